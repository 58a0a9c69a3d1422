//! The chaos runner (`kvfabric-chaos`) once through every fault kind: agent SIGKILL and
//! SIGTERM, a worker dropped mid-pull, an etcd member killed, two peers blackholed, every agent
//! restarted at once, with pulls going on between three agents all along. Every invariant must
//! hold: no wrong byte, no pull hung past its deadline, every fault recovered from, etcd's keys
//! back to exactly the live agents and segments, fds/threads/RSS back. The long runs are the
//! command's (`scripts/chaos.sh`); their reports are in docs/results.md.

use std::time::Duration;

use kvfabric_e2e::chaos::{self, Config, Fault, Shape};
use kvfabric_testkit::skip::{Why, skip};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_kind_once_keeps_every_invariant() {
    let config = Config {
        agents: 3,
        duration: Duration::from_secs(600),
        fault_every: Duration::from_millis(500),
        seed: rand::random(),
        shape: Shape {
            block: 32 << 10,
            blocks: 32,
            per_pull: 8,
        },
        lease_ttl_secs: 3,
        faults: Fault::ALL.to_vec(),
        max_faults: Some(Fault::ALL.len()),
    };
    eprintln!("seed {}", config.seed);
    let report = match chaos::run(config, |t, line| {
        eprintln!("{:>5.1} s {line}", t.as_secs_f64())
    })
    .await
    {
        Ok(r) => r,
        Err(e @ chaos::Error::NoNamespaces(_)) => {
            skip(Why::Missing("network namespaces"), e.to_string());
            return;
        }
        Err(e) => panic!("{e}"),
    };
    println!("{}", report.recovery_table());
    println!("{}", report.invariant_table());
    let kinds: std::collections::BTreeSet<Fault> =
        report.recoveries.iter().map(|r| r.fault).collect();
    assert_eq!(kinds.len(), Fault::ALL.len(), "every kind once");
    assert_eq!(
        report.violations(),
        Vec::<String>::new(),
        "incidents: {:?}",
        report.incidents
    );
}
