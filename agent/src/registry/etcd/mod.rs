//! The production registry: etcd, with a lease per agent and a watch-fed local cache.
//!
//! Keys: `<root>/agents/<name>` and `<root>/segments/<name>` under the fabric's root
//! `<prefix>/<namespace>/<fabric>` (`kvfabric_proto::contract::registry_root`), JSON values,
//! every key this agent writes bound to its lease.
//!
//! Two background tasks run per [`EtcdRegistry`]:
//!
//! - the **keeper** keeps the lease alive (a keepalive every TTL/3). The lease counts as lost
//!   when a keepalive answers TTL 0, when no keepalive succeeded for a whole TTL (etcd down or
//!   unreachable: the server may have expired the lease meanwhile), or when a write fails with
//!   "lease not found". It then grants a new lease (retrying with backoff while etcd is down),
//!   re-puts every key this agent owns under it, revokes the old lease (best effort) and counts
//!   a re-registration.
//! - the **watcher** reads everything under `<root>/` once, then watches from the
//!   next revision. Each change updates the cache and is broadcast. A watch that ends (its
//!   member died or lost its leader, the connection dropped, it went silent past its deadline)
//!   is resumed from the first revision not yet applied, on whichever member answers; only
//!   when etcd compacted that revision away does it read everything again (a relist, counted
//!   in `resyncs` and broadcast as [`Event::Resynced`]). Lookups only ever read the cache.
//!
//! Requests ask for a member with a leader (etcd's "require leader"): a member cut off from
//! the others refuses them at once and cancels its watches, so nothing is served from a store
//! that no longer changes. A request the client fails at once as unavailable (a member just
//! restarted, no leader) is tried again on another connection, a few times within its timeout.
//!
//! Writes go to etcd and are remembered (for re-registration, and for a write that failed while
//! etcd was unreachable: the keeper publishes it once keepalives succeed again);
//! they return once the entry is in this registry's own cache (read-your-writes), or after one
//! request timeout if the watch lags.
//!
//! Dropping the last handle aborts both tasks without revoking anything: the lease then expires
//! after its TTL and every key goes with it, as for an agent that died. [`Registry::shutdown`]
//! revokes the lease instead, which deletes the keys at once.

mod config;
mod keeper;
mod status_code;
mod watcher;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use kvfabric_rt::Backoff;
use parking_lot::{Mutex, RwLock};
use tokio::sync::{Notify, broadcast, watch};
use tokio::task::AbortHandle;

use super::{AgentEntry, Event, Registry, RegistryState, SegmentEntry, check_name};
use crate::error::{Error, Result};
pub use config::{EtcdConfig, EtcdTls, TLS_DIR_ENV};
use status_code::{classify, is_lease_not_found, timed_out};

/// Events a subscriber may fall behind by before it sees `Lagged` (then: re-read the cache).
const EVENT_CAPACITY: usize = 1024;
/// Keys per range request of a full read (keeps every response far below gRPC's 4 MiB).
const PAGE: i64 = 1000;
/// Puts per transaction when re-registering (etcd's default `--max-txn-ops` is 128).
const TXN_OPS: usize = 100;
/// Most tries of one request that etcd's client fails at once as unavailable (see
/// [`Inner::call_retrying`]); the number of endpoints plus one, up to this.
const MAX_ATTEMPTS: usize = 8;
/// First pause between such tries (doubling, capped at `RETRY_PAUSE_CAP`).
const RETRY_PAUSE: Duration = Duration::from_millis(20);
const RETRY_PAUSE_CAP: Duration = Duration::from_millis(200);

/// One agent's registry on etcd. See the module documentation.
pub struct EtcdRegistry {
    inner: Arc<Inner>,
    tasks: Mutex<Vec<AbortHandle>>,
    shut_down: AtomicBool,
}

