//! `kvfabric agent`: binds its sockets, joins the registry, serves the local API, the peer API and
//! the data plane, and drains on shutdown.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvfabric_engine::{
    Engine, EngineConfig, RdmaConfig, ServeObserver, ServedChunk, TransportKind,
};
use serde::Serialize;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::transport::Server;
use tracing::{info, warn};

use crate::cli::AgentArgs;
use crate::discovery;
use crate::error::{Error, Result};
use crate::local_api::LocalApi;
use crate::metrics::{Metrics, ServedLabels, SharedMetrics};
use crate::node::{Node, NodeConfig};
use crate::peer_api::PeerApi;
use crate::peer_token::PeerToken;
use crate::registry::etcd::{EtcdConfig, EtcdRegistry, EtcdTls};
use crate::registry::memory::MemoryRegistry;
use crate::registry::{AgentEntry, SharedRegistry};
use crate::rpc::MAX_MESSAGE_BYTES;
use crate::rpc::pb::local_agent_server::LocalAgentServer;
use crate::rpc::pb::peer_agent_server::PeerAgentServer;
use crate::telemetry::Telemetry;

pub const LOCAL_SOCKET: &str = "agent.sock";
pub const FD_SOCKET: &str = "agent.fd.sock";
pub const SHM_SOCKET: &str = "shm.sock";

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
    pub async fn bind(
        socket_dir: &Path,
        peer: SocketAddr,
        data: SocketAddr,
        metrics: SocketAddr,
    ) -> Result<Self> {
        std::fs::create_dir_all(socket_dir)
            .map_err(|e| Error::io(format!("create socket dir {}", socket_dir.display()), e))?;
        let unix = |name: &str| {
            let path = socket_dir.join(name);
            // A socket file left by a previous run would make bind fail.
            let _ = std::fs::remove_file(&path);
            UnixListener::bind(&path).map_err(|e| Error::io(format!("bind {}", path.display()), e))
        };
        let tcp = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|e| Error::io(format!("bind {addr}"), e))
        };
        Ok(Listeners {
            peer: tcp(peer).await?,
            metrics: tcp(metrics).await?,
            data: tcp(data).await?,
            local: unix(LOCAL_SOCKET)?,
            fd: unix(FD_SOCKET)?,
            shm: unix(SHM_SOCKET)?,
            socket_dir: socket_dir.to_path_buf(),
        })
    }
}

/// Printed on stdout once the agent serves, so scripts and tests learn the bound ports.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct Ready {
    pub agent: String,
    pub peer: SocketAddr,
    pub metrics: SocketAddr,
    pub data: SocketAddr,
    pub socket_dir: PathBuf,
    pub registry: String,
}

pub async fn run(
    args: AgentArgs,
    telemetry: &Telemetry,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    validate(&args)?;
    let listeners = Listeners::bind(
        &args.socket_dir,
        args.grpc_addr,
        args.data_addr,
        args.metrics_addr,
    )
    .await?;
    let registry: SharedRegistry = if args.etcd_endpoints.is_empty() {
        MemoryRegistry::standalone()
    } else {
        let tls = match &args.etcd_tls_dir {
            Some(dir) => Some(EtcdTls::from_dir(dir)?),
            None => None,
        };
        let auth = match (&args.etcd_username, &args.etcd_password) {
            (Some(u), Some(p)) => Some((u.clone(), p.clone())),
            (None, None) => None,
            _ => {
                return Err(Error::config(
                    "etcd-username/etcd-password",
                    "(one of them)",
                    "set both or neither",
                ));
            }
        };
        let mut config = EtcdConfig::new(args.etcd_endpoints.clone(), args.fabric.clone());
        config.prefix = args.etcd_key_prefix.clone();
        config.lease_ttl = Duration::from_secs(args.lease_ttl_secs);
        config.tls = tls;
        config.auth = auth;
        EtcdRegistry::connect(config).await?
    };
    let print = |ready: &Ready| {
        // The parent process (or a person) reads this line to learn the bound ports.
        if let Ok(line) = serde_json::to_string(ready) {
            println!("{line}");
        }
    };
    serve(&args, listeners, registry, telemetry, print, shutdown).await
}

