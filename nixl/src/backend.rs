//! One NIXL backend instance: the worker's connection to its node's agent, the memory NIXL
//! registered (as segments open to the fabric), the peers' metadata NIXL loaded, and the
//! notifications that arrived.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfabric_client::{
    Client, CudaRegion, FABRIC_KEY, HostMemory, Memory, Notification, Registration, Segment,
};

use crate::metadata::{self, ConnInfo, PublicData, Span};
use crate::moved;
use crate::status::{Error, Result};

/// Where the Helm chart puts the agent's sockets on every node.
const DEFAULT_SOCKET_DIR: &str = "/var/run/kvfabric";
/// Longest any call to the agent may take (registration, a notification, deregistration).
const CALL_DEADLINE: Duration = Duration::from_secs(30);
/// Notifications kept here for NIXL's next `getNotifs`; past it they wait at the agent (whose
/// queue is bounded too: senders then hear RESOURCE_EXHAUSTED).
const MAX_KEPT_NOTIFICATIONS: usize = 65_536;
/// How long one long poll of the inbox waits at the agent.
const INBOX_POLL: Duration = Duration::from_secs(1);

/// NIXL memory types this backend registers (`nixl_mem_t`).
pub const DRAM: i32 = 0;
pub const VRAM: i32 = 1;

/// Memory registered through this backend: a segment open to the fabric, of one region per
/// memfd the range lies in.
#[derive(Debug)]
pub struct Local {
    pub segment: Segment,
    /// The registered range, as NIXL names it.
    pub addr: u64,
    pub len: u64,
    /// Where its bytes are in the segment's regions, in order.
    pub pieces: Vec<Span>,
    pub public: String,
    _memory: Vec<Arc<HostMemory>>,
}

impl Local {
    /// `pieces` of `segment` hold `[addr, addr + len)`; `memory` keeps host regions mapped.
    fn new(
        segment: Segment,
        addr: u64,
        len: u64,
        pieces: Vec<Span>,
        memory: Vec<Arc<HostMemory>>,
    ) -> Local {
        Local {
            public: metadata::to_string(&PublicData::new(&segment.name, pieces.clone())),
            segment,
            addr,
            len,
            pieces,
            _memory: memory,
        }
    }
}

/// A peer's registered memory, from its public data.
#[derive(Debug)]
pub struct Remote {
    pub agent: String,
    pub segment: String,
    pub addr: u64,
    pub len: u64,
    pub pieces: Vec<Span>,
}

#[derive(Debug)]
pub enum Md {
    Local(Arc<Local>),
    Remote(Arc<Remote>),
}

#[derive(Debug)]
pub struct Backend {
    pub(crate) rt: tokio::runtime::Runtime,
    pub(crate) client: Client,
    /// The NIXL agent's name: what receivers of its notifications are told.
    pub(crate) agent: String,
    prefix: String,
    conn_info: String,
    _inbox: Segment,
    _inbox_memory: HostMemory,
    next_segment: Mutex<u64>,
    /// NIXL agent → the inbox segment its notifications go to.
    peers: Mutex<HashMap<String, String>>,
    notifications: Arc<Mutex<Vec<Notification>>>,
    poller: tokio::task::JoinHandle<()>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.poller.abort();
    }
}

