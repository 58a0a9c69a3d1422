//! What the workers saw: pulls verified, bytes right and wrong, failures by kind, pulls that
//! hung, and when each pair of workers last moved bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub struct Tally {
    pub pulls: AtomicU64,
    pub bytes: AtomicU64,
    pub wrong_bytes: AtomicU64,
    pub failed: AtomicU64,
    pub hung: AtomicU64,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Failed pulls by the error's kind (its gRPC code, or the client's error variant).
    failures: BTreeMap<String, u64>,
    /// (puller, source) → when the last verified pull between them ended.
    last_ok: HashMap<(usize, usize), Instant>,
    /// What went wrong worst, for the report: wrong bytes and hangs, each with its pair.
    incidents: Vec<String>,
}

/// How many incidents are kept for the report.
const INCIDENTS: usize = 20;

impl Tally {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn pulled(&self, to: usize, from: usize, bytes: u64, wrong: u64) {
        self.pulls.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        let mut inner = self.inner();
        if wrong > 0 {
            self.wrong_bytes.fetch_add(wrong, Ordering::Relaxed);
            if inner.incidents.len() < INCIDENTS {
                inner
                    .incidents
                    .push(format!("w{to} ← w{from}: {wrong} of {bytes} bytes wrong"));
            }
        } else {
            inner.last_ok.insert((to, from), Instant::now());
        }
    }

    pub fn failed(&self, e: &kvfabric_client::Error) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let kind = match e.code() {
            Some(code) => format!("{code:?}"),
            None => variant(e).into(),
        };
        *self.inner().failures.entry(kind).or_default() += 1;
    }

    pub fn hung(&self, to: usize, from: usize, after: Duration) {
        self.hung.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.inner();
        if inner.incidents.len() < INCIDENTS {
            inner
                .incidents
                .push(format!("w{to} ← w{from}: no answer in {after:.1?}"));
        }
    }

    /// Whether every ordered pair of `workers` has moved verified bytes since `since`.
    pub fn all_pairs_since(&self, workers: usize, since: Instant) -> bool {
        let inner = self.inner();
        (0..workers).all(|to| {
            (0..workers)
                .filter(|&from| from != to)
                .all(|from| inner.last_ok.get(&(to, from)).is_some_and(|t| *t >= since))
        })
    }

    pub fn failures(&self) -> BTreeMap<String, u64> {
        self.inner().failures.clone()
    }

    pub fn incidents(&self) -> Vec<String> {
        self.inner().incidents.clone()
    }
}

fn variant(e: &kvfabric_client::Error) -> &'static str {
    use kvfabric_client::Error as E;
    match e {
        E::Connect { .. } => "Connect",
        E::FdSocket { .. } => "FdSocket",
        E::Document { .. } => "Document",
        E::Invalid { .. } => "Invalid",
        E::Engine(_) => "Engine",
        E::Io { .. } => "Io",
        _ => "Other",
    }
}
