//! What a worker links to talk to its node's agent: register KV memory, submit batches of block
//! ops (or block tables: planes × block-id pairs) against segments named in the registry, await
//! completion.
//!
//! ```no_run
//! # async fn demo() -> kvfabric_client::Result<()> {
//! use kvfabric_client::{Client, HostMemory, Op};
//! let agent = Client::connect("/var/run/kvfabric").await?;
//! let kv = HostMemory::alloc(1 << 30)?;
//! let mine = agent.register("decode-0", &[&kv], None).await?;
//! // Pull block 7 of the prefill worker's first region into our block 0.
//! let done = agent
//!     .read(&mine, "prefill-0", 0x5eed, &[Op { local_region: 0, local_offset: 0,
//!         remote_region: 0, remote_offset: 7 * 32768, len: 32768 }])
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! A prefill worker hands a decode worker one request's blocks rather than its segment's key:
//! [`Client::create_hold`] grants reads of some blocks for a while, the decode presents the
//! hold's key as the remote key of its batches, and [`Client::end_hold`] returns once no read
//! under it can land.

mod error;
mod fd;
mod memory;
pub mod trace;

pub use error::{Error, Result};
pub use kvfabric_proto::contract::FABRIC_KEY;
pub use kvfabric_proto::pb;
pub use memory::{CudaRegion, HostMemory, Memory};

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kvfabric_proto::contract::socket;
use kvfabric_proto::limits::{MAX_CREATE_HOLD_BYTES, MAX_LOCAL_RESPONSE_BYTES, max_submit_bytes};
use kvfabric_proto::pb::local_agent_client::LocalAgentClient;
use kvfabric_proto::pb::{
    CudaMemory, DeregisterSegmentRequest, HostMemory as PbHost, RegionSpec, RegisterSegmentRequest,
    StatusRequest, SubmitRequest, SubmitResponse, WatchSegmentsRequest, region_spec,
};
use kvfabric_proto::status::StatusDoc;
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;
use tracing::Instrument;

/// A connection to the local agent. Cheap to clone; clones share the channel.
#[derive(Debug, Clone)]
pub struct Client {
    grpc: LocalAgentClient<Channel>,
    socket_dir: PathBuf,
}

/// A registered segment: its name and the key readers must present.
#[derive(Debug, Clone)]
pub struct Segment {
    pub name: String,
    pub key: u64,
    pub regions: Vec<pb::RegionInfo>,
}

/// A message sent to a segment's registrant ([`Client::notify`]), and who said they sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub sender: String,
    pub message: Vec<u8>,
}

/// How a segment is registered ([`Client::register_with`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Registration {
    /// The key readers must present (None: the agent picks a random one, returned).
    pub key: Option<u64>,
    /// Workers of any node of the fabric may read and write it presenting [`FABRIC_KEY`]:
    /// their agent proves membership to this one (peer token, mTLS) instead of holding a key.
    /// For descriptors that travel unauthenticated (NIXL's metadata). An agent that
    /// authenticates no peer refuses it (`InvalidArgument` naming `fabric_access`).
    pub fabric_access: bool,
}

/// One block op; regions are indexes in each segment's region list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub local_region: u32,
    pub local_offset: u64,
    pub remote_region: u32,
    pub remote_offset: u64,
    pub len: u64,
}

impl From<Op> for pb::BlockOp {
    fn from(o: Op) -> Self {
        pb::BlockOp {
            local_region: o.local_region,
            local_offset: o.local_offset,
            remote_region: o.remote_region,
            remote_offset: o.remote_offset,
            len: o.len,
        }
    }
}

/// One side of a block-table plane: block `i` starts at `base + i × stride` of region `region`
/// (an index in that side's segment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaneSide {
    pub region: u32,
    pub base: u64,
    pub stride: u64,
}

/// A plane of a block table (one per layer and K/V, say): where its blocks lie on each side,
/// and how many bytes of each block move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plane {
    pub local: PlaneSide,
    pub remote: PlaneSide,
    pub block_bytes: u64,
}

/// A batch as an inference engine describes a request: planes, and the block-id pairs every
/// plane moves (`local_blocks[i]` with `remote_blocks[i]`). The agent checks it per plane, and
/// (over cuda-ipc) the GPU expands it itself: its cost grows with planes + blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub planes: Vec<Plane>,
    pub local_blocks: Vec<u32>,
    pub remote_blocks: Vec<u32>,
}

