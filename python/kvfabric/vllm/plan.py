"""How a worker pulls a request's KV from the workers of another instance: which remote worker
serves each of its layers and heads, and the block tables (plane pairs and block-id pairs)
that move it.

The two instances may differ in TP size (a local layer's heads come from the remote workers
that hold them; a head several remote workers replicate, as with MLA, is read from one), in PP
stage split (layers are matched by name), in scheduler block size (one must be a multiple of
the other: a local block is several remote blocks, or a part of one), in KV cache layout
(cells are matched one by one, then merged into the longest runs both sides store contiguously)
and in everything that only moves bytes around (number of blocks, base offsets, regions).
They must agree on the model (layer names, dtype, cell size, KV cache groups).

A plan depends only on the two layouts; it is made once per remote layout and kept. What
depends on the request (which positions are local prefix-cache hits, the block ids on both
sides, the window of a sliding-window group) is applied by :func:`block_pairs`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .layout import LayerLayout, WorkerLayout

Plane = tuple[int, int, int, int]

# A layout that needs more plane pairs than this per table is refused rather than read
# (each plane is checked and expanded per block).
MAX_PLANES_PER_TABLE = 4096
MAX_TABLES = 4096


class Reason(enum.Enum):
    """Why a request's KV was not pulled (the metric's ``reason`` label)."""

    INVALID_PARAMS = "invalid_params"
    LAYERS = "layers"  # another model: layer names, dtype, cell size or groups differ
    BLOCK_SIZE = "block_size"  # neither block size a multiple of the other
    HEADS = "heads"  # a local head no remote worker holds
    LAYOUT = "layout"  # too many plane pairs to read (a layout that scatters every cell)
    EXPIRED = "expired"  # the prefill's hold ended before the pull could start
    UNREACHABLE = "unreachable"  # no segment of the prefill's workers known at start


class Incompatible(Exception):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Table:
    """One block-table read from remote worker ``peer`` for KV cache group ``group``. ``sub``
    picks the part of a block when block sizes differ (see :func:`block_pairs`)."""

    peer: int
    group: int
    sub: int
    local_planes: tuple[Plane, ...]
    remote_planes: tuple[Plane, ...]

    @property
    def bytes_per_pair(self) -> int:
        return sum(p[3] for p in self.local_planes)


@dataclass(frozen=True)
class Plan:
    """Every table a local worker reads, and the block-size relation of the two instances:
    ``local_block == ratio * remote_block`` (``ratio >= 1``, ``inverse`` False) or
    ``remote_block == ratio * local_block`` (``inverse`` True)."""

    tables: tuple[Table, ...]
    local_block: int
    remote_block: int
    ratio: int
    inverse: bool

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({t.peer for t in self.tables}))


def _runs(loff: np.ndarray, roff: np.ndarray, cell: int) -> list[tuple[int, int, int]]:
    """Cells (in order) merged into runs contiguous on both sides: (local, remote, bytes)."""
    if len(loff) == 0:
        return []
    breaks = np.nonzero((np.diff(loff) != cell) | (np.diff(roff) != cell))[0] + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(loff)]))
    return [
        (int(loff[s]), int(roff[s]), int(e - s) * cell)
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


def _cell_offsets(layer: LayerLayout, heads: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Offsets (from block start, base included) of cells heads × tokens, heads outer."""
    assert layer.heads is not None
    k, t = np.divmod(tokens, layer.tokens)
    per_token = k * layer.block_stride + t * layer.token_stride
    per_head = (heads - layer.heads[0]) * layer.head_stride
    return layer.base + per_head[:, None] + per_token[None, :]


def _layer_runs(
    local: LayerLayout,
    remote: LayerLayout,
    heads: np.ndarray,
    local_first: int,
    remote_first: int,
    count: int,
) -> list[tuple[int, int, int]]:
    """Runs moving cells (heads, ``count`` tokens) from the remote block (from token
    ``remote_first``) into the local one (from ``local_first``): the better of reading
    head-major or token-major."""
    tokens = np.arange(count, dtype=np.int64)
    lo = _cell_offsets(local, heads, local_first + tokens)
    ro = _cell_offsets(remote, heads, remote_first + tokens)
    by_head = _runs(lo.ravel(), ro.ravel(), local.cell)
    by_token = _runs(lo.T.ravel(), ro.T.ravel(), local.cell)
    return by_head if len(by_head) <= len(by_token) else by_token


