//! Where agents and segments are found: etcd in production, memory when no etcd is given.
//!
//! Keys live under `<prefix>/<fabric>/agents/<agent>` and `<prefix>/<fabric>/segments/<segment>`
//! with JSON values. Everything an agent writes is bound to its lease, so a dead agent's keys
//! vanish with the lease. Lookups read a local cache kept current by a watch: the transfer path
//! never waits on the registry.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use kvfabric_engine::{Location, RegionId};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::error::{Error, Result};
pub use kvfabric_proto::entry::AgentEntry;
pub use kvfabric_proto::status::RegistryState;

pub mod etcd;
pub mod memory;

pub use etcd::{EtcdConfig, EtcdRegistry, EtcdTls};
pub use memory::{MemoryRegistry, MemoryStore};

/// One region of a published segment. Keys are never published: whoever may read a segment gets
/// its key from the segment's owner, out of band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRegion {
    pub id: RegionId,
    pub len: u64,
    pub location: Location,
}

/// What a worker publishes through its agent: named memory that others can pull from or push to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentEntry {
    /// Unique in the fabric.
    pub name: String,
    /// The agent that serves the segment's memory.
    pub agent: String,
    pub regions: Vec<SegmentRegion>,
}

/// A change seen by the watch (own writes included).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    AgentPut(AgentEntry),
    AgentDeleted(String),
    SegmentPut(SegmentEntry),
    SegmentDeleted(String),
    /// The watch had to start over (compaction, reconnect): the cache was rebuilt from a full
    /// read, and incremental events may have been skipped.
    Resynced,
}

/// Agents and segments of one fabric.
#[async_trait]
pub trait Registry: Send + Sync + fmt::Debug {
    /// Publishes (or replaces) this agent's entry, bound to its lease and re-published whenever
    /// the lease is lost and renewed.
    async fn register_agent(&self, entry: AgentEntry) -> Result<()>;
    /// Publishes (or replaces) a segment served by this agent, bound to the same lease.
    async fn put_segment(&self, entry: SegmentEntry) -> Result<()>;
    /// Unpublishes a segment this agent put. `UnknownSegment` if it did not.
    async fn delete_segment(&self, name: &str) -> Result<()>;
    /// Cached lookups: never wait on the network.
    fn segment(&self, name: &str) -> Option<SegmentEntry>;
    fn agent(&self, name: &str) -> Option<AgentEntry>;
    fn segments(&self) -> BTreeMap<String, SegmentEntry>;
    fn agents(&self) -> BTreeMap<String, AgentEntry>;
    /// Changes from now on.
    fn subscribe(&self) -> broadcast::Receiver<Event>;
    fn state(&self) -> RegistryState;
    /// Deletes every key this agent wrote and releases its lease. Idempotent.
    async fn shutdown(&self) -> Result<()>;
}

pub type SharedRegistry = Arc<dyn Registry>;

/// The registry an agent runs with: etcd when a configuration is given, otherwise an in-memory
/// registry of its own (a single agent, or tests).
pub async fn open(etcd: Option<EtcdConfig>) -> Result<SharedRegistry> {
    Ok(match etcd {
        Some(cfg) => EtcdRegistry::connect(cfg).await?,
        None => MemoryRegistry::standalone(),
    })
}

/// Names become the last part of a key: non-empty, printable.
pub(crate) fn check_name(field: &'static str, name: &str) -> Result<()> {
    if name.is_empty() || name.chars().any(char::is_control) {
        return Err(Error::config(
            field,
            name,
            "must be non-empty, without control characters",
        ));
    }
    Ok(())
}
