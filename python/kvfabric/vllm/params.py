"""The ``kv_transfer_params`` a prefill instance hands out and a decode instance reads.

The request protocol is NixlConnector's, so P/D routers written for it route kvfabric
deployments unchanged: a prefill request with ``{"do_remote_decode": true}`` finishes with
``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
``tp_size``, ... and the router passes them to the decode request. kvfabric's own part is the
``kvfabric`` entry (a :class:`Handover`): the prefill workers' segments with their keys and KV
layouts, the prefill engine's mailbox with the hold's slot and nonce, the lease, and how many
tokens' KV is held. ``remote_block_ids`` has one list per KV cache group, indexed by block
position in the request, ``-1`` where the prefill already freed the block (outside a sliding
window).

Everything here arrives from a router, so it is parsed strictly: a malformed entry is an
:class:`~kvfabric.errors.InvalidArgument` naming the field, and the decode recomputes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .layout import MAX_WORKERS, WorkerLayout, _int, _list, _str, fingerprint, invalid
from .layout import worker_from_wire as _worker

VERSION = 1
MAX_GROUPS = 64
MAX_BLOCKS_PER_GROUP = 1 << 20


@dataclass(frozen=True)
class Segment:
    """A segment of another instance and the key it was registered with."""

    name: str
    key: int

    def wire(self) -> list[Any]:
        return [self.name, f"{self.key:016x}"]


@dataclass(frozen=True)
class Handover:
    """What a decode needs to pull one request's KV from a prefill instance."""

    engine: str
    request: str
    workers: tuple[Segment, ...]
    layouts: tuple[WorkerLayout, ...]
    layout_id: str
    mailbox: Segment
    slots: int
    slot: int
    nonce: int
    lease_s: float
    expires_at: float
    tokens: int
    block_ids: tuple[tuple[int, ...], ...]


def _hex(v: Any, field: str) -> int:
    if not isinstance(v, str) or not 0 < len(v) <= 16:
        raise invalid(field, v)
    try:
        return int(v, 16)
    except ValueError:
        raise invalid(field, v) from None


def _segment(v: Any, field: str) -> Segment:
    v = _list(v, field, 2)
    return Segment(_str(v[0], f"{field}.name"), _hex(v[1], f"{field}.key"))


def _num(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise invalid(field, v)
    return float(v)


_layouts_cache: dict[str, tuple[tuple[WorkerLayout, ...], str]] = {}


def _layouts(v: Any) -> tuple[tuple[WorkerLayout, ...], str]:
    """Parsed layouts and their fingerprint, cached: every request of one prefill instance
    carries the same ones."""
    text = json.dumps(v, separators=(",", ":"))
    got = _layouts_cache.get(text)
    if got is None:
        v = _list(v, "kvfabric.layouts", most=MAX_WORKERS)
        parsed = tuple(_worker(w, f"kvfabric.layouts[{i}]") for i, w in enumerate(v))
        if len(_layouts_cache) >= 64:
            _layouts_cache.pop(next(iter(_layouts_cache)))
        got = _layouts_cache[text] = (parsed, fingerprint(v))
    return got


def handover_of(params: dict[str, Any]) -> Handover:
    """The handover in a decode request's params; InvalidArgument when it is malformed."""
    fab = params.get("kvfabric")
    if not isinstance(fab, dict):
        raise invalid("kvfabric", fab)
    if fab.get("v") != VERSION:
        raise invalid("kvfabric.v", fab.get("v"))
    workers = tuple(
        _segment(w, f"kvfabric.workers[{i}]")
        for i, w in enumerate(_list(fab.get("workers"), "kvfabric.workers", most=MAX_WORKERS))
    )
    layouts, layout_id = _layouts(fab.get("layouts"))
    if not workers or len(layouts) != len(workers):
        raise invalid("kvfabric.layouts", len(layouts))
    slots = _int(fab.get("slots"), "kvfabric.slots", lo=1, hi=1 << 20)
    tokens = _int(fab.get("tokens"), "kvfabric.tokens", lo=1, hi=1 << 30)
    groups = _list(params.get("remote_block_ids"), "remote_block_ids", most=MAX_GROUPS)
    block_ids = []
    for g, ids in enumerate(groups):
        ids = _list(ids, f"remote_block_ids[{g}]", most=MAX_BLOCKS_PER_GROUP)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= -1 for b in ids):
            raise invalid(f"remote_block_ids[{g}]", ids[:8])
        block_ids.append(tuple(ids))
    if not block_ids:
        raise invalid("remote_block_ids", groups)
    return Handover(
        engine=str(params.get("remote_engine_id") or "")[:256],
        request=str(params.get("remote_request_id") or "")[:256],
        workers=workers,
        layouts=layouts,
        layout_id=layout_id,
        mailbox=_segment(fab.get("mailbox"), "kvfabric.mailbox"),
        slots=slots,
        slot=_int(fab.get("slot"), "kvfabric.slot", hi=slots - 1),
        nonce=_hex(fab.get("nonce"), "kvfabric.nonce"),
        lease_s=_num(fab.get("lease_s"), "kvfabric.lease_s"),
        expires_at=_num(fab.get("expires_at"), "kvfabric.expires_at"),
        tokens=tokens,
        block_ids=tuple(block_ids),
    )
