//! The agent's state: its engine, the segments its workers registered, and its data connections
//! to other agents (opened through their peer API, cached, re-opened after a failure).

use crate::inbox::{Inbox, Notification};
use kvfabric_proto::contract::FABRIC_KEY;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use kvfabric_engine::{
    AccessKey, Batch, BatchOps, BlockOp, CudaExport, DataSecret, Engine, IpcHandle, Location,
    Opcode, Peer, Preference, Region, RegionDesc, RegionId, SegmentDescriptor, TransportKind,
};
use serde::Serialize;
use tracing::{Instrument, debug, field, info, info_span, warn};

use crate::error::{Error, Result};
use crate::fd_stash::FdStash;
use crate::holds::{self, Grant, GrantPlane, GrantSlot, Grants, Holds, Unusable};
use crate::metrics::{LinkLabels, SharedMetrics, TransportLabels};
use crate::peer_link;
use crate::peer_tls::PeerTls;
use crate::peer_token::PeerToken;
use crate::registry::{AgentEntry, SegmentEntry, SegmentRegion, SharedRegistry};
use crate::telemetry;

/// Most regions one segment may hold.
pub(crate) const MAX_REGIONS: usize = 4096;

/// What the agent was configured with.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub name: String,
    pub fabric: String,
    pub pool: String,
    /// Transports this agent may use, in order of preference.
    pub transports: Vec<TransportKind>,
    /// The address peers reach this agent's data plane and peer API at.
    pub advertise: IpAddr,
    pub batch_timeout: Duration,
    pub max_batch_ops: usize,
    /// How long dialling a peer agent may take.
    pub connect_timeout: Duration,
    /// Presented to other agents' peer API and required of callers of ours.
    pub peer_token: Option<PeerToken>,
    /// mTLS to other agents' peer API (None: plain TCP).
    pub tls: Option<Arc<PeerTls>>,
}

/// Memory a worker registered: its regions in this agent's engine, under the worker's key.
#[derive(Debug)]
pub struct LocalSegment {
    pub name: String,
    pub key: AccessKey,
    pub regions: Vec<Arc<Region>>,
    /// Whether agents of the fabric may reach it for their workers with [`FABRIC_KEY`].
    pub fabric_access: bool,
    /// Messages for its registrant (LocalAgent.Notify), freed with it.
    pub inbox: Inbox,
}

impl LocalSegment {
    /// Whether `key` may reach the segment: its own, or [`FABRIC_KEY`] when it is open to the
    /// fabric (the caller is a worker of this node, or an agent the peer API admitted).
    fn admits(&self, key: u64) -> bool {
        self.key == AccessKey(key) || (self.fabric_access && key == FABRIC_KEY)
    }
}

impl LocalSegment {
    /// What the registry publishes of it, served by `agent`.
    fn entry(&self, agent: &str) -> SegmentEntry {
        SegmentEntry {
            name: self.name.clone(),
            agent: agent.into(),
            regions: self
                .regions
                .iter()
                .map(|r| SegmentRegion {
                    id: r.id(),
                    len: r.len(),
                    location: r.location(),
                })
                .collect(),
        }
    }
}

/// One data connection to another agent's engine, over one transport.
#[derive(Debug)]
pub struct Link {
    pub agent: String,
    pub peer: Peer,
    pub reason: String,
    pub batches: AtomicU64,
    pub errors: AtomicU64,
    pub opened: Instant,
    /// The peer agent this link reached: a restarted agent (another start time or address in
    /// the registry) has other regions and another data secret, so the link is dropped.
    peer_instance: (u64, u64),
    peer_addr: SocketAddr,
    /// Segments whose regions the peer gave for a key, and that key.
    learned: tokio::sync::Mutex<HashMap<String, u64>>,
}

impl Link {
    fn reaches(&self, agent: &AgentEntry) -> bool {
        self.peer_instance == (agent.started_at, agent.instance)
            && self.peer_addr == agent.peer_addr
    }
}

/// A registration request, decoded from whichever API carried it.
#[derive(Debug)]
pub enum RegionSource {
    Host {
        fd_token: u64,
    },
    Cuda {
        device: u32,
        ipc_handle: Vec<u8>,
        offset: u64,
        len: u64,
    },
}

/// A registration's memory, its fds taken from the stash.
#[derive(Debug)]
enum Memory {
    Host(OwnedFd),
    Cuda {
        device: u32,
        ipc_handle: Vec<u8>,
        offset: u64,
        len: u64,
    },
}

/// What a registration did.
#[derive(Debug)]
pub struct Registered {
    pub segment: Arc<LocalSegment>,
    /// In the registry now; false while the registry is unreachable (published when it is back).
    pub published: bool,
}

/// A transfer request, decoded.
#[derive(Debug, Clone)]
pub struct Transfer {
    pub local_segment: String,
    pub local_key: u64,
    pub remote_segment: String,
    pub remote_key: u64,
    pub opcode: Opcode,
    /// Ops or a block table; region fields are indexes into the segments' region lists.
    pub ops: BatchOps,
    pub timeout: Option<Duration>,
    pub checksum: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct TransferResult {
    pub bytes: u64,
    pub ops: usize,
    pub coalesced_ops: usize,
    pub transport: TransportKind,
    pub transport_reason: String,
    pub elapsed: Duration,
    pub remote_agent: String,
}

#[derive(Debug)]
pub struct Node {
    pub config: NodeConfig,
    pub engine: Engine,
    pub registry: SharedRegistry,
    pub metrics: SharedMetrics,
    /// Where this agent's peer API listens (what its registry entry advertises).
    pub peer_addr: SocketAddr,
    segments: RwLock<HashMap<String, Arc<LocalSegment>>>,
    /// Held by each registration and deregistration.
    registrations: tokio::sync::Mutex<()>,
    /// Memfds handed over on the fd socket, waiting for their RegisterSegment.
    pub fds: FdStash,
    links: tokio::sync::Mutex<HashMap<(String, TransportKind), Arc<Link>>>,
    /// One gate per peer agent, held while dialling it.
    dialing: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Bytes moved through links that have since been closed, so totals never go backwards.
    closed_bytes: AtomicU64,
    /// Peer agents RDMA was given up for (the engine's retry policy failed it), with why: their
    /// links are re-opened over the next allowed transport and say so.
    rdma_given_up: Mutex<HashMap<String, String>>,
    /// Holds on the segments registered here (this agent hands out their grants).
    pub holds: Holds,
    /// Grants other agents (or this one) handed this agent for its workers' batches.
    pub grants: Grants,
    /// This agent's own registry entry, as published: it stays resolvable while a lost lease
    /// took it out of the registry's view (a batch between this agent's own segments, a hold
    /// it revokes on itself).
    own: OnceLock<AgentEntry>,
}

/// A plane of a CreateHold request: block `i` is `block_bytes` at `base + i × stride` of the
/// segment's region `region` (an index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldPlane {
    pub region: u32,
    pub base: u64,
    pub stride: u64,
    pub block_bytes: u64,
}

