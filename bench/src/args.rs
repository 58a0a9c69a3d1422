//! `kvfabric bench`, `registry-bench` and `gpu-selftest` flags.

use std::net::SocketAddr;

use clap::{Args, ValueEnum};
use kvfabric_agent::config::parse_location;
use kvfabric_engine::{CudaPath, Location};

use kvfabric_proto::bytesize;

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

/// What the test hook `--test-corrupt` changes after the timed phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CorruptArg {
    /// One byte of a written destination block flipped, one byte written into a destination
    /// block the row never wrote.
    Destination,
    /// One byte written into the source pool.
    Source,
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

    /// Kernel buffers of each tcp data connection, both processes: `auto` (256 KiB between
    /// processes of one host, autotuning elsewhere), `kernel` (autotuning), or a size.
    #[arg(long, env = "KVFABRIC_TCP_BUFFER", default_value = "auto", value_parser = bytesize::parse_tcp_buffer)]
    pub tcp_buffer: kvfabric_engine::TcpBuffer,

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

    /// With --through-agent: both agents with mTLS (peer API and tcp data port), certificates
    /// of a throwaway CA, to measure what TLS costs.
    #[arg(long, requires = "through_agent")]
    pub tls: bool,

    /// With --tls: the data port's records sealed by the kernel where it offers TLS (`true`) or
    /// in userspace (`false`, the agents' default), to compare the two.
    #[arg(long, requires = "tls", default_value_t = false, action = clap::ArgAction::Set)]
    pub tls_kernel_records: bool,

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

    /// µs a batch waiting on its own thread polls for its reply before it sleeps, and the target
    /// polls a data connection for the next request (`EngineConfig::spin_wait`; each poll holds
    /// a core). Default: the engine's (50), or 200 with --cuda-spin.
    #[arg(long, value_parser = clap::value_parser!(u64).range(..=1_000_000))]
    pub busy_poll_us: Option<u64>,

    /// Half the batches pull and half push, at the same time (needs an even --concurrency).
    #[arg(long)]
    pub bidirectional: bool,

    /// Pinned host bytes per tcp connection and direction through which GPU memory travels over
    /// tcp (0: GPU memory over tcp and shm is refused with StagingNotConfigured).
    #[arg(long, env = "KVFABRIC_STAGING_BYTES", default_value = "8MiB", value_parser = bytesize::parse)]
    pub staging_bytes: u64,

    /// Test hook for the bench's own tests (hidden): after the timed phase, change the pools as
    /// a faulty transport would, so that verification must fail naming the blocks changed.
    #[arg(long, value_enum, env = "KVFABRIC_BENCH_CORRUPT", hide = true)]
    pub test_corrupt: Option<CorruptArg>,

    /// How batches are given to the engine: `ops` (explicit block ops, the default) or
    /// `planes[:N]` (block tables: N planes, default layers × K/V, and block-id pairs shared by
    /// all; a batch of --blocks-per-batch ops is that many / N pairs). With `planes` and the
    /// default shape, rows at the model's block size and at the TP-sharded one (--tp).
    #[arg(long = "layout", default_value = "ops", value_parser = crate::layout::parse_form)]
    pub form: crate::layout::BatchForm,

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
    /// Tensor-parallel ranks of the decode side for the sharded rows of `--layout planes`: each
    /// rank holds kv_heads / tp heads (default: one head per rank, 4 KiB blocks for Llama-3-8B).
    #[arg(long)]
    pub tp: Option<u64>,
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

impl BenchArgs {
    /// How long waiting threads poll before they sleep (`EngineConfig::spin_wait`).
    pub fn spin_wait(&self) -> std::time::Duration {
        match (self.busy_poll_us, self.cuda_spin) {
            (Some(us), _) => std::time::Duration::from_micros(us),
            (None, true) => std::time::Duration::from_micros(200),
            // The engine's default completion, as a user gets it.
            (None, false) => kvfabric_engine::EngineConfig::default().spin_wait,
        }
    }
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
