"""The worker side of the connector: publishes the worker's KV cache as a segment, pulls the KV
of decode requests in the background, and reports prefill holds the scheduler released.

A pull reads every block table of the plan (plan.py) from the prefill workers that hold the
layers and heads, all at once, then reads the hold's state word from the prefill's mailbox: a
pull is used only if the hold was still alive after it ended (the prefill clears the word
before it frees the blocks). It is reported done only once nothing of it is in flight, so vLLM
never frees or reuses blocks a transfer still writes. A pull that fails (peer gone, key
refused, timeout, hold ended) is reported failed and vLLM recomputes the request.

Pulls run on one asyncio loop in a thread of their own; the model's forward never waits on
them. Nothing here imports vLLM (its GPU test runs where vLLM is not installed).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvfabric

from .layout import LayerSpec, WorkerLayout, worker_layout
from .mailbox import state_offset
from .metadata import KVFabricMetadata, Load, WorkerSegments
from .params import Handover
from .plan import Incompatible, MissingBlocks, Plan, block_pairs, make_plan
from .registration import WORD, Loop, Registration
from .stats import KVFabricStats

log = logging.getLogger("vllm.kvfabric")

try:
    from opentelemetry import trace as _otel

    _tracer = _otel.get_tracer("kvfabric.vllm")
except ImportError:  # traces are optional
    _tracer = None


class _Span:
    """An OpenTelemetry span when the SDK is there, else nothing."""

    def __init__(self, name: str, **attrs: Any) -> None:
        self.cm = _tracer.start_as_current_span(name, attributes=attrs) if _tracer else None
        self.span: Any = None

    def __enter__(self) -> _Span:
        if self.cm is not None:
            self.span = self.cm.__enter__()
        return self

    def set(self, key: str, value: Any) -> None:
        if self.span is not None:
            self.span.set_attribute(key, value)

    def __exit__(self, *exc: Any) -> None:
        if self.cm is not None:
            self.cm.__exit__(*exc)


@dataclass(frozen=True)
class WorkerInfo:
    """What the worker side needs of vLLM's config, as plain values (connector.py fills it)."""

    prefix: str
    pp: int
    tp_rank: int
    tp_size: int
    num_blocks: int
    block_size: int
    layers: dict[str, LayerSpec]


class LoadFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Worker:
    def __init__(self, info: WorkerInfo, settings: Any) -> None:
        self.info = info
        self.settings = settings
        self.kv_name = f"{info.prefix}.pp{info.pp}.tp{info.tp_rank}"
        import secrets

        self.kv_key = secrets.randbits(63) | 1
        self.client = kvfabric.Client(settings.socket_dir, timeout=settings.call_timeout_s)
        # Two probe words for the registration keeper, then one word per pull in flight for
        # the hold check.
        self.scratch = kvfabric.host_array((2 + settings.max_held_requests) * WORD)
        self.free_words = list(range(settings.max_held_requests - 1, -1, -1))
        self.regions: list[Any] = []
        self.layout: WorkerLayout | None = None
        self.registration: Registration | None = None
        self.plans: dict[str, Plan | Incompatible] = {}
        self.lock = threading.Lock()
        self.sending: set[str] = set()
        self.done: set[str] = set()
        self.failed: set[str] = set()
        self.stats = KVFabricStats()
        self.loop = Loop("kvfabric-loads")

    # -- registration ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any], views: Sequence[Any] = ()) -> None:
        """The KV cache's regions and layout (layout.worker_layout), then the scratch region,
        registered as one segment. ``views``: other tensors over the same memory (what the
        model's layers hold), which move with it."""
        by_storage: dict[int, dict[int, Any]] = {}
        for t in kv_caches.values():
            if t.device.type == "cpu":
                by_storage.setdefault(t.untyped_storage().data_ptr(), {})[id(t)] = t
        for t in views:
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() in by_storage:
                by_storage[t.untyped_storage().data_ptr()][id(t)] = t
        for tensors in by_storage.values():
            group = list(tensors.values())
            t = group[0]
            if kvfabric.HostBuffer.containing(t.untyped_storage().data_ptr(), 1) is None:
                # vLLM allocated the CPU cache in ordinary memory; the agent can only map
                # kvfabric's (a memfd), so the storage moves there, in place.
                kvfabric.move_to_host_buffer(*group)
        info = self.info
        self.regions, self.layout = worker_layout(
            kv_caches,
            info.layers,
            info.num_blocks,
            (info.pp, info.tp_rank, info.tp_size, info.block_size),
        )
        self.registration = Registration(
            self.client,
            self.kv_name,
            [*self.regions, self.scratch],
            self.kv_key,
            (len(self.regions), 0),
            self.settings.check_interval_s,
            self.settings.call_timeout_s,
        )

    def handshake(self) -> WorkerSegments:
        assert self.layout is not None
        return WorkerSegments(kv=self.kv_name, kv_key=self.kv_key, layout=self.layout.wire())

    # -- per step ---------------------------------------------------------------------------

    def start_load_kv(self, meta: KVFabricMetadata) -> None:
        if meta.releases:
            with self.lock:
                self.sending |= meta.releases
        for req_id, load in meta.loads.items():
            self.loop.run(self._load(req_id, load, time.perf_counter()))

    def _plan(self, h: Handover) -> Plan:
        got = self.plans.get(h.layout_id)
        if got is None:
            assert self.layout is not None
            try:
                got = make_plan(self.layout, list(h.layouts))
            except Incompatible as e:
                got = e
            if len(self.plans) >= 64:
                self.plans.pop(next(iter(self.plans)))
            self.plans[h.layout_id] = got
        if isinstance(got, Incompatible):
            raise LoadFailed(got.reason.value, str(got))
        return got

    async def _load(self, req_id: str, load: Load, queued_at: float) -> None:
        h = load.handover
        t0 = time.perf_counter()
        t_read = t0
        nbytes, reason = 0, ""
        with _Span(
            "kvfabric.connector.load",
            **{"kvfabric.request": req_id, "kvfabric.src.engine": h.engine},
        ) as span:
            try:
                nbytes = await self._pull(load)
                t_read = time.perf_counter()
                await self._check_hold(h)
                span.set("kvfabric.bytes", nbytes)
            except LoadFailed as e:
                reason = e.reason
                span.set("error", str(e))
                log.warning(
                    "kvfabric: pulling %s from %s failed (%s), vLLM recomputes: %s",
                    req_id,
                    h.engine,
                    e.reason,
                    e,
                )
            t1 = time.perf_counter()
            ms = (t1 - t0) * 1e3
            with self.lock:
                self.stats.record_load(nbytes, ms, reason)
                self.done.add(req_id)
                if reason:
                    self.failed.add(req_id)
            if not reason:
                # Where the time went: waiting for this loop's thread (the engine's own threads
                # hold the GIL), the reads, the hold check after them.
                log.info(
                    "kvfabric: pulled %s: %d B from %s in %.2f ms (queued %.2f, read %.2f, "
                    "hold check %.2f; done at %.6f)",
                    req_id,
                    nbytes,
                    h.engine,
                    ms,
                    (t0 - queued_at) * 1e3,
                    (t_read - t0) * 1e3,
                    (t1 - t_read) * 1e3,
                    time.time(),
                )

    async def _pull(self, load: Load) -> int:
        """Every table of the plan at once; returns once none is in flight."""
        h = load.handover
        plan = self._plan(h)
        if len(load.groups) != len(h.block_ids):
            raise LoadFailed("invalid_params", "no blocks to load into")
        calls = []
        for table in plan.tables:
            try:
                local, remote = block_pairs(plan, table, load.groups[table.group])
            except MissingBlocks as e:
                raise LoadFailed("invalid_params", str(e)) from None
            if len(local) == 0:
                continue
            peer = h.workers[table.peer]
            assert self.registration is not None and self.registration.segment is not None
            calls.append(
                self.client.read_blocks_async(
                    self.registration.segment,
                    peer.name,
                    peer.key,
                    table.local_planes,
                    table.remote_planes,
                    local,
                    remote,
                    timeout=self.settings.load_timeout_s,
                )
            )
        done = await asyncio.gather(*calls, return_exceptions=True)
        errors = [e for e in done if isinstance(e, BaseException)]
        if errors:
            code = getattr(errors[0], "code", "") or type(errors[0]).__name__
            raise LoadFailed(str(code).lower(), str(errors[0]))
        return sum(t.bytes for t in done)

    async def _check_hold(self, h: Handover) -> None:
        """Reads the hold's state word from the prefill's mailbox: the pull counts only if the
        hold outlived it."""
        with self.lock:
            if not self.free_words:
                raise LoadFailed("busy", "too many pulls in flight to check their holds")
            j = self.free_words.pop()
        try:
            at = (2 + j) * WORD
            assert self.registration is not None and self.registration.segment is not None
            try:
                await self.client.read_async(
                    self.registration.segment,
                    h.mailbox.name,
                    h.mailbox.key,
                    [len(self.regions)],
                    [at],
                    [0],
                    [state_offset(h.slots, h.slot)],
                    [WORD],
                    timeout=self.settings.ack_timeout_s,
                )
            except Exception as e:  # noqa: BLE001 - any failure: the pull is not trusted
                code = getattr(e, "code", "") or type(e).__name__
                raise LoadFailed(str(code).lower(), f"checking the hold: {e}") from None
            got = int(self.scratch[at : at + WORD].view(np.uint64)[0])
            if got != h.nonce:
                raise LoadFailed("hold_ended", "the prefill's hold ended before the pull did")
        finally:
            with self.lock:
                self.free_words.append(j)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        with self.lock:
            out = (self.sending, self.done, self.failed)
            self.sending, self.done, self.failed = set(), set(), set()
        return out

    def get_stats(self) -> KVFabricStats | None:
        with self.lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, KVFabricStats()
        return out

    def shutdown(self) -> None:
        self.loop.stop(self.settings.load_timeout_s + 1)
        if self.registration is not None:
            self.registration.close()
