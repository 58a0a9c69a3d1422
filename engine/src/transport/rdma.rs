//! RDMA, the data path (cargo feature `rdma`).
//!
//! - [`Runtime`] is the engine's RDMA state: the ports it opened (allowed by the device filter,
//!   allocated to the pod, active, with a GID), a protection domain and a completion poller per
//!   NIC, the memory registrations of this engine's regions (made on first use, published as
//!   rkeys in the segment descriptor, dropped at deregistration) and the QPs it accepted for
//!   peers (the target side: passive, one-sided operations need nothing from it).
//! - [`RdmaLink`] is the initiator side of one peer: `qps_per_peer` RC QPs on every local NIC,
//!   connected through an [`RdmaExchange`]. A batch is cut into slices and striped over the QPs
//!   of the NICs closest to its local memory (`rdma::topology`), posted in chains under
//!   send-queue credits with selective signalling (`rdma::lane`), and completed by the NIC's
//!   poller thread, pinned to the NIC's NUMA node. A failed completion puts the QP in the error
//!   state: the link is rebuilt (all its QPs reset and exchanged again) and the work posted
//!   again, or the batch fails (the request was refused), or RDMA to the peer is given up
//!   (`Error::RdmaFallback`, for the caller to use tcp), as `rdma::retry` decides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::{Piece, Transport, TransportKind, TransportStats};
use crate::batch::Job;
use crate::error::{Error, Result, Side};
use crate::op::{BlockOp, Coalesced, RegionIndex};
use crate::rdma::config::RdmaConfig;
use crate::rdma::handshake::{ConnectInfo, QpParams, negotiate, pair};
use crate::rdma::lane::{Failure, LaneItem, LaneState};
use crate::rdma::mr_cache::{Lookup, MrCache};
use crate::rdma::plan::{self, Lane};
use crate::rdma::retry::PeerHealth;
use crate::rdma::session::{AfterFailure, LinkPhase, Sessions, answer_nics};
use crate::rdma::sysfs::{self, Gid, LinkLayer, PciPath};
use crate::rdma::topology::{self, MemoryPlace, NicPlace};
use crate::rdma::verbs::{self, Completion, Context, Cq, MemoryRegion, Pd, Qp, RemoteMemory};
use crate::rdma::{RdmaExchange, RdmaNicInfo, allocation, select};
use crate::region::{Location, Region, RegionId};
use crate::segment::{RdmaKey, SegmentDescriptor};

/// One port this engine uses.
#[derive(Debug)]
struct Nic {
    info: RdmaNicInfo,
    port: u8,
    gid_index: u32,
    gid: Gid,
    link_layer: LinkLayer,
    place: NicPlace,
    pd: Arc<Pd>,
    poller: Poller,
}

/// QPs accepted for one session of a peer (kept alive, never posted to).
#[derive(Debug)]
struct Accepted {
    _qps: Vec<Qp>,
    _cqs: Vec<Arc<Cq>>,
}

/// A GPU's PCI position and NUMA node.
type GpuPlace = (Option<PciPath>, Option<u32>);

/// A region's registration on each NIC, or why it has none there.
type Registrations = Vec<std::result::Result<Arc<MemoryRegion>, String>>;

