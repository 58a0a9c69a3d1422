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
    made = []

    def engine(name: str, slots: int = 4, blocks_at: int = 0, **extra) -> Scheduler:
        settings = Settings.of({"socket_dir": agent.socket_dir, **extra})
        client = kvfabric.Client(agent.socket_dir)
        mailbox = Mailbox(client, f"{name}.mailbox", slots, settings)
        s = Scheduler(EngineInfo(name, name, BLOCK, 1, 1), settings, mailbox)
        s.set_workers({(0, 0): WorkerSegments(f"{name}.pp0.tp0", 0x1234, layout(blocks_at).wire())})
        made.append(s)
        return s

    yield engine
    for s in made:
        s.shutdown()


def step(s: Scheduler, finished=()):
    return s.build_connector_meta(SimpleNamespace(finished_req_ids=set(finished)))


def request(req_id: str, tokens: int, params: dict | None) -> Request:
    sp = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params})
    return Request(req_id, list(range(3, 3 + tokens)), sp, None)


def handed_over(p: Scheduler, req_id: str = "r1", tokens: int = 100, blocks=(4, 5, 6, 7)):
    """A prefill request that finished with do_remote_decode: (delay free, params)."""
    req = request(req_id, tokens, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = tokens
    return p.request_finished(req, (list(blocks),))


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


def alloc(n_hits: int, n_new: int, first_id: int = 20) -> KVCacheBlocks:
    """What vLLM hands update_state_after_alloc: the request's blocks, the first ``n_hits``
    prefix-cache hits (hashed), then those allocated for the rest."""
    blocks = []
    for i in range(n_hits + n_new):
        b = KVCacheBlock(first_id + i)
        if i < n_hits:
            b.set_block_hash(b"h%d" % i)  # any hash: it marks a cached block
        blocks.append(b)
    return KVCacheBlocks((blocks,))


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
    assert step(p, finished={"r1"}).releases == {"r1"}
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
