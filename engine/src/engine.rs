//! The engine: this process's regions, its data-plane servers, and its connections to peers.

use std::collections::HashMap;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Instant;

use tracing::{debug, info};

use crate::auth::DataSecret;
use crate::batch::{Batch, BatchHandle, BatchOps, BatchResult, Job};
use crate::block_table::{BlockTable, plane_end};
pub use crate::engine_config::EngineConfig;
use crate::error::{Error, Result, Side};
use crate::frame::{Entry, TablePlane};
use crate::handshake::Credentials;
use crate::op::{self, BlockOp, Opcode, RegionIndex};
use crate::rdma::{ConnectInfo, RdmaExchange, RdmaNicInfo};
use crate::region::{AccessKey, Lease, Location, Region, RegionId};
use crate::region_table::RegionTable;
use crate::segment::{DESCRIPTOR_VERSION, Endpoints, RegionDesc, SegmentDescriptor};
use crate::transport::planned_table::PlannedPlane;
use crate::transport::route::Route;
use crate::transport::select::{Local, NO_EXCHANGE, Preference, Selection, select_for};
use crate::transport::shm::ShmLink;
use crate::transport::target::Target;
pub use crate::transport::target::{ServeObserver, ServedChunk};
use crate::transport::tcp::{TcpLink, TcpOptions};
use crate::transport::{
    Piece, PlannedTable, Transport, TransportKind, TransportStats, listener, shm_server, tcp_server,
};

/// Why a build without the cargo feature `rdma` has no RDMA.
#[cfg(not(feature = "rdma"))]
const NOT_BUILT: &str = "rdma is not built into this engine (cargo feature `rdma` is off)";

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) config: EngineConfig,
    pub(crate) regions: Arc<RegionTable>,
    /// What the tcp and shm servers serve (the regions again, the secret, the settings).
    pub(crate) target: Arc<Target>,
    endpoints: RwLock<Endpoints>,
    next_batch: AtomicU64,
    shm_pool: Arc<rayon::ThreadPool>,
    /// The RDMA devices, opened on first use; or why there are none.
    #[cfg(feature = "rdma")]
    rdma: std::sync::OnceLock<std::result::Result<Arc<crate::transport::rdma::Runtime>, String>>,
}