impl Backend {
    /// Connects to the agent whose sockets are in `socket_dir` (empty: KVFABRIC_SOCKET_DIR,
    /// else the chart's host path) and opens the inbox peers notify.
    pub fn new(agent: &str, socket_dir: &str) -> Result<Backend> {
        let dir = match socket_dir {
            "" => std::env::var_os("KVFABRIC_SOCKET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET_DIR)),
            d => PathBuf::from(d),
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvfabric-nixl")
            .enable_all()
            .build()
            .map_err(|e| Error::Invalid {
                field: "runtime",
                reason: e.to_string(),
            })?;
        let client =
            within(&rt, "connecting to the agent", Client::connect(&dir))?.map_err(Error::Agent)?;
        let prefix = metadata::segment_prefix(agent);
        let inbox_memory = HostMemory::alloc(4096).map_err(Error::Agent)?;
        let inbox_name = format!("{prefix}.inbox");
        let inbox = within(
            &rt,
            "registering the inbox",
            client.register_with(&inbox_name, &[Memory::Host(&inbox_memory)], fabric()),
        )?
        .map_err(Error::Agent)?;
        let notifications = Arc::new(Mutex::new(Vec::new()));
        let poller = rt.spawn(poll_inbox(
            client.clone(),
            inbox.clone(),
            notifications.clone(),
        ));
        Ok(Backend {
            conn_info: metadata::to_string(&ConnInfo::new(&inbox_name)),
            rt,
            client,
            agent: agent.into(),
            prefix,
            _inbox: inbox,
            _inbox_memory: inbox_memory,
            next_segment: Mutex::new(0),
            peers: Mutex::new(HashMap::new()),
            notifications,
            poller,
        })
    }

    pub fn conn_info(&self) -> &str {
        &self.conn_info
    }

    /// Registers `[addr, addr + len)` as a segment open to the fabric.
    ///
    /// # Safety
    /// The range is memory of this process that stays mapped while transfers may touch it,
    /// and no thread writes it during the call (its pages move into a memfd).
    pub unsafe fn register(&self, addr: u64, len: u64, device: u64, mem: i32) -> Result<Local> {
        match mem {
            DRAM => {}
            VRAM => return self.register_cuda(addr, len, device),
            other => {
                return Err(Error::NotSupported {
                    what: format!("memory type {other}"),
                });
            }
        }
        // SAFETY: forwarded to the caller.
        let found = unsafe { moved::pieces_for(addr, len) }?;
        let mut memory: Vec<Arc<HostMemory>> = Vec::new();
        let mut pieces = Vec::with_capacity(found.len());
        for p in &found {
            let region = match memory.iter().position(|m| Arc::ptr_eq(m, &p.memory)) {
                Some(i) => i,
                None => {
                    memory.push(p.memory.clone());
                    memory.len() - 1
                }
            };
            pieces.push(Span {
                len: p.len,
                region: region as u32,
                offset: p.offset,
            });
        }
        let regions: Vec<Memory<'_>> = memory.iter().map(|m| Memory::Host(m)).collect();
        let segment = self.register_segment(&regions)?;
        Ok(Local::new(segment, addr, len, pieces, memory))
    }

    /// GPU memory: the agent opens the allocation by its CUDA IPC handle, on the GPU named by
    /// UUID (whatever numbering the agent's process sees).
    fn register_cuda(&self, addr: u64, len: u64, device: u64) -> Result<Local> {
        let device = u32::try_from(device).map_err(|_| Error::Invalid {
            field: "devId",
            reason: format!("{device} is not a CUDA device number"),
        })?;
        let export = kvfabric_engine::cuda::export(device, addr, len).map_err(Error::Cuda)?;
        let uuid = kvfabric_engine::cuda::devices()
            .map_err(Error::Cuda)?
            .into_iter()
            .find(|d| d.ordinal == device)
            .map(|d| d.uuid)
            .unwrap_or_default();
        let region = CudaRegion {
            device,
            device_uuid: uuid,
            ipc_handle: export.handle.0.to_vec(),
            offset: export.offset,
            len,
        };
        let pieces = vec![Span {
            len,
            region: 0,
            offset: 0,
        }];
        let segment = self.register_segment(&[Memory::Cuda(&region)])?;
        Ok(Local::new(segment, addr, len, pieces, Vec::new()))
    }

    /// Registers `regions` as a new segment open to the fabric.
    fn register_segment(&self, regions: &[Memory<'_>]) -> Result<Segment> {
        let name = {
            let mut n = self.next_segment.lock().unwrap_or_else(|e| e.into_inner());
            *n += 1;
            format!("{}.{}", self.prefix, *n)
        };
        within(
            &self.rt,
            "registering memory",
            self.client.register_with(&name, regions, fabric()),
        )?
        .map_err(Error::Agent)
    }

    pub fn deregister(&self, local: &Local) -> Result<()> {
        within(
            &self.rt,
            "deregistering memory",
            self.client.deregister(&local.segment),
        )?
        .map_err(Error::Agent)
    }

    pub fn load_conn_info(&self, agent: &str, info: &[u8]) -> Result<()> {
        let c = ConnInfo::parse(info)?;
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(agent.into(), c.inbox);
        Ok(())
    }

    pub fn forget(&self, agent: &str) {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(agent);
    }

    pub fn load_remote(
        &self,
        agent: &str,
        addr: u64,
        len: u64,
        mem: i32,
        public: &[u8],
    ) -> Result<Remote> {
        if !matches!(mem, DRAM | VRAM) {
            return Err(Error::NotSupported {
                what: format!("remote memory type {mem}"),
            });
        }
        if addr.checked_add(len).is_none() {
            return Err(Error::Invalid {
                field: "remote descriptor",
                reason: format!("{len} bytes at {addr:#x} overflow"),
            });
        }
        let p = PublicData::parse(public, len)?;
        Ok(Remote {
            agent: agent.into(),
            segment: p.segment,
            addr,
            len,
            pieces: p.pieces,
        })
    }

    /// The inbox of NIXL agent `agent` (its connection info loaded).
    pub fn inbox_of(&self, agent: &str) -> Result<String> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(agent)
            .cloned()
            .ok_or_else(|| Error::UnknownPeer {
                agent: agent.into(),
            })
    }

    pub fn notify(&self, agent: &str, message: &[u8]) -> Result<()> {
        let inbox = self.inbox_of(agent)?;
        within(
            &self.rt,
            "sending a notification",
            self.client.notify(&inbox, FABRIC_KEY, &self.agent, message),
        )?
        .map_err(Error::Agent)
    }

    pub fn take_notifications(&self) -> Vec<Notification> {
        std::mem::take(&mut *self.notifications.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

fn fabric() -> Registration {
    Registration {
        key: None,
        fabric_access: true,
    }
}

/// Runs `f` on `rt` from a thread outside it, for at most [`CALL_DEADLINE`].
fn within<T>(
    rt: &tokio::runtime::Runtime,
    context: &'static str,
    f: impl Future<Output = T>,
) -> Result<T> {
    // The timer is made inside the runtime (it needs its clock).
    rt.block_on(async { tokio::time::timeout(CALL_DEADLINE, f).await })
        .map_err(|_| Error::Late {
            context,
            seconds: CALL_DEADLINE.as_secs(),
        })
}

/// Takes the inbox's notifications as they arrive (a long poll), keeping at most
/// [`MAX_KEPT_NOTIFICATIONS`] for NIXL's next `getNotifs`.
async fn poll_inbox(client: Client, inbox: Segment, kept: Arc<Mutex<Vec<Notification>>>) {
    let mut reported = false;
    loop {
        let room = MAX_KEPT_NOTIFICATIONS
            .saturating_sub(kept.lock().unwrap_or_else(|e| e.into_inner()).len());
        if room == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let max = u32::try_from(room).unwrap_or(u32::MAX);
        match client.take_notifications(&inbox, max, INBOX_POLL).await {
            Ok(taken) => {
                reported = false;
                kept.lock().unwrap_or_else(|e| e.into_inner()).extend(taken);
            }
            Err(e) => {
                if !reported {
                    eprintln!("kvfabric-nixl: taking notifications: {e}");
                    reported = true;
                }
                tokio::time::sleep(INBOX_POLL).await;
            }
        }
    }
}