fn validate(args: &AgentArgs) -> Result<()> {
    if args.transports.is_empty() {
        return Err(Error::config("transports", "", "name at least one"));
    }
    if args.lease_ttl_secs < 2 {
        return Err(Error::config(
            "lease-ttl-secs",
            args.lease_ttl_secs,
            "must be at least 2",
        ));
    }
    if args.max_batch_ops == 0 {
        return Err(Error::config("max-batch-ops", 0, "must be positive"));
    }
    crate::node::check_segment_name(&agent_name(args))
        .map_err(|_| Error::config("name", agent_name(args), "1..=253 of [A-Za-z0-9-_.:]"))?;
    peer_token(args)?;
    Ok(())
}

/// Parsed here rather than by clap, whose message would echo the secret.
fn peer_token(args: &AgentArgs) -> Result<Option<PeerToken>> {
    args.peer_token
        .as_deref()
        .map(|t| {
            t.parse()
                .map_err(|reason| Error::config("peer-token", "(hidden)", reason))
        })
        .transpose()
}

fn agent_name(args: &AgentArgs) -> String {
    args.name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()))
        .unwrap_or_else(|| {
            rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned()
        })
}

fn advertise(args: &AgentArgs, devices: &discovery::Devices) -> IpAddr {
    args.advertise_addr
        .or_else(|| std::env::var("POD_IP").ok()?.parse().ok())
        .or_else(|| (!args.data_addr.ip().is_unspecified()).then(|| args.data_addr.ip()))
        .or_else(|| devices.addresses.first().map(|a| a.ip))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Serves on `listeners` with `registry` until `shutdown` resolves, then drains.
pub async fn serve(
    args: &AgentArgs,
    listeners: Listeners,
    registry: SharedRegistry,
    telemetry: &Telemetry,
    on_ready: impl FnOnce(&Ready),
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let name = agent_name(args);
    let devices = tokio::task::spawn_blocking(discovery::discover)
        .await
        .map_err(|e| Error::io("device discovery", std::io::Error::other(e)))?;
    let advertise = advertise(args, &devices);
    let metrics: SharedMetrics = Arc::new(Metrics::new(&telemetry.counters));
    let engine = Engine::new(EngineConfig {
        name: format!("agent-{name}"),
        observer: Some(Arc::new(ServedSpans {
            agent: name.clone(),
            tracing: telemetry.tracing_enabled(),
            metrics: metrics.clone(),
        })),
        tcp_connections: args.tcp_connections,
        batch_timeout: Duration::from_millis(args.batch_timeout_ms),
        max_batch_ops: args.max_batch_ops,
        cuda_path: args.cuda_path,
        // RDMA only where it is an allowed transport: otherwise no memory is pinned for it.
        rdma: RdmaConfig {
            enabled: args.transports.contains(&TransportKind::Rdma),
            devices: args.rdma_devices.clone(),
            gid: args.rdma_gid_index,
            qps_per_peer: args.rdma_qps_per_peer,
            ..RdmaConfig::default()
        },
        ..EngineConfig::default()
    })?;
    let peer_local = listeners
        .peer
        .local_addr()
        .map_err(|e| Error::io("peer listener address", e))?;
    let data_local = listeners
        .data
        .local_addr()
        .map_err(|e| Error::io("data listener address", e))?;
    let peer_addr = SocketAddr::new(
        if peer_local.ip().is_unspecified() {
            advertise
        } else {
            peer_local.ip()
        },
        peer_local.port(),
    );
    let node = Node::new(
        NodeConfig {
            name: name.clone(),
            fabric: args.fabric.clone(),
            pool: args.pool.clone(),
            transports: args.transports.clone(),
            advertise,
            batch_timeout: Duration::from_millis(args.batch_timeout_ms),
            max_batch_ops: args.max_batch_ops,
            connect_timeout: Duration::from_millis(args.connect_timeout_ms),
            peer_token: peer_token(args)?,
        },
        engine.clone(),
        registry.clone(),
        metrics.clone(),
        peer_addr,
    );

    // Servers stop in two steps: the APIs first (nothing new comes in, in-flight calls finish),
    // the data plane last (peers finish the batches they run against our memory).
    let (api_stop, api_rx) = watch::channel(false);
    let (data_stop, data_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let data_tasks = [
        tokio::spawn({
            let (e, s) = (engine.clone(), stopped(data_rx.clone()));
            async move { e.serve_tcp(listeners.data, s).await }
        }),
        tokio::spawn({
            let (e, s) = (engine.clone(), stopped(data_rx.clone()));
            async move { e.serve_shm(listeners.shm, s).await }
        }),
    ];
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_serving::<LocalAgentServer<LocalApi>>().await;
    health.set_serving::<PeerAgentServer<PeerApi>>().await;
    let local_svc = LocalAgentServer::new(LocalApi { node: node.clone() })
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let peer_svc = PeerAgentServer::new(PeerApi { node: node.clone() })
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let api_tasks = [
        tokio::spawn(
            Server::builder()
                .add_service(health_svc.clone())
                .add_service(local_svc)
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listeners.local),
                    stopped(api_rx.clone()),
                ),
        ),
        tokio::spawn(
            Server::builder()
                .add_service(health_svc)
                .add_service(peer_svc)
                .serve_with_incoming_shutdown(
                    TcpListenerStream::new(listeners.peer),
                    stopped(api_rx.clone()),
                ),
        ),
    ];
    let metrics_addr = listeners
        .metrics
        .local_addr()
        .map_err(|e| Error::io("metrics listener address", e))?;
    let metrics_task = tokio::spawn(
        axum::serve(listeners.metrics, metrics_router(node.clone()))
            .with_graceful_shutdown(stopped(data_rx.clone()))
            .into_future(),
    );
    let fd_task = tokio::spawn(crate::fd_socket::serve(
        listeners.fd,
        node.clone(),
        stopped(api_rx.clone()),
    ));
    while engine.descriptor().endpoints.tcp.is_none() || engine.descriptor().endpoints.shm.is_none()
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let started_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    registry
        .register_agent(AgentEntry {
            name: name.clone(),
            pool: args.pool.clone(),
            node: engine.config().node.clone(),
            peer_addr,
            devices,
            started_at,
        })
        .await?;
    let ready = Ready {
        agent: name.clone(),
        peer: peer_addr,
        metrics: metrics_addr,
        data: SocketAddr::new(advertise, data_local.port()),
        socket_dir: listeners.socket_dir.clone(),
        registry: registry.state().backend,
    };
    on_ready(&ready);
    info!(agent = %name, %peer_addr, data = %ready.data, "agent serving");

    shutdown.await;
    let grace = Duration::from_secs(args.grace_secs);
    info!(?grace, "draining");
    health.set_not_serving::<LocalAgentServer<LocalApi>>().await;
    health.set_not_serving::<PeerAgentServer<PeerApi>>().await;
    if let Err(e) = tokio::time::timeout(grace, registry.shutdown()).await {
        warn!(error = %e, "registry shutdown timed out");
    }
    let _ = api_stop.send(true);
    let drain = async {
        for t in api_tasks {
            let _ = t.await;
        }
        let _ = fd_task.await;
        node.release_all().await;
    };
    if tokio::time::timeout(grace, drain).await.is_err() {
        warn!(
            ?grace,
            "in-flight transfers did not finish within the grace period"
        );
    }
    let _ = data_stop.send(true);
    for t in data_tasks {
        let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), metrics_task).await;
    for name in [LOCAL_SOCKET, FD_SOCKET] {
        let _ = std::fs::remove_file(listeners.socket_dir.join(name));
    }
    info!("agent stopped");
    Ok(())
}

