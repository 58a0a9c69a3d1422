//! The local API workers on this node call over the agent's Unix socket.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use kvfabric_engine::{
    BatchOps, BlockOp, BlockPair, BlockTable, Opcode, Plane, PlaneSide, RegionId,
};
use tokio::sync::broadcast::error::RecvError;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::holds::DEFAULT_END_TIMEOUT;
use crate::incoming::Connection;
use crate::node::{HoldPlane, Node, RegionSource, Transfer};
use crate::registry::{Event, SegmentEntry};
use crate::status;
use crate::telemetry;
use kvfabric_proto::limits::MAX_HOLD_TTL_MS;
use kvfabric_proto::pb::local_agent_server::LocalAgent;
use kvfabric_proto::pb::{
    self, CreateHoldRequest, CreateHoldResponse, DeregisterSegmentRequest,
    DeregisterSegmentResponse, EndHoldRequest, EndHoldResponse, ExtendHoldRequest,
    ExtendHoldResponse, NotifyRequest, NotifyResponse, RegionInfo, RegisterSegmentRequest,
    RegisterSegmentResponse, SegmentEvent, StatusRequest, StatusResponse, SubmitRequest,
    SubmitResponse, TakeNotificationsRequest, TakeNotificationsResponse, WatchSegmentsRequest,
    region_spec, segment_event,
};
use tonic::transport::server::UdsConnectInfo;
use tracing::{Instrument, field, info_span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[derive(Debug, Clone)]
pub(crate) struct LocalApi {
    pub node: Arc<Node>,
}

fn regions_of(entry: &SegmentEntry) -> Vec<RegionInfo> {
    entry
        .regions
        .iter()
        .enumerate()
        .map(|(i, r)| RegionInfo {
            index: i as u32,
            len: r.len,
            location: crate::config::location_name(r.location),
        })
        .collect()
}

fn event(kind: segment_event::Kind, entry: &SegmentEntry) -> SegmentEvent {
    SegmentEvent {
        kind: kind as i32,
        name: entry.name.clone(),
        agent: entry.agent.clone(),
        regions: regions_of(entry),
    }
}

pub(crate) fn decode_transfer(req: SubmitRequest) -> Result<Transfer, Error> {
    let opcode = match pb::Opcode::try_from(req.opcode) {
        Ok(pb::Opcode::Read) => Opcode::Read,
        Ok(pb::Opcode::Write) => Opcode::Write,
        _ => {
            return Err(Error::invalid(
                "opcode",
                req.opcode,
                "must be OPCODE_READ or OPCODE_WRITE",
            ));
        }
    };
    let ops = match req.table {
        Some(_) if !req.ops.is_empty() => {
            return Err(Error::invalid(
                "table",
                format!("a table beside {} ops", req.ops.len()),
                "give ops or a table, not both",
            ));
        }
        Some(table) => BatchOps::Table(decode_table(table)?),
        None => BatchOps::List(
            req.ops
                .iter()
                .map(|o| BlockOp {
                    local_region: RegionId(o.local_region.into()),
                    local_offset: o.local_offset,
                    remote_region: RegionId(o.remote_region.into()),
                    remote_offset: o.remote_offset,
                    len: o.len,
                })
                .collect(),
        ),
    };
    Ok(Transfer {
        local_segment: req.local_segment,
        local_key: req.local_key,
        remote_segment: req.remote_segment,
        remote_key: req.remote_key,
        opcode,
        ops,
        timeout: (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms)),
        checksum: req.checksum,
    })
}

