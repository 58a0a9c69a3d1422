"""DLSlime (PyPI `dlslime`) through its TCP endpoint: each side is a `TcpEndpoint` with its pool
registered as a memory region; the initiator connects with the target's `endpoint_info()` and
moves a batch as `read`/`write` of (local region, remote region, remote offset, local offset,
length) assignments, one per block.

Its future tracks completion in a 32-bit mask, one bit per assignment (`1 << i`), so a future of
more than 32 assignments can report done while some are still moving: a batch is therefore
posted as futures of at most 32 assignments and is done when all of them are. Each assignment
takes a TCP connection of its own, connected synchronously inside `read`/`write` when none is
idle (here: thousands per row, left in TIME-WAIT), which is why the namespaces it runs in need
`net.ipv4.tcp_tw_reuse=1`, and why a 16 or 64 KiB row (4096 or 1024 connections a batch) can
stall in its accept backlog of 64.

The PyPI wheel is built without CUDA (`_BUILD_NVLINK` false, no cudart): it has no GPU path, and
GPU memory handed to its TCP endpoint would be read as host memory — refused here instead."""

from __future__ import annotations

import time
from importlib import metadata
from typing import Any

from .engine import JsonDict, Link
from .errors import Kind, PeerError
from .pool import CudaPool, HostPool
from .work import Batch

name = "dlslime"
_MASK_BITS = 32


def version() -> str:
    return metadata.version("dlslime")


def _endpoint(link: Link) -> Any:
    import dlslime

    if link.device is not None and not getattr(dlslime._slime_c, "_BUILD_NVLINK", False):
        raise PeerError(
            Kind.UNSUPPORTED,
            "location",
            f"dlslime {version()} is built without CUDA: no GPU memory path",
        )
    if link.transport != "tcp":
        raise PeerError(
            Kind.UNSUPPORTED,
            "transport",
            f"dlslime {version()} has no same-node {link.transport} endpoint in this "
            "wheel (tcp, rdma only)",
        )
    return dlslime.TcpEndpoint(link.host, 0)


def _region(seq: int) -> str:
    return f"kv{seq}"


class Target:
    """One endpoint for the process, a region of a new name per row: its memory pool has no
    deregistration, refuses a name twice, and in 0.1.23 `shutdown()` of an endpoint that has
    served sessions closed other descriptors of the process too (our control socket), so no
    endpoint is shut down before the process ends."""

    def __init__(self, link: Link) -> None:
        self.endpoint = _endpoint(link)
        self.seq = 0

    def expose(self, pool: HostPool | CudaPool) -> JsonDict:
        self.seq += 1
        name = _region(self.seq)
        if self.endpoint.register_memory_region(name, pool.addr, 0, pool.nbytes) < 0:
            raise PeerError(Kind.ENGINE, "dlslime register_memory_region", f"refused {name}")
        info: JsonDict = self.endpoint.endpoint_info()
        return {"endpoint": info, "region": name}

    def withdraw(self) -> None:
        """Nothing to undo: the region's name is not used again."""

    def close(self) -> None:
        """The endpoint ends with the process (see the class)."""


class Initiator:
    def __init__(self, link: Link) -> None:
        self.endpoint = _endpoint(link)
        self.seq = 0
        self.local = -1
        self.remote = -1
        self.block = 0

    def attach(self, pool: HostPool | CudaPool, remote: JsonDict) -> None:
        self.seq += 1
        self.local = self.endpoint.register_memory_region(
            _region(self.seq), pool.addr, 0, pool.nbytes
        )
        if self.local < 0:
            raise PeerError(Kind.ENGINE, "dlslime register_memory_region", "refused")
        info = remote["endpoint"]
        self.endpoint.connect(info)
        if not self.endpoint.is_connected():
            raise PeerError(
                Kind.ENGINE,
                "dlslime connect",
                f"cannot reach {info.get('host')}:{info.get('port')}",
            )
        name = str(remote["region"])
        self.remote = self.endpoint.register_remote_memory_region(name, info["mr_info"][name])
        self.block = pool.block_size

    def submit(self, op: str, batch: Batch) -> object:
        bs = self.block
        assign = [
            (self.local, self.remote, r * bs, loc * bs, bs)
            for loc, r in zip(batch.local.tolist(), batch.remote.tolist(), strict=True)
        ]
        post = self.endpoint.read if op == "read" else self.endpoint.write
        return [post(assign[i : i + _MASK_BITS]) for i in range(0, len(assign), _MASK_BITS)]

    def wait(self, handle: object, deadline: float) -> None:
        futures: list[Any] = handle  # type: ignore[assignment]
        for f in futures:
            status = f.wait_for(max(deadline - time.monotonic(), 0.0))
            if status is None:
                raise PeerError(Kind.TIMEOUT, "dlslime batch", "not done by its deadline")
            if status != 0:
                raise PeerError(Kind.ENGINE, "dlslime future", f"status {status}")

    def detach(self) -> None:
        """Nothing to undo (see Target)."""

    def close(self) -> None:
        """The endpoint ends with the process (see Target)."""
