//! Real components for kvfabric's tests and benchmarks, never linked by a production crate: a
//! throwaway etcd ([`EtcdServer`]) and etcd cluster of several members ([`EtcdCluster`]), an
//! OTLP trace receiver ([`otlp::Receiver`]), agents served by a task of the calling process
//! ([`InProcessAgent`], feature `agent`), and skips that are counted, and refused in CI
//! ([`skip::skip`]).

#![forbid(unsafe_code)]

#[cfg(feature = "agent")]
mod agent;
pub mod cluster;
mod error;
pub mod etcd;
pub mod otlp;
pub mod skip;
pub mod tls;

#[cfg(feature = "agent")]
pub use agent::InProcessAgent;
pub use cluster::EtcdCluster;
pub use error::{Error, Result};
pub use etcd::EtcdServer;
pub use tls::{TestCa, TestCert};
