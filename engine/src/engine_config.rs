//! How an engine is set up: one typed config, validated once at `Engine::new`, with documented
//! defaults.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::DataSecret;
use crate::cuda::CudaPath;
use crate::error::{Error, Result};
use crate::rdma::RdmaConfig;
use crate::segment::local_node_id;
use crate::tcp_buffer::TcpBuffer;
use crate::transport::target::ServeObserver;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// This engine's segment name, as peers and the registry know it.
    pub name: String,
    /// When set, peers must present it in the handshake, and those that do (naming this
    /// segment) are given its descriptor with region keys.
    pub segment_key: Option<u64>,
    /// The secret every data connection proves it holds before this engine says anything (see
    /// [`crate::auth`]). None: [`Engine::new`] generates one, so authentication is never off;
    /// hand [`Engine::data_secret`] to peers over an authenticated channel.
    pub data_secret: Option<DataSecret>,
    /// Machine identity for locality (default: the kernel boot id).
    pub node: String,
    /// Data connections opened per tcp peer.
    pub tcp_connections: usize,
    /// Kernel buffers of each tcp data connection, both ends (see [`crate::tcp_buffer`]).
    /// Default `Auto`: 256 KiB between two processes of one host, autotuning elsewhere.
    pub tcp_buffer: TcpBuffer,
    /// A batch is cut into chunks of about this many bytes, spread over the connections.
    pub chunk_bytes: u64,
    /// Default time a batch may take before it fails with `Timeout`.
    pub batch_timeout: Duration,
    /// Threads copying for the shm transport.
    pub shm_threads: usize,
    /// Batches at least this large are copied by every shm thread at once.
    pub shm_parallel_min: u64,
    /// Most ops one batch may carry.
    pub max_batch_ops: usize,
    /// How cuda-ipc moves a batch: one kernel over an op list (`Sm`), the copy engines (`Ce`),
    /// or per batch by its mean copy size (`Auto`, the default).
    pub cuda_path: CudaPath,
    /// cuda-ipc completion threads poll their events instead of sleeping in cuEventSynchronize,
    /// for 20 ms after their last batch, and a caller's `Peer::run` polls until its batch is
    /// done: one busy core per GPU in use while batches keep coming. Off by default (the
    /// default `spin_wait` gets a lone small op most of the way at no idle cost).
    pub cuda_spin: bool,
    /// A thread that waits for its own batch of at most 4 MiB (`Peer::run`,
    /// `BatchHandle::wait_blocking`) polls for completion this long before it sleeps: a batch
    /// done within it costs no wake-up (microseconds per batch), and no thread polls once its
    /// batch is done or the window has passed, so an idle engine polls nothing. Larger batches
    /// are never polled: they outlast any window, and many in flight would hold as many cores.
    /// Over tcp the caller running its own small batch polls its socket as long for the reply,
    /// and a tcp target polls each data connection as long for the next request after serving
    /// one (a socket polls 1 s at most); over cuda-ipc the caller polls its GPU work itself (and
    /// small batches take the doorbell). 0: never polls, completion always wakes the waiter (the
    /// lowest CPU use, tens of µs more per small batch). Default 50 µs.
    pub spin_wait: Duration,
    /// cuda-ipc's doorbell kernel (one CTA that takes small batches of a polling caller with no
    /// launch; see `cuda::doorbell`) exits after this long without a batch, so an idle fabric
    /// holds no SM: the next small batch launches it again. 0 turns the doorbell off. Default
    /// 500 µs; at most 1 s.
    pub cuda_doorbell_idle: Duration,
    /// cuda-ipc pushes run on the peer's GPU (which then pulls from ours) when this process can
    /// use that GPU, so each GPU pulls and both link directions carry data at once.
    pub cuda_push_by_peer: bool,
    /// GPU memory over tcp goes through pinned host buffers: this many bytes per tcp connection
    /// and direction (a ring of units of up to 1 MiB; the copy of one unit overlaps the socket
    /// I/O of another), allocated at the first GPU batch and reused. Over shm, GPU memory is
    /// copied straight to and from the peer's mapping (page-locked once), and this only needs to
    /// be non-zero. 0 turns GPU memory over tcp and shm off: such ops fail with
    /// `StagingNotConfigured`. Default: 2 × the default `chunk_bytes` (8 MiB).
    pub staging_bytes: u64,
    /// Told about every chunk this engine served for a peer (tcp target side), with the trace
    /// context the initiator sent: how an embedding agent traces the work it does for others.
    pub observer: Option<Arc<dyn ServeObserver>>,
    /// RDMA devices, QPs, work-request plans and retries (used in a build with the cargo
    /// feature `rdma`, on a machine with a usable device).
    pub rdma: RdmaConfig,
    /// A data connection must finish its handshake within this (target side: the connection is
    /// closed; initiator side: connect and handshake fail with `Io`/`TimedOut`). Default 10 s.
    pub handshake_timeout: Duration,
    /// The target closes a data connection that sends nothing for this long (a peer that is
    /// gone without a FIN, or that stopped reading replies). Initiators keep theirs alive with
    /// a KeepAlive frame every third of it, so only dead ones are closed. Default 120 s.
    pub idle_timeout: Duration,
    /// Data connections served at once, per listener (tcp, shm): one thread each. Past it a new
    /// caller is refused (`busy`) unless a caller still in its handshake can be dropped for it.
    /// Default 256.
    pub max_connections: usize,
    /// Of those, connections still in their handshake, per listener. When full, the oldest is
    /// closed to make room: a flood of callers that never speak cannot keep a peer that does
    /// out (its handshake takes one round trip). Default 32.
    pub max_unauthenticated: usize,
    /// TLS on the tcp data port, both ways (None: plain TCP). Peers must agree.
    pub tls: Option<crate::DataTls>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        EngineConfig {
            name: "kvfabric".into(),
            segment_key: None,
            data_secret: None,
            node: local_node_id(),
            tcp_connections: 4,
            tcp_buffer: TcpBuffer::Auto,
            chunk_bytes: 4 << 20,
            batch_timeout: Duration::from_secs(30),
            shm_threads: cores.clamp(1, 8),
            shm_parallel_min: 4 << 20,
            max_batch_ops: 1 << 20,
            cuda_path: CudaPath::Auto,
            cuda_spin: false,
            spin_wait: Duration::from_micros(50),
            cuda_doorbell_idle: Duration::from_micros(500),
            cuda_push_by_peer: true,
            observer: None,
            staging_bytes: 2 * (4 << 20),
            tls: None,
            rdma: RdmaConfig::default(),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_connections: 256,
            max_unauthenticated: 32,
        }
    }
}

