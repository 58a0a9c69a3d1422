//! The one module of the binding that uses the Rust client (`kvfabric-client`).
//!
//! Registration goes through the client (it hands memfds over on the fd socket); other calls go
//! through the client's gRPC channel rather than its `Result`-returning wrappers, so a
//! Python caller gets the agent's status code and message as the agent sent them, and the
//! caller's W3C trace context (from Python's OpenTelemetry, not a Rust `tracing` span) travels in
//! the request's metadata.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::MetadataValue;

pub use kvfabric_client::pb;
pub use kvfabric_client::pb::{BlockOp, RegionInfo, SegmentEvent, SubmitResponse};
use kvfabric_client::pb::{
    DeregisterSegmentRequest, StatusRequest, SubmitRequest, WatchSegmentsRequest, segment_event,
};
use kvfabric_client::{Client, Memory};
pub use kvfabric_client::{CudaRegion as CudaMemory, Hold, HoldPlane, HostMemory};
use kvfabric_proto::contract::socket;

use crate::error::{Error, Result};

pub type EventStream = tonic::Streaming<SegmentEvent>;

/// A connection to the node's agent.
#[derive(Debug, Clone)]
pub struct Agent {
    client: Client,
    socket_dir: PathBuf,
}

/// Memory to publish in a segment.
pub type Source<'a> = Memory<'a>;

/// One batch as the agent takes it.
#[derive(Debug)]
pub struct Batch {
    pub local_segment: String,
    pub local_key: u64,
    pub remote_segment: String,
    pub remote_key: u64,
    pub write: bool,
    pub ops: Arc<Work>,
    pub timeout_ms: u64,
    pub checksum: bool,
}

/// What a batch moves: an op list, or a block table the agent takes as it is.
#[derive(Debug)]
pub enum Work {
    List(Vec<BlockOp>),
    Table(pb::BlockTable),
}

impl Work {
    /// Block ops (a table: planes × blocks).
    pub fn len(&self) -> usize {
        match self {
            Work::List(ops) => ops.len(),
            Work::Table(t) => t.planes.len().saturating_mul(t.local_blocks.len()),
        }
    }

    /// Bytes moved (saturating).
    pub fn bytes(&self) -> u64 {
        match self {
            Work::List(ops) => ops.iter().map(|o| o.len).fold(0, u64::saturating_add),
            Work::Table(t) => t
                .planes
                .iter()
                .map(|p| p.block_bytes.saturating_mul(t.local_blocks.len() as u64))
                .fold(0, u64::saturating_add),
        }
    }
}

/// The caller's trace context, W3C headers as Python's propagator wrote them.
#[derive(Debug, Default, Clone)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// The client's view of a segment for calls that name it by name and key.
fn client_segment((name, key): (String, u64)) -> kvfabric_client::Segment {
    kvfabric_client::Segment {
        name,
        key,
        regions: Vec::new(),
    }
}

/// "put" or "deleted".
pub fn event_kind(ev: &SegmentEvent) -> &'static str {
    match segment_event::Kind::try_from(ev.kind) {
        Ok(segment_event::Kind::Put) => "put",
        Ok(segment_event::Kind::Deleted) => "deleted",
        _ => "unknown",
    }
}

impl Agent {
    pub async fn connect(socket_dir: &Path) -> Result<Agent> {
        let client = Client::connect(socket_dir)
            .await
            .map_err(|e| Error::Unreachable {
                path: socket_dir.join(socket::LOCAL).display().to_string(),
                reason: e.to_string(),
            })?;
        Ok(Agent {
            client,
            socket_dir: socket_dir.to_path_buf(),
        })
    }

    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// Publishes `regions` as segment `name`; host memory goes over the fd socket first.
    pub async fn register(
        &self,
        name: &str,
        regions: &[Source<'_>],
        key: u64,
    ) -> Result<(String, u64, Vec<RegionInfo>)> {
        let reply = self
            .client
            .register_memory(name, regions, (key != 0).then_some(key))
            .await
            .map_err(|e| Error::from_client("RegisterSegment", e))?;
        Ok((reply.name, reply.key, reply.regions))
    }

    pub async fn deregister(&self, name: &str, key: u64) -> Result<()> {
        self.client
            .grpc()
            .deregister_segment(DeregisterSegmentRequest {
                name: name.into(),
                key,
            })
            .await
            .map_err(|s| Error::agent("DeregisterSegment", s))?;
        Ok(())
    }

    pub async fn submit(&self, batch: Batch, trace: &TraceHeaders) -> Result<SubmitResponse> {
        let opcode = if batch.write {
            pb::Opcode::Write
        } else {
            pb::Opcode::Read
        };
        let mut call = tonic::Request::new(SubmitRequest {
            local_segment: batch.local_segment,
            local_key: batch.local_key,
            remote_segment: batch.remote_segment,
            remote_key: batch.remote_key,
            opcode: opcode as i32,
            ops: match batch.ops.as_ref() {
                Work::List(ops) => ops.clone(),
                Work::Table(_) => Vec::new(),
            },
            timeout_ms: batch.timeout_ms,
            checksum: batch.checksum,
            table: match batch.ops.as_ref() {
                Work::Table(t) => Some(t.clone()),
                Work::List(_) => None,
            },
        });
        for (name, value) in [
            ("traceparent", &trace.traceparent),
            ("tracestate", &trace.tracestate),
        ] {
            if let Some(v) = value {
                let v: MetadataValue<_> = v
                    .parse()
                    .map_err(|_| Error::invalid(name, v, "not a valid header value"))?;
                call.metadata_mut().insert(name, v);
            }
        }
        Ok(self
            .client
            .grpc()
            .submit(call)
            .await
            .map_err(|s| Error::agent("Submit", s))?
            .into_inner())
    }

    /// A hold on `planes` × `block_ids` of the segment (name, key) for `ttl`: its key and the
    /// time it lives.
    pub async fn create_hold(
        &self,
        segment: (String, u64),
        planes: Vec<HoldPlane>,
        block_ids: Vec<u64>,
        ttl: Duration,
    ) -> Result<Hold> {
        self.client
            .create_hold(&client_segment(segment), &planes, &block_ids, ttl)
            .await
            .map_err(|e| Error::from_client("CreateHold", e))
    }

    /// Moves a live hold's expiry to `ttl` from now (never earlier); the time it now has.
    pub async fn extend_hold(
        &self,
        segment: (String, u64),
        hold_key: u64,
        ttl: Duration,
    ) -> Result<Duration> {
        self.client
            .extend_hold(&client_segment(segment), hold_key, ttl)
            .await
            .map_err(|e| Error::from_client("ExtendHold", e))
    }

    /// Ends a hold; returns once no read under it can land (`timeout`: how long the agent
    /// waits for the readers' agents; None: its default).
    pub async fn end_hold(
        &self,
        segment: (String, u64),
        hold_key: u64,
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.client
            .end_hold_within(&client_segment(segment), hold_key, timeout)
            .await
            .map_err(|e| Error::from_client("EndHold", e))
    }

    /// The agent's status document, as JSON.
    pub async fn status(&self) -> Result<String> {
        Ok(self
            .client
            .grpc()
            .status(StatusRequest {})
            .await
            .map_err(|s| Error::agent("Status", s))?
            .into_inner()
            .json)
    }

    pub async fn watch(&self) -> Result<EventStream> {
        Ok(self
            .client
            .grpc()
            .watch_segments(WatchSegmentsRequest {})
            .await
            .map_err(|s| Error::agent("WatchSegments", s))?
            .into_inner())
    }
}
