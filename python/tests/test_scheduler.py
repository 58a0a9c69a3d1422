"""The connector's scheduler side on vLLM's own request and block objects, with each instance's
mailbox registered with a real agent: the params a prefill hands over and the holds behind
them, which blocks a decode loads when its prefix cache already holds part of the prompt, what
happens to a request aborted while it waits, lease renewals, and params that must fail closed.
The real-vLLM tests (test_vllm.py) cover the same paths end to end; these pin the rules."""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import kvfabric  # noqa: E402
from kvfabric.vllm.layout import LayerLayout, WorkerLayout  # noqa: E402
from kvfabric.vllm.mailbox import Mailbox  # noqa: E402
from kvfabric.vllm.metadata import WorkerSegments  # noqa: E402
from kvfabric.vllm.params import handover_of  # noqa: E402
from kvfabric.vllm.scheduler import EngineInfo, Scheduler  # noqa: E402
from kvfabric.vllm.settings import Settings  # noqa: E402

BLOCK = 32


def layout(blocks_at: int = 0) -> WorkerLayout:
    """Two layers of ``[blocks, 2 heads, 32 tokens, 64 floats]``, head-major."""
    layers = tuple(
        LayerLayout(
            name=f"l{i}",
            group=0,
            dtype="float32",
            region=0,
            base=blocks_at + i * (1 << 20),
            block_stride=16384,
            tokens=BLOCK,
            token_stride=256,
            heads=(0, 2),
            head_stride=8192,
            cell=256,
        )  # fmt: skip
        for i in range(2)
    )
    return WorkerLayout(0, 0, 1, BLOCK, layers)


@pytest.fixture
def engines(agent):
    def engine(
        name: str, slots: int = 4, blocks_at: int = 0, window: int = 0, **extra
    ) -> Scheduler:
        settings = Settings.of({"socket_dir": agent.socket_dir, **extra})
        client = kvfabric.Client(agent.socket_dir)
        mailbox = Mailbox(client, f"{name}.mailbox", slots, settings)
        # A hybrid model: a full-attention group and a sliding-window one.
        groups = ((0, 0), (1, window)) if window else ((0, 0),)
        info = EngineInfo(name, name, BLOCK, 1, 1, groups, backoff=1 if window else 0)
        s = Scheduler(info, settings, mailbox)
        # The worker's KV cache, registered with the agent: holds are made on it.
        kv = client.register(f"{name}.pp0.tp0", [kvfabric.host_array(4 << 20)])
        segments.append((client, kv))
        s.set_workers({(0, 0): WorkerSegments(kv.name, kv.key, layout(blocks_at).wire())})
        made.append(s)
        return s

    made: list[Scheduler] = []
    segments: list = []
    yield engine
    for s in made:
        s.shutdown()
    for client, kv in segments:
        client.deregister(kv)


def step(s: Scheduler, finished=()):
    return s.build_connector_meta(SimpleNamespace(finished_req_ids=set(finished)))


def request(req_id: str, tokens: int, params: dict | None) -> Request:
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params})
    return Request(req_id, list(range(3, 3 + tokens)), sp, None)


