//! The registry on a real three-member etcd cluster (issue 26, items 3 and 4): agents in network
//! namespaces given all three endpoints, etcd's members in a namespace of their own, and pulls
//! between agents going on (every byte checked) while the leader is killed, then a follower
//! (the quorum with it), both come back, one agent is cut off from etcd but not from its peers
//! for longer than its lease, and history an agent's watch still needs is compacted away.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{BLOCK, has_namespaces, within};
use kvfabric_agent::registry::SegmentEntry;
use kvfabric_client::{Client, HostMemory, Op, Segment};
use kvfabric_e2e::worker::{first_mismatch, random_memory, scattered};
use kvfabric_e2e::{AgentProcess, Network, fault_flags};
use kvfabric_operator::finalizer::{CleanupPolicy, EtcdAccess, EtcdCleaner, clean_registry};
use kvfabric_proto::contract::registry_root;
use kvfabric_testkit::EtcdCluster;

const MEMBERS: usize = 3;
/// The fabric's registry root, as the agents' `--fabric e2e` makes it.
const ROOT: &str = "/kvfabric/default/e2e/";
/// Blocks per pull: small, so the pulls keep going without starving etcd of the two cores.
const BLOCKS: u64 = 16;

/// Agents on hosts `0..n`, etcd's members on host `n`.
struct Fabric {
    net: Network,
    etcd: EtcdCluster,
    agents: Vec<AgentProcess>,
    clients: Vec<Client>,
}

impl Fabric {
    /// `names.len()` agents with lease TTL `ttl_secs`, all given every member's endpoint; None
    /// where namespaces or etcd are missing (a recorded skip, a failure in CI).
    async fn start(names: &[&str], ttl_secs: u64) -> Option<Fabric> {
        let net = Network::new(names.len() + 1);
        if !has_namespaces(&net) {
            return None;
        }
        let host = &net.hosts[names.len()];
        let etcd = EtcdCluster::or_skip(
            EtcdCluster::start_in(host.netns.as_deref(), host.ip, MEMBERS).await,
        )?;
        let endpoints = etcd.endpoints().join(",");
        let flags = fault_flags(ttl_secs, 5000);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut agents = Vec::new();
        let mut clients = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let agent = AgentProcess::spawn(name, &net.hosts[i], &endpoints, &flags);
            clients.push(Client::connect(agent.socket_dir()).await.unwrap());
            agents.push(agent);
        }
        Some(Fabric {
            net,
            etcd,
            agents,
            clients,
        })
    }

    /// Segment names agent `i` sees (its registry cache), each once per row.
    async fn view(&self, i: usize) -> Vec<String> {
        match self.clients[i].status().await {
            Ok(s) => s.segments.into_iter().map(|r| r.name).collect(),
            Err(e) => panic!("status of {}: {e}", self.agents[i].name),
        }
    }

    /// What agent `i` sees: (segment, agent, bytes) per row, sorted.
    async fn rows(&self, i: usize) -> Vec<(String, String, u64)> {
        let mut rows: Vec<_> = self.clients[i]
            .status()
            .await
            .unwrap()
            .segments
            .into_iter()
            .map(|r| (r.name, r.agent, r.bytes))
            .collect();
        rows.sort();
        rows
    }

    /// The keys etcd should hold: every agent in `live` and the segments their workers
    /// registered (what each agent reports as local), read from the agents themselves.
    async fn live_keys(&self, live: &[usize]) -> Vec<String> {
        let mut keys = Vec::new();
        for &i in live {
            keys.push(format!("{ROOT}agents/{}", self.agents[i].name));
            let status = self.clients[i].status().await.unwrap();
            for row in status.segments.iter().filter(|r| r.local) {
                keys.push(format!("{ROOT}segments/{}", row.name));
            }
        }
        keys.sort();
        keys
    }

    /// The fabric's keys in etcd (a linearizable read), empty while the cluster cannot answer.
    async fn etcd_keys(&mut self) -> Vec<String> {
        self.etcd.keys(ROOT).await.unwrap_or_default()
    }

    /// Waits until etcd holds exactly the keys of the agents in `live` and their segments.
    async fn keys_settle(&mut self, live: &[usize], limit: Duration, what: &str) -> Duration {
        let start = Instant::now();
        loop {
            let (want, have) = (self.live_keys(live).await, self.etcd_keys().await);
            if want == have {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < limit,
                "{what}: etcd keys differ from the live agents' after {limit:?}\n\
                 want {want:#?}\netcd {have:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Agent `i`'s counter `name` from its `/metrics`.
    async fn counter(&self, i: usize, name: &str) -> u64 {
        let agent = &self.agents[i];
        let samples = kvfabric_agent::metrics::scrape(agent.ready.metrics)
            .await
            .unwrap_or_else(|e| panic!("scrape {}: {e}", agent.name));
        samples
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v as u64)
            .unwrap_or_else(|| panic!("{} has no {name}", agent.name))
    }

    async fn relists(&self, i: usize) -> u64 {
        self.counter(i, "kvfabric_agent_registry_relists_total")
            .await
    }

    async fn resumes(&self, i: usize) -> u64 {
        self.counter(i, "kvfabric_agent_registry_watch_resumes_total")
            .await
    }

    /// What a failing test shows: each agent's log and etcd's keys and member logs.
    fn report(&mut self) {
        for a in &self.agents {
            let log = a.log();
            let tail = &log[log.len().saturating_sub(6000)..];
            eprintln!("===== agent {} log (tail) =====\n{tail}", a.name);
        }
        let etcd = &mut self.etcd;
        // Drop runs inside the test's runtime: read etcd from a runtime of its own.
        let keys = std::thread::scope(|s| {
            s.spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?
                    .block_on(async {
                        tokio::time::timeout(Duration::from_secs(5), etcd.keys_and_leases(ROOT))
                            .await
                            .map_err(|_| "timed out".to_string())?
                            .map_err(|e| e.to_string())
                    })
            })
            .join()
            .unwrap_or_else(|_| Err("panicked".into()))
        });
        eprintln!("===== etcd keys (key, lease) =====\n{keys:#?}");
        eprintln!(
            "===== etcd members (log tails) =====\n{}",
            self.etcd.log_tails(1500)
        );
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.report();
        }
    }
}

