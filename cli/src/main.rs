//! `kvfabric`: parse the command line and environment into a subcommand's validated config (exit
//! 64 when it is bad), run it until it ends or SIGTERM/SIGINT, exit with its status.

#![forbid(unsafe_code)]

mod command;
mod status;

use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

use command::Cli;

/// The command line or environment is wrong (each crate's `exit_code` says 64 for its
/// configuration errors too).
use kvfabric_rt::args::EXIT_USAGE as EXIT_CONFIG;

fn main() -> ExitCode {
    kvfabric_agent::allocator::keep_freed_memory();
    let cli: Cli = match kvfabric_rt::args::parse() {
        Ok(cli) => cli,
        Err(exit) => return exit,
    };
    let filter = match EnvFilter::try_new(&cli.log) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("invalid --log {:?}: {e}", cli.log);
            return ExitCode::from(EXIT_CONFIG);
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
    match runtime.block_on(cli.command.run(filter)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failed) => {
            eprintln!("kvfabric: {}", failed.message);
            ExitCode::from(failed.exit_code)
        }
    }
}