/// What SegmentAccess answers: a segment's regions, and for a hold's key the grant and the
/// time it has left.
pub(crate) type SegmentAccess = (Vec<RegionDesc>, Option<(Arc<Grant>, Duration)>);

/// How a remote segment may be reached for a batch: with its key (all of it), or under a
/// hold's grant.
#[derive(Debug)]
enum Access {
    Full,
    Hold(Arc<GrantSlot>),
}

impl Node {
    pub fn new(
        config: NodeConfig,
        engine: Engine,
        registry: SharedRegistry,
        metrics: SharedMetrics,
        peer_addr: SocketAddr,
    ) -> Arc<Node> {
        Arc::new(Node {
            config,
            engine,
            registry,
            metrics,
            peer_addr,
            segments: RwLock::default(),
            registrations: tokio::sync::Mutex::default(),
            fds: FdStash::default(),
            links: tokio::sync::Mutex::default(),
            dialing: Mutex::default(),
            closed_bytes: AtomicU64::new(0),
            rdma_given_up: Mutex::default(),
            holds: Holds::default(),
            grants: Grants::default(),
            own: OnceLock::new(),
        })
    }

    /// Remembers the entry this agent publishes for itself (see [`Node::agent_entry`]).
    pub fn set_own_entry(&self, entry: AgentEntry) {
        // Set once, before the agent serves; a second call is the same agent's same entry.
        let _ = self.own.set(entry);
    }

    /// The agent entry named `name`: this agent's own as it published it, else the registry's.
    fn agent_entry(&self, name: &str) -> Option<AgentEntry> {
        match self.own.get() {
            Some(own) if own.name == name => Some(own.clone()),
            _ => self.registry.agent(name),
        }
    }

    /// The engine descriptor peers get from the handshake: data endpoints rewritten to the
    /// advertised address (the listener may be bound to 0.0.0.0).
    pub fn descriptor(&self) -> SegmentDescriptor {
        let mut d = self.engine.descriptor();
        if let Some(tcp) = d.endpoints.tcp.as_mut()
            && tcp.ip().is_unspecified()
        {
            tcp.set_ip(self.config.advertise);
        }
        d
    }