struct Inner {
    client: Client,
    endpoints: Vec<String>,
    /// `endpoints` joined, for error messages.
    endpoints_str: String,
    root: String,
    ttl_secs: i64,
    request_timeout: Duration,
    /// Whether a watch keeps `cache` current (the registry benchmark runs agents without).
    watching: bool,
    cache: RwLock<Cache>,
    /// The revision `cache` reflects, for read-your-writes.
    cache_rev: watch::Sender<i64>,
    events: broadcast::Sender<Event>,
    /// What this agent wrote: re-put under every new lease. Held across the etcd request of
    /// each write and across a whole re-registration, so they never interleave.
    owned: tokio::sync::Mutex<Owned>,
    /// Current lease, 0 while there is none (lost, being re-granted).
    lease: AtomicI64,
    granted_ttl: AtomicI64,
    /// A lease a write found gone ("lease not found"), for the keeper.
    lost_lease: AtomicI64,
    lease_lost: Notify,
    /// A write failed while etcd was unreachable: what is owned must be put again.
    unpublished: AtomicBool,
    status: Mutex<Status>,
}

#[derive(Default)]
struct Cache {
    agents: HashMap<String, AgentEntry>,
    segments: HashMap<String, SegmentEntry>,
}

#[derive(Default)]
struct Owned {
    agent: Option<AgentEntry>,
    segments: BTreeMap<String, SegmentEntry>,
}

#[derive(Default)]
struct Status {
    connected: bool,
    last_error: Option<String>,
    reregistrations: u64,
    /// Full reads after the first (relists).
    resyncs: u64,
    /// Watches opened again from the last applied revision, without a full read.
    watch_resumes: u64,
}

impl fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdRegistry")
            .field("endpoints", &self.inner.endpoints)
            .field("root", &self.inner.root)
            .field("lease", &self.inner.lease.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl EtcdRegistry {
    /// Connects, reads the fabric's current entries into the cache, grants the lease and
    /// starts the keeper and watcher tasks. Fails (typed) when etcd does not answer within
    /// `connect_timeout`, rejects the credentials, or the configuration is invalid.
    pub async fn connect(cfg: EtcdConfig) -> Result<Arc<Self>> {
        let client = cfg.client().await?;
        let registry = Self::start(client, &cfg, true).await?;
        let state = registry.state();
        tracing::info!(
            endpoints = %registry.inner.endpoints_str, root = %registry.inner.root,
            lease = format!("{:x}", state.lease_id), ttl_secs = state.lease_ttl_secs,
            agents = state.agents, segments = state.segments, "registry connected to etcd"
        );
        Ok(registry)
    }

    /// [`EtcdRegistry::connect`] on an existing client (several registries may share one).
    /// Without `watch`, the cache stays empty and no events are sent: a write-only agent, as
    /// the registry benchmark simulates them by the thousand.
    pub async fn start(client: Client, cfg: &EtcdConfig, watch: bool) -> Result<Arc<Self>> {
        cfg.validate()?;
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let inner = Arc::new(Inner {
            client,
            endpoints: cfg.endpoints.clone(),
            endpoints_str: cfg.endpoints.join(","),
            root: cfg.root(),
            ttl_secs: cfg.ttl_secs(),
            request_timeout: cfg.connect_timeout,
            watching: watch,
            cache: RwLock::new(Cache::default()),
            cache_rev: watch::Sender::new(0),
            events,
            owned: tokio::sync::Mutex::new(Owned::default()),
            lease: AtomicI64::new(0),
            granted_ttl: AtomicI64::new(0),
            lost_lease: AtomicI64::new(0),
            lease_lost: Notify::new(),
            unpublished: AtomicBool::new(false),
            status: Mutex::new(Status::default()),
        });
        // Nothing is spawned before both requests succeeded.
        let rev = if watch {
            Some(inner.full_read().await?)
        } else {
            None
        };
        let (lease, ttl) = inner.grant().await?;
        inner.lease.store(lease, Ordering::SeqCst);
        let mut tasks = Vec::new();
        if let Some(rev) = rev {
            tasks.push(tokio::spawn(inner.clone().watcher(rev)).abort_handle());
        }
        tasks.push(tokio::spawn(inner.clone().keeper(lease, ttl)).abort_handle());
        tracing::debug!(
            endpoints = %inner.endpoints_str, root = %inner.root, lease = format!("{lease:x}"),
            ttl_secs = ttl, "registry connected to etcd"
        );
        Ok(Arc::new(EtcdRegistry {
            inner,
            tasks: Mutex::new(tasks),
            shut_down: AtomicBool::new(false),
        }))
    }

    fn stop_tasks(&self) {
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
    }

    fn check_open(&self, op: &str) -> Result<()> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(Error::Registry {
                op: op.into(),
                endpoints: self.inner.endpoints_str.clone(),
                reason: "this registry was shut down".into(),
            });
        }
        Ok(())
    }
}

