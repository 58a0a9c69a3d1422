"""Exceptions the kvfabric client raises."""

from __future__ import annotations


class KvfabricError(Exception):
    """Base of every kvfabric error."""


class AgentError(KvfabricError):
    """The agent refused or failed a call, or could not be reached.

    ``code`` is the gRPC status name (``"NOT_FOUND"``, ``"PERMISSION_DENIED"``, ``"UNAVAILABLE"``,
    ``"DEADLINE_EXCEEDED"``, ...), ``grpc_code`` its number, ``message`` the agent's own text and
    ``call`` the API call (``"Submit"``, ``"RegisterSegment"``, ..., ``"connect"``).
    """

    def __init__(self, text: str, call: str, code: str, grpc_code: int, message: str) -> None:
        super().__init__(text)
        self.call = call
        self.code = code
        self.grpc_code = grpc_code
        self.message = message


class InvalidArgument(KvfabricError, ValueError):
    """An argument was refused before anything was sent: ``field`` names it, ``value`` echoes
    it (truncated)."""

    def __init__(self, text: str, field: str, value: str) -> None:
        super().__init__(text)
        self.field = field
        self.value = value


class Unsupported(KvfabricError):
    """What is asked is a case kvfabric does not implement; the message says which and what
    to do instead. Raised at start, never mid-request."""
