"""NIXL (PyPI `nixl`, UCX backend). Each side is one `nixl_agent`; the target's metadata travels
over our control channel (`get_agent_metadata` → `add_remote_agent`). Both pools are prepared
once per row as one descriptor per block (`prep_xfer_dlist`), and each batch is one
`make_prepped_xfer` over block indices, posted with `transfer` and polled with
`check_xfer_state` — the way NIXL's own examples and vLLM's connector drive it.

Which UCX transports carry the data is UCX's environment, set here per link before the agent is
created: tcp (UCX_TLS=tcp), shm (shared memory and cross-memory attach), ipc (cuda_ipc with
zero-copy reads; see `env_for`)."""

from __future__ import annotations

import base64
import os
import time
import uuid
from importlib import metadata
from typing import Any

import numpy as np

from .engine import JsonDict, Link
from .errors import Kind, PeerError
from .pool import CudaPool, HostPool
from .work import Batch

name = "nixl"


def env_for(link: Link) -> dict[str, str]:
    if link.transport == "tcp":
        tls = "tcp" if link.device is None else "tcp,cuda_copy"
        env = {"UCX_TLS": tls}
        if link.host.startswith("127."):
            # UCX leaves the loopback interface out of its tcp devices unless it is named.
            env["UCX_NET_DEVICES"] = "lo"
        return env
    if link.transport == "shm":
        # NIXL's UCX backend cannot start on shared memory alone (its setup needs tcp); with
        # both, UCX moves the data through shared memory and cross-memory attach.
        return {"UCX_TLS": "sm,tcp"}
    if link.transport == "ipc":
        # With its defaults UCX never reads through CUDA IPC on one GPU (it falls back to a
        # tcp "software emulation" when it sees no NVLink); these two make it.
        return {
            "UCX_TLS": "cuda_ipc,cuda_copy,tcp",
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
            "NIXL_UCX_SGL_ENABLE": "1",
        }
    raise PeerError(Kind.UNSUPPORTED, "transport", f"nixl has no {link.transport} path here")


def version() -> str:
    return metadata.version("nixl")


def _agent(link: Link, role: str, backend: str) -> Any:
    if backend == "UCX":
        os.environ.update(env_for(link))
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"kvf-{role}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[backend]))


def _mem(pool: HostPool | CudaPool) -> str:
    return "DRAM" if pool.device is None else "VRAM"


def _blocks(pool: HostPool | CudaPool, base: int) -> np.ndarray:
    """One (address, length, device) descriptor per block."""
    n = pool.blocks
    descs = np.empty((n, 3), dtype=np.int64)
    descs[:, 0] = base + np.arange(n, dtype=np.int64) * pool.block_size
    descs[:, 1] = pool.block_size
    descs[:, 2] = pool.device or 0
    return descs


class Target:
    backend = "UCX"

    def __init__(self, link: Link) -> None:
        self.agent = _agent(link, "target", self.backend)
        self.reg: Any = None

    def expose(self, pool: HostPool | CudaPool) -> JsonDict:
        self.reg = self.agent.register_memory(
            [(pool.addr, pool.nbytes, pool.device or 0, "")], _mem(pool)
        )
        return {
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "addr": pool.addr,
            "mem": _mem(pool),
            "device": pool.device or 0,
        }

    def withdraw(self) -> None:
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None

    def close(self) -> None:
        self.withdraw()


class Initiator:
    backend = "UCX"

    def __init__(self, link: Link) -> None:
        self.agent = _agent(link, "initiator", self.backend)
        self.reg: Any = None
        self.peer = ""
        self.local: Any = None
        self.remote: Any = None

    def attach(self, pool: HostPool | CudaPool, remote: JsonDict) -> None:
        self.reg = self.agent.register_memory(
            [(pool.addr, pool.nbytes, pool.device or 0, "")], _mem(pool)
        )
        self.peer = self.agent.add_remote_agent(base64.b64decode(remote["metadata"]))
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _blocks(pool, pool.addr), _mem(pool)
        )
        theirs = _blocks(pool, int(remote["addr"]))
        theirs[:, 2] = int(remote["device"])
        self.remote = self.agent.prep_xfer_dlist(self.peer, theirs, str(remote["mem"]))
        self.agent.make_connection(self.peer)

    def submit(self, op: str, batch: Batch) -> object:
        handle = self.agent.make_prepped_xfer(
            op.upper(),
            self.local,
            batch.local.astype(np.int32),
            self.remote,
            batch.remote.astype(np.int32),
        )
        if self.agent.transfer(handle) == "ERR":
            handle.release()
            raise PeerError(Kind.ENGINE, "nixl transfer", "posting the batch failed")
        return handle

    def wait(self, handle: object, deadline: float) -> None:
        h: Any = handle
        while True:
            state = self.agent.check_xfer_state(h)
            if state == "DONE":
                h.release()
                return
            if state == "ERR":
                h.release()
                raise PeerError(Kind.ENGINE, "nixl check_xfer_state", "ERR")
            if time.monotonic() > deadline:
                # Still in flight: NIXL refuses to release it; the row's pool is kept.
                raise PeerError(Kind.TIMEOUT, "nixl batch", "not done by its deadline")

    def detach(self) -> None:
        for dl in (self.local, self.remote):
            if dl is not None:
                dl.release()
        self.local = self.remote = None
        if self.peer:
            self.agent.remove_remote_agent(self.peer)
            self.peer = ""
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None

    def close(self) -> None:
        self.detach()
