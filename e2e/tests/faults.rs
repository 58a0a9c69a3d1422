//! Faults between agent processes in network namespaces: a serving agent killed while it serves,
//! the worker's own agent killed and restarted, etcd stopped, wiped and restarted, a peer
//! blackholed and restored, a dead agent's segments expiring.

mod common;

use std::time::{Duration, Instant};

use common::{
    BLOCK, TTL_SECS, etcd_on, fabric_keys, has_namespaces, prefill_and_decode, sees, served_bytes,
    serving, within,
};
use kvfabric_client::{Client, SubmitOptions};
use kvfabric_e2e::worker::{first_mismatch, random_memory, refill, scattered};
use kvfabric_e2e::{AgentProcess, Network, fault_flags};
use kvfabric_proto::pb::Opcode;
use kvfabric_testkit::EtcdServer;
use tonic::Code;

/// The agents' `--batch-timeout-ms` where a test waits for it.
const TIMEOUT_MS: u64 = 2_000;
/// What the serving host may send, where a batch must stay on the wire long enough to be
/// interrupted: 64 MiB take about 2.7 s.
const SLOW_MBIT: u32 = 200;

struct Pair {
    net: Network,
    etcd: EtcdServer,
    a: AgentProcess,
    b: AgentProcess,
    prefill: Client,
    decode: Client,
}