/// A block table as the engine takes it, its regions still indexes in the two segments.
fn decode_table(t: pb::BlockTable) -> Result<BlockTable, Error> {
    if t.local_blocks.len() != t.remote_blocks.len() {
        return Err(Error::invalid(
            "table.remote_blocks",
            format!("{} ids", t.remote_blocks.len()),
            format!(
                "must pair with table.local_blocks ({} ids)",
                t.local_blocks.len()
            ),
        ));
    }
    let side = |i: usize, name: &str, s: Option<pb::PlaneSide>| {
        s.map(|s| PlaneSide {
            region: RegionId(s.region.into()),
            base: s.base,
            stride: s.stride,
        })
        .ok_or_else(|| Error::invalid(format!("table.planes[{i}].{name}"), "unset", "set it"))
    };
    let planes = t
        .planes
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            Ok(Plane {
                local: side(i, "local", p.local)?,
                remote: side(i, "remote", p.remote)?,
                block_bytes: p.block_bytes,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let blocks = t
        .local_blocks
        .into_iter()
        .zip(t.remote_blocks)
        .map(|(local, remote)| BlockPair { local, remote })
        .collect();
    Ok(BlockTable { planes, blocks })
}

/// The agent's ordinal of the GPU a region names: by UUID when given (the worker's numbering
/// may differ from ours), else the ordinal as sent.
fn device_of(i: usize, c: &pb::CudaMemory) -> Result<u32, Error> {
    if c.device_uuid.is_empty() {
        return Ok(c.device);
    }
    let field = || format!("regions[{i}].device_uuid");
    let want = kvfabric_engine::cuda::uuid_digits(&c.device_uuid)
        .ok_or_else(|| Error::invalid(field(), &c.device_uuid, "not a GPU UUID"))?;
    kvfabric_engine::cuda::devices()?
        .into_iter()
        .find(|d| kvfabric_engine::cuda::uuid_digits(&d.uuid).as_deref() == Some(want.as_str()))
        .map(|d| d.ordinal)
        .ok_or_else(|| {
            Error::invalid(
                field(),
                &c.device_uuid,
                "no GPU with this UUID on this node",
            )
        })
}

type EventStream = Pin<Box<dyn Stream<Item = Result<SegmentEvent, Status>> + Send>>;

#[tonic::async_trait]
impl LocalAgent for LocalApi {
    async fn register_segment(
        &self,
        request: Request<RegisterSegmentRequest>,
    ) -> Result<Response<RegisterSegmentResponse>, Status> {
        let connection = request
            .extensions()
            .get::<Connection<UdsConnectInfo>>()
            .cloned();
        let req = request.into_inner();
        let mut sources = Vec::with_capacity(req.regions.len());
        for (i, spec) in req.regions.into_iter().enumerate() {
            sources.push(match spec.memory {
                Some(region_spec::Memory::Host(h)) => RegionSource::Host {
                    fd_token: h.fd_token,
                },
                Some(region_spec::Memory::Cuda(c)) => RegionSource::Cuda {
                    device: device_of(i, &c)?,
                    ipc_handle: c.ipc_handle,
                    offset: c.offset,
                    len: c.len,
                },
                None => {
                    return Err(Error::invalid(
                        format!("regions[{i}]"),
                        "empty",
                        "set host or cuda",
                    )
                    .into());
                }
            });
        }
        let registered = self
            .node
            .register(&req.name, sources, req.key, req.fabric_access)
            .await?;
        let segment = &registered.segment;
        if let Some(connection) = connection.filter(|_| !req.detached) {
            let (node, owned) = (self.node.clone(), segment.clone());
            tokio::spawn(async move {
                connection.closed().await;
                node.release_with_owner(&owned).await;
            });
        }
        Ok(Response::new(RegisterSegmentResponse {
            published: registered.published,
            name: segment.name.clone(),
            key: segment.key.0,
            regions: segment
                .regions
                .iter()
                .enumerate()
                .map(|(i, r)| RegionInfo {
                    index: i as u32,
                    len: r.len(),
                    location: crate::config::location_name(r.location()),
                })
                .collect(),
        }))
    }

    async fn notify(
        &self,
        request: Request<NotifyRequest>,
    ) -> Result<Response<NotifyResponse>, Status> {
        let req = request.into_inner();
        self.node
            .notify(&req.segment, req.key, req.sender, req.message)
            .await?;
        Ok(Response::new(NotifyResponse {}))
    }

    async fn take_notifications(
        &self,
        request: Request<TakeNotificationsRequest>,
    ) -> Result<Response<TakeNotificationsResponse>, Status> {
        let req = request.into_inner();
        let taken = self
            .node
            .take_notifications(&req.segment, req.key, req.max, req.wait_ms)
            .await?;
        Ok(Response::new(TakeNotificationsResponse {
            notifications: taken
                .into_iter()
                .map(|n| pb::Notification {
                    sender: n.sender,
                    message: n.message,
                })
                .collect(),
        }))
    }

    async fn deregister_segment(
        &self,
        request: Request<DeregisterSegmentRequest>,
    ) -> Result<Response<DeregisterSegmentResponse>, Status> {
        let req = request.into_inner();
        self.node.deregister(&req.name, req.key).await?;
        Ok(Response::new(DeregisterSegmentResponse {}))
    }

    async fn submit(
        &self,
        request: Request<SubmitRequest>,
    ) -> Result<Response<SubmitResponse>, Status> {
        let config = &self.node.config;
        let span = info_span!(
            "kvfabric.agent.submit",
            otel.kind = "server",
            kvfabric.agent = %config.name,
            kvfabric.fabric = %config.fabric,
            kvfabric.pool = %config.pool,
            kvfabric.src.segment = field::Empty,
            kvfabric.dst.segment = field::Empty,
            kvfabric.src.node = field::Empty,
            kvfabric.dst.node = field::Empty,
            kvfabric.op = field::Empty,
            kvfabric.blocks = field::Empty,
            kvfabric.coalesced_ops = field::Empty,
            kvfabric.bytes = field::Empty,
            kvfabric.duration_ms = field::Empty,
            kvfabric.gbps = field::Empty,
            kvfabric.transport = field::Empty,
            kvfabric.transport.reason = field::Empty,
            kvfabric.retries = 0,
            trace_id = field::Empty,
            error = field::Empty,
            otel.status_code = field::Empty,
        );
        let _ = span.set_parent(telemetry::extract(request.metadata()));
        let transfer = match decode_transfer(request.into_inner()) {
            Ok(t) => t,
            Err(e) => {
                self.node.metrics.error(e.label());
                return Err(e.into());
            }
        };
        let done = self.node.transfer(transfer).instrument(span).await?;
        Ok(Response::new(SubmitResponse {
            bytes: done.bytes,
            ops: done.ops as u32,
            coalesced_ops: done.coalesced_ops as u32,
            transport: done.transport.to_string(),
            transport_reason: done.transport_reason,
            elapsed_us: done.elapsed.as_micros() as u64,
            remote_agent: done.remote_agent,
        }))
    }

    type WatchSegmentsStream = EventStream;

    async fn watch_segments(
        &self,
        _request: Request<WatchSegmentsRequest>,
    ) -> Result<Response<EventStream>, Status> {
        // Subscribe before the snapshot, so nothing falls between the two.
        let mut rx = self.node.registry.subscribe();
        let snapshot: Vec<SegmentEvent> = self
            .node
            .registry
            .segments()
            .values()
            .map(|s| event(segment_event::Kind::Put, s))
            .collect();
        let registry = self.node.registry.clone();
        let stream = async_stream(snapshot, move |tx| async move {
            loop {
                let ev = match rx.recv().await {
                    Ok(Event::SegmentPut(s)) => event(segment_event::Kind::Put, &s),
                    Ok(Event::SegmentDeleted(name)) => SegmentEvent {
                        kind: segment_event::Kind::Deleted as i32,
                        name,
                        ..SegmentEvent::default()
                    },
                    Ok(Event::Resynced) | Err(RecvError::Lagged(_)) => {
                        // Changes were missed: send the whole current set again.
                        for s in registry.segments().values() {
                            if tx
                                .send(Ok(event(segment_event::Kind::Put, s)))
                                .await
                                .is_err()
                            {
                                return;
                            }
                        }
                        continue;
                    }
                    Ok(_) => continue,
                    Err(RecvError::Closed) => return,
                };
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn create_hold(
        &self,
        request: Request<CreateHoldRequest>,
    ) -> Result<Response<CreateHoldResponse>, Status> {
        let req = request.into_inner();
        let planes: Vec<HoldPlane> = req
            .planes
            .iter()
            .map(|p| HoldPlane {
                region: p.region,
                base: p.base,
                stride: p.stride,
                block_bytes: p.block_bytes,
            })
            .collect();
        let (hold_key, left) =
            self.node
                .create_hold(&req.segment, req.key, &planes, req.block_ids, req.ttl_ms)?;
        Ok(Response::new(CreateHoldResponse {
            hold_key,
            expires_in_ms: millis(left),
        }))
    }

    async fn extend_hold(
        &self,
        request: Request<ExtendHoldRequest>,
    ) -> Result<Response<ExtendHoldResponse>, Status> {
        let req = request.into_inner();
        let left = self
            .node
            .extend_hold(&req.segment, req.key, req.hold_key, req.ttl_ms)?;
        Ok(Response::new(ExtendHoldResponse {
            expires_in_ms: millis(left),
        }))
    }

    async fn end_hold(
        &self,
        request: Request<EndHoldRequest>,
    ) -> Result<Response<EndHoldResponse>, Status> {
        let req = request.into_inner();
        let timeout = match req.timeout_ms {
            0 => DEFAULT_END_TIMEOUT,
            ms if ms <= MAX_HOLD_TTL_MS => Duration::from_millis(ms),
            ms => {
                return Err(Error::invalid(
                    "timeout_ms",
                    ms,
                    format!("0 (the agent's 5 s) or at most {MAX_HOLD_TTL_MS} ms"),
                )
                .into());
            }
        };
        self.node
            .end_hold(&req.segment, req.key, req.hold_key, timeout)
            .await?;
        Ok(Response::new(EndHoldResponse {}))
    }

    async fn status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let doc = status::collect(&self.node).await;
        let json = serde_json::to_string(&doc)
            .map_err(|e| Status::internal(format!("status document: {e}")))?;
        Ok(Response::new(StatusResponse { json }))
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A stream fed by a task: `first` items, then whatever `feed` sends; ends when the client goes.
fn async_stream<F, Fut>(first: Vec<SegmentEvent>, feed: F) -> EventStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<SegmentEvent, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let task = feed(tx.clone());
    tokio::spawn(async move {
        for ev in first {
            if tx.send(Ok(ev)).await.is_err() {
                return;
            }
        }
        drop(tx);
        task.await;
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
