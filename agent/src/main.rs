use std::process::ExitCode;

use clap::Parser;
use kvfabric_agent::cli::{Cli, Command};
use kvfabric_agent::telemetry::{self, TraceConfig};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    kvfabric_agent::allocator::keep_freed_memory();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            // EX_USAGE for bad configuration; help and version are not errors.
            return ExitCode::from(if usage { 64 } else { 0 });
        }
    };
    let filter = match EnvFilter::try_new(&cli.log) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("invalid --log {:?}: {e}", cli.log);
            return ExitCode::from(64);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        // The agent exports traces where configured, `bench --trace` to a receiver of its own;
        // the other commands only log.
        let sink = match &cli.command {
            Command::Bench(b) if b.trace => {
                Some(kvfabric_agent::otlp_sink::Receiver::start([127, 0, 0, 1].into()).await?)
            }
            _ => None,
        };
        let trace = match &cli.command {
            Command::Agent(a) => Some(TraceConfig::resolve(
                a.otlp_endpoint.clone(),
                a.trace_sample_ratio,
            )),
            Command::Bench(_) => sink.as_ref().map(|s| TraceConfig {
                endpoint: Some(s.endpoint()),
                sample_ratio: Some(1.0),
                service_name: Some("kvfabric-bench".into()),
            }),
            _ => None,
        };
        let telemetry = telemetry::init(filter, trace, "kvfabric-agent")?;
        let result = match cli.command {
            Command::Bench(args) => kvfabric_agent::bench::run(args, &telemetry).await,
            Command::Agent(args) => {
                kvfabric_agent::server::run(args, &telemetry, kvfabric_agent::shutdown::signal())
                    .await
            }
            Command::Status(args) => kvfabric_agent::status::show(args).await,
            Command::RegistryBench(args) => kvfabric_agent::registry::bench::main(args).await,
            Command::GpuSelftest(args) => {
                tokio::task::spawn_blocking(move || kvfabric_agent::bench::selftest(args))
                    .await
                    .unwrap_or_else(|e| {
                        Err(kvfabric_agent::Error::io(
                            "gpu selftest",
                            std::io::Error::other(e),
                        ))
                    })
            }
        };
        telemetry.shutdown();
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvfabric: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
