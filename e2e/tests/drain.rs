//! SIGTERM to an agent while a pull runs through it: the pull completes with its bytes right,
//! health on the peer port goes NOT_SERVING, the agent's etcd keys go well before its lease
//! would expire, and the process exits 0 within `--grace-secs`.

mod common;

use std::time::{Duration, Instant};

use common::{
    BLOCK, etcd_on, has_namespaces, keys_of, prefill_and_decode, sees, served_bytes, serving,
    within,
};
use kvfabric_client::Client;
use kvfabric_e2e::worker::{first_mismatch, random_memory, scattered};
use kvfabric_e2e::{AgentProcess, Network};
use kvfabric_testkit::EtcdServer;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Long, so only the graceful path can remove the keys in time.
const TTL_SECS: u64 = 10;
const GRACE_SECS: u64 = 5;
/// 48 MiB at 200 Mbit/s: about two seconds on the wire, well inside the grace period.
const BLOCKS: u64 = 1536;
const SLOW_MBIT: u32 = 200;
/// "Well under the TTL".
const KEYS_GONE_WITHIN: Duration = Duration::from_secs(2);

struct Setup {
    net: Network,
    etcd: EtcdServer,
    prefill_agent: AgentProcess,
    decode_agent: AgentProcess,
    /// The prefill worker's connection: its segment lives as long as this does.
    _prefill: Client,
    decode: Client,
    ds: kvfabric_client::Segment,
    key: u64,
    ops: Vec<kvfabric_client::Op>,
    src: kvfabric_client::HostMemory,
    dst: kvfabric_client::HostMemory,
}

async fn setup() -> Option<Setup> {
    let net = Network::new(2);
    let etcd = etcd_on(net.gateway).await?;
    if !has_namespaces(&net) {
        return None;
    }
    let (ttl, grace) = (TTL_SECS.to_string(), GRACE_SECS.to_string());
    let flags = [
        "--transports",
        "tcp",
        "--lease-ttl-secs",
        &ttl,
        "--grace-secs",
        &grace,
    ];
    let (prefill_agent, decode_agent, prefill, decode) =
        prefill_and_decode(&net, &etcd, &flags, &[]).await;
    let src = random_memory(BLOCKS * BLOCK, 1);
    let dst = random_memory(BLOCKS * BLOCK, 2);
    let ps = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let ds = decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&decode, "prefill-0")
    })
    .await;
    // The data connection is up before the slow pull starts.
    decode
        .read(&ds, "prefill-0", ps.key, &scattered(1, BLOCK, BLOCKS))
        .await
        .unwrap();
    net.limit_rate(0, SLOW_MBIT).unwrap();
    Some(Setup {
        net,
        etcd,
        prefill_agent,
        decode_agent,
        _prefill: prefill,
        decode,
        ds,
        key: ps.key,
        ops: scattered(BLOCKS, BLOCK, BLOCKS),
        src,
        dst,
    })
}

/// Waits until etcd holds none of the keys of `names`, and checks that came well before the
/// lease would have expired.
async fn keys_gone(etcd: &EtcdServer, names: &[&str], since: Instant) {
    within(KEYS_GONE_WITHIN, "the agent's keys deleted", || async {
        keys_of(etcd, names).await.is_empty()
    })
    .await;
    let took = since.elapsed();
    println!("keys of {names:?} gone {took:?} after SIGTERM (TTL {TTL_SECS} s)");
    assert!(took < KEYS_GONE_WITHIN, "{took:?}");
}

/// Starts the slow pull and returns once the prefill agent is serving it.
async fn pull_in_flight(
    s: &Setup,
) -> tokio::task::JoinHandle<kvfabric_client::Result<kvfabric_client::pb::SubmitResponse>> {
    let before = served_bytes(&s.prefill_agent).await;
    let reader = tokio::spawn({
        let (decode, ds, ops, key) = (s.decode.clone(), s.ds.clone(), s.ops.clone(), s.key);
        async move { decode.read(&ds, "prefill-0", key, &ops).await }
    });
    serving(&s.prefill_agent, before, Duration::from_secs(10)).await;
    assert!(!reader.is_finished(), "the pull ended before SIGTERM");
    reader
}

/// The pull finished, with every byte where it belongs.
async fn completed(
    s: &Setup,
    reader: tokio::task::JoinHandle<kvfabric_client::Result<kvfabric_client::pb::SubmitResponse>>,
) {
    let done = tokio::time::timeout(Duration::from_secs(GRACE_SECS + 5), reader)
        .await
        .expect("the pull hung")
        .unwrap();
    let done = done.unwrap_or_else(|e| panic!("the in-flight pull failed during the drain: {e}"));
    assert_eq!(done.bytes, BLOCKS * BLOCK);
    assert_eq!(first_mismatch(&s.ops, &s.dst, &s.src), None);
}

/// Waits for `agent` to exit, and checks it exits 0 within the grace period of `since`.
fn exits_in_grace(agent: &mut AgentProcess, since: Instant) {
    let code = agent.wait_exit(Duration::from_secs(GRACE_SECS + 10));
    let took = since.elapsed();
    println!("{} exited with {code:?} {took:?} after SIGTERM", agent.name);
    assert_eq!(code, Some(0), "{}", agent.log());
    assert!(
        took <= Duration::from_secs(GRACE_SECS),
        "exit {took:?} after SIGTERM, beyond --grace-secs {GRACE_SECS}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_of_the_serving_agent_drains_it() {
    let Some(mut s) = setup().await else {
        return;
    };
    let peer = s.prefill_agent.ready.peer;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{peer}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let check = HealthCheckRequest {
        service: "kvfabric.v1.PeerAgent".into(),
    };
    let status = health.check(check.clone()).await.unwrap().into_inner();
    assert_eq!(status.status(), ServingStatus::Serving);

    let reader = pull_in_flight(&s).await;
    // A frozen etcd holds the agent in the step after NOT_SERVING (revoking its lease) while
    // the peer port still answers, so the test sees what a probe would.
    s.etcd.pause().unwrap();
    let term = Instant::now();
    s.prefill_agent.sigterm();
    let not_serving = loop {
        match health.check(check.clone()).await {
            Ok(r) if r.get_ref().status() == ServingStatus::NotServing => break term.elapsed(),
            Ok(_) => {}
            Err(e) => panic!("the peer port stopped answering before NOT_SERVING: {e}"),
        }
        assert!(
            term.elapsed() < Duration::from_secs(2),
            "health still SERVING 2 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    s.etcd.resume().unwrap();
    println!("peer health NOT_SERVING {not_serving:?} after SIGTERM");

    let names = ["prefill-node", "prefill-0"];
    keys_gone(&s.etcd, &names, term).await;
    completed(&s, reader).await;
    exits_in_grace(&mut s.prefill_agent, term);
    // The decode agent's cache followed the deletion.
    within(
        Duration::from_secs(2),
        "decode agent forgets prefill-0",
        || async { !sees(&s.decode, "prefill-0").await },
    )
    .await;
    let _ = &s.net;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_of_the_pulling_agent_lets_its_workers_pull_finish() {
    let Some(mut s) = setup().await else {
        return;
    };
    let reader = pull_in_flight(&s).await;
    let term = Instant::now();
    s.decode_agent.sigterm();
    let names = ["decode-node", "decode-0"];
    keys_gone(&s.etcd, &names, term).await;
    completed(&s, reader).await;
    exits_in_grace(&mut s.decode_agent, term);
    let _ = &s.net;
}
