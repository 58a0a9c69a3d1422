"""The connector's worker side driven directly against a real agent, on KV caches laid out as
vLLM lays them out (a logical ``[blocks, heads, tokens, cell]`` view per layer): a decode
worker of another size and layout pulls a request's blocks from a prefill worker, into the
blocks vLLM allocated, and checks the hold after the pull; a pull whose hold ended meanwhile,
or whose key is wrong, is reported failed and writes nothing a request uses. CPU always; CUDA
(zero-copy CUDA IPC named by the GPU's UUID) when a GPU is there. No vLLM needed: this test
also runs on the GPU machine, where vLLM is not installed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvfabric.vllm.layout import LayerSpec, fingerprint  # noqa: E402
from kvfabric.vllm.mailbox import Mailbox  # noqa: E402
from kvfabric.vllm.metadata import KVFabricMetadata, Load  # noqa: E402
from kvfabric.vllm.params import Handover, Segment  # noqa: E402
from kvfabric.vllm.plan import GroupBlocks  # noqa: E402
from kvfabric.vllm.settings import Settings  # noqa: E402
from kvfabric.vllm.worker import Worker, WorkerInfo  # noqa: E402

LAYERS, BLOCK, HEADS, HEAD = 3, 32, 2, 32
P_BLOCKS, D_BLOCKS = 64, 40

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
        ],
    ),
]


def names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def caches(device: str, blocks: int, token_major: bool, seed: int) -> dict[str, torch.Tensor]:
    """One allocation for all layers, as vLLM makes it; each layer a ``[blocks, heads, tokens,
    2 * head]`` view, head-major (CPU attention's LBHNC) or token-major (LBNHC, the layout of
    FlashAttention's NHD)."""
    g = torch.Generator().manual_seed(seed)
    if token_major:
        raw = torch.randn(LAYERS, blocks, BLOCK, HEADS, 2 * HEAD, generator=g).to(device)
        return {n: raw[i].permute(0, 2, 1, 3) for i, n in enumerate(names())}
    raw = torch.randn(LAYERS, blocks, HEADS, BLOCK, 2 * HEAD, generator=g).to(device)
    return {n: raw[i] for i, n in enumerate(names())}


def settings(agent, **extra) -> Settings:
    return Settings.of({"socket_dir": agent.socket_dir, "max_held_requests": 16, **extra})


def worker(agent, name: str, blocks: int, **extra) -> Worker:
    spec = LayerSpec(0, BLOCK, (0, HEADS), "float32")
    info = WorkerInfo(name, 0, 0, 1, blocks, BLOCK, {n: spec for n in names()})
    return Worker(info, settings(agent, **extra))


def handover(p: Worker, mailbox: Mailbox, slot: int, nonce: int, remote_ids, key=None):
    wire = p.handshake().layout
    return Handover(
        engine="p",
        request="r",
        workers=(Segment(p.kv_name, key if key is not None else p.kv_key),),
        layouts=(p.layout,),
        layout_id=fingerprint([wire]),
        mailbox=mailbox.segment,
        slots=mailbox.slots,
        slot=slot,
        nonce=nonce,
        lease_s=30.0,
        expires_at=time.time() + 30,
        tokens=len(remote_ids) * BLOCK,
        block_ids=(tuple(remote_ids),),
    )


def until(cond, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def results(w: Worker):
    """(finished receiving, failed) once something finished."""
    got = SimpleNamespace(done=set(), failed=set())

    def poll():
        _, done, failed = w.transfer_results()
        got.done |= done
        got.failed |= failed
        return got.done

    until(poll)
    return got


@pytest.fixture
def pair(agent, request):
    """A prefill worker (64 blocks, head-major) with its instance's mailbox, and a decode worker
    (40 blocks, token-major: other offsets, other strides)."""
    device = request.param
    p_caches = caches(device, P_BLOCKS, False, 1)
    d_caches = caches(device, D_BLOCKS, True, 2)
    p, d = worker(agent, "p", P_BLOCKS), worker(agent, "d", D_BLOCKS, load_timeout_s=5)
    import kvfabric

    mailbox = Mailbox(kvfabric.Client(agent.socket_dir), "p.mailbox", 16, settings(agent))
    try:
        p.register_kv_caches(p_caches)
        d.register_kv_caches(d_caches)
        yield SimpleNamespace(p=p, d=d, mailbox=mailbox, pc=p_caches, dc=d_caches)
    finally:
        p.shutdown()
        d.shutdown()
        mailbox.close()


def block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b].cpu()


@pytest.mark.parametrize("pair", DEVICES, indirect=True)
def test_a_pull_fills_the_allocated_blocks_and_nothing_else(pair):
    before = {n: t.clone() for n, t in pair.dc.items()}
    remote_ids, local_ids = [5, 6, 7, 40, 63], [0, 9, 10, 39]
    pair.mailbox.hold(3, 77)
    # Position 0 is a prefix-cache hit on the decode: positions 1..4 are loaded.
    h = handover(pair.p, pair.mailbox, 3, 77, remote_ids)
    group = GroupBlocks((1, 2, 3, 4), tuple(local_ids), tuple(remote_ids), 0, h.tokens)
    pair.d.start_load_kv(KVFabricMetadata(loads={"r1": Load(h, (group,))}))
    got = results(pair.d)
    assert got.done == {"r1"} and got.failed == set()
    for name, t in pair.dc.items():
        for pos, lid in zip((1, 2, 3, 4), local_ids, strict=True):
            assert torch.equal(block(t, lid), block(pair.pc[name], remote_ids[pos]))
        for b in range(D_BLOCKS):
            if b not in local_ids:
                assert torch.equal(block(t, b), block(before[name], b)), (name, b)
    stats = pair.d.get_stats().reduce()
    assert stats["loads"] == 1 and stats["bytes"] == 4 * LAYERS * HEADS * BLOCK * 2 * HEAD * 4


@pytest.mark.parametrize("pair", DEVICES, indirect=True)
def test_a_pull_whose_hold_ended_or_whose_key_is_wrong_is_reported_failed(pair):
    remote_ids, local_ids = [1, 2], [3, 4]
    # The prefill ended the hold (lease, or its acknowledgement) before the pull checked it:
    # whatever the pull read is not used.
    pair.mailbox.hold(1, 5)
    pair.mailbox.release(1)
    h = handover(pair.p, pair.mailbox, 1, 5, remote_ids)
    group = GroupBlocks((0, 1), tuple(local_ids), tuple(remote_ids), 0, h.tokens)
    pair.d.start_load_kv(KVFabricMetadata(loads={"ended": Load(h, (group,))}))
    got = results(pair.d)
    assert got.done == {"ended"} and got.failed == {"ended"}
    before = {n: t.clone() for n, t in pair.dc.items()}
    # A key the prefill never gave: refused before a byte moves.
    pair.mailbox.hold(2, 9)
    bad = handover(pair.p, pair.mailbox, 2, 9, remote_ids, key=pair.p.kv_key ^ 1)
    pair.d.start_load_kv(KVFabricMetadata(loads={"key": Load(bad, (group,))}))
    got = results(pair.d)
    assert got.done == {"key"} and got.failed == {"key"}
    for name, t in pair.dc.items():
        assert torch.equal(t.cpu(), before[name].cpu()), name
    failures = pair.d.get_stats().data["failures"]
    assert failures == {"hold_ended": 1, "permission_denied": 1}, failures
