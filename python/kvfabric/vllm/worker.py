"""The worker side of the connector: publishes the KV cache as a segment, pulls the blocks of
decode requests in the background, and holds prefill blocks until the decode side acknowledges
the pull (a nonce written into this worker's mailbox segment) or the lease runs out.

Pulls run on one asyncio loop in a thread of their own; the model's forward never waits on them.
A pull that fails (peer gone, key refused, timeout) reports its blocks through
``get_block_ids_with_load_errors``, so vLLM recomputes them (``kv_load_failure_policy:
recompute``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from typing import Any

import numpy as np

import kvfabric
from kvfabric.errors import KvfabricError

from .layout import tensor_layout
from .metadata import Hold, KVFabricMetadata, Load, WorkerSegments
from .stats import KVFabricStats

log = logging.getLogger("vllm.kvfabric")

try:
    from opentelemetry import trace as _otel

    _tracer = _otel.get_tracer("kvfabric.vllm")
except ImportError:  # traces are optional
    _tracer = None

_WORD = 8


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


class Worker:
    def __init__(self, vllm_config: Any, settings: Any, num_blocks: int, rank: int) -> None:
        self.settings = settings
        self.rank = rank
        self.num_blocks = num_blocks
        base = settings.segment_prefix or vllm_config.kv_transfer_config.engine_id
        self.kv_name = f"{base}.tp{rank}"
        self.acks_name = f"{self.kv_name}.acks"
        self.kv_key = secrets.randbits(63) | 1
        self.acks_key = secrets.randbits(63) | 1
        self.client = kvfabric.Client(settings.socket_dir, timeout=settings.call_timeout_s)
        self.regions: list[Any] = []
        self.planes: list[tuple[int, int, int, int]] = []
        self.kv: Any = None
        self.acks: Any = None
        # Mailbox: the first half is written by decode workers (acknowledgements for our holds);
        # the second half is where our own acknowledgements are staged before we send them.
        # Two scratch words at the end: the keeper's probe copies one onto the other.
        self.mailbox = kvfabric.host_array((2 * settings.max_held_requests + 2) * _WORD)
        self.inbox = self.mailbox[: settings.max_held_requests * _WORD].view(np.uint64)
        self.outbox = self.mailbox[
            settings.max_held_requests * _WORD : 2 * settings.max_held_requests * _WORD
        ].view(np.uint64)
        self.next_out = 0
        self.lock = threading.Lock()
        self.holds: dict[str, tuple[Hold, float]] = {}
        self.finished_seen: set[str] = set()
        self.done_loads: set[str] = set()
        self.failed_blocks: set[int] = set()
        self.pass_errors: set[int] = set()
        self.stats = KVFabricStats()
        self.pending: set[Any] = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="kvfabric-loads", daemon=True
        )
        self.thread.start()
        self.stop = threading.Event()
        self.keeper = threading.Thread(
            target=self._keep_registered, name="kvfabric-keeper", daemon=True
        )

    # -- registration ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """One region per storage the layers live in (vLLM may put several layers in one
        allocation); each layer's planes are offsets into its storage's region."""
        layers = list(kv_caches.values())
        by_storage: dict[int, list[Any]] = {}
        for t in layers:
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        for group in by_storage.values():
            t = group[0]
            if (
                t.device.type == "cpu"
                and kvfabric.HostBuffer.containing(t.untyped_storage().data_ptr(), 1) is None
            ):
                # vLLM allocated the CPU cache in ordinary memory; the agent can only map
                # kvfabric's (a memfd), so the storage moves there, in place.
                kvfabric.move_to_host_buffer(*group)
        index: dict[int, int] = {}
        planes: list[tuple[int, int, int, int]] = []
        for i, t in enumerate(layers):
            storage = t.untyped_storage()
            if storage.data_ptr() not in index:
                index[storage.data_ptr()] = len(self.regions)
                self.regions.append(kvfabric.storage_tensor(t))
            layout = tensor_layout(f"kv_caches[{i}]", t, self.num_blocks)
            planes += layout.block_table(
                index[storage.data_ptr()], t.data_ptr() - storage.data_ptr()
            )
        self.planes = planes
        self._register()
        self.keeper.start()

    def _register(self) -> None:
        """Registers whichever of the two segments this agent lacks; ALREADY_EXISTS while the
        registry still holds a previous agent's entry for it (until that agent's lease ends)."""
        if self.kv is None:
            self.kv = self.client.register(self.kv_name, self.regions, key=self.kv_key)
        if self.acks is None:
            self.acks = self.client.register(self.acks_name, [self.mailbox], key=self.acks_key)
        log.info(
            "kvfabric: registered %s (%d regions, %d planes) and %s",
            self.kv_name,
            len(self.regions),
            len(self.planes),
            self.acks_name,
        )

    def _registered(self) -> bool:
        """Whether the agent still has our segments: an 8-byte copy within the mailbox, which
        only the agent that registered it can do (a registry entry left by a restarted agent
        of the same name does not count). UNAVAILABLE: the agent is down, nothing to do yet."""
        scratch = 2 * len(self.inbox) * _WORD
        try:
            self.client.read(
                self.acks,
                self.acks_name,
                self.acks_key,
                [0],
                [scratch],
                [0],
                [scratch + _WORD],
                [_WORD],
                timeout=self.settings.ack_timeout_s,
            )
            return True
        except KvfabricError as e:
            return getattr(e, "code", "") in ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    def _keep_registered(self) -> None:
        """An agent restarted forgets our segments: register them again (same names, same
        keys, so params already handed out stay valid)."""
        while not self.stop.wait(self.settings.check_interval_s):
            if self._registered():
                continue
            self.kv = self.acks = None
            while not self.stop.is_set():
                try:
                    self._register()
                    break
                except KvfabricError as e:
                    log.info("kvfabric: re-registering after an agent restart: %s", e)
                    self.stop.wait(self.settings.check_interval_s)

    def handshake(self) -> WorkerSegments:
        return WorkerSegments(
            kv=self.kv_name,
            kv_key=self.kv_key,
            acks=self.acks_name,
            acks_key=self.acks_key,
            layout=tuple(self.planes),
        )

    # -- per step ---------------------------------------------------------------------------

    def start_load_kv(self, meta: KVFabricMetadata) -> None:
        now = time.monotonic()
        with self.lock:
            for req_id, hold in meta.holds.items():
                self.holds[req_id] = (hold, now + hold.lease_s)
        for req_id, load in meta.loads.items():
            fut = asyncio.run_coroutine_threadsafe(self._load(req_id, load), self.loop)
            self.pending.add(fut)
            fut.add_done_callback(self.pending.discard)

    async def _load(self, req_id: str, load: Load) -> None:
        peer = load.remote[self.rank]
        ok, nbytes = True, 0
        t0 = time.perf_counter()
        with _Span(
            "kvfabric.connector.load",
            **{
                "kvfabric.request": req_id,
                "kvfabric.src.segment": peer["kv"],
                "kvfabric.blocks": len(load.local_block_ids),
            },
        ) as span:
            if load.local_block_ids:
                planes = self.planes
                try:
                    done = await self.client.read_blocks_async(
                        self.kv,
                        peer["kv"],
                        int(peer["kv_key"], 16),
                        planes,
                        planes,
                        np.asarray(load.local_block_ids, dtype=np.uint64),
                        np.asarray(load.remote_block_ids, dtype=np.uint64),
                        timeout=self.settings.load_timeout_s,
                    )
                    nbytes = done.bytes
                    span.set("kvfabric.bytes", nbytes)
                    span.set("kvfabric.transport", done.transport)
                except Exception as e:  # noqa: BLE001 - any failure: vLLM recomputes
                    ok = False
                    span.set("error", str(e))
                    log.warning(
                        "kvfabric: pulling %s from %s failed, vLLM recomputes: %s",
                        req_id,
                        peer["kv"],
                        e,
                    )
            ms = (time.perf_counter() - t0) * 1e3
            loaded_at = time.time()
            # Done (and its failed blocks known) before the acknowledgement goes out, so vLLM
            # schedules the request without waiting on it.
            with self.lock:
                if load.local_block_ids:
                    self.stats.record_load(nbytes, ms, ok)
                if not ok:
                    self.failed_blocks.update(load.local_block_ids)
                self.done_loads.add(req_id)
            if ok and load.local_block_ids:
                log.info(
                    "kvfabric: pulled %s: %d blocks, %d B from %s in %.2f ms (done at %.6f)",
                    req_id,
                    len(load.local_block_ids),
                    nbytes,
                    peer["kv"],
                    ms,
                    loaded_at,
                )
            await self._acknowledge(peer, load)

    async def _acknowledge(self, peer: dict, load: Load) -> None:
        """Tells the prefill worker it may free the request's blocks: our nonce into its slot."""
        with self.lock:
            j = self.next_out
            self.next_out = (j + 1) % len(self.outbox)
        self.outbox[j] = load.nonce
        base = len(self.inbox) * _WORD
        try:
            await self.client.write_async(
                self.acks,
                peer["acks"],
                int(peer["acks_key"], 16),
                [0],
                [base + j * _WORD],
                [0],
                [load.slot * _WORD],
                [_WORD],
                timeout=self.settings.ack_timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - the lease frees the blocks anyway
            log.info(
                "kvfabric: acknowledging to %s failed (its lease frees the blocks): %s",
                peer["acks"],
                e,
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        with self.lock:
            self.finished_seen |= finished_req_ids
            sending = set()
            for req_id, (hold, expiry) in list(self.holds.items()):
                if req_id not in self.finished_seen:
                    continue
                acked = int(self.inbox[hold.slot]) == hold.nonce
                if acked or now >= expiry:
                    if acked:
                        self.stats.data["acked"] += 1
                    else:
                        self.stats.data["lease_expired"] += 1
                        log.info("kvfabric: lease of %s ran out; its blocks are freed", req_id)
                    self.inbox[hold.slot] = 0
                    del self.holds[req_id]
                    self.finished_seen.discard(req_id)
                    sending.add(req_id)
            recving, self.done_loads = self.done_loads, set()
            self.pass_errors |= self.failed_blocks
            self.failed_blocks = set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self.lock:
            errors, self.pass_errors = self.pass_errors, set()
        return errors

    def get_stats(self) -> KVFabricStats | None:
        with self.lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, KVFabricStats()
        return out

    def shutdown(self) -> None:
        self.stop.set()
        for fut in list(self.pending):
            fut.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        for seg in (self.kv, self.acks):
            if seg is not None:
                try:
                    self.client.deregister(seg)
                except KvfabricError as e:
                    log.info("kvfabric: deregistering %s: %s", seg.name, e)