/// Prefill agent on host 0, decode agent on host 1, tcp only, short leases, batches limited to
/// `timeout_ms`.
async fn pair(timeout_ms: u64) -> Option<Pair> {
    let net = Network::new(2);
    let etcd = etcd_on(net.gateway).await?;
    let flags = fault_flags(TTL_SECS, timeout_ms);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (a, b, prefill, decode) = prefill_and_decode(&net, &etcd, &flags, &[]).await;
    Some(Pair {
        net,
        etcd,
        a,
        b,
        prefill,
        decode,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_serving_agent_while_it_serves_fails_the_batch_at_once_with_unavailable() {
    // A batch timeout far above the batch's own time: a failure within a second of the kill is
    // the dead peer noticed, not the timeout.
    let Some(mut p) = pair(30_000).await else {
        return;
    };
    if !has_namespaces(&p.net) {
        return;
    }
    let blocks = 2048;
    let src = random_memory(blocks * BLOCK, 1);
    let dst = random_memory(blocks * BLOCK, 2);
    let ps = p
        .prefill
        .register("prefill-0", &[&src], None)
        .await
        .unwrap();
    let ds = p.decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&p.decode, "prefill-0")
    })
    .await;
    let ops = scattered(blocks, BLOCK, blocks);
    p.net.limit_rate(0, SLOW_MBIT).unwrap();
    let before = served_bytes(&p.a).await;

    let reader = tokio::spawn({
        let (decode, ds, ops) = (p.decode.clone(), ds.clone(), ops.clone());
        async move {
            let r = decode.read(&ds, "prefill-0", ps.key, &ops).await;
            (Instant::now(), r)
        }
    });
    // Kill once the prefill agent is serving this batch, not before and not after.
    let seen = serving(&p.a, before, Duration::from_secs(10)).await;
    assert!(!reader.is_finished(), "the batch ended before the kill");
    let killed = Instant::now();
    p.a.kill9();
    let total = blocks * BLOCK;
    assert!(
        seen - before < total,
        "all {total} bytes were served before the kill"
    );

    let (failed, result) = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .expect("the waiting worker hung")
        .unwrap();
    let err = result.expect_err("the batch succeeded though its server was killed mid-way");
    let waited = failed.duration_since(killed);
    println!("worker saw {err} {waited:?} after kill -9 ({seen} of {total} bytes served)");
    assert_eq!(err.code(), Some(Code::Unavailable), "{err}");
    assert!(
        waited < Duration::from_secs(1),
        "failed {waited:?} after the kill"
    );
    // The batch really was cut short: some blocks never arrived.
    assert!(
        first_mismatch(&ops, &dst, &src).is_some(),
        "every block arrived"
    );
    // The decode agent keeps serving its worker.
    let status = p.decode.status().await.unwrap();
    assert!(status.segments.iter().any(|s| s.name == "decode-0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_workers_own_agent_fails_its_calls_at_once_and_the_client_reconnects() {
    let Some(mut p) = pair(30_000).await else {
        return;
    };
    if !has_namespaces(&p.net) {
        return;
    }
    let blocks = 2048;
    let src = random_memory(blocks * BLOCK, 3);
    let dst = random_memory(blocks * BLOCK, 4);
    let ps = p
        .prefill
        .register("prefill-0", &[&src], None)
        .await
        .unwrap();
    let ds = p.decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&p.decode, "prefill-0")
    })
    .await;
    let ops = scattered(blocks, BLOCK, blocks);
    p.net.limit_rate(0, SLOW_MBIT).unwrap();
    let before = served_bytes(&p.a).await;

    // A pull in flight when the decode worker's own agent dies.
    let reader = tokio::spawn({
        let (decode, ds, ops) = (p.decode.clone(), ds.clone(), ops.clone());
        async move {
            let r = decode.read(&ds, "prefill-0", ps.key, &ops).await;
            (Instant::now(), r)
        }
    });
    serving(&p.a, before, Duration::from_secs(10)).await;
    assert!(!reader.is_finished(), "the batch ended before the kill");
    let killed = Instant::now();
    p.b.kill9();
    let (failed, result) = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the worker hung on its dead agent")
        .unwrap();
    let err = result.expect_err("a pull through a killed agent succeeded");
    let waited = failed.duration_since(killed);
    println!("in-flight pull: {err} {waited:?} after kill -9 of its agent");
    assert_eq!(err.code(), Some(Code::Unavailable), "{err}");
    assert!(waited < Duration::from_millis(500), "{waited:?}");

    // While the agent is down, every call fails at once, and says so.
    for _ in 0..3 {
        let start = Instant::now();
        let err = p.decode.status().await.unwrap_err();
        assert_eq!(err.code(), Some(Code::Unavailable), "{err}");
        assert!(start.elapsed() < Duration::from_millis(500), "{err}");
    }

    // The agent comes back on the same socket directory: the same client, without a new
    // connect, works again. Memory registered with the dead agent is gone with it.
    p.b.restart();
    p.net.unlimit_rate(0).unwrap();
    let back = within(Duration::from_secs(5), "client reconnects", || async {
        p.decode.status().await.is_ok()
    })
    .await;
    println!("client reconnected {back:?} after the agent was back");
    let ds = p.decode.register("decode-1", &[&dst], None).await.unwrap();
    within(
        Duration::from_secs(5),
        "restarted agent sees prefill-0",
        || sees(&p.decode, "prefill-0"),
    )
    .await;
    refill(&src, 30);
    let done = p.decode.read(&ds, "prefill-0", ps.key, &ops).await.unwrap();
    assert_eq!(done.bytes, blocks * BLOCK);
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_lets_its_worker_register_its_segment_again_at_once() {
    let Some(mut p) = pair(TIMEOUT_MS).await else {
        return;
    };
    let src = random_memory(64 * BLOCK, 13);
    let dst = random_memory(64 * BLOCK, 14);
    p.decode.register("decode-0", &[&dst], None).await.unwrap();
    p.b.kill9();
    p.b.restart();
    // The dead agent's entry for decode-0 names this same agent, which holds no segment after
    // its restart: the entry is stale, and the worker's registration takes its place without
    // waiting out the old lease.
    let ds = p.decode.register("decode-0", &[&dst], None).await.unwrap();
    let ps = p
        .prefill
        .register("prefill-0", &[&src], None)
        .await
        .unwrap();
    within(
        Duration::from_secs(5),
        "restarted agent sees prefill-0",
        || sees(&p.decode, "prefill-0"),
    )
    .await;
    let ops = scattered(64, BLOCK, 64);
    pull_fresh(&p.decode, &ds, "prefill-0", ps.key, &ops, &dst, &src).await;
    // And the prefill side reaches decode-0 at the restarted agent, not the dead one.
    let push = scattered(8, BLOCK, 64);
    within(
        Duration::from_secs(5),
        "prefill agent sees the new decode-0",
        || {
            let (prefill, ps, push) = (p.prefill.clone(), ps.clone(), push.clone());
            async move { prefill.read(&ps, "decode-0", ds.key, &push).await.is_ok() }
        },
    )
    .await;
    assert_eq!(first_mismatch(&push, &src, &dst), None);
}

