//! Faults between agent processes in network namespaces: a serving agent killed mid-batch, etcd
//! stopped and restarted, a link cut and restored, a dead agent's segments expiring.

mod common;

use std::time::{Duration, Instant};

use common::{BLOCK, TTL_SECS, etcd_on, prefill_and_decode, sees, within};
use kvfabric_client::{Client, SubmitOptions};
use kvfabric_e2e::worker::{first_mismatch, random_memory, scattered};
use kvfabric_e2e::{AgentProcess, Network};
use kvfabric_proto::pb::Opcode;

const TIMEOUT_MS: u64 = 2_000;

struct Pair {
    net: Network,
    etcd: kvfabric_testkit::EtcdServer,
    a: AgentProcess,
    b: AgentProcess,
    prefill: Client,
    decode: Client,
}

async fn pair() -> Option<Pair> {
    let net = Network::new(2);
    let etcd = etcd_on(net.gateway).await?;
    let ttl = TTL_SECS.to_string();
    let timeout = TIMEOUT_MS.to_string();
    let flags = [
        "--transports",
        "tcp",
        "--lease-ttl-secs",
        &ttl,
        "--batch-timeout-ms",
        &timeout,
        "--connect-timeout-ms",
        "1000",
    ];
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
async fn killing_the_serving_agent_mid_batch_fails_the_waiting_worker_in_time() {
    let Some(mut p) = pair().await else { return };
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
    p.decode.read(&ds, "prefill-0", ps.key, &ops).await.unwrap();

    // Batches back to back; the agent dies under one of them.
    let decode = p.decode.clone();
    let (d2, key) = (ds.clone(), ps.key);
    let reader = tokio::spawn(async move {
        loop {
            if let Err(e) = decode.read(&d2, "prefill-0", key, &ops).await {
                return (Instant::now(), e);
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = Instant::now();
    p.a.kill9();
    let (failed, err) = tokio::time::timeout(Duration::from_millis(TIMEOUT_MS + 3_000), reader)
        .await
        .expect("the waiting worker hung")
        .unwrap();
    let waited = failed.saturating_duration_since(killed);
    println!("worker saw {err} {waited:?} after kill -9");
    assert!(
        waited <= Duration::from_millis(TIMEOUT_MS + 500),
        "{waited:?}"
    );
    // The decode agent keeps serving.
    assert!(p.decode.status().await.is_ok());
}

/// Waits (up to three TTLs) until etcd holds both agents' and both segments' keys again.
async fn all_keys_back(kv: &etcd_client::Client, what: &str) -> Duration {
    within(Duration::from_secs(TTL_SECS * 3), what, || {
        let mut kv = kv.clone();
        async move {
            let keys = etcd_client::GetOptions::new()
                .with_prefix()
                .with_keys_only();
            kv.get("/kvfabric/default/e2e/", Some(keys))
                .await
                .is_ok_and(|r| r.kvs().len() == 4)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_keeps_transfers_going_and_agents_re_register_within_a_ttl() {
    let Some(mut p) = pair().await else { return };
    let src = random_memory(64 * BLOCK, 3);
    let dst = random_memory(64 * BLOCK, 4);
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
    p.decode.read(&ds, "prefill-0", ps.key, &ops).await.unwrap();

    p.etcd.stop().await.unwrap();
    // Longer than the TTL: the leases expire while etcd is down.
    let down = Instant::now();
    while down.elapsed() < Duration::from_secs(TTL_SECS + 1) {
        let done = p.decode.read(&ds, "prefill-0", ps.key, &ops).await;
        assert!(
            done.is_ok(),
            "transfer failed while etcd was down: {done:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
    let state = p.decode.status().await.unwrap().registry;
    assert!(!state.connected, "{state:?}");

    p.etcd.start_again().await.unwrap();
    let back = Instant::now();
    let kv = p.etcd.client().await.unwrap();
    let took = all_keys_back(&kv, "both agents and segments back in etcd").await;
    println!("re-registered {took:?} after etcd came back (TTL {TTL_SECS} s)");
    assert!(
        back.elapsed() <= Duration::from_secs(TTL_SECS) + Duration::from_millis(500),
        "re-registration took {took:?}, more than one TTL"
    );
    // etcd restores leases from its data dir (with a fresh TTL), so the keys above survived.
    // Now lose etcd's data too: every lease is gone and the agents must notice and re-register.
    p.etcd.stop().await.unwrap();
    std::fs::remove_dir_all(p.etcd.data_dir()).unwrap();
    p.etcd.start_again().await.unwrap();
    let back = Instant::now();
    let took = all_keys_back(
        &kv,
        "both agents and segments re-registered in a wiped etcd",
    )
    .await;
    println!("re-registered {took:?} after a wiped etcd came back (TTL {TTL_SECS} s)");
    assert!(
        back.elapsed() <= Duration::from_secs(TTL_SECS) + Duration::from_millis(500),
        "re-registration took {took:?}, more than one TTL"
    );
    let state = p.decode.status().await.unwrap().registry;
    assert!(state.reregistrations >= 1, "{state:?}");
    // The keys are back in etcd; the decode agent's watch cache follows after its resync.
    within(Duration::from_secs(5), "segment visible again", || {
        sees(&p.decode, "prefill-0")
    })
    .await;
    p.decode.read(&ds, "prefill-0", ps.key, &ops).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_link_fails_batches_then_recovers_when_restored() {
    let Some(p) = pair().await else { return };
    if p.net.fallback.is_some() {
        println!("skipped: links cannot be cut without network namespaces");
        return;
    }
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
    let ops = scattered(64, BLOCK, 64);
    p.decode.read(&ds, "prefill-0", ps.key, &ops).await.unwrap();

    p.net.set_link(0, false).unwrap();
    let options = SubmitOptions {
        timeout: Some(Duration::from_millis(1_000)),
        ..SubmitOptions::default()
    };
    let start = Instant::now();
    let err = p
        .decode
        .submit(&ds, "prefill-0", ps.key, Opcode::Read, &ops, options)
        .await
        .unwrap_err();
    println!("with the link down: {err} after {:?}", start.elapsed());
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );

    p.net.set_link(0, true).unwrap();
    // SAFETY: no batch is in flight (the failed one timed out and was dropped).
    unsafe { dst.as_mut_slice() }.fill(0);
    within(
        Duration::from_secs(10),
        "transfers recover after link up",
        || {
            let (decode, ds, ops) = (p.decode.clone(), ds.clone(), ops.clone());
            async move { decode.read(&ds, "prefill-0", ps.key, &ops).await.is_ok() }
        },
    )
    .await;
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_agents_segments_leave_the_registry_after_its_ttl() {
    let Some(mut p) = pair().await else { return };
    let src = random_memory(16 * BLOCK, 7);
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