impl Drop for EtcdRegistry {
    /// Stops keepalive and watch; the lease is not revoked, so it expires after its TTL (what
    /// happens when an agent dies). Call [`Registry::shutdown`] to remove the keys at once.
    fn drop(&mut self) {
        self.stop_tasks();
    }
}

#[async_trait]
impl Registry for EtcdRegistry {
    /// Errors mean what they mean for `put_segment`.
    async fn register_agent(&self, entry: AgentEntry) -> Result<()> {
        check_name("agent.name", &entry.name)?;
        self.check_open("register agent")?;
        let inner = &self.inner;
        let value = to_json(&entry)?;
        let key = inner.agent_key(&entry.name);
        let op = format!("register agent {:?}", entry.name);
        let mut owned = inner.owned.lock().await;
        let previous = owned.agent.replace(entry.clone());
        let rev = match inner.put_owned(&op, &key, value).await {
            Ok(rev) => rev,
            Err(e) => {
                if !matches!(e, Error::RegistryUnavailable { .. }) {
                    owned.agent = previous;
                }
                return Err(e);
            }
        };
        // A new name replaces the old entry.
        if let Some(old) = previous.filter(|old| old.name != entry.name) {
            let op = format!("delete agent {:?}", old.name);
            if let Err(e) = inner.delete_owned(&op, &inner.agent_key(&old.name)).await {
                tracing::warn!(error = %e, "old agent entry stays until the lease ends");
            }
        }
        drop(owned);
        inner.wait_cache(rev).await;
        Ok(())
    }

    /// On [`Error::RegistryUnavailable`] (etcd down, no lease at the moment, lease just lost)
    /// the entry is still remembered: it is published as soon as etcd answers again (under the
    /// same lease if it survived, else by the re-registration), and `shutdown` removes it. On
    /// any other error it is forgotten.
    async fn put_segment(&self, entry: SegmentEntry) -> Result<()> {
        check_name("segment.name", &entry.name)?;
        self.check_open("put segment")?;
        let inner = &self.inner;
        let value = to_json(&entry)?;
        let key = inner.segment_key(&entry.name);
        let op = format!("put segment {:?}", entry.name);
        let mut owned = inner.owned.lock().await;
        let previous = owned.segments.insert(entry.name.clone(), entry.clone());
        let rev = match inner.put_owned(&op, &key, value).await {
            Ok(rev) => rev,
            Err(e) => {
                if !matches!(e, Error::RegistryUnavailable { .. }) {
                    match previous {
                        Some(p) => owned.segments.insert(entry.name.clone(), p),
                        None => owned.segments.remove(&entry.name),
                    };
                }
                return Err(e);
            }
        };
        drop(owned);
        inner.wait_cache(rev).await;
        Ok(())
    }