impl Inner {
    /// The RDMA state, opened on first use, or why this engine has none.
    #[cfg(feature = "rdma")]
    pub(crate) fn rdma(
        &self,
    ) -> std::result::Result<&Arc<crate::transport::rdma::Runtime>, String> {
        self.rdma
            .get_or_init(|| {
                let r = crate::transport::rdma::Runtime::open(&self.config.rdma).map(Arc::new);
                if let Err(why) = &r {
                    debug!(segment = %self.config.name, %why, "no rdma");
                }
                r
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Whether this engine can open rdma connections, or why not.
    fn rdma_ready(&self) -> std::result::Result<(), String> {
        #[cfg(feature = "rdma")]
        {
            self.rdma()
                .map(|_| ())
                .map_err(|why| format!("no usable RDMA device here: {why}"))
        }
        #[cfg(not(feature = "rdma"))]
        {
            Err(NOT_BUILT.into())
        }
    }

    /// The regions' descriptors, with their rkeys when this engine has RDMA.
    fn region_descriptors(&self) -> Vec<RegionDesc> {
        #[allow(unused_mut)]
        let mut regions = self.regions.descriptors();
        #[cfg(feature = "rdma")]
        if let Ok(rt) = self.rdma() {
            for d in &mut regions {
                if let Ok(region) = self.regions.get(d.id, Side::Local) {
                    d.rdma = rt.keys(&region, || self.regions.get(d.id, Side::Local).is_ok());
                }
            }
        }
        regions
    }

    pub(crate) fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: self.config.name.clone(),
            node: self.config.node.clone(),
            regions: self.region_descriptors(),
            endpoints: self
                .endpoints
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

/// A transfer engine. Cheap to clone; clones share everything.
#[derive(Debug, Clone)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Result<Engine> {
        config.validate()?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.shm_threads)
            .thread_name(|i| format!("kvf-shm-{i}"))
            .build()
            .map_err(|e| Error::io("start shm copy pool", std::io::Error::other(e)))?;
        let secret = config
            .data_secret
            .clone()
            .unwrap_or_else(DataSecret::random);
        let regions = Arc::new(RegionTable::default());
        // The servers ask for the descriptor through a weak handle: they hold the target, and
        // the engine holds them no longer than its own life.
        let inner = Arc::new_cyclic(|me: &Weak<Inner>| {
            let me = me.clone();
            let describe = Box::new(move || me.upgrade().map(|inner| inner.descriptor()));
            Inner {
                target: Arc::new(Target::new(
                    regions.clone(),
                    config.clone(),
                    secret,
                    describe,
                )),
                config,
                regions,
                endpoints: RwLock::default(),
                next_batch: AtomicU64::new(1),
                shm_pool: Arc::new(pool),
                #[cfg(feature = "rdma")]
                rdma: std::sync::OnceLock::new(),
            }
        });
        Ok(Engine { inner })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// The secret this engine's tcp and shm peers must prove they hold: the configured one, or
    /// the one generated at start. Hand it out only over an authenticated channel.
    pub fn data_secret(&self) -> &DataSecret {
        &self.inner.target.secret
    }

    /// Allocates a host region in a memfd (page-aligned, zeroed, shareable with same-node peers).
    pub fn alloc(&self, len: u64) -> Result<Arc<Region>> {
        self.inner.regions.alloc(len)
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads and writes until [`Engine::deregister`] of the
    /// returned region has completed.
    pub unsafe fn register_ptr(
        &self,
        location: Location,
        ptr: NonNull<u8>,
        len: u64,
    ) -> Result<Arc<Region>> {
        // SAFETY: forwarded to our caller.
        unsafe { self.inner.regions.register_ptr(location, ptr, len) }
    }

    /// Adopts a memfd another process on this node shares (a worker's KV memory handed to its
    /// agent), under the access key its readers will present. The memfd must allow sealing: it
    /// is sealed against shrinking before it is mapped.
    pub fn register_memfd(&self, fd: std::os::fd::OwnedFd, key: AccessKey) -> Result<Arc<Region>> {
        self.inner.regions.register_memfd(fd, key)
    }

    /// Maps another process's GPU memory from its CUDA IPC export, under `key`.
    pub fn import_cuda(
        &self,
        device: u32,
        export: crate::cuda::CudaExport,
        len: u64,
        key: AccessKey,
    ) -> Result<Arc<Region>> {
        self.inner.regions.import_cuda(device, export, len, key)
    }

    /// Allocates `len` bytes of device memory on CUDA device `device` (zeroed, exported for CUDA
    /// IPC so same-node peers can map it). `NoCudaDriver` / `NoSuchDevice` when it cannot be.
    pub fn alloc_cuda(&self, device: u32, len: u64) -> Result<Arc<Region>> {
        self.inner.regions.alloc_cuda(device, len)
    }

    /// Registers device memory the caller owns (device pointer `ptr` on `device`).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay allocated until [`Engine::deregister`] of the returned region has
    /// completed.
    pub unsafe fn register_cuda(&self, device: u32, ptr: u64, len: u64) -> Result<Arc<Region>> {
        // SAFETY: forwarded to our caller.
        unsafe { self.inner.regions.register_cuda(device, ptr, len) }
    }

    /// The registered region and offset that hold `ptr..ptr+len` at `location`, or
    /// `UnregisteredPointer`.
    pub fn locate(&self, location: Location, ptr: u64, len: u64) -> Result<(RegionId, u64)> {
        self.inner.regions.locate(location, ptr, len)
    }

    pub fn region(&self, id: RegionId) -> Result<Arc<Region>> {
        self.inner.regions.get(id, Side::Local)
    }

    /// Unpublishes a region at once and returns when no in-flight batch uses it any more. Its
    /// RDMA registrations are dropped then (peers still holding its rkeys get access errors).
    pub async fn deregister(&self, id: RegionId) -> Result<()> {
        self.inner.regions.deregister(id).await?;
        #[cfg(feature = "rdma")]
        if let Some(Ok(rt)) = self.inner.rdma.get() {
            rt.forget(id);
        }
        Ok(())
    }

    /// The RDMA ports this engine uses, or `NoRdmaDevice` saying why it has none (no device,
    /// none allowed or allocated, RDMA turned off, or a build without the cargo feature `rdma`).
    pub fn rdma_devices(&self) -> Result<Vec<RdmaNicInfo>> {
        #[cfg(feature = "rdma")]
        {
            self.inner
                .rdma()
                .map(|rt| rt.nics())
                .map_err(|reason| Error::NoRdmaDevice { reason })
        }
        #[cfg(not(feature = "rdma"))]
        {
            Err(Error::NoRdmaDevice {
                reason: NOT_BUILT.into(),
            })
        }
    }

    /// The target side of an rdma connection: creates a QP for each QP `peer` offers, connects
    /// them to the offer and returns this engine's answer, for the peer's
    /// [`RdmaExchange`] to bring back. An offer for a session this engine already holds
    /// replaces its QPs (the peer is rebuilding its link). Blocking (verbs calls).
    pub fn rdma_accept(&self, peer: &str, offer: &ConnectInfo) -> Result<ConnectInfo> {
        #[cfg(feature = "rdma")]
        {
            let rt = self
                .inner
                .rdma()
                .map_err(|reason| Error::NoRdmaDevice { reason })?;
            rt.accept(peer, offer)
        }
        #[cfg(not(feature = "rdma"))]
        {
            let _ = (peer, offer);
            Err(Error::NoRdmaDevice {
                reason: NOT_BUILT.into(),
            })
        }
    }

    /// Closes the QPs accepted for `peer`'s session; false when there were none.
    pub fn rdma_release(&self, peer: &str, session: u64) -> bool {
        #[cfg(feature = "rdma")]
        if let Some(Ok(rt)) = self.inner.rdma.get() {
            return rt.release(peer, session);
        }
        let _ = (peer, session);
        false
    }

    /// What peers need to reach this engine.
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.inner.descriptor()
    }

    /// Serves tcp data connections until `shutdown` resolves, then closes them all.
    pub async fn serve_tcp(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<()> {
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("tcp listener address", e))?;
        self.set_endpoint(|e| e.tcp = Some(addr));
        info!(%addr, segment = %self.inner.config.name, "serving tcp data plane");
        let target = self.inner.target.clone();
        let limits = target.limits();
        listener::serve(
            listener,
            shutdown,
            "kvf-tcp-serve",
            limits,
            move |s, peer, a| tcp_server::serve_conn(target.clone(), s, peer, a),
        )
        .await;
        self.set_endpoint(|e| e.tcp = None);
        Ok(())
    }

    /// Serves same-node peers on a Unix socket until `shutdown` resolves.
    pub async fn serve_shm(
        &self,
        listener: tokio::net::UnixListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<()> {
        let path: PathBuf = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(PathBuf::from))
            .ok_or_else(|| Error::InvalidConfig {
                field: "shm listener",
                value: format!("{listener:?}"),
                reason: "must be bound to a filesystem path",
            })?;
        self.set_endpoint(|e| e.shm = Some(path.clone()));
        info!(path = %path.display(), "serving shm data plane");
        let target = self.inner.target.clone();
        let limits = target.limits();
        listener::serve(
            listener,
            shutdown,
            "kvf-shm-serve",
            limits,
            move |s, peer, a| shm_server::serve_conn(target.clone(), s, peer, a),
        )
        .await;
        self.set_endpoint(|e| e.shm = None);
        let _ = std::fs::remove_file(&path);
        Ok(())
    }

    fn set_endpoint(&self, f: impl FnOnce(&mut Endpoints)) {
        f(&mut self
            .inner
            .endpoints
            .write()
            .unwrap_or_else(|e| e.into_inner()));
    }

    /// Connects to a peer segment over the transport that locality (or `preference`) picks, and
    /// logs the choice with its reason. Never rdma, which needs an exchange with the peer: see
    /// [`Engine::connect_with`].
    pub async fn connect(
        &self,
        remote: &SegmentDescriptor,
        secret: &DataSecret,
        preference: Preference,
        segment_key: Option<u64>,
    ) -> Result<Peer> {
        self.connect_with(remote, secret, preference, segment_key, None)
            .await
    }

    /// [`Engine::connect`], where rdma may be chosen too: `rdma` carries the connection offer
    /// to the peer's engine and its answer back (the agent's peer API, the bench's control
    /// channel), at connect time and whenever a failed QP is rebuilt. Rdma is possible when this
    /// engine has a usable RDMA device and the peer publishes rkeys for its regions; otherwise
    /// the selection (or the error, for `Preference::Only(Rdma)`) says why.
    ///
    /// `secret` is the peer engine's data secret (its [`Engine::data_secret`], as its owner
    /// handed it out): tcp and shm connections prove it, and check the peer proves it too. The
    /// peer's region keys come from `remote`, unless `segment_key` opens the peer's own
    /// descriptor (then the peer's answer replaces `remote`).
    pub async fn connect_with(
        &self,
        remote: &SegmentDescriptor,
        secret: &DataSecret,
        preference: Preference,
        segment_key: Option<u64>,
        rdma: Option<Arc<dyn RdmaExchange>>,
    ) -> Result<Peer> {
        let local = Local {
            node: &self.inner.config.node,
            rdma: match &rdma {
                None => Err(NO_EXCHANGE.into()),
                Some(_) => self.inner.rdma_ready(),
            },
        };
        let selection = select_for(&local, remote, preference)?;
        info!(
            segment = %remote.name,
            transport = %selection.kind,
            reason = %selection.reason,
            "transport selected"
        );
        let route = Route::new(selection.kind, remote, rdma)?;
        let inner = self.inner.clone();
        let remote = remote.clone();
        let secret = secret.clone();
        let (link, descriptor) = tokio::task::spawn_blocking(move || {
            let creds = Credentials {
                secret: &secret,
                segment: &remote.name,
                key: segment_key,
                from: &inner.config.name,
            };
            let pair: (Box<dyn Transport>, Option<SegmentDescriptor>) = match route {
                Route::Tcp(addr) => {
                    let opts = TcpOptions {
                        connections: inner.config.tcp_connections,
                        buffer: inner.config.tcp_buffer,
                        chunk_bytes: inner.config.chunk_bytes,
                        staging_bytes: inner.config.staging_bytes,
                        handshake_timeout: inner.config.handshake_timeout,
                        busy_poll: inner.config.spin_wait,
                        tls: inner.config.tls.clone(),
                    };
                    let (link, d) = TcpLink::connect(addr, creds, opts)?;
                    (Box::new(link), d)
                }
                Route::Shm(path) => {
                    let (link, d) = ShmLink::connect(
                        &path,
                        creds,
                        inner.config.handshake_timeout,
                        inner.shm_pool.clone(),
                        inner.config.shm_parallel_min,
                    )?;
                    (Box::new(link), d)
                }
                #[cfg(feature = "cuda")]
                Route::CudaIpc => {
                    let c = &inner.config;
                    let lane = crate::cuda::lane::LaneOptions {
                        spin: c.cuda_spin,
                        poll: c.spin_wait,
                        doorbell_idle: c.cuda_doorbell_idle,
                    };
                    let link = crate::transport::cuda_ipc::CudaIpcLink::connect(
                        &remote,
                        c.cuda_path,
                        lane,
                        c.cuda_push_by_peer,
                    )?;
                    (Box::new(link), None)
                }
                #[cfg(feature = "rdma")]
                Route::Rdma(exchange) => {
                    let rt = inner
                        .rdma()
                        .map_err(|reason| Error::NoRdmaDevice { reason })?
                        .clone();
                    let link = crate::transport::rdma::RdmaLink::connect(rt, &remote, exchange)?;
                    (Box::new(link), None)
                }
            };
            let (link, told) = pair;
            Ok::<_, Error>((link, told.unwrap_or(remote)))
        })
        .await
        .map_err(|e| Error::io("connect task", std::io::Error::other(e)))??;
        Ok(Peer {
            inner: self.inner.clone(),
            known: RwLock::new(Known::new(descriptor)),
            selection,
            link,
        })
    }
}

/// What this side knows of the peer's regions, indexed by id: a peer agent may serve thousands,
/// and every batch looks its own up.
#[derive(Debug)]
pub(crate) struct Known {
    descriptor: SegmentDescriptor,
    index: HashMap<RegionId, usize>,
}

impl Known {
    pub(crate) fn new(descriptor: SegmentDescriptor) -> Known {
        let index = descriptor
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| (r.id, i))
            .collect();
        Known { descriptor, index }
    }

    fn region(&self, id: RegionId) -> Option<&RegionDesc> {
        self.index.get(&id).map(|&i| &self.descriptor.regions[i])
    }
}

/// A connected remote segment. Submit batches against it; each carries its transport.
#[derive(Debug)]
pub struct Peer {
    pub(crate) inner: Arc<Inner>,
    pub(crate) known: RwLock<Known>,
    pub(crate) selection: Selection,
    pub(crate) link: Box<dyn Transport>,
}

impl Peer {
    pub fn transport(&self) -> TransportKind {
        self.link.kind()
    }

