"""The one error type of the peer benchmark: what failed, named by kind and field."""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    CONFIG = "config"
    ENGINE = "engine"
    CONTROL = "control"
    TIMEOUT = "timeout"
    VERIFY = "verify"
    UNSUPPORTED = "unsupported"


class PeerError(Exception):
    """A typed failure; `field` names the input or engine call that caused it."""

    def __init__(self, kind: Kind, field: str, reason: str) -> None:
        super().__init__(f"{kind.value}: {field}: {reason}")
        self.kind = kind
        self.field = field
        self.reason = reason


def truncated(value: object, limit: int = 80) -> str:
    """A value as echoed in an error: never more than `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def config(field: str, value: object, reason: str) -> PeerError:
    return PeerError(Kind.CONFIG, field, f"{truncated(value)} {reason}")