impl EngineConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |field, value: String, reason| {
            Err(Error::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if self.name.is_empty() {
            return bad("name", String::new(), "must not be empty");
        }
        if !(1..=64).contains(&self.tcp_connections) {
            return bad(
                "tcp_connections",
                self.tcp_connections.to_string(),
                "must be 1..=64",
            );
        }
        if let Some(reason) = self.tcp_buffer.invalid() {
            return bad("tcp_buffer", self.tcp_buffer.to_string(), reason);
        }
        if self.chunk_bytes < 4096 {
            return bad(
                "chunk_bytes",
                self.chunk_bytes.to_string(),
                "must be >= 4096",
            );
        }
        if !(1..=256).contains(&self.shm_threads) {
            return bad(
                "shm_threads",
                self.shm_threads.to_string(),
                "must be 1..=256",
            );
        }
        if !(1..=u32::MAX as usize).contains(&self.max_batch_ops) {
            return bad(
                "max_batch_ops",
                self.max_batch_ops.to_string(),
                "must be 1..=2^32-1",
            );
        }
        for (field, t) in [
            ("batch_timeout", self.batch_timeout),
            ("handshake_timeout", self.handshake_timeout),
            ("idle_timeout", self.idle_timeout),
        ] {
            if t.is_zero() {
                return bad(field, "0".into(), "must be positive");
            }
        }
        if !(1..=65536).contains(&self.max_connections) {
            return bad(
                "max_connections",
                self.max_connections.to_string(),
                "must be 1..=65536",
            );
        }
        if !(1..=self.max_connections).contains(&self.max_unauthenticated) {
            return bad(
                "max_unauthenticated",
                self.max_unauthenticated.to_string(),
                "must be 1..=max_connections",
            );
        }
        for (field, t, most) in [
            ("spin_wait", self.spin_wait, Duration::from_secs(1)),
            (
                "cuda_doorbell_idle",
                self.cuda_doorbell_idle,
                Duration::from_secs(1),
            ),
        ] {
            if t > most {
                return bad(field, format!("{t:?}"), "must be at most 1 s");
            }
        }
        if self.staging_bytes != 0 && self.staging_bytes < crate::transport::staging::STAGING_MIN {
            return bad(
                "staging_bytes",
                self.staging_bytes.to_string(),
                "must be 0 (off) or >= 8192",
            );
        }
        self.rdma.validate()
    }
}