/// Waits (up to three TTLs) until etcd holds both agents' and `segments` segments' keys again.
async fn all_keys_back(etcd: &EtcdServer, segments: usize, what: &str) -> Duration {
    within(Duration::from_secs(TTL_SECS * 3), what, || async {
        fabric_keys(etcd).await.len() == 2 + segments
    })
    .await
}

/// Clears `dst`, pulls `ops` into it, and checks every block against `src`: the data really
/// moved now, not in an earlier batch.
async fn pull_fresh(
    decode: &Client,
    ds: &kvfabric_client::Segment,
    remote: &str,
    key: u64,
    ops: &[kvfabric_client::Op],
    dst: &kvfabric_client::HostMemory,
    src: &kvfabric_client::HostMemory,
) {
    // SAFETY: no batch is in flight on `dst`.
    unsafe { dst.as_mut_slice() }.fill(0);
    let done = decode.read(ds, remote, key, ops).await;
    assert!(done.is_ok(), "pull from {remote} failed: {done:?}");
    assert_eq!(first_mismatch(ops, dst, src), None, "from {remote}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_keeps_transfers_going_and_agents_re_register_within_a_ttl() {
    let Some(mut p) = pair(TIMEOUT_MS).await else {
        return;
    };
    let src = random_memory(64 * BLOCK, 5);
    let dst = random_memory(64 * BLOCK, 6);
    let ps = p
        .prefill
        .register("prefill-0", &[&src], None)
        .await
        .unwrap();
    let ds = p.decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&p.decode, "prefill-0")
    })
    .await;
    let ops = scattered(32, BLOCK, 64);
    pull_fresh(&p.decode, &ds, "prefill-0", ps.key, &ops, &dst, &src).await;

    p.etcd.stop().await.unwrap();
    // Longer than the TTL: the leases expire while etcd is down. Every pull moves new data.
    let down = Instant::now();
    let mut seed = 100;
    while down.elapsed() < Duration::from_secs(TTL_SECS + 1) {
        seed += 1;
        refill(&src, seed);
        pull_fresh(&p.decode, &ds, "prefill-0", ps.key, &ops, &dst, &src).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let state = p.decode.status().await.unwrap().registry;
    assert!(!state.connected, "{state:?}");

    p.etcd.start_again().await.unwrap();
    let took = all_keys_back(&p.etcd, 2, "both agents and segments back in etcd").await;
    println!("keys back {took:?} after etcd came back (TTL {TTL_SECS} s)");
    assert!(
        took <= Duration::from_secs(TTL_SECS),
        "took {took:?}, more than one TTL"
    );

    // etcd restores leases from its data dir (with a fresh TTL), so the keys above survived.
    // Lose etcd's data too, several times: every lease is gone each time and the agents must
    // notice and re-register, each time within a TTL.
    let mut samples = Vec::new();
    for _ in 0..3 {
        p.etcd.stop().await.unwrap();
        std::fs::remove_dir_all(p.etcd.data_dir()).unwrap();
        p.etcd.start_again().await.unwrap();
        samples.push(
            all_keys_back(
                &p.etcd,
                2,
                "agents and segments re-registered in a wiped etcd",
            )
            .await,
        );
    }
    println!("re-registered after a wiped etcd came back: {samples:?} (TTL {TTL_SECS} s)");
    let slowest = samples.iter().max().copied().unwrap_or_default();
    assert!(
        slowest <= Duration::from_secs(TTL_SECS),
        "re-registration took up to {slowest:?}, more than one TTL: {samples:?}"
    );
    let state = p.decode.status().await.unwrap().registry;
    assert!(state.reregistrations >= 3, "{state:?}");

    // The registry works again end to end: a segment registered now is seen and served, and
    // the old one serves data written now.
    let fresh = random_memory(64 * BLOCK, 7);
    let fs = p
        .prefill
        .register("prefill-1", &[&fresh], None)
        .await
        .unwrap();
    within(
        Duration::from_secs(5),
        "a segment registered after the wipe",
        || sees(&p.decode, "prefill-1"),
    )
    .await;
    all_keys_back(&p.etcd, 3, "the new segment in etcd").await;
    pull_fresh(&p.decode, &ds, "prefill-1", fs.key, &ops, &dst, &fresh).await;
    refill(&src, 8);
    pull_fresh(&p.decode, &ds, "prefill-0", ps.key, &ops, &dst, &src).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_peer_fails_with_deadline_exceeded_within_the_batch_timeout() {
    let Some(p) = pair(TIMEOUT_MS).await else {
        return;
    };
    if !has_namespaces(&p.net) {
        return;
    }
    let src = random_memory(64 * BLOCK, 9);
    let dst = random_memory(64 * BLOCK, 10);
    let ps = p
        .prefill
        .register("prefill-0", &[&src], None)
        .await
        .unwrap();
    let ds = p.decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&p.decode, "prefill-0")
    })
    .await;
    let ops = scattered(64, BLOCK, 64);
    pull_fresh(&p.decode, &ds, "prefill-0", ps.key, &ops, &dst, &src).await;

    // The prefill host's link goes down: what the decode agent sends is dropped silently. The
    // first batch goes over the data connection the agent holds, under the agent's batch
    // timeout; it drops that connection when the batch times out, so the second, with its own
    // deadline below the agent's connect timeout, must re-dial the blackholed peer.
    p.net.set_link(0, false).unwrap();
    for (timeout, limit) in [
        (None, Duration::from_millis(TIMEOUT_MS)),
        (Some(Duration::from_millis(500)), Duration::from_millis(500)),
    ] {
        let options = SubmitOptions {
            timeout,
            ..SubmitOptions::default()
        };
        let start = Instant::now();
        let err = p
            .decode
            .submit(&ds, "prefill-0", ps.key, Opcode::Read, &ops, options)
            .await
            .unwrap_err();
        let took = start.elapsed();
        println!("blackholed, timeout {limit:?}: {err} after {took:?}");
        assert_eq!(err.code(), Some(Code::DeadlineExceeded), "{err}");
        // The batch's own deadline ends it: not sooner, and not much later.
        assert!(took >= limit, "{took:?} < {limit:?}");
        assert!(took <= limit + Duration::from_millis(500), "{took:?}");
    }

    p.net.set_link(0, true).unwrap();
    refill(&src, 11);
    within(
        Duration::from_secs(10),
        "transfers recover after link up",
        || {
            let (decode, ds, ops) = (p.decode.clone(), ds.clone(), ops.clone());
            async move { decode.read(&ds, "prefill-0", ps.key, &ops).await.is_ok() }
        },
    )
    .await;
    pull_fresh(&p.decode, &ds, "prefill-0", ps.key, &ops, &dst, &src).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_agents_segments_leave_the_registry_after_its_ttl() {
    let Some(mut p) = pair(TIMEOUT_MS).await else {
        return;
    };
    let src = random_memory(16 * BLOCK, 12);
    p.prefill
        .register("prefill-0", &[&src], None)
        .await
        .unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&p.decode, "prefill-0")
    })
    .await;
    p.a.kill9();
    let gone = within(
        Duration::from_secs(TTL_SECS * 3),
        "dead agent's segment expires",
        || async { !sees(&p.decode, "prefill-0").await },
    )
    .await;
    println!("segment of the killed agent gone after {gone:?} (TTL {TTL_SECS} s)");
    assert!(gone <= Duration::from_secs(TTL_SECS + 2), "{gone:?}");
    let status = p.decode.status().await.unwrap();
    assert!(
        status.agents.iter().all(|a| a.name != "prefill-node"),
        "{:?}",
        status.agents
    );
    let _ = &p.b;
}
