"""What a peer driver implements: a target that exposes a pool, and an initiator that moves
batches of blocks between its own pool and the target's through the engine's own API."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from .pool import CudaPool, HostPool
from .work import Batch

JsonDict = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Link:
    """How the two sides reach each other: `transport` is tcp, shm (same node, host memory) or
    ipc (same node, GPU memory); `host` is this side's address for engines that bind one."""

    transport: str
    host: str
    device: int | None


class Target(Protocol):
    def expose(self, pool: HostPool | CudaPool) -> JsonDict:
        """Registers `pool` with the engine; returns what an initiator needs to reach it."""
        ...

    def withdraw(self) -> None: ...

    def close(self) -> None: ...


class Initiator(Protocol):
    def attach(self, pool: HostPool | CudaPool, remote: JsonDict) -> None: ...

    def submit(self, op: str, batch: Batch) -> object:
        """Starts one batch; returns what `wait` takes."""
        ...

    def wait(self, handle: object, deadline: float) -> None:
        """Returns once the batch has completed; raises PeerError on failure or past `deadline`
        (time.monotonic())."""
        ...

    def detach(self) -> None: ...

    def close(self) -> None: ...


class Driver(Protocol):
    name: str

    def version(self) -> str: ...

    def target(self, link: Link) -> Target: ...

    def initiator(self, link: Link) -> Initiator: ...
