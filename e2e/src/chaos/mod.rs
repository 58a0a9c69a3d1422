//! Chaos that runs for as long as it is given (issue 26): agents in network namespaces on a
//! three-member etcd, workers registering and pulling verified blocks between every pair of
//! them, and a schedule of faults — agent SIGKILL and SIGTERM, a worker dropped mid-pull, an
//! etcd member killed (the leader every other time), two peers blackholed, every agent
//! restarted at once. After each fault: how long until every pair of workers moves verified
//! bytes again, and whether etcd's keys settle to exactly the live agents and segments. At the
//! end: wrong bytes (must be 0), pulls hung past their deadline (must be 0), and each agent's
//! fds, threads and RSS against the same agent's before the first fault.

mod board;
mod fault;
mod puller;
mod report;
mod resources;
mod tally;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_testkit::EtcdCluster;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

pub use fault::Fault;
pub use puller::Shape;
pub use report::{AgentResources, Recovery, Report};

use crate::{AgentProcess, Network};
use board::Board;
use resources::Resources;
use tally::Tally;

/// The registry root of the agents' `--fabric e2e`.
const ROOT: &str = "/kvfabric/default/e2e/";
const ETCD_MEMBERS: usize = 3;
/// A fault not recovered from within this long counts as unrecovered.
const RECOVERY_LIMIT: Duration = Duration::from_secs(60);
/// How long a fresh fabric may take until every pair pulls: a cold start on a loaded machine
/// (first runs of debug binaries, the etcd cluster electing its first leader) is no fault.
const START_LIMIT: Duration = Duration::from_secs(240);

/// A validated chaos run.
#[derive(Debug, Clone)]
pub struct Config {
    pub agents: usize,
    pub duration: Duration,
    /// Pause between one fault's recovery and the next fault.
    pub fault_every: Duration,
    pub seed: u64,
    pub shape: Shape,
    /// Agents' registry lease TTL.
    pub lease_ttl_secs: u64,
    /// Faults drawn from (each in turn, in an order the seed shuffles).
    pub faults: Vec<Fault>,
    /// Stop after this many faults, even with time left.
    pub max_faults: Option<usize>,
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("network namespaces are needed (run as root with `ip netns`): {0}")]
    NoNamespaces(String),
    #[error("etcd cluster: {0}")]
    Etcd(String),
    /// The baseline (each agent's fds, threads and RSS with every pair pulling) can only be
    /// read from a fabric that pulls: without it no later reading means anything.
    #[error("the fabric did not get every pair of workers pulling within {0:?} of its start")]
    NotStarted(Duration),
}

struct Fabric {
    net: Network,
    etcd: EtcdCluster,
    agents: Vec<AgentProcess>,
    workers: Vec<Option<tokio::task::JoinHandle<()>>>,
    board: Arc<Board>,
    tally: Arc<Tally>,
    config: Config,
    rng: rand::rngs::StdRng,
    /// Which etcd member the next member kill hits first: the leader or a follower.
    kill_leader: bool,
}