/// Pulls of one remote segment into a local one, one after the other, each checked byte for
/// byte, until stopped.
struct Pulls {
    what: String,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<PullReport>,
}

#[derive(Debug, Default)]
struct PullReport {
    ok: u64,
    bytes: u64,
    /// Each failed or wrong pull: when (since the start) and why.
    failures: Vec<String>,
}

impl Pulls {
    fn start(
        client: &Client,
        local: &Segment,
        remote: &Segment,
        dst: HostMemory,
        src: Arc<HostMemory>,
    ) -> Pulls {
        let stop = Arc::new(AtomicBool::new(false));
        let what = format!("{} <- {}", local.name, remote.name);
        let ops: Vec<Op> = scattered(BLOCKS, BLOCK, BLOCKS);
        let (client, local, remote_name, key) = (
            client.clone(),
            local.clone(),
            remote.name.clone(),
            remote.key,
        );
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut report = PullReport::default();
                let start = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: this task is the only user of `dst`, and no batch is in flight.
                    unsafe { dst.as_mut_slice() }.fill(0);
                    let pull = client.read(&local, &remote_name, key, &ops);
                    match tokio::time::timeout(Duration::from_secs(10), pull).await {
                        Ok(Ok(done)) => match first_mismatch(&ops, &dst, &src) {
                            None => {
                                report.ok += 1;
                                report.bytes += done.bytes;
                            }
                            Some(op) => report.failures.push(format!(
                                "{:?}: op {op} did not bring its block",
                                start.elapsed()
                            )),
                        },
                        Ok(Err(e)) => report.failures.push(format!("{:?}: {e}", start.elapsed())),
                        Err(_) => report
                            .failures
                            .push(format!("{:?}: hung for 10 s", start.elapsed())),
                    }
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
                report
            }
        });
        Pulls { what, stop, task }
    }

    /// The pulls done since the start, without stopping them.
    async fn finish(self) -> PullReport {
        self.stop.store(true, Ordering::Relaxed);
        let report = self.task.await.unwrap();
        println!(
            "pulls {}: {} verified ({} MiB), {} failed",
            self.what,
            report.ok,
            report.bytes >> 20,
            report.failures.len()
        );
        report
    }
}

/// A worker's segment of seeded random bytes, and its memory.
async fn register(client: &Client, name: &str, seed: u64) -> (Segment, HostMemory) {
    let memory = random_memory(BLOCKS * BLOCK, seed);
    let segment = client.register(name, &[&memory], None).await.unwrap();
    (segment, memory)
}

