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
//!   next revision. Each change updates the cache and is broadcast. On a watch error,
//!   cancellation or compaction it re-reads everything (a resync, broadcast as
//!   [`Event::Resynced`]) and watches again. Lookups only ever read the cache.
//!
//! Writes go to etcd and are remembered (for re-registration, and for a write that failed while
//! etcd was unreachable: the keeper publishes it once keepalives succeed again);
//! they return once the entry is in this registry's own cache (read-your-writes), or after one
//! request timeout if the watch lags.
//!
//! Dropping the last handle aborts both tasks without revoking anything: the lease then expires
//! after its TTL and every key goes with it, as for an agent that died. [`Registry::shutdown`]
//! revokes the lease instead, which deletes the keys at once.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    KeyValue, PutOptions, TlsOptions, Txn, TxnOp, WatchOptions,
};
use kvfabric_rt::Backoff;
use parking_lot::{Mutex, RwLock};
use tokio::sync::{Notify, broadcast, watch};
use tokio::task::AbortHandle;

use super::{AgentEntry, Event, Registry, RegistryState, SegmentEntry, check_name};
use crate::error::{Error, Result};

/// Events a subscriber may fall behind by before it sees `Lagged` (then: re-read the cache).
const EVENT_CAPACITY: usize = 1024;
/// Keys per range request of a full read (keeps every response far below gRPC's 4 MiB).
const PAGE: i64 = 1000;
/// Puts per transaction when re-registering (etcd's default `--max-txn-ops` is 128).
const TXN_OPS: usize = 100;
/// Environment variable naming the directory with `ca.crt`, `tls.crt`, `tls.key`.
pub const TLS_DIR_ENV: &str = "KVFABRIC_ETCD_TLS_DIR";

/// TLS towards etcd: the CA that signed the server's certificate and, for client-certificate
/// authentication, this agent's certificate and key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl EtcdTls {
    /// Reads the layout of a mounted Kubernetes TLS secret: `ca.crt` (required), `tls.crt` and
    /// `tls.key` (both or neither). Only checks that the files exist; they are read at connect.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let ca = dir.join("ca.crt");
        if !ca.is_file() {
            return Err(Error::config(
                "etcd.tls.ca",
                ca.display(),
                format!("file not found (the TLS directory, {TLS_DIR_ENV}, must hold ca.crt)"),
            ));
        }
        let cert = dir.join("tls.crt");
        let key = dir.join("tls.key");
        let (cert, key) = match (cert.is_file(), key.is_file()) {
            (true, true) => (Some(cert), Some(key)),
            (false, false) => (None, None),
            (true, false) => {
                return Err(Error::config(
                    "etcd.tls.key",
                    key.display(),
                    "file not found (tls.crt is there: a client certificate needs its key)",
                ));
            }
            (false, true) => {
                return Err(Error::config(
                    "etcd.tls.cert",
                    cert.display(),
                    "file not found (tls.key is there: a client key needs its certificate)",
                ));
            }
        };
        Ok(EtcdTls { ca, cert, key })
    }

    /// Reads the files (blocking: call off the async threads).
    pub fn options(&self) -> Result<TlsOptions> {
        let read = |field: &'static str, path: &Path| {
            std::fs::read(path).map_err(|e| Error::config(field, path.display(), e.to_string()))
        };
        let mut tls =
            TlsOptions::new().ca_certificate(Certificate::from_pem(read("etcd.tls.ca", &self.ca)?));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                tls = tls.identity(Identity::from_pem(
                    read("etcd.tls.cert", cert)?,
                    read("etcd.tls.key", key)?,
                ));
            }
            (None, None) => {}
            (Some(cert), None) => {
                return Err(Error::config(
                    "etcd.tls.key",
                    "",
                    format!(
                        "missing (a client certificate, {}, needs its key)",
                        cert.display()
                    ),
                ));
            }
            (None, Some(key)) => {
                return Err(Error::config(
                    "etcd.tls.cert",
                    "",
                    format!(
                        "missing (a client key, {}, needs its certificate)",
                        key.display()
                    ),
                ));
            }
        }
        Ok(tls)
    }
}