    pub fn local_segment(&self, name: &str, key: u64) -> Result<Arc<LocalSegment>> {
        let seg = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownSegment { name: name.into() })?;
        if seg.key != AccessKey(key) {
            return Err(Error::WrongKey { name: name.into() });
        }
        Ok(seg)
    }

    pub fn local_segments(&self) -> Vec<Arc<LocalSegment>> {
        let mut v: Vec<_> = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Maps the worker's memory, publishes the segment, and returns it with its key.
    /// Publishes a worker's memory as segment `name`. Every memfd the request names is taken
    /// from the stash first, so a refused request releases all of them at once. Registrations
    /// and deregistrations run one at a time, so the registry and this agent agree after any
    /// interleaving: a segment is in both or in neither, except while etcd is unreachable, when
    /// the registry remembers it and publishes it once etcd answers again (`published: false`).
    pub async fn register(
        &self,
        name: &str,
        sources: Vec<RegionSource>,
        key: u64,
        fabric_access: bool,
    ) -> Result<Registered> {
        if fabric_access && self.config.peer_token.is_none() && self.config.tls.is_none() {
            return Err(Error::invalid(
                "fabric_access",
                true,
                "this agent authenticates no peer (neither a peer token nor mTLS): a segment \
                 open to the fabric would be open to anyone reaching its peer port",
            ));
        }
        let mut memory = Vec::with_capacity(sources.len());
        for (i, source) in sources.into_iter().enumerate() {
            memory.push(match source {
                RegionSource::Host { fd_token } => Memory::Host(
                    self.fds
                        .take(fd_token, &format!("regions[{i}].host.fd_token"))?,
                ),
                RegionSource::Cuda {
                    device,
                    ipc_handle,
                    offset,
                    len,
                } => Memory::Cuda {
                    device,
                    ipc_handle,
                    offset,
                    len,
                },
            });
        }
        check_segment_name(name)?;
        if memory.is_empty() || memory.len() > MAX_REGIONS {
            return Err(Error::invalid(
                "regions",
                memory.len(),
                format!("a segment needs 1..={MAX_REGIONS} regions"),
            ));
        }
        let _one_at_a_time = self.registrations.lock().await;
        let held_here = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(name);
        match self.registry.segment(name) {
            // An entry naming this agent for a segment this process does not hold was left by
            // the agent's previous life (killed, its lease not yet expired): only this agent
            // serves under its name, so the worker's registration takes its place at once.
            Some(owner) if owner.agent == self.config.name && !held_here => {}
            Some(owner) => {
                return Err(Error::SegmentExists {
                    name: name.into(),
                    agent: owner.agent,
                });
            }
            None if held_here => {
                return Err(Error::SegmentExists {
                    name: name.into(),
                    agent: self.config.name.clone(),
                });
            }
            None => {}
        }
        let key = if key == 0 {
            AccessKey::random()
        } else {
            AccessKey(key)
        };
        let mut regions = Vec::with_capacity(memory.len());
        for (i, m) in memory.into_iter().enumerate() {
            match self.map_region(i, m, key) {
                Ok(r) => regions.push(r),
                Err(e) => {
                    self.drop_regions(&regions).await;
                    return Err(e);
                }
            }
        }
        let segment = Arc::new(LocalSegment {
            name: name.into(),
            key,
            regions,
            fabric_access,
            inbox: Inbox::default(),
        });
        let entry = segment.entry(&self.config.name);
        let published = match self.registry.put_segment(entry).await {
            Ok(()) => true,
            Err(e @ Error::RegistryUnavailable { .. }) => {
                warn!(segment = name, error = %e, "registry unreachable: the segment is published when it answers again");
                false
            }
            Err(e) => {
                self.drop_regions(&segment.regions).await;
                return Err(e);
            }
        };
        self.segments
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.into(), segment.clone());
        info!(
            segment = name,
            regions = segment.regions.len(),
            published,
            "segment registered"
        );
        Ok(Registered { segment, published })
    }

    fn map_region(&self, i: usize, memory: Memory, key: AccessKey) -> Result<Arc<Region>> {
        let r = match memory {
            Memory::Host(fd) => self.engine.register_memfd(fd, key),
            Memory::Cuda {
                device,
                ipc_handle,
                offset,
                len,
            } => {
                let handle: [u8; 64] = ipc_handle.as_slice().try_into().map_err(|_| {
                    Error::invalid(
                        format!("regions[{i}].cuda.ipc_handle"),
                        format!("{} bytes", ipc_handle.len()),
                        "a CUDA IPC handle is 64 bytes",
                    )
                })?;
                let export = CudaExport {
                    handle: IpcHandle(handle),
                    offset,
                };
                self.engine.import_cuda(device, export, len, key)
            }
        };
        r.map_err(Error::from)
    }

    async fn drop_regions(&self, regions: &[Arc<Region>]) {
        for r in regions {
            if let Err(e) = self.engine.deregister(r.id()).await {
                warn!(region = %r.id(), error = %e, "deregister failed");
            }
        }
    }

    /// Unpublishes a segment, then waits for the transfers that still use its memory. The
    /// registry goes first: if it cannot be reached the segment stays registered here and in
    /// the registry (the error says so; retry), never in one of them only.
    pub async fn deregister(&self, name: &str, key: u64) -> Result<()> {
        let _one_at_a_time = self.registrations.lock().await;
        self.local_segment(name, key)?;
        self.registry.delete_segment(name).await?;
        let segment = self
            .segments
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.holds.drop_segment(name);
        self.metrics.holds_live.set(self.holds.live() as i64);
        if let Some(segment) = segment {
            self.drop_regions(&segment.regions).await;
        }
        info!(segment = name, "segment deregistered");
        Ok(())
    }

    /// Deregisters `segment` because the connection that registered it closed (its worker is
    /// gone), unless it was deregistered (or replaced) meanwhile.
    pub async fn release_with_owner(&self, segment: &Arc<LocalSegment>) {
        let current = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&segment.name)
            .is_some_and(|s| Arc::ptr_eq(s, segment));
        if !current {
            return;
        }
        loop {
            match self.deregister(&segment.name, segment.key.0).await {
                Ok(()) => {
                    info!(segment = %segment.name, "its worker's connection closed: deregistered");
                    return;
                }
                // Registry unreachable: the segment stays in both places until it answers.
                Err(Error::RegistryUnavailable { .. }) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                // Deregistered meanwhile, or refused for good.
                Err(e) => {
                    debug!(segment = %segment.name, error = %e, "not deregistered after its worker left");
                    return;
                }
            }
        }
    }

    /// Releases every segment's memory once no transfer uses it (graceful shutdown; the
    /// registry shutdown has already deleted the keys).
    pub async fn release_all(&self) {
        let all: Vec<_> = self
            .segments
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, s)| s)
            .collect();
        for s in all {
            self.holds.drop_segment(&s.name);
            self.drop_regions(&s.regions).await;
        }
    }

    /// Moves one batch for a worker: resolves both segments, checks keys and indexes, picks (or
    /// opens) the data connection to the agent serving the remote segment, and waits. Runs in
    /// the caller's span (the local API's submit span), which it fills with what it learns.
    pub async fn transfer(&self, t: Transfer) -> Result<TransferResult> {
        let span = tracing::Span::current();
        let (src, dst) = match t.opcode {
            Opcode::Read => (&t.remote_segment, &t.local_segment),
            Opcode::Write => (&t.local_segment, &t.remote_segment),
        };
        span.record("kvfabric.src.segment", src.as_str());
        span.record("kvfabric.dst.segment", dst.as_str());
        span.record("kvfabric.op", t.opcode.to_string());
        span.record("kvfabric.blocks", t.ops.len());
        if let Some(id) = telemetry::current_trace_id() {
            span.record("trace_id", id);
        }
        let outcome = self.transfer_in_span(&t).await;
        match &outcome {
            Ok(done) => {
                record_done(&span, done.bytes, done.coalesced_ops, done.elapsed);
                let secs = done.elapsed.as_secs_f64();
                let labels = LinkLabels {
                    transport: done.transport.to_string(),
                    peer: done.remote_agent.clone(),
                };
                self.metrics.bytes.get_or_create(&labels).inc_by(done.bytes);
                self.metrics.batches.get_or_create(&labels).inc();
                self.metrics
                    .batch_seconds
                    .get_or_create(&TransportLabels {
                        transport: labels.transport,
                    })
                    .observe(secs);
            }
            Err(e) => {
                record_error(&span, e);
                self.metrics.error(e.label());
            }
        }
        outcome
    }

    /// A segment by name: this agent's own from its table, which stays authoritative while
    /// the registry's view lags or lost the entry (a lease that expired under load and is
    /// being re-registered), any other from the registry.
    fn segment_entry(&self, name: &str) -> Option<SegmentEntry> {
        let own = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|s| s.entry(&self.config.name));
        own.or_else(|| self.registry.segment(name))
    }

    async fn transfer_in_span(&self, t: &Transfer) -> Result<TransferResult> {
        let span = tracing::Span::current();
        let local = self.local_segment(&t.local_segment, t.local_key)?;
        self.check_size(&t.ops)?;
        let remote =
            self.segment_entry(&t.remote_segment)
                .ok_or_else(|| Error::UnknownSegment {
                    name: t.remote_segment.clone(),
                })?;
        let (src_node, dst_node) = match t.opcode {
            Opcode::Read => (&remote.agent, &self.config.name),
            Opcode::Write => (&self.config.name, &remote.agent),
        };
        span.record("kvfabric.src.node", src_node.as_str());
        span.record("kvfabric.dst.node", dst_node.as_str());
        let (ops, gpu_only) = resolve_regions(&local, &remote, &t.ops)?;
        // The batch's deadline bounds all of it: a dial to a peer that does not answer ends
        // when the batch would have, not after the connect timeout.
        let budget = t.timeout.unwrap_or(self.config.batch_timeout);
        let deadline = tokio::time::Instant::now() + budget;
        let link = tokio::time::timeout_at(deadline, self.link(&remote, gpu_only))
            .await
            .map_err(|_| late("connecting to the peer agent", budget))??;
        span.record("kvfabric.transport", link.peer.transport().to_string());
        span.record("kvfabric.transport.reason", link.reason.as_str());
        let access = tokio::time::timeout_at(
            deadline,
            self.learn_segment(&link, &remote, t.remote_key, budget),
        )
        .await
        .map_err(|_| late("asking the peer agent for the segment's regions", budget))??;
        let presented = presented_key(t, &link, &remote, &access)?;
        let under_hold = self
            .admit(
                t, presented, &link, &remote, &access, &ops, deadline, budget,
            )
            .await?;
        let outcome = submit(&link, t, presented, ops, under_hold, deadline).await;
        link.batches.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Ok(done) => Ok(TransferResult {
                bytes: done.bytes,
                ops: done.ops,
                coalesced_ops: done.coalesced_ops,
                transport: done.transport,
                transport_reason: link.reason.clone(),
                elapsed: done.elapsed,
                remote_agent: link.agent.clone(),
            }),
            Err(e) if e.kind() == kvfabric_engine::ErrorKind::RdmaFallback => {
                // RDMA to this peer was given up: the batch goes again over the next allowed
                // transport, whose link reason says why (as does the batch result).
                link.errors.fetch_add(1, Ordering::Relaxed);
                tracing::Span::current().record("kvfabric.retries", 1);
                warn!(agent = %link.agent, reason = %e, "rdma given up; the batch is retried over the next transport");
                self.rdma_given_up
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(link.agent.clone(), e.to_string());
                self.forget(&link).await;
                Box::pin(self.transfer_in_span(t)).await
            }
            Err(e) => {
                link.errors.fetch_add(1, Ordering::Relaxed);
                if e.breaks_connection() {
                    self.forget(&link).await;
                }
                Err(e.into())
            }
        }
    }

    /// A batch has at least one op and at most the agent's limit (a table counts as its
    /// planes × blocks).
    fn check_size(&self, ops: &BatchOps) -> Result<()> {
        let field = match ops {
            BatchOps::List(_) => "ops",
            BatchOps::Table(_) => "table",
        };
        if ops.is_empty() {
            return Err(Error::invalid(
                field,
                0,
                "a batch needs at least one op (a table: a plane and a block)",
            ));
        }
        if ops.len() > self.config.max_batch_ops {
            return Err(Error::invalid(
                field,
                ops.len(),
                format!(
                    "more than the agent's limit of {} block ops",
                    self.config.max_batch_ops
                ),
            ));
        }
        Ok(())
    }

    /// Whether the batch may read or write the remote segment as `access` allows: with the
    /// segment's key, every region's key must be that key; under a hold, only reads inside the
    /// grant, while it lasts. Under a hold: the guard its batches keep (the engine holds it
    /// until every piece is accounted for, which is what a revocation waits for) and when the
    /// grant ends.
    #[allow(clippy::too_many_arguments)]
    async fn admit(
        &self,
        t: &Transfer,
        presented: AccessKey,
        link: &Link,
        remote: &SegmentEntry,
        access: &Access,
        ops: &BatchOps,
        deadline: tokio::time::Instant,
        budget: Duration,
    ) -> Result<Option<HeldGrant>> {
        let slot = match access {
            Access::Full => {
                let wrong =
                    |r: &SegmentRegion| link.peer.region_key(r.id).is_some_and(|k| k != presented);
                if remote.regions.iter().any(wrong) {
                    return Err(Error::WrongKey {
                        name: remote.name.clone(),
                    });
                }
                return Ok(None);
            }
            Access::Hold(slot) => slot,
        };
        let refused = |e: Error| {
            self.metrics.hold_refused_batches.inc();
            e
        };
        if t.opcode != Opcode::Read {
            return Err(refused(Error::OutsideHold {
                segment: remote.name.clone(),
                what: "a hold grants reads only".into(),
            }));
        }
        let uses = tokio::time::timeout_at(deadline, slot.uses.clone().read_owned())
            .await
            .map_err(|_| late("waiting for the hold's revocation", budget))?;
        let usable = slot.usable().map_err(|why| {
            refused(match why {
                Unusable::Ended => Error::HoldEnded {
                    segment: remote.name.clone(),
                },
                // Dropped from the table between the question and now (a sweep of an
                // expired grant, a key found to be no hold's): the worker retries.
                Unusable::Retry => Error::PeerAgent {
                    agent: link.agent.clone(),
                    addr: link.peer_addr.to_string(),
                    reason: "the hold's grant changed while the batch started; retry".into(),
                },
            })
        })?;
        usable.grant.admits(ops).map_err(|o| {
            refused(Error::OutsideHold {
                segment: remote.name.clone(),
                what: o.to_string(),
            })
        })?;
        Ok(Some(HeldGrant {
            uses: Arc::new(uses),
            expires: tokio::time::Instant::from_std(usable.expires),
        }))
    }

    /// The exchange an rdma link to `agent` is set up (and rebuilt) through, or why rdma is not
    /// possible: RDMA devices on both ends (this engine's, and the peer's registry entry), and
    /// RDMA not given up for the peer.
    fn rdma_exchange(
        &self,
        agent: &AgentEntry,
    ) -> std::result::Result<Arc<dyn kvfabric_engine::RdmaExchange>, String> {
        if let Some(why) = self
            .rdma_given_up
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&agent.name)
        {
            return Err(why.clone());
        }
        let mut why = Vec::new();
        if let Err(e) = self.engine.rdma_devices() {
            why.push(e.to_string());
        }
        if agent.devices.rdma.is_empty() {
            why.push(format!("peer agent {} lists no RDMA devices", agent.name));
        }
        if !why.is_empty() {
            return Err(why.join("; "));
        }
        Ok(Arc::new(peer_link::PeerExchange {
            agent: agent.clone(),
            caller: self.caller(),
            runtime: tokio::runtime::Handle::current(),
        }))
    }

    /// The cached data connection to the agent serving `segment`, or a new one.
    async fn link(&self, segment: &SegmentEntry, gpu: bool) -> Result<Arc<Link>> {
        let agent = self
            .agent_entry(&segment.agent)
            .ok_or_else(|| Error::UnknownAgent {
                agent: segment.agent.clone(),
                segment: segment.name.clone(),
            })?;
        // A peer's segment may hold GPU and host regions (the KV cache and the mailbox): GPU
        // batches go over cuda-ipc, host ones over shm, tcp and rdma serve both; a link is
        // cached per transport, so each class only ever finds a link that reaches its memory.
        let candidates: Vec<TransportKind> = self
            .config
            .transports
            .iter()
            .copied()
            .filter(|k| match k {
                TransportKind::CudaIpc => gpu,
                TransportKind::Shm => !gpu,
                _ => true,
            })
            .collect();
        if let Some(link) = self.cached_link(&agent, &candidates).await {
            return Ok(link);
        }
        // One dial per peer at a time, and none under the cache's lock: a peer that hangs
        // stalls only the batches meant for it, and only until the deadline.
        let gate = self
            .dialing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(agent.name.clone())
            .or_default()
            .clone();
        let _one_dial = gate.lock().await;
        if let Some(link) = self.cached_link(&agent, &candidates).await {
            return Ok(link);
        }
        let deadline = self.config.connect_timeout * 3;
        tokio::time::timeout(deadline, self.dial(&agent, candidates))
            .await
            .map_err(|_| Error::PeerAgent {
                agent: agent.name.clone(),
                addr: agent.peer_addr.to_string(),
                reason: format!(
                    "not reached within {deadline:?} (peer API, data connection and handshake)"
                ),
            })?
    }

    /// A cached link to `agent` over one of `candidates`; a link to an earlier run of the agent
    /// is dropped instead.
    async fn cached_link(
        &self,
        agent: &AgentEntry,
        candidates: &[TransportKind],
    ) -> Option<Arc<Link>> {
        let found = {
            let links = self.links.lock().await;
            candidates
                .iter()
                .find_map(|k| links.get(&(agent.name.clone(), *k)))
                .cloned()
        }?;
        if found.reaches(agent) {
            return Some(found);
        }
        info!(agent = %agent.name, "the peer agent restarted: its data connection is re-opened");
        self.forget(&found).await;
        None
    }

    /// Opens a link to `agent` over the first of `candidates` that works.
    async fn dial(&self, agent: &AgentEntry, candidates: Vec<TransportKind>) -> Result<Arc<Link>> {
        let select = info_span!(
            "kvfabric.transport.select",
            kvfabric.peer = %agent.name,
            kvfabric.transport = field::Empty,
            kvfabric.transport.reason = field::Empty,
            kvfabric.fallback = field::Empty,
        );
        let (descriptor, secret) = self
            .peer_descriptor(agent)
            .instrument(select.clone())
            .await?;
        let mut refused = Vec::new();
        for kind in candidates {
            let rdma = match kind {
                TransportKind::Rdma => match self.rdma_exchange(agent) {
                    Ok(x) => Some(x),
                    Err(why) => {
                        refused.push(format!("{kind} not possible: {why}"));
                        continue;
                    }
                },
                _ => None,
            };
            match self
                .engine
                .connect_with(&descriptor, &secret, Preference::Only(kind), None, rdma)
                .instrument(select.clone())
                .await
            {
                Ok(peer) => {
                    let reason = if refused.is_empty() {
                        format!("first allowed transport ({})", self.transports_list())
                    } else {
                        refused.join("; ")
                    };
                    info!(agent = %agent.name, transport = %kind, %reason, "data connection open");
                    select.record("kvfabric.transport", kind.to_string());
                    select.record("kvfabric.transport.reason", reason.as_str());
                    if !refused.is_empty() {
                        select.record("kvfabric.fallback", refused.join("; "));
                    }
                    self.metrics.open_connections.inc();
                    let link = Arc::new(Link {
                        agent: agent.name.clone(),
                        peer,
                        reason,
                        batches: AtomicU64::new(0),
                        errors: AtomicU64::new(0),
                        opened: Instant::now(),
                        peer_instance: (agent.started_at, agent.instance),
                        peer_addr: agent.peer_addr,
                        learned: tokio::sync::Mutex::default(),
                    });
                    self.links
                        .lock()
                        .await
                        .insert((agent.name.clone(), kind), link.clone());
                    return Ok(link);
                }
                Err(e) => refused.push(format!("{kind} not possible: {e}")),
            }
        }
        Err(Error::PeerAgent {
            agent: agent.name.clone(),
            addr: agent.peer_addr.to_string(),
            reason: format!("no allowed transport reaches it: {}", refused.join("; ")),
        })
    }

    fn transports_list(&self) -> String {
        self.config
            .transports
            .iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The data-plane descriptor of an agent and its engine's data secret: ours directly,
    /// others' through their peer API.
    async fn peer_descriptor(&self, agent: &AgentEntry) -> Result<(SegmentDescriptor, DataSecret)> {
        if agent.name == self.config.name {
            return Ok((self.descriptor(), self.engine.data_secret().clone()));
        }
        self.caller().handshake(agent).await
    }

    fn caller(&self) -> peer_link::Caller {
        peer_link::Caller {
            fabric: self.config.fabric.clone(),
            me: self.config.name.clone(),
            timeout: self.config.connect_timeout,
            token: self.config.peer_token.clone(),
            tls: self.config.tls.clone(),
        }
    }

    /// The regions of a segment registered here, with what reaching them takes, for its key
    /// (the peer API's SegmentAccess, and this agent's own batches); for a live hold's key,
    /// also the hold's grant and its time left, `agent` then recorded as holding it.
    pub fn segment_access(&self, agent: &str, name: &str, key: u64) -> Result<SegmentAccess> {
        let segment = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownSegment { name: name.into() })?;
        let grant = if segment.admits(key) {
            None
        } else {
            Some(
                self.holds
                    .access(&segment, key, agent)?
                    .ok_or_else(|| Error::WrongKey { name: name.into() })?,
            )
        };
        let ids: Vec<RegionId> = segment.regions.iter().map(|r| r.id()).collect();
        let mut regions = self.descriptor().regions;
        regions.retain(|r| ids.contains(&r.id));
        Ok((regions, grant))
    }

    /// Queues `message` from `sender` for segment `name`, registered here, for a caller that
    /// presents `key` (the peer API's Deliver, and this agent's own workers' Notify).
    pub fn deliver(&self, name: &str, key: u64, sender: String, message: Vec<u8>) -> Result<()> {
        check_notification(&sender, &message)?;
        let segment = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownSegment { name: name.into() })?;
        if !segment.admits(key) {
            return Err(Error::WrongKey { name: name.into() });
        }
        segment.inbox.push(Notification { sender, message })
    }

    /// Sends `message` to the registrant of segment `name` through the agent serving it.
    pub async fn notify(
        &self,
        name: &str,
        key: u64,
        sender: String,
        message: Vec<u8>,
    ) -> Result<()> {
        check_notification(&sender, &message)?;
        let entry = self
            .segment_entry(name)
            .ok_or_else(|| Error::UnknownSegment { name: name.into() })?;
        if entry.agent == self.config.name {
            return self.deliver(name, key, sender, message);
        }
        let agent = self
            .agent_entry(&entry.agent)
            .ok_or_else(|| Error::UnknownAgent {
                agent: entry.agent.clone(),
                segment: name.into(),
            })?;
        self.caller()
            .deliver(
                &agent,
                name,
                key,
                sender,
                message,
                self.config.batch_timeout,
            )
            .await
    }

    /// The messages queued for segment `name` (registered here; its own key): up to `max` (0:
    /// all), waiting up to `wait_ms` for a first one.
    pub async fn take_notifications(
        &self,
        name: &str,
        key: u64,
        max: u32,
        wait_ms: u32,
    ) -> Result<Vec<Notification>> {
        use kvfabric_proto::limits::MAX_NOTIFICATION_WAIT_MS;
        if wait_ms > MAX_NOTIFICATION_WAIT_MS {
            return Err(Error::invalid(
                "wait_ms",
                wait_ms,
                format!("at most {MAX_NOTIFICATION_WAIT_MS}"),
            ));
        }
        let segment = self.local_segment(name, key)?;
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        Ok(segment
            .inbox
            .take(max, Duration::from_millis(wait_ms.into()))
            .await)
    }

    /// A segment registered here, for its owner's hold requests: NOT_FOUND naming the agent
    /// that serves it when that is another.
    fn hold_segment(&self, name: &str, key: u64) -> Result<Arc<LocalSegment>> {
        match self.local_segment(name, key) {
            Err(Error::UnknownSegment { .. }) => match self.registry.segment(name) {
                Some(e) if e.agent != self.config.name => Err(Error::SegmentElsewhere {
                    name: name.into(),
                    agent: e.agent,
                }),
                _ => Err(Error::UnknownSegment { name: name.into() }),
            },
            other => other,
        }
    }

    /// Grants reads of `block_ids` of every plane of segment `name` for `ttl_ms`, returning
    /// the hold's key and its time left. Every block of every plane must lie inside its region
    /// (checked arithmetic: the engine's plane bound); the number of holds and the memory they
    /// take are bounded (`holds::MAX_*`).
    pub fn create_hold(
        &self,
        name: &str,
        key: u64,
        planes: &[HoldPlane],
        block_ids: Vec<u64>,
        ttl_ms: u64,
    ) -> Result<(u64, Duration)> {
        use kvfabric_proto::limits::{MAX_HOLD_BLOCK_IDS, MAX_HOLD_PLANES};
        let segment = self.hold_segment(name, key)?;
        let ttl = hold_ttl(ttl_ms)?;
        if planes.is_empty() || planes.len() > MAX_HOLD_PLANES {
            return Err(Error::invalid(
                "planes",
                planes.len(),
                format!("a hold has 1..={MAX_HOLD_PLANES} planes"),
            ));
        }
        if block_ids.is_empty() || block_ids.len() > MAX_HOLD_BLOCK_IDS {
            return Err(Error::invalid(
                "block_ids",
                block_ids.len(),
                format!("a hold has 1..={MAX_HOLD_BLOCK_IDS} block ids"),
            ));
        }
        let max_id = block_ids.iter().copied().max().unwrap_or(0);
        let mut granted = Vec::with_capacity(planes.len());
        for (i, p) in planes.iter().enumerate() {
            let region = segment.regions.get(p.region as usize).ok_or_else(|| {
                index_error(
                    format!("planes[{i}].region"),
                    p.region.into(),
                    name,
                    segment.regions.len(),
                )
            })?;
            if p.block_bytes == 0 {
                return Err(Error::invalid(
                    format!("planes[{i}].block_bytes"),
                    0,
                    "blocks need at least one byte",
                ));
            }
            let end = kvfabric_engine::plane_end(p.base, p.stride, max_id, p.block_bytes)
                .ok_or_else(|| {
                    Error::invalid(
                        format!("planes[{i}].stride"),
                        p.stride,
                        format!(
                            "base + largest block id ({max_id}) × stride + block_bytes passes 2^64"
                        ),
                    )
                })?;
            if end > region.len() {
                return Err(Error::invalid(
                    format!("planes[{i}]"),
                    format!("block {max_id} ends at byte {end}"),
                    format!("past region {} ({} bytes)", p.region, region.len()),
                ));
            }
            granted.push(GrantPlane {
                region: region.id(),
                base: p.base,
                stride: p.stride,
                block_bytes: p.block_bytes,
            });
        }
        let grant = Grant::new(granted, block_ids).map_err(|(plane, why)| {
            Error::invalid(
                plane.map_or("planes".into(), |i| format!("planes[{i}]")),
                "",
                why,
            )
        })?;
        let keys: std::collections::HashSet<u64> =
            self.local_segments().iter().map(|s| s.key.0).collect();
        let hold_key = self
            .holds
            .create(&segment, grant, ttl, |k| keys.contains(&k))?;
        self.metrics.holds_created.inc();
        self.metrics.holds_live.set(self.holds.live() as i64);
        debug!(
            segment = name,
            ttl_ms,
            planes = planes.len(),
            "hold created"
        );
        Ok((hold_key, ttl))
    }

    /// Moves a live hold's expiry to `ttl_ms` from now (never earlier); returns the time left.
    pub fn extend_hold(
        &self,
        name: &str,
        key: u64,
        hold_key: u64,
        ttl_ms: u64,
    ) -> Result<Duration> {
        let segment = self.hold_segment(name, key)?;
        let ttl = hold_ttl(ttl_ms)?;
        self.holds.extend(&segment, hold_key, ttl)
    }

    /// Ends a hold, returning once no read under it can land: the grant is no longer handed
    /// out, and every agent it was handed to (this one included) dropped it and saw its batches
    /// under it accounted for, all within `timeout`. An agent that does not confirm in time
    /// (hung, unreachable, gone from the registry) makes it DEADLINE_EXCEEDED with the hold's
    /// time left; a second call asks only those again.
    pub async fn end_hold(
        &self,
        name: &str,
        key: u64,
        hold_key: u64,
        timeout: Duration,
    ) -> Result<()> {
        let segment = self.hold_segment(name, key)?;
        let Some(ending) = self.holds.begin_end(&segment, hold_key) else {
            // Never issued, expired, or ended: no read under it can land.
            return Ok(());
        };
        if ending.was_live {
            self.metrics.holds_ended.inc();
            self.metrics.holds_live.set(self.holds.live() as i64);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let asks = ending.agents.iter().map(|agent| async move {
            let asked =
                tokio::time::timeout_at(deadline, self.revoke_at(agent, name, hold_key, deadline))
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::Deadline {
                            during: "waiting for the agent to confirm",
                            millis: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                        })
                    });
            (agent.clone(), asked)
        });
        let answers = futures::future::join_all(asks).await;
        let confirmed: Vec<String> = answers
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|(a, _)| a.clone())
            .collect();
        let Some(left) = self.holds.confirm(hold_key, &confirmed) else {
            debug!(segment = name, agents = ending.agents.len(), "hold ended");
            return Ok(());
        };
        let failed: Vec<(String, String)> = answers
            .into_iter()
            .filter_map(|(a, r)| r.err().map(|e| (a, e.to_string())))
            .collect();
        warn!(segment = name, agents = ?failed, left_ms = left.as_millis() as u64, "hold ended without every agent's confirmation");
        Err(Error::HoldUnconfirmed {
            segment: name.into(),
            agents: failed
                .iter()
                .map(|(a, _)| format!("{:?}", kvfabric_proto::limits::echo(a)))
                .collect::<Vec<_>>()
                .join(", "),
            reason: failed
                .first()
                .map(|(_, e)| kvfabric_proto::limits::echo(e))
                .unwrap_or_default(),
            remaining_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// Asks `agent` (this one directly, others through their peer API) to drop its grant of
    /// the hold and to answer once its batches under it are accounted for.
    async fn revoke_at(
        &self,
        agent: &str,
        segment: &str,
        hold_key: u64,
        deadline: tokio::time::Instant,
    ) -> Result<()> {
        let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        if agent == self.config.name {
            return self.grants.revoke(segment, hold_key, wait).await;
        }
        let entry = self.agent_entry(agent).ok_or_else(|| Error::UnknownAgent {
            agent: agent.into(),
            segment: segment.into(),
        })?;
        self.caller()
            .revoke_hold(&entry, segment, hold_key, wait)
            .await
    }

    /// The peer API's RevokeHold: drops this agent's grant of the hold and waits (at most
    /// `wait`) for its batches under it.
    pub async fn revoke_grant(&self, segment: &str, hold_key: u64, wait: Duration) -> Result<()> {
        self.grants.revoke(segment, hold_key, wait).await
    }

    /// Forgets expired holds and unused expired grants (every second, from the server).
    pub fn sweep_holds(&self) {
        let swept = self.holds.sweep();
        self.metrics.holds_expired.inc_by(swept.expired as u64);
        self.metrics.holds_live.set(self.holds.live() as i64);
        self.grants.sweep();
    }

    /// Makes sure the link knows every region of `segment` as the holder of `key` may reach
    /// them: asked of the peer (which checks the key) the first time, and again when the key
    /// or the segment's regions changed. Regions of segments the registry no longer lists for
    /// the peer are forgotten on the way, so what a link knows stays bounded.
    ///
    /// A key that is not the segment's may be a hold's: the peer then answers with the grant,
    /// kept per (segment, key) for this agent's batches until it has less than
    /// `min(budget, GRANT_REFRESH)` left, when it is asked for again (the owner may have
    /// extended the hold).
    async fn learn_segment(
        &self,
        link: &Link,
        segment: &SegmentEntry,
        key: u64,
        budget: Duration,
    ) -> Result<Access> {
        let mut learned = link.learned.lock().await;
        let want = budget.min(holds::GRANT_REFRESH);
        // A slot found gone was dropped by another batch's question (its key turned out to be
        // the segment's, say): ask again with a new one, a few times at most.
        for _ in 0..3 {
            let served = unserved(link, segment).is_none();
            if served && learned.get(&segment.name) == Some(&key) {
                return Ok(Access::Full);
            }
            if served
                && let Some(slot) = self.grants.find(&segment.name, key)
                && slot.fresh(want).is_some()
            {
                return Ok(Access::Hold(slot));
            }
            // The slot is in the table before the question leaves: a revocation that overtakes
            // the answer finds it, and the answer is then not used.
            let slot = self.grants.slot(&segment.name, key)?;
            let _asking = slot.fetch.lock().await;
            if holds::slot_gone(&slot) {
                continue;
            }
            if served && slot.fresh(want).is_some() {
                return Ok(Access::Hold(slot.clone()));
            }
            let asked = std::time::Instant::now();
            let (fresh, grant) = match self.ask_segment_access(link, segment, key, budget).await {
                Ok(answer) => answer,
                Err(e) => {
                    self.grants.discard(&slot);
                    return Err(e);
                }
            };
            self.merge_regions(link, &mut learned, fresh);
            let access = match grant {
                None => {
                    self.grants.discard(&slot);
                    learned.insert(segment.name.clone(), key);
                    Access::Full
                }
                Some((grant, left)) => {
                    let expires = asked + left.saturating_sub(holds::margin(left));
                    self.grants.set(&slot, grant, expires)?;
                    Access::Hold(slot.clone())
                }
            };
            if let Some(r) = unserved(link, segment) {
                learned.remove(&segment.name);
                return Err(Error::PeerAgent {
                    agent: link.agent.clone(),
                    addr: link.peer_addr.to_string(),
                    reason: format!(
                        "does not serve region {} of segment {:?} (the registry entry is stale)",
                        r.id,
                        kvfabric_proto::limits::echo(&segment.name)
                    ),
                });
            }
            return Ok(access);
        }
        Err(Error::PeerAgent {
            agent: link.agent.clone(),
            addr: link.peer_addr.to_string(),
            reason: "the hold's grant kept changing while the batch started; retry".into(),
        })
    }

    /// SegmentAccess of the agent behind `link` (this agent's own table when it is this one),
    /// answered within `budget` (what is left of the batch's deadline).
    async fn ask_segment_access(
        &self,
        link: &Link,
        segment: &SegmentEntry,
        key: u64,
        budget: Duration,
    ) -> Result<SegmentAccess> {
        let agent = self
            .agent_entry(&link.agent)
            .ok_or_else(|| Error::UnknownAgent {
                agent: link.agent.clone(),
                segment: segment.name.clone(),
            })?;
        if agent.name == self.config.name {
            return self.segment_access(&self.config.name, &segment.name, key);
        }
        let (regions, grant) = self
            .caller()
            .segment_access(&agent, &segment.name, key, budget)
            .await?;
        Ok((regions, grant.map(|(g, left)| (Arc::new(g), left))))
    }

    /// Puts `fresh` regions into what the link knows, forgetting those of segments the
    /// registry no longer lists for the peer.
    fn merge_regions(
        &self,
        link: &Link,
        learned: &mut HashMap<String, u64>,
        fresh: Vec<RegionDesc>,
    ) {
        let listed = self.registry.segments();
        let live: std::collections::HashSet<RegionId> = listed
            .values()
            .filter(|s| s.agent == link.agent)
            .flat_map(|s| s.regions.iter().map(|r| r.id))
            .collect();
        let mut descriptor = link.peer.descriptor();
        descriptor
            .regions
            .retain(|r| live.contains(&r.id) && !fresh.iter().any(|f| f.id == r.id));
        descriptor.regions.extend(fresh);
        link.peer.set_descriptor(descriptor);
        learned.retain(|name, _| listed.contains_key(name));
    }

    async fn forget(&self, link: &Arc<Link>) {
        let mut links = self.links.lock().await;
        let key = (link.agent.clone(), link.peer.transport());
        if links.get(&key).is_some_and(|l| Arc::ptr_eq(l, link)) {
            links.remove(&key);
            self.metrics.open_connections.dec();
            self.closed_bytes
                .fetch_add(link.peer.stats().bytes, Ordering::Relaxed);
            warn!(agent = %link.agent, transport = %key.1, "data connection dropped; the next batch re-dials");
        }
    }

    pub async fn links(&self) -> Vec<Arc<Link>> {
        let mut v: Vec<_> = self.links.lock().await.values().cloned().collect();
        v.sort_by(|a, b| a.agent.cmp(&b.agent));
        v
    }

    pub fn closed_bytes(&self) -> u64 {
        self.closed_bytes.load(Ordering::Relaxed)
    }
}

/// The first region of `segment` that the link does not know the peer to serve.
fn unserved<'a>(link: &Link, segment: &'a SegmentEntry) -> Option<&'a SegmentRegion> {
    segment
        .regions
        .iter()
        .find(|r| link.peer.region_key(r.id).is_none())
}

