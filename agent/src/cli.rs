//! The `kvfabric` command line: one typed config per subcommand, flags with env fallbacks.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvfabric_engine::{CudaPath, Location, TransportKind};

use crate::bytesize;

#[derive(Debug, Parser)]
#[command(
    name = "kvfabric",
    version,
    about = "Move KV-cache blocks between LLM workers"
)]
pub struct Cli {
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "KVFABRIC_LOG", default_value = "warn", global = true)]
    pub log: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
// Parsed once per process; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Measure transfers against the ceiling of the same path (default: two local processes).
    Bench(BenchArgs),
    /// Run the node agent: registry entry, local API for workers, peer API for other agents,
    /// and the data plane, until SIGTERM/SIGINT.
    Agent(AgentArgs),
    /// Agents, segments and open connections, from the local agent and its registry.
    Status(StatusArgs),
    /// Registry at scale against one real etcd: simulated agents and segments, lookup latency
    /// from the watch cache, and how fast a new segment reaches every watcher.
    RegistryBench(RegistryBenchArgs),
    /// Check the GPU copy paths: random sizes at unaligned offsets, both directions, sm and ce,
    /// every byte compared with the same copies done on the host.
    GpuSelftest(SelftestArgs),
}

#[derive(Debug, Clone, Args)]
pub struct SelftestArgs {
    /// The two devices to copy between ("0,1"; "0,0" on a one-GPU machine).
    #[arg(long, default_value = "0,1", value_parser = parse_pair)]
    pub devices: (u32, u32),
    /// Batches per path and direction.
    #[arg(long, default_value_t = 8)]
    pub rounds: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn parse_pair(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?} is not two device numbers (e.g. 0,1)"))?;
    let n = |x: &str| {
        x.trim()
            .parse::<u32>()
            .map_err(|_| format!("{x:?} is not a device number"))
    };
    Ok((n(a)?, n(b)?))
}

/// The inverse of [`parse_location`].
pub fn location_name(location: Location) -> String {
    match location {
        Location::Host { .. } => "host".into(),
        Location::Cuda { device } => format!("cuda:{device}"),
    }
}

