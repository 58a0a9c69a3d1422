//! The one module of the binding that uses the Rust client: when the client moves to its own
//! crate, the `use` lines here are all that change.
//!
//! Calls go through the client's gRPC channel rather than its `Result`-returning wrappers, so a
//! Python caller gets the agent's status code and message as the agent sent them, and the
//! caller's W3C trace context (from Python's OpenTelemetry, not a Rust `tracing` span) travels in
//! the request's metadata.

use std::path::{Path, PathBuf};

use tonic::metadata::MetadataValue;

use kvfabric_agent::client::Client;
pub use kvfabric_agent::client::HostMemory;
use kvfabric_agent::fd_socket;
use kvfabric_agent::rpc::pb::{
    self, CudaMemory, DeregisterSegmentRequest, RegionSpec, RegisterSegmentRequest, StatusRequest,
    SubmitRequest, WatchSegmentsRequest, region_spec, segment_event,
};
pub use kvfabric_agent::rpc::pb::{BlockOp, RegionInfo, SegmentEvent, SubmitResponse};
use kvfabric_agent::server::{FD_SOCKET, LOCAL_SOCKET};

use crate::error::{Error, Result};

pub type EventStream = tonic::Streaming<SegmentEvent>;

/// A connection to the node's agent.
#[derive(Debug, Clone)]
pub struct Agent {
    client: Client,
    socket_dir: PathBuf,
}

/// Memory to publish in a segment.
#[derive(Debug)]
pub enum Source<'a> {
    Host(&'a HostMemory),
    Cuda {
        /// The device in the caller's numbering; the agent prefers `device_uuid` when given.
        device: u32,
        device_uuid: String,
        ipc_handle: Vec<u8>,
        offset: u64,
        len: u64,
    },
}

/// One batch as the agent takes it.
#[derive(Debug)]
pub struct Batch {
    pub local_segment: String,
    pub local_key: u64,
    pub remote_segment: String,
    pub remote_key: u64,
    pub write: bool,
    pub ops: Vec<BlockOp>,
    pub timeout_ms: u64,
    pub checksum: bool,
}

/// The caller's trace context, W3C headers as Python's propagator wrote them.
#[derive(Debug, Default, Clone)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
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
                path: socket_dir.join(LOCAL_SOCKET).display().to_string(),
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
        let fd_path = self.socket_dir.join(FD_SOCKET);
        let mut specs = Vec::with_capacity(regions.len());
        for (i, source) in regions.iter().enumerate() {
            let memory = match source {
                Source::Host(h) => {
                    let fd = h
                        .memfd()
                        .ok_or_else(|| {
                            Error::invalid(format!("regions[{i}]"), "host memory", "has no memfd")
                        })?
                        .try_clone_to_owned()
                        .map_err(|e| kvfabric_agent::Error::io("dup memfd", e))?;
                    let path = fd_path.clone();
                    let token = tokio::task::spawn_blocking(move || fd_socket::send(&path, &fd))
                        .await
                        .map_err(|e| {
                            kvfabric_agent::Error::io("fd socket task", std::io::Error::other(e))
                        })?
                        .map_err(|e| Error::Unreachable {
                            path: fd_path.display().to_string(),
                            reason: e.to_string(),
                        })?;
                    region_spec::Memory::Host(pb::HostMemory { fd_token: token })
                }
                Source::Cuda {
                    device,
                    device_uuid,
                    ipc_handle,
                    offset,
                    len,
                } => region_spec::Memory::Cuda(CudaMemory {
                    device: *device,
                    device_uuid: device_uuid.clone(),
                    ipc_handle: ipc_handle.clone(),
                    offset: *offset,
                    len: *len,
                }),
            };
            specs.push(RegionSpec {
                memory: Some(memory),
            });
        }
        let reply = self
            .client
            .grpc()
            .register_segment(RegisterSegmentRequest {
                name: name.into(),
                regions: specs,
                key,
            })
            .await
            .map_err(|s| Error::agent("RegisterSegment", s))?
            .into_inner();
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
            ops: batch.ops,
            timeout_ms: batch.timeout_ms,
            checksum: batch.checksum,
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