    pub fn selection(&self) -> &Selection {
        &self.selection
    }

    pub fn descriptor(&self) -> SegmentDescriptor {
        self.known
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .descriptor
            .clone()
    }

    /// The key of the peer's region `id`, if the peer serves it as far as we know.
    pub fn region_key(&self, id: RegionId) -> Option<AccessKey> {
        self.known
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .region(id)
            .map(|r| r.key)
    }

    /// Replaces what we know of the peer's regions (after it registered or dropped some).
    pub fn set_descriptor(&self, descriptor: SegmentDescriptor) {
        self.link.regions_changed(&descriptor);
        *self.known.write().unwrap_or_else(|e| e.into_inner()) = Known::new(descriptor);
    }

    pub fn stats(&self) -> TransportStats {
        self.link.stats()
    }

    /// How many of the peer's regions are mapped into this process right now.
    pub fn mapped_regions(&self) -> usize {
        self.link.mapped()
    }

    /// GPU memory goes over cuda-ipc (device on both sides, one local device per batch) or rdma
    /// (GPUDirect). Over tcp either side may be a GPU (each side stages its own through pinned
    /// buffers; the target refuses its GPU regions if its staging is off); over shm the local
    /// side may be (the peer's memory is a memfd). With `staging_bytes = 0`, tcp and shm reach
    /// host memory only.
    fn check_locations(
        &self,
        resolved: impl IntoIterator<Item = (usize, u32, u32)>,
        locals: &[Arc<Region>],
        remotes: &[&RegionDesc],
    ) -> Result<()> {
        let kind = self.link.kind();
        if kind == TransportKind::Rdma {
            // The NIC reaches host and GPU memory alike; what could not be registered has no
            // rkey, which the link reports per region.
            return Ok(());
        }
        let mut first: Option<Location> = None;
        for (i, l, r) in resolved {
            let (local, remote) = (&locals[l as usize], remotes[r as usize]);
            let gpu = |l: Location| matches!(l, Location::Cuda { .. });
            let staged = |region, location| Error::StagingNotConfigured {
                op: i,
                region,
                location,
                transport: kind,
            };
            if kind == TransportKind::CudaIpc {
                if !gpu(local.location()) {
                    return Err(staged(local.id(), local.location()));
                }
                if !gpu(remote.location) {
                    return Err(staged(remote.id, remote.location));
                }
                match first {
                    None => first = Some(local.location()),
                    Some(f) if f != local.location() => {
                        return Err(Error::MixedDevices {
                            op: i,
                            region: local.id(),
                            location: local.location(),
                            first: f,
                        });
                    }
                    Some(_) => {}
                }
            } else if self.inner.config.staging_bytes == 0 {
                if gpu(local.location()) {
                    return Err(staged(local.id(), local.location()));
                }
                if gpu(remote.location) {
                    return Err(staged(remote.id, remote.location));
                }
            } else if kind == TransportKind::Shm && gpu(remote.location) {
                return Err(Error::NotShareable {
                    region: remote.id,
                    reason: format!(
                        "{} memory is no memfd: a same-node peer's GPU memory goes over cuda-ipc \
                         (or tcp)",
                        remote.location
                    ),
                });
            }
        }
        Ok(())
    }

