//! kvfabric's wire contracts, shared by everything that talks to an agent: the gRPC APIs (the
//! .proto files and their generated Rust, committed so that building needs no `protoc`), the
//! socket names and message limits, the status and registry documents, the environment the
//! operator sets and the agent reads, and how engine error kinds become gRPC codes.
//!
//! Without default features this crate is the contract alone (constants and serde documents),
//! which is what the operator links.

#![forbid(unsafe_code)]

pub mod bytesize;
pub mod contract;
pub mod entry;
pub mod fd_wire;
pub mod limits;
pub mod ready;
pub mod status;

#[cfg(feature = "engine")]
pub mod code;

/// The generated gRPC types, clients and servers of `kvfabric/v1/agent.proto`.
#[cfg(feature = "grpc")]
#[allow(clippy::all, missing_debug_implementations, unreachable_pub)]
pub mod pb {
    include!("gen/kvfabric.v1.rs");
}
