//! `kvfabric agent`: binds its sockets, joins the registry, serves the local API, the peer API and
//! the data plane, and drains on shutdown.
//!
//! [`Agent::start`] takes bound [`Listeners`], a registry and the trace pipeline, and returns once
//! the agent serves and is in the registry; [`Agent::serve`] runs it until `shutdown` resolves,
//! then drains: health goes NOT_SERVING, the registry entries go (the lease is revoked), the
//! APIs stop taking calls, in-flight transfers get the grace period, the data plane stops last.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::TryStreamExt;
use kvfabric_engine::{
    Engine, EngineConfig, RdmaConfig, ServeObserver, ServedChunk, TransportKind,
};
use kvfabric_proto::contract::socket;
use kvfabric_proto::limits::{MAX_CREATE_HOLD_BYTES, MAX_PEER_REQUEST_BYTES, max_submit_bytes};
use kvfabric_proto::pb::local_agent_server::LocalAgentServer;
use kvfabric_proto::pb::peer_agent_server::PeerAgentServer;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;
use tracing::{info, warn};

use crate::authority::AuthorityRewrite;
use crate::config::AgentConfig;
use crate::discovery;
use crate::error::{Error, Result};
use crate::incoming;
use crate::local_api::LocalApi;
use crate::message_limit;
use crate::metrics::{Metrics, ServedLabels, SharedMetrics};
use crate::node::{Node, NodeConfig};
use crate::peer_api::PeerApi;
use crate::peer_token::PeerToken;
use crate::readiness::Readiness;
use crate::registry::{AgentEntry, SharedRegistry};
use crate::telemetry::Telemetry;

pub use kvfabric_proto::ready::Ready;

/// The sockets an agent serves on, bound by the caller (tests bind port 0 and temp dirs).
#[derive(Debug)]
pub struct Listeners {
    pub peer: TcpListener,
    pub metrics: TcpListener,
    pub data: TcpListener,
    pub local: UnixListener,
    pub fd: UnixListener,
    pub shm: UnixListener,
    pub socket_dir: PathBuf,
}

impl Listeners {
    /// Binds the addresses and the socket directory of `config`. The Unix sockets get
    /// `socket_mode` and `socket_group`, so workers that are not root can connect. A socket
    /// file another live agent still serves on is refused, never replaced: two agents sharing
    /// a directory would otherwise take each other's workers.
    pub async fn bind(config: &AgentConfig) -> Result<Self> {
        let dir = &config.socket_dir;
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create socket dir {}", dir.display()), e))?;
        let unix = |name: &str| -> Result<UnixListener> {
            let path = dir.join(name);
            claim_socket_path(&path)?;
            let listener = UnixListener::bind(&path)
                .map_err(|e| Error::io(format!("bind {}", path.display()), e))?;
            set_socket_access(&path, config.socket_mode, config.socket_group)?;
            Ok(listener)
        };
        let tcp = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|e| Error::io(format!("bind {addr}"), e))
        };
        Ok(Listeners {
            peer: tcp(config.grpc_addr).await?,
            metrics: tcp(config.metrics_addr).await?,
            data: tcp(config.data_addr).await?,
            local: unix(socket::LOCAL)?,
            fd: unix(socket::FD)?,
            shm: unix(socket::SHM)?,
            socket_dir: dir.clone(),
        })
    }
}

/// Makes `path` free for a new socket: a stale file of a dead agent goes, a live one is an
/// error naming the path.
fn claim_socket_path(path: &Path) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(Error::config(
            "socket-dir",
            path.display(),
            "another agent serves on this socket: give each fabric and pool its own directory",
        ));
    }
    std::fs::remove_file(path).map_err(|e| Error::io(format!("remove stale {}", path.display()), e))
}