    /// Deletes the key only if it is still bound to this agent's lease (another agent may have
    /// taken the name over). Without a lease at the moment, the segment is just forgotten: its
    /// key went, or goes, with the lost lease. If etcd does not answer, the segment stays
    /// published and owned, and the error says so: retry.
    async fn delete_segment(&self, name: &str) -> Result<()> {
        self.check_open("delete segment")?;
        let inner = &self.inner;
        let op = format!("delete segment {name:?}");
        let mut owned = inner.owned.lock().await;
        let Some(entry) = owned.segments.remove(name) else {
            return Err(Error::UnknownSegment { name: name.into() });
        };
        match inner.delete_owned(&op, &inner.segment_key(name)).await {
            Ok(rev) => {
                drop(owned);
                inner.wait_cache(rev).await;
                Ok(())
            }
            Err(e) => {
                owned.segments.insert(name.into(), entry);
                Err(e)
            }
        }
    }

    fn segment(&self, name: &str) -> Option<SegmentEntry> {
        self.inner.cache.read().segments.get(name).cloned()
    }

    fn agent(&self, name: &str) -> Option<AgentEntry> {
        self.inner.cache.read().agents.get(name).cloned()
    }

    fn segments(&self) -> BTreeMap<String, SegmentEntry> {
        let cache = self.inner.cache.read();
        cache
            .segments
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn agents(&self) -> BTreeMap<String, AgentEntry> {
        let cache = self.inner.cache.read();
        cache
            .agents
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.inner.events.subscribe()
    }

    fn state(&self) -> RegistryState {
        let inner = &self.inner;
        let (agents, segments) = {
            let cache = inner.cache.read();
            (cache.agents.len(), cache.segments.len())
        };
        let status = inner.status.lock();
        RegistryState {
            backend: "etcd".into(),
            endpoints: inner.endpoints.clone(),
            connected: status.connected && !self.shut_down.load(Ordering::Acquire),
            lease_id: inner.lease.load(Ordering::SeqCst),
            lease_ttl_secs: inner.granted_ttl.load(Ordering::Relaxed).max(0) as u64,
            reregistrations: status.reregistrations,
            resyncs: status.resyncs,
            watch_resumes: status.watch_resumes,
            agents,
            segments,
            last_error: status.last_error.clone(),
        }
    }

    /// Stops the tasks and revokes the lease, which deletes every key bound to it (all this
    /// agent wrote) in one step. Bounded by `connect_timeout`. If etcd does not answer, the
    /// error says so and the keys go when the lease expires. Idempotent: later calls return
    /// `Ok`.
    async fn shutdown(&self) -> Result<()> {
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.stop_tasks();
        let inner = &self.inner;
        let lease = {
            // Waits for a write in flight (bounded by its request timeout).
            let mut owned = inner.owned.lock().await;
            *owned = Owned::default();
            inner.lease.swap(0, Ordering::SeqCst)
        };
        if lease == 0 {
            return Ok(());
        }
        inner
            .call_retrying("revoke lease at shutdown", || {
                let mut client = inner.client.lease_client();
                async move { client.revoke(lease).await }
            })
            .await?;
        tracing::info!(
            lease = format!("{lease:x}"),
            "registry shut down, lease revoked"
        );
        Ok(())
    }
}

impl Inner {
    fn agent_key(&self, name: &str) -> String {
        format!("{}agents/{name}", self.root)
    }

    fn segment_key(&self, name: &str) -> String {
        format!("{}segments/{name}", self.root)
    }

    fn ok(&self) {
        let mut status = self.status.lock();
        status.connected = true;
        status.last_error = None;
    }

    fn failed(&self, e: &Error) {
        let mut status = self.status.lock();
        if matches!(e, Error::RegistryUnavailable { .. }) {
            status.connected = false;
        }
        status.last_error = Some(e.to_string());
    }