    /// Checks every op (bounds on both sides, keys, overlaps), coalesces, and hands the batch to
    /// the transport. Returns at once; await the handle for completion.
    pub fn submit(&self, batch: Batch) -> Result<BatchHandle> {
        let (planned, handle) = self.plan(batch)?;
        let job = handle.job.clone();
        match planned {
            Planned::Pieces(pieces) => self.link.submit(pieces, job),
            Planned::Table(table) => self.link.submit_table(table, job),
        }
        Ok(handle)
    }

    /// Submits and waits on the calling thread. A small batch may be carried by this thread
    /// itself (sent, and its reply read, without waking any engine thread), which is what one
    /// latency-bound block op wants; larger ones are submitted as usual.
    pub fn run(&self, batch: Batch) -> Result<BatchResult> {
        let (planned, handle) = self.plan(batch)?;
        let (job, deadline) = (handle.job.clone(), handle.deadline());
        match planned {
            Planned::Pieces(pieces) => self.link.run_here(pieces, job, deadline),
            Planned::Table(table) => self.link.run_table_here(table, job, deadline),
        }
        handle.wait_blocking()
    }

    /// Checks every op (or every plane), and prepares the job; nothing is sent yet.
    pub(crate) fn plan(&self, batch: Batch) -> Result<(Planned, BatchHandle)> {
        let started = Instant::now();
        let Batch {
            opcode,
            ops,
            timeout,
            checksum,
            remote_key,
            trace,
            keep,
        } = batch;
        let (planned, locals, elements, bytes) = match ops {
            BatchOps::List(ops) => {
                let (pieces, locals, bytes) = self.plan_list(&ops, opcode, remote_key)?;
                (Planned::Pieces(pieces), locals, ops.len(), bytes)
            }
            BatchOps::Table(table) => {
                let elements = table.elements().unwrap_or(usize::MAX);
                let (table, locals) = self.plan_table(table, opcode, remote_key)?;
                let bytes = table.bytes;
                (Planned::Table(table), locals, elements, bytes)
            }
        };
        let leases: Vec<Lease> = locals.iter().map(|r| r.lease()).collect();
        let id = self.inner.next_batch.fetch_add(1, Ordering::Relaxed);
        let job = Job::new(id, opcode, checksum, trace, leases, keep);
        let coalesced = match &planned {
            Planned::Pieces(p) => p.len(),
            // Expanded (and coalesced) by the transport, if at all.
            Planned::Table(t) => t.elements(),
        };
        debug!(
            batch = id,
            op = %opcode,
            ops = elements,
            coalesced,
            table = matches!(planned, Planned::Table(_)),
            transport = %self.link.kind(),
            "batch submitted"
        );
        let handle = BatchHandle {
            job,
            timeout: timeout.unwrap_or(self.inner.config.batch_timeout),
            started,
            transport: self.link.kind(),
            ops: elements,
            coalesced_ops: coalesced,
            spin: crate::batch::poll_window(bytes, self.inner.config.spin_wait),
        };
        Ok((planned, handle))
    }

