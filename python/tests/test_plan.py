"""The pull planner (kvfabric.vllm.plan) on KV caches laid out as vLLM lays them out, between
instances that differ in what a production deployment lets differ: TP size (both ways, MLA's
replicated latent included), scheduler block size (both ways), kernel block splits, the
layout of a block (head-major, token-major, every layer of a block together) and the number
of blocks. Each case runs the plan's block tables over the two workers' memory (a copy per
plane and block pair, what the agent does) and checks every cell of every loaded token against
the truth, that prefix-cache hits and every other byte of the decode's memory were not written,
and what the planner refuses and why. No agent and no vLLM: the planner is pure."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvfabric.vllm.layout import (  # noqa: E402
    LayerSpec,
    WorkerLayout,
    kv_heads_of_rank,
    worker_from_wire,
    worker_layout,
)
from kvfabric.vllm.plan import (  # noqa: E402
    GroupBlocks,
    Incompatible,
    MissingBlocks,
    Reason,
    block_pairs,
    make_plan,
)

LAYERS, HEADS, CELL = 3, 4, 16  # int32 cells: K and V of a 8-wide head side by side
POISON = -7


@dataclass
class Instance:
    """The workers of one instance: their caches (by layer name), the KV heads each holds, and
    their layouts. ``packed``: how the backend reads a (block, head) (layout.LayerSpec)."""

    caches: list[dict[str, torch.Tensor]]
    heads: list[tuple[int, int]]
    regions: list[list[torch.Tensor]]
    layouts: list[WorkerLayout]
    block_size: int
    num_blocks: int
    kernel: int
    packed: bool


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def caches_of(
    layout: str, num_blocks: int, block_size: int, heads: int, kernel: int
) -> dict[str, torch.Tensor]:
    """One worker's caches: logical ``[kernel blocks, heads, tokens, cell]`` views, laid out
    as vLLM's ``LBHNC`` (head-major), ``LBNHC`` (token-major) or ``BLHNC`` (the layers of a
    block together), one allocation for all layers, kernel blocks of ``kernel`` tokens."""
    kb = num_blocks * (block_size // kernel)
    names = layer_names()
    if layout == "LBHNC":
        raw = torch.full((LAYERS, kb, heads, kernel, CELL), POISON, dtype=torch.int32)
        return {n: raw[i] for i, n in enumerate(names)}
    if layout == "LBNHC":
        raw = torch.full((LAYERS, kb, kernel, heads, CELL), POISON, dtype=torch.int32)
        return {n: raw[i].permute(0, 2, 1, 3) for i, n in enumerate(names)}
    if layout == "BLHNC":
        raw = torch.full((kb, LAYERS, heads, kernel, CELL), POISON, dtype=torch.int32)
        return {n: raw[:, i] for i, n in enumerate(names)}
    raise AssertionError(layout)


def instance(
    tp: int,
    block_size: int,
    num_blocks: int,
    layout: str = "LBHNC",
    kernel: int | None = None,
    packed: bool = False,
    mla: bool = False,
    pp: int = 1,
) -> Instance:
    """``tp * pp`` workers in vLLM's order (PP stage, then TP rank); a PP stage holds its
    share of the layers, in order."""
    caches, heads, regions, layouts = [], [], [], []
    kernel = kernel or block_size
    names = layer_names()
    for stage, rank in ((s, r) for s in range(pp) for r in range(tp)):
        held = kv_heads_of_rank(1 if mla else HEADS, rank, tp, mla)
        c = caches_of(layout, num_blocks, block_size, held[1] - held[0], kernel)
        mine = names[stage * LAYERS // pp : (stage + 1) * LAYERS // pp]
        c = {n: t for n, t in c.items() if n in mine}
        specs = {n: LayerSpec(0, block_size, held, "int32", packed) for n in c}
        r, w = worker_layout(c, specs, num_blocks, (stage, rank, tp, block_size))
        # Through the wire and back, as the decode sees the prefill's layout.
        w = worker_from_wire(w.wire(), "layout")
        caches.append(c)
        heads.append(held)
        regions.append([x.view(torch.uint8) for x in r])
        layouts.append(w)
    return Instance(caches, heads, regions, layouts, block_size, num_blocks, kernel, packed)


def cell(inst: Instance, t: torch.Tensor, kb: int, h: int, j: int, value=None):
    """Token ``j`` of kernel block ``kb``, local head ``h``: its K and V (read, or written from
    ``value``), wherever the backend keeps them. Packed as vLLM's CPU attention packs a (block,
    head): K transposed (element ``d`` of token ``t`` at ``d * N + t``), then V row-major."""
    if not inst.packed:
        if value is not None:
            t[kb, h, j] = value
        return t[kb, h, j].clone()
    d = CELL // 2
    chunk = t[kb, h].reshape(-1)
    k_at = torch.arange(d) * inst.kernel + j
    v_at = inst.kernel * d + j * d + torch.arange(d)
    if value is not None:
        chunk[k_at] = value[:d]
        chunk[v_at] = value[d:]
    return torch.cat((chunk[k_at], chunk[v_at]))


def truth(tokens: int, mla: bool, seed: int) -> np.ndarray:
    """[layer, global head, token, cell]"""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 30, (LAYERS, 1 if mla else HEADS, tokens, CELL), dtype=np.int32)


def fill(inst: Instance, kv: np.ndarray, block_ids: list[int]) -> None:
    """Writes the request's KV into the instance's blocks (the prefill computed it)."""
    bs, per = inst.block_size, inst.block_size // inst.kernel
    for (h0, h1), c in zip(inst.heads, inst.caches, strict=True):
        for li, name in enumerate(layer_names()):
            if name not in c:
                continue
            for tok in range(kv.shape[2]):
                pos, within = divmod(tok, bs)
                k, j = divmod(within, inst.kernel)
                for h in range(h0, h1):
                    value = torch.from_numpy(kv[li, h, tok])
                    cell(inst, c[name], block_ids[pos] * per + k, h - h0, j, value)


def run(plan, local: Instance, rank: int, remote: Instance, group: GroupBlocks) -> int:
    """Runs every table of the plan as the agent does: a copy per plane pair and block pair."""
    moved = 0
    for table in plan.tables:
        lids, rids = block_pairs(plan, table, group)
        src = remote.regions[table.peer]
        dst = local.regions[rank]
        for (lr, lb, ls, n), (rr, rb, rs, m) in zip(
            table.local_planes, table.remote_planes, strict=True
        ):
            assert n == m
            for li, ri in zip(lids.tolist(), rids.tolist(), strict=True):
                dst[lr][lb + li * ls : lb + li * ls + n] = src[rr][rb + ri * rs : rb + ri * rs + n]
                moved += n
    return moved


def check(local: Instance, rank: int, kv: np.ndarray, ids: list[int], hits: int, end: int):
    """Every loaded token's cells equal the truth; the hits' blocks and every other block are
    untouched."""
    bs, per = local.block_size, local.block_size // local.kernel
    (h0, h1), c = local.heads[rank], local.caches[rank]
    for li, name in enumerate(layer_names()):
        if name not in c:
            continue
        t = c[name]
        for pos, b in enumerate(ids):
            for within in range(bs):
                tok = pos * bs + within
                k, j = divmod(within, local.kernel)
                for h in range(h0, h1):
                    got = cell(local, t, b * per + k, h - h0, j).numpy()
                    if pos < hits or tok >= end:
                        assert (got == POISON).all(), (name, pos, tok, "written")
                    else:
                        assert (got == kv[li, h, tok]).all(), (name, pos, tok, h)
        used = {b * per + k for b in ids for k in range(per)}
        for kb in range(t.shape[0]):
            if kb not in used:
                assert (t[kb].numpy() == POISON).all(), (name, kb, "outside the request")


def distinct(n: int, of: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(of)[:n].tolist()


CASES = {
    # name: (prefill (tp, block, blocks, layout, kernel), decode (...), mla)
    "same shape, other number of blocks": ((1, 16, 40, "LBHNC", None), (1, 16, 24, "LBHNC", None)),
    "prefill TP2 -> decode TP1": ((2, 16, 40, "LBHNC", None), (1, 16, 24, "LBHNC", None)),
    "prefill TP1 -> decode TP2": ((1, 16, 40, "LBHNC", None), (2, 16, 24, "LBHNC", None)),
    "prefill TP4 -> decode TP2": ((4, 16, 40, "LBHNC", None), (2, 16, 30, "LBHNC", None)),
    "block 16 -> block 32": ((1, 16, 40, "LBHNC", None), (1, 32, 24, "LBHNC", None)),
    "block 32 -> block 16": ((1, 32, 24, "LBHNC", None), (1, 16, 40, "LBHNC", None)),
    "TP2, block 32 -> TP1, block 16": ((2, 32, 24, "LBHNC", None), (1, 16, 40, "LBHNC", None)),
    "head-major -> token-major": ((1, 16, 40, "LBHNC", None), (1, 16, 24, "LBNHC", None)),
    "token-major TP1 -> head-major TP2": ((1, 16, 40, "LBNHC", None), (2, 16, 24, "LBHNC", None)),
    "layers of a block together": ((1, 16, 40, "BLHNC", None), (1, 16, 24, "LBHNC", None)),
    "kernel blocks of 8 -> 16": ((1, 16, 40, "LBHNC", 8), (1, 16, 24, "LBHNC", None)),
    # vLLM's CPU attention: each (block, head) packed for its kernel, moved whole.
    "CPU attention, TP2 -> TP1": (
        (2, 16, 40, "LBHNC", None, True),
        (1, 16, 24, "LBHNC", None, True),
    ),
    "CPU attention, TP1 -> TP2": (
        (1, 16, 40, "LBHNC", None, True),
        (2, 16, 24, "LBHNC", None, True),
    ),
    "CPU attention, TP4 -> TP2": (
        (4, 16, 40, "LBHNC", None, True),
        (2, 16, 24, "LBHNC", None, True),
    ),
}


@pytest.mark.parametrize("hits", [0, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_plans_move_every_cell_of_the_loaded_tokens_and_nothing_else(case, hits):
    (ptp, pbs, pnb, *prest), (dtp, dbs, dnb, *drest) = CASES[case]
    tokens = 5 * 32 + 7  # whole blocks of either size and a part
    kv = truth(tokens, False, sum(map(ord, case)))
    p = instance(ptp, pbs, pnb, *prest)
    rids = distinct(-(-tokens // pbs), pnb, 1)
    fill(p, kv, rids)
    d = instance(dtp, dbs, dnb, *drest)
    # The decode's prefix cache served the first `hits` blocks (the planner must not touch
    # them); vLLM allocated the rest.
    ids = distinct(-(-tokens // dbs), dnb, 2)
    for rank in range(dtp):
        plan = make_plan(d.layouts[rank], p.layouts)
        group = GroupBlocks(tuple(range(hits, len(ids))), tuple(ids[hits:]), tuple(rids), 0, tokens)
        moved = run(plan, d, rank, p, group)
        assert moved > 0
        check(d, rank, kv, ids, hits, tokens)
        # Each remote worker that holds a head this rank needs is read, and no other.
        held = kv_heads_of_rank(HEADS, rank, dtp)
        needed = {
            i
            for i in range(ptp)
            if set(range(*kv_heads_of_rank(HEADS, i, ptp))) & set(range(*held))
        }
        assert set(plan.peers) == needed, (plan.peers, needed)


@pytest.mark.parametrize(("ppp", "ptp", "dpp", "dtp"), [(2, 1, 1, 1), (1, 2, 3, 1), (3, 2, 1, 2)])
def test_pipeline_stages_are_read_from_the_workers_holding_their_layers(ppp, ptp, dpp, dtp):
    """Instances split into other PP stages: each local layer is read, by name, from the
    prefill workers of the stage that holds it (and the TP ranks holding its heads)."""
    tokens = 3 * 16 + 5
    kv = truth(tokens, False, 77)
    p = instance(ptp, 16, 40, pp=ppp)
    rids = distinct(4, 40, 1)
    fill(p, kv, rids)
    d = instance(dtp, 16, 24, pp=dpp)
    ids = distinct(4, 24, 2)
    for w, layout in enumerate(d.layouts):
        plan = make_plan(layout, p.layouts)
        run(plan, d, w, p, GroupBlocks(tuple(range(4)), tuple(ids), tuple(rids), 0, tokens))
        check(d, w, kv, ids, 0, tokens)
        names = {x.name for x in layout.layers}
        holders = {i for i, r in enumerate(p.layouts) if names & {x.name for x in r.layers}}
        assert set(plan.peers) <= holders


def test_mla_reads_the_replicated_latent_once_from_one_worker():
    """MLA: every prefill rank holds the same latent; a decode rank reads it from one of them,
    and the decode ranks spread over the prefill's."""
    tokens = 3 * 16 + 1
    kv = truth(tokens, True, 5)
    p = instance(2, 16, 40, mla=True)
    rids = distinct(4, 40, 1)
    fill(p, kv, rids)
    d = instance(2, 16, 24, mla=True)
    ids = distinct(4, 24, 2)
    peers = []
    for rank in range(2):
        plan = make_plan(d.layouts[rank], p.layouts)
        assert len(plan.peers) == 1
        peers += plan.peers
        run(plan, d, rank, p, GroupBlocks(tuple(range(4)), tuple(ids), tuple(rids), 0, tokens))
        check(d, rank, kv, ids, 0, tokens)
    assert sorted(peers) == [0, 1]