/// Where and how to reach etcd. Build with [`EtcdConfig::new`] and adjust the fields.
#[derive(Clone)]
pub struct EtcdConfig {
    /// `http://host:port` or `https://host:port` (https with [`EtcdConfig::tls`]).
    pub endpoints: Vec<String>,
    /// Key prefix, default `/kvfabric`.
    pub prefix: String,
    /// The fabric's namespace: the second level of every key.
    pub namespace: String,
    /// Fabric name: the third level of every key.
    pub fabric: String,
    /// Lease time-to-live, default 10 s (whole seconds; etcd may raise very short ones). An
    /// agent that dies disappears from other agents' caches about one TTL later.
    pub lease_ttl: Duration,
    pub tls: Option<EtcdTls>,
    /// Username and password.
    pub auth: Option<(String, String)>,
    /// Bounds connecting and each single request, default 5 s.
    pub connect_timeout: Duration,
}

impl EtcdConfig {
    pub const DEFAULT_PREFIX: &'static str = kvfabric_proto::contract::DEFAULT_KEY_PREFIX;
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

    pub fn new<E: Into<String>>(
        endpoints: impl IntoIterator<Item = E>,
        fabric: impl Into<String>,
    ) -> Self {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: Self::DEFAULT_PREFIX.into(),
            namespace: kvfabric_proto::contract::DEFAULT_NAMESPACE.into(),
            fabric: fabric.into(),
            lease_ttl: Self::DEFAULT_LEASE_TTL,
            tls: None,
            auth: None,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// `<prefix>/<namespace>/<fabric>/` (`kvfabric_proto::contract::registry_root`).
    pub fn root(&self) -> String {
        kvfabric_proto::contract::registry_root(&self.prefix, &self.namespace, &self.fabric) + "/"
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::config("etcd.endpoints", "", "at least one endpoint"));
        }
        for ep in &self.endpoints {
            if self.tls.is_some() && ep.starts_with("http://") {
                return Err(Error::config(
                    "etcd.endpoints",
                    ep,
                    "TLS is configured: use an https:// endpoint",
                ));
            }
        }
        check_name("etcd.fabric", &self.fabric)?;
        check_name("etcd.namespace", &self.namespace)?;
        for (field, value) in [
            ("etcd.fabric", &self.fabric),
            ("etcd.namespace", &self.namespace),
        ] {
            if value.contains('/') {
                return Err(Error::config(field, value, "must not contain '/'"));
            }
        }
        if !self.prefix.starts_with('/') {
            return Err(Error::config(
                "etcd.prefix",
                &self.prefix,
                "must start with '/'",
            ));
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return Err(Error::config(
                "etcd.lease_ttl",
                format!("{:?}", self.lease_ttl),
                "at least 1 s",
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::config(
                "etcd.connect_timeout",
                "0s",
                "must be positive",
            ));
        }
        Ok(())
    }

    fn ttl_secs(&self) -> i64 {
        i64::try_from(self.lease_ttl.as_secs_f64().ceil() as u64).unwrap_or(i64::MAX)
    }

