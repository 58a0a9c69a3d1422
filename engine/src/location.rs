//! Where memory lives: a leaf noun, below the error type.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Location {
    Host { numa: Option<u32> },
    Cuda { device: u32 },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Host { numa: Some(n) } => write!(f, "host(numa {n})"),
            Location::Host { numa: None } => f.write_str("host"),
            Location::Cuda { device } => write!(f, "cuda:{device}"),
        }
    }
}
