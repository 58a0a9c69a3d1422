//! The kvfabric node agent and CLI.

pub mod allocator;
pub mod bench;
pub mod bytesize;
pub mod cli;
pub mod client;
pub mod discovery;
mod error;
pub mod fd_socket;
pub mod local_api;
pub mod metrics;
pub mod node;
pub mod otlp_sink;
pub mod peer_api;
pub mod peer_link;
pub mod peer_token;
pub mod registry;
pub mod rpc;
pub mod server;
pub mod shutdown;
pub mod status;
pub mod telemetry;
pub mod testkit;

pub use error::{Error, Result};