fn set_socket_access(path: &Path, mode: u32, group: Option<u32>) -> Result<()> {
    if let Some(gid) = group {
        std::os::unix::fs::chown(path, None, Some(gid))
            .map_err(|e| Error::io(format!("chown {} to group {gid}", path.display()), e))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {:o} {}", mode, path.display()), e))
}

/// A started agent: serving, and in the registry.
#[derive(Debug)]
pub struct Agent {
    ready: Ready,
    config: AgentConfig,
    node: Arc<Node>,
    registry: SharedRegistry,
    readiness: Arc<Readiness>,
    follow: JoinHandle<()>,
    api_stop: watch::Sender<bool>,
    data_stop: watch::Sender<bool>,
    api_tasks: Vec<ApiTask>,
    fd_task: JoinHandle<()>,
    sweep_task: JoinHandle<()>,
    tls_watch: Option<JoinHandle<()>>,
    data_tasks: Vec<JoinHandle<kvfabric_engine::Result<()>>>,
    metrics_task: JoinHandle<std::io::Result<()>>,
    /// When the data plane last served a chunk to a peer.
    served: Arc<LastServed>,
}

/// Resolves once the stop signal `rx` watches is raised.
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

type ApiTask = JoinHandle<std::result::Result<(), tonic::transport::Error>>;

/// The local API (workers, on the Unix socket) and the peer API (other agents, on TCP), each
/// with its request-size limits and accept caps, until `api_rx` says stop.
fn api_servers(
    config: &AgentConfig,
    local: UnixListener,
    peer: TcpListener,
    node: &Arc<Node>,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    api_rx: &watch::Receiver<bool>,
) -> Vec<ApiTask> {
    let metrics = &node.metrics;
    let submit_limit = max_submit_bytes(config.max_batch_ops);
    let local_svc = LocalAgentServer::new(LocalApi { node: node.clone() })
        .max_decoding_message_size(submit_limit.max(MAX_CREATE_HOLD_BYTES));
    // The token is checked on the headers, before the body is read; a call that passes
    // marks its connection authenticated, which the peer port's accept loop never sheds.
    let peer_svc = InterceptedService::new(
        PeerAgentServer::new(PeerApi { node: node.clone() })
            .max_decoding_message_size(MAX_PEER_REQUEST_BYTES),
        PeerToken::interceptor(config.peer_token.clone()),
    );
    let refused = metrics.accept_errors.clone();
    let local_task = tokio::spawn(
        grpc_server()
            .layer(message_limit::layer(move |method| match method {
                SUBMIT_METHOD => submit_limit,
                CREATE_HOLD_METHOD => MAX_CREATE_HOLD_BYTES,
                _ => MAX_LOCAL_REQUEST_BYTES,
            }))
            .add_service(health.clone())
            .add_service(local_svc)
            .serve_with_incoming_shutdown(
                // grpcio's `:authority` for a Unix socket is made acceptable to h2.
                incoming::capped(
                    local,
                    incoming::LOCAL,
                    metrics.shedding(incoming::LOCAL.port),
                    refused.clone(),
                )
                .map_ok(AuthorityRewrite::new),
                stopped(api_rx.clone()),
            ),
    );
    let peer_router = grpc_server()
        .layer(message_limit::layer(|_| MAX_PEER_REQUEST_BYTES))
        .add_service(health)
        .add_service(peer_svc);
    let peer_conns = incoming::capped(
        peer,
        incoming::PEER,
        metrics.shedding(incoming::PEER.port),
        refused,
    );
    // With mTLS, a client certificate of the fabric's CA carrying the fabric's name is
    // required before the first byte of HTTP/2 is read (the token is checked after, on the
    // headers); the handshake is done here so that a renewed certificate is used at once.
    let peer_task = match &config.tls {
        None => tokio::spawn(
            peer_router.serve_with_incoming_shutdown(peer_conns, stopped(api_rx.clone())),
        ),
        Some(tls) => tokio::spawn(
            peer_router
                .serve_with_incoming_shutdown(tls.accept(peer_conns), stopped(api_rx.clone())),
        ),
    };
    vec![local_task, peer_task]
}

/// How long the data plane must have served nothing before a draining agent takes its memory
/// away: a peer's batch is many chunks over several connections, and between two chunks no
/// region is leased, so "no chunk being served" alone is not "no batch in flight".
const DRAIN_QUIET: Duration = Duration::from_secs(1);

/// When the data plane last served a chunk (a peer's batch in flight keeps it recent).
#[derive(Debug)]
struct LastServed {
    since: Instant,
    millis: AtomicU64,
}

impl LastServed {
    fn new() -> Self {
        LastServed {
            since: Instant::now(),
            millis: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        // + 1: 0 stays "never".
        let now = self.since.elapsed().as_millis() as u64 + 1;
        self.millis.fetch_max(now, Ordering::Relaxed);
    }

    /// Waits until nothing was served for `quiet` (returns at once if nothing was served that
    /// recently).
    async fn quiet_for(&self, quiet: Duration) {
        loop {
            let last = self.millis.load(Ordering::Relaxed);
            let idle = self
                .since
                .elapsed()
                .saturating_sub(Duration::from_millis(last));
            if last == 0 || idle >= quiet {
                return;
            }
            tokio::time::sleep(quiet - idle).await;
        }
    }
}

pub use crate::incoming::{MAX_LOCAL_CONNECTIONS, MAX_PEER_CONNECTIONS};
/// Largest request of a local API method other than Submit (a registration of many regions).
pub const MAX_LOCAL_REQUEST_BYTES: usize = 1 << 20;
const SUBMIT_METHOD: &str = "/kvfabric.v1.LocalAgent/Submit";
const CREATE_HOLD_METHOD: &str = "/kvfabric.v1.LocalAgent/CreateHold";

/// A gRPC server with the agent's connection settings: dead peers are noticed by keepalives,
/// and every request has a deadline.
fn grpc_server() -> Server {
    Server::builder()
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .max_concurrent_streams(Some(256))
}

fn advertise(config: &AgentConfig, devices: &discovery::Devices) -> IpAddr {
    config
        .advertise_addr
        .or_else(|| (!config.data_addr.ip().is_unspecified()).then(|| config.data_addr.ip()))
        .or_else(|| devices.addresses.first().map(|a| a.ip))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// The embedded engine's settings, from the agent's.
fn engine_config(config: &AgentConfig, observer: Arc<ServedSpans>) -> EngineConfig {
    EngineConfig {
        name: format!("agent-{}", config.name),
        observer: Some(observer),
        tcp_connections: config.tcp_connections,
        tcp_buffer: config.tcp_buffer,
        tls: config
            .tls
            .as_ref()
            .filter(|_| config.tls_data_port)
            .map(|t| t.data.clone().kernel_records(config.tls_kernel_records)),
        batch_timeout: config.batch_timeout,
        max_batch_ops: config.max_batch_ops,
        cuda_path: config.cuda_path,
        // RDMA only where it is an allowed transport: otherwise no memory is pinned for it.
        rdma: RdmaConfig {
            enabled: config.transports.contains(&TransportKind::Rdma),
            devices: config.rdma_devices.clone(),
            gid: config.rdma_gid_index,
            qps_per_peer: config.rdma_qps_per_peer,
            ..RdmaConfig::default()
        },
        ..EngineConfig::default()
    }
}

/// What the node (the APIs' shared state) needs of the agent's settings.
fn node_config(config: &AgentConfig, advertise: IpAddr) -> NodeConfig {
    NodeConfig {
        name: config.name.clone(),
        fabric: config.fabric.clone(),
        pool: config.pool.clone(),
        transports: config.transports.clone(),
        advertise,
        batch_timeout: config.batch_timeout,
        max_batch_ops: config.max_batch_ops,
        connect_timeout: config.connect_timeout,
        peer_token: config.peer_token.clone(),
        tls: config.tls.clone().map(Arc::new),
    }
}

/// Holds end at their expiry even when nothing else touches them: the table (and the grants
/// this agent keeps) stay bounded, and the metrics count them.
async fn sweep_holds(node: Arc<Node>, stop: impl std::future::Future<Output = ()>) {
    tokio::pin!(stop);
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = every.tick() => node.sweep_holds(),
            () = &mut stop => return,
        }
    }
}

impl Agent {
    /// Starts serving on `listeners` and publishes the agent in `registry`; returns once both
    /// are done (what `ready()` then says is true).
    pub async fn start(
        config: AgentConfig,
        listeners: Listeners,
        registry: SharedRegistry,
        telemetry: &Telemetry,
    ) -> Result<Agent> {
        let name = config.name.clone();
        let devices = tokio::task::spawn_blocking(discovery::discover)
            .await
            .map_err(|e| Error::io("device discovery", std::io::Error::other(e)))?;
        let advertise = advertise(&config, &devices);
        let metrics: SharedMetrics = Arc::new(Metrics::new(&telemetry.counters));
        let served = Arc::new(LastServed::new());
        if config.tls.is_some() && config.tls_data_port {
            let layer = kvfabric_engine::RecordLayer::chosen(config.tls_kernel_records);
            info!(records = %layer.describe(), "tcp data port TLS");
        }
        let observer = Arc::new(ServedSpans {
            agent: name.clone(),
            tracing: telemetry.tracing_enabled(),
            metrics: metrics.clone(),
            last: served.clone(),
        });
        let engine = Engine::new(engine_config(&config, observer))?;
        let local_addr = |l: &TcpListener, what: &str| {
            l.local_addr()
                .map_err(|e| Error::io(format!("{what} listener address"), e))
        };
        let peer_local = local_addr(&listeners.peer, "peer")?;
        let data_local = local_addr(&listeners.data, "data")?;
        let metrics_addr = local_addr(&listeners.metrics, "metrics")?;
        let peer_addr = SocketAddr::new(
            if peer_local.ip().is_unspecified() {
                advertise
            } else {
                peer_local.ip()
            },
            peer_local.port(),
        );
        let node = Node::new(
            node_config(&config, advertise),
            engine.clone(),
            registry.clone(),
            metrics.clone(),
            peer_addr,
        );

        // Servers stop in two steps: the APIs first (nothing new comes in, in-flight calls
        // finish), the data plane last (peers finish the batches they run against our memory).
        let (api_stop, api_rx) = watch::channel(false);
        let (data_stop, data_rx) = watch::channel(false);
        let data_tasks = vec![
            tokio::spawn({
                let (e, s) = (engine.clone(), stopped(data_rx.clone()));
                async move { e.serve_tcp(listeners.data, s).await }
            }),
            tokio::spawn({
                let (e, s) = (engine.clone(), stopped(data_rx.clone()));
                async move { e.serve_shm(listeners.shm, s).await }
            }),
        ];
        // Not ready (health and /healthz) until the agent is in the registry.
        let (health, health_svc) = tonic_health::server::health_reporter();
        let readiness = Readiness::new(health).await;
        let api_tasks = api_servers(
            &config,
            listeners.local,
            listeners.peer,
            &node,
            health_svc,
            &api_rx,
        );
        // The data port uses the certificate until the very end, so the files are watched
        // until then.
        let tls_watch = config.tls.clone().map(|tls| {
            tls.watch(
                metrics.tls_reloads.clone(),
                metrics.tls_reload_refusals.clone(),
                stopped(data_rx.clone()),
            )
        });
        let metrics_task = tokio::spawn(
            axum::serve(
                listeners.metrics,
                metrics_router(node.clone(), readiness.clone()),
            )
            .with_graceful_shutdown(stopped(data_rx.clone()))
            .into_future(),
        );
        let sweep_task = tokio::spawn(sweep_holds(node.clone(), stopped(api_rx.clone())));
        let fd_task = tokio::spawn(crate::fd_socket::serve(
            listeners.fd,
            node.clone(),
            stopped(api_rx.clone()),
        ));
        while engine.descriptor().endpoints.tcp.is_none()
            || engine.descriptor().endpoints.shm.is_none()
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }

        let own = AgentEntry {
            name: name.clone(),
            pool: config.pool.clone(),
            role: config.pool_role.map(|r| r.to_string()),
            node: engine.config().node.clone(),
            peer_addr,
            devices,
            started_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            instance: rand::random(),
        };
        node.set_own_entry(own.clone());
        registry.register_agent(own).await?;
        readiness.set(true).await;
        let follow = readiness.follow(registry.clone(), config.tls.clone());
        let ready = Ready {
            agent: name.clone(),
            peer: peer_addr,
            metrics: metrics_addr,
            data: SocketAddr::new(advertise, data_local.port()),
            socket_dir: listeners.socket_dir.clone(),
            registry: registry.state().backend,
        };
        info!(agent = %name, %peer_addr, data = %ready.data, "agent serving");
        Ok(Agent {
            ready,
            config,
            node,
            registry,
            readiness,
            follow,
            api_stop,
            data_stop,
            api_tasks,
            fd_task,
            sweep_task,
            tls_watch,
            data_tasks,
            metrics_task,
            served,
        })
    }

    /// The bound ports and socket directory, as the ready line prints them.
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    /// Serves until `shutdown` resolves, then drains (see the module comment).
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        shutdown.await;
        let grace = self.config.grace;
        info!(?grace, "draining");
        self.follow.abort();
        self.readiness.drain().await;
        let draining = tokio::time::Instant::now();
        if let Err(e) = tokio::time::timeout(grace, self.registry.shutdown()).await {
            warn!(error = %e, "registry shutdown timed out");
        }
        // Peers no longer find this agent; batches they started still pull from its memory,
        // which the steps below release (workers' connections close with the local API).
        let left = grace.saturating_sub(draining.elapsed());
        if tokio::time::timeout(left, self.served.quiet_for(DRAIN_QUIET))
            .await
            .is_err()
        {
            warn!(
                ?grace,
                "peers were still pulling at the end of the grace period"
            );
        }
        let _ = self.api_stop.send(true);
        let node = self.node.clone();
        let drain = async {
            for t in self.api_tasks {
                let _ = t.await;
            }
            let _ = self.fd_task.await;
            let _ = self.sweep_task.await;
            node.release_all().await;
        };
        if tokio::time::timeout(grace, drain).await.is_err() {
            warn!(
                ?grace,
                "in-flight transfers did not finish within the grace period"
            );
        }
        let _ = self.data_stop.send(true);
        for t in self.data_tasks {
            let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
        }
        if let Some(t) = self.tls_watch {
            let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), self.metrics_task).await;
        for name in [socket::LOCAL, socket::FD, socket::SHM] {
            let _ = std::fs::remove_file(self.ready.socket_dir.join(name));
        }
        info!("agent stopped");
        Ok(())
    }
}

