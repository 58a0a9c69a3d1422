//! Which transport carries a peer: a leaf noun, below the error type.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::parse_error::ParseError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransportKind {
    Tcp,
    Shm,
    CudaIpc,
    Rdma,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::CudaIpc => "cuda-ipc",
            TransportKind::Rdma => "rdma",
        })
    }
}

impl std::str::FromStr for TransportKind {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        match s {
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            "cuda-ipc" => Ok(TransportKind::CudaIpc),
            "rdma" => Ok(TransportKind::Rdma),
            other => Err(ParseError {
                field: "transport",
                value: other.into(),
                expected: "expected tcp, shm, cuda-ipc or rdma",
            }),
        }
    }
}