/// The engine's RDMA state.
#[derive(Debug)]
pub(crate) struct Runtime {
    config: RdmaConfig,
    nics: Vec<Nic>,
    mrs: Mutex<MrCache<Arc<MemoryRegion>>>,
    accepted: Mutex<Sessions<Accepted>>,
    /// GPU ordinal → its PCI position and NUMA node, for choosing NICs.
    gpus: Mutex<HashMap<u32, GpuPlace>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Runtime {
    /// Opens the usable ports, or says why there are none.
    pub(crate) fn open(config: &RdmaConfig) -> std::result::Result<Runtime, String> {
        if !config.enabled {
            return Err("RDMA is turned off in this engine's configuration".into());
        }
        config.validate().map_err(|e| e.to_string())?;
        let names = verbs::device_names();
        if names.is_empty() {
            return Err(
                "libibverbs lists no RDMA devices (no RDMA NIC or soft-RoCE here, or \
                        /dev/infiniband is not mounted into this container)"
                    .into(),
            );
        }
        let root = &config.sysfs_root;
        let nics = sysfs::nics(root).map_err(|e| format!("reading sysfs: {e}"))?;
        let alloc = allocation::allocation(root, std::env::vars())
            .map_err(|e| format!("reading the pod's device allocation: {e}"))?;
        let usable = select::usable_ports(&nics, &config.devices, alloc.restriction(), config.gid);
        let mut skipped = usable.skipped.clone();
        let mut opened: Vec<Nic> = Vec::new();
        for p in usable.ports {
            if opened.iter().any(|n| n.info.name == p.nic) {
                skipped.push(format!(
                    "{} port {}: one port per device is used",
                    p.nic, p.port
                ));
                continue;
            }
            if !names.contains(&p.nic) {
                skipped.push(format!("{}: not listed by libibverbs", p.nic));
                continue;
            }
            let sys = nics
                .iter()
                .find(|n| n.name == p.nic)
                .expect("usable ports come from nics");
            match Self::open_port(root, sys, &p) {
                Ok(nic) => opened.push(nic),
                Err(e) => skipped.push(format!("{} port {}: {e}", p.nic, p.port)),
            }
        }
        if opened.is_empty() {
            return Err(format!(
                "no usable RDMA port ({})",
                if skipped.is_empty() {
                    "sysfs lists none".to_string()
                } else {
                    skipped.join("; ")
                }
            ));
        }
        for s in &skipped {
            debug!(skipped = %s, "rdma port not used");
        }
        info!(
            nics = %opened.iter().map(|n| format!("{}:{} ({})", n.info.name, n.port, n.info.gid)).collect::<Vec<_>>().join(", "),
            "rdma ready"
        );
        Ok(Runtime {
            config: config.clone(),
            nics: opened,
            mrs: Mutex::default(),
            accepted: Mutex::default(),
            gpus: Mutex::default(),
        })
    }

    fn open_port(root: &std::path::Path, sys: &sysfs::Nic, p: &select::UsablePort) -> Result<Nic> {
        let port = u8::try_from(p.port).map_err(|_| Error::RdmaPort {
            device: p.nic.clone(),
            port: p.port,
            reason: "port number above 255".into(),
        })?;
        let ctx = Context::open(&p.nic)?;
        let attr = ctx.query_port(port)?;
        if !attr.state.is_active() {
            return Err(Error::RdmaPort {
                device: p.nic.clone(),
                port: p.port,
                reason: format!("verbs reports the port {}", attr.state),
            });
        }
        let pd = ctx.alloc_pd()?;
        let cpus = sys
            .numa_node
            .and_then(|n| topology::numa_cpus(root, n))
            .unwrap_or_default();
        let rate_gbps = sys
            .port(p.port)
            .and_then(|pp| pp.rate.as_deref())
            .and_then(crate::rdma::parse_rate_gbps);
        Ok(Nic {
            info: RdmaNicInfo {
                name: p.nic.clone(),
                port: p.port,
                link_layer: attr.link_layer.to_string(),
                gid_index: p.gid.index,
                gid: format!("{} {}", p.gid.gid, p.gid_reason),
                numa_node: sys.numa_node,
                rate_gbps,
            },
            port,
            gid_index: p.gid.index,
            gid: p.gid.gid,
            link_layer: attr.link_layer,
            place: NicPlace::from(sys),
            pd,
            poller: Poller::new(p.nic.clone(), cpus),
        })
    }

    pub(crate) fn nics(&self) -> Vec<RdmaNicInfo> {
        self.nics.iter().map(|n| n.info.clone()).collect()
    }

    /// The registration of `region` on NIC `nic` (made now if needed). `live` says whether the
    /// region is still registered with the engine.
    fn mr(
        &self,
        region: &Arc<Region>,
        nic: usize,
        live: impl FnOnce() -> bool,
    ) -> std::result::Result<Arc<MemoryRegion>, String> {
        let pd = &self.nics[nic].pd;
        let lookup = lock(&self.mrs).get_or_register(
            region.id(),
            nic,
            || {
                pd.register(region.clone())
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            },
            live,
        );
        match lookup {
            Lookup::Cached(m) => Ok(m),
            Lookup::New(m) => {
                debug!(region = %region.id(), nic = %self.nics[nic].info.name, kind = ?m.kind(), rkey = m.rkey(), "memory registered for rdma");
                Ok(m)
            }
            Lookup::FailedNow(why) => {
                warn!(region = %region.id(), nic = %self.nics[nic].info.name, %why, "memory cannot be registered for rdma; peers cannot reach it through this NIC");
                Err(why)
            }
            Lookup::Failed(why) => Err(why),
        }
    }

    /// The rkeys of `region` on every NIC it could be registered with (what the descriptor
    /// publishes). Failures are logged once, when they happen.
    pub(crate) fn keys(&self, region: &Arc<Region>, live: impl Fn() -> bool) -> Vec<RdmaKey> {
        (0..self.nics.len())
            .filter_map(|nic| self.mr(region, nic, &live).ok().map(|m| m.key()))
            .collect()
    }

    /// Drops the registrations of a deregistered region (after its last local use).
    pub(crate) fn forget(&self, region: RegionId) {
        let gone = lock(&self.mrs).forget(region);
        drop(gone);
    }

    /// Where memory at `location` sits, for choosing NICs.
    fn place(&self, location: Location) -> MemoryPlace {
        match location {
            Location::Host { numa } => MemoryPlace::Host { numa },
            Location::Cuda { device } => {
                let mut gpus = lock(&self.gpus);
                if gpus.is_empty() {
                    let root = &self.config.sysfs_root;
                    for g in crate::cuda::devices().unwrap_or_default() {
                        let bus = sysfs::normalize_pci_address(&g.pci_bus_id);
                        let pci = bus.as_deref().and_then(|b| sysfs::pci_path(root, b));
                        let numa = bus.as_deref().and_then(|b| sysfs::pci_numa_node(root, b));
                        gpus.insert(g.ordinal, (pci, numa));
                    }
                }
                let (pci, numa) = gpus.get(&device).cloned().unwrap_or((None, None));
                MemoryPlace::Gpu { pci, numa }
            }
        }
    }

    /// The target side of the exchange: QPs for every QP `peer` offers, connected to them, and
    /// this end's answer. Replaces the QPs of the same session (the peer rebuilt its link).
    pub(crate) fn accept(&self, peer: &str, offer: &ConnectInfo) -> Result<ConnectInfo> {
        offer.validate(peer)?;
        let layers: Vec<LinkLayer> = self.nics.iter().map(|n| n.link_layer.clone()).collect();
        let map = answer_nics(offer, &layers);
        // The target posts nothing: a minimal send queue, the READ depth it serves.
        let params = QpParams {
            sq_depth: 1,
            ..self.config.qp
        };
        let mut cqs: HashMap<usize, Arc<Cq>> = HashMap::new();
        let mut qps = Vec::with_capacity(offer.qps.len());
        let mut infos = Vec::with_capacity(offer.qps.len());
        for (remote, &nic) in offer.qps.iter().zip(&map) {
            let n = &self.nics[nic];
            let cq = match cqs.get(&nic) {
                Some(cq) => cq.clone(),
                None => {
                    let cq = n.pd.context().create_cq(16)?;
                    cqs.insert(nic, cq.clone());
                    cq
                }
            };
            let mut qp = Qp::create(&n.pd, &cq, n.port, &params)?;
            let info = qp.info(n.gid)?;
            let route = negotiate(peer, &info, remote)?;
            qp.connect(&route, n.gid_index)?;
            infos.push(info);
            qps.push(qp);
        }
        let answer = ConnectInfo::new(infos).with_session(offer.session);
        let gone = lock(&self.accepted).accept(
            peer,
            offer.session,
            Accepted {
                _qps: qps,
                _cqs: cqs.into_values().collect(),
            },
        );
        if gone.iter().any(|(s, _)| *s != offer.session) {
            warn!(%peer, "rdma: too many sessions from one peer; the oldest was closed");
        }
        drop(gone);
        debug!(%peer, session = offer.session, qps = answer.qps.len(), "rdma connection accepted");
        Ok(answer)
    }

    pub(crate) fn release(&self, peer: &str, session: u64) -> bool {
        let gone = lock(&self.accepted).release(peer, session);
        gone.is_some()
    }
}

// ---- completion pollers ----

#[derive(Debug)]
struct Slot {
    cq: Arc<Cq>,
    link: Weak<LinkShared>,
    nic: usize,
}

#[derive(Debug)]
struct PollShared {
    nic: String,
    cpus: Vec<usize>,
    stop: AtomicBool,
    slots: Mutex<Vec<Slot>>,
    wake: Condvar,
    version: AtomicU64,
}

/// One thread per NIC polls the completion queues of every link on that NIC, pinned to the
/// NIC's NUMA node. Started with the first link.
#[derive(Debug)]
struct Poller {
    shared: Arc<PollShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Poller {
    fn new(nic: String, cpus: Vec<usize>) -> Poller {
        Poller {
            shared: Arc::new(PollShared {
                nic,
                cpus,
                stop: AtomicBool::new(false),
                slots: Mutex::default(),
                wake: Condvar::new(),
                version: AtomicU64::new(0),
            }),
            thread: Mutex::new(None),
        }
    }

    fn add(&self, cq: Arc<Cq>, link: Weak<LinkShared>, nic: usize) -> Result<()> {
        lock(&self.shared.slots).push(Slot { cq, link, nic });
        self.shared.version.fetch_add(1, Ordering::AcqRel);
        self.shared.wake.notify_all();
        let mut thread = lock(&self.thread);
        if thread.is_none() {
            let shared = self.shared.clone();
            *thread = Some(
                std::thread::Builder::new()
                    .name(format!("kvf-rdma-cq-{}", shared.nic))
                    .spawn(move || poll_loop(&shared))
                    .map_err(|e| Error::io("start the rdma completion poller", e))?,
            );
        }
        Ok(())
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            // The last link (and with it the engine's RDMA state) may go away on the poller
            // thread itself: it then just ends.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn poll_loop(shared: &PollShared) {
    if let Err(e) = verbs::pin_current_thread(&shared.cpus) {
        warn!(nic = %shared.nic, %e, "rdma completion poller not pinned to its NUMA node");
    }
    let mut local: Vec<(Arc<Cq>, Weak<LinkShared>, usize)> = Vec::new();
    let mut seen = u64::MAX;
    let mut out = Vec::with_capacity(32);
    let mut idle = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        let v = shared.version.load(Ordering::Acquire);
        if v != seen {
            let mut slots = lock(&shared.slots);
            slots.retain(|s| s.link.strong_count() > 0);
            if slots.is_empty() {
                // Nothing to poll: sleep until a link arrives.
                let _ = shared
                    .wake
                    .wait_timeout(slots, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner());
                local.clear();
                seen = u64::MAX;
                continue;
            }
            local = slots
                .iter()
                .map(|s| (s.cq.clone(), s.link.clone(), s.nic))
                .collect();
            seen = v;
        }
        let mut any = false;
        for (cq, link, nic) in &local {
            let Some(link) = link.upgrade() else {
                // The link is gone: prune it on the next round.
                shared.version.fetch_add(1, Ordering::AcqRel);
                continue;
            };
            out.clear();
            match cq.poll(&mut out, 32) {
                Ok(0) => {}
                Ok(_) => {
                    any = true;
                    for c in out.drain(..) {
                        link.on_completion(*nic, c);
                    }
                }
                Err(e) => {
                    warn!(nic = %shared.nic, %e, "polling a completion queue failed");
                }
            }
        }
        if any {
            idle = 0;
        } else {
            // Busy-poll briefly, then back off so an idle NIC costs no core.
            idle = idle.saturating_add(1);
            if idle > 1024 {
                std::thread::sleep(Duration::from_micros(if idle > 200_000 { 500 } else { 50 }));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

// ---- the initiator's link ----

/// One WR's worth of a batch.
#[derive(Debug)]
struct WrItem {
    job: Arc<Job>,
    /// Registered on the lane's NIC.
    local: Arc<MemoryRegion>,
    local_offset: u64,
    /// Keyed for the lane's remote NIC.
    remote: RemoteMemory,
    remote_offset: u64,
    len: u32,
}

impl LaneItem for WrItem {
    fn cancelled(&self) -> bool {
        self.job.is_cancelled()
    }
}

#[derive(Debug)]
struct LaneCore {
    // Declared first: the QP is destroyed (the device stops touching memory) before the work
    // (and the memory registrations and leases it holds) is dropped.
    qp: Qp,
    remote_nic: String,
    state: LaneState<WrItem>,
}

#[derive(Debug)]
struct LaneSlot {
    /// Index into the runtime's NICs.
    nic: usize,
    /// The QP's number among this NIC's QPs of the link.
    k: usize,
    core: Mutex<LaneCore>,
}

#[derive(Debug)]
struct LinkShared {
    peer: String,
    session: u64,
    runtime: Arc<Runtime>,
    exchange: Arc<dyn RdmaExchange>,
    descriptor: RwLock<SegmentDescriptor>,
    lanes: Vec<LaneSlot>,
    /// (NIC, QP number) → lane.
    by_qpn: HashMap<(usize, u32), usize>,
    /// Lock order: a lane's core, then the phase.
    phase: Mutex<LinkPhase>,
    bytes: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct RdmaLink {
    shared: Arc<LinkShared>,
}

impl RdmaLink {
    /// Creates the QPs, exchanges them with the peer and connects them. Blocking.
    pub(crate) fn connect(
        runtime: Arc<Runtime>,
        remote: &SegmentDescriptor,
        exchange: Arc<dyn RdmaExchange>,
    ) -> Result<RdmaLink> {
        let peer = remote.name.clone();
        let cfg = &runtime.config;
        let per = cfg.qps_per_peer;
        let mut cqs = Vec::with_capacity(runtime.nics.len());
        for n in &runtime.nics {
            // Every WR of every QP may complete (an error flushes unsignaled WRs too), and a
            // provider may leave a reset QP's flushes in the queue: room for twice that.
            let entries = (2 * per as u32)
                .saturating_mul(cfg.qp.sq_depth)
                .saturating_add(64);
            cqs.push(n.pd.context().create_cq(entries)?);
        }
        let mut qps = Vec::new();
        for l in plan::lanes(runtime.nics.len(), per) {
            let n = &runtime.nics[l.nic];
            let qp = Qp::create(&n.pd, &cqs[l.nic], n.port, &cfg.qp)?;
            qps.push((l, qp));
        }
        let infos = qps
            .iter()
            .map(|(l, qp)| qp.info(runtime.nics[l.nic].gid))
            .collect::<Result<Vec<_>>>()?;
        let session = rand::random::<u64>() | 1;
        let offer = ConnectInfo::new(infos).with_session(session);
        let answer = exchange.exchange(&offer)?;
        check_answer(&peer, &offer, &answer)?;
        let routes = pair(&peer, &offer.qps, &answer)?;
        let mut lanes = Vec::with_capacity(qps.len());
        let mut by_qpn = HashMap::new();
        for (((l, mut qp), route), far) in qps.into_iter().zip(&routes).zip(&answer.qps) {
            qp.connect(route, runtime.nics[l.nic].gid_index)?;
            by_qpn.insert((l.nic, qp.qpn()), lanes.len());
            let state = LaneState::new(
                qp.name(),
                qp.params().sq_depth,
                cfg.plan.signal_every,
                cfg.plan.max_wrs_per_post,
            );
            lanes.push(LaneSlot {
                nic: l.nic,
                k: l.qp,
                core: Mutex::new(LaneCore {
                    qp,
                    remote_nic: far.nic.clone(),
                    state,
                }),
            });
        }
        let shared = Arc::new(LinkShared {
            peer: peer.clone(),
            session,
            exchange,
            descriptor: RwLock::new(remote.clone()),
            lanes,
            by_qpn,
            phase: Mutex::new(LinkPhase::new(PeerHealth::new(peer.clone(), cfg.retry))),
            bytes: AtomicU64::new(0),
            runtime: runtime.clone(),
        });
        for (nic, cq) in cqs.into_iter().enumerate() {
            runtime.nics[nic]
                .poller
                .add(cq, Arc::downgrade(&shared), nic)?;
        }
        info!(
            %peer,
            qps = shared.lanes.len(),
            mtu = %routes.first().map(|r| r.mtu.to_string()).unwrap_or_default(),
            "rdma connected"
        );
        Ok(RdmaLink { shared })
    }
}

fn check_answer(peer: &str, offer: &ConnectInfo, answer: &ConnectInfo) -> Result<()> {
    if answer.session != offer.session {
        return Err(Error::BadHandshake {
            peer: peer.into(),
            field: "session",
            value: answer.session.to_string(),
            reason: "the answer is for another offer",
        });
    }
    Ok(())
}

impl LinkShared {
    fn fallback(&self) -> Option<String> {
        lock(&self.phase).fallback().map(str::to_string)
    }

    fn fallback_error(&self, reason: String) -> Error {
        Error::RdmaFallback {
            peer: self.peer.clone(),
            reason,
        }
    }

    /// Turns the pieces into WRs per lane. Local memory picks the NICs (closest first); a lane
    /// is usable when its NIC has the local regions registered and its peer NIC has keys for
    /// the remote regions.
    fn plan(&self, pieces: &[Piece], job: &Arc<Job>) -> Result<Vec<(usize, Vec<WrItem>)>> {
        let rt = &self.runtime;
        let descriptor = self.descriptor.read().unwrap_or_else(|e| e.into_inner());
        // Local regions of the batch and their registrations per NIC.
        let mut locals: Vec<(RegionId, Registrations)> = Vec::new();
        // A batch may span many regions (one per layer): each is looked at once.
        let (mut local_seen, mut remote_seen) = (RegionIndex::default(), RegionIndex::default());
        let mut location = None;
        for p in pieces {
            location = match location {
                None => Some(p.location),
                Some(l) if l == p.location => Some(l),
                // Memory in several places: no NIC is closer than another.
                Some(_) => Some(Location::Host { numa: None }),
            };
            if !local_seen.number(p.local_region).1 {
                continue;
            }
            let region = job
                .regions()
                .find(|r| r.id() == p.local_region)
                .ok_or(Error::UnknownRegion {
                    region: p.local_region,
                    side: Side::Local,
                })?
                .clone();
            let mrs = (0..rt.nics.len())
                .map(|nic| rt.mr(&region, nic, || true))
                .collect();
            locals.push((p.local_region, mrs));
        }
        // Remote regions: their descriptor entries, the key checked.
        let mut remotes: Vec<&crate::segment::RegionDesc> = Vec::new();
        for p in pieces {
            if !remote_seen.number(p.remote.region).1 {
                continue;
            }
            let r = descriptor
                .region(p.remote.region)
                .ok_or(Error::UnknownRegion {
                    region: p.remote.region,
                    side: Side::Remote,
                })?;
            if r.key != p.remote.key {
                return Err(Error::WrongKey {
                    region: r.id,
                    side: Side::Remote,
                });
            }
            remotes.push(r);
        }
        let remote_nics: Vec<String> = self
            .lanes
            .iter()
            .map(|l| lock(&l.core).remote_nic.clone())
            .collect();
        let usable = |lane: usize| -> std::result::Result<(), String> {
            let nic = self.lanes[lane].nic;
            for (id, mrs) in &locals {
                if let Err(why) = &mrs[nic] {
                    return Err(format!(
                        "local region {id} is not registered on {}: {why}",
                        rt.nics[nic].info.name
                    ));
                }
            }
            for r in &remotes {
                if !r.rdma.iter().any(|k| k.nic == remote_nics[lane]) {
                    return Err(format!(
                        "peer region {} has no rdma key for its NIC {}",
                        r.id, remote_nics[lane]
                    ));
                }
            }
            Ok(())
        };
        let places: Vec<NicPlace> = rt.nics.iter().map(|n| n.place.clone()).collect();
        let place = rt.place(location.unwrap_or(Location::Host { numa: None }));
        let close: Vec<usize> = topology::choose_nics(&places, &place)
            .map(|c| c.nics)
            .unwrap_or_default();
        let mut why_not = Vec::new();
        let mut chosen: Vec<usize> = (0..self.lanes.len())
            .filter(|&l| close.contains(&self.lanes[l].nic))
            .filter(|&l| usable(l).map_err(|e| why_not.push(e)).is_ok())
            .collect();
        if chosen.is_empty() {
            chosen = (0..self.lanes.len())
                .filter(|&l| usable(l).map_err(|e| why_not.push(e)).is_ok())
                .collect();
        }
        if chosen.is_empty() {
            why_not.dedup();
            return Err(Error::TransportUnavailable {
                transport: TransportKind::Rdma,
                segment: self.peer.clone(),
                reason: format!(
                    "no QP reaches every region of the batch: {}",
                    why_not.join("; ")
                ),
            });
        }
        let lanes: Vec<Lane> = chosen
            .iter()
            .map(|&l| Lane {
                nic: self.lanes[l].nic,
                qp: self.lanes[l].k,
            })
            .collect();
        let ops: Vec<Coalesced> = pieces
            .iter()
            .map(|p| Coalesced {
                op: BlockOp {
                    local_region: p.local_region,
                    local_offset: p.local_offset,
                    remote_region: p.remote.region,
                    remote_offset: p.remote.offset,
                    len: p.remote.len,
                },
                first_index: p.op,
            })
            .collect();
        let planned = plan::plan(&ops, &lanes, &rt.config.plan)?;
        let mut out = Vec::with_capacity(planned.lanes.len());
        for lp in planned.lanes {
            let lane = chosen
                .iter()
                .copied()
                .find(|&l| self.lanes[l].nic == lp.lane.nic && self.lanes[l].k == lp.lane.qp)
                .expect("planned lanes are chosen lanes");
            let nic = self.lanes[lane].nic;
            let items = lp
                .wrs
                .iter()
                .map(|w| {
                    let s = w.slice;
                    let local = locals
                        .iter()
                        .find(|(id, _)| *id == s.local_region)
                        .and_then(|(_, mrs)| mrs[nic].as_ref().ok())
                        .expect("usable lanes have every local registration")
                        .clone();
                    let r = remotes
                        .iter()
                        .find(|r| r.id == s.remote_region)
                        .expect("looked up above");
                    let key = r
                        .rdma
                        .iter()
                        .find(|k| k.nic == remote_nics[lane])
                        .expect("usable lanes have every remote key");
                    WrItem {
                        job: job.clone(),
                        local,
                        local_offset: s.local_offset,
                        remote: RemoteMemory {
                            region: r.id,
                            addr: key.addr,
                            rkey: key.rkey,
                            len: r.len,
                        },
                        remote_offset: s.remote_offset,
                        len: s.len as u32,
                    }
                })
                .collect();
            out.push((lane, items));
        }
        Ok(out)
    }

    /// Posts what the lane's credits allow. True when posting failed and the link needs a
    /// rebuild.
    fn pump(&self, core: &mut LaneCore) -> bool {
        loop {
            let n = core.state.take_chain();
            if n == 0 {
                return false;
            }
            let posted = {
                let LaneCore { qp, state, .. } = &mut *core;
                let chain: Vec<verbs::WorkRequest<'_>> = state
                    .posted(n)
                    .map(|(wr_id, signaled, it)| verbs::WorkRequest {
                        wr_id,
                        opcode: it.job.opcode,
                        local: &it.local,
                        local_offset: it.local_offset,
                        remote: it.remote,
                        remote_offset: it.remote_offset,
                        len: it.len,
                        signaled,
                    })
                    .collect();
                qp.post(&chain)
            };
            if let Err(e) = posted {
                warn!(peer = %self.peer, %e, "rdma post failed; rebuilding the connection");
                core.state.post_failed();
                return true;
            }
        }
    }

    fn on_completion(self: &Arc<Self>, nic: usize, c: Completion) {
        let Some(&lane) = self.by_qpn.get(&(nic, c.qp_num)) else {
            return;
        };
        let (out, rebuild, qp_name) = {
            let mut core = lock(&self.lanes[lane].core);
            let out = {
                let mut phase = lock(&self.phase);
                core.state
                    .on_completion(c.wr_id, c.status, c.vendor_err, phase.health())
            };
            let mut rebuild = out.rebuild;
            if !rebuild && !core.state.is_broken() {
                rebuild = self.pump(&mut core);
            }
            (out, rebuild, core.qp.name())
        };
        for it in out.done {
            self.bytes.fetch_add(it.len.into(), Ordering::Relaxed);
            it.job.piece_done(it.len.into());
        }
        let mut fallback = None;
        for (it, why) in out.failed {
            match why {
                Failure::Refused(reason) => {
                    warn!(peer = %self.peer, qp = %qp_name, %reason, "rdma request refused; the batch fails");
                    it.job.piece_failed(Error::Verbs {
                        call: "rdma work completion",
                        device: qp_name.clone(),
                        reason,
                    })
                }
                Failure::Fallback(reason) => {
                    it.job.piece_failed(self.fallback_error(reason.clone()));
                    fallback = Some(reason);
                }
            }
        }
        if let Some(reason) = fallback {
            self.fail_everything(reason);
        } else if rebuild {
            if c.status != crate::rdma::WcStatus::Success {
                warn!(peer = %self.peer, qp = %qp_name, status = %c.status, vendor_err = format!("{:#x}", c.vendor_err), "rdma completion failed; rebuilding the connection");
            }
            self.start_rebuild();
        }
    }

    /// RDMA to the peer is given up: every piece of work fails with the reason.
    fn fail_everything(&self, reason: String) {
        lock(&self.phase).fall_back(reason.clone());
        self.stop_all(|| self.fallback_error(reason.clone()));
    }

    /// Stops every QP (the device touches no memory of ours after a reset) and fails all work
    /// with `error`.
    fn stop_all(&self, error: impl Fn() -> Error) {
        for l in &self.lanes {
            let items = {
                let mut core = lock(&l.core);
                if let Err(e) = core.qp.reset() {
                    warn!(peer = %self.peer, %e, "rdma QP reset failed");
                }
                core.state.drain()
            };
            for it in items {
                it.job.piece_failed(error());
            }
        }
    }

    fn start_rebuild(self: &Arc<Self>) {
        let start = {
            let mut phase = lock(&self.phase);
            let start = phase.begin_rebuild();
            if !start && let Some(r) = phase.fallback() {
                let r = r.to_string();
                drop(phase);
                self.fail_everything(r);
                return;
            }
            start
        };
        if !start {
            return;
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("kvf-rdma-rebuild".into())
            .spawn(move || me.rebuild_loop());
        if let Err(e) = spawned {
            let reason = format!(
                "rdma to {} failed: cannot start a rebuild thread ({e}); falling back to tcp",
                self.peer
            );
            self.fail_everything(reason);
        }
    }

    fn rebuild_loop(self: &Arc<Self>) {
        let mut pause = Duration::from_millis(10);
        loop {
            match self.rebuild_once() {
                Ok(()) => {
                    lock(&self.phase).rebuilt();
                    info!(peer = %self.peer, "rdma connection rebuilt");
                    let mut again = false;
                    for l in &self.lanes {
                        let mut core = lock(&l.core);
                        again |= self.pump(&mut core);
                    }
                    if again {
                        self.start_rebuild();
                    }
                    return;
                }
                Err(e) => {
                    let after = lock(&self.phase).rebuild_failed(&e.to_string());
                    match after {
                        AfterFailure::Retry => {
                            warn!(peer = %self.peer, %e, "rdma rebuild failed; trying again");
                            std::thread::sleep(pause);
                            pause = (pause * 2).min(Duration::from_secs(1));
                        }
                        AfterFailure::Fallback(reason) => {
                            self.fail_everything(reason);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Resets every QP, exchanges them with the peer again and reconnects them.
    fn rebuild_once(&self) -> Result<()> {
        let rt = &self.runtime;
        let mut infos = Vec::with_capacity(self.lanes.len());
        for l in &self.lanes {
            let mut core = lock(&l.core);
            core.state.begin_rebuild();
            core.qp.reset()?;
            infos.push(core.qp.info(rt.nics[l.nic].gid)?);
        }
        let offer = ConnectInfo::new(infos).with_session(self.session);
        let answer = self.exchange.exchange(&offer)?;
        check_answer(&self.peer, &offer, &answer)?;
        let routes = pair(&self.peer, &offer.qps, &answer)?;
        let descriptor = self
            .descriptor
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for ((l, route), far) in self.lanes.iter().zip(&routes).zip(&answer.qps) {
            let mut core = lock(&l.core);
            core.qp.connect(route, rt.nics[l.nic].gid_index)?;
            if core.remote_nic != far.nic {
                // The peer answers from another NIC now: key the waiting work for it.
                for it in core.state.backlog_mut() {
                    if let Some(k) = descriptor
                        .region(it.remote.region)
                        .and_then(|r| r.rdma.iter().find(|k| k.nic == far.nic))
                    {
                        it.remote.addr = k.addr;
                        it.remote.rkey = k.rkey;
                    }
                }
                core.remote_nic = far.nic.clone();
            }
            core.state.rebuilt();
        }
        Ok(())
    }
}

impl Transport for RdmaLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn submit(&self, pieces: Vec<Piece>, job: Arc<Job>) {
        let s = &self.shared;
        if let Some(reason) = s.fallback() {
            job.fail(s.fallback_error(reason));
            return;
        }
        let per_lane = match s.plan(&pieces, &job) {
            Ok(p) => p,
            Err(e) => {
                job.fail(e);
                return;
            }
        };
        job.expect_pieces(per_lane.iter().map(|(_, items)| items.len()).sum());
        let mut rebuild = false;
        for (lane, items) in per_lane {
            let mut core = lock(&s.lanes[lane].core);
            core.state.push(items);
            if !core.state.is_broken() {
                rebuild |= s.pump(&mut core);
            }
        }
        if rebuild {
            s.start_rebuild();
        }
    }

    fn stats(&self) -> TransportStats {
        TransportStats {
            connections: self.shared.lanes.len(),
            bytes: self.shared.bytes.load(Ordering::Relaxed),
            resident_kernels: 0,
        }
    }

    fn regions_changed(&self, descriptor: &SegmentDescriptor) {
        *self
            .shared
            .descriptor
            .write()
            .unwrap_or_else(|e| e.into_inner()) = descriptor.clone();
    }
}

impl Drop for RdmaLink {
    fn drop(&mut self) {
        // Work still queued belongs to batches nobody waits for any more (or that are failing):
        // stop the QPs and fail it, so no job waits for a link that is going away.
        self.shared.stop_all(|| Error::ShuttingDown);
    }
}