    /// Builds the etcd client (reads TLS files off the async threads). Only connects when
    /// credentials are given (to authenticate); otherwise the first request connects.
    pub async fn client(&self) -> Result<Client> {
        self.validate()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            // etcd's --grpc-keepalive-min-time is 5 s: never ping more often than that.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let Some(tls) = self.tls.clone() {
            let tls = tokio::task::spawn_blocking(move || tls.options())
                .await
                .map_err(|e| Error::config("etcd.tls", "", e.to_string()))??;
            options = options.with_tls(tls);
        }
        if let Some((user, password)) = &self.auth {
            options = options
                .with_user(user, password)
                .with_auto_token_refresh(true);
        }
        let endpoints = self.endpoints.join(",");
        let connect = Client::connect(&self.endpoints, Some(options));
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(client)) => Ok(client),
            // With credentials, connecting is authenticating: etcd saying no is about them.
            Ok(Err(e)) => Err(match (&self.auth, classify("connect", &endpoints, e)) {
                (
                    Some((user, _)),
                    Error::Registry { reason, .. } | Error::RegistryAuth { reason, .. },
                ) => Error::RegistryAuth {
                    user: user.clone(),
                    endpoints,
                    reason,
                },
                (_, e) => e,
            }),
            Err(_) => Err(timed_out("connect", &endpoints, self.connect_timeout)),
        }
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("namespace", &self.namespace)
            .field("fabric", &self.fabric)
            .field("lease_ttl", &self.lease_ttl)
            .field("tls", &self.tls)
            .field(
                "auth",
                &self.auth.as_ref().map(|(user, _)| (user, "<redacted>")),
            )
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

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
    resyncs: u64,
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
        let mut client = inner.client.lease_client();
        inner
            .call("revoke lease at shutdown", client.revoke(lease))
            .await?;
        tracing::info!(
            lease = format!("{lease:x}"),
            "registry shut down, lease revoked"
        );
        Ok(())
    }
}

/// How a keepalive run ended.
enum KeepAlive {
    Lost(&'static str),
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

    /// One request, bounded by the request timeout, with connection bookkeeping.
    async fn call<T>(
        &self,
        op: &str,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        let result = match tokio::time::timeout(self.request_timeout, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(op, &self.endpoints_str, e)),
            Err(_) => Err(timed_out(op, &self.endpoints_str, self.request_timeout)),
        };
        match &result {
            Ok(_) => self.ok(),
            Err(e) => self.failed(e),
        }
        result
    }

    fn unavailable(&self, op: &str, reason: impl Into<String>) -> Error {
        Error::RegistryUnavailable {
            op: op.into(),
            endpoints: self.endpoints_str.clone(),
            reason: reason.into(),
        }
    }

