"""Holds through the binding against real ``kvfabric agent`` processes: a prefill grants one
request's blocks, the decode reads those with the hold's key and nothing else, and not after
the hold ended. Every byte read is checked; refused reads leave the memory as it was."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fabric import Agent

import kvfabric
from kvfabric import AgentError, InvalidArgument

BLOCK = 4096
BLOCKS = 64
# The prefill's cache: K of block b at b × BLOCK, V at (BLOCKS + b) × BLOCK of region 0.
PLANES = [(0, 0, BLOCK, BLOCK), (0, BLOCKS * BLOCK, BLOCK, BLOCK)]


def filled(nbytes: int, seed: int) -> np.ndarray:
    a = kvfabric.host_array(nbytes)
    a[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return a


def local_planes(n: int) -> list[kvfabric.Plane]:
    """The decode's side: plane i packed at i × BLOCKS blocks of its region 0."""
    return [(0, i * BLOCKS * BLOCK, BLOCK, BLOCK) for i in range(n)]


def block(a: np.ndarray, base: int, i: int) -> np.ndarray:
    return a[base + i * BLOCK : base + (i + 1) * BLOCK]


def refused(call, code: str = "PERMISSION_DENIED", *watched: np.ndarray) -> AgentError:
    before = [w.copy() for w in watched]
    with pytest.raises(AgentError) as e:
        call()
    assert e.value.code == code, e.value
    for w, b in zip(watched, before, strict=True):
        np.testing.assert_array_equal(w, b)
    return e.value


@pytest.fixture
def two_agents(etcd):
    a = Agent("agent-a", etcd=etcd.endpoint, extra=["--transports", "tcp"])
    b = Agent("agent-b", etcd=etcd.endpoint, extra=["--transports", "tcp"])
    yield a, b
    a.kill()
    b.kill()


def test_a_hold_key_reads_only_its_blocks_until_the_hold_ends(two_agents):
    a, b = two_agents
    prefill, decode = kvfabric.Client(a.socket_dir), kvfabric.Client(b.socket_dir)
    src = filled(2 * BLOCKS * BLOCK, 1)
    dst = filled(2 * BLOCKS * BLOCK, 2)
    p = prefill.register("prefill-0", [src])
    d = decode.register("decode-0", [dst])
    deadline = time.monotonic() + 10
    while "prefill-0" not in {s["name"] for s in decode.status()["segments"]}:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    hold = prefill.create_hold(p, PLANES, np.array([3, 7, 40]), ttl=60.0)
    assert isinstance(hold, int) and hold not in (0, p.key)

    # The granted blocks, K and V, as a block table.
    done = decode.read_blocks(
        d, "prefill-0", hold, local_planes(2), PLANES, np.arange(3), np.array([3, 7, 40])
    )
    assert (done.transport, done.remote_agent, done.bytes) == ("tcp", "agent-a", 6 * BLOCK)
    for k, r in enumerate([3, 7, 40]):
        np.testing.assert_array_equal(block(dst, 0, k), block(src, 0, r))
        np.testing.assert_array_equal(block(dst, BLOCKS * BLOCK, k), block(src, BLOCKS * BLOCK, r))
    # As ops: part of a granted block.
    decode.read(d, "prefill-0", hold, [0], [10 * BLOCK], [0], [7 * BLOCK + 64], [128])
    np.testing.assert_array_equal(
        dst[10 * BLOCK : 10 * BLOCK + 128], src[7 * BLOCK + 64 : 7 * BLOCK + 192]
    )

    # Outside the grant: another block, a plane of another stride, an op over two blocks, a
    # write. Nothing moves either way.
    refused(
        lambda: decode.read_blocks(
            d, "prefill-0", hold, local_planes(2), PLANES, np.arange(2), np.array([3, 4])
        ),
        "PERMISSION_DENIED",
        dst,
        src,
    )
    refused(
        lambda: decode.read_blocks(
            d, "prefill-0", hold, local_planes(1), [(0, 0, 2 * BLOCK, BLOCK)], [0], [3]
        ),
        "PERMISSION_DENIED",
        dst,
        src,
    )
    refused(
        lambda: decode.read(d, "prefill-0", hold, [0], [0], [0], [3 * BLOCK], [2 * BLOCK]),
        "PERMISSION_DENIED",
        dst,
        src,
    )
    refused(
        lambda: decode.write(d, "prefill-0", hold, [0], [0], [0], [3 * BLOCK], [BLOCK]),
        "PERMISSION_DENIED",
        dst,
        src,
    )

    # Extended, never shortened; ended, then refused.
    left = prefill.extend_hold(p, hold, 120.0)
    assert 119.0 < left <= 120.0
    assert prefill.extend_hold(p, hold, 0.001) > 119.0
    prefill.end_hold(p, hold)
    refused(
        lambda: decode.read_blocks(d, "prefill-0", hold, local_planes(1), PLANES[:1], [0], [3]),
        "PERMISSION_DENIED",
        dst,
        src,
    )
    refused(lambda: prefill.extend_hold(p, hold, 1.0), "NOT_FOUND")
    # Ending it again is no error: nothing under it can land.
    prefill.end_hold(p, hold)
    # The segment's key still reads everything.
    decode.read_blocks(d, "prefill-0", p.key, local_planes(1), PLANES[:1], [0], [4])
    np.testing.assert_array_equal(block(dst, 0, 0), block(src, 0, 4))


