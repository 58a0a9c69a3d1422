//! The kvfabric node agent and CLI.

pub mod bench;
pub mod bytesize;
pub mod cli;
pub mod discovery;
mod error;
pub mod registry;
pub mod shutdown;
pub mod testkit;

pub use error::{Error, Result};