impl From<&BlockTable> for pb::BlockTable {
    fn from(t: &BlockTable) -> Self {
        let side = |s: PlaneSide| pb::PlaneSide {
            region: s.region,
            base: s.base,
            stride: s.stride,
        };
        pb::BlockTable {
            planes: t
                .planes
                .iter()
                .map(|p| pb::Plane {
                    local: Some(side(p.local)),
                    remote: Some(side(p.remote)),
                    block_bytes: p.block_bytes,
                })
                .collect(),
            local_blocks: t.local_blocks.clone(),
            remote_blocks: t.remote_blocks.clone(),
        }
    }
}

/// A plane of a hold: block `i` is `block_bytes` at `base + i × stride` of the segment's
/// region `region` (an index), as a reader's block table names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldPlane {
    pub region: u32,
    pub base: u64,
    pub stride: u64,
    pub block_bytes: u64,
}

/// A hold the agent granted: the key to hand to the one reader it is for (presented as the
/// `remote_key` of its batches), and how long it lives unless extended or ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub key: u64,
    pub expires_in: Duration,
}

fn millis(field: &'static str, d: Duration) -> Result<u64> {
    match u64::try_from(d.as_millis()) {
        Ok(ms) if ms > 0 => Ok(ms),
        _ => Err(Error::Invalid {
            field,
            value: format!("{d:?}"),
            reason: "a whole number of milliseconds, at least 1".into(),
        }),
    }
}

/// Options of one submitted batch.
#[derive(Debug, Clone, Default)]
pub struct SubmitOptions {
    pub timeout: Option<Duration>,
    pub checksum: bool,
    /// W3C `traceparent` to carry instead of the current `tracing` span's (a caller that keeps
    /// its trace context elsewhere, e.g. Python's OpenTelemetry).
    pub traceparent: Option<String>,
}

