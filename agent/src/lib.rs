//! The kvfabric node agent and CLI.

pub mod bench;
pub mod bytesize;
pub mod cli;
pub mod discovery;
mod error;
pub mod shutdown;

pub use error::{Error, Result};
