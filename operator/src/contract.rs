//! The operator↔agent contract lives in `kvfabric_proto::contract`, which the agent reads too.

pub use kvfabric_proto::contract::*;
