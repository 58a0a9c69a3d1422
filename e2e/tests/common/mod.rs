#![allow(dead_code)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvfabric_client::Client;
use kvfabric_e2e::{AgentProcess, Network};
use kvfabric_testkit::EtcdServer;

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

/// The prefill agent on host 0 and the decode agent on host 1 of `net`, both on `etcd` with
/// `flags` and `env`, and a worker client of each.
pub async fn prefill_and_decode(
    net: &Network,
    etcd: &EtcdServer,
    flags: &[&str],
    env: &[(&str, &str)],
) -> (AgentProcess, AgentProcess, Client, Client) {
    let spawn = |name, host| AgentProcess::spawn_env(name, host, &etcd.endpoint(), flags, env);
    let a = spawn("prefill-node", &net.hosts[0]);
    let b = spawn("decode-node", &net.hosts[1]);
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    (a, b, prefill, decode)
}
