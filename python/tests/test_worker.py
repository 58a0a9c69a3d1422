"""The connector's worker side driven directly, on KV caches laid out as vLLM lays them out
(one tensor per layer), against a real agent: a prefill worker holds blocks, a decode worker
pulls them, acknowledges, and the hold ends; a failed pull reports its blocks; an unpulled hold
ends with its lease. CPU always; CUDA (FlashAttention's layout, zero-copy CUDA IPC named by
device UUID) when a GPU is there."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvfabric.vllm.metadata import Hold, KVFabricMetadata, Load  # noqa: E402
from kvfabric.vllm.settings import Settings  # noqa: E402
from kvfabric.vllm.worker import Worker  # noqa: E402

LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 64, 32, 2, 32

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


def caches(device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if device == "cpu":
        # CPU attention: (blocks, kv heads, block size, 2 * head size), one allocation for all
        # layers as vLLM makes it.
        raw = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g)
        return {f"model.layers.{i}.self_attn.attn": raw[i] for i in range(LAYERS)}
    # FlashAttention: (2, blocks, block size, kv heads, head size), a tensor per layer.
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            2, BLOCKS, BLOCK, HEADS, HEAD, generator=g
        ).to(device)
        for i in range(LAYERS)
    }


def worker(agent, name: str, **settings) -> Worker:
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=name))
    s = Settings.of({"socket_dir": agent.socket_dir, "max_held_requests": 16, **settings})
    return Worker(config, s, BLOCKS, rank=0)


def peer(w: Worker, key: int | None = None) -> dict:
    h = w.handshake()
    return {
        "kv": h.kv,
        "kv_key": f"{key or h.kv_key:016x}",
        "acks": h.acks,
        "acks_key": f"{h.acks_key:016x}",
    }


def blocks_of(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    dim = 0 if t.shape[0] == BLOCKS else 1
    return t.index_select(dim, torch.tensor(ids, device=t.device)).cpu()


def until(cond, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("device", DEVICES)
def test_pull_acknowledge_and_release(agent, device):
    p_caches, d_caches = caches(device, 1), caches(device, 2)
    p, d = worker(agent, "p"), worker(agent, "d")
    try:
        p.register_kv_caches(p_caches)
        d.register_kv_caches(d_caches)
        assert p.handshake().layout == d.handshake().layout
        before = {n: t.clone() for n, t in d_caches.items()}
        remote_ids, local_ids = [5, 6, 7, 40], [0, 9, 10, 63]
        p.start_load_kv(KVFabricMetadata(holds={"r1": Hold(slot=3, nonce=77, lease_s=30)}))
        assert p.get_finished({"r1"}) == (None, None)  # held: nobody pulled yet
        d.start_load_kv(
            KVFabricMetadata(loads={"r1": Load([peer(p)], 3, 77, local_ids, remote_ids)})
        )
        recving = until(lambda: d.get_finished(set())[1])
        assert recving == {"r1"} and d.get_block_ids_with_load_errors() == set()
        for name, t in d_caches.items():
            assert torch.equal(blocks_of(t, local_ids), blocks_of(p_caches[name], remote_ids))
            untouched = [b for b in range(BLOCKS) if b not in local_ids]
            assert torch.equal(blocks_of(t, untouched), blocks_of(before[name], untouched))
        # The acknowledgement ends the hold long before the lease.
        assert until(lambda: p.get_finished(set())[0]) == {"r1"}
        stats = d.get_stats().reduce()
        assert stats["loads"] == 1 and stats["bytes"] == len(local_ids) * sum(
            pl[3] for pl in d.planes
        )
        assert p.get_stats().reduce()["acked"] == 1
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_failed_pull_reports_its_blocks_and_an_unpulled_hold_ends_with_its_lease(agent, device):
    p_caches, d_caches = caches(device, 3), caches(device, 4)
    p, d = worker(agent, "p2"), worker(agent, "d2", load_timeout_s=5)
    try:
        p.register_kv_caches(p_caches)
        d.register_kv_caches(d_caches)
        before = {n: t.clone() for n, t in d_caches.items()}
        p.start_load_kv(KVFabricMetadata(holds={"r2": Hold(slot=1, nonce=5, lease_s=1.0)}))
        bad = peer(p, key=p.handshake().kv_key ^ 1)
        d.start_load_kv(KVFabricMetadata(loads={"r2": Load([bad], 1, 9, [1, 2], [3, 4])}))
        assert until(lambda: d.get_finished(set())[1]) == {"r2"}
        assert d.get_block_ids_with_load_errors() == {1, 2}
        for name, t in d_caches.items():
            assert torch.equal(t.cpu(), before[name].cpu())
        # A wrong nonce in the slot is no acknowledgement: the lease ends the hold.
        t0 = time.monotonic()
        assert until(lambda: p.get_finished({"r2"})[0], timeout=10) == {"r2"}
        assert time.monotonic() - t0 >= 0.5
        assert p.get_stats().reduce()["lease_expired"] == 1
    finally:
        p.shutdown()
        d.shutdown()
