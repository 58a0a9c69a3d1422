//! The kvfabric node agent: publishes itself and its workers' memory in the registry, serves the
//! local API (workers) and the peer API (other agents), and moves batches through the engine.
//! `serve` runs one from an [`AgentConfig`]; the `kvfabric` binary (crate `kvfabric-cli`)
//! parses the flags and environment into one.

pub mod allocator;
pub mod authority;
pub mod config;
pub mod discovery;
mod error;
pub mod fd_socket;
pub mod fd_stash;
pub mod holds;
pub mod incoming;
pub mod local_api;
pub mod message_limit;
pub mod metrics;
pub mod node;
pub mod peer_api;
pub mod peer_link;
pub mod peer_tls;
pub mod peer_token;
pub mod readiness;
pub mod registry;
pub mod rpc;
pub mod server;
pub mod status;
pub mod telemetry;
mod write_through;

pub use config::{AgentArgs, AgentConfig};
pub use error::{Error, Result};
pub use server::{Agent, Listeners};
