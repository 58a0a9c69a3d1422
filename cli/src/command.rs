//! The subcommands and how each one runs: its flags validated into its config, then the crate that
//! owns it does the work.

use clap::{Parser, Subcommand};
use kvfabric_agent::telemetry;
use kvfabric_agent::{Agent, AgentArgs, Listeners};
use kvfabric_proto::contract::env;
use tracing_subscriber::EnvFilter;

use crate::status::{self, StatusArgs};

#[derive(Debug, Parser)]
#[command(
    name = "kvfabric",
    version,
    about = "Move KV-cache blocks between LLM workers"
)]
pub struct Cli {
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = env::LOG, default_value = "warn", global = true)]
    pub log: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
// Parsed once per process; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run the node agent: registry entry, local API for workers, peer API for other agents,
    /// and the data plane, until SIGTERM/SIGINT.
    Agent(AgentCommand),
    /// Agents, segments and open connections, from the local agent and its registry.
    Status(StatusArgs),
    /// Measure transfers against the bound of the same path (default: two local processes).
    #[cfg(feature = "bench")]
    Bench(kvfabric_bench::args::BenchArgs),
    /// Registry at scale against one real etcd: simulated agents and segments, lookup latency
    /// from the watch cache, and how fast a new segment reaches every watcher.
    #[cfg(feature = "bench")]
    RegistryBench(kvfabric_bench::args::RegistryBenchArgs),
    /// Check the GPU copy paths: random sizes at unaligned offsets, both directions, sm and ce,
    /// every byte compared with the same copies done on the host.
    #[cfg(feature = "bench")]
    GpuSelftest(kvfabric_bench::args::SelftestArgs),
}

#[derive(Debug, clap::Args)]
pub struct AgentCommand {
    #[command(flatten)]
    pub args: AgentArgs,

    /// Validate the configuration, print what it resolved to (JSON) and exit: 0 when it is
    /// good, 64 when not.
    #[arg(long)]
    pub check_config: bool,
}

/// Why a command failed, and the exit status that says so.
#[derive(Debug)]
pub struct Failed {
    pub message: String,
    pub exit_code: u8,
}

impl Failed {
    fn new(e: impl std::fmt::Display, exit_code: u8) -> Self {
        Failed {
            message: e.to_string(),
            exit_code,
        }
    }
}

impl From<kvfabric_agent::Error> for Failed {
    fn from(e: kvfabric_agent::Error) -> Self {
        let code = e.exit_code();
        Failed::new(e, code)
    }
}

#[cfg(feature = "bench")]
impl From<kvfabric_bench::Error> for Failed {
    fn from(e: kvfabric_bench::Error) -> Self {
        let code = e.exit_code();
        Failed::new(e, code)
    }
}

impl Command {
    pub async fn run(self, filter: EnvFilter) -> Result<(), Failed> {
        match self {
            Command::Agent(cmd) => agent(cmd, filter).await,
            Command::Status(args) => {
                telemetry::init(filter, None, "kvfabric")?;
                status::show(args).await.map_err(|e| Failed::new(e, 1))
            }
            #[cfg(feature = "bench")]
            Command::Bench(args) => Ok(kvfabric_bench::main(args, filter).await?),
            #[cfg(feature = "bench")]
            Command::RegistryBench(args) => {
                telemetry::init(filter, None, "kvfabric")?;
                Ok(kvfabric_bench::registry::main(args).await?)
            }
            #[cfg(feature = "bench")]
            Command::GpuSelftest(args) => {
                telemetry::init(filter, None, "kvfabric")?;
                tokio::task::spawn_blocking(move || kvfabric_bench::selftest(args))
                    .await
                    .map_err(|e| Failed::new(e, 1))??;
                Ok(())
            }
        }
    }
}

/// `kvfabric agent`: config, trace pipeline, registry, sockets, serve until a signal, drain.
async fn agent(cmd: AgentCommand, filter: EnvFilter) -> Result<(), Failed> {
    let config = cmd.args.validate()?;
    if cmd.check_config {
        println!("{}", config.summary());
        return Ok(());
    }
    let telemetry = telemetry::init(filter, Some(config.trace.clone()), "kvfabric-agent")?;
    let result = async {
        let registry = kvfabric_agent::registry::open(config.etcd.clone()).await?;
        let listeners = Listeners::bind(&config).await?;
        let agent = Agent::start(config, listeners, registry, &telemetry).await?;
        // The parent process (or a person) reads this line to learn the bound ports.
        if let Ok(line) = serde_json::to_string(agent.ready()) {
            println!("{line}");
        }
        agent.serve(kvfabric_rt::shutdown::signal()).await
    }
    .await;
    telemetry.shutdown();
    Ok(result?)
}
