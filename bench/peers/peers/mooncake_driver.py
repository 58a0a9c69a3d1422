"""Mooncake Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda` on the CPU, `-cuda13` on a
GPU) in its P2P handshake mode (no metadata server): the target registers its pool and publishes
`host:rpc_port` and the pool's address; each batch is one `batch_transfer_async` of per-block
address lists, waited for with `get_batch_transfer_status`.

The engine picks its transport when it starts, from what the machine has and its environment:
tcp with no RDMA device (`MC_FORCE_TCP=1` keeps it there on a GPU machine); the same-GPU path is
its intra-node NVLink transport (`MC_INTRANODE_NVLINK=1`, protocol `nvlink_intra`, CUDA builds
only). It has no same-node host-memory transport in these builds."""

from __future__ import annotations

import os
import time
from importlib import metadata
from typing import Any

import numpy as np

from .engine import JsonDict, Link
from .errors import Kind, PeerError
from .pool import CudaPool, HostPool
from .work import Batch

name = "mooncake"
_DISTRIBUTIONS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine",
)


def version() -> str:
    for dist in _DISTRIBUTIONS:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


# Its tcp transport rejects a transfer ("queue-full", and the batch fails) once more than 1024
# wait for one peer; a row keeps 4 batches of up to 4096 block ops queued. 65535 (its largest)
# is what deployments of it on tcp set.
TCP_QUEUES = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}


def _protocol(link: Link) -> str:
    for key, value in TCP_QUEUES.items():
        os.environ.setdefault(key, value)
    if link.transport == "tcp":
        os.environ["MC_FORCE_TCP"] = "1"
        return "tcp"
    if link.transport == "ipc":
        os.environ["MC_INTRANODE_NVLINK"] = "1"
        return "nvlink_intra"
    raise PeerError(
        Kind.UNSUPPORTED,
        "transport",
        f"mooncake has no same-node {link.transport} transport for host memory "
        "(its builds here carry tcp and rdma)",
    )


def _engine(link: Link) -> Any:
    protocol = _protocol(link)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    ret = engine.initialize(link.host, "P2PHANDSHAKE", protocol, "")
    if ret != 0:
        raise PeerError(Kind.ENGINE, "mooncake initialize", f"returned {ret} ({protocol})")
    return engine


def _location(pool: HostPool | CudaPool) -> str:
    return "cpu:0" if pool.device is None else f"cuda:{pool.device}"


class Target:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.engine = _engine(link)
        self.addr = 0

    def expose(self, pool: HostPool | CudaPool) -> JsonDict:
        ret = self.engine.register_memory(pool.addr, pool.nbytes, _location(pool))
        if ret != 0:
            raise PeerError(Kind.ENGINE, "mooncake register_memory", f"returned {ret}")
        self.addr = pool.addr
        return {"session": f"{self.link.host}:{self.engine.get_rpc_port()}", "addr": pool.addr}

    def withdraw(self) -> None:
        if self.addr:
            self.engine.unregister_memory(self.addr)
            self.addr = 0

    def close(self) -> None:
        self.withdraw()


class Initiator:
    def __init__(self, link: Link) -> None:
        self.engine = _engine(link)
        from mooncake.engine import TransferOpcode

        self.opcodes = {"read": TransferOpcode.Read, "write": TransferOpcode.Write}
        self.addr = 0
        self.session = ""
        self.remote = 0
        self.block = 0

    def attach(self, pool: HostPool | CudaPool, remote: JsonDict) -> None:
        ret = self.engine.register_memory(pool.addr, pool.nbytes, _location(pool))
        if ret != 0:
            raise PeerError(Kind.ENGINE, "mooncake register_memory", f"returned {ret}")
        self.addr = pool.addr
        self.session = str(remote["session"])
        self.remote = int(remote["addr"])
        self.block = pool.block_size

    def submit(self, op: str, batch: Batch) -> object:
        local = (self.addr + batch.local * self.block).tolist()
        remote = (self.remote + batch.remote * self.block).tolist()
        lengths = np.full(len(local), self.block, dtype=np.int64).tolist()
        batch_id = self.engine.batch_transfer_async(
            self.session, local, remote, lengths, self.opcodes[op]
        )
        if batch_id == 0:
            raise PeerError(Kind.ENGINE, "mooncake batch_transfer_async", "returned 0 (failed)")
        return batch_id

    def wait(self, handle: object, deadline: float) -> None:
        # get_batch_transfer_status blocks until done, failed or past the engine's own timeout
        # (MC_TRANSFER_TIMEOUT, 30 s by default, below our deadline).
        ret = self.engine.get_batch_transfer_status([handle])
        if ret != 0:
            raise PeerError(Kind.ENGINE, "mooncake get_batch_transfer_status", f"returned {ret}")
        if time.monotonic() > deadline:
            raise PeerError(Kind.TIMEOUT, "mooncake batch", "done only after its deadline")

    def detach(self) -> None:
        if self.addr:
            self.engine.unregister_memory(self.addr)
            self.addr = 0

    def close(self) -> None:
        self.detach()
