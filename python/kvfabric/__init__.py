"""kvfabric: move KV-cache blocks between the workers of a disaggregated LLM deployment.

A worker talks to its node's agent over the agent's Unix socket::

    import kvfabric
    agent = kvfabric.Client("/var/run/kvfabric")
    kv = kvfabric.host_array(1 << 20)
    me = agent.register("decode-0", [kv])
    agent.read_blocks(me, "prefill-0", prefill_key,
                      local_planes=[(0, 0, 4096, 4096)], remote_planes=[(0, 0, 4096, 4096)],
                      local_block_ids=np.arange(8), remote_block_ids=np.arange(8))

See python/README.md; ``kvfabric.vllm`` holds the vLLM V1 KV connector.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from . import _native, _trace
from ._native import (
    Ops,
    Pulled,
    Pulls,
    Region,
    Segment,
    SegmentEvent,
    Transfer,
    Watch,
    block_table,
    columns,
)
from .errors import AgentError, InvalidArgument, KvfabricError
from .memory import (
    CudaRegion,
    HostBuffer,
    host_array,
    host_tensor,
    move_to_host_buffer,
    region_of,
    storage_tensor,
)

__version__ = _native.__version__

__all__ = [
    "AgentError",
    "Client",
    "CudaRegion",
    "HostBuffer",
    "InvalidArgument",
    "KvfabricError",
    "Ops",
    "Plane",
    "Pulled",
    "Pulls",
    "Region",
    "Segment",
    "SegmentEvent",
    "Transfer",
    "Watch",
    "block_table",
    "columns",
    "default_socket_dir",
    "host_array",
    "host_tensor",
    "move_to_host_buffer",
    "region_of",
    "storage_tensor",
]

#: ``(region, base, stride, block_bytes)``: block ``i`` of a plane is ``block_bytes`` at
#: ``base + i * stride`` of region ``region``.
Plane = tuple[int, int, int, int]


def default_socket_dir() -> str:
    """``$KVFABRIC_SOCKET_DIR``, else the agent's default ``/var/run/kvfabric``."""
    return os.environ.get("KVFABRIC_SOCKET_DIR") or "/var/run/kvfabric"


