//! The registry at scale, against one real etcd: many agents (each with its own lease and
//! keepalive), many segments, a few watch caches. Measures what the transfer path depends on:
//! how fast a cached lookup answers, and how soon a newly put segment is visible to watchers.
//!
//! The simulated agents are [`EtcdRegistry`]s without a watch (write-only), sharing a few etcd
//! clients; the watchers are full [`EtcdRegistry`]s (each reads the whole fabric at start, then
//! watches), sharing one client.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use kvfabric_engine::{Location, RegionId};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast::error::RecvError;

use crate::error::{Error, Result};
use kvfabric_agent::discovery::Devices;
use kvfabric_agent::registry::{
    AgentEntry, EtcdConfig, EtcdRegistry, Event, Registry, SegmentEntry, SegmentRegion,
};

/// What to simulate. `Default` is the full-scale run (1000 agents, 10 000 segments).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegistryBenchConfig {
    /// etcd client URL, e.g. `http://127.0.0.1:2379`.
    pub endpoint: String,
    /// Fabric the run writes under (`/kvfabric/<fabric>/`); empty: a fresh unique name.
    pub fabric: String,
    /// Simulated agents, each with its own lease.
    pub agents: usize,
    /// Segments spread round-robin over the agents.
    pub segments: usize,
    /// Watch caches (each a full registry reading everything, then watching).
    pub watchers: usize,
    /// Segments put one at a time after setup, to time their visibility at every watcher.
    pub new_segments: usize,
    /// Timed lookups per watcher (random existing segment names).
    pub lookups_per_watcher: usize,
    /// etcd clients (connections) the agents share.
    pub clients: usize,
    /// Writes in flight during setup.
    pub concurrency: usize,
    pub regions_per_segment: usize,
    pub lease_ttl_secs: u64,
    /// Longest wait for watchers to see a new segment.
    pub settle_timeout_secs: u64,
    pub seed: u64,
}

impl Default for RegistryBenchConfig {
    fn default() -> Self {
        RegistryBenchConfig {
            endpoint: "http://127.0.0.1:2379".into(),
            fabric: String::new(),
            agents: 1000,
            segments: 10_000,
            watchers: 8,
            new_segments: 200,
            lookups_per_watcher: 100_000,
            clients: 8,
            concurrency: 64,
            regions_per_segment: 4,
            lease_ttl_secs: 10,
            settle_timeout_secs: 60,
            seed: 1,
        }
    }
}

/// Latency distribution in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub count: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