/// A hold's time to live: 1 ms to an hour.
fn hold_ttl(ttl_ms: u64) -> Result<Duration> {
    use kvfabric_proto::limits::MAX_HOLD_TTL_MS;
    if !(1..=MAX_HOLD_TTL_MS).contains(&ttl_ms) {
        return Err(Error::invalid(
            "ttl_ms",
            ttl_ms,
            format!("a hold lives 1..={MAX_HOLD_TTL_MS} ms"),
        ));
    }
    Ok(Duration::from_millis(ttl_ms))
}

/// A hold's guard, kept by the batch's pieces, and when the grant ends.
struct HeldGrant {
    uses: Arc<dyn std::any::Any + Send + Sync>,
    expires: tokio::time::Instant,
}

fn late(during: &'static str, budget: Duration) -> Error {
    Error::Deadline {
        during,
        millis: budget.as_millis() as u64,
    }
}

/// The batch's ops with the segments' region indexes turned into the engines' region ids, once
/// per op or once per plane; and whether every region on both sides is GPU memory.
fn resolve_regions(
    local: &LocalSegment,
    remote: &SegmentEntry,
    ops: &BatchOps,
) -> Result<(BatchOps, bool)> {
    let mut gpu_only = true;
    let mut resolve = |field: String, l: RegionId, r: RegionId| {
        let lr = local.regions.get(l.0 as usize).ok_or_else(|| {
            index_error(
                format!("{field}local_region"),
                l.0,
                &local.name,
                local.regions.len(),
            )
        })?;
        let rr = remote.regions.get(r.0 as usize).ok_or_else(|| {
            index_error(
                format!("{field}remote_region"),
                r.0,
                &remote.name,
                remote.regions.len(),
            )
        })?;
        gpu_only &= matches!(lr.location(), Location::Cuda { .. })
            && matches!(rr.location, Location::Cuda { .. });
        Ok::<_, Error>((lr.id(), rr.id))
    };
    let ops = match ops {
        BatchOps::List(list) => {
            let mut ops = Vec::with_capacity(list.len());
            for (i, o) in list.iter().enumerate() {
                let (l, r) = resolve(format!("ops[{i}]."), o.local_region, o.remote_region)?;
                ops.push(BlockOp {
                    local_region: l,
                    remote_region: r,
                    ..*o
                });
            }
            BatchOps::List(ops)
        }
        BatchOps::Table(table) => {
            let mut table = table.clone();
            for (i, p) in table.planes.iter_mut().enumerate() {
                let (l, r) = resolve(
                    format!("table.planes[{i}]."),
                    p.local.region,
                    p.remote.region,
                )?;
                (p.local.region, p.remote.region) = (l, r);
            }
            BatchOps::Table(table)
        }
    };
    Ok((ops, gpu_only))
}

