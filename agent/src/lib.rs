//! The kvfabric node agent: publishes itself and its workers' memory in the registry, serves the
//! local API (workers) and the peer API (other agents), and moves batches through the engine.
//! `serve` runs one from an [`AgentConfig`]; the `kvfabric` binary (crate `kvfabric-cli`)
//! parses the flags and environment into one.

// What only the agent uses is crate-private, so the compiler flags it once it is unused.
#![warn(unreachable_pub)]

pub mod allocator;
pub mod authority;
pub mod config;
pub mod discovery;
mod error;
pub mod fd_socket;
pub mod fd_stash;
mod holds;
mod inbox;
pub mod incoming;
mod local_api;
mod message_limit;
pub mod metrics;
mod node;
mod peer_api;
mod peer_link;
pub mod peer_tls;
pub mod peer_token;
mod readiness;
pub mod registry;
mod rpc;
pub mod server;
mod status;
pub mod telemetry;
mod write_through;

pub use config::{AgentArgs, AgentConfig};
pub use error::{Error, Result};
pub use server::{Agent, Listeners};