/// `host` or `cuda:N`.
pub fn parse_location(s: &str) -> Result<Location, String> {
    if s == "host" {
        return Ok(Location::Host { numa: None });
    }
    s.strip_prefix("cuda:")
        .and_then(|d| d.parse::<u32>().ok())
        .map(|device| Location::Cuda { device })
        .ok_or_else(|| format!("{s:?} is not a location (host or cuda:N)"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    Tcp,
    Shm,
    CudaIpc,
    /// One-sided RDMA READ/WRITE (needs an RDMA device on both ends and a build with the cargo
    /// feature `rdma`; the target must be started with `--transport rdma` too).
    Rdma,
    Auto,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OpArg {
    Read,
    Write,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Transport to measure (default: tcp and shm, one row each).
    #[arg(long, value_enum)]
    pub transport: Option<TransportArg>,

    /// read = pull from the target, write = push to it (default: both).
    #[arg(long, value_enum)]
    pub op: Option<OpArg>,

    /// Bytes per block op (default: one KV block of the model layout below).
    #[arg(long, value_parser = bytesize::parse)]
    pub block_size: Option<u64>,

    /// Block ops per batch (default: every block of a 512-token request, all layers, K and V).
    #[arg(long)]
    pub blocks_per_batch: Option<usize>,

    /// KV pool registered on each side.
    #[arg(long, default_value = "1GiB", value_parser = bytesize::parse)]
    pub pool_bytes: u64,

    /// Batches in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,

    /// Seconds of timed transfers per row.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,

    /// Carry a crc32c of every block and verify it on arrival.
    #[arg(long)]
    pub checksum: bool,

    /// One JSON object per result row instead of a table.
    #[arg(long)]
    pub json: bool,

    /// Serve as the target on this control address until SIGTERM/SIGINT.
    #[arg(long, conflicts_with = "connect")]
    pub serve: Option<SocketAddr>,

    /// Run as the initiator against a target started with --serve.
    #[arg(long)]
    pub connect: Option<SocketAddr>,

    /// TCP data connections per peer.
    #[arg(long, env = "KVFABRIC_TCP_CONNECTIONS", default_value_t = 4)]
    pub connections: usize,

    /// Segment key the target requires in the handshake (none: open).
    #[arg(long, env = "KVFABRIC_SEGMENT_KEY")]
    pub key: Option<u64>,

    /// Compare engine-to-engine pulls with the same pulls through two agents (worker → local
    /// agent → peer agent → worker memory) over tcp on loopback.
    #[arg(long, conflicts_with_all = ["serve", "connect"])]
    pub through_agent: bool,

    /// With --through-agent: export every span (100% sampling) over OTLP to a receiver in this
    /// process, to measure what tracing costs.
    #[arg(long, requires = "through_agent")]
    pub trace: bool,

    /// Skip the single-block latency row of the default run.
    #[arg(long)]
    pub no_latency: bool,

    /// Where this side's pool lives: host or cuda:N.
    #[arg(long, default_value = "host", value_parser = parse_location)]
    pub location: Location,

    /// Where the target's pool lives: host or cuda:N.
    #[arg(long, default_value = "host", value_parser = parse_location)]
    pub peer_location: Location,

    /// How cuda-ipc moves a batch: sm (one kernel), ce (copy engines, no SMs), or auto (ce
    /// for a batch between two GPUs whose copies average 1 MiB or more, else sm).
    #[arg(long, default_value = "auto")]
    pub cuda_path: CudaPath,

    /// cuda-ipc completion threads poll instead of sleeping (lower latency, one busy core).
    #[arg(long)]
    pub cuda_spin: bool,

    /// Half the batches pull and half push, at the same time (needs an even --concurrency).
    #[arg(long)]
    pub bidirectional: bool,

    /// Pinned host bytes per tcp connection and direction through which GPU memory travels over
    /// tcp (0: GPU memory over tcp and shm is refused with StagingNotConfigured).
    #[arg(long, env = "KVFABRIC_STAGING_BYTES", default_value = "8MiB", value_parser = bytesize::parse)]
    pub staging_bytes: u64,

    #[command(flatten)]
    pub layout: LayoutArgs,
}

/// The KV cache shape that sets the default block size (default: Llama-3-8B).
#[derive(Debug, Clone, Args)]
pub struct LayoutArgs {
    #[arg(long, default_value = "Llama-3-8B")]
    pub model: String,
    #[arg(long, default_value_t = 32)]
    pub layers: u64,
    #[arg(long, default_value_t = 16)]
    pub tokens_per_block: u64,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: u64,
    #[arg(long, default_value_t = 128)]
    pub head_dim: u64,
    /// Bytes per element (bf16 = 2).
    #[arg(long, default_value_t = 2)]
    pub dtype_bytes: u64,
    /// Prompt length whose blocks make one batch.
    #[arg(long, default_value_t = 512)]
    pub request_tokens: u64,
}

/// `tcp`, `shm`, `cuda-ipc` or `rdma`.
pub fn parse_transport(s: &str) -> Result<TransportKind, String> {
    match s.trim() {
        "tcp" => Ok(TransportKind::Tcp),
        "shm" => Ok(TransportKind::Shm),
        "cuda-ipc" => Ok(TransportKind::CudaIpc),
        "rdma" => Ok(TransportKind::Rdma),
        other => Err(format!(
            "{other:?} is not a transport (tcp, shm, cuda-ipc, rdma)"
        )),
    }
}

/// `kvfabric agent`. Every flag reads the environment variable the operator's DaemonSet and
/// ConfigMap set (see docs/operator.md).
#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// The TransferFabric this agent belongs to.
    #[arg(long, env = "KVFABRIC_FABRIC", default_value = "default")]
    pub fabric: String,

    /// Pool this agent serves.
    #[arg(long, env = "KVFABRIC_POOL", default_value = "default")]
    pub pool: String,

    /// Agent name, unique in the fabric (default: $NODE_NAME, else the host name).
    #[arg(long, env = "KVFABRIC_AGENT_NAME")]
    pub name: Option<String>,

    /// etcd endpoints (comma-separated). None: an in-memory registry (this agent alone).
    #[arg(long, env = "KVFABRIC_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,

    #[arg(long, env = "KVFABRIC_ETCD_KEY_PREFIX", default_value = "/kvfabric")]
    pub etcd_key_prefix: String,

    #[arg(long, env = "KVFABRIC_ETCD_USERNAME")]
    pub etcd_username: Option<String>,

    #[arg(long, env = "KVFABRIC_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,

    /// Shared secret of this fabric's agents (at least 16 printable ASCII characters): sent
    /// to other agents' peer API and required of its callers, since that API hands out region
    /// keys. Set it from a Secret (the operator does: `spec.peerTokenSecret`).
    #[arg(long, env = "KVFABRIC_PEER_TOKEN", hide_env_values = true)]
    pub peer_token: Option<String>,

    /// Directory with ca.crt (and tls.crt + tls.key for a client certificate).
    #[arg(long, env = "KVFABRIC_ETCD_TLS_DIR")]
    pub etcd_tls_dir: Option<PathBuf>,

    /// Registry lease TTL: a dead agent's entries vanish this long after its last keepalive.
    #[arg(long, env = "KVFABRIC_LEASE_TTL_SECS", default_value_t = 10)]
    pub lease_ttl_secs: u64,

    /// Directory of the local API socket (agent.sock), its fd socket (agent.fd.sock) and the
    /// shm data socket (shm.sock); workers mount it.
    #[arg(long, env = "KVFABRIC_SOCKET_DIR", default_value = "/var/run/kvfabric")]
    pub socket_dir: PathBuf,

    /// Peer API (gRPC) listen address.
    #[arg(long, env = "KVFABRIC_GRPC_ADDR", default_value = "0.0.0.0:50051")]
    pub grpc_addr: SocketAddr,

    /// tcp data plane listen address.
    #[arg(long, env = "KVFABRIC_DATA_ADDR", default_value = "0.0.0.0:50052")]
    pub data_addr: SocketAddr,

    /// Address other agents reach this one at (default: $POD_IP, else the listen address, else
    /// the first non-loopback address).
    #[arg(long, env = "KVFABRIC_ADVERTISE_ADDR")]
    pub advertise_addr: Option<IpAddr>,

    /// Transports this agent may use, in order of preference.
    #[arg(
        long,
        env = "KVFABRIC_TRANSPORTS",
        value_delimiter = ',',
        value_parser = parse_transport,
        default_value = "cuda-ipc,shm,rdma,tcp"
    )]
    pub transports: Vec<TransportKind>,

    /// TCP data connections per peer agent.
    #[arg(long, env = "KVFABRIC_TCP_CONNECTIONS", default_value_t = 4)]
    pub tcp_connections: usize,

    /// RDMA devices (and ports) the agent may use: `mlx5_0,mlx5_1:1`, `^mlx5_2` excludes (empty:
    /// every device allocated to the pod).
    #[arg(long, env = "KVFABRIC_RDMA_DEVICES", default_value = "", value_parser = parse_rdma_devices)]
    pub rdma_devices: kvfabric_engine::rdma::DeviceFilter,

    /// GID table index every RDMA port sends from (`auto`: RoCE v2 with IPv4 first).
    #[arg(long, env = "KVFABRIC_RDMA_GID_INDEX", default_value = "auto", value_parser = parse_gid_index)]
    pub rdma_gid_index: kvfabric_engine::rdma::GidChoice,

    /// RC QPs per peer agent on each RDMA NIC.
    #[arg(long, env = "KVFABRIC_RDMA_QPS_PER_PEER", default_value_t = 2)]
    pub rdma_qps_per_peer: usize,

    /// Default time one batch may take.
    #[arg(long, env = "KVFABRIC_BATCH_TIMEOUT_MS", default_value_t = 30_000)]
    pub batch_timeout_ms: u64,

    /// Most block ops in one submitted batch.
    #[arg(long, env = "KVFABRIC_MAX_BATCH_OPS", default_value_t = 65_536)]
    pub max_batch_ops: usize,

    /// How cuda-ipc moves a batch between GPUs of this node: sm (one kernel), ce (copy
    /// engines, no SMs), or auto (ce for a batch between two GPUs whose copies average 1 MiB
    /// or more, else sm).
    #[arg(long, env = "KVFABRIC_CUDA_PATH", default_value = "auto")]
    pub cuda_path: CudaPath,

    /// How long dialling another agent may take.
    #[arg(long, env = "KVFABRIC_CONNECT_TIMEOUT_MS", default_value_t = 3_000)]
    pub connect_timeout_ms: u64,

    /// Prometheus metrics (`/metrics`) and `/healthz` listen address.
    #[arg(long, env = "KVFABRIC_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,

    /// OTLP gRPC collector for traces (OTEL_EXPORTER_OTLP_ENDPOINT, when set, wins). None: no
    /// trace export.
    #[arg(long, env = "KVFABRIC_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Share of traces kept, 0..=1 (OTEL_TRACES_SAMPLER, when set, wins).
    #[arg(long, env = "KVFABRIC_TRACE_SAMPLE_RATIO", value_parser = parse_ratio)]
    pub trace_sample_ratio: Option<f64>,

    /// After SIGTERM, how long in-flight transfers may take to finish.
    #[arg(long, env = "KVFABRIC_GRACE_SECS", default_value_t = 10)]
    pub grace_secs: u64,
}