impl Latency {
    fn of(mut samples: Vec<Duration>) -> Self {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort_unstable();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let at = |q: f64| {
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            us(samples[rank - 1])
        };
        let total: Duration = samples.iter().sum();
        Latency {
            count: samples.len(),
            p50_us: at(0.50),
            p99_us: at(0.99),
            max_us: us(*samples.last().expect("not empty")),
            mean_us: us(total) / samples.len() as f64,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegistryBenchReport {
    pub endpoint: String,
    pub fabric: String,
    pub agents: usize,
    pub segments: usize,
    pub watchers: usize,
    /// Connecting the agents (lease grant each) and registering them.
    pub agents_secs: f64,
    /// Putting all segments.
    pub segments_secs: f64,
    pub segment_puts_per_sec: f64,
    /// Starting the watchers (each reads the whole fabric).
    pub watchers_start_secs: f64,
    /// Cached lookups of random segment names, over all watchers.
    pub lookup: Latency,
    /// Lookups that found nothing (should be 0).
    pub lookup_misses: u64,
    /// Acknowledgement latency of the new segments' puts.
    pub put: Latency,
    /// From the start of a put until a watcher's broadcast delivered it, over every (watcher,
    /// new segment) pair.
    pub visibility: Latency,
    /// Same, from the put's acknowledgement (0 when a watcher saw it first).
    pub visibility_after_ack: Latency,
    /// (watcher, new segment) pairs not seen within the settle timeout.
    pub not_seen: usize,
    /// Revoking every lease and stopping the watchers.
    pub teardown_secs: f64,
    pub total_secs: f64,
}

/// Runs the benchmark. Everything it writes is bound to its agents' leases, revoked at the end.
pub async fn run(cfg: RegistryBenchConfig) -> Result<RegistryBenchReport> {
    validate(&cfg)?;
    let started = Instant::now();
    let fabric = if cfg.fabric.is_empty() {
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        format!("registry-bench-{}-{unique}", std::process::id())
    } else {
        cfg.fabric.clone()
    };
    let mut etcd = EtcdConfig::new([cfg.endpoint.clone()], fabric.clone());
    etcd.lease_ttl = Duration::from_secs(cfg.lease_ttl_secs);
    etcd.connect_timeout = Duration::from_secs(10);

    // Agents: write-only registries on a few shared clients.
    let t = Instant::now();
    let mut clients = Vec::with_capacity(cfg.clients);
    for _ in 0..cfg.clients {
        clients.push(etcd.client().await?);
    }
    let agents: Vec<Arc<EtcdRegistry>> = futures::stream::iter(0..cfg.agents)
        .map(|i| {
            let client = clients[i % clients.len()].clone();
            let etcd = &etcd;
            async move {
                let agent = EtcdRegistry::start(client, etcd, false).await?;
                agent.register_agent(agent_entry(i)).await?;
                Ok::<_, Error>(agent)
            }
        })
        .buffered(cfg.concurrency)
        .try_collect()
        .await?;
    let agents_secs = t.elapsed().as_secs_f64();
    tracing::info!(
        agents = agents.len(),
        secs = agents_secs,
        "registry bench: agents registered"
    );

    // Segments, round-robin over the agents.
    let t = Instant::now();
    futures::stream::iter(0..cfg.segments)
        .map(|i| {
            let agent = agents[i % agents.len()].clone();
            let entry = segment_entry(&segment_name(i), &agent_name(i % cfg.agents), &cfg);
            async move { agent.put_segment(entry).await }
        })
        .buffer_unordered(cfg.concurrency)
        .try_collect::<()>()
        .await?;
    let segments_secs = t.elapsed().as_secs_f64();
    tracing::info!(
        segments = cfg.segments,
        secs = segments_secs,
        "registry bench: segments put"
    );

    // Watchers: each reads everything at start.
    let t = Instant::now();
    let watch_client = etcd.client().await?;
    let mut watchers = Vec::with_capacity(cfg.watchers);
    for _ in 0..cfg.watchers {
        watchers.push(EtcdRegistry::start(watch_client.clone(), &etcd, true).await?);
    }
    let watchers_start_secs = t.elapsed().as_secs_f64();
    for (w, watcher) in watchers.iter().enumerate() {
        let state = watcher.state();
        if state.segments < cfg.segments || state.agents < cfg.agents {
            return Err(Error::Registry {
                what: format!("watcher {w} start"),
                endpoint: cfg.endpoint.clone(),
                reason: format!(
                    "read {} agents and {} segments, expected {} and {}",
                    state.agents, state.segments, cfg.agents, cfg.segments
                ),
            });
        }
    }

    // Lookups: CPU only, off the async threads; one watcher at a time, so that the samples
    // time the cache rather than threads competing for cores.
    let mut lookup_samples = Vec::with_capacity(cfg.lookups_per_watcher * watchers.len());
    let mut lookup_misses = 0;
    for (w, watcher) in watchers.iter().enumerate() {
        let watcher = watcher.clone();
        let (n, segments, seed) = (cfg.lookups_per_watcher, cfg.segments, cfg.seed + w as u64);
        let job = tokio::task::spawn_blocking(move || {
            let mut rng = SmallRng::seed_from_u64(seed);
            let names: Vec<String> = (0..n)
                .map(|_| segment_name(rng.random_range(0..segments)))
                .collect();
            let mut samples = Vec::with_capacity(n);
            let mut misses = 0u64;
            for name in &names {
                let t = Instant::now();
                let found = watcher.segment(name);
                samples.push(t.elapsed());
                misses += u64::from(found.is_none());
            }
            (samples, misses)
        });
        let (samples, misses) = job.await.map_err(|e| Error::Registry {
            what: "lookups".into(),
            endpoint: cfg.endpoint.clone(),
            reason: e.to_string(),
        })?;
        lookup_samples.extend(samples);
        lookup_misses += misses;
    }

    // Visibility: put new segments one at a time; every watcher notes when it sees each.
    let settle = Duration::from_secs(cfg.settle_timeout_secs);
    let seen_by: Vec<Arc<Mutex<HashMap<String, Instant>>>> = (0..watchers.len())
        .map(|_| Arc::new(Mutex::new(HashMap::with_capacity(cfg.new_segments))))
        .collect();
    let collectors: Vec<_> = watchers
        .iter()
        .zip(&seen_by)
        .map(|(watcher, seen)| {
            let mut events = watcher.subscribe();
            let seen = seen.clone();
            tokio::spawn(async move {
                loop {
                    match events.recv().await {
                        Ok(Event::SegmentPut(s)) if s.name.starts_with("new-") => {
                            let at = Instant::now();
                            seen.lock().entry(s.name).or_insert(at);
                        }
                        Ok(_) | Err(RecvError::Lagged(_)) => {}
                        Err(RecvError::Closed) => break,
                    }
                }
            })
        })
        .collect();
    let mut puts = Vec::with_capacity(cfg.new_segments);
    for i in 0..cfg.new_segments {
        let agent = &agents[i % agents.len()];
        let name = format!("new-{i:06}");
        let entry = segment_entry(&name, &agent_name(i % cfg.agents), &cfg);
        let start = Instant::now();
        agent.put_segment(entry).await?;
        puts.push((name, start, Instant::now()));
    }
    let deadline = Instant::now() + settle;
    while Instant::now() < deadline
        && !seen_by
            .iter()
            .all(|seen| seen.lock().len() >= cfg.new_segments)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Whatever is not seen by now counts as not seen.
    for collector in collectors {
        collector.abort();
    }
    let seen_by: Vec<HashMap<String, Instant>> =
        seen_by.iter().map(|seen| seen.lock().clone()).collect();
    let mut visibility = Vec::new();
    let mut after_ack = Vec::new();
    let mut not_seen = 0;
    for seen in &seen_by {
        for (name, start, ack) in &puts {
            match seen.get(name) {
                Some(at) => {
                    visibility.push(at.saturating_duration_since(*start));
                    after_ack.push(at.saturating_duration_since(*ack));
                }
                None => not_seen += 1,
            }
        }
    }
    let put = puts.iter().map(|(_, start, ack)| *ack - *start).collect();

    // Teardown: revoke every lease (deletes every key of the run).
    let t = Instant::now();
    futures::stream::iter(agents.iter().chain(&watchers))
        .map(|r| r.shutdown())
        .buffer_unordered(cfg.concurrency)
        .try_collect::<()>()
        .await?;
    let teardown_secs = t.elapsed().as_secs_f64();

    Ok(RegistryBenchReport {
        endpoint: cfg.endpoint.clone(),
        fabric,
        agents: cfg.agents,
        segments: cfg.segments,
        watchers: cfg.watchers,
        agents_secs,
        segments_secs,
        segment_puts_per_sec: cfg.segments as f64 / segments_secs.max(1e-9),
        watchers_start_secs,
        lookup: Latency::of(lookup_samples),
        lookup_misses,
        put: Latency::of(put),
        visibility: Latency::of(visibility),
        visibility_after_ack: Latency::of(after_ack),
        not_seen,
        teardown_secs,
        total_secs: started.elapsed().as_secs_f64(),
    })
}

fn validate(cfg: &RegistryBenchConfig) -> Result<()> {
    let positive = [
        ("registry_bench.agents", cfg.agents),
        ("registry_bench.segments", cfg.segments),
        ("registry_bench.watchers", cfg.watchers),
        ("registry_bench.clients", cfg.clients),
        ("registry_bench.concurrency", cfg.concurrency),
        ("registry_bench.lease_ttl_secs", cfg.lease_ttl_secs as usize),
    ];
    for (field, value) in positive {
        if value == 0 {
            return Err(Error::config(field, value, "must be at least 1"));
        }
    }
    if cfg.watchers > cfg.agents {
        return Err(Error::config(
            "registry_bench.watchers",
            cfg.watchers,
            format!("at most the number of agents ({})", cfg.agents),
        ));
    }
    Ok(())
}

fn agent_name(i: usize) -> String {
    format!("agent-{i:05}")
}

fn segment_name(i: usize) -> String {
    format!("seg-{i:06}")
}

fn agent_entry(i: usize) -> AgentEntry {
    let ip = Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8);
    AgentEntry {
        name: agent_name(i),
        pool: if i.is_multiple_of(2) {
            "prefill"
        } else {
            "decode"
        }
        .into(),
        role: None,
        node: format!("boot-id-{i:05}"),
        peer_addr: SocketAddr::new(ip.into(), 50051),
        devices: Devices::default(),
        started_at: 1_700_000_000,
        instance: 0,
    }
}

fn segment_entry(name: &str, agent: &str, cfg: &RegistryBenchConfig) -> SegmentEntry {
    SegmentEntry {
        name: name.into(),
        agent: agent.into(),
        regions: (0..cfg.regions_per_segment)
            .map(|r| SegmentRegion {
                id: RegionId(r as u64 + 1),
                len: 1 << 30,
                location: Location::Cuda { device: r as u32 },
            })
            .collect(),
    }
}

/// `kvfabric registry-bench`: runs against the given etcd or a private one, prints a table with
/// the targets (lookup p99 ≤ 1 ms, visibility p99 ≤ 100 ms).
pub async fn main(args: crate::args::RegistryBenchArgs) -> Result<()> {
    let mut private = None;
    let endpoint = match args.etcd_endpoint.clone() {
        Some(e) => e,
        None => {
            let server = kvfabric_testkit::EtcdServer::start().await?;
            let e = server.endpoint();
            private = Some(server);
            e
        }
    };
    eprintln!(
        "registry bench: {} agents, {} segments, {} watchers against {endpoint}{}",
        args.agents,
        args.segments,
        args.watchers,
        if private.is_some() {
            " (private etcd)"
        } else {
            ""
        }
    );
    let report = run(RegistryBenchConfig {
        endpoint,
        agents: args.agents,
        segments: args.segments,
        watchers: args.watchers,
        new_segments: args.new_segments,
        ..RegistryBenchConfig::default()
    })
    .await?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| Error::io("report", e.into()))?
        );
    } else {
        let mut t = comfy_table::Table::new();
        t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
        t.set_header(["measure", "count", "p50", "p99", "max", "target", "met"]);
        let row = |t: &mut comfy_table::Table, name: &str, l: &Latency, target: Option<f64>| {
            let ms = |us: f64| format!("{:.3} ms", us / 1000.0);
            t.add_row(vec![
                name.to_string(),
                l.count.to_string(),
                ms(l.p50_us),
                ms(l.p99_us),
                ms(l.max_us),
                target.map_or("-".into(), |x| format!("p99 ≤ {} ms", x / 1000.0)),
                target.map_or("-".into(), |x| {
                    if l.p99_us <= x { "yes" } else { "NO" }.to_string()
                }),
            ]);
        };
        row(
            &mut t,
            "lookup (watch cache)",
            &report.lookup,
            Some(1_000.0),
        );
        row(
            &mut t,
            "new segment visible at every watcher",
            &report.visibility,
            Some(100_000.0),
        );
        row(
            &mut t,
            "  same, from the put's ack",
            &report.visibility_after_ack,
            None,
        );
        row(&mut t, "segment put (ack)", &report.put, None);
        println!("{t}");
        println!(
            "setup: {} agents in {:.1} s, {} segments in {:.1} s ({:.0} puts/s), {} watchers \
             loaded in {:.1} s; misses {}, not seen {}; total {:.1} s",
            report.agents,
            report.agents_secs,
            report.segments,
            report.segments_secs,
            report.segment_puts_per_sec,
            report.watchers,
            report.watchers_start_secs,
            report.lookup_misses,
            report.not_seen,
            report.total_secs
        );
    }
    drop(private);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles() {
        let l = Latency::of((1..=100).map(Duration::from_micros).collect());
        assert_eq!(
            (l.count, l.p50_us, l.p99_us, l.max_us),
            (100, 50.0, 99.0, 100.0)
        );
        assert_eq!(Latency::of(Vec::new()).count, 0);
    }
}