def _merge(pairs: list[tuple[Plane, Plane]]) -> list[tuple[Plane, Plane]]:
    """Plane pairs that continue each other on both sides (same regions and strides, the next
    starting where the last ends) as one."""
    out: list[tuple[Plane, Plane]] = []
    for lp, rp in sorted(pairs):
        if out:
            (a, ab, ast, al), (b, bb, bst, bl) = out[-1]
            if (
                (a, ast, b, bst) == (lp[0], lp[2], rp[0], rp[2])
                and ab + al == lp[1]
                and bb + bl == rp[1]
            ):
                out[-1] = ((a, ab, ast, al + lp[3]), (b, bb, bst, bl + rp[3]))
                continue
        out.append((lp, rp))
    return out


def _check_model(local: WorkerLayout, remotes: list[WorkerLayout]) -> dict[str, list[int]]:
    """Remote workers holding each layer name; raises when the instances serve other models."""
    holders: dict[str, list[int]] = {}
    kinds: dict[str, tuple] = {}
    for i, w in enumerate(remotes):
        if w.block_size != remotes[0].block_size:
            raise Incompatible(Reason.INVALID_PARAMS, "remote workers disagree on block size")
        for layer in w.layers:
            holders.setdefault(layer.name, []).append(i)
            kinds.setdefault(
                layer.name, (layer.group, layer.dtype, layer.cell, layer.structured, layer.packed)
            )
    for layer in local.layers:
        if layer.name not in holders:
            raise Incompatible(Reason.LAYERS, f"no remote worker holds layer {layer.name}")
        want = (layer.group, layer.dtype, layer.cell, layer.structured, layer.packed)
        if kinds[layer.name] != want:
            raise Incompatible(
                Reason.LAYERS,
                f"layer {layer.name}: (group, dtype, cell bytes, structured, packed) "
                f"{kinds[layer.name]} there, {want} here",
            )
    return holders


def make_plan(local: WorkerLayout, remotes: list[WorkerLayout]) -> Plan:
    """The tables ``local`` reads from ``remotes`` (the other instance's workers, in the order
    their segments are named), or :class:`Incompatible` saying why it cannot."""
    if not remotes:
        raise Incompatible(Reason.INVALID_PARAMS, "no remote workers")
    holders = _check_model(local, remotes)
    lb, rb = local.block_size, remotes[0].block_size
    if lb % rb == 0:
        ratio, inverse = lb // rb, False
    elif rb % lb == 0:
        ratio, inverse = rb // lb, True
    else:
        raise Incompatible(Reason.BLOCK_SIZE, f"block size {rb} there, {lb} here")
    if ratio != 1 and any(layer.packed for layer in local.layers):
        raise Incompatible(
            Reason.BLOCK_SIZE,
            f"block size {rb} there, {lb} here: the attention backend packs each block for its "
            "kernel (vLLM's CPU attention), so tokens cannot move between blocks of other sizes",
        )
    # Per sub-block: (local first token, remote first token, tokens).
    subs = [
        (s * rb, 0, rb) if not inverse else (0, s * lb, lb) for s in range(ratio)
    ]  # fmt: skip
    by_table: dict[tuple[int, int, int], list[tuple[Plane, Plane]]] = {}
    for layer in local.layers:
        found = [(i, _layer_of(remotes[i], layer.name)) for i in holders[layer.name]]
        if not layer.structured:
            _opaque_pairs(local, layer, remotes, found, ratio, by_table)
            continue
        assert layer.heads is not None
        # Each local head from one remote worker holding it, replicas spread over local ranks.
        chosen: dict[int, list[int]] = {}
        for h in range(*layer.heads):
            cands = [i for i, r in found if r.heads is not None and r.heads[0] <= h < r.heads[1]]
            if not cands:
                raise Incompatible(
                    Reason.HEADS, f"layer {layer.name}: no remote worker holds KV head {h}"
                )
            chosen.setdefault(cands[local.tp_rank % len(cands)], []).append(h)
        for peer, heads in chosen.items():
            remote = _layer_of(remotes[peer], layer.name)
            for s, (lf, rf, n) in enumerate(subs):
                runs = _layer_runs(layer, remote, np.array(heads, np.int64), lf, rf, n)
                by_table.setdefault((peer, layer.group, s), []).extend(
                    (
                        (layer.region, lo, layer.logical_stride, size),
                        (remote.region, ro, remote.logical_stride, size),
                    )
                    for lo, ro, size in runs
                )
    tables = []
    for (peer, group, sub), pairs in sorted(by_table.items()):
        merged = _merge(pairs)
        # A table past the limit goes as several (one block-table batch each).
        for at in range(0, len(merged), MAX_PLANES_PER_TABLE):
            chunk = merged[at : at + MAX_PLANES_PER_TABLE]
            tables.append(
                Table(peer, group, sub, tuple(p[0] for p in chunk), tuple(p[1] for p in chunk))
            )
    if len(tables) > MAX_TABLES:
        raise Incompatible(
            Reason.LAYOUT, f"{len(tables)} block tables per request (at most {MAX_TABLES})"
        )
    return Plan(tuple(tables), lb, rb, ratio, inverse)