/// `kvfabric status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// The local agent's socket directory.
    #[arg(long, env = "KVFABRIC_SOCKET_DIR", default_value = "/var/run/kvfabric")]
    pub socket_dir: PathBuf,

    /// The status document as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// `kvfabric registry-bench`.
#[derive(Debug, Clone, Args)]
pub struct RegistryBenchArgs {
    /// etcd to load (default: start a private etcd from the `etcd` binary on a free port).
    #[arg(long, env = "KVFABRIC_ETCD_ENDPOINT")]
    pub etcd_endpoint: Option<String>,
    #[arg(long, default_value_t = 1000)]
    pub agents: usize,
    #[arg(long, default_value_t = 10_000)]
    pub segments: usize,
    /// Watch caches, each reading the whole fabric and then following it.
    #[arg(long, default_value_t = 8)]
    pub watchers: usize,
    /// Segments put one at a time to time their visibility at every watcher.
    #[arg(long, default_value_t = 200)]
    pub new_segments: usize,
    /// The report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_rdma_devices(s: &str) -> Result<kvfabric_engine::rdma::DeviceFilter, String> {
    s.parse().map_err(|e: kvfabric_engine::Error| e.to_string())
}

fn parse_gid_index(s: &str) -> Result<kvfabric_engine::rdma::GidChoice, String> {
    s.parse().map_err(|e: kvfabric_engine::Error| e.to_string())
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a ratio between 0 and 1")),
    }
}
