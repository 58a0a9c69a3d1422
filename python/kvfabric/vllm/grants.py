"""Per-request read rights on a prefill instance's KV cache: agent holds.

A prefill hands a decode (and the routers between them) no segment key: for each request it
asks its agent for a hold on every worker's segment — the request's block ids over every plane
of a block (``WorkerLayout.block_planes``), for the lease — and hands out the holds' keys. The
agents refuse any read outside those blocks, or after the hold ended: the prefill ends the
holds (``end``) before vLLM may reuse the blocks, and ``end`` returns once no read under them
can still land. A renewal from a waiting decode extends them.

The instance's workers must be registered with the agent the scheduler talks to (one node per
instance); holds on segments of another agent are refused and the request is not handed over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import kvfabric

from .layout import WorkerLayout
from .registration import Loop

log = logging.getLogger("vllm.kvfabric")

# How long a failed EndHold leaves blocks held past the hold's own expiry (the agents' clocks
# and the readers' margins are within this).
END_MARGIN_S = 0.5


class Grants:
    def __init__(self, client: kvfabric.Client, loop: Loop, settings: Any) -> None:
        self.client = client
        self.loop = loop
        self.settings = settings
        self.workers: list[tuple[kvfabric.Segment, list[tuple[int, int, int, int]]]] = []

    def set_workers(self, segments: Sequence[tuple[str, int]], layouts: Sequence[WorkerLayout]):
        """The instance's worker segments (name, key) and their layouts, in the order the
        params list them."""
        self.workers = [
            (kvfabric.Segment(name, key), layout.block_planes())
            for (name, key), layout in zip(segments, layouts, strict=True)
        ]

    def create(self, block_ids: Sequence[int], ttl: float) -> list[int]:
        """One hold per worker on ``block_ids``; their keys. Raises KvfabricError (the agent
        refused or is unreachable) or TimeoutError; holds made before a failure are ended."""

        async def all_of() -> list[int]:
            got = await asyncio.gather(
                *(
                    self.client.create_hold_async(seg, planes, list(block_ids), ttl)
                    for seg, planes in self.workers
                ),
                return_exceptions=True,
            )
            errors = [g for g in got if isinstance(g, BaseException)]
            if errors:
                made = [
                    (s, k)
                    for (s, _), k in zip(self.workers, got, strict=True)
                    if isinstance(k, int)
                ]
                await self._end(made)
                raise errors[0]
            return [int(k) for k in got]

        return self.loop.run(all_of()).result(self.settings.call_timeout_s)

    def extend(self, keys: Sequence[int], ttl: float) -> Future[Any]:
        async def all_of() -> None:
            await asyncio.gather(
                *(
                    self.client.extend_hold_async(seg, key, ttl)
                    for (seg, _), key in zip(self.workers, keys, strict=True)
                )
            )

        return self.loop.run(all_of())

    def end(self, keys: Sequence[int], expires_at: float) -> Future[float]:
        """Ends the holds; the future gives the monotonic time after which the blocks may be
        reused: now when every reader's agent confirmed, else the holds' expiry (plus a
        margin)."""
        pairs = [(seg, key) for (seg, _), key in zip(self.workers, keys, strict=True)]

        async def ended() -> float:
            if await self._end(pairs):
                return time.monotonic()
            return expires_at + END_MARGIN_S

        return self.loop.run(ended())

    async def _end(self, pairs: Sequence[tuple[kvfabric.Segment, int]]) -> bool:
        got = await asyncio.gather(
            *(self.client.end_hold_async(seg, key) for seg, key in pairs),
            return_exceptions=True,
        )
        failed = [g for g in got if isinstance(g, BaseException)]
        for e in failed:
            log.warning("kvfabric: ending a hold: %s (its blocks wait for its expiry)", e)
        return not failed
