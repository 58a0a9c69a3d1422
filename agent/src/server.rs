//! `kvfabric agent`: binds its sockets, joins the registry, serves the local API, the peer API and
//! the data plane, and drains on shutdown.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvfabric_engine::{Engine, EngineConfig};
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
use crate::node::{Node, NodeConfig};
use crate::peer_api::PeerApi;
use crate::registry::etcd::{EtcdConfig, EtcdRegistry, EtcdTls};
use crate::registry::memory::MemoryRegistry;
use crate::registry::{AgentEntry, SharedRegistry};
use crate::rpc::MAX_MESSAGE_BYTES;
use crate::rpc::pb::local_agent_server::LocalAgentServer;
use crate::rpc::pb::peer_agent_server::PeerAgentServer;

pub const LOCAL_SOCKET: &str = "agent.sock";
pub const FD_SOCKET: &str = "agent.fd.sock";
pub const SHM_SOCKET: &str = "shm.sock";

/// The sockets an agent serves on, bound by the caller (tests bind port 0 and temp dirs).
#[derive(Debug)]
pub struct Listeners {
    pub peer: TcpListener,
    pub data: TcpListener,
    pub local: UnixListener,
    pub fd: UnixListener,
    pub shm: UnixListener,
    pub socket_dir: PathBuf,
}

impl Listeners {
    pub async fn bind(socket_dir: &Path, peer: SocketAddr, data: SocketAddr) -> Result<Self> {
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
            data: tcp(data).await?,
            local: unix(LOCAL_SOCKET)?,
            fd: unix(FD_SOCKET)?,
            shm: unix(SHM_SOCKET)?,
            socket_dir: socket_dir.to_path_buf(),
        })
    }
}

/// Printed on stdout once the agent serves, so scripts and tests learn the bound ports.
#[derive(Debug, Serialize)]
pub struct Ready {
    pub agent: String,
    pub peer: SocketAddr,
    pub data: SocketAddr,
    pub socket_dir: PathBuf,
    pub registry: String,
}

pub async fn run(args: AgentArgs, shutdown: impl Future<Output = ()>) -> Result<()> {
    validate(&args)?;
    let listeners = Listeners::bind(&args.socket_dir, args.grpc_addr, args.data_addr).await?;
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
    serve(&args, listeners, registry, print, shutdown).await
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
    Ok(())
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
    on_ready: impl FnOnce(&Ready),
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let name = agent_name(args);
    let devices = tokio::task::spawn_blocking(discovery::discover)
        .await
        .map_err(|e| Error::io("device discovery", std::io::Error::other(e)))?;
    let advertise = advertise(args, &devices);
    let engine = Engine::new(EngineConfig {
        name: format!("agent-{name}"),
        tcp_connections: args.tcp_connections,
        batch_timeout: Duration::from_millis(args.batch_timeout_ms),
        max_batch_ops: args.max_batch_ops,
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
        },
        engine.clone(),
        registry.clone(),
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
    for name in [LOCAL_SOCKET, FD_SOCKET] {
        let _ = std::fs::remove_file(listeners.socket_dir.join(name));
    }
    info!("agent stopped");
    Ok(())
}
