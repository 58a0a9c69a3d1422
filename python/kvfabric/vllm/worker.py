"""The worker side of the connector: publishes the worker's KV cache as a segment, pulls the KV
of decode requests in the background, and reports prefill holds the scheduler released.

A pull reads every block table of the plan (plan.py) from the prefill workers that hold the
layers and heads, all at once, then reads the hold's state word from the prefill's mailbox: a
pull is used only if the hold was still alive after it ended (the prefill clears the word
before it frees the blocks). It is reported done only once nothing of it is in flight, so vLLM
never frees or reuses blocks a transfer still writes. A pull that fails (peer gone, key
refused, timeout, hold ended) is reported failed and vLLM recomputes the request.

Pulls run to completion in the binding's Rust runtime (``kvfabric.Pulls``): no Python thread,
event loop or GIL between a pull's start and its end, since vLLM's engine thread keeps the GIL
busy between steps (an asyncio loop needing it at every answer added milliseconds per pull).
The model's forward never waits on them; each step collects the finished ones. Nothing here
imports vLLM (its GPU test runs where vLLM is not installed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvfabric
from kvfabric import _trace

from .layout import LayerSpec, WorkerLayout, worker_layout
from .mailbox import state_offset
from .metadata import KVFabricMetadata, Load, WorkerSegments
from .params import Handover
from .plan import Incompatible, MissingBlocks, Plan, block_pairs, make_plan
from .registration import WORD, Registration
from .stats import KVFabricStats

log = logging.getLogger("vllm.kvfabric")

try:
    from opentelemetry import trace as _otel

    _tracer = _otel.get_tracer("kvfabric.vllm")
except ImportError:  # traces are optional
    _tracer = None


class _Span:
    """An OpenTelemetry span from a pull's start to its end, when the SDK is there; its
    context travels with the pull's batches to the agents."""

    def __init__(self, name: str, **attrs: Any) -> None:
        self.span: Any = _tracer.start_span(name, attributes=attrs) if _tracer else None

    def headers(self) -> tuple[str | None, str | None]:
        if self.span is None:
            return None, None
        with _otel.use_span(self.span, end_on_exit=False):
            return _trace.headers()

    def set(self, key: str, value: Any) -> None:
        if self.span is not None:
            self.span.set_attribute(key, value)

    def end(self) -> None:
        if self.span is not None:
            self.span.end()


@dataclass
class _InFlight:
    """A started pull: its hold-check word, where it comes from, its span."""

    word: int
    engine: str
    queued_at: float
    span: _Span


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
        self.scratch_buffer = kvfabric.HostBuffer((2 + settings.max_held_requests) * WORD)
        self.scratch = np.frombuffer(self.scratch_buffer, dtype=np.uint8)
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
        self.pulls = self.client.pulls()
        self.inflight: dict[str, _InFlight] = {}

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
            self._start(req_id, load, time.perf_counter())

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

    def _start(self, req_id: str, load: Load, queued_at: float) -> None:
        """Every table of the plan at once, then the hold's state word from the prefill's
        mailbox (the pull counts only if the hold outlived it), all in the binding's runtime."""
        h = load.handover
        attrs = {"kvfabric.request": req_id, "kvfabric.src.engine": h.engine}
        span = _Span("kvfabric.connector.load", **attrs)
        try:
            reads = self._reads(load)
            with self.lock:
                if not self.free_words:
                    raise LoadFailed("busy", "too many pulls in flight to check their holds")
                j = self.free_words.pop()
        except LoadFailed as e:
            self._finish(req_id, h.engine, span, 0, (e.reason, str(e)), None)
            return
        at = (2 + j) * WORD
        assert self.registration is not None and self.registration.segment is not None
        check = kvfabric.columns(
            [len(self.regions)], [at], [0], [state_offset(h.slots, h.slot)], [WORD]
        )
        tp, ts = span.headers()
        try:
            self.pulls.start(
                req_id,
                self.registration.segment,
                reads,
                self.settings.load_timeout_s,
                (h.mailbox.name, h.mailbox.key, check),
                self.settings.ack_timeout_s,
                self.scratch_buffer,
                at,
                h.nonce,
                tp,
                ts,
            )
        except Exception as e:  # noqa: BLE001 - never leave vLLM waiting for a pull that is not
            with self.lock:
                self.free_words.append(j)
            self._finish(req_id, h.engine, span, 0, (type(e).__name__.lower(), str(e)), None)
            return
        # Collected on this thread (transfer_results), so never before this line.
        self.inflight[req_id] = _InFlight(j, h.engine, queued_at, span)

    def _reads(self, load: Load) -> list[tuple[str, int, kvfabric.Ops]]:
        """(peer segment, key, block table) per table of the plan that moves blocks."""
        h = load.handover
        plan = self._plan(h)
        if len(load.groups) != len(h.block_ids):
            raise LoadFailed("invalid_params", "no blocks to load into")
        out = []
        for table in plan.tables:
            try:
                local, remote = block_pairs(plan, table, load.groups[table.group])
            except MissingBlocks as e:
                raise LoadFailed("invalid_params", str(e)) from None
            if len(local) == 0:
                continue
            peer = h.workers[table.peer]
            ops = kvfabric.block_table(table.local_planes, table.remote_planes, local, remote)
            out.append((peer.name, peer.key, ops))
        return out

    def _collect(self) -> None:
        """Records the pulls the runtime finished since the last step."""
        for p in self.pulls.take():
            f = self.inflight.pop(p.id, None)
            if f is None:
                continue
            with self.lock:
                self.free_words.append(f.word)
            failure = (p.reason, p.detail) if p.reason else None
            self._finish(p.id, f.engine, f.span, p.bytes, failure, (f.queued_at, p))

    def _finish(
        self,
        req_id: str,
        engine: str,
        span: _Span,
        nbytes: int,
        failure: tuple[str, str] | None,
        timing: tuple[float, Any] | None,
    ) -> None:
        reason = failure[0] if failure else ""
        ms = (time.perf_counter() - timing[0]) * 1e3 if timing else 0.0
        if failure:
            span.set("error", failure[1])
            log.warning(
                "kvfabric: pulling %s from %s failed (%s), vLLM recomputes: %s",
                req_id,
                engine,
                reason,
                failure[1],
            )
        else:
            span.set("kvfabric.bytes", nbytes)
        span.end()
        with self.lock:
            self.stats.record_load(nbytes, ms, reason)
            self.done.add(req_id)
            if reason:
                self.failed.add(req_id)
        if not reason and timing:
            p = timing[1]
            # Where the time went: the reads, the hold check after them, and the wait for the
            # engine's next step to see the pull done (the rest).
            log.info(
                "kvfabric: pulled %s: %d B from %s in %.2f ms (read %.2f, hold check %.2f; "
                "done at %.6f)",
                req_id,
                nbytes,
                engine,
                ms,
                p.read_us / 1e3,
                p.check_us / 1e3,
                time.time(),
            )

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        self._collect()
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
        # Pulls still in flight end within their deadlines in the runtime; their memory stays
        # registered until then (the segment keeps it alive).
        if self.registration is not None:
            self.registration.close()