impl Client {
    /// Connects to the agent whose sockets are in `socket_dir`.
    pub async fn connect(socket_dir: impl AsRef<Path>) -> Result<Client> {
        let socket_dir = socket_dir.as_ref().to_path_buf();
        let path = socket_dir.join(socket::LOCAL);
        let fail = |reason: String| Error::Connect {
            path: path.display().to_string(),
            reason,
        };
        // The URI is required by the API and ignored: the connector dials the socket.
        let channel = Endpoint::from_static("http://kvfabric-agent")
            .connect_with_connector(service_fn({
                let path = path.clone();
                move |_: Uri| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(TokioIo::new(
                            tokio::net::UnixStream::connect(path).await?,
                        ))
                    }
                }
            }))
            .await
            .map_err(|e| fail(format!("connect: {e}")))?;
        Ok(Client {
            grpc: LocalAgentClient::new(channel)
                .max_decoding_message_size(MAX_LOCAL_RESPONSE_BYTES)
                .max_encoding_message_size(
                    max_submit_bytes(usize::from(u16::MAX) + 1).max(MAX_CREATE_HOLD_BYTES),
                ),
            socket_dir,
        })
    }

    fn rpc_error(&self, call: &'static str, s: tonic::Status) -> Error {
        let (code, message) = match std::error::Error::source(&s) {
            // The agent's answers are decoded from the wire and carry no source; a status with
            // one was made here from a broken or refused connection (tonic says Unknown
            // "transport error", or Internal for an h2 reset): the agent is unavailable, and
            // the channel dials it again on the next call.
            Some(cause) => (Code::Unavailable, causes(s.message(), cause)),
            None => (s.code(), s.message().to_owned()),
        };
        Error::Rpc {
            call,
            path: self.socket_dir.join(socket::LOCAL).display().to_string(),
            code,
            message,
        }
    }

    /// Publishes `regions` as segment `name`. `key`: the key readers must present (None: the
    /// agent picks a random one, returned in the answer).
    pub async fn register(
        &self,
        name: &str,
        regions: &[&HostMemory],
        key: Option<u64>,
    ) -> Result<Segment> {
        let memory: Vec<Memory<'_>> = regions.iter().map(|m| Memory::Host(m)).collect();
        self.register_memory(name, &memory, key).await
    }

    /// Like [`Client::register`], for host and GPU memory alike.
    pub async fn register_memory(
        &self,
        name: &str,
        regions: &[Memory<'_>],
        key: Option<u64>,
    ) -> Result<Segment> {
        let how = Registration {
            key,
            ..Registration::default()
        };
        self.register_with(name, regions, how).await
    }

    /// Like [`Client::register_memory`], saying who may reach the segment.
    pub async fn register_with(
        &self,
        name: &str,
        regions: &[Memory<'_>],
        how: Registration,
    ) -> Result<Segment> {
        let fd_path = self.socket_dir.join(socket::FD);
        let mut specs = Vec::with_capacity(regions.len());
        for m in regions {
            specs.push(RegionSpec {
                memory: Some(match m {
                    Memory::Host(h) => {
                        let fd = h.0.memfd().ok_or_else(|| Error::Invalid {
                            field: "region",
                            value: "host memory".into(),
                            reason: "has no memfd".into(),
                        })?;
                        let owned = fd
                            .try_clone_to_owned()
                            .map_err(|e| Error::io("dup memfd", e))?;
                        let path = fd_path.clone();
                        let token = tokio::task::spawn_blocking(move || fd::send(&path, &owned))
                            .await
                            .map_err(|e| Error::io("fd socket task", std::io::Error::other(e)))??;
                        region_spec::Memory::Host(PbHost { fd_token: token })
                    }
                    Memory::Cuda(c) => region_spec::Memory::Cuda(CudaMemory {
                        device: c.device,
                        device_uuid: c.device_uuid.clone(),
                        ipc_handle: c.ipc_handle.clone(),
                        offset: c.offset,
                        len: c.len,
                    }),
                }),
            });
        }
        let reply = self
            .grpc
            .clone()
            .register_segment(RegisterSegmentRequest {
                name: name.into(),
                regions: specs,
                key: how.key.unwrap_or(0),
                detached: false,
                fabric_access: how.fabric_access,
            })
            .await
            .map_err(|s| self.rpc_error("RegisterSegment", s))?
            .into_inner();
        Ok(Segment {
            name: reply.name,
            key: reply.key,
            regions: reply.regions,
        })
    }

    pub async fn deregister(&self, segment: &Segment) -> Result<()> {
        self.grpc
            .clone()
            .deregister_segment(DeregisterSegmentRequest {
                name: segment.name.clone(),
                key: segment.key,
            })
            .await
            .map_err(|s| self.rpc_error("DeregisterSegment", s))?;
        Ok(())
    }

    /// Pulls `ops` from `remote` (with the key its owner handed out) into `local`.
    pub async fn read(
        &self,
        local: &Segment,
        remote: &str,
        remote_key: u64,
        ops: &[Op],
    ) -> Result<SubmitResponse> {
        self.submit(
            local,
            remote,
            remote_key,
            pb::Opcode::Read,
            ops,
            SubmitOptions::default(),
        )
        .await
    }

    /// Pushes `ops` from `local` into `remote`.
    pub async fn write(
        &self,
        local: &Segment,
        remote: &str,
        remote_key: u64,
        ops: &[Op],
    ) -> Result<SubmitResponse> {
        self.submit(
            local,
            remote,
            remote_key,
            pb::Opcode::Write,
            ops,
            SubmitOptions::default(),
        )
        .await
    }

    pub async fn submit(
        &self,
        local: &Segment,
        remote: &str,
        remote_key: u64,
        opcode: pb::Opcode,
        ops: &[Op],
        options: SubmitOptions,
    ) -> Result<SubmitResponse> {
        let request = SubmitRequest {
            ops: ops.iter().map(|&o| o.into()).collect(),
            ..Self::request(local, remote, remote_key, opcode, &options)
        };
        self.submit_traced(request, options.traceparent)
            .await
            .map_err(|s| self.rpc_error("Submit", s))
    }

    /// Moves a block table between `local` and `remote`: every plane's blocks
    /// `local_blocks[i]` ↔ `remote_blocks[i]`, in the direction `opcode` says.
    pub async fn submit_blocks(
        &self,
        local: &Segment,
        remote: &str,
        remote_key: u64,
        opcode: pb::Opcode,
        table: &BlockTable,
        options: SubmitOptions,
    ) -> Result<SubmitResponse> {
        let request = SubmitRequest {
            table: Some(table.into()),
            ..Self::request(local, remote, remote_key, opcode, &options)
        };
        self.submit_traced(request, options.traceparent)
            .await
            .map_err(|s| self.rpc_error("Submit", s))
    }

    /// A request of no ops yet.
    fn request(
        local: &Segment,
        remote: &str,
        remote_key: u64,
        opcode: pb::Opcode,
        options: &SubmitOptions,
    ) -> SubmitRequest {
        SubmitRequest {
            local_segment: local.name.clone(),
            local_key: local.key,
            remote_segment: remote.into(),
            remote_key,
            opcode: opcode as i32,
            ops: Vec::new(),
            timeout_ms: options
                .timeout
                .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
            checksum: options.checksum,
            table: None,
        }
    }

    /// The request as given, and the gRPC status as the agent answered (tests of bad input).
    ///
    /// The call runs in a `kvfabric.worker.submit` span whose context travels to the agent
    /// (W3C `traceparent` metadata), so a worker that exports traces sees the whole transfer.
    pub async fn submit_raw(
        &self,
        request: SubmitRequest,
    ) -> std::result::Result<SubmitResponse, tonic::Status> {
        self.submit_traced(request, None).await
    }

    async fn submit_traced(
        &self,
        request: SubmitRequest,
        traceparent: Option<String>,
    ) -> std::result::Result<SubmitResponse, tonic::Status> {
        let span = tracing::info_span!(
            "kvfabric.worker.submit",
            otel.kind = "client",
            kvfabric.local.segment = %request.local_segment,
            kvfabric.remote.segment = %request.remote_segment,
            kvfabric.op = request.opcode,
            kvfabric.blocks = blocks(&request),
        );
        async {
            let mut call = tonic::Request::new(request);
            let parent = traceparent
                .filter(|t| trace::is_traceparent(t))
                .or_else(trace::current_traceparent);
            if let Some(value) = parent.and_then(|t| t.parse().ok()) {
                call.metadata_mut().insert("traceparent", value);
            }
            Ok(self.grpc.clone().submit(call).await?.into_inner())
        }
        .instrument(span)
        .await
    }

    /// Grants reads of `block_ids` of every plane of `segment` (registered through this agent)
    /// for `ttl` (1 ms to 1 h): the returned key, handed to one reader, reads those blocks and
    /// nothing else until the hold expires or is ended. Blocks are checked against their
    /// regions (`InvalidArgument` naming the field); `NotFound` when the segment is registered
    /// with another agent (holds are made where the memory is); `ResourceExhausted` past the
    /// agent's number of holds.
    pub async fn create_hold(
        &self,
        segment: &Segment,
        planes: &[HoldPlane],
        block_ids: &[u64],
        ttl: Duration,
    ) -> Result<Hold> {
        let reply = self
            .grpc
            .clone()
            .create_hold(pb::CreateHoldRequest {
                segment: segment.name.clone(),
                key: segment.key,
                planes: planes
                    .iter()
                    .map(|p| pb::HoldPlane {
                        region: p.region,
                        base: p.base,
                        stride: p.stride,
                        block_bytes: p.block_bytes,
                    })
                    .collect(),
                block_ids: block_ids.to_vec(),
                ttl_ms: millis("ttl", ttl)?,
            })
            .await
            .map_err(|s| self.rpc_error("CreateHold", s))?
            .into_inner();
        Ok(Hold {
            key: reply.hold_key,
            expires_in: Duration::from_millis(reply.expires_in_ms),
        })
    }

    /// Moves a live hold's expiry to `ttl` from now (never earlier than it was); returns the
    /// time it now has. `NotFound` once it has ended or expired.
    pub async fn extend_hold(
        &self,
        segment: &Segment,
        hold_key: u64,
        ttl: Duration,
    ) -> Result<Duration> {
        let reply = self
            .grpc
            .clone()
            .extend_hold(pb::ExtendHoldRequest {
                segment: segment.name.clone(),
                key: segment.key,
                hold_key,
                ttl_ms: millis("ttl", ttl)?,
            })
            .await
            .map_err(|s| self.rpc_error("ExtendHold", s))?
            .into_inner();
        Ok(Duration::from_millis(reply.expires_in_ms))
    }

    /// Ends a hold; returns once no read under it can still land (the agent's default wait
    /// of 5 s for the readers' agents). See [`Client::end_hold_within`].
    pub async fn end_hold(&self, segment: &Segment, hold_key: u64) -> Result<()> {
        self.end_hold_within(segment, hold_key, None).await
    }

    /// Ends a hold, waiting up to `timeout` for the agents it was handed to. `DeadlineExceeded`
    /// when one did not confirm in time: the message says how long the hold still lives; do
    /// not reuse its blocks before then (or call again). A hold that already ended or expired
    /// is no error.
    pub async fn end_hold_within(
        &self,
        segment: &Segment,
        hold_key: u64,
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.grpc
            .clone()
            .end_hold(pb::EndHoldRequest {
                segment: segment.name.clone(),
                key: segment.key,
                hold_key,
                timeout_ms: timeout
                    .map(|t| millis("timeout", t))
                    .transpose()?
                    .unwrap_or(0),
            })
            .await
            .map_err(|s| self.rpc_error("EndHold", s))?;
        Ok(())
    }

    /// The raw gRPC client, for calls this wrapper does not cover.
    pub fn grpc(&self) -> LocalAgentClient<Channel> {
        self.grpc.clone()
    }

    /// Sends `message` (at most 16 KiB) to whoever registered `segment`, anywhere in the
    /// fabric, presenting `key` (the segment's, or [`FABRIC_KEY`] for one open to the fabric);
    /// `sender` is what the receiver is told sent it. Returns once it is queued at the
    /// segment's agent: `ResourceExhausted` when the receiver's queue is full.
    pub async fn notify(
        &self,
        segment: &str,
        key: u64,
        sender: &str,
        message: &[u8],
    ) -> Result<()> {
        self.grpc
            .clone()
            .notify(pb::NotifyRequest {
                segment: segment.into(),
                key,
                sender: sender.into(),
                message: message.to_vec(),
            })
            .await
            .map_err(|s| self.rpc_error("Notify", s))?;
        Ok(())
    }

    /// The messages sent to `segment` (registered through this agent), oldest first: up to
    /// `max` (0: all queued), waiting up to `wait` (at most 10 s) for one when none is queued.
    pub async fn take_notifications(
        &self,
        segment: &Segment,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Notification>> {
        let reply = self
            .grpc
            .clone()
            .take_notifications(pb::TakeNotificationsRequest {
                segment: segment.name.clone(),
                key: segment.key,
                max,
                wait_ms: u32::try_from(wait.as_millis()).unwrap_or(u32::MAX),
            })
            .await
            .map_err(|s| self.rpc_error("TakeNotifications", s))?
            .into_inner();
        Ok(reply
            .notifications
            .into_iter()
            .map(|n| Notification {
                sender: n.sender,
                message: n.message,
            })
            .collect())
    }

    pub async fn status(&self) -> Result<StatusDoc> {
        let reply = self
            .grpc
            .clone()
            .status(StatusRequest {})
            .await
            .map_err(|s| self.rpc_error("Status", s))?
            .into_inner();
        serde_json::from_str(&reply.json).map_err(|e| Error::Document {
            what: "status document",
            reason: e.to_string(),
        })
    }

    /// Segment changes, starting with every segment known now.
    pub async fn watch(&self) -> Result<tonic::Streaming<pb::SegmentEvent>> {
        Ok(self
            .grpc
            .clone()
            .watch_segments(WatchSegmentsRequest {})
            .await
            .map_err(|s| self.rpc_error("WatchSegments", s))?
            .into_inner())
    }
}

/// Block ops a request stands for (a table: planes × blocks).
fn blocks(request: &SubmitRequest) -> usize {
    match &request.table {
        Some(t) => t.planes.len().saturating_mul(t.local_blocks.len()),
        None => request.ops.len(),
    }
}

/// `what` and the causes under it, outermost first (tonic's own words, "transport error", say
/// nothing of the cause); a cause that repeats the words before it is left out.
fn causes(what: &str, cause: &(dyn std::error::Error + 'static)) -> String {
    let mut text = what.to_owned();
    let mut next = Some(cause);
    while let Some(e) = next {
        let words = e.to_string();
        if !text.ends_with(&words) {
            text.push_str(": ");
            text.push_str(&words);
        }
        next = e.source();
    }
    text
}
