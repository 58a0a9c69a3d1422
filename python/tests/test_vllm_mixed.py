"""Instances that differ, served by real vLLM processes (CPU build) with vLLM's defaults (prefix
caching on): tensor parallelism 1 and 2 on either side, KV caches of different sizes, and a
model vLLM runs with its hybrid KV cache manager (every other layer attends to a sliding window
of 64 tokens: two KV cache groups, and the prefill frees the blocks that fell out of the
window). A decode of another block size is refused on CPU (vLLM's CPU attention packs each
block for its kernel) and recomputes, saying why; block-size changes between GPU layouts are
covered by test_plan.py.

Every decode output is compared token for token with the same decode instance computing the
prompt itself (a ``cache_salt`` keeps its prefix cache out), and each hand-over is shown to be
a pull by every decode worker, with vLLM counting the handed-over tokens as external hits.
"""

from __future__ import annotations

import itertools
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from fabric import Agent, Etcd  # noqa: E402
from tiny_llama import write  # noqa: E402
from vllm_server import (  # noqa: E402
    HITS,
    STALLS,
    VllmServer,
    prefill,
    prompt,
    pulls,
    start,
    tokens,
    trail,
    wait_free,
)

pytestmark = pytest.mark.vllm

WINDOW = 64
NEW_TOKENS = 10
# (name, tensor parallel size, block size, KV cache bytes)
PREFILLS = (("p1", 1, 32, 64 << 20), ("p2", 2, 32, 48 << 20))
DECODES = (("d1", 1, 32, 24 << 20), ("d2", 2, 32, 40 << 20))
# A decode whose blocks are twice the prefills' (refused on CPU: recomputed, reason counted).
OTHER_BLOCK = ("d64", 1, 64, 32 << 20)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    model = write(root / "hybrid", seed=3, layers=4, sliding_window=WINDOW)
    etcd = Etcd()
    agents = {
        side: Agent(f"agent-{side}", etcd=etcd.endpoint, extra=["--transports", "tcp"])
        for side in ("p", "d")
    }
    servers = {}
    decodes = (*DECODES, OTHER_BLOCK)
    for role, side, specs in (("kv_producer", "p", PREFILLS), ("kv_consumer", "d", decodes)):
        for name, tp, block, kv in specs:
            servers[name] = VllmServer(
                name,
                model,
                root,
                role,
                agents[side].socket_dir,
                {"load_timeout_s": 10.0},
                tp=tp,
                block_size=block,
                kv_bytes=kv,
            )
    try:
        start(*servers.values())
        yield servers
    finally:
        for s in servers.values():
            s.stop()
        for a in agents.values():
            a.kill()
        etcd.stop()


SALT = itertools.count()


def own(server: VllmServer, p: list[int]) -> list[int]:
    """The server's own output, computed from scratch."""
    return tokens(server.complete(p, NEW_TOKENS, cache_salt=f"salt-{next(SALT)}"))


def handover(mixed, src: str, dst: str, p: list[int]):
    """Prefill on ``src``, decode on ``dst``. Again, under a fresh ``cache_salt`` on both
    (the decode's cache now holds the recomputed prompt), if not every decode worker pulled
    and the machine stood still meanwhile (see ``Stalls``): a deadline that ran out then is
    the machine's, and the recompute that followed is the connector doing its job. Up to two
    more tries: the 2-core VM has stalled twice in a row (3.9 s, then 22.5 s, 2026-12-04)."""
    salt = None
    for _ in range(3):
        t0 = time.monotonic()
        params = prefill(mixed[src], p, salt)
        before = mixed[dst].metric(HITS)
        out = mixed[dst].complete(p, NEW_TOKENS, params, cache_salt=salt)
        hits = mixed[dst].metric(HITS) - before
        stalled = STALLS.longest_since(t0)
        if dst not in TP or pulls(mixed[dst], out) == TP[dst] or not stalled:
            break
        print(f"{src} → {dst}: not pulled after a {stalled:.1f} s stall of the machine; again")
        salt = f"retry-{next(SALT)}"
    return params, out, hits


PAIRS = [(p[0], d[0]) for p in PREFILLS for d in DECODES]
TP = {name: tp for name, tp, _, _ in (*PREFILLS, *DECODES)}


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_instances_of_other_tp_sizes_hand_over_a_hybrid_model(mixed, src, dst):
    # Shorter than the window; past it (blocks freed there); past it and a block part.
    for i, n in enumerate((40, 3 * WINDOW, 4 * WINDOW + 37)):
        p = prompt(n, 7000 + 10 * i + 100 * PAIRS.index((src, dst)))
        params, out, hits = handover(mixed, src, dst, p)
        assert params["tp_size"] == TP[src]
        if n > 2 * WINDOW:
            # The window's group names only the blocks the decode needs; the rest were freed.
            assert -1 in params["remote_block_ids"][1], params["remote_block_ids"]
        assert tokens(out) == own(mixed[dst], p), (src, dst, n)
        # Every decode worker pulled; the prefill left the last prompt token to the decode
        # (a sliding-window block it still reads may already be freed there).
        assert pulls(mixed[dst], out) == TP[dst], (src, dst, n, trail(mixed[dst], out))
        assert hits == n - 1, (src, dst, n, hits)


def test_a_decode_of_another_block_size_on_cpu_recomputes_and_says_why(mixed):
    d = mixed["d64"]
    for i, n in enumerate((40, 200)):
        p = prompt(n, 7500 + i)
        before = d.metric("vllm:kvfabric_not_pulled_total", reason="block_size")
        _, out, hits = handover(mixed, "p2", "d64", p)
        assert tokens(out) == own(d, p) and pulls(d, out) == 0 and hits == 0
        assert d.metric("vllm:kvfabric_not_pulled_total", reason="block_size") == before + 1
    assert d.log().count("not pulled from p2: block_size:") == 1


@pytest.mark.parametrize("dst", [d[0] for d in DECODES])
def test_a_hybrid_decode_with_cached_prefixes_decodes_as_itself(mixed, dst):
    """Prompts sharing a prefix, computed on the decode itself or handed over one after the
    other: every output is the decode's own, whatever its prefix cache held (vLLM finds a hit
    of a hybrid model only where both groups hold the prefix: what it lacks is pulled)."""
    d = mixed[dst]
    wait_free(d)
    for k, shared in enumerate((64, 2 * 64 + 9, 4 * 64)):
        base = prompt(shared, 8000 + 10 * k)
        a = base + prompt(70, 8001 + 10 * k)
        assert tokens(d.complete(a, NEW_TOKENS)) == own(d, a)
        for j, (src, extra) in enumerate((("p2", 150), ("p1", 90), ("p2", 40))):
            c = base + prompt(extra, 8002 + 10 * k + j)
            _, out, hits = handover(mixed, src, dst, c)
            assert tokens(out) == own(d, c), (dst, shared, extra)
            assert pulls(d, out) == TP[dst] and 0 < hits <= len(c) - 1, (
                dst,
                shared,
                hits,
                trail(d, out),
            )