/// Waits until every agent `of` sees exactly `want` (and each once).
async fn views_are(
    f: &Fabric,
    of: &[usize],
    want: &[&str],
    limit: Duration,
    what: &str,
) -> Duration {
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    want.sort();
    let start = Instant::now();
    loop {
        let mut all = true;
        for &i in of {
            let mut have = f.view(i).await;
            have.sort();
            if have != want {
                all = false;
                if start.elapsed() >= limit {
                    panic!(
                        "{what}: {} sees {have:?}, not {want:?} after {limit:?}",
                        f.agents[i].name
                    );
                }
            }
        }
        if all {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_and_follower_loss_and_a_partitioned_agent_on_a_three_member_cluster() {
    const TTL_SECS: u64 = 3;
    let ttl = Duration::from_secs(TTL_SECS);
    let names = ["prefill-node", "decode-node", "third-node"];
    let Some(mut f) = Fabric::start(&names, TTL_SECS).await else {
        return;
    };
    let etcd_host = names.len();
    let (a, b, c) = (0, 1, 2);
    let (a_src, a_src_mem) = register(&f.clients[a], "a-src", 1).await;
    let (a_dst, a_dst_mem) = register(&f.clients[a], "a-dst", 2).await;
    let (b_src, b_src_mem) = register(&f.clients[b], "b-src", 3).await;
    let (b_dst, b_dst_mem) = register(&f.clients[b], "b-dst", 4).await;
    let (c_0, c_0_mem) = register(&f.clients[c], "c-0", 5).await;
    let (c_1, c_1_mem) = register(&f.clients[c], "c-1", 6).await;
    let a_src_mem = Arc::new(a_src_mem);
    let mut all = vec!["a-src", "a-dst", "b-src", "b-dst", "c-0", "c-1"];
    views_are(&f, &[a, b, c], &all, Duration::from_secs(10), "start").await;
    f.keys_settle(&[a, b, c], Duration::from_secs(5), "start")
        .await;

    // Pulls both ways between the two agents that stay healthy, for the whole test.
    let pulls = [
        Pulls::start(&f.clients[b], &b_dst, &a_src, b_dst_mem, a_src_mem.clone()),
        Pulls::start(
            &f.clients[a],
            &a_dst,
            &b_src,
            a_dst_mem,
            Arc::new(b_src_mem),
        ),
    ];
    let relists_before: Vec<u64> = vec![f.relists(a).await, f.relists(b).await, f.relists(c).await];
    assert_eq!(relists_before, [0, 0, 0], "no relist at start");

    // 1. The leader dies. The two members left elect another; writes go on through it.
    let first = f.etcd.leader().await.unwrap();
    let killed = Instant::now();
    f.etcd.kill(&first).await.unwrap();
    let second = f.etcd.leader().await.unwrap();
    println!(
        "leader {first} killed; {second} elected {:?} later",
        killed.elapsed()
    );
    let (_a_new, _a_new_mem) = register(&f.clients[a], "a-new", 9).await;
    all.push("a-new");
    let seen = views_are(
        &f,
        &[a, b, c],
        &all,
        Duration::from_secs(10),
        "after the leader's death",
    )
    .await;
    println!("a segment registered after the leader's death seen everywhere in {seen:?}");

    // 2. A follower dies too: one member of three, no quorum. Nothing can be written or
    //    renewed for longer than a TTL; the caches keep every entry and the pulls go on.
    let follower = f
        .etcd
        .running()
        .into_iter()
        .find(|m| *m != second)
        .expect("a follower");
    f.etcd.kill(&follower).await.unwrap();
    println!("follower {follower} killed: quorum lost");
    tokio::time::sleep(ttl + Duration::from_secs(2)).await;
    views_are(&f, &[a, b, c], &all, Duration::ZERO, "without quorum").await;

    // 3. Both come back: the agents re-register under new leases, nothing is lost or doubled.
    let back = Instant::now();
    f.etcd.start_again(&first).await.unwrap();
    f.etcd.start_again(&follower).await.unwrap();
    let leader = f.etcd.leader().await.unwrap();
    println!(
        "{first} and {follower} back, {leader} leads, {:?} after the restart",
        back.elapsed()
    );
    let took = f.keys_settle(&[a, b, c], ttl * 3, "quorum back").await;
    println!(
        "etcd holds every live entry again {:?} after the restart",
        back.elapsed()
    );
    assert!(took <= ttl * 2, "{took:?}");
    views_are(&f, &[a, b, c], &all, Duration::from_secs(5), "quorum back").await;
    // Longer than a TTL without a keepalive answered: each agent counted its lease lost and
    // re-registers once a quorum is back (the new leader kept the old leases alive meanwhile,
    // so the keys above may still be the old lease's).
    for (i, client) in f.clients.iter().enumerate() {
        let start = Instant::now();
        loop {
            let state = client.status().await.unwrap().registry;
            if state.reregistrations >= 1 && state.lease_id != 0 {
                break;
            }
            assert!(start.elapsed() < ttl * 2, "{}: {state:?}", names[i]);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // 4. The third agent is cut off from etcd, not from its peers, for longer than its lease:
    //    the others stop seeing its entries within a TTL and the watch's delay, the healthy
    //    agents' transfers go on, and once healed it is back, once.
    let c_names = ["c-0", "c-1"];
    let without_c: Vec<&str> = all
        .iter()
        .copied()
        .filter(|s| !c_names.contains(s))
        .collect();
    let cut = Instant::now();
    f.net.partition(c, etcd_host).unwrap();
    let gone = views_are(
        &f,
        &[a, b],
        &without_c,
        ttl * 3,
        "the partitioned agent's segments expire",
    )
    .await;
    println!(
        "partitioned agent's segments gone from the others' views {gone:?} after the cut (TTL {ttl:?})"
    );
    assert!(gone <= ttl + Duration::from_secs(2), "{gone:?}");
    for i in [a, b] {
        let status = f.clients[i].status().await.unwrap();
        assert!(
            status.agents.iter().all(|x| x.name != "third-node"),
            "{} still lists the partitioned agent: {:?}",
            names[i],
            status.agents
        );
    }
    // Cut off from etcd, not from its peers: its cache still names a-src, and its worker pulls
    // from it, byte for byte.
    let ops = scattered(BLOCKS, BLOCK, BLOCKS);
    // SAFETY: no batch is in flight on c-1's memory.
    unsafe { c_1_mem.as_mut_slice() }.fill(0);
    f.clients[c]
        .read(&c_1, "a-src", a_src.key, &ops)
        .await
        .unwrap_or_else(|e| panic!("the partitioned agent's pull from a peer: {e}"));
    assert_eq!(first_mismatch(&ops, &c_1_mem, &a_src_mem), None);
    // A change the partitioned agent cannot see until its watch resumes after healing.
    let (_a_during, _a_during_mem) = register(&f.clients[a], "a-during", 11).await;
    all.push("a-during");
    let hold = (ttl + Duration::from_secs(1)).saturating_sub(cut.elapsed());
    tokio::time::sleep(hold).await;
    f.net.heal(c, etcd_host).unwrap();
    // Within three TTLs: the keeper tries again within a second, but a connection that
    // stalled through the partition carries requests again only at its next TCP
    // retransmission (seconds apart by now), or once the transport's keepalive replaces it.
    let returned = views_are(
        &f,
        &[a, b, c],
        &all,
        ttl * 3,
        "the partitioned agent's segments return, and it sees what changed meanwhile",
    )
    .await;
    println!(
        "partitioned agent's segments back in the others' views, and what changed meanwhile in \
         its own, {returned:?} after healing"
    );
    f.keys_settle(&[a, b, c], ttl * 2, "after healing").await;

    // Every key is bound to its agent's current lease, and etcd holds no other lease: the
    // leases given up (the quorum loss, the partition) are gone, none holds a stray copy.
    let settled = Instant::now();
    while f.etcd.leases().await.map_or(true, |l| l.len() != 3) {
        assert!(
            settled.elapsed() < ttl * 2,
            "leases besides the three agents' current ones: {:?}",
            f.etcd.leases().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "old leases gone {:?} after the keys settled",
        settled.elapsed()
    );
    let mut current = BTreeSet::new();
    for (i, client) in f.clients.iter().enumerate() {
        // Connected: its last request answered (a keepalive may just have failed once more).
        let start = Instant::now();
        let state = loop {
            let state = client.status().await.unwrap().registry;
            if state.connected {
                break state;
            }
            assert!(start.elapsed() < ttl, "{}: {state:?}", names[i]);
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        current.insert(state.lease_id);
    }
    assert_eq!(
        f.etcd
            .leases()
            .await
            .unwrap()
            .into_iter()
            .collect::<BTreeSet<_>>(),
        current
    );
    for (key, lease) in f.etcd.keys_and_leases(ROOT).await.unwrap() {
        assert!(
            current.contains(&lease),
            "{key} bound to lease {lease:x}, not a live agent's"
        );
    }
    // C's segment serves again through the registry.
    let probe_dst = random_memory(BLOCKS * BLOCK, 10);
    let probe = f.clients[b]
        .register("b-probe", &[&probe_dst], None)
        .await
        .unwrap();
    within(
        Duration::from_secs(5),
        "decode pulls from the healed agent",
        || {
            let (client, probe, ops) = (f.clients[b].clone(), probe.clone(), ops.clone());
            let key = c_0.key;
            async move { client.read(&probe, "c-0", key, &ops).await.is_ok() }
        },
    )
    .await;
    assert_eq!(first_mismatch(&ops, &probe_dst, &c_0_mem), None);
    f.clients[b].deregister(&probe).await.unwrap();

    // No watch read everything again: no history was compacted, so each resumed from the
    // revision it had reached, however its stream ended (its member killed, the quorum lost,
    // the partition). Every agent's watch did end at least once (two of three members died,
    // and the survivor cancels watches while it has no leader).
    let mut counts = Vec::new();
    for i in [a, b, c] {
        counts.push((names[i], f.relists(i).await, f.resumes(i).await));
    }
    println!("(agent, relists, watch resumes): {counts:?}");
    for (name, relists, resumes) in &counts {
        assert_eq!(*relists, 0, "{name} re-read the whole registry: {counts:?}");
        assert!(*resumes >= 1, "{name}'s watch never resumed: {counts:?}");
    }

    for pulls in pulls {
        let report = pulls.finish().await;
        assert!(report.failures.is_empty(), "{:#?}", report.failures);
        assert!(report.ok >= 20, "{report:?}");
    }

    // 5. No entry outlives its agent: a killed agent's keys leave etcd with its lease.
    let dead = Instant::now();
    f.agents[c].kill9();
    let gone = f
        .keys_settle(&[a, b], ttl * 3, "killed agent's keys expire")
        .await;
    println!(
        "killed agent's keys gone from etcd {:?} after kill -9 (TTL {ttl:?})",
        dead.elapsed()
    );
    assert!(gone <= ttl + Duration::from_secs(2), "{gone:?}");

    // 6. The operator's finalizer cleans the fabric with a member down (the leader): every
    //    key under the fabric's root goes at once, leased or not, and nothing else.
    let leader = f.etcd.leader().await.unwrap();
    f.etcd.kill(&leader).await.unwrap();
    f.etcd.leader().await.unwrap();
    let mut client = f.etcd.client().await.unwrap();
    client
        .put(format!("{ROOT}segments/ghost"), "{}", None)
        .await
        .unwrap();
    let other = "/kvfabric/default/e2e-other/agents/x";
    client.put(other, "{}", None).await.unwrap();
    let before = f.etcd_keys().await.len() as u64;
    let access = EtcdAccess {
        endpoints: f.etcd.endpoints(),
        ..EtcdAccess::default()
    };
    let policy = CleanupPolicy {
        attempts: 3,
        timeout: Duration::from_secs(3),
        backoff: Duration::from_millis(200),
    };
    let cleaner = EtcdCleaner {
        timeout: Duration::from_secs(2),
    };
    let prefix = registry_root("/kvfabric", "default", "e2e") + "/";
    let start = Instant::now();
    let deleted = clean_registry(&cleaner, &policy, &access, &prefix)
        .await
        .unwrap_or_else(|e| panic!("cleanup with {leader} down: {e}"));
    println!(
        "finalizer cleanup with {leader} down: {deleted} keys in {:?}",
        start.elapsed()
    );
    assert_eq!(deleted, before, "every key of the fabric");
    assert_eq!(f.etcd_keys().await, Vec::<String>::new());
    assert_eq!(f.etcd.keys("/kvfabric/").await.unwrap(), [other]);
}

/// A member's kill, with the agent paused, closes its watch stream for good; history compacted
/// past the agent's revision meanwhile leaves a full read as the only way to catch up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_past_a_paused_agents_watch_makes_it_relist_once_and_converge() {
    // Longer than the pause: the paused agent keeps its lease, so what changes is only what
    // the other agent does.
    const TTL_SECS: u64 = 15;
    let names = ["prefill-node", "decode-node"];
    let Some(mut f) = Fabric::start(&names, TTL_SECS).await else {
        return;
    };
    let (a, b) = (0, 1);
    let mut kept = Vec::new();
    let mut segments = Vec::new();
    for (i, name) in ["a-0", "a-1", "a-2"].iter().enumerate() {
        let (s, m) = register(&f.clients[a], name, i as u64).await;
        segments.push(s);
        kept.push(m);
    }
    let dst = random_memory(2 * BLOCKS * BLOCK, 20);
    let b_dst = f.clients[b].register("b-dst", &[&dst], None).await.unwrap();
    let before = ["a-0", "a-1", "a-2", "b-dst"];
    views_are(&f, &[a, b], &before, Duration::from_secs(10), "start").await;
    assert_eq!((f.relists(a).await, f.relists(b).await), (0, 0));

    // B stops; every member restarts (so B's watch stream, wherever it was, is closed before
    // anything changes and B's kernel can buffer no event for it); then A's worker removes
    // a-1, adds a-3, replaces a-0 by a larger one, and etcd compacts past all of it.
    f.agents[b].pause();
    let paused = Instant::now();
    for member in f.etcd.names() {
        f.etcd.kill(&member).await.unwrap();
        f.etcd.start_again(&member).await.unwrap();
        f.etcd.leader().await.unwrap();
    }
    let a0 = segments.remove(0);
    f.clients[a].deregister(&a0).await.unwrap();
    let big = random_memory(2 * BLOCKS * BLOCK, 30);
    let a0 = f.clients[a].register("a-0", &[&big], None).await.unwrap();
    f.clients[a].deregister(&segments[0]).await.unwrap();
    let (a3, a3_mem) = register(&f.clients[a], "a-3", 31).await;
    let after = ["a-0", "a-2", "a-3", "b-dst"];
    views_are(&f, &[a], &after, Duration::from_secs(5), "A's own view").await;
    let compacted = f.etcd.compact().await.unwrap();
    println!(
        "decode agent paused {:?}; history compacted at revision {compacted}",
        paused.elapsed()
    );
    assert!(
        paused.elapsed() < Duration::from_secs(TTL_SECS),
        "paused past its lease"
    );

    // B goes on: its watch finds the stream closed, asks to resume from where it was, is told
    // "compacted", reads everything once, and then sees exactly what etcd holds.
    let resumed = Instant::now();
    f.agents[b].resume();
    let took = views_are(
        &f,
        &[b],
        &after,
        Duration::from_secs(10),
        "B converges after the compaction",
    )
    .await;
    println!("decode agent's view converged {took:?} after SIGCONT");
    // The same entries as etcd's, not only the same names (a-0 grew).
    let mut want = Vec::new();
    let mut client = f.etcd.client().await.unwrap();
    let resp = client
        .get(
            format!("{ROOT}segments/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    for kv in resp.kvs() {
        let s: SegmentEntry = serde_json::from_slice(kv.value()).unwrap();
        want.push((
            s.name,
            s.agent,
            s.regions.iter().map(|r| r.len).sum::<u64>(),
        ));
    }
    want.sort();
    assert_eq!(f.rows(b).await, want);
    // Once: no storm of reads after it either.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let counts = (f.relists(a).await, f.relists(b).await);
    println!(
        "relists (A, B): {counts:?} {:?} after SIGCONT",
        resumed.elapsed()
    );
    assert_eq!(
        counts,
        (0, 1),
        "A resumed without a relist, B relisted once"
    );
    assert!(
        f.agents[b].log().contains("compacted"),
        "B's log does not say its watch was compacted"
    );

    // What B sees, it reaches: the grown a-0 and the new a-3, byte for byte.
    for (segment, src, blocks) in [(&a0, &big, 2 * BLOCKS), (&a3, &a3_mem, BLOCKS)] {
        let ops = scattered(blocks, BLOCK, blocks);
        // SAFETY: no batch is in flight on `dst`.
        unsafe { dst.as_mut_slice() }.fill(0);
        f.clients[b]
            .read(&b_dst, &segment.name, segment.key, &ops)
            .await
            .unwrap();
        assert_eq!(first_mismatch(&ops, &dst, src), None, "{}", segment.name);
    }
}