    /// One request (every etcd request goes through here: bounded by the request timeout, with
    /// connection bookkeeping), made by `request` and tried again while it fails at once as
    /// unavailable:
    /// at most once more than there are endpoints (and [`MAX_ATTEMPTS`]), pausing
    /// [`RETRY_PAUSE`] doubling in between, all within one request timeout.
    ///
    /// Why: the client keeps a connection per member; when a member restarts, the first
    /// request sent on its broken connection fails with the connect error the client met while
    /// the member was away ("tcp connect error"), even once every member is back, and a member
    /// without a leader refuses at once ("no leader"). Another try goes to another member or a
    /// fresh connection. Every request sent this way may be repeated: puts of the same value
    /// under the same lease, deletes conditional on the lease, reads, revokes; a repeated grant
    /// would leave at worst an empty lease that expires after its TTL; opening a keepalive or
    /// watch stream sends nothing that changes etcd. A request that timed out is not retried:
    /// its time is spent.
    async fn call_retrying<T, F, Fut>(&self, op: &str, mut request: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        let attempts = self.endpoints.len().saturating_add(1).min(MAX_ATTEMPTS);
        let mut pause = Backoff::new(RETRY_PAUSE, RETRY_PAUSE_CAP);
        let mut attempt = 1;
        loop {
            let result = match tokio::time::timeout_at(deadline, request()).await {
                Ok(Ok(v)) => {
                    self.ok();
                    return Ok(v);
                }
                Ok(Err(e)) => classify(op, &self.endpoints_str, e),
                Err(_) => {
                    let e = timed_out(op, &self.endpoints_str, self.request_timeout);
                    self.failed(&e);
                    return Err(e);
                }
            };
            let wait = pause.next_delay();
            let again = matches!(result, Error::RegistryUnavailable { .. })
                && attempt < attempts
                && tokio::time::Instant::now() + wait < deadline;
            if !again {
                self.failed(&result);
                return Err(result);
            }
            tracing::debug!(op, attempt, error = %result, "etcd refused at once; trying again");
            attempt += 1;
            tokio::time::sleep(wait).await;
        }
    }

    fn unavailable(&self, op: &str, reason: impl Into<String>) -> Error {
        Error::RegistryUnavailable {
            op: op.into(),
            endpoints: self.endpoints_str.clone(),
            reason: reason.into(),
        }
    }

    async fn grant(&self) -> Result<(i64, i64)> {
        let resp = self
            .call_retrying("grant lease", || {
                let mut client = self.client.lease_client();
                async move { client.grant(self.ttl_secs, None).await }
            })
            .await?;
        self.granted_ttl.store(resp.ttl(), Ordering::Relaxed);
        Ok((resp.id(), resp.ttl()))
    }

    /// Puts a key of this agent under the current lease (caller holds `owned`). Returns the
    /// revision of the write.
    async fn put_owned(&self, op: &str, key: &str, value: Vec<u8>) -> Result<i64> {
        let lease = self.lease.load(Ordering::SeqCst);
        if lease == 0 {
            return Err(self.unavailable(
                op,
                "no lease at the moment (being re-established); the entry is remembered and \
                 published with the new lease",
            ));
        }
        let put = || {
            let (mut kv, value) = (self.client.kv_client(), value.clone());
            async move {
                kv.put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        };
        match self.call_retrying(op, put).await {
            Ok(resp) => Ok(resp.header().map_or(0, |h| h.revision())),
            Err(e) if is_lease_not_found(&e) => {
                self.report_lost(lease);
                Err(self.unavailable(
                    op,
                    format!(
                        "lease {lease:x} is gone; the entry is remembered and published under \
                         the new lease"
                    ),
                ))
            }
            Err(e) => {
                if matches!(e, Error::RegistryUnavailable { .. }) {
                    // Remembered by the caller: published once etcd answers again.
                    self.unpublished.store(true, Ordering::SeqCst);
                }
                Err(e)
            }
        }
    }

    /// Deletes a key if it is bound to the current lease (caller holds `owned`). Returns the
    /// revision of the delete (0: nothing to wait for).
    async fn delete_owned(&self, op: &str, key: &str) -> Result<i64> {
        let lease = self.lease.load(Ordering::SeqCst);
        if lease == 0 {
            return Ok(0);
        }
        let delete = || {
            let mut kv = self.client.kv_client();
            let txn = Txn::new()
                .when([Compare::lease(key, CompareOp::Equal, lease)])
                .and_then([TxnOp::delete(key, None)]);
            async move { kv.txn(txn).await }
        };
        let resp = self.call_retrying(op, delete).await?;
        Ok(if resp.succeeded() {
            resp.header().map_or(0, |h| h.revision())
        } else {
            0
        })
    }

    fn report_lost(&self, lease: i64) {
        self.lost_lease.store(lease, Ordering::SeqCst);
        self.lease_lost.notify_one();
    }

    /// Waits (at most one request timeout) until the watch has brought the cache to `rev`.
    async fn wait_cache(&self, rev: i64) {
        if !self.watching || rev == 0 {
            return;
        }
        let mut rx = self.cache_rev.subscribe();
        let _ = tokio::time::timeout(self.request_timeout, rx.wait_for(|r| *r >= rev)).await;
    }

    fn backoff_cap(&self) -> Duration {
        Duration::from_secs(self.ttl_secs.max(1) as u64)
            .div_f64(3.0)
            .min(Duration::from_secs(1))
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| Error::Registry {
        op: "encode entry".into(),
        endpoints: String::new(),
        reason: e.to_string(),
    })
}

/// The end of the range of keys that start with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end("/kvfabric/f/"), b"/kvfabric/f0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }

