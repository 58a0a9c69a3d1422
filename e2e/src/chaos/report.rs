//! What a chaos run found, as tables, and whether every invariant held.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use comfy_table::Table;

use super::resources::Resources;
use super::tally::Tally;
use super::{Config, Fault};

/// One injected fault and the fabric's recovery from it.
#[derive(Debug, Clone)]
pub struct Recovery {
    pub fault: Fault,
    /// What it hit (an agent, a worker, a member, a pair).
    pub what: String,
    /// Until every pair of workers moved verified bytes again; None: not within the limit.
    pub took: Option<Duration>,
    /// Whether etcd's keys settled to the live agents and segments.
    pub keys_settled: bool,
}

/// An agent's fds, threads and RSS before the first fault and after the run (None: gone).
#[derive(Debug, Clone)]
pub struct AgentResources {
    pub agent: String,
    pub before: Option<Resources>,
    pub after: Option<Resources>,
}

impl AgentResources {
    fn back(&self) -> bool {
        matches!((&self.before, &self.after), (Some(b), Some(a)) if a.back_to(b))
    }
}

#[derive(Debug)]
pub struct Report {
    pub config: Config,
    pub elapsed: Duration,
    pub recoveries: Vec<Recovery>,
    pub final_recovery: Option<Duration>,
    pub final_keys_settled: bool,
    pub resources: Vec<AgentResources>,
    pub pulls: u64,
    pub bytes: u64,
    pub wrong_bytes: u64,
    pub failed: u64,
    pub failures: BTreeMap<String, u64>,
    pub hung: u64,
    pub incidents: Vec<String>,
}

impl Report {
    pub fn new(config: Config) -> Report {
        Report {
            config,
            elapsed: Duration::ZERO,
            recoveries: Vec::new(),
            final_recovery: None,
            final_keys_settled: false,
            resources: Vec::new(),
            pulls: 0,
            bytes: 0,
            wrong_bytes: 0,
            failed: 0,
            failures: BTreeMap::new(),
            hung: 0,
            incidents: Vec::new(),
        }
    }

    pub(super) fn fill(&mut self, t: &Tally) {
        self.pulls = t.pulls.load(Relaxed);
        self.bytes = t.bytes.load(Relaxed);
        self.wrong_bytes = t.wrong_bytes.load(Relaxed);
        self.failed = t.failed.load(Relaxed);
        self.hung = t.hung.load(Relaxed);
        self.failures = t.failures();
        self.incidents = t.incidents();
    }

    fn resources_back(&self) -> bool {
        self.resources.iter().all(AgentResources::back)
    }

    /// The invariants that failed; empty when the run held them all.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.wrong_bytes > 0 {
            v.push(format!("{} wrong bytes", self.wrong_bytes));
        }
        if self.hung > 0 {
            v.push(format!("{} pulls hung past their deadline", self.hung));
        }
        if self.pulls == 0 {
            v.push("no pull completed".into());
        }
        let unrecovered = self.recoveries.iter().filter(|r| r.took.is_none()).count()
            + usize::from(self.final_recovery.is_none());
        if unrecovered > 0 {
            v.push(format!("{unrecovered} faults not recovered from"));
        }
        let unsettled = self.recoveries.iter().filter(|r| !r.keys_settled).count()
            + usize::from(!self.final_keys_settled);
        if unsettled > 0 {
            v.push(format!("etcd's keys did not settle {unsettled} times"));
        }
        if !self.resources_back() {
            v.push("an agent's fds, threads or RSS did not come back".into());
        }
        v
    }

    /// Recovery per fault kind: count, recovered, p50, p99 and max.
    pub fn recovery_table(&self) -> Table {
        let mut t = Table::new();
        t.set_header(vec![
            "fault",
            "n",
            "recovered",
            "keys settled",
            "p50",
            "p99",
            "max",
        ]);
        let mut kinds: BTreeMap<Fault, Vec<&Recovery>> = BTreeMap::new();
        for r in &self.recoveries {
            kinds.entry(r.fault).or_default().push(r);
        }
        for (fault, rs) in kinds {
            let mut took: Vec<Duration> = rs.iter().filter_map(|r| r.took).collect();
            took.sort();
            let q = |p: f64| {
                took.get(((took.len() as f64 - 1.0) * p).round() as usize)
                    .map_or("-".into(), |d| format!("{:.2} s", d.as_secs_f64()))
            };
            t.add_row(vec![
                fault.to_string(),
                rs.len().to_string(),
                took.len().to_string(),
                rs.iter().filter(|r| r.keys_settled).count().to_string(),
                q(0.5),
                q(0.99),
                q(1.0),
            ]);
        }
        t
    }

    /// The invariants, each with its value and whether it held.
    pub fn invariant_table(&self) -> Table {
        let mut t = Table::new();
        t.set_header(vec!["invariant", "value", "holds"]);
        let mark = |ok: bool| if ok { "yes" } else { "NO" };
        let failures = if self.failures.is_empty() {
            "none".into()
        } else {
            self.failures
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        t.add_row(vec![
            "pulls verified (every byte)".into(),
            format!(
                "{} ({:.2} GiB)",
                self.pulls,
                self.bytes as f64 / (1u64 << 30) as f64
            ),
            mark(self.pulls > 0).into(),
        ]);
        t.add_row(vec![
            "wrong bytes".into(),
            self.wrong_bytes.to_string(),
            mark(self.wrong_bytes == 0).into(),
        ]);
        t.add_row(vec![
            "pulls failed with a typed error (retried)".into(),
            format!("{} ({failures})", self.failed),
            "-".into(),
        ]);
        t.add_row(vec![
            "pulls hung past their deadline".into(),
            self.hung.to_string(),
            mark(self.hung == 0).into(),
        ]);
        t.add_row(vec![
            "etcd keys = live agents and segments".into(),
            format!(
                "{} of {} checks",
                self.recoveries.iter().filter(|r| r.keys_settled).count()
                    + usize::from(self.final_keys_settled),
                self.recoveries.len() + 1
            ),
            mark(self.recoveries.iter().all(|r| r.keys_settled) && self.final_keys_settled).into(),
        ]);
        for r in &self.resources {
            let show = |r: &Option<Resources>| r.map_or("gone".into(), |r| r.to_string());
            t.add_row(vec![
                format!("{}: fds, threads, RSS back", r.agent),
                format!("{} → {}", show(&r.before), show(&r.after)),
                mark(r.back()).into(),
            ]);
        }
        t
    }
}