def _layer_of(worker: WorkerLayout, name: str) -> LayerLayout:
    return next(layer for layer in worker.layers if layer.name == name)


def _opaque_pairs(
    local: WorkerLayout,
    layer: LayerLayout,
    remotes: list[WorkerLayout],
    found: list[tuple[int, LayerLayout]],
    ratio: int,
    by_table: dict[tuple[int, int, int], list[tuple[Plane, Plane]]],
) -> None:
    """A layer copied block for block: the remote worker of the same TP rank and size, the
    same block size, the same parts."""
    same = [
        (i, r)
        for i, r in found
        if remotes[i].tp_size == local.tp_size and remotes[i].tp_rank == local.tp_rank
    ]
    if not same:
        raise Incompatible(
            Reason.HEADS, f"layer {layer.name} has no head layout; it needs the same TP size there"
        )
    if ratio != 1:
        raise Incompatible(
            Reason.BLOCK_SIZE, f"layer {layer.name} has no token layout; it needs one block size"
        )
    peer, remote = same[0]
    if [n for _, n in remote.parts] != [n for _, n in layer.parts]:
        raise Incompatible(
            Reason.LAYERS, f"layer {layer.name}: block parts {remote.parts} there, {layer.parts}"
        )
    by_table.setdefault((peer, layer.group, 0), []).extend(
        (
            (layer.region, layer.base + lo, layer.block_stride, n),
            (remote.region, remote.base + ro, remote.block_stride, n),
        )
        for (lo, n), (ro, _) in zip(layer.parts, remote.parts, strict=True)
    )


@dataclass(frozen=True)
class GroupBlocks:
    """One KV cache group of a request: the local ``(position, block id)`` pairs to load (the
    positions that are neither prefix-cache hits nor outside a sliding window), the remote
    block ids by position (``-1``: freed there), and the tokens to load in this group
    (``first`` to ``end``, positions in tokens)."""

    local_positions: tuple[int, ...]
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    first: int
    end: int


class MissingBlocks(Exception):
    """The remote side lacks a block this side needs (fail closed: the request is recomputed)."""


def block_pairs(plan: Plan, table: Table, group: GroupBlocks) -> tuple[np.ndarray, np.ndarray]:
    """The (local, remote) block ids ``table`` moves for ``group``.

    Local block at position ``i`` covers tokens ``[i*L, (i+1)*L)``; with ``L = ratio * R`` it
    is remote positions ``ratio*i + sub`` (``sub`` the table's part of the local block); with
    ``R = ratio * L`` it is part ``i % ratio`` of remote position ``i // ratio`` (tables of
    that part only). Pairs whose tokens lie outside ``[first, end)`` are left out; a needed
    remote position that is missing or freed raises :class:`MissingBlocks`."""
    lb, rb, ratio = plan.local_block, plan.remote_block, plan.ratio
    local: list[int] = []
    remote: list[int] = []
    for pos, lid in zip(group.local_positions, group.local_ids, strict=True):
        if plan.inverse:
            if pos % ratio != table.sub:
                continue
            rpos = pos // ratio
            lo, hi = pos * lb, (pos + 1) * lb
        else:
            rpos = ratio * pos + table.sub
            lo, hi = rpos * rb, (rpos + 1) * rb
        if hi <= group.first or lo >= group.end:
            continue
        if rpos >= len(group.remote_ids) or group.remote_ids[rpos] < 0:
            raise MissingBlocks(f"remote block at position {rpos} (tokens {lo}..{hi})")
        local.append(lid)
        remote.append(group.remote_ids[rpos])
    return np.asarray(local, dtype=np.uint64), np.asarray(remote, dtype=np.uint64)