    #[test]
    fn config_is_checked() {
        let cfg = EtcdConfig::new(["http://127.0.0.1:2379"], "f");
        assert_eq!(cfg.root(), "/kvfabric/default/f/");
        assert!(cfg.validate().is_ok());
        let mut bad = cfg.clone();
        bad.fabric = "a/b".into();
        assert!(matches!(
            bad.validate(),
            Err(Error::Config {
                field: "etcd.fabric",
                ..
            })
        ));
        let mut bad = cfg.clone();
        bad.endpoints.clear();
        assert!(matches!(
            bad.validate(),
            Err(Error::Config {
                field: "etcd.endpoints",
                ..
            })
        ));
        let mut bad = cfg.clone();
        bad.lease_ttl = Duration::from_millis(200);
        assert!(matches!(
            bad.validate(),
            Err(Error::Config {
                field: "etcd.lease_ttl",
                ..
            })
        ));
        let mut bad = cfg;
        bad.tls = Some(EtcdTls {
            ca: "/x/ca.crt".into(),
            cert: None,
            key: None,
        });
        assert!(matches!(
            bad.validate(),
            Err(Error::Config {
                field: "etcd.endpoints",
                ..
            })
        ));
    }

    #[test]
    fn debug_hides_the_password() {
        let mut cfg = EtcdConfig::new(["http://127.0.0.1:2379"], "f");
        cfg.auth = Some(("root".into(), "hunter2".into()));
        let text = format!("{cfg:?}");
        assert!(text.contains("root") && !text.contains("hunter2"), "{text}");
    }

    #[test]
    fn tls_dir_without_ca_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = EtcdTls::from_dir(dir.path()).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                Error::Config {
                    field: "etcd.tls.ca",
                    ..
                }
            ),
            "{text}"
        );
        assert!(text.contains("ca.crt"), "{text}");
        std::fs::write(dir.path().join("ca.crt"), "x").unwrap();
        let tls = EtcdTls::from_dir(dir.path()).unwrap();
        assert_eq!((tls.cert, tls.key), (None, None));
        std::fs::write(dir.path().join("tls.crt"), "x").unwrap();
        let err = EtcdTls::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Config {
                    field: "etcd.tls.key",
                    ..
                }
            ),
            "{err}"
        );
        std::fs::write(dir.path().join("tls.key"), "x").unwrap();
        assert!(EtcdTls::from_dir(dir.path()).unwrap().key.is_some());
    }
}