def test_bad_holds_name_the_field_and_holds_live_where_the_segment_is(two_agents):
    a, b = two_agents
    prefill, elsewhere = kvfabric.Client(a.socket_dir), kvfabric.Client(b.socket_dir)
    p = prefill.register("prefill-0", [kvfabric.host_array(2 * BLOCKS * BLOCK)])
    e = refused(lambda: prefill.create_hold(p, PLANES, [BLOCKS], 10.0), "INVALID_ARGUMENT")
    assert "planes[1]" in e.message, e
    e = refused(
        lambda: prefill.create_hold(p, [(0, 0, 2**62, 1)], [0, 8], 10.0), "INVALID_ARGUMENT"
    )
    assert "planes[0].stride" in e.message, e
    e = refused(lambda: prefill.create_hold(p, PLANES, [], 10.0), "INVALID_ARGUMENT")
    assert "block_ids" in e.message, e
    e = refused(lambda: prefill.create_hold(p, PLANES, [0], 7200.0), "INVALID_ARGUMENT")
    assert "ttl_ms" in e.message, e
    with pytest.raises(InvalidArgument) as bad:
        prefill.create_hold(p, PLANES, [0], 0.0)
    assert bad.value.field == "ttl"
    with pytest.raises(InvalidArgument) as bad:
        prefill.create_hold(p, PLANES, [-1], 1.0)
    assert bad.value.field.startswith("block_ids")
    # Registered through agent A: agent B makes no hold on it, and says where it lives.
    deadline = time.monotonic() + 10
    while True:
        try:
            elsewhere.create_hold(p, PLANES, [0], 10.0)
        except AgentError as err:
            assert err.code == "NOT_FOUND", err
            if "agent-a" in err.message:
                break
        assert time.monotonic() < deadline, "agent B never learned where the segment is"
        time.sleep(0.05)


def test_the_awaitable_calls(agent):
    async def run() -> None:
        client = kvfabric.Client(agent.socket_dir)
        src = filled(2 * BLOCKS * BLOCK, 3)
        dst = kvfabric.host_array(2 * BLOCKS * BLOCK)
        p = client.register("prefill-0", [src])
        d = client.register("decode-0", [dst])
        hold = await client.create_hold_async(p, PLANES, [5], 30.0)
        await client.read_blocks_async(d, "prefill-0", hold, local_planes(2), PLANES, [0], [5])
        np.testing.assert_array_equal(block(dst, 0, 0), block(src, 0, 5))
        assert await client.extend_hold_async(p, hold, 60.0) > 59.0
        await client.end_hold_async(p, hold, timeout=2.0)
        with pytest.raises(AgentError) as e:
            await client.read_blocks_async(
                d, "prefill-0", hold, local_planes(1), PLANES[:1], [1], [5]
            )
        assert e.value.code == "PERMISSION_DENIED"

    asyncio.run(run())
