"""The connector's scheduler side on its own: which decode requests it pulls for, and the params
a prefill request finishes with."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvfabric.vllm.metadata import WorkerSegments  # noqa: E402
from kvfabric.vllm.scheduler import Scheduler  # noqa: E402
from kvfabric.vllm.settings import Settings  # noqa: E402

LAYOUT = ((0, 0, 4096, 4096), (0, 1 << 20, 4096, 4096))


def scheduler(max_held: int = 4) -> Scheduler:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="engine-p"),
        cache_config=SimpleNamespace(block_size=32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    s = Scheduler(
        config,
        Settings.of({"socket_dir": "/nonexistent", "lease_s": 30, "max_held_requests": max_held}),
    )
    s.set_workers({0: WorkerSegments("engine-p.tp0", 0x1234, "engine-p.tp0.acks", 0x99, LAYOUT)})
    return s


def finished(s: Scheduler, req_id: str = "r1", blocks=(4, 5, 6)):
    req = SimpleNamespace(
        request_id=req_id,
        kv_transfer_params={"do_remote_decode": True},
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=70,
    )
    return s.request_finished(req, list(blocks))


def test_prefill_params_name_the_workers_segments_and_hold_the_blocks():
    s = scheduler()
    delay, params = finished(s)
    assert delay and params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_block_ids"] == [[4, 5, 6]]
    fab = params["kvfabric"]
    assert fab["workers"] == [
        {
            "kv": "engine-p.tp0",
            "kv_key": "0000000000001234",
            "acks": "engine-p.tp0.acks",
            "acks_key": "0000000000000099",
        }
    ]
    assert fab["layout"] == [list(p) for p in LAYOUT]
    hold = s.build_connector_meta(None).holds["r1"]
    assert (hold.slot, hold.nonce) == (fab["slot"], int(fab["nonce"], 16))


def test_holds_are_bounded_and_slots_come_back():
    s = scheduler(max_held=2)
    assert finished(s, "a")[0] and finished(s, "b")[0]
    assert finished(s, "c") == (False, None)  # no slot: freed now, the decode recomputes
    s.update_connector_output(SimpleNamespace(finished_sending={"a"}))
    assert finished(s, "d")[0]


def decode_request(params, n=70):
    return SimpleNamespace(
        request_id="d1", kv_transfer_params=params, num_prompt_tokens=n, num_computed_tokens=0
    )


def test_decode_pulls_only_matching_unexpired_params():
    p = scheduler()
    _, params = finished(p)
    d = scheduler()
    assert d.get_num_new_matched_tokens(decode_request(dict(params)), 0) == (70, True)
    other = dict(params, kvfabric=dict(params["kvfabric"], layout=[[0, 0, 8192, 8192]]))
    assert d.get_num_new_matched_tokens(decode_request(other), 0) == (0, False)
    late = dict(params, kvfabric=dict(params["kvfabric"], expires_at=time.time() + 0.5))
    assert d.get_num_new_matched_tokens(decode_request(late), 0) == (0, False)
    assert d.get_num_new_matched_tokens(decode_request({"do_remote_prefill": True}), 0) == (
        0,
        False,
    )
    # The pull: remote blocks onto the blocks vLLM allocated.
    req = decode_request(dict(params))
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12],))
    d.update_state_after_alloc(req, blocks, 70)
    load = d.build_connector_meta(None).loads["d1"]
    assert (load.local_block_ids, load.remote_block_ids) == ([10, 11, 12], [4, 5, 6])
    assert not req.kv_transfer_params["do_remote_prefill"]  # one pull per request