/// `/metrics` (registry gauges refreshed at scrape time), `/healthz` (ready: in the registry,
/// not draining and the certificate in use not expired; 503 otherwise, with the reason) and
/// `/livez` (the process answers).
fn metrics_router(node: Arc<Node>, readiness: Arc<Readiness>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let node = node.clone();
                async move {
                    let m = &node.metrics;
                    m.sync_registry(&node.registry.state());
                    m.local_segments.set(node.local_segments().len() as i64);
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        m.encode(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let ready = readiness.is_ready();
                let reason = readiness.reason();
                async move {
                    if ready {
                        (axum::http::StatusCode::OK, "ok".to_owned())
                    } else {
                        let why = reason
                            .map_or_else(|| "not ready".to_owned(), |r| format!("not ready: {r}"));
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, why)
                    }
                }
            }),
        )
        .route("/livez", get(|| async { "ok" }))
}

/// Turns every chunk the engine served for a peer into a metric and, when tracing, a span in
/// the initiator's trace (its context came with the chunk).
#[derive(Debug)]
struct ServedSpans {
    agent: String,
    tracing: bool,
    metrics: SharedMetrics,
    last: Arc<LastServed>,
}

impl ServeObserver for ServedSpans {
    fn served(&self, c: &ServedChunk<'_>) {
        self.last.touch();
        if c.error.is_none() {
            self.metrics
                .served_bytes
                .get_or_create(&ServedLabels {
                    op: c.opcode.to_string(),
                })
                .inc_by(c.bytes);
        }
        let Some(trace) = c.trace.filter(|t| self.tracing && t.flags & 1 == 1) else {
            return;
        };
        use opentelemetry::trace::{Span, SpanKind, Tracer};
        let tracer = opentelemetry::global::tracer("kvfabric");
        let mut span = tracer
            .span_builder("kvfabric.peer.serve")
            .with_kind(SpanKind::Server)
            .with_start_time(c.started)
            .with_attributes(crate::telemetry::served_attributes(c, &self.agent))
            .start_with_context(&tracer, &crate::telemetry::remote_parent(&trace));
        if let Some(e) = &c.error {
            span.set_status(opentelemetry::trace::Status::error(e.clone()));
        }
        span.end_with_timestamp(c.started + c.elapsed);
    }
}
