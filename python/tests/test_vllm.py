"""The connector in real vLLM processes (CPU build), run as an operator runs them: vLLM's
defaults (prefix caching on everywhere), a decode instance smaller than its prefill (another
number of blocks, so other plane offsets), clients that disconnect. A prefill and a decode
vLLM each talk to their own kvfabric agent; the agents find each other through etcd and move
the blocks over tcp.

Every output is compared token for token with a single instance of the same model that no
connector touches; the decode side is shown to use the transferred KV (vLLM's external
prefix-cache hits, and a prefill with other weights changing its output); and the faults: a
failed pull is recomputed, malformed params fail closed, aborted requests leave the decode
serving with every block freed, a decode queued past the lease keeps the hold alive, unpulled
blocks are freed after the lease, agents restarted between requests and under a stream of
hand-overs serve again without a wrong token, a prefill killed before the pull does not hang
the decode, and a decode killed mid-pull leaves its prefill freeing the blocks at lease end.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from fabric import Agent, Etcd  # noqa: E402
from tiny_llama import write  # noqa: E402
from vllm_server import (  # noqa: E402
    BLOCK_SIZE,
    HITS,
    USAGE,
    VllmServer,
    prefill,
    prompt,
    pulls,
    start,
    tokens,
    wait_free,
)

pytestmark = pytest.mark.vllm

# Shorter than a block, several whole blocks, several blocks and a part.
LENGTHS = (7, 3 * BLOCK_SIZE, 4 * BLOCK_SIZE + 5)
NEW_TOKENS = 12
LEASE_S = 8.0


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model, other = write(root / "model-a", seed=0), write(root / "model-b", seed=1)
    etcd = Etcd()
    agents = {
        side: Agent(f"agent-{side}", etcd=etcd.endpoint, extra=["--transports", "tcp"])
        for side in ("p", "d")
    }
    servers = {
        # Two prefill instances: the real one, and a control whose weights differ.
        "prefill": VllmServer(
            "prefill", model, root, "kv_producer", agents["p"].socket_dir, {"lease_s": LEASE_S}
        ),
        "control": VllmServer(
            "control", other, root, "kv_producer", agents["p"].socket_dir, {"lease_s": LEASE_S}
        ),
        # Half the prefill's KV cache: other block counts, so other offsets of every plane.
        "decode": VllmServer(
            "decode",
            model,
            root,
            "kv_consumer",
            agents["d"].socket_dir,
            {"load_timeout_s": 5.0},
            kv_bytes=32 << 20,
        ),
        # What every output is compared with: the same model, no connector.
        "single": VllmServer("single", model, root),
    }
    try:
        start(*servers.values())
        yield {"agents": agents, "etcd": etcd, "root": root, **servers}
    finally:
        for s in servers.values():
            s.stop()
        for a in agents.values():
            a.kill()
        etcd.stop()


def expected(pd, p: list[int], n: int = NEW_TOKENS) -> list[int]:
    return tokens(pd["single"].complete(p, n))


def pulled(pd, out: dict) -> bool:
    """Whether the decode worker logged a completed pull for this response's request."""
    return pulls(pd["decode"], out) > 0


def disaggregated(pd, p: list[int], source: str = "prefill", n: int = NEW_TOKENS):
    """Prefill there, decode here; also how many prompt tokens the decode instance took from
    the connector (vLLM's external prefix-cache hits)."""
    params = prefill(pd[source], p)
    before = pd["decode"].metric(HITS)
    out = pd["decode"].complete(p, n, params)
    return params, out, pd["decode"].metric(HITS) - before


