//! The one line an agent prints on stdout once it serves, so the process that started it (a
//! script, a test, a person) learns the ports it bound.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    pub agent: String,
    pub peer: SocketAddr,
    pub metrics: SocketAddr,
    pub data: SocketAddr,
    pub socket_dir: PathBuf,
    pub registry: String,
}