class Client:
    """A connection to the node's agent (its sockets are in ``socket_dir``).

    Every call waits at most ``timeout`` seconds for the agent (a batch: its own timeout plus
    that), with the GIL released; failures raise :class:`AgentError` carrying the gRPC code and
    the agent's message. Batches carry the caller's OpenTelemetry trace context when a span is
    active. ``*_async`` variants return awaitables for asyncio.
    """

    def __init__(self, socket_dir: str | os.PathLike[str] | None = None, *, timeout: float = 60.0):
        self._native = _native.Client(os.fspath(socket_dir or default_socket_dir()), timeout)

    @property
    def socket_dir(self) -> str:
        return os.fspath(self._native.socket_dir)

    def register(self, name: str, memory: Sequence[Any], key: int | None = None) -> Segment:
        """Publishes ``memory`` (HostBuffers, numpy arrays or torch tensors in kvfabric host
        memory, CUDA tensors, CudaRegions) as segment ``name``, one region each in order.
        ``key``: what readers must present (None: the agent picks one; it is ``segment.key``).
        The segment keeps the objects alive."""
        regions = [region_of(m, i) for i, m in enumerate(memory)]
        return self._native.register(name, regions, key, list(memory))

    def pulls(self) -> Pulls:
        """Pulls that run to completion without Python (no event loop, no GIL in their path):
        ``start`` them, ``take`` the finished ones."""
        return Pulls(self._native)

    def deregister(self, segment: Segment) -> None:
        """Unpublishes ``segment``; returns once no transfer uses its memory."""
        self._native.deregister(segment)

    def submit(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        ops: Ops,
        *,
        write: bool = False,
        timeout: float | None = None,
        checksum: bool = False,
    ) -> Transfer:
        """Moves a prepared op list (``columns``/``block_table``): pulls from ``remote`` into
        ``local``, or pushes when ``write``."""
        tp, ts = _trace.headers()
        return self._native.submit(local, remote, remote_key, write, ops, timeout, checksum, tp, ts)

    async def submit_async(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        ops: Ops,
        *,
        write: bool = False,
        timeout: float | None = None,
        checksum: bool = False,
    ) -> Transfer:
        """:meth:`submit`, awaitable."""
        tp, ts = _trace.headers()
        return await self._native.submit_async(
            local, remote, remote_key, write, ops, timeout, checksum, tp, ts
        )

    def read(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_regions: Any,
        local_offsets: Any,
        remote_regions: Any,
        remote_offsets: Any,
        lengths: Any,
        **options: Any,
    ) -> Transfer:
        """Pulls op ``i``: ``lengths[i]`` bytes from ``remote_offsets[i]`` of region
        ``remote_regions[i]`` of ``remote`` to ``local_offsets[i]`` of ``local_regions[i]``.
        The five are integer arrays (numpy, or anything ``numpy.asarray`` takes)."""
        ops = columns(local_regions, local_offsets, remote_regions, remote_offsets, lengths)
        return self.submit(local, remote, remote_key, ops, **options)

    def write(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_regions: Any,
        local_offsets: Any,
        remote_regions: Any,
        remote_offsets: Any,
        lengths: Any,
        **options: Any,
    ) -> Transfer:
        """:meth:`read`'s ops the other way: local → remote."""
        ops = columns(local_regions, local_offsets, remote_regions, remote_offsets, lengths)
        return self.submit(local, remote, remote_key, ops, write=True, **options)

    async def read_async(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_regions: Any,
        local_offsets: Any,
        remote_regions: Any,
        remote_offsets: Any,
        lengths: Any,
        **options: Any,
    ) -> Transfer:
        ops = columns(local_regions, local_offsets, remote_regions, remote_offsets, lengths)
        return await self.submit_async(local, remote, remote_key, ops, **options)

    async def write_async(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_regions: Any,
        local_offsets: Any,
        remote_regions: Any,
        remote_offsets: Any,
        lengths: Any,
        **options: Any,
    ) -> Transfer:
        ops = columns(local_regions, local_offsets, remote_regions, remote_offsets, lengths)
        return await self.submit_async(local, remote, remote_key, ops, write=True, **options)

    def read_blocks(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_planes: Sequence[Plane],
        remote_planes: Sequence[Plane],
        local_block_ids: Any,
        remote_block_ids: Any,
        **options: Any,
    ) -> Transfer:
        """Pulls block ``remote_block_ids[k]`` of every remote plane into block
        ``local_block_ids[k]`` of the matching local plane (planes: :data:`Plane`)."""
        ops = block_table(local_planes, remote_planes, local_block_ids, remote_block_ids)
        return self.submit(local, remote, remote_key, ops, **options)

    def write_blocks(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_planes: Sequence[Plane],
        remote_planes: Sequence[Plane],
        local_block_ids: Any,
        remote_block_ids: Any,
        **options: Any,
    ) -> Transfer:
        """:meth:`read_blocks` the other way: local blocks pushed into the remote ones."""
        ops = block_table(local_planes, remote_planes, local_block_ids, remote_block_ids)
        return self.submit(local, remote, remote_key, ops, write=True, **options)

    async def read_blocks_async(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_planes: Sequence[Plane],
        remote_planes: Sequence[Plane],
        local_block_ids: Any,
        remote_block_ids: Any,
        **options: Any,
    ) -> Transfer:
        ops = block_table(local_planes, remote_planes, local_block_ids, remote_block_ids)
        return await self.submit_async(local, remote, remote_key, ops, **options)

    async def write_blocks_async(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        local_planes: Sequence[Plane],
        remote_planes: Sequence[Plane],
        local_block_ids: Any,
        remote_block_ids: Any,
        **options: Any,
    ) -> Transfer:
        ops = block_table(local_planes, remote_planes, local_block_ids, remote_block_ids)
        return await self.submit_async(local, remote, remote_key, ops, write=True, **options)

    def create_hold(
        self,
        segment: Segment,
        planes: Sequence[Plane],
        block_ids: Any,
        ttl: float,
    ) -> int:
        """Grants reads of blocks ``block_ids`` of every plane (:data:`Plane`, regions indexed
        in ``segment``) for ``ttl`` seconds (0.001 to 3600), and returns the hold's key.

        Hand the key (not ``segment.key``) to the one reader the blocks are for: it passes it as
        ``remote_key`` and may then read those blocks of those planes, nothing else (no writes),
        until the hold expires or :meth:`end_hold` returns. ``segment`` must be registered
        through this client's agent (``AgentError`` ``NOT_FOUND`` naming the agent that serves
        it otherwise). A block outside its region raises ``AgentError`` ``INVALID_ARGUMENT``
        naming the field (``planes[3].stride``); too many holds ``RESOURCE_EXHAUSTED``."""
        return self._native.create_hold(segment, list(planes), block_ids, ttl)

    async def create_hold_async(
        self,
        segment: Segment,
        planes: Sequence[Plane],
        block_ids: Any,
        ttl: float,
    ) -> int:
        """:meth:`create_hold`, awaitable."""
        return await self._native.create_hold_async(segment, list(planes), block_ids, ttl)

    def extend_hold(self, segment: Segment, hold_key: int, ttl: float) -> float:
        """Moves a live hold's expiry to ``ttl`` seconds from now, never earlier than it was
        (a reader's agent may keep the grant until then); returns the seconds it now has.
        ``AgentError`` ``NOT_FOUND`` once it has ended or expired."""
        return self._native.extend_hold(segment, hold_key, ttl)

    async def extend_hold_async(self, segment: Segment, hold_key: int, ttl: float) -> float:
        """:meth:`extend_hold`, awaitable."""
        return await self._native.extend_hold_async(segment, hold_key, ttl)

    def end_hold(self, segment: Segment, hold_key: int, *, timeout: float | None = None) -> None:
        """Ends a hold; returns once no read under it can land, so its blocks may be reused.

        The agent waits up to ``timeout`` seconds (None: 5) for the readers' agents to drop it.
        If one does not confirm, ``AgentError`` ``DEADLINE_EXCEEDED`` says how long the hold
        still lives ("expires in N ms"): do not reuse its blocks before then (or call again).
        A hold that already ended or expired is no error."""
        self._native.end_hold(segment, hold_key, timeout)

    async def end_hold_async(
        self, segment: Segment, hold_key: int, *, timeout: float | None = None
    ) -> None:
        """:meth:`end_hold`, awaitable."""
        await self._native.end_hold_async(segment, hold_key, timeout)

    def status(self) -> dict[str, Any]:
        """The agent's status document (agents, segments, connections, registry)."""
        return json.loads(self._native.status_json())

    async def status_async(self) -> dict[str, Any]:
        return json.loads(await self._native.status_json_async())

    def watch(self) -> Watch:
        """Segment events, starting with every segment known now: ``for ev in watch``,
        ``watch.next(timeout)``, or ``async for ev in watch``."""
        return self._native.watch()