def test_decode_outputs_equal_a_single_instance_token_for_token(pd):
    for i, n in enumerate(LENGTHS):
        p = prompt(n, i)
        params, out, hits = disaggregated(pd, p)
        assert params["do_remote_prefill"] and params["kvfabric"]
        assert len(params["remote_block_ids"][0]) == -(-n // BLOCK_SIZE)
        assert tokens(out) == expected(pd, p), n
        # The decode (another size than the prefill) took the prompt's KV from the prefill:
        # the pull completed, and vLLM counts the prompt's tokens as hits from the connector.
        assert pulled(pd, out), n
        assert hits == n, (n, hits)


def test_prompts_sharing_prefixes_decode_as_a_single_instance(pd):
    """The decode's own prefix cache holds a shared prefix (pulled or computed there): only the
    rest is pulled, into the blocks vLLM allocated for it, and no cached block is written."""
    seed = 1000
    for shared in (BLOCK_SIZE, 2 * BLOCK_SIZE + 7, 3 * BLOCK_SIZE):
        cached = shared // BLOCK_SIZE * BLOCK_SIZE
        for order in ("pull,pull", "direct,pull", "pull,direct", "pull,same", "pull,prefix"):
            seed += 10
            base = prompt(shared, seed)
            a = base + prompt(BLOCK_SIZE + 3, seed + 1)
            b = {
                "same": a,
                "prefix": base,
            }.get(order.split(",")[1], base + prompt(2 * BLOCK_SIZE + 5, seed + 2))
            first, second = order.split(",")
            if first == "pull":
                _, out, hits = disaggregated(pd, a)
                assert pulled(pd, out) and hits == len(a)
            else:
                out = pd["decode"].complete(a, NEW_TOKENS)
            assert tokens(out) == expected(pd, a), (shared, order, "first")
            if second == "direct":
                out = pd["decode"].complete(b, NEW_TOKENS)
                assert tokens(out) == expected(pd, b), (shared, order)
                continue
            _, out, hits = disaggregated(pd, b)
            assert tokens(out) == expected(pd, b), (shared, order)
            # What the decode had cached was used; only the rest came from the prefill.
            local = min(cached, (len(b) - 1) // BLOCK_SIZE * BLOCK_SIZE)
            if second == "same":
                local = (len(a) - 1) // BLOCK_SIZE * BLOCK_SIZE
            assert hits == len(b) - local, (shared, order, hits, local)


def test_the_decode_side_computes_on_the_transferred_kv(pd):
    """A prefill instance with other weights hands over other KV: the decode's output changes."""
    changed = 0
    for i, n in enumerate(LENGTHS):
        p = prompt(n, 100 + i)
        _, out, hits = disaggregated(pd, p, source="control")
        assert pulled(pd, out) and hits == n
        changed += tokens(out) != expected(pd, p)
    assert changed == len(LENGTHS), changed


def test_a_failed_pull_is_recomputed_by_vllm(pd):
    p = prompt(LENGTHS[-1], 7)
    params = prefill(pd["prefill"], p)
    worker = params["kvfabric"]["workers"][0]
    worker[1] = f"{int(worker[1], 16) ^ 1:016x}"  # a key the owner never gave
    failures = pd["decode"].metric("vllm:kvfabric_pull_failures_total")
    out = pd["decode"].complete(p, NEW_TOKENS, params)
    assert tokens(out) == expected(pd, p)
    assert not pulled(pd, out)
    assert "failed (permission_denied), vLLM recomputes" in pd["decode"].log()
    deadline = time.monotonic() + 30
    while pd["decode"].metric("vllm:kvfabric_pull_failures_total") == failures:
        assert time.monotonic() < deadline, "no pull failure in the decode's metrics"
        time.sleep(0.5)


MALFORMED = {
    "flat block ids": lambda k: k.__setitem__("remote_block_ids", [1, 2, 3]),
    "too few block ids": lambda k: k["remote_block_ids"][0].__delitem__(slice(1, None)),
    "a freed block": lambda k: k["remote_block_ids"][0].__setitem__(0, -1),
    "no kvfabric entry": lambda k: k.pop("kvfabric"),
    "a layer of another model": lambda k: k["kvfabric"]["layouts"][0][4][0].__setitem__(0, "x"),
    "a block size neither divides": lambda k: k["kvfabric"]["layouts"][0].__setitem__(3, 48),
    "negative slot": lambda k: k["kvfabric"].__setitem__("slot", -4),
    "nonce of text": lambda k: k["kvfabric"].__setitem__("nonce", "zz"),
}


def test_malformed_params_fail_closed_and_say_why_once(pd):
    """Params a router mangled are never taken as computed KV: the decode recomputes, says why
    once per reason, and counts every request."""
    p = prompt(LENGTHS[-1], 11)
    want = expected(pd, p)
    good = prefill(pd["prefill"], p)
    for name, mangle in MALFORMED.items():
        params = copy.deepcopy(good)
        mangle(params)
        before = pd["decode"].metric(HITS)
        out = pd["decode"].complete(p, NEW_TOKENS, params)
        assert tokens(out) == want, name
        assert not pulled(pd, out), name
        # Nothing counted as transferred, except the blocks a pull really brought.
        assert pd["decode"].metric(HITS) == before, name
    # The same mangling again: counted again, not said again.
    params = copy.deepcopy(good)
    MALFORMED["a layer of another model"](params)
    assert tokens(pd["decode"].complete(p, NEW_TOKENS, params)) == want
    log = pd["decode"].log()
    assert log.count("not pulled from prefill: layers:") == 1, log[-3000:]
    assert pd["decode"].metric("vllm:kvfabric_not_pulled_total", reason="layers") >= 2
    for reason in ("invalid_params", "layers", "block_size"):
        assert pd["decode"].metric("vllm:kvfabric_not_pulled_total", reason=reason) >= 1, reason


def test_clients_that_disconnect_leave_the_decode_serving(pd):
    """Handed-over requests whose clients hang up while queued, while their pull is in flight,
    and while decoding — more of them than the decode's KV cache holds at once: the decode
    stays up, frees every block, and the next hand-over is correct."""
    decode = pd["decode"]
    wait_free(decode)
    n = 3000  # 94 blocks: the decode holds 10 such requests at once, the test sends 16
    prompts = [prompt(n, 3000 + i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        handed = list(pool.map(lambda p: (p, prefill(pd["prefill"], p)), prompts))
    # The prefill's agent stops answering for longer than a pull's timeout: pulls in flight
    # stall, then fail; requests without blocks wait.
    agent = pd["agents"]["p"].proc
    agent.send_signal(signal.SIGSTOP)
    try:
        delays = [0.0, 0.2, 0.5, 1.0, 2.0, 3.0]
        gone = [
            decode.abandon(p, 64, params, delays[i % len(delays)])
            for i, (p, params) in enumerate(handed[:12])
        ]
        with ThreadPoolExecutor(4) as pool:
            kept = [
                pool.submit(decode.complete, p, NEW_TOKENS, params, 180)
                for p, params in handed[12:]
            ]
            time.sleep(6.0)
            agent.send_signal(signal.SIGCONT)
            # Those whose clients wait: pulled after all, or recomputed; the same tokens.
            for (p, _), out in zip(handed[12:], kept, strict=True):
                assert tokens(out.result()) == expected(pd, p)
    finally:
        agent.send_signal(signal.SIGCONT)
    for t in gone:
        t.join(60)
    # Clients that hang up mid-decode.
    decoding = [
        decode.abandon(p, 400, prefill(pd["prefill"], p), 1.5)
        for p in (prompt(500, 4000 + i) for i in range(6))
    ]
    for t in decoding:
        t.join(60)
    wait_free(decode)
    assert decode.alive(), decode.log()[-3000:]
    assert "EngineDeadError" not in decode.log() and "AssertionError" not in decode.log()
    p = prompt(LENGTHS[-1], 4100)
    _, out, hits = disaggregated(pd, p)
    assert tokens(out) == expected(pd, p) and pulled(pd, out) and hits == len(p)


def test_a_decode_queued_past_the_lease_keeps_the_hold_alive(pd):
    """A handed-over request waits behind requests that fill the decode's KV cache for longer
    than the prefill's lease: the decode renews the hold, then pulls (not recomputes)."""
    decode = pd["decode"]
    wait_free(decode)
    # Five long requests sent to the decode directly fill its KV cache (970 of its 1024
    # blocks) and keep it full; the hand-over (63 blocks) waits behind them until they hang
    # up, past the lease (the time they would take to finish is the machine's).
    hang_up = threading.Event()
    blockers = [
        decode.abandon(prompt(6200, 5000 + i), 1900, None, 300, hang_up) for i in range(5)
    ]  # fmt: skip
    deadline = time.monotonic() + 120
    while decode.metric("vllm:num_requests_running") < len(blockers):
        assert time.monotonic() < deadline, "the blockers did not all start"
        time.sleep(0.1)
    p = prompt(2000, 5100)
    params = prefill(pd["prefill"], p)
    t0 = time.monotonic()
    before = decode.metric(HITS)
    timer = threading.Timer(LEASE_S + 4, hang_up.set)
    timer.start()
    try:
        out = decode.complete(p, NEW_TOKENS, params, timeout=300)
    finally:
        timer.cancel()
        hang_up.set()
    waited = time.monotonic() - t0
    for t in blockers:
        t.join(300)
    assert waited > LEASE_S + 1, f"the request waited only {waited:.1f} s: not a test"
    assert tokens(out) == expected(pd, p)
    assert pulled(pd, out) and decode.metric(HITS) - before == len(p)
    assert f"lease of {params['remote_request_id']} ran out" not in pd["prefill"].log()


def test_blocks_nobody_pulls_are_freed_when_the_lease_ends(pd):
    server = pd["prefill"]
    wait_free(server, 30)
    before = server.log().count("ran out; its blocks are freed")
    prefill(server, prompt(LENGTHS[-1], 8))
    held_at = time.monotonic()
    assert server.metric(USAGE) > 0
    while server.metric(USAGE) > 0:
        assert time.monotonic() - held_at < LEASE_S + 10, "blocks still held after the lease"
        time.sleep(0.2)
    assert time.monotonic() - held_at >= LEASE_S - 1
    assert server.log().count("ran out; its blocks are freed") == before + 1


def test_connector_metrics_reach_vllms_logger_and_prometheus(pd):
    """The workers' and schedulers' stats travel vLLM's connector-stats channel to its
    periodic stats log and to its /metrics."""
    decode, prefill_ = pd["decode"], pd["prefill"]
    deadline = time.monotonic() + 25  # vLLM logs stats every 10 s
    while "KV Transfer metrics: loads=" not in decode.log():
        assert time.monotonic() < deadline, "no KV Transfer metrics line in the decode log"
        time.sleep(0.5)
    line = next(x for x in decode.log().splitlines() if "KV Transfer metrics: loads=" in x)
    assert "bytes=" in line and "load_ms_mean=" in line and "not_pulled=" in line, line
    assert decode.metric("vllm:kvfabric_pulls_total") >= len(LENGTHS)
    assert decode.metric("vllm:kvfabric_pulled_bytes_total") > 0
    assert decode.metric("vllm:kvfabric_pull_seconds_count") >= len(LENGTHS)
    assert decode.metric("vllm:kvfabric_lease_renewals_total") > 0
    assert prefill_.metric("vllm:kvfabric_holds_ended_total", how="acked") >= len(LENGTHS)
    assert prefill_.metric("vllm:kvfabric_holds_ended_total", how="lease_expired") >= 1


def test_requests_work_again_after_the_agents_restart(pd):
    """Both agents restart between requests; the workers and mailboxes of every instance
    register their segments again (same names and keys), and the next requests pull again."""
    logs = {
        "prefill": "kvfabric: registered prefill.pp0.tp0 ",
        "decode": "kvfabric: registered decode.pp0",
    }
    before = {side: pd[side].log().count(line) for side, line in logs.items()}
    for side in ("p", "d"):
        pd["agents"][side].restart()
    # The workers find their segments gone and register them again (the registry entries of
    # an agent's previous run name that agent: the new registrations take their place).
    deadline = time.monotonic() + 60
    for side, line in logs.items():
        while pd[side].log().count(line) == before[side]:
            assert time.monotonic() < deadline, f"the {side} workers did not register again"
            time.sleep(0.2)
    for attempt in range(3):
        p = prompt(LENGTHS[1], 9 + attempt)
        _, out, hits = disaggregated(pd, p)
        assert tokens(out) == expected(pd, p)
        if pulled(pd, out):
            break
    assert pulled(pd, out), "no pull succeeded after the agents restarted"
    assert hits == len(p)


def test_agents_restarted_under_a_stream_of_handovers_never_give_a_wrong_token(pd):
    """Clients keep handing requests over while the decode's agent, then the prefill's, is
    killed and started again: every output equals a single instance's (pulled, or recomputed
    while an agent was away), and hand-overs pull again once both are back."""
    stop = time.monotonic() + 3600
    results: list[tuple[list[int], dict]] = []

    def client(k: int) -> None:
        i = 0
        while time.monotonic() < stop:
            p = prompt(LENGTHS[i % len(LENGTHS)], 20_000 + 100 * k + i)
            _, out, _ = disaggregated(pd, p)
            results.append((p, out))
            i += 1

    with ThreadPoolExecutor(3) as pool:
        clients = [pool.submit(client, k) for k in range(3)]
        for side in ("d", "p"):
            time.sleep(2.0)
            pd["agents"][side].kill()
            time.sleep(1.0)
            pd["agents"][side].start()
        back = len(results)
        deadline = time.monotonic() + 90
        while not any(pulled(pd, out) for _, out in results[back:]):
            assert time.monotonic() < deadline, "no hand-over pulled after the agents came back"
            time.sleep(0.5)
        stop = time.monotonic()
        for c in clients:
            c.result()
    assert len(results) > back > 0, (back, len(results))
    wrong = [p for p, out in results if tokens(out) != expected(pd, p)]
    assert not wrong, f"{len(wrong)} of {len(results)} outputs differ"


def test_a_prefill_killed_before_the_pull_does_not_hang_the_decode(pd):
    p = prompt(LENGTHS[-1], 10)
    want = expected(pd, p)
    params = prefill(pd["prefill"], p)
    pd["prefill"].kill()
    t0 = time.monotonic()
    out = pd["decode"].complete(p, NEW_TOKENS, params, timeout=60)
    assert time.monotonic() - t0 < 30
    # Pulled from the memory the agent still maps, or recomputed: the same tokens either way.
    assert tokens(out) == want
    assert os.path.exists(pd["decode"].log_path)


def test_a_decode_killed_mid_pull_leaves_its_prefills_blocks_freed_at_lease_end(pd):
    """The decode dies (SIGKILL, its whole process group) with handed-over requests in flight:
    their pulls stalled (the prefill's agent frozen), so nobody acknowledges them, and the
    prefill frees their blocks when their leases end, not later, and keeps serving. Last: the
    decode stays dead."""
    server, decode, agent = pd["control"], pd["decode"], pd["agents"]["p"].proc
    wait_free(server, 30)
    ended = server.log().count("ran out; its blocks are freed")
    handed = [(p, prefill(server, p)) for p in (prompt(3000, 6000 + i) for i in range(4))]
    held_at = time.monotonic()
    assert server.metric(USAGE) > 0
    agent.send_signal(signal.SIGSTOP)
    try:
        for p, params in handed:
            decode.abandon(p, NEW_TOKENS, params, 30)
        time.sleep(1.5)  # scheduled, and their pulls sent to the frozen peer
        decode.kill()
    finally:
        agent.send_signal(signal.SIGCONT)
    while server.metric(USAGE) > 0:
        assert time.monotonic() - held_at < LEASE_S + 10, "blocks still held after the lease"
        time.sleep(0.2)
    assert server.log().count("ran out; its blocks are freed") - ended == len(handed)
    assert server.alive()
    assert tokens(server.complete(prompt(40, 6100), 4))
