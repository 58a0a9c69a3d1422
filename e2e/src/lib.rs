//! Harness for whole-system tests: the `kvfabric` binary run as agent processes, each in its own
//! network namespace on a bridge (or on loopback where namespaces cannot be made), a real etcd
//! reachable from all of them, and workers that talk to the agents through the client library.

pub mod agent;
pub mod chaos;
pub mod net;
pub mod worker;

pub use agent::{AgentProcess, fault_flags, kvfabric_bin, operator_bin};
pub use net::{Host, Network};
