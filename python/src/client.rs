//! The Python-facing client: segments, batches (sync and awaitable), watch, status.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;

use crate::agent::{
    Agent, Batch, CudaMemory, EventStream, HoldPlane, RegionInfo, Source, SubmitResponse,
    TraceHeaders, Work,
};
use crate::batch::{self, Plane};
use crate::buffer::HostBuffer;
use crate::error::{Error, Result};

pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    pyo3_async_runtimes::tokio::get_runtime()
}

/// Runs `f` on the binding's runtime with the GIL released.
fn wait<T: Send>(py: Python<'_>, f: impl Future<Output = Result<T>> + Send) -> Result<T> {
    py.detach(|| runtime().block_on(f))
}

/// A deadline on a call to the agent: no answer in time is DEADLINE_EXCEEDED, never a hang.
pub(crate) async fn within<T>(
    limit: Duration,
    call: &'static str,
    f: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
        Err(Error::agent(
            call,
            tonic::Status::deadline_exceeded(format!("the agent did not answer within {limit:?}")),
        ))
    })
}

pub(crate) fn seconds(field: &str, s: Option<f64>) -> Result<Option<Duration>> {
    s.map(|s| {
        Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| Error::invalid(field, s, "must be a positive number of seconds"))
    })
    .transpose()
}

/// GPU memory exported with CUDA IPC: the allocation's 64-byte handle, and where the region
/// starts in it and how long it is. `device_uuid` names the GPU whatever the agent's numbering.
#[pyclass(module = "kvfabric._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct CudaRegion {
    pub device: u32,
    pub device_uuid: String,
    pub ipc_handle: Vec<u8>,
    pub offset: u64,
    pub len: u64,
}

#[pymethods]
impl CudaRegion {
    #[new]
    #[pyo3(signature = (ipc_handle, offset, len, device=0, device_uuid=String::new()))]
    fn new(ipc_handle: Vec<u8>, offset: u64, len: u64, device: u32, device_uuid: String) -> Self {
        CudaRegion {
            device,
            device_uuid,
            ipc_handle,
            offset,
            len,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "CudaRegion(device={}, device_uuid={:?}, offset={}, len={})",
            self.device, self.device_uuid, self.offset, self.len
        )
    }
}

/// One region of a registered segment, as the agent reported it.
#[pyclass(module = "kvfabric._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Region {
    /// What block ops name.
    pub index: u32,
    pub len: u64,
    /// "host" or "cuda:N" (the agent's device).
    pub location: String,
}

impl From<RegionInfo> for Region {
    fn from(r: RegionInfo) -> Self {
        Region {
            index: r.index,
            len: r.len,
            location: r.location,
        }
    }
}

#[pymethods]
impl Region {
    fn __repr__(&self) -> String {
        format!(
            "Region(index={}, len={}, location={:?})",
            self.index, self.len, self.location
        )
    }
}

/// A registered segment: its name, the key readers must present, its regions. It keeps the
/// registered memory alive.
#[pyclass(module = "kvfabric._native", frozen, get_all)]
#[derive(Debug)]
pub struct Segment {
    pub name: String,
    pub key: u64,
    pub regions: Vec<Region>,
    /// The objects registered (buffers, tensors), kept alive with the segment.
    pub memory: Vec<Py<PyAny>>,
}

#[pymethods]
impl Segment {
    /// A segment of any process, by name and key, for the calls that need no more (holds on
    /// it, from a process that did not register it but was given its key).
    #[new]
    fn named(name: String, key: u64) -> Segment {
        Segment {
            name,
            key,
            regions: Vec::new(),
            memory: Vec::new(),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Segment(name={:?}, regions={})",
            self.name,
            self.regions.len()
        )
    }
}

/// A batch's ops, built once (it can be submitted many times): an op list, or a block table.
#[pyclass(module = "kvfabric._native", frozen)]
#[derive(Debug)]
pub struct Ops(pub Arc<Work>);

#[pymethods]
impl Ops {
    /// Block ops (a block table: planes × blocks).
    fn __len__(&self) -> usize {
        self.0.len()
    }

    /// Total bytes the ops move.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.0.bytes()
    }
}

