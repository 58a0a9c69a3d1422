//! The transports an agent may use, in the spelling of the CRD.

use std::borrow::Cow;
use std::fmt;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// One data-plane transport. The schema only admits the four known values; `Unknown` exists so an
/// object that bypassed the schema (or was written by a newer version) still deserializes, and the
/// reconciler can report it as a `Degraded` condition instead of the watcher dropping the object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum Transport {
    /// RDMA verbs (InfiniBand / RoCE).
    Rdma,
    /// CUDA IPC between processes on one node.
    CudaIpc,
    /// Shared host memory on one node.
    Shm,
    /// TCP, the fallback that always works.
    Tcp,
    /// A value the schema would have rejected.
    Unknown(String),
}

impl Transport {
    /// Every known transport, in the default order of preference.
    pub const KNOWN: [Transport; 4] = [
        Transport::Rdma,
        Transport::CudaIpc,
        Transport::Shm,
        Transport::Tcp,
    ];

    /// The CRD spelling.
    pub fn as_str(&self) -> &str {
        match self {
            Transport::Rdma => "rdma",
            Transport::CudaIpc => "cuda-ipc",
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Unknown(s) => s,
        }
    }
}

impl From<String> for Transport {
    fn from(s: String) -> Self {
        match s.as_str() {
            "rdma" => Transport::Rdma,
            "cuda-ipc" => Transport::CudaIpc,
            "shm" => Transport::Shm,
            "tcp" => Transport::Tcp,
            _ => Transport::Unknown(s),
        }
    }
}

impl From<Transport> for String {
    fn from(t: Transport) -> Self {
        t.as_str().to_owned()
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl JsonSchema for Transport {
    fn schema_name() -> Cow<'static, str> {
        "Transport".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "enum": ["rdma", "cuda-ipc", "shm", "tcp"],
        })
    }
}