/// The batch on the link's engine peer, in a `kvfabric.transport` span that records what it
/// moved or why it failed.
/// The key a batch presents to the segment's engine: the worker's, or for [`FABRIC_KEY`] the
/// one the segment's owner answered with (it admitted this agent as one of its fabric).
fn check_notification(sender: &str, message: &[u8]) -> Result<()> {
    use kvfabric_proto::limits::{MAX_NAME_LEN, MAX_NOTIFICATION_BYTES};
    if sender.len() > MAX_NAME_LEN {
        return Err(Error::invalid(
            "sender",
            kvfabric_proto::limits::echo(sender),
            format!("at most {MAX_NAME_LEN} bytes"),
        ));
    }
    if message.len() > MAX_NOTIFICATION_BYTES {
        return Err(Error::invalid(
            "message",
            format!("{} bytes", message.len()),
            format!("at most {MAX_NOTIFICATION_BYTES} bytes"),
        ));
    }
    Ok(())
}

fn presented_key(
    t: &Transfer,
    link: &Link,
    remote: &SegmentEntry,
    access: &Access,
) -> Result<AccessKey> {
    if t.remote_key != FABRIC_KEY || !matches!(access, Access::Full) {
        return Ok(AccessKey(t.remote_key));
    }
    remote
        .regions
        .first()
        .and_then(|r| link.peer.region_key(r.id))
        .ok_or_else(|| Error::WrongKey {
            name: remote.name.clone(),
        })
}