    /// An op list: every op checked (bounds on both sides, overlaps), then coalesced. Returns
    /// the pieces, the local regions and the bytes.
    fn plan_list(
        &self,
        ops: &[BlockOp],
        opcode: Opcode,
        remote_key: Option<AccessKey>,
    ) -> Result<(Vec<Piece>, Vec<Arc<Region>>, u64)> {
        let limit = self.inner.config.max_batch_ops;
        if ops.len() > limit {
            return Err(Error::BatchTooLarge {
                field: "ops",
                value: ops.len() as u64,
                limit: limit as u64,
            });
        }
        // Bounds before overlaps: the overlap check sizes bitmaps from offsets, which mean
        // nothing until they are known to lie inside their regions.
        op::check_shape(ops)?;
        let known = self.known.read().unwrap_or_else(|e| e.into_inner());
        let mut locals: Vec<Arc<Region>> = Vec::new();
        let mut remotes: Vec<&RegionDesc> = Vec::new();
        // Each op's (local, remote) index into those, found once: a KV cache is often one region
        // per layer, and a batch of 10^5 ops must not search them three times per op.
        let mut resolved: Vec<(u32, u32)> = Vec::with_capacity(ops.len());
        let (mut local_at, mut remote_at) = (RegionIndex::default(), RegionIndex::default());
        // What the transports add up (job bytes, chunk sizes) is bounded by this sum.
        let mut total = 0u64;
        for (i, o) in ops.iter().enumerate() {
            let (l, new) = local_at.number(o.local_region);
            if new {
                locals.push(self.inner.regions.get(o.local_region, Side::Local)?);
            }
            let (r, new) = remote_at.number(o.remote_region);
            if new {
                remotes.push(known.region(o.remote_region).ok_or(Error::UnknownRegion {
                    region: o.remote_region,
                    side: Side::Remote,
                })?);
            }
            locals[l].range(i, "local_offset", o.local_offset, o.len)?;
            let remote = remotes[r];
            if o.remote_offset
                .checked_add(o.len)
                .is_none_or(|end| end > remote.len)
            {
                return Err(Error::OutOfBounds {
                    op: i,
                    field: "remote_offset",
                    region: remote.id,
                    offset: o.remote_offset,
                    len: o.len,
                    region_len: remote.len,
                });
            }
            total = total.checked_add(o.len).ok_or(Error::BatchTooLarge {
                field: "bytes",
                value: u64::MAX,
                limit: u64::MAX,
            })?;
            // Exact: at most `max_batch_ops` (< 2^32) regions are numbered.
            resolved.push((l as u32, r as u32));
        }
        op::check_destinations(ops, opcode)?;
        self.check_locations(
            resolved.iter().enumerate().map(|(i, &(l, r))| (i, l, r)),
            &locals,
            &remotes,
        )?;
        let mut pieces = Vec::with_capacity(ops.len());
        for c in op::coalesce(ops) {
            let o = c.op;
            // Coalesced ops share their first op's regions.
            let (l, r) = resolved[c.first_index];
            let (local, remote) = (&locals[l as usize], remotes[r as usize]);
            pieces.push(Piece {
                local: local.range(c.first_index, "local_offset", o.local_offset, o.len)?,
                remote: Entry {
                    region: remote.id,
                    key: remote_key.unwrap_or(remote.key),
                    offset: o.remote_offset,
                    len: o.len,
                },
                local_region: local.id(),
                local_offset: o.local_offset,
                op: c.first_index,
                location: local.location(),
            });
        }
        drop(known);
        Ok((pieces, locals, total))
    }