def test_a_sliding_window_loads_only_the_window_and_fails_closed_on_a_freed_block_it_needs():
    tokens = 6 * 16
    kv = truth(tokens, False, 9)
    p = instance(1, 16, 40)
    rids = distinct(6, 40, 1)
    fill(p, kv, rids)
    d = instance(1, 16, 24)
    ids = distinct(6, 24, 2)
    plan = make_plan(d.layouts[0], p.layouts)
    # Window of 40 tokens: tokens 56.. are needed, blocks 3.. (block 0..2 freed there: -1).
    remote = tuple([-1, -1, -1, *rids[3:]])
    group = GroupBlocks(tuple(range(6)), tuple(ids), remote, tokens - 40, tokens)
    run(plan, d, 0, p, group)
    w, c = d.layouts[0], d.caches[0]
    for layer in w.layers:
        t = c[layer.name]
        for pos in range(3):
            assert (t[ids[pos]].numpy() == POISON).all()
        for pos in range(3, 6):
            assert (
                t[ids[pos], :, :].numpy()
                == kv[layer_names().index(layer.name), :, pos * 16 : pos * 16 + 16]
            ).all()
    with pytest.raises(MissingBlocks):
        block_pairs(
            plan, plan.tables[0], GroupBlocks(group.local_positions, ids, remote, 40, tokens)
        )