/// Runs the chaos `config` describes; `progress` is told the elapsed time and a line of
/// counts after every fault.
pub async fn run(config: Config, progress: impl Fn(Duration, String)) -> Result<Report, Error> {
    let setup = Instant::now();
    let mut fabric = Fabric::start(config).await?;
    if !fabric.all_pairs_pulling(setup, START_LIMIT).await {
        fabric.stop_workers();
        return Err(Error::NotStarted(START_LIMIT));
    }
    fabric.settle(setup, "start").await;
    progress(
        Duration::ZERO,
        format!("fabric up, every pair pulling, in {:.1?}", setup.elapsed()),
    );
    let start = Instant::now();
    let baseline = fabric.resources();
    let mut report = Report::new(fabric.config.clone());
    let mut order = fabric.config.faults.clone();
    let mut i = 0usize;
    while start.elapsed() < fabric.config.duration && fabric.config.max_faults.is_none_or(|m| i < m)
    {
        if i.is_multiple_of(order.len()) {
            order.shuffle(&mut fabric.rng);
        }
        let fault = order[i % order.len()];
        i += 1;
        let (what, recovery) = fabric.inject(fault).await;
        report.recoveries.push(Recovery {
            fault,
            what,
            took: recovery.0,
            keys_settled: recovery.1,
        });
        progress(start.elapsed(), fabric.counts(report.recoveries.len()));
        tokio::time::sleep(fabric.config.fault_every).await;
    }
    // Quiet: every pair moves again and the keys settle once more before the last readings.
    let quiet = Instant::now();
    let (took, keys) = fabric.settle(quiet, "end").await;
    report.final_recovery = took;
    report.final_keys_settled = keys;
    report.elapsed = start.elapsed();
    report.resources = baseline
        .into_iter()
        .zip(fabric.resources())
        .map(|((agent, before), (_, after))| AgentResources {
            agent,
            before,
            after,
        })
        .collect();
    fabric.stop_workers();
    report.fill(&fabric.tally);
    Ok(report)
}

impl Fabric {
    async fn start(config: Config) -> Result<Fabric, Error> {
        let n = config.agents;
        let net = Network::namespaces(n + 1).map_err(Error::NoNamespaces)?;
        let host = &net.hosts[n];
        let etcd = EtcdCluster::start_in(host.netns.as_deref(), host.ip, ETCD_MEMBERS)
            .await
            .map_err(|e| Error::Etcd(e.to_string()))?;
        let endpoints = etcd.endpoints().join(",");
        let mut flags = crate::fault_flags(config.lease_ttl_secs, 5000);
        flags.extend(["--grace-secs".into(), "3".into()]);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let agents: Vec<AgentProcess> = (0..n)
            .map(|i| AgentProcess::spawn(&format!("chaos-{i}"), &net.hosts[i], &endpoints, &flags))
            .collect();
        let mut fabric = Fabric {
            net,
            etcd,
            agents,
            workers: (0..n).map(|_| None).collect(),
            board: Arc::new(Board::new(n)),
            tally: Arc::new(Tally::default()),
            rng: rand::rngs::StdRng::seed_from_u64(config.seed),
            config,
            kill_leader: true,
        };
        for slot in 0..n {
            fabric.spawn_worker(slot);
        }
        Ok(fabric)
    }

    fn spawn_worker(&mut self, slot: usize) {
        let seed = self.config.seed ^ self.rng.random::<u64>();
        self.workers[slot] = Some(tokio::spawn(puller::run(
            slot,
            self.agents[slot].socket_dir().to_path_buf(),
            self.config.shape,
            self.board.clone(),
            self.tally.clone(),
            seed,
        )));
    }

    fn stop_workers(&mut self) {
        for w in self.workers.iter_mut().flatten() {
            w.abort();
        }
    }