    async fn grant(&self) -> Result<(i64, i64)> {
        let mut client = self.client.lease_client();
        let resp = self
            .call("grant lease", client.grant(self.ttl_secs, None))
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
        let mut kv = self.client.kv_client();
        let put = kv.put(key, value, Some(PutOptions::new().with_lease(lease)));
        match self.call(op, put).await {
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
        let txn = Txn::new()
            .when([Compare::lease(key, CompareOp::Equal, lease)])
            .and_then([TxnOp::delete(key, None)]);
        let mut kv = self.client.kv_client();
        let resp = self.call(op, kv.txn(txn)).await?;
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

    // ---- the keeper ---------------------------------------------------------------------

    async fn keeper(self: Arc<Self>, mut lease: i64, mut ttl: i64) {
        loop {
            let KeepAlive::Lost(why) = self.keep_alive(lease, ttl).await;
            // Writes from now on are remembered for the re-registration, not sent.
            self.lease.store(0, Ordering::SeqCst);
            tracing::warn!(
                lease = format!("{lease:x}"),
                why,
                "registry lease lost; re-registering"
            );
            let old = lease;
            let mut backoff = Backoff::new(Duration::from_millis(50), self.backoff_cap());
            loop {
                match self.reregister().await {
                    Ok((new, new_ttl)) => {
                        (lease, ttl) = (new, new_ttl);
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "re-registration failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
            self.status.lock().reregistrations += 1;
            tracing::info!(
                old = format!("{old:x}"),
                new = format!("{lease:x}"),
                "registry re-registered under a new lease"
            );
            // If etcd kept the old lease (it extends leases across its own restarts), its keys
            // moved to the new one; revoking it frees it early.
            let mut client = self.client.lease_client();
            let _ = tokio::time::timeout(self.request_timeout, client.revoke(old)).await;
        }
    }

    /// Grants a new lease and re-puts everything this agent owns under it.
    async fn reregister(&self) -> Result<(i64, i64)> {
        let (lease, ttl) = self.grant().await?;
        let owned = self.owned.lock().await;
        self.lease.store(lease, Ordering::SeqCst);
        self.unpublished.store(false, Ordering::SeqCst);
        if let Err(e) = self.put_all(&owned, lease, "re-register").await {
            self.lease.store(0, Ordering::SeqCst);
            drop(owned);
            let mut client = self.client.lease_client();
            let _ = tokio::time::timeout(self.request_timeout, client.revoke(lease)).await;
            return Err(e);
        }
        Ok((lease, ttl))
    }

    /// Publishes what writes failed to publish while the lease lived on (etcd was briefly
    /// unreachable), by re-putting everything owned under the same lease.
    async fn republish(self: Arc<Self>, lease: i64) {
        let owned = self.owned.lock().await;
        if self.lease.load(Ordering::SeqCst) != lease {
            return; // a re-registration or the shutdown took over
        }
        match self
            .put_all(&owned, lease, "publish remembered entries")
            .await
        {
            Ok(()) => {
                tracing::info!("registry published the entries remembered while etcd was away")
            }
            Err(e) => {
                self.unpublished.store(true, Ordering::SeqCst);
                if is_lease_not_found(&e) {
                    self.report_lost(lease);
                }
            }
        }
    }

    /// Puts every entry in `owned` under `lease`, in transactions of `TXN_OPS`.
    async fn put_all(&self, owned: &Owned, lease: i64, op: &str) -> Result<()> {
        let mut puts = Vec::new();
        if let Some(agent) = &owned.agent {
            puts.push((self.agent_key(&agent.name), to_json(agent)?));
        }
        for segment in owned.segments.values() {
            puts.push((self.segment_key(&segment.name), to_json(segment)?));
        }
        for chunk in puts.chunks(TXN_OPS) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|(key, value)| {
                    TxnOp::put(
                        key.as_str(),
                        value.as_slice(),
                        Some(PutOptions::new().with_lease(lease)),
                    )
                })
                .collect();
            let mut kv = self.client.kv_client();
            self.call(op, kv.txn(Txn::new().and_then(ops))).await?;
        }
        Ok(())
    }

    /// After a keepalive succeeded: publishes what failed to publish meanwhile, off the
    /// keepalive loop (keepalives go on while it runs).
    fn publish_if_needed(self: &Arc<Self>, lease: i64) {
        if self.unpublished.swap(false, Ordering::SeqCst) {
            tokio::spawn(self.clone().republish(lease));
        }
    }

    /// Keeps `lease` alive until it is lost.
    async fn keep_alive(self: &Arc<Self>, lease: i64, ttl: i64) -> KeepAlive {
        let ttl = Duration::from_secs(ttl.max(1) as u64);
        let period = (ttl / 3).max(Duration::from_millis(100));
        let mut last_ok = Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(50), self.backoff_cap());
        loop {
            if last_ok.elapsed() >= ttl {
                return KeepAlive::Lost("no keepalive answered for a whole TTL");
            }
            if self.lost_lease.load(Ordering::SeqCst) == lease {
                return KeepAlive::Lost("a write found the lease gone");
            }
            let mut client = self.client.lease_client();
            let open = self.call("lease keepalive", client.keep_alive(lease)).await;
            let (mut keeper, mut stream) = match open {
                Ok(pair) => pair,
                Err(e) if e.to_string().contains("lease not found") => {
                    return KeepAlive::Lost("etcd answered: lease not found");
                }
                Err(_) => {
                    let wait = backoff
                        .next_delay()
                        .min(ttl.saturating_sub(last_ok.elapsed()));
                    tokio::time::sleep(wait).await;
                    continue;
                }
            };
            last_ok = Instant::now();
            backoff.reset();
            self.publish_if_needed(lease);
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is immediate; the open just renewed the lease
            loop {
                tokio::select! {
                    _ = self.lease_lost.notified() => {
                        if self.lost_lease.load(Ordering::SeqCst) == lease {
                            return KeepAlive::Lost("a write found the lease gone");
                        }
                    }
                    _ = tick.tick() => {
                        if last_ok.elapsed() >= ttl {
                            return KeepAlive::Lost("no keepalive answered for a whole TTL");
                        }
                        if let Err(e) = keeper.keep_alive().await {
                            self.failed(&classify("lease keepalive", &self.endpoints_str, e));
                            break;
                        }
                    }
                    msg = stream.message() => match msg {
                        Ok(Some(resp)) if resp.ttl() <= 0 => {
                            return KeepAlive::Lost("etcd answered: lease not found");
                        }
                        Ok(Some(_)) => {
                            last_ok = Instant::now();
                            self.ok();
                            self.publish_if_needed(lease);
                        }
                        Ok(None) => {
                            self.failed(&self.unavailable("lease keepalive", "stream closed"));
                            break;
                        }
                        Err(e) => {
                            self.failed(&classify("lease keepalive", &self.endpoints_str, e));
                            break;
                        }
                    },
                }
            }
        }
    }

    // ---- the watcher --------------------------------------------------------------------

    /// Reads every entry of the fabric (paged, at one revision) and replaces the cache.
    async fn full_read(&self) -> Result<i64> {
        let end = prefix_end(&self.root);
        let mut kv = self.client.kv_client();
        let mut agents = HashMap::new();
        let mut segments = HashMap::new();
        let mut from = self.root.clone().into_bytes();
        let mut rev = 0;
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
            if rev != 0 {
                options = options.with_revision(rev);
            }
            let resp = self
                .call("read fabric", kv.get(from.clone(), Some(options)))
                .await?;
            if rev == 0 {
                rev = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                match self.decode(kv) {
                    Some(Entry::Agent(a)) => {
                        agents.insert(a.name.clone(), a);
                    }
                    Some(Entry::Segment(s)) => {
                        segments.insert(s.name.clone(), s);
                    }
                    None => {}
                }
            }
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        *self.cache.write() = Cache { agents, segments };
        self.cache_rev.send_modify(|r| *r = (*r).max(rev));
        Ok(rev)
    }

    async fn watcher(self: Arc<Self>, mut rev: i64) {
        let mut backoff = Backoff::new(Duration::from_millis(50), self.backoff_cap());
        let mut resync = false;
        loop {
            if resync {
                match self.full_read().await {
                    Ok(r) => {
                        rev = r;
                        self.status.lock().resyncs += 1;
                        let _ = self.events.send(Event::Resynced);
                        tracing::info!(revision = rev, "registry cache resynced");
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "registry resync failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                        continue;
                    }
                }
            }
            // Whatever ends this watch, the next one starts from a full read.
            resync = true;
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(rev + 1);
            let mut client = self.client.watch_client();
            let mut stream = match self
                .call(
                    "watch fabric",
                    client.watch(self.root.clone(), Some(options)),
                )
                .await
            {
                Ok(stream) => stream,
                Err(_) => {
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        if resp.canceled() || resp.compact_revision() > 0 {
                            tracing::warn!(
                                compact_revision = resp.compact_revision(),
                                reason = resp.cancel_reason(),
                                "registry watch canceled; resyncing"
                            );
                            break;
                        }
                        backoff.reset();
                        self.ok();
                        let mut applied = rev;
                        for event in resp.events() {
                            let Some(kv) = event.kv() else { continue };
                            applied = applied.max(kv.mod_revision());
                            if let Some(event) = self.apply(event.event_type(), kv) {
                                let _ = self.events.send(event);
                            }
                        }
                        if let Some(h) = resp.header() {
                            applied = applied.max(h.revision());
                        }
                        rev = applied;
                        self.cache_rev.send_modify(|r| *r = (*r).max(rev));
                    }
                    Ok(None) => {
                        self.failed(&self.unavailable("watch fabric", "watch stream closed"));
                        break;
                    }
                    Err(e) => {
                        self.failed(&classify("watch fabric", &self.endpoints_str, e));
                        break;
                    }
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Applies one watch event to the cache.
    fn apply(&self, kind: EventType, kv: &KeyValue) -> Option<Event> {
        match kind {
            EventType::Put => match self.decode(kv)? {
                Entry::Agent(a) => {
                    self.cache.write().agents.insert(a.name.clone(), a.clone());
                    Some(Event::AgentPut(a))
                }
                Entry::Segment(s) => {
                    self.cache
                        .write()
                        .segments
                        .insert(s.name.clone(), s.clone());
                    Some(Event::SegmentPut(s))
                }
            },
            EventType::Delete => {
                let key = std::str::from_utf8(kv.key()).ok()?;
                let rest = key.strip_prefix(&self.root)?;
                if let Some(name) = rest.strip_prefix("agents/") {
                    self.cache.write().agents.remove(name)?;
                    Some(Event::AgentDeleted(name.into()))
                } else if let Some(name) = rest.strip_prefix("segments/") {
                    self.cache.write().segments.remove(name)?;
                    Some(Event::SegmentDeleted(name.into()))
                } else {
                    None
                }
            }
        }
    }

    /// An entry from a key and value under the root; anything else (unknown key, bad JSON) is
    /// logged and skipped: another agent's bug must not stop this one's watch.
    fn decode(&self, kv: &KeyValue) -> Option<Entry> {
        let key = std::str::from_utf8(kv.key()).ok()?;
        let rest = key.strip_prefix(&self.root)?;
        let entry = if rest.starts_with("agents/") {
            serde_json::from_slice(kv.value()).map(Entry::Agent)
        } else if rest.starts_with("segments/") {
            serde_json::from_slice(kv.value()).map(Entry::Segment)
        } else {
            return None;
        };
        match entry {
            Ok(entry) => Some(entry),
            Err(e) => {
                tracing::warn!(key, error = %e, "registry: skipping an entry that does not parse");
                None
            }
        }
    }
}

enum Entry {
    Agent(AgentEntry),
    Segment(SegmentEntry),
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

// gRPC status codes (tonic's `Code` as i32).
const CANCELLED: i32 = 1;
const UNKNOWN: i32 = 2;
const INVALID_ARGUMENT: i32 = 3;
const DEADLINE_EXCEEDED: i32 = 4;
const ABORTED: i32 = 10;
const UNAVAILABLE: i32 = 14;
const UNAUTHENTICATED: i32 = 16;

/// Sorts an etcd client error into "etcd did not answer" (worth retrying) and "etcd said no".
fn classify(op: &str, endpoints: &str, e: etcd_client::Error) -> Error {
    use etcd_client::Error as E;
    let op = op.to_string();
    let endpoints = endpoints.to_string();
    match e {
        E::GRpcStatus(status) => {
            let code = i32::from(status.code());
            let reason = format!("{} ({:?})", status.message(), status.code());
            match code {
                CANCELLED | UNKNOWN | DEADLINE_EXCEEDED | ABORTED | UNAVAILABLE => {
                    Error::RegistryUnavailable {
                        op,
                        endpoints,
                        reason,
                    }
                }
                UNAUTHENTICATED => Error::RegistryAuth {
                    user: String::new(),
                    endpoints,
                    reason,
                },
                INVALID_ARGUMENT if status.message().contains("authentication failed") => {
                    Error::RegistryAuth {
                        user: String::new(),
                        endpoints,
                        reason,
                    }
                }
                _ => Error::Registry {
                    op,
                    endpoints,
                    reason,
                },
            }
        }
        E::TransportError(_) | E::IoError(_) | E::LeaseKeepAliveError(_) | E::WatchError(_) => {
            Error::RegistryUnavailable {
                op,
                endpoints,
                reason: e.to_string(),
            }
        }
        other => Error::Registry {
            op,
            endpoints,
            reason: other.to_string(),
        },
    }
}

fn is_lease_not_found(e: &Error) -> bool {
    matches!(e, Error::Registry { reason, .. } if reason.contains("lease not found"))
}

fn timed_out(op: &str, endpoints: &str, after: Duration) -> Error {
    Error::RegistryUnavailable {
        op: op.into(),
        endpoints: endpoints.into(),
        reason: format!("no answer within {after:?}"),
    }
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