@pytest.mark.parametrize(("pbs", "dbs"), [(32, 16), (16, 32)])
def test_packed_blocks_of_other_sizes_are_refused(pbs, dbs):
    """vLLM's CPU attention packs each block for its kernel: tokens cannot be remapped between
    blocks of other sizes, so the decode recomputes (with the reason)."""
    p, d = instance(2, pbs, 24, packed=True), instance(1, dbs, 24, packed=True)
    with pytest.raises(Incompatible) as e:
        make_plan(d.layouts[0], p.layouts)
    assert e.value.reason is Reason.BLOCK_SIZE and "packs" in e.value.detail


def wire_of(inst: Instance) -> list:
    return [w.wire() for w in inst.layouts]


REFUSED = {
    "another model (a layer missing)": (
        lambda w: w[4].pop(),
        Reason.LAYERS,
    ),
    "another dtype": (lambda w: w[4][0].__setitem__(2, "float16"), Reason.LAYERS),
    "another cell size (head size)": (lambda w: w[4][0].__setitem__(11, 32), Reason.LAYERS),
    "block sizes neither divides": (lambda w: w.__setitem__(3, 24), Reason.BLOCK_SIZE),
    "heads no remote worker holds": (lambda w: w[4][0].__setitem__(9, [2, 4]), Reason.HEADS),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_read_is_refused_with_its_reason(case):
    mangle, reason = REFUSED[case]
    p = instance(1, 16, 40)
    wire = wire_of(p)
    mangle(wire[0])
    remote = [worker_from_wire(w, "layout") for w in wire]
    d = instance(1, 16, 24)
    with pytest.raises(Incompatible) as e:
        make_plan(d.layouts[0], remote)
    assert e.value.reason is reason, e.value


def test_one_table_per_peer_and_group_for_equal_layouts():
    """Equal instances read each block as a few long runs (every layer's block is one range in
    the layouts vLLM uses), not one op per cell."""
    p, d = instance(1, 16, 40), instance(1, 16, 24)
    plan = make_plan(d.layouts[0], p.layouts)
    assert len(plan.tables) == 1
    assert len(plan.tables[0].local_planes) == LAYERS
    assert plan.tables[0].bytes_per_pair == LAYERS * HEADS * 16 * CELL * 4