/// `/metrics` (registry gauges refreshed at scrape time) and `/healthz`.
fn metrics_router(node: Arc<Node>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let node = node.clone();
                async move {
                    let m = &node.metrics;
                    let state = node.registry.state();
                    m.registry_connected.set(i64::from(state.connected));
                    m.registry_agents.set(state.agents as i64);
                    m.registry_segments.set(state.segments as i64);
                    m.registry_reregistrations.set(state.reregistrations as i64);
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
        .route("/healthz", get(|| async { "ok" }))
}

/// Turns every chunk the engine served for a peer into a metric and, when tracing, a span in
/// the initiator's trace (its context came with the chunk).
#[derive(Debug)]
struct ServedSpans {
    agent: String,
    tracing: bool,
    metrics: SharedMetrics,
}

impl ServeObserver for ServedSpans {
    fn served(&self, c: &ServedChunk<'_>) {
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

/// An agent served by a task of this process (tests, `kvfabric bench --through-agent`): its own
/// socket directory and loopback ports, a registry handed in (e.g. a shared in-memory store).
/// Stops on drop or `stop`.
#[derive(Debug)]
pub struct InProcessAgent {
    dir: tempfile::TempDir,
    stop: tokio::sync::watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<Result<()>>>,
    pub ready: Ready,
}

impl InProcessAgent {
    /// `flags`: extra `kvfabric agent` flags (e.g. `--transports tcp`). `telemetry`: this
    /// process's trace pipeline (`Telemetry::default()`: none).
    pub async fn start(
        name: &str,
        registry: SharedRegistry,
        telemetry: Telemetry,
        flags: &[&str],
    ) -> Result<Self> {
        use clap::Parser;
        let dir = tempfile::tempdir().map_err(|e| Error::io("agent socket dir", e))?;
        let socket_dir = dir.path().display().to_string();
        let mut argv = vec![
            "kvfabric",
            "agent",
            "--name",
            name,
            "--socket-dir",
            &socket_dir,
            "--grpc-addr",
            "127.0.0.1:0",
            "--data-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ];
        argv.extend_from_slice(flags);
        let cli = crate::cli::Cli::try_parse_from(argv)
            .map_err(|e| Error::config("agent flags", flags.join(" "), e.to_string()))?;
        let crate::cli::Command::Agent(args) = cli.command else {
            return Err(Error::config(
                "agent flags",
                name,
                "not an agent command line",
            ));
        };
        let listeners = Listeners::bind(
            dir.path(),
            args.grpc_addr,
            args.data_addr,
            args.metrics_addr,
        )
        .await?;
        let (stop, mut rx) = watch::channel(false);
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            serve(
                &args,
                listeners,
                registry,
                &telemetry,
                move |r| {
                    let _ = ready_tx.send(serde_json::to_value(r).ok());
                },
                async move {
                    let _ = rx.wait_for(|s| *s).await;
                },
            )
            .await
        });
        let ready = match ready_rx.await {
            Ok(Some(v)) => serde_json::from_value(v).map_err(|e| Error::io("ready", e.into()))?,
            _ => {
                return Err(match task.await {
                    Ok(Err(e)) => e,
                    _ => Error::io("agent task", std::io::Error::other("ended before ready")),
                });
            }
        };
        Ok(InProcessAgent {
            dir,
            stop,
            task: Some(task),
            ready,
        })
    }

    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// Drains like SIGTERM would and returns the agent's result.
    pub async fn stop(mut self) -> Result<()> {
        let _ = self.stop.send(true);
        match self.task.take() {
            Some(t) => t
                .await
                .map_err(|e| Error::io("agent task", std::io::Error::other(e)))?,
            None => Ok(()),
        }
    }
}

impl Drop for InProcessAgent {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}
