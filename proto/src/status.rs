//! The status document: what `kvfabric status` prints and the local API's `Status` call returns
//! (as JSON, so scripts read one schema that can grow without proto churn).

use serde::{Deserialize, Serialize};

use crate::entry::AgentEntry;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusDoc {
    pub agent: String,
    pub fabric: String,
    pub pool: String,
    pub peer_addr: String,
    pub transports: Vec<String>,
    pub registry: RegistryState,
    pub agents: Vec<AgentEntry>,
    pub segments: Vec<SegmentRow>,
    pub connections: Vec<ConnectionRow>,
    /// Bytes moved by connections that have since closed.
    pub closed_bytes: u64,
    /// TLS on the tcp data port, and where its records are sealed; None: plaintext.
    #[serde(default)]
    pub data_tls: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SegmentRow {
    pub name: String,
    pub agent: String,
    pub regions: usize,
    pub bytes: u64,
    pub locations: Vec<String>,
    /// Registered with this agent (its memory is mapped here).
    pub local: bool,
    /// In the registry. A local segment that is not is waiting for the registry to answer.
    #[serde(default = "yes")]
    pub published: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectionRow {
    pub agent: String,
    pub transport: String,
    pub reason: String,
    pub connections: usize,
    pub bytes: u64,
    pub batches: u64,
    pub errors: u64,
    pub open_secs: u64,
}

/// Health of the registry connection, for `kvfabric status` and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryState {
    /// `memory` or `etcd`.
    pub backend: String,
    /// etcd endpoints (empty for memory).
    pub endpoints: Vec<String>,
    /// The registry answered the last request or keepalive.
    pub connected: bool,
    /// Current lease (0 for memory).
    pub lease_id: i64,
    pub lease_ttl_secs: u64,
    /// Times the lease was lost and everything re-registered under a new one.
    pub reregistrations: u64,
    /// Times the watch had to read everything again (a relist: etcd had compacted the
    /// revisions it needed). The first read at start is not counted.
    pub resyncs: u64,
    /// Times the watch was opened again from the last revision it had applied, without reading
    /// everything again (its stream broke: a member died, a connection dropped, etcd lost its
    /// leader). Older agents do not report it (0).
    #[serde(default)]
    pub watch_resumes: u64,
    pub agents: usize,
    pub segments: usize,
    /// The last error talking to the registry, if any since the last success.
    pub last_error: Option<String>,
}
