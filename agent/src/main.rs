use std::process::ExitCode;

use clap::Parser;
use kvfabric_agent::cli::{Cli, Command};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
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
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
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
        match cli.command {
            Command::Bench(args) => kvfabric_agent::bench::run(args).await,
            Command::Agent(args) => {
                kvfabric_agent::server::run(args, kvfabric_agent::shutdown::signal()).await
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
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvfabric: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
