#![allow(dead_code)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvfabric_agent::client::Client;
use kvfabric_agent::testkit::EtcdServer;

pub const TTL_SECS: u64 = 3;
pub const BLOCK: u64 = 32 << 10;

/// A real etcd on `ip`, or None (with the reason printed) where the binary is missing.
pub async fn etcd_on(ip: IpAddr) -> Option<EtcdServer> {
    match EtcdServer::start_on(ip).await {
        Ok(e) => Some(e),
        Err(e) => {
            println!("skipped: no etcd ({e})");
            None
        }
    }
}

/// Polls `check` until it holds or `limit` passes; returns how long it took.
pub async fn within<F, Fut>(limit: Duration, what: &str, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    start.elapsed()
}

/// True once the agent behind `client` has `segment` in its registry cache.
pub async fn sees(client: &Client, segment: &str) -> bool {
    client
        .status()
        .await
        .is_ok_and(|s| s.segments.iter().any(|x| x.name == segment))
}