def handed_over(
    p: Scheduler, req_id: str = "r1", tokens: int = 100, blocks=((4, 5, 6, 7),), computed=None
):
    """A prefill request that finished with do_remote_decode: (delay free, params)."""
    req = request(req_id, tokens, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = tokens if computed is None else computed
    return p.request_finished(req, tuple(list(g) for g in blocks))


def until(cond, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_prefill_hands_over_and_holds_a_bounded_number_of_requests(engines):
    p = engines("p", slots=2)
    delay, params = handed_over(p, "a")
    assert delay and params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_block_ids"] == [[4, 5, 6, 7]] and params["remote_engine_id"] == "p"
    h = handover_of(params)
    assert h.tokens == 100 and h.workers[0].name == "p.pp0.tp0" and h.mailbox.name == "p.mailbox"
    assert int(p.mailbox.state[h.slot]) == h.nonce  # the hold is alive
    assert handed_over(p, "b")[0]
    assert handed_over(p, "c") == (False, None)  # no slot: freed now, the decode recomputes
    assert p.get_stats().data["holds_refused"] == 1
    # The slot comes back once vLLM freed the blocks of a hold that ended.
    p.update_connector_output(SimpleNamespace(finished_recving=(), finished_sending={"a"}))
    assert handed_over(p, "d")[0]


def group(n_hits: int, n_new: int, first_id: int = 20, n_null: int = 0) -> list[KVCacheBlock]:
    """One group's blocks as vLLM hands them to update_state_after_alloc: ``n_null`` null
    blocks (outside a sliding window), prefix-cache hits (hashed), then those allocated for
    the rest."""
    blocks = [KVCacheBlock(0, is_null=True) for _ in range(n_null)]
    for i in range(n_hits + n_new):
        b = KVCacheBlock(first_id + i)
        if i < n_hits:
            b.set_block_hash(b"h%d" % i)  # any hash: it marks a cached block
        blocks.append(b)
    return blocks


def test_a_decode_is_given_a_key_to_the_requests_blocks_only_until_the_hold_ends(engines, agent):
    """The params carry a hold key, not the worker's segment key: it reads the request's
    blocks (any part of them), nothing else, and nothing once the hold ended."""
    p = engines("p")
    _, params = handed_over(p, blocks=((4, 5, 6, 7),))
    h = handover_of(params)
    segment_key = p.local[(0, 0)].kv_key
    assert h.workers[0].key != segment_key
    reader = kvfabric.Client(agent.socket_dir)
    mine = reader.register("reader", [kvfabric.host_array(1 << 20)])
    try:

        def read(block: int, base: int = 0, size: int = 16384) -> None:
            plane = [(0, base, 16384, size)]
            reader.read_blocks(mine, "p.pp0.tp0", h.workers[0].key, [(0, 0, 16384, size)],
                               plane, [0], [block])  # fmt: skip

        read(5)
        read(7, base=(1 << 20) + 8192, size=8192)  # the second layer's second head
        for block in (3, 8, 40):
            with pytest.raises(kvfabric.AgentError) as e:
                read(block)
            assert e.value.code == "PERMISSION_DENIED", e.value
        # The decode acknowledges; the prefill ends the hold and releases the blocks once no
        # read under it can land.
        p.mailbox.inbox[h.slot] = h.nonce
        until(lambda: step(p, finished={"r1"}).releases == {"r1"})
        with pytest.raises(kvfabric.AgentError) as e:
            read(5)
        assert e.value.code == "PERMISSION_DENIED"
    finally:
        reader.deregister(mine)


def test_a_request_whose_hold_the_agent_refuses_is_not_handed_over(engines):
    p = engines("p")
    # Blocks past the worker's memory: the agent refuses the hold.
    assert handed_over(p, blocks=((4, 5, 1 << 20),)) == (False, None)
    assert p.get_stats().data["holds_refused"] == 1
    assert not p.holds and handed_over(p)[0]


def alloc(n_hits: int, n_new: int, first_id: int = 20) -> KVCacheBlocks:
    return KVCacheBlocks((group(n_hits, n_new, first_id),))


@pytest.mark.parametrize("hits", [0, 1, 3])
def test_a_decode_loads_only_what_its_prefix_cache_lacks(engines, hits):
    p, d = engines("p"), engines("d", blocks_at=4096)
    _, params = handed_over(p, tokens=100)
    req = request("d1", 100, params)
    d.on_new_request(req)
    local = hits * BLOCK
    assert d.get_num_new_matched_tokens(req, local) == (100 - local, True)
    # vLLM has not yet set num_computed_tokens (it is 0 here, as in the real call).
    d.update_state_after_alloc(req, alloc(hits, 4 - hits), 100 - local)
    load = step(d).loads["d1"]
    (group,) = load.groups
    assert group.local_positions == tuple(range(hits, 4))
    assert group.local_ids == tuple(range(20 + hits, 24))
    assert group.remote_ids == (4, 5, 6, 7) and (group.first, group.end) == (0, 100)
    assert not req.kv_transfer_params["do_remote_prefill"]  # one pull per request


def test_a_sliding_window_group_loads_its_window_and_fails_closed_past_freed_blocks(engines):
    """A hybrid model: the prefill names its freed window blocks -1 and leaves the last prompt
    token to the decode; the decode loads the window group from the first token the next one
    attends to, and recomputes when a block it needs was freed there."""
    p, d = engines("p", window=64), engines("d", window=64)
    p.bind_null_block(0)
    # 200 prompt tokens; the prefill computed 199 and freed the window's blocks 0..3.
    _, params = handed_over(
        p, tokens=200, blocks=(range(1, 8), (0, 0, 0, 0, 12, 13, 14)), computed=199
    )
    assert params["remote_block_ids"][1] == [-1, -1, -1, -1, 12, 13, 14]
    req = request("d1", 200, params)
    d.on_new_request(req)
    assert d.get_num_new_matched_tokens(req, 0) == (199, True)
    # vLLM gives the window group null blocks for the 4 blocks before token 136 (199 - 64 + 1).
    d.update_state_after_alloc(
        req, KVCacheBlocks((group(0, 7), group(0, 3, first_id=40, n_null=4))), 199
    )
    full, window = step(d).loads["d1"].groups
    assert (full.local_positions, full.first, full.end) == (tuple(range(7)), 0, 199)
    assert (window.local_positions, window.local_ids) == ((4, 5, 6), (40, 41, 42))
    assert (window.first, window.end) == (136, 199)
    # A window block the decode needs was freed there: recomputed, not read.
    bad = copy.deepcopy(params)
    bad["remote_block_ids"][1][4] = -1
    req = request("d2", 200, bad)
    d.on_new_request(req)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_request_aborted_while_queued_acknowledges_without_a_load(engines):
    p, d = engines("p"), engines("d")
    _, params = handed_over(p)
    slot = params["kvfabric"]["slot"]
    req = request("d1", 100, params)
    d.on_new_request(req)
    req.status = RequestStatus.FINISHED_ABORTED
    assert d.request_finished(req, ([],)) == (False, None)
    # Nothing for the workers to report back (vLLM already freed the request).
    assert step(d).loads == {}
    until(lambda: p.mailbox.acked(slot, int(params["kvfabric"]["nonce"], 16)))
    # The prefill ends the hold at once and releases the blocks once vLLM said the request
    # finished there.
    assert step(p).releases == set()
    assert int(p.mailbox.state[slot]) == 0
    # Released once the agent confirmed no read under the request's hold can land.
    step(p, finished={"r1"})
    until(lambda: step(p).releases == {"r1"})
    assert p.get_stats().data["acked"] == 1


def test_a_decode_request_that_waits_renews_the_hold_past_its_lease(engines):
    p = engines("p", lease_s=1.0)
    d = engines("d")
    _, params = handed_over(p)
    req = request("d1", 100, params)
    d.on_new_request(req)
    step(p, finished={"r1"})
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5:  # 2.5 leases
        step(d)
        assert step(p).releases == set(), "the hold ended while the decode renewed it"
        time.sleep(0.05)
    assert d.get_stats().data["renewals"] >= 3
    # The decode stops renewing (its request finished without a load): the lease ends it.
    req.status = RequestStatus.FINISHED_ABORTED
    d.leases.clear()
    until(lambda: step(p).releases == {"r1"}, timeout=5)
    assert p.get_stats().data["lease_expired"] == 1


BAD = "invalid_params"
MALFORMED = {
    "flat block ids": (lambda k: k.__setitem__("remote_block_ids", [1, 2, 3]), BAD),
    "too few block ids": (lambda k: k["remote_block_ids"][0].__delitem__(slice(1, None)), BAD),
    "a freed block": (lambda k: k["remote_block_ids"][0].__setitem__(0, -1), BAD),
    "no kvfabric entry": (lambda k: k.pop("kvfabric"), BAD),
    "another version": (lambda k: k["kvfabric"].__setitem__("v", 99), BAD),
    "a layer of another model": (
        lambda k: k["kvfabric"]["layouts"][0][4][0].__setitem__(0, "x"), "layers",
    ),
    "a block size neither divides": (
        lambda k: k["kvfabric"]["layouts"][0].__setitem__(3, 48), "block_size",
    ),
    "slot past the mailbox": (lambda k: k["kvfabric"].__setitem__("slot", 4), BAD),
    "negative slot": (lambda k: k["kvfabric"].__setitem__("slot", -4), BAD),
    "nonce of text": (lambda k: k["kvfabric"].__setitem__("nonce", "zz"), BAD),
    "a huge token count": (lambda k: k["kvfabric"].__setitem__("tokens", 1 << 40), BAD),
    "lease ended": (lambda k: k["kvfabric"].__setitem__("expires_at", time.time() - 1), "expired"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MALFORMED))
def test_params_that_cannot_be_read_are_recomputed_and_counted_by_reason(engines, case):
    p, d = engines("p"), engines("d")
    _, good = handed_over(p)
    params = copy.deepcopy(good)
    mangle, reason = MALFORMED[case]
    mangle(params)
    req = request("d1", 100, params)
    d.on_new_request(req)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    d.update_state_after_alloc(req, alloc(0, 4), 0)
    assert step(d).loads == {}
    assert d.get_stats().data["not_pulled"] == {reason: 1}
