"""The scheduler side of the connector: which requests pull KV (decode), which hold their blocks
for a decode to pull (prefill), the ``kv_transfer_params`` between the two (params.py), and
the holds' life through the instance's mailbox (mailbox.py).

Prefill: a request handed over keeps its blocks under a hold (a mailbox slot and a random
nonce) until the decode acknowledges it or the lease ends; a decode that waits renews the
lease. The hold's ``state`` word is cleared before the workers are told to release the blocks,
so a decode's check after its pull sees any end of the hold.

Decode: a request whose params can be read here is reported as externally computed; its
workers pull the blocks vLLM allocated for the tokens that are not local prefix-cache hits;
the acknowledgement goes once every worker has finished (vLLM's aggregated
``finished_recving``). A request that will not be pulled (no params of ours, another model,
an ended lease, ...) is recomputed; why is said once in the log and counted in the metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, KvfabricError
from .grants import END_MARGIN_S, Grants
from .layout import WorkerLayout, worker_from_wire
from .mailbox import Mailbox
from .metadata import KVFabricMetadata, Load, WorkerSegments
from .params import VERSION, Handover, Segment, handover_of
from .plan import GroupBlocks, Incompatible, Reason, make_plan
from .stats import KVFabricStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvfabric")

# A pull is not started this close to the end of the hold's lease (the check after the pull
# catches the rest: a clock between instances can be off by this much without recomputes).
EXPIRY_MARGIN_S = 0.5
MAX_LOGGED_REASONS = 256


def _free_at(ending: Future[float], expiry: float) -> float:
    """When the blocks of an ended hold may be reused (grants.Grants.end)."""
    try:
        return ending.result(0)
    except Exception:  # noqa: BLE001 - the holds' expiry bounds every read anyway
        return expiry + END_MARGIN_S


# The "window" of a state group (Mamba / linear attention): one state per request, not tokens.
STATE = -1
# What a state group's loads span: every position vLLM gave the request a block at.
ALL_TOKENS = 1 << 62


def _window_start(computed: int, window: int) -> int:
    """The first token the next one attends to in a sliding-window group, once ``computed``
    tokens are (vLLM's ``get_num_skipped_tokens``: the blocks before it are freed or null)."""
    return max(0, computed - window + 1) if window > 0 else 0


@dataclass(frozen=True)
class EngineInfo:
    """What the scheduler side needs of vLLM's config, as plain values (connector.py fills
    it): the engine's id and segment prefix, its scheduler block size and parallel sizes, the
    transfer KV cache groups (their index among vLLM's groups and sliding window in tokens, 0
    for full attention, ``STATE`` for a Mamba / linear-attention state), how many trailing
    prompt tokens a prefill leaves to the decode, and the id of vLLM's null block."""

    engine_id: str
    prefix: str
    block_size: int
    tp_size: int
    pp_size: int
    groups: tuple[tuple[int, int], ...] = ((0, 0),)
    backoff: int = 0
    null_block: int = 0


@dataclass
class _Hold:
    """A request of this prefill whose blocks a decode may read: its mailbox slot and nonce,
    the agent holds' keys (grants.py), and where it is in its life: ended (the state word
    cleared, the agent holds ending), released (no read can land: vLLM may free the blocks),
    reported to vLLM."""

    slot: int
    nonce: int
    keys: list[int]
    started: float
    expiry: float
    renewals: int = 0
    announced: bool = False
    ending: Future[float] | None = None
    released: bool = False
    reported: bool = False


@dataclass
class _Lease:
    """A hold of another instance this decode still means to read: renewed until pulled."""

    mailbox: Segment
    slots: int
    slot: int
    nonce: int
    interval: float
    next_at: float
    count: int = 0
    expires_at: float = 0.0


@dataclass
class _Pending:
    handover: Handover | None = None
    error: Incompatible | None = None
    renewed_until: list[float] = field(default_factory=lambda: [0.0])


class Scheduler:
    def __init__(self, info: EngineInfo, settings: Any, mailbox: Mailbox) -> None:
        self.info = info
        self.settings = settings
        self.mailbox = mailbox
        self.local: dict[tuple[int, int], WorkerSegments] = {}
        self.local_layouts: list[WorkerLayout] = []
        self.free_slots = list(range(mailbox.slots - 1, -1, -1))
        self.holds: dict[str, _Hold] = {}
        self.by_slot: dict[int, str] = {}
        self.loads: dict[str, Load] = {}
        self.releases: set[str] = set()
        self.pending: dict[str, _Pending] = {}
        self.leases: dict[str, _Lease] = {}
        self.awaiting: set[str] = set()
        self.plans: dict[str, Incompatible | None] = {}
        self.logged: set[tuple[str, str]] = set()
        self.stats = KVFabricStats()
        self.grants = Grants(mailbox.client, mailbox.loop, settings)

    # -- start -----------------------------------------------------------------------------

    def bind_null_block(self, block_id: int) -> None:
        """vLLM's null block: what a group's freed positions point at (named -1 in params)."""
        self.info = dataclasses.replace(self.info, null_block=block_id)

    def set_workers(self, metadata: dict[tuple[int, int], WorkerSegments]) -> None:
        self.local = dict(sorted(metadata.items()))
        self.local_layouts = [
            worker_from_wire(w.layout, f"worker[{k}]") for k, w in self.local.items()
        ]
        self.grants.set_workers([(w.kv, w.kv_key) for w in self.local.values()], self.local_layouts)

    def _workers_wire(self, keys: list[int]) -> tuple[list[Any], list[Any]]:
        """The workers' segments with the request's hold keys (never the segments' own keys),
        and their layouts."""
        segs = [Segment(w.kv, k).wire() for w, k in zip(self.local.values(), keys, strict=True)]
        return segs, [w.layout for w in self.local.values()]

    # -- decode side -----------------------------------------------------------------------

    def _pending(self, request: Request) -> _Pending | None:
        """The parsed handover of a decode request (or why it cannot be read), once per
        request."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        got = self.pending.get(request.request_id)
        if got is None:
            got = self.pending[request.request_id] = _Pending()
            try:
                got.handover = handover_of(params)
            except InvalidArgument as e:
                got.error = Incompatible(Reason.INVALID_PARAMS, str(e))
            if got.handover is not None:
                got.error = self._compatible(got.handover) or self._covered(got.handover)
                got.renewed_until[0] = got.handover.expires_at
        return got

    def _compatible(self, h: Handover) -> Incompatible | None:
        """Whether every local worker can read this prefill's layout (made once per layout)."""
        if h.layout_id not in self.plans:
            if len(self.plans) >= 64:
                self.plans.pop(next(iter(self.plans)))
            err = None
            try:
                if len(h.block_ids) != len(self.info.groups):
                    raise Incompatible(
                        Reason.LAYERS,
                        f"{len(h.block_ids)} KV cache groups there, {len(self.info.groups)} here",
                    )
                for w in self.local_layouts:
                    make_plan(w, list(h.layouts))
            except Incompatible as e:
                err = e
            self.plans[h.layout_id] = err
        return self.plans[h.layout_id]

    def _covered(self, h: Handover) -> Incompatible | None:
        """Whether the remote block ids name a block for every position the decode reads
        (every one in full-attention groups, the window's in sliding-window ones)."""
        rb = h.layouts[0].block_size
        n = -(-h.tokens // rb)
        for i, ((_, window), ids) in enumerate(zip(self.info.groups, h.block_ids, strict=True)):
            if window == STATE:
                # The request's state: the blocks the prefill named, none of them freed.
                if not ids or any(b < 0 for b in ids):
                    return Incompatible(
                        Reason.INVALID_PARAMS, f"remote_block_ids[{i}]: no state block {ids[:8]}"
                    )
                continue
            first = _window_start(h.tokens, window) // rb
            if len(ids) < n or any(b < 0 for b in ids[first:n]):
                return Incompatible(
                    Reason.INVALID_PARAMS,
                    f"remote_block_ids[{i}]: {len(ids)} ids, some freed, for {h.tokens} tokens "
                    f"of blocks of {rb}",
                )
        return None

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._back_off(request)
            return
        p = self._pending(request)
        if p is None or p.handover is None:
            return
        h = p.handover
        interval = max(h.lease_s / 3, 0.05)
        self.leases[request.request_id] = _Lease(
            h.mailbox, h.slots, h.slot, h.nonce, interval, time.monotonic() + interval,
            expires_at=h.expires_at,
        )  # fmt: skip

    def _back_off(self, request: Request) -> None:
        """Prefill side: leave the last ``backoff`` prompt tokens to the decode (a
        sliding-window group frees the token the decode's recompute of the last prompt token
        still reads)."""
        n = self.info.backoff
        params = request.kv_transfer_params
        if (
            not n
            or params.get("_kvfabric_backed_off")
            or request.num_prompt_tokens <= n
            or request.prompt_token_ids is None
        ):
            return
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        request.max_tokens = 1
        params["_kvfabric_backed_off"] = True

    def _not_pulled(self, request: Request, reason: Reason, detail: str) -> None:
        self.stats.not_pulled(reason.value)
        key = (reason.value, str((request.kv_transfer_params or {}).get("remote_engine_id")))
        if key not in self.logged:
            if len(self.logged) < MAX_LOGGED_REASONS:
                self.logged.add(key)
            log.warning(
                "kvfabric: request %s is recomputed, not pulled from %s: %s "
                "(said once per prefill engine and reason; counted in "
                "vllm:kvfabric_not_pulled_total)",
                request.request_id,
                key[1],
                f"{reason.value}: {detail}",
            )
        else:
            log.debug("kvfabric: request %s not pulled: %s", request.request_id, detail)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        p = self._pending(request)
        if p is None or p.error is not None or p.handover is None:
            return 0, False
        if time.time() > p.renewed_until[0] - EXPIRY_MARGIN_S:
            return 0, False
        count = min(p.handover.tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        p = self._pending(request)
        params["do_remote_prefill"] = False  # one pull per request
        if p is None:
            return
        if num_external_tokens > 0 and p.handover is not None and p.error is None:
            groups = self._groups(blocks, p.handover, num_external_tokens)
            self.loads[request.request_id] = Load(p.handover, groups)
            self.awaiting.add(request.request_id)
            return
        if p.handover is None or p.error is not None:
            err = p.error or Incompatible(Reason.INVALID_PARAMS, "no handover")
            self._not_pulled(request, err.reason, err.detail)
        elif time.time() > p.renewed_until[0] - EXPIRY_MARGIN_S:
            self._not_pulled(request, Reason.EXPIRED, "the prefill's lease on its blocks ended")
        else:
            self.stats.count("local_hits")
        self._done_with(request.request_id, ack=True)

    def _groups(
        self, blocks: KVCacheBlocks, h: Handover, num_external_tokens: int
    ) -> tuple[GroupBlocks, ...]:
        """Per transfer group: the positions vLLM allocated new blocks for (not prefix-cache
        hits, not null blocks outside a sliding window) and the tokens to load."""
        out = []
        for (g, window), remote in zip(self.info.groups, h.block_ids, strict=True):
            group = blocks.blocks[g]
            hits = sum(1 for b in group if b.block_hash is not None or b.is_null)
            end = min(h.tokens, hits * self.info.block_size + num_external_tokens)
            end = min(end, (hits + len(group)) * self.info.block_size)
            positions, ids = [], []
            for i, b in enumerate(group):
                if b.block_hash is None and not b.is_null:
                    positions.append(i)
                    ids.append(b.block_id)
            if window == STATE:
                first, end = 0, ALL_TOKENS
            else:
                first = _window_start(end, window)
            out.append(GroupBlocks(tuple(positions), tuple(ids), remote, first, end))
        return tuple(out)

    def _done_with(self, req_id: str, ack: bool) -> None:
        """Stops renewing the request's hold and (``ack``) tells the prefill to free it."""
        p = self.pending.pop(req_id, None)
        self.leases.pop(req_id, None)
        self.awaiting.discard(req_id)
        if ack and p is not None and p.handover is not None:
            h = p.handover
            if self.mailbox.ack(h.mailbox, h.slots, h.slot, h.nonce) is None:
                self.stats.count("ack_failures")

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            if req_id in self.awaiting:
                self._done_with(req_id, ack=True)
        for req_id in output.finished_sending or ():
            hold = self.holds.pop(req_id, None)
            if hold is not None:
                self.by_slot.pop(hold.slot, None)
                self.free_slots.append(hold.slot)

    def _renew(self, now: float) -> None:
        due: dict[Segment, list[tuple[str, _Lease]]] = {}
        for req_id, lease in self.leases.items():
            if lease.next_at <= now:
                due.setdefault(lease.mailbox, []).append((req_id, lease))
        for mailbox, leases in due.items():
            for _, lease in leases:
                lease.count += 1
                lease.next_at = now + lease.interval
            fut = self.mailbox.renew_holds(
                mailbox, leases[0][1].slots, [(x.slot, x.nonce, x.count) for _, x in leases]
            )
            if fut is None:
                continue
            sent_at = time.time()
            until = [
                (self.pending[r].renewed_until, x.interval * 3)
                for r, x in leases
                if r in self.pending
            ]

            def renewed(f: Any, until: list = until, sent_at: float = sent_at) -> None:
                if f.cancelled() or f.exception() is not None:
                    return
                for cell, lease_s in until:
                    cell[0] = max(cell[0], sent_at + lease_s)

            fut.add_done_callback(renewed)
            self.stats.count("renewals", len(leases))

    # -- prefill side ----------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # A decode request that never got blocks (aborted while queued): tell the
            # prefill now rather than at the end of the lease.
            params["do_remote_prefill"] = False
            self._done_with(request.request_id, ack=True)
            return False, None
        if request.request_id in self.pending or request.request_id in self.leases:
            # A decode request whose load is in flight acknowledges when the workers are done
            # (finished_recving); any other stops renewing now.
            if request.request_id not in self.awaiting:
                self._done_with(request.request_id, ack=False)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        groups = [list(block_ids[g]) for g, _ in self.info.groups]
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ) or not any(groups):
            return False, None
        if len(self.local) != self.info.tp_size * self.info.pp_size:
            log.warning(
                "kvfabric: no worker segments known; request %s is not handed over",
                request.request_id,
            )
            return False, None
        if not self.free_slots:
            self.stats.count("holds_refused")
            log.warning(
                "kvfabric: %d requests already hold blocks (max_held_requests); %s is not "
                "handed over",
                len(self.holds),
                request.request_id,
            )
            return False, None
        null = self.info.null_block
        lease_s = self.settings.lease_s
        ids = sorted({b for g in groups for b in g if b != null})
        try:
            keys = self.grants.create(ids, lease_s)
        except (KvfabricError, TimeoutError) as e:
            self.stats.count("holds_refused")
            log.warning(
                "kvfabric: the agent refused a hold on %s's blocks; not handed over: %s",
                request.request_id,
                e,
            )
            return False, None
        slot = self.free_slots.pop()
        nonce = secrets.randbits(63) | 1
        now = time.monotonic()
        self.holds[request.request_id] = _Hold(slot, nonce, keys, now, now + lease_s)
        self.by_slot[slot] = request.request_id
        self.mailbox.hold(slot, nonce)
        workers, layouts = self._workers_wire(keys)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[-1 if b == null else b for b in g] for g in groups],
            "remote_engine_id": self.info.engine_id,
            "remote_request_id": request.request_id,
            # NixlConnector's side channel, which kvfabric does not use; routers copy them.
            "remote_host": self.settings.advertise_host,
            "remote_port": 0,
            "tp_size": self.info.tp_size,
            "pp_size": self.info.pp_size,
            "remote_num_tokens": request.num_computed_tokens,
            "kvfabric": {
                "v": VERSION,
                "workers": workers,
                "layouts": layouts,
                "mailbox": self.mailbox.segment.wire(),
                "slots": self.mailbox.slots,
                "slot": slot,
                "nonce": f"{nonce:016x}",
                "lease_s": lease_s,
                # Wall clock: the decode, on another machine, stops starting pulls then.
                "expires_at": time.time() + lease_s,
                "tokens": request.num_computed_tokens,
            },
        }

    def _check_holds(self, finished: set[str], now: float) -> None:
        """Acknowledged, renewed and expired holds. A hold ends at once (its state word
        cleared, its agent holds ending); its blocks are released once the agents confirmed
        no read under it can land (or its expiry passed) and vLLM has told the workers the
        request finished."""
        cap = self.settings.max_hold_s
        lease_s = self.settings.lease_s
        for req_id, hold in self.holds.items():
            if hold.reported:
                continue
            if req_id in finished:
                hold.announced = True
            if hold.ending is None:
                if self.mailbox.acked(hold.slot, hold.nonce):
                    self.stats.count("acked")
                    self._end(hold)
                else:
                    n = self.mailbox.renewal(hold.slot, hold.nonce)
                    if n > hold.renewals:
                        hold.renewals = n
                        expiry = min(now + lease_s, hold.started + cap)
                        if expiry > hold.expiry:
                            self.grants.extend(hold.keys, expiry - now)
                            hold.expiry = expiry
                    if now >= hold.expiry:
                        self.stats.count("lease_expired")
                        log.info("kvfabric: lease of %s ran out; its blocks are freed", req_id)
                        self._end(hold)
            if hold.ending is not None and not hold.released and hold.ending.done():
                hold.released = now >= _free_at(hold.ending, hold.expiry)
            if hold.released and hold.announced:
                self.releases.add(req_id)

    def _end(self, hold: _Hold) -> None:
        # The state word first: a pull that checks it from now on is not used.
        self.mailbox.release(hold.slot)
        hold.ending = self.grants.end(hold.keys, hold.expiry)

    # -- every step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        now = time.monotonic()
        finished = set(getattr(scheduler_output, "finished_req_ids", None) or ())
        self._check_holds(finished, now)
        self._renew(now)
        meta = KVFabricMetadata(loads=self.loads, releases=self.releases)
        for req_id in self.releases:
            # Told once: vLLM frees the blocks when every worker has reported them; the slot
            # comes back then (update_connector_output).
            self.holds[req_id].reported = True
        self.loads, self.releases = {}, set()
        return meta

    def get_stats(self) -> KVFabricStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVFabricStats()
        return out

    def shutdown(self) -> None:
        self.mailbox.close()
