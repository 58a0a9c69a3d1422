//! Real components for kvfabric's tests and benchmarks, never linked by a production crate: a
//! throwaway etcd ([`EtcdServer`]), an OTLP trace receiver ([`otlp::Receiver`]), and agents served
//! by a task of the calling process ([`InProcessAgent`]).

mod agent;
mod error;
pub mod etcd;
pub mod otlp;

pub use agent::InProcessAgent;
pub use error::{Error, Result};
pub use etcd::EtcdServer;
