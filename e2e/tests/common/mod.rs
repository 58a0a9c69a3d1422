#![allow(dead_code)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvfabric_client::Client;
use kvfabric_e2e::{AgentProcess, Network};
use kvfabric_testkit::EtcdServer;

pub const TTL_SECS: u64 = 3;
pub const BLOCK: u64 = 32 << 10;

/// A real etcd on `ip`, or None (a recorded skip; a failure in CI) where the binary is
/// missing. An installed etcd that does not start fails the test.
pub async fn etcd_on(ip: IpAddr) -> Option<EtcdServer> {
    EtcdServer::or_skip(EtcdServer::start_on(ip).await)
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

/// Bytes `agent` has served to its peers so far (`kvfabric_agent_served_bytes_total`, every
/// opcode), from its `/metrics`.
pub async fn served_bytes(agent: &AgentProcess) -> u64 {
    let samples = kvfabric_agent::metrics::scrape(agent.ready.metrics)
        .await
        .unwrap_or_else(|e| panic!("scrape {}: {e}", agent.name));
    samples
        .iter()
        .filter(|(name, _)| name.starts_with("kvfabric_agent_served_bytes_total"))
        .map(|(_, v)| *v as u64)
        .sum()
}

/// Waits until `agent` has served more than `before` bytes (a batch against it is on the wire),
/// polling every few milliseconds; returns the count seen.
pub async fn serving(agent: &AgentProcess, before: u64, limit: Duration) -> u64 {
    let start = Instant::now();
    loop {
        let now = served_bytes(agent).await;
        if now > before {
            return now;
        }
        assert!(
            start.elapsed() < limit,
            "{} served nothing within {limit:?} (before {before}, now {now}); log:\n{}",
            agent.name,
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every key under the e2e fabric's registry root (empty while etcd does not answer).
pub async fn fabric_keys(etcd: &EtcdServer) -> Vec<String> {
    etcd.keys("/kvfabric/default/e2e/")
        .await
        .unwrap_or_default()
}

/// The fabric's keys of the agents and segments called `names`.
pub async fn keys_of(etcd: &EtcdServer, names: &[&str]) -> Vec<String> {
    fabric_keys(etcd)
        .await
        .into_iter()
        .filter(|k| names.iter().any(|n| k.ends_with(&format!("/{n}"))))
        .collect()
}

/// Whether `net` has namespaces (links can be cut, rates limited). Without them
/// [`Network::new`] has recorded the skip (a failure in CI), and the test should return.
pub fn has_namespaces(net: &Network) -> bool {
    net.fallback.is_none()
}
