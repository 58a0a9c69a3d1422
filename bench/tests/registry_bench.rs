//! `kvfabric registry-bench` against a real etcd (Debian's `etcd-server`).

use std::time::Instant;

use kvfabric_bench::registry::{self as bench, RegistryBenchConfig};
use kvfabric_proto::contract::{DEFAULT_KEY_PREFIX, DEFAULT_NAMESPACE, registry_root};
use kvfabric_testkit::EtcdServer;

/// A fresh etcd, or `None` (test skipped) where the binary is missing.
async fn etcd() -> Option<EtcdServer> {
    match EtcdServer::start().await {
        Ok(etcd) => Some(etcd),
        Err(e @ kvfabric_testkit::Error::EtcdNotFound { .. }) => {
            eprintln!("skipped: no etcd binary ({e})");
            None
        }
        Err(e) => panic!("etcd did not start: {e}"),
    }
}

#[tokio::test]
async fn registry_bench_at_tiny_scale() {
    let Some(etcd) = etcd().await else { return };
    let report = bench::run(RegistryBenchConfig {
        endpoint: etcd.endpoint(),
        agents: 10,
        segments: 50,
        watchers: 2,
        new_segments: 20,
        lookups_per_watcher: 1000,
        clients: 2,
        concurrency: 8,
        ..RegistryBenchConfig::default()
    })
    .await
    .unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert_eq!(report.lookup.count, 2000);
    assert_eq!(report.lookup_misses, 0);
    assert_eq!(report.visibility.count, 40);
    assert_eq!(report.not_seen, 0);
    // Everything the run wrote went with its leases.
    let mut client = etcd.client().await.unwrap();
    let prefix = registry_root(DEFAULT_KEY_PREFIX, DEFAULT_NAMESPACE, &report.fabric) + "/";
    let left = client
        .get(
            prefix,
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(left.count(), 0);
}

/// The full-scale run (1000 agents, 10 000 segments, 8 watchers); slow, so on request:
/// `cargo test -p kvfabric-bench --release --test registry_bench -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "full scale: minutes"]
async fn registry_bench_full_scale() {
    let Some(etcd) = etcd().await else { return };
    let started = Instant::now();
    let report = bench::run(RegistryBenchConfig {
        endpoint: etcd.endpoint(),
        ..RegistryBenchConfig::default()
    })
    .await
    .unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    println!("full-scale run took {:?}", started.elapsed());
    assert_eq!(report.lookup_misses, 0);
    assert_eq!(report.not_seen, 0);
}
