//! The `kvfabric` command line: one typed config per subcommand, flags with env fallbacks.

use std::net::SocketAddr;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvfabric_engine::Location;

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
pub enum CudaPathArg {
    /// One kernel launch over a device-side op list.
    Sm,
    /// The copy engines (cuMemcpyBatchAsync), no SMs.
    Ce,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    Tcp,
    Shm,
    CudaIpc,
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

    /// Skip the single-block latency row of the default run.
    #[arg(long)]
    pub no_latency: bool,

    /// Where this side's pool lives: host or cuda:N.
    #[arg(long, default_value = "host", value_parser = parse_location)]
    pub location: Location,

    /// Where the target's pool lives: host or cuda:N.
    #[arg(long, default_value = "host", value_parser = parse_location)]
    pub peer_location: Location,

    /// How cuda-ipc moves a batch: sm (one kernel) or ce (copy engines).
    #[arg(long, value_enum, default_value = "sm")]
    pub cuda_path: CudaPathArg,

    /// cuda-ipc completion threads poll instead of sleeping (lower latency, one busy core).
    #[arg(long)]
    pub cuda_spin: bool,

    /// Half the batches pull and half push, at the same time (needs an even --concurrency).
    #[arg(long)]
    pub bidirectional: bool,

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