async fn submit(
    link: &Link,
    t: &Transfer,
    presented: AccessKey,
    ops: BatchOps,
    under_hold: Option<HeldGrant>,
    deadline: tokio::time::Instant,
) -> kvfabric_engine::Result<kvfabric_engine::BatchResult> {
    let transport = info_span!(
        "kvfabric.transport",
        otel.name = format!("kvfabric.transport.{}", link.peer.transport()),
        kvfabric.transport = %link.peer.transport(),
        kvfabric.peer = %link.agent,
        kvfabric.op = %t.opcode,
        kvfabric.blocks = ops.len(),
        kvfabric.coalesced_ops = field::Empty,
        kvfabric.bytes = field::Empty,
        kvfabric.duration_ms = field::Empty,
        kvfabric.gbps = field::Empty,
        error = field::Empty,
        otel.status_code = field::Empty,
    );
    async {
        let mut batch = Batch::of(t.opcode, ops).with_checksum(t.checksum);
        // Under a hold the engine presents the region keys the segment's agent gave this one
        // (the worker never sees them); with the segment's key, that key.
        let deadline = match under_hold {
            None => {
                batch = batch.with_remote_key(presented);
                deadline
            }
            Some(held) => {
                batch = batch.keeping(held.uses);
                // No read under the grant is still running when it ends.
                deadline.min(held.expires)
            }
        };
        batch.trace = telemetry::current_trace();
        // What is left of the batch's deadline (at least 1 ms: the engine's own timeout then
        // reports it).
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        batch.timeout = Some(left.max(Duration::from_millis(1)));
        let done = match link.peer.submit(batch) {
            Ok(handle) => handle.wait().await,
            Err(e) => Err(e),
        };
        let span = tracing::Span::current();
        match &done {
            Ok(d) => record_done(&span, d.bytes, d.coalesced_ops, d.elapsed),
            Err(e) => record_error(&span, e),
        }
        done
    }
    .instrument(transport)
    .await
}

fn index_error(field: String, index: u64, segment: &str, count: usize) -> Error {
    Error::invalid(
        field,
        index,
        format!("segment {segment:?} has {count} regions"),
    )
}

/// Segment names become etcd key segments and log fields: keep them plain.
pub(crate) fn check_segment_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "name",
            format!("{name:?}"),
            "1..=253 characters of [A-Za-z0-9-_.:]",
        ))
    }
}

/// What a finished batch leaves on a span: the submit span and the transport span carry the
/// same fields, so a trace reads the same at both levels.
fn record_done(span: &tracing::Span, bytes: u64, coalesced_ops: usize, elapsed: Duration) {
    let secs = elapsed.as_secs_f64();
    span.record("kvfabric.bytes", bytes);
    span.record("kvfabric.coalesced_ops", coalesced_ops);
    span.record("kvfabric.duration_ms", secs * 1e3);
    span.record("kvfabric.gbps", bytes as f64 / secs.max(1e-9) / 1e9);
}

/// A failed batch: its error, and the status the OpenTelemetry bridge exports as ERROR.
fn record_error(span: &tracing::Span, e: &dyn std::fmt::Display) {
    span.record("error", e.to_string());
    span.record("otel.status_code", "ERROR");
}
