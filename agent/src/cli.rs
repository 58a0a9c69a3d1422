//! The `kvfabric` command line: one typed config per subcommand, flags with env fallbacks.

use std::net::SocketAddr;

use clap::{Args, Parser, Subcommand, ValueEnum};

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
pub enum Command {
    /// Measure transfers against the ceiling of the same path (default: two local processes).
    Bench(BenchArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    Tcp,
    Shm,
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
