"""The binding against a real ``kvfabric agent`` (in-memory registry): every byte moved is
checked against what was written."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from fabric import Agent

import kvfabric
from kvfabric import AgentError, InvalidArgument

BLOCK = 4096


def filled(nbytes: int, seed: int) -> np.ndarray:
    a = kvfabric.host_array(nbytes)
    a[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return a


def test_five_columns_pull_and_push_move_exactly_the_named_bytes(agent):
    client = kvfabric.Client(agent.socket_dir)
    src = filled(64 * BLOCK, 1)
    dst = kvfabric.host_array(64 * BLOCK)
    p = client.register("prefill-0", [src])
    d = client.register("decode-0", [dst])
    lo = np.array([0, 5, 9], dtype=np.int64) * BLOCK
    ro = np.array([7, 2, 63], dtype=np.uint64) * BLOCK
    lengths = np.array([BLOCK, 100, BLOCK], dtype=np.uint32)
    done = client.read(d, "prefill-0", p.key, np.zeros(3, np.uint32), lo, [0, 0, 0], ro, lengths)
    assert done.bytes == 2 * BLOCK + 100 and done.ops == 3
    expect = np.zeros_like(dst)
    for l_, r_, n in zip(lo, ro, lengths, strict=True):
        expect[l_ : l_ + n] = src[r_ : r_ + n]
    np.testing.assert_array_equal(dst, expect)

    # Push local block 0 into remote block 1.
    before = src.copy()
    client.write(d, "prefill-0", p.key, [0], [0], [0], [BLOCK], [BLOCK])
    before[BLOCK : 2 * BLOCK] = dst[:BLOCK]
    np.testing.assert_array_equal(src, before)


def test_block_tables_over_planes_move_2048_blocks_of_every_plane(agent):
    client = kvfabric.Client(agent.socket_dir)
    blocks, block, layers = 2048, 512, 3
    # Remote: one region per layer laid out [K blocks | V blocks]; local: K and V interleaved
    # per block in one region, a different layout on each side.
    remote = [filled(2 * blocks * block, 10 + i) for i in range(layers)]
    local = kvfabric.host_array(layers * 2 * blocks * block)
    r = client.register("p", remote)
    d = client.register("d", [local])
    rng = np.random.default_rng(3)
    remote_ids = rng.permutation(blocks)
    local_ids = rng.permutation(blocks)
    remote_planes, local_planes = [], []
    for layer in range(layers):
        for kv in range(2):
            remote_planes.append((layer, kv * blocks * block, block, block))
            local_planes.append((0, (layer * 2 + kv) * block, layers * 2 * block, block))
    done = client.read_blocks(d, "p", r.key, local_planes, remote_planes, local_ids, remote_ids)
    assert done.ops == layers * 2 * blocks
    assert done.bytes == layers * 2 * blocks * block
    view = local.reshape(blocks, layers, 2, block)
    for layer in range(layers):
        src = remote[layer].reshape(2, blocks, block)
        for kv in range(2):
            np.testing.assert_array_equal(view[local_ids, layer, kv], src[kv, remote_ids])


def test_awaitables_run_concurrently_and_match_the_sync_result(agent):
    client = kvfabric.Client(agent.socket_dir)
    src = filled(32 * BLOCK, 5)
    dsts = [kvfabric.host_array(32 * BLOCK) for _ in range(4)]
    p = client.register("src", [src])
    segs = [client.register(f"dst-{i}", [d]) for i, d in enumerate(dsts)]
    plane = [(0, 0, BLOCK, BLOCK)]

    async def main():
        ids = np.arange(32)
        return await asyncio.gather(
            *[
                client.read_blocks_async(s, "src", p.key, plane, plane, ids, ids[::-1].copy())
                for s in segs
            ],
            client.status_async(),
        )

    *transfers, status = asyncio.run(main())
    assert all(t.bytes == 32 * BLOCK for t in transfers)
    want = src.reshape(32, BLOCK)[::-1].reshape(-1)
    for d in dsts:
        np.testing.assert_array_equal(d, want)
    assert {s["name"] for s in status["segments"]} >= {"src", "dst-0"}


def test_agent_errors_carry_the_grpc_code_and_the_agents_message(agent):
    client = kvfabric.Client(agent.socket_dir)
    src = filled(4 * BLOCK, 7)
    dst = kvfabric.host_array(4 * BLOCK)
    p = client.register("owner", [src])
    d = client.register("reader", [dst])
    plane = [(0, 0, BLOCK, BLOCK)]
    with pytest.raises(AgentError) as e:
        client.read_blocks(d, "owner", p.key ^ 1, plane, plane, [0], [0])
    assert e.value.code == "PERMISSION_DENIED" and e.value.grpc_code == 7
    assert e.value.call == "Submit" and "owner" in e.value.message
    with pytest.raises(AgentError) as e:
        client.read_blocks(d, "nobody", 1, plane, plane, [0], [0])
    assert e.value.code == "NOT_FOUND" and "nobody" in e.value.message
    # Past the end of the remote region: refused, and nothing written.
    with pytest.raises(AgentError) as e:
        client.read_blocks(d, "owner", p.key, plane, plane, [0, 1], [0, 4])
    assert e.value.code == "INVALID_ARGUMENT"
    assert not dst.any()
    with pytest.raises(AgentError) as e:
        client.register("owner", [kvfabric.host_array(BLOCK)])
    assert e.value.code == "ALREADY_EXISTS"
    # The agent keeps serving.
    client.read_blocks(d, "owner", p.key, plane, plane, [3], [2])
    np.testing.assert_array_equal(dst[3 * BLOCK :], src[2 * BLOCK : 3 * BLOCK])


def test_bad_arrays_are_refused_naming_the_field_before_anything_is_sent(agent):
    client = kvfabric.Client(agent.socket_dir)
    d = client.register("d", [kvfabric.host_array(BLOCK)])
    plane = [(0, 0, BLOCK, BLOCK)]
    cases = {
        "local_block_ids[1]": lambda: kvfabric.block_table(plane, plane, [0, -1], [0, 0]),
        "remote_block_ids": lambda: kvfabric.block_table(plane, plane, [0, 1], [0]),
        "local_block_ids": lambda: kvfabric.block_table(plane, plane, np.zeros((2, 2)), [0]),
        "remote_planes[0].block_bytes": lambda: kvfabric.block_table(
            plane, [(0, 0, BLOCK, 8)], [0], [0]
        ),
        "remote_offsets": lambda: kvfabric.columns([0], [0], [0], [0, 1], [8]),
        "local_regions[0]": lambda: kvfabric.columns([2**33], [0], [0], [0], [8]),
        "lengths": lambda: kvfabric.columns([0], [0], [0], [0], [1.5]),
        "timeout": lambda: client.read(d, "d", d.key, [0], [0], [0], [0], [8], timeout=-1),
    }
    for field, call in cases.items():
        with pytest.raises(InvalidArgument) as e:
            call()
        assert e.value.field == field, (field, str(e.value))
        assert isinstance(e.value, ValueError)


def test_tensors_and_arrays_register_only_in_kvfabric_memory(agent):
    torch = pytest.importorskip("torch")
    client = kvfabric.Client(agent.socket_dir)
    t = kvfabric.host_tensor((8, BLOCK // 4), torch.float32)
    t.normal_()
    plain = torch.randn(8, BLOCK // 4)
    moved = plain.clone()
    kvfabric.move_to_host_buffer(moved)
    assert torch.equal(moved, plain)  # same values, now in kvfabric memory
    out = kvfabric.host_array(8 * BLOCK)
    src = client.register("tensors", [t, moved])
    dst = client.register("array", [out])
    ids = np.arange(8)
    for region, want in ((0, t), (1, moved)):
        client.read_blocks(
            dst, "tensors", src.key, [(0, 0, BLOCK, BLOCK)], [(region, 0, BLOCK, BLOCK)], ids, ids
        )
        np.testing.assert_array_equal(out.view(np.float32).reshape(8, -1), want.numpy())
    with pytest.raises(InvalidArgument) as e:
        client.register("plain", [kvfabric.host_array(4), torch.zeros(4)])
    assert e.value.field == "regions[1]"
    with pytest.raises(InvalidArgument) as e:
        client.register("plain", [np.zeros(4)])
    assert e.value.field == "regions[0]"
    with pytest.raises(InvalidArgument) as e:
        client.register("offset", [out[8:]])
    assert "starts 8 bytes" in str(e.value)


def test_watch_sees_segments_come_and_go_and_status_lists_them(agent):
    client = kvfabric.Client(agent.socket_dir)
    client.register("first", [kvfabric.host_array(BLOCK)])
    watch = client.watch()
    ev = watch.next(timeout=5)
    assert (ev.kind, ev.name, ev.agent) == ("put", "first", agent.name)
    second = client.register("second", [kvfabric.host_array(2 * BLOCK)])
    ev = watch.next(timeout=5)
    assert (ev.kind, ev.name, [r.len for r in ev.regions]) == ("put", "second", [2 * BLOCK])
    client.deregister(second)
    ev = watch.next(timeout=5)
    assert (ev.kind, ev.name) == ("deleted", "second")
    assert watch.next(timeout=0.2) is None
    names = {s["name"] for s in client.status()["segments"]}
    assert names == {"first"}

    async def first_async():
        w = client.watch()
        return await w.__anext__()

    assert asyncio.run(first_async()).name == "first"


def test_waiting_releases_the_gil(agent):
    client = kvfabric.Client(agent.socket_dir)
    watch = client.watch()
    count = 0
    stop = threading.Event()

    def spin():
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.1)
        before = count
        assert watch.next(timeout=1.0) is None  # nothing registered: waits the whole second
        during = count - before
    finally:
        stop.set()
        t.join()
    assert during > 10_000, during


def test_no_agent_is_unavailable_and_a_restarted_agent_is_reached_again(tmp_path):
    with pytest.raises(AgentError) as e:
        kvfabric.Client(tmp_path)
    assert e.value.code == "UNAVAILABLE" and e.value.call == "connect"
    a = Agent(socket_dir=str(tmp_path))
    try:
        client = kvfabric.Client(tmp_path)
        client.register("x", [kvfabric.host_array(BLOCK)])
        a.restart()
        deadline = time.monotonic() + 10
        while True:
            try:
                status = client.status()
                break
            except AgentError as err:
                assert err.code == "UNAVAILABLE", err
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert status["segments"] == []
        client.register("x", [kvfabric.host_array(BLOCK)])
    finally:
        a.kill()


def test_two_agents_over_etcd_and_tcp(etcd):
    a = Agent("agent-a", etcd=etcd.endpoint, extra=["--transports", "tcp"])
    b = Agent("agent-b", etcd=etcd.endpoint, extra=["--transports", "tcp"])
    try:
        ca, cb = kvfabric.Client(a.socket_dir), kvfabric.Client(b.socket_dir)
        src = filled(256 * BLOCK, 11)
        dst = kvfabric.host_array(256 * BLOCK)
        p = ca.register("prefill-a", [src])
        d = cb.register("decode-b", [dst])
        deadline = time.monotonic() + 10
        while "prefill-a" not in {s["name"] for s in cb.status()["segments"]}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ids = np.arange(256)
        done = cb.read_blocks(
            d,
            "prefill-a",
            p.key,
            [(0, 0, BLOCK, BLOCK)],
            [(0, 0, BLOCK, BLOCK)],
            ids,
            ids[::-1].copy(),
            checksum=True,
        )
        assert (done.transport, done.remote_agent) == ("tcp", "agent-a")
        np.testing.assert_array_equal(dst.reshape(256, -1), src.reshape(256, -1)[::-1])
    finally:
        a.kill()
        b.kill()


def test_the_active_opentelemetry_span_is_the_agents_parent(tmp_path):
    otlp = pytest.importorskip("otlp_receiver")
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    receiver = otlp.Receiver()
    a = Agent(extra=["--otlp-endpoint", receiver.endpoint])
    try:
        provider = sdk.TracerProvider()
        tracer = provider.get_tracer("test")
        client = kvfabric.Client(a.socket_dir)
        src = client.register("s", [filled(BLOCK, 1)])
        dst = client.register("d", [kvfabric.host_array(BLOCK)])
        with tracer.start_as_current_span("caller") as span:
            client.read(dst, "s", src.key, [0], [0], [0], [0], [BLOCK])
            ctx = span.get_span_context()
        got = receiver.wait_for("kvfabric.agent.submit", timeout=20)
        assert got.trace_id == ctx.trace_id.to_bytes(16, "big")
        assert got.parent_span_id == ctx.span_id.to_bytes(8, "big")
    finally:
        a.kill()
        receiver.stop()


def test_close_ends_a_watch_another_thread_waits_on(agent):
    client = kvfabric.Client(agent.socket_dir)
    watch = client.watch()
    got: list = []
    t = threading.Thread(target=lambda: got.append(list(watch)))  # blocks: no events come
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    watch.close()
    t.join(5)
    assert not t.is_alive() and got == [[]]
    assert time.monotonic() - t0 < 5
    assert watch.next(timeout=0.1) is None


def test_pulls_run_without_python_and_report_the_checked_word(agent):
    """``Pulls``: batches, then one word that must equal what was expected; every byte moved
    is checked, a word that differs fails the pull, and a bad word offset is refused."""
    client = kvfabric.Client(agent.socket_dir)
    src = filled(64 * BLOCK, 21)
    words = kvfabric.host_array(16)
    words[:8] = np.frombuffer(np.uint64(0xC0FFEE).tobytes(), np.uint8)
    scratch = kvfabric.HostBuffer(16)
    dst = kvfabric.host_array(64 * BLOCK)
    p = client.register("pulls-src", [src, words])
    d = client.register("pulls-dst", [dst, scratch])
    plane = [(0, 0, BLOCK, BLOCK)]
    ids = np.arange(64)
    table = kvfabric.block_table(plane, plane, ids, ids[::-1].copy())
    check = kvfabric.columns([1], [8], [1], [0], [8])
    pulls = client.pulls()
    pulls.start("good", d, [("pulls-src", p.key, table)], 10.0,
                ("pulls-src", p.key, check), 5.0, scratch, 8, 0xC0FFEE)  # fmt: skip
    pulls.start("stale", d, [("pulls-src", p.key, table)], 10.0,
                ("pulls-src", p.key, check), 5.0, scratch, 8, 0xBAD)  # fmt: skip
    pulls.start("refused", d, [("pulls-src", p.key + 1, table)], 10.0,
                ("pulls-src", p.key, check), 5.0, scratch, 8, 0xC0FFEE)  # fmt: skip
    got: dict[str, kvfabric.Pulled] = {}
    deadline = time.monotonic() + 30
    while len(got) < 3:
        assert time.monotonic() < deadline, got
        got |= {x.id: x for x in pulls.take()}
        time.sleep(0.01)
    assert got["good"].reason == "" and got["good"].bytes == 64 * BLOCK, got["good"]
    np.testing.assert_array_equal(dst.reshape(64, BLOCK), src.reshape(64, BLOCK)[::-1])
    assert got["stale"].reason == "hold_ended" and got["stale"].bytes == 0
    assert got["refused"].reason == "permission_denied", got["refused"]
    assert pulls.take() == []
    with pytest.raises(InvalidArgument) as e:
        pulls.start("x", d, [], 1.0, ("pulls-src", p.key, check), 1.0, scratch, 9, 0)
    assert e.value.field == "word"