/// The five-column form: op `i` moves `lengths[i]` bytes between `local_offsets[i]` of local
/// region `local_regions[i]` and `remote_offsets[i]` of remote region `remote_regions[i]`.
#[pyfunction]
pub fn columns(
    local_regions: &Bound<'_, PyAny>,
    local_offsets: &Bound<'_, PyAny>,
    remote_regions: &Bound<'_, PyAny>,
    remote_offsets: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
) -> Result<Ops> {
    Ok(Ops(Arc::new(Work::List(batch::from_columns(
        &batch::region_indexes(local_regions, "local_regions")?,
        &batch::indexes(local_offsets, "local_offsets")?,
        &batch::region_indexes(remote_regions, "remote_regions")?,
        &batch::indexes(remote_offsets, "remote_offsets")?,
        &batch::indexes(lengths, "lengths")?,
    )?))))
}

fn planes(list: Vec<(u32, u64, u64, u64)>) -> Vec<Plane> {
    list.into_iter()
        .map(|(region, base, stride, block_bytes)| Plane {
            region,
            base,
            stride,
            block_bytes,
        })
        .collect()
}

/// The block-table form: planes are `(region, base, stride, block_bytes)` per side; block
/// `local_block_ids[k]` of every local plane moves with block `remote_block_ids[k]` of the
/// matching remote plane. Sent to the agent as a table, never expanded into ops.
#[pyfunction]
pub fn block_table(
    local_planes: Vec<(u32, u64, u64, u64)>,
    remote_planes: Vec<(u32, u64, u64, u64)>,
    local_block_ids: &Bound<'_, PyAny>,
    remote_block_ids: &Bound<'_, PyAny>,
) -> Result<Ops> {
    Ok(Ops(Arc::new(Work::Table(batch::from_planes(
        &planes(local_planes),
        &planes(remote_planes),
        &batch::indexes(local_block_ids, "local_block_ids")?,
        &batch::indexes(remote_block_ids, "remote_block_ids")?,
    )?))))
}

/// What a completed batch reports.
#[pyclass(module = "kvfabric._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Transfer {
    pub bytes: u64,
    pub ops: u32,
    pub coalesced_ops: u32,
    pub transport: String,
    /// Why that transport was chosen.
    pub transport_reason: String,
    pub elapsed_us: u64,
    /// The agent serving the remote segment.
    pub remote_agent: String,
}

impl From<SubmitResponse> for Transfer {
    fn from(r: SubmitResponse) -> Self {
        Transfer {
            bytes: r.bytes,
            ops: r.ops,
            coalesced_ops: r.coalesced_ops,
            transport: r.transport,
            transport_reason: r.transport_reason,
            elapsed_us: r.elapsed_us,
            remote_agent: r.remote_agent,
        }
    }
}

#[pymethods]
impl Transfer {
    fn __repr__(&self) -> String {
        format!(
            "Transfer(bytes={}, ops={}, transport={:?}, elapsed_us={})",
            self.bytes, self.ops, self.transport, self.elapsed_us
        )
    }
}

/// A segment appearing or going away in the fabric.
#[pyclass(module = "kvfabric._native", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct SegmentEvent {
    /// "put" or "deleted".
    pub kind: String,
    pub name: String,
    /// The agent serving it (empty for "deleted").
    pub agent: String,
    pub regions: Vec<Region>,
}

#[pymethods]
impl SegmentEvent {
    fn __repr__(&self) -> String {
        format!(
            "SegmentEvent(kind={:?}, name={:?}, agent={:?})",
            self.kind, self.name, self.agent
        )
    }
}

/// Segment events: iterate (blocking, GIL released), `next(timeout)`, or `async for`.
#[pyclass(module = "kvfabric._native", frozen)]
#[derive(Debug)]
pub struct Watch {
    stream: Arc<tokio::sync::Mutex<Option<EventStream>>>,
    /// `close` sets it, so a thread waiting for the next event returns at once.
    closed: tokio::sync::watch::Sender<bool>,
}

async fn next_event(
    stream: Arc<tokio::sync::Mutex<Option<EventStream>>>,
    mut closed: tokio::sync::watch::Receiver<bool>,
    timeout: Option<Duration>,
) -> Result<Option<SegmentEvent>> {
    let ended = async move {
        let _ = closed.wait_for(|c| *c).await;
    };
    tokio::pin!(ended);
    let mut guard = tokio::select! {
        g = stream.lock() => g,
        () = &mut ended => return Ok(None),
    };
    let Some(s) = guard.as_mut() else {
        return Ok(None);
    };
    let next = async {
        match timeout {
            Some(t) => tokio::time::timeout(t, s.message()).await.ok(),
            None => Some(s.message().await),
        }
    };
    let message = tokio::select! {
        m = next => match m {
            Some(m) => m,
            None => return Ok(None),
        },
        () = &mut ended => {
            *guard = None;
            return Ok(None);
        }
    };
    match message {
        Ok(Some(ev)) => Ok(Some(SegmentEvent {
            kind: crate::agent::event_kind(&ev).into(),
            name: ev.name,
            agent: ev.agent,
            regions: ev.regions.into_iter().map(Region::from).collect(),
        })),
        Ok(None) => {
            *guard = None;
            Err(Error::agent(
                "WatchSegments",
                tonic::Status::unavailable("the agent ended the watch"),
            ))
        }
        Err(s) => {
            *guard = None;
            Err(Error::agent("WatchSegments", s))
        }
    }
}

