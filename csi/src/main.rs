//! kvfabric-csi binary: parse the config, read the state, serve the CSI and registration sockets
//! until SIGTERM/SIGINT or a refused registration.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use kvfabric_csi::config::Cli;
use kvfabric_csi::node::Node;
use kvfabric_csi::server::{bind, serve};

use kvfabric_rt::args::{EXIT_USAGE, parse};

#[tokio::main]
async fn main() -> ExitCode {
    let cli: Cli = match parse() {
        Ok(c) => c,
        Err(exit) => return exit,
    };
    let config = match cli.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvfabric-csi: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let run = async {
        let csi_path = config.csi_socket();
        let registration_path = config.registration_socket();
        let node = Node::open(config)?;
        let csi = bind(&csi_path)?;
        let registration = bind(&registration_path)?;
        tracing::info!(csi = %csi_path.display(), registration = %registration_path.display(), "serving");
        serve(
            node,
            (csi, csi_path),
            (registration, registration_path),
            kvfabric_rt::shutdown::signal(),
        )
        .await
    };
    match run.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "exiting");
            eprintln!("kvfabric-csi: {e}");
            ExitCode::FAILURE
        }
    }
}