    /// Injects `fault`, lifts it, and measures the recovery: (what was hit, (time until every
    /// pair moved verified bytes again, whether etcd's keys settled to the live ones)).
    async fn inject(&mut self, fault: Fault) -> (String, (Option<Duration>, bool)) {
        let n = self.config.agents;
        let a = self.rng.random_range(0..n);
        let what = match fault {
            Fault::AgentKill => {
                self.agents[a].kill9();
                tokio::time::sleep(fault.outage()).await;
                self.agents[a].restart();
                self.agents[a].name.clone()
            }
            Fault::AgentTerm => {
                self.agents[a].sigterm();
                let grace = tokio::task::block_in_place(|| {
                    self.agents[a].wait_exit(Duration::from_secs(15))
                });
                tokio::time::sleep(fault.outage()).await;
                self.agents[a].restart();
                format!("{} (exit {grace:?})", self.agents[a].name)
            }
            Fault::WorkerKill => {
                // Mid-pull: the worker is aborted wherever it is, most likely in a pull.
                if let Some(w) = self.workers[a].take() {
                    w.abort();
                    let _ = w.await;
                }
                self.board.clear(a);
                self.spawn_worker(a);
                format!("w{a}")
            }
            Fault::EtcdMemberKill => {
                let member = if self.kill_leader {
                    self.etcd.leader().await.ok()
                } else {
                    None
                };
                self.kill_leader = !self.kill_leader;
                let names = self.etcd.names();
                let member =
                    member.unwrap_or_else(|| names[self.rng.random_range(0..names.len())].clone());
                let _ = self.etcd.kill(&member).await;
                tokio::time::sleep(fault.outage()).await;
                if let Err(e) = self.etcd.start_again(&member).await {
                    eprintln!("etcd member {member} did not come back: {e}");
                }
                member
            }
            Fault::Blackhole => {
                let b = (a + 1 + self.rng.random_range(0..n - 1)) % n;
                let cut = self.net.partition(a, b);
                tokio::time::sleep(fault.outage()).await;
                if cut.is_ok() {
                    let _ = self.net.heal(a, b);
                }
                format!("{} ↔ {}", self.agents[a].name, self.agents[b].name)
            }
            Fault::FullRestart => {
                for agent in &mut self.agents {
                    agent.kill9();
                }
                tokio::time::sleep(fault.outage()).await;
                for agent in &mut self.agents {
                    agent.restart();
                }
                "all".into()
            }
        };
        let lifted = Instant::now();
        (what, self.settle(lifted, &fault.to_string()).await)
    }

    /// Whether every pair of workers moved verified bytes after `since`, waiting up to `limit`.
    async fn all_pairs_pulling(&self, since: Instant, limit: Duration) -> bool {
        while since.elapsed() < limit {
            if self.tally.all_pairs_since(self.config.agents, since) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Waits until every pair of workers moved verified bytes after `since` and etcd holds
    /// exactly the live agents' and workers' keys; (how long the first took, whether the keys
    /// settled).
    async fn settle(&mut self, since: Instant, what: &str) -> (Option<Duration>, bool) {
        let recovered = self
            .all_pairs_pulling(since, RECOVERY_LIMIT)
            .await
            .then(|| since.elapsed());
        if recovered.is_none() {
            eprintln!("after {what}: not every pair of workers pulled within {RECOVERY_LIMIT:?}");
        }
        // Keys of agents that died go with their lease: allow a TTL and the watch's delay.
        let limit = Duration::from_secs(2 * self.config.lease_ttl_secs + 10);
        let keys_from = Instant::now();
        let mut last = (Vec::new(), Vec::new());
        while keys_from.elapsed() < limit {
            let stored = self.etcd.keys(ROOT).await.unwrap_or_default();
            let live = self.live_keys();
            if stored == live {
                return (recovered, true);
            }
            last = (stored, live);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "after {what}: etcd holds {:?}, the live fabric {:?}",
            last.0, last.1
        );
        (recovered, false)
    }

    /// The keys etcd should hold: every agent and the segments of every published worker.
    fn live_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .agents
            .iter()
            .map(|a| format!("{ROOT}agents/{}", a.name))
            .chain(
                self.board
                    .segment_names()
                    .into_iter()
                    .map(|s| format!("{ROOT}segments/{s}")),
            )
            .collect();
        keys.sort();
        keys
    }

    fn resources(&self) -> Vec<(String, Option<Resources>)> {
        self.agents
            .iter()
            .map(|a| (a.name.clone(), a.pid().and_then(Resources::of)))
            .collect()
    }

    fn counts(&self, faults: usize) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let t = &self.tally;
        format!(
            "faults {faults} · pulls {} · failed {} · hung {} · wrong bytes {}",
            t.pulls.load(Relaxed),
            t.failed.load(Relaxed),
            t.hung.load(Relaxed),
            t.wrong_bytes.load(Relaxed)
        )
    }
}