#[pymethods]
impl Watch {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> Result<Option<SegmentEvent>> {
        wait(
            py,
            next_event(self.stream.clone(), self.closed.subscribe(), None),
        )
    }

    /// The next event, or None when `timeout` seconds pass first (or the watch was closed).
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> Result<Option<SegmentEvent>> {
        let t = seconds("timeout", timeout)?;
        wait(
            py,
            next_event(self.stream.clone(), self.closed.subscribe(), t),
        )
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (stream, closed) = (self.stream.clone(), self.closed.subscribe());
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            match next_event(stream, closed, None).await? {
                Some(ev) => Ok(ev),
                None => Err(pyo3::exceptions::PyStopAsyncIteration::new_err(())),
            }
        })
    }

    /// Ends the watch: iteration stops, also in threads waiting for the next event.
    fn close(&self, py: Python<'_>) {
        self.closed.send_replace(true);
        py.detach(|| runtime().block_on(async { self.stream.lock().await.take() }));
    }
}

/// The options of one submitted batch.
fn batch_of(
    local: &Segment,
    remote: String,
    remote_key: u64,
    write: bool,
    ops: &Ops,
    timeout: Option<f64>,
    checksum: bool,
) -> Result<(Batch, Option<Duration>)> {
    let t = seconds("timeout", timeout)?;
    Ok((
        Batch {
            local_segment: local.name.clone(),
            local_key: local.key,
            remote_segment: remote,
            remote_key,
            write,
            ops: ops.0.clone(),
            timeout_ms: t.map_or(0, |t| t.as_millis().max(1) as u64),
            checksum,
        },
        t,
    ))
}

/// A connection to the node's agent (see `kvfabric.Client`).
#[pyclass(module = "kvfabric._native", frozen)]
#[derive(Debug)]
pub struct Client {
    agent: Agent,
    /// How long any call may go unanswered (a batch: its own timeout plus this).
    deadline: Duration,
}

impl Client {
    pub(crate) fn agent(&self) -> &Agent {
        &self.agent
    }

    pub(crate) fn deadline(&self) -> Duration {
        self.deadline
    }

    fn submit_future(
        &self,
        batch: Batch,
        timeout: Option<Duration>,
        trace: TraceHeaders,
    ) -> impl Future<Output = Result<Transfer>> + Send + 'static {
        let agent = self.agent.clone();
        let limit = timeout.map_or(self.deadline, |t| t + self.deadline);
        async move {
            within(limit, "Submit", agent.submit(batch, &trace))
                .await
                .map(Transfer::from)
        }
    }
}

/// A hold's time to live: positive seconds, at least a millisecond (the agent counts in ms).
fn hold_ttl(field: &str, ttl: f64) -> Result<Duration> {
    seconds(field, Some(ttl))?
        .filter(|t| *t >= Duration::from_millis(1))
        .ok_or_else(|| Error::invalid(field, ttl, "must be at least 0.001 seconds"))
}