    /// A block table: checked per plane (bounds of the largest id on each side, keys through
    /// the descriptor, destinations apart) in O(planes + blocks), never expanded here.
    fn plan_table(
        &self,
        table: BlockTable,
        opcode: Opcode,
        remote_key: Option<AccessKey>,
    ) -> Result<(PlannedTable, Vec<Arc<Region>>)> {
        let limit = self.inner.config.max_batch_ops;
        match table.elements() {
            Some(n) if n <= limit => {}
            n => {
                return Err(Error::BatchTooLarge {
                    field: "blocks × planes",
                    value: n.map_or(u64::MAX, |n| n as u64),
                    limit: limit as u64,
                });
            }
        }
        let shape = table.validate(opcode)?;
        let bytes = table.bytes().ok_or(Error::BatchTooLarge {
            field: "bytes",
            value: u64::MAX,
            limit: u64::MAX,
        })?;
        let known = self.known.read().unwrap_or_else(|e| e.into_inner());
        let mut locals: Vec<Arc<Region>> = Vec::new();
        let mut remotes: Vec<&RegionDesc> = Vec::new();
        let (mut local_at, mut remote_at) = (RegionIndex::default(), RegionIndex::default());
        let mut resolved = Vec::with_capacity(table.planes.len());
        let mut planes = Vec::with_capacity(table.planes.len());
        for (i, p) in table.planes.iter().enumerate() {
            let (l, new) = local_at.number(p.local.region);
            if new {
                locals.push(self.inner.regions.get(p.local.region, Side::Local)?);
            }
            let (r, new) = remote_at.number(p.remote.region);
            if new {
                remotes.push(known.region(p.remote.region).ok_or(Error::UnknownRegion {
                    region: p.remote.region,
                    side: Side::Remote,
                })?);
            }
            let (local, remote) = (&locals[l], remotes[r]);
            let out_of_bounds = |side, region, region_len| {
                let s = p.side(side);
                let block = shape.max(side);
                Error::PlaneOutOfBounds {
                    plane: i,
                    side,
                    region,
                    block,
                    offset: s.base + u64::from(block) * s.stride,
                    len: p.block_bytes,
                    region_len,
                }
            };
            // `validate` checked that both ends fit in 2^64.
            let local_end = plane_end(p.local.base, p.local.stride, shape.max_local, p.block_bytes)
                .expect("validated");
            let extent = local
                .range(i, "local.base", p.local.base, local_end - p.local.base)
                .map_err(|_| out_of_bounds(Side::Local, local.id(), local.len()))?;
            let remote_end = plane_end(
                p.remote.base,
                p.remote.stride,
                shape.max_remote,
                p.block_bytes,
            )
            .expect("validated");
            if remote_end > remote.len {
                return Err(out_of_bounds(Side::Remote, remote.id, remote.len));
            }
            resolved.push((table.element(i, 0), l as u32, r as u32));
            planes.push(PlannedPlane {
                local: extent,
                local_region: local.id(),
                local_base: p.local.base,
                local_stride: p.local.stride,
                location: local.location(),
                remote: TablePlane {
                    region: remote.id,
                    key: remote_key.unwrap_or(remote.key),
                    base: p.remote.base,
                    stride: p.remote.stride,
                    block_bytes: p.block_bytes,
                },
            });
        }
        self.check_locations(resolved, &locals, &remotes)?;
        drop(known);
        let planned = PlannedTable {
            planes,
            blocks: table.blocks.into(),
            shape,
            bytes,
        };
        Ok((planned, locals))
    }
}

/// A batch after the initiator's checks, as the transport takes it.
#[derive(Debug)]
pub(crate) enum Planned {
    Pieces(Vec<Piece>),
    Table(PlannedTable),
}
