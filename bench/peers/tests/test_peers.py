"""The parts of the peer benchmark that need no engine: contents, verification, the work's
shape, the control channel's bounds and the table."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from peers import control, table
from peers.errors import PeerError
from peers.pool import HostPool
from peers.work import Shape, Slots

BS = 4096


def _copy(dst: HostPool, d: int, src: HostPool, s: int) -> None:
    dst.array[d * BS : (d + 1) * BS] = src.array[s * BS : (s + 1) * BS]


def test_verify_passes_a_correct_pool_and_catches_each_kind_of_wrong_block() -> None:
    src, dst = HostPool(64 * BS, BS), HostPool(64 * BS, BS)
    src.fill(1)
    dst.fill(2)
    source_of = np.full(64, -1, dtype=np.int64)
    for d, s in ((3, 5), (10, 10), (63, 0)):
        _copy(dst, d, src, s)
        source_of[d] = s
    assert dst.verify(source_of, 1, 2).mismatches == 0

    flipped = HostPool(64 * BS, BS)
    flipped.array[:] = dst.array
    flipped.array[3 * BS + 7] ^= 1
    v = flipped.verify(source_of, 1, 2)
    assert (v.mismatches, v.first) == (1, "destination block 3 should hold source block 5")

    misplaced = HostPool(64 * BS, BS)
    misplaced.array[:] = dst.array
    _copy(misplaced, 10, src, 11)
    assert misplaced.verify(source_of, 1, 2).mismatches == 1

    stray = HostPool(64 * BS, BS)
    stray.array[:] = dst.array
    _copy(stray, 20, src, 20)  # a write nobody asked for lands in a poisoned block
    v = stray.verify(source_of, 1, 2)
    assert v.mismatches == 1 and "block 20 should hold poison" in (v.first or "")


def test_pools_of_different_seeds_share_no_block_and_no_block_repeats() -> None:
    a, b = HostPool(32 * BS, BS), HostPool(32 * BS, BS)
    a.fill(7)
    b.fill(8)
    blocks = {bytes(p.array[i * BS : (i + 1) * BS]) for p in (a, b) for i in range(32)}
    assert len(blocks) == 64


def test_slots_own_disjoint_destinations_and_remember_the_last_source() -> None:
    shape = Shape("read", 256 * BS, BS, per_batch=16, inflight=4, seconds=1.0)
    shape.validate()
    slots = Slots(shape, seed=3)
    owner: dict[int, int] = {}
    last: dict[int, int] = {}
    for _ in range(20):
        for k in range(4):
            batch = slots.next(k)
            assert len(set(batch.local.tolist())) == 16, "destinations distinct within a batch"
            for d, s in zip(batch.local.tolist(), batch.remote.tolist(), strict=True):
                assert owner.setdefault(d, k) == k, f"block {d} in two slots"
                last[d] = s
    assert all(slots.source_of[d] == s for d, s in last.items())
    assert (slots.source_of >= 0).sum() == len(last)


def test_write_batches_push_into_the_targets_blocks() -> None:
    shape = Shape("write", 64 * BS, BS, per_batch=4, inflight=2, seconds=1.0)
    batch = Slots(shape, seed=1).next(1)
    assert all(d % 2 == 1 for d in batch.remote.tolist())


def test_a_pool_too_small_for_the_batches_in_flight_is_refused_naming_the_field() -> None:
    with pytest.raises(PeerError, match="pool-bytes"):
        Shape("read", 64 * BS, BS, per_batch=32, inflight=4, seconds=1.0).validate()


def test_control_refuses_an_oversized_header_before_reading_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", control.MAX_HEADER + 1))
        with pytest.raises(PeerError, match="header"):
            control.recv(b)


def test_control_tokens_must_match_exactly() -> None:
    assert control.authentic({"token": "s3cret-token-0001"}, "s3cret-token-0001")
    assert not control.authentic({"token": "s3cret-token-0002"}, "s3cret-token-0001")
    assert not control.authentic({}, "s3cret-token-0001")


def test_table_puts_peers_beside_kvfabric_with_the_ratio() -> None:
    base = {
        "path": "loopback",
        "op": "read",
        "block_size": 65536,
        "blocks_per_batch": 1024,
        "inflight": 4,
        "verified": True,
        "p50_us": 1000.0,
    }
    rows = [
        {**base, "engine": "kvfabric", "gbps": 4.0},
        {**base, "engine": "nixl", "gbps": 2.0},
        {**base, "engine": "mooncake", "error": "boom", "verified": False},
    ]
    text = table.render(rows)
    assert "2.00×" in text
    assert "failed" in text and "mooncake loopback read 64 KiB: boom" in text