impl Client {
    fn create_hold_future(
        &self,
        segment: &Segment,
        planes: Vec<(u32, u64, u64, u64)>,
        block_ids: &Bound<'_, PyAny>,
        ttl: f64,
    ) -> Result<impl Future<Output = Result<u64>> + Send + 'static> {
        let ttl = hold_ttl("ttl", ttl)?;
        let ids = batch::indexes(block_ids, "block_ids")?;
        let planes = planes
            .into_iter()
            .map(|(region, base, stride, block_bytes)| HoldPlane {
                region,
                base,
                stride,
                block_bytes,
            })
            .collect();
        let (agent, deadline) = (self.agent.clone(), self.deadline);
        let segment = (segment.name.clone(), segment.key);
        Ok(async move {
            within(
                deadline,
                "CreateHold",
                agent.create_hold(segment, planes, ids, ttl),
            )
            .await
            .map(|h| h.key)
        })
    }

    fn extend_hold_future(
        &self,
        segment: &Segment,
        hold_key: u64,
        ttl: f64,
    ) -> Result<impl Future<Output = Result<f64>> + Send + 'static> {
        let ttl = hold_ttl("ttl", ttl)?;
        let (agent, deadline) = (self.agent.clone(), self.deadline);
        let segment = (segment.name.clone(), segment.key);
        Ok(async move {
            within(
                deadline,
                "ExtendHold",
                agent.extend_hold(segment, hold_key, ttl),
            )
            .await
            .map(|left| left.as_secs_f64())
        })
    }

    fn end_hold_future(
        &self,
        segment: &Segment,
        hold_key: u64,
        timeout: Option<f64>,
    ) -> Result<impl Future<Output = Result<()>> + Send + 'static> {
        let timeout = timeout.map(|t| hold_ttl("timeout", t)).transpose()?;
        let (agent, deadline) = (self.agent.clone(), self.deadline);
        // The agent's own wait for the readers' agents, plus the usual allowance.
        let limit = timeout.unwrap_or(Duration::from_secs(5)) + deadline;
        let segment = (segment.name.clone(), segment.key);
        Ok(
            async move { within(limit, "EndHold", agent.end_hold(segment, hold_key, timeout)).await },
        )
    }
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (socket_dir, timeout=60.0))]
    fn new(py: Python<'_>, socket_dir: PathBuf, timeout: f64) -> Result<Self> {
        let deadline = seconds("timeout", Some(timeout))?.unwrap_or(Duration::from_secs(60));
        let agent = wait(py, async {
            within(deadline, "connect", Agent::connect(&socket_dir)).await
        })?;
        Ok(Client { agent, deadline })
    }

    #[getter]
    fn socket_dir(&self) -> PathBuf {
        self.agent.socket_dir().to_path_buf()
    }

    /// Publishes `regions` (HostBuffer or CudaRegion) as segment `name`.
    #[pyo3(signature = (name, regions, key=None, keep=None))]
    fn register(
        &self,
        py: Python<'_>,
        name: String,
        regions: Vec<Bound<'_, PyAny>>,
        key: Option<u64>,
        keep: Option<Vec<Py<PyAny>>>,
    ) -> Result<Segment> {
        let mut hosts: Vec<Option<Arc<crate::agent::HostMemory>>> = Vec::new();
        let mut cudas: Vec<Option<CudaRegion>> = Vec::new();
        for (i, r) in regions.iter().enumerate() {
            if let Ok(h) = r.cast::<HostBuffer>() {
                hosts.push(Some(h.get().memory.clone()));
                cudas.push(None);
            } else if let Ok(c) = r.cast::<CudaRegion>() {
                hosts.push(None);
                cudas.push(Some(c.get().clone()));
            } else {
                return Err(Error::invalid(
                    format!("regions[{i}]"),
                    r.to_string(),
                    "must be a HostBuffer or a CudaRegion (kvfabric.Client.register converts \
                     tensors and arrays)",
                ));
            }
        }
        let deadline = self.deadline;
        let cudas: Vec<Option<CudaMemory>> = cudas
            .into_iter()
            .map(|c| {
                c.map(|c| CudaMemory {
                    device: c.device,
                    device_uuid: c.device_uuid,
                    ipc_handle: c.ipc_handle,
                    offset: c.offset,
                    len: c.len,
                })
            })
            .collect();
        let (name, key, infos) = wait(py, async {
            let sources: Vec<Source<'_>> = hosts
                .iter()
                .zip(&cudas)
                .map(|(h, c)| match (h, c) {
                    (Some(h), _) => Source::Host(h),
                    (None, Some(c)) => Source::Cuda(c),
                    (None, None) => unreachable!("every region is host or cuda"),
                })
                .collect();
            within(
                deadline,
                "RegisterSegment",
                self.agent.register(&name, &sources, key.unwrap_or(0)),
            )
            .await
        })?;
        let mut memory: Vec<Py<PyAny>> = regions.into_iter().map(|r| r.unbind()).collect();
        memory.extend(keep.unwrap_or_default());
        Ok(Segment {
            name,
            key,
            regions: infos.into_iter().map(Region::from).collect(),
            memory,
        })
    }

    /// Unpublishes `segment`; returns once no transfer uses its memory.
    fn deregister(&self, py: Python<'_>, segment: &Segment) -> Result<()> {
        wait(
            py,
            within(
                self.deadline,
                "DeregisterSegment",
                self.agent.deregister(&segment.name, segment.key),
            ),
        )
    }

    /// Moves `ops` between `local` and segment `remote` (pull unless `write`); answers on
    /// completion.
    #[pyo3(signature = (local, remote, remote_key, write, ops, timeout=None, checksum=false, traceparent=None, tracestate=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        local: &Segment,
        remote: String,
        remote_key: u64,
        write: bool,
        ops: &Ops,
        timeout: Option<f64>,
        checksum: bool,
        traceparent: Option<String>,
        tracestate: Option<String>,
    ) -> Result<Transfer> {
        let (batch, t) = batch_of(local, remote, remote_key, write, ops, timeout, checksum)?;
        let trace = TraceHeaders {
            traceparent,
            tracestate,
        };
        wait(py, self.submit_future(batch, t, trace))
    }

    /// `submit`, as an awaitable.
    #[pyo3(signature = (local, remote, remote_key, write, ops, timeout=None, checksum=false, traceparent=None, tracestate=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_async<'py>(
        &self,
        py: Python<'py>,
        local: &Segment,
        remote: String,
        remote_key: u64,
        write: bool,
        ops: &Ops,
        timeout: Option<f64>,
        checksum: bool,
        traceparent: Option<String>,
        tracestate: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (batch, t) = batch_of(local, remote, remote_key, write, ops, timeout, checksum)?;
        let trace = TraceHeaders {
            traceparent,
            tracestate,
        };
        let f = self.submit_future(batch, t, trace);
        pyo3_async_runtimes::tokio::future_into_py(py, async move { Ok(f.await?) })
    }

    /// Grants reads of `block_ids` of every plane (`(region, base, stride, block_bytes)`) of
    /// `segment` for `ttl` seconds; returns the hold's key, for the one reader it is for.
    fn create_hold(
        &self,
        py: Python<'_>,
        segment: &Segment,
        planes: Vec<(u32, u64, u64, u64)>,
        block_ids: &Bound<'_, PyAny>,
        ttl: f64,
    ) -> Result<u64> {
        let f = self.create_hold_future(segment, planes, block_ids, ttl)?;
        wait(py, f)
    }

    /// `create_hold`, as an awaitable.
    fn create_hold_async<'py>(
        &self,
        py: Python<'py>,
        segment: &Segment,
        planes: Vec<(u32, u64, u64, u64)>,
        block_ids: &Bound<'_, PyAny>,
        ttl: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let f = self.create_hold_future(segment, planes, block_ids, ttl)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move { Ok(f.await?) })
    }

    /// Moves a live hold's expiry to `ttl` seconds from now (never earlier); returns the
    /// seconds it now has.
    fn extend_hold(
        &self,
        py: Python<'_>,
        segment: &Segment,
        hold_key: u64,
        ttl: f64,
    ) -> Result<f64> {
        let f = self.extend_hold_future(segment, hold_key, ttl)?;
        wait(py, f)
    }

    /// `extend_hold`, as an awaitable.
    fn extend_hold_async<'py>(
        &self,
        py: Python<'py>,
        segment: &Segment,
        hold_key: u64,
        ttl: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let f = self.extend_hold_future(segment, hold_key, ttl)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move { Ok(f.await?) })
    }

    /// Ends a hold; returns once no read under it can land. `timeout`: seconds the agent
    /// waits for the readers' agents (None: its 5 s).
    #[pyo3(signature = (segment, hold_key, timeout=None))]
    fn end_hold(
        &self,
        py: Python<'_>,
        segment: &Segment,
        hold_key: u64,
        timeout: Option<f64>,
    ) -> Result<()> {
        let f = self.end_hold_future(segment, hold_key, timeout)?;
        wait(py, f)
    }

    /// `end_hold`, as an awaitable.
    #[pyo3(signature = (segment, hold_key, timeout=None))]
    fn end_hold_async<'py>(
        &self,
        py: Python<'py>,
        segment: &Segment,
        hold_key: u64,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let f = self.end_hold_future(segment, hold_key, timeout)?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move { Ok(f.await?) })
    }

    /// The agent's status document as JSON text.
    fn status_json(&self, py: Python<'_>) -> Result<String> {
        wait(py, within(self.deadline, "Status", self.agent.status()))
    }

    fn status_json_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let agent = self.agent.clone();
        let deadline = self.deadline;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            Ok(within(deadline, "Status", agent.status()).await?)
        })
    }

    /// Segment changes, starting with every segment known now.
    fn watch(&self, py: Python<'_>) -> Result<Watch> {
        let stream = wait(
            py,
            within(self.deadline, "WatchSegments", self.agent.watch()),
        )?;
        Ok(Watch {
            stream: Arc::new(tokio::sync::Mutex::new(Some(stream))),
            closed: tokio::sync::watch::channel(false).0,
        })
    }
}
