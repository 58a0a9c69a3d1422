//! `kvfabric agent`'s configuration: flags, each with the environment variable the operator
//! sets (`kvfabric_proto::contract::env`), validated once into an [`AgentConfig`]. Bad
//! configuration is refused here, before anything binds (the binary exits 64).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use kvfabric_engine::rdma::{DeviceFilter, GidChoice};
use kvfabric_engine::{CudaPath, Location, TcpBuffer, TransportKind};
use kvfabric_proto::bytesize;
use kvfabric_proto::contract::{DEFAULT_KEY_PREFIX, DEFAULT_NAMESPACE, env, socket};
use kvfabric_proto::limits::DEFAULT_MAX_BATCH_OPS;

use crate::error::{Error, Result};
use crate::node::check_segment_name;
use crate::peer_tls::PeerTls;
use crate::peer_token::PeerToken;
use crate::registry::etcd::{EtcdConfig, EtcdTls};
use crate::telemetry::TraceConfig;

/// `kvfabric agent`. Every flag reads the environment variable the operator's DaemonSet and
/// ConfigMap set (see docs/operator.md).
#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// The TransferFabric this agent belongs to.
    #[arg(long, env = env::FABRIC, default_value = "default")]
    pub fabric: String,

    /// The fabric's Kubernetes namespace: part of the registry prefix, so same-named fabrics of
    /// two namespaces never share keys.
    #[arg(long, env = env::NAMESPACE, default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,

    /// Pool this agent serves.
    #[arg(long, env = env::POOL, default_value = "default")]
    pub pool: String,

    /// What the pool's workers do (the operator sets it from the pool's role).
    #[arg(long, env = env::POOL_ROLE, value_enum, ignore_case = true)]
    pub pool_role: Option<PoolRole>,

    /// Agent name, unique in the fabric (default: $NODE_NAME, else the host name).
    #[arg(long, env = env::AGENT_NAME)]
    pub name: Option<String>,

    /// etcd endpoints (comma-separated). None: an in-memory registry (this agent alone).
    #[arg(long, env = env::ETCD_ENDPOINTS, value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,

    #[arg(long, env = env::ETCD_KEY_PREFIX, default_value = DEFAULT_KEY_PREFIX)]
    pub etcd_key_prefix: String,

    #[arg(long, env = env::ETCD_USERNAME)]
    pub etcd_username: Option<String>,

    #[arg(long, env = env::ETCD_PASSWORD, hide_env_values = true)]
    pub etcd_password: Option<String>,

    /// Shared secret of this fabric's agents (at least 16 printable ASCII characters): sent
    /// to other agents' peer API and required of its callers, since that API hands out region
    /// keys. Set it from a Secret (the operator does: `spec.peerTokenSecret`).
    #[arg(long, env = env::PEER_TOKEN, hide_env_values = true)]
    pub peer_token: Option<String>,

    /// mTLS between agents (peer API): a directory with tls.crt, tls.key and ca.crt, as a
    /// mounted kubernetes.io/tls Secret holds them (the operator mounts `spec.tlsSecret`). Or
    /// name the three files with --tls-cert, --tls-key and --tls-ca. Off when unset.
    #[arg(long, env = env::TLS_DIR)]
    pub tls_dir: Option<PathBuf>,

    /// This agent's certificate (PEM, chain first): presented to peers and served to them. It
    /// must carry the fabric's DNS name `<fabric>.<namespace>.kvfabric` and be valid for client
    /// and server use. The files are read again every few seconds; a renewed certificate is
    /// used for new connections without a restart.
    #[arg(long, env = env::TLS_CERT)]
    pub tls_cert: Option<PathBuf>,

    /// The certificate's private key (PEM).
    #[arg(long, env = env::TLS_KEY)]
    pub tls_key: Option<PathBuf>,

    /// The fabric's CA (PEM): peers must present a certificate it signed.
    #[arg(long, env = env::TLS_CA)]
    pub tls_ca: Option<PathBuf>,

    /// With mTLS on, TLS on the tcp data port too (the same certificate and CA). Every agent
    /// of a fabric must agree.
    #[arg(long, env = env::TLS_DATA_PORT, default_value_t = true, action = clap::ArgAction::Set)]
    pub tls_data_port: bool,

    /// With TLS on the data port, records sealed by the kernel where it offers TLS (kernel TLS;
    /// not yet run on a kernel with TLS, hence off by default); `false` keeps them in userspace.
    /// Peers need not agree: the records are the same.
    #[arg(long, env = env::TLS_KERNEL_RECORDS, default_value_t = false, action = clap::ArgAction::Set)]
    pub tls_kernel_records: bool,

    /// Directory with ca.crt (and tls.crt + tls.key for a client certificate).
    #[arg(long, env = env::ETCD_TLS_DIR)]
    pub etcd_tls_dir: Option<PathBuf>,

    /// Registry lease TTL: a dead agent's entries vanish this long after its last keepalive.
    #[arg(long, env = env::LEASE_TTL_SECS, default_value_t = 10)]
    pub lease_ttl_secs: u64,

    /// Directory of the local API socket (agent.sock), its fd socket (agent.fd.sock) and the
    /// shm data socket (shm.sock); workers mount it.
    #[arg(long, env = env::SOCKET_DIR, default_value = socket::DEFAULT_DIR)]
    pub socket_dir: PathBuf,

    /// Group that owns the sockets (a numeric gid): workers in it may connect. Default: the
    /// agent's own group.
    #[arg(long, env = env::SOCKET_GROUP)]
    pub socket_group: Option<u32>,

    /// Permissions of the sockets, octal. Connecting needs write permission, so 0660 admits
    /// the owner and `--socket-group`.
    #[arg(long, env = env::SOCKET_MODE, default_value = "0660", value_parser = parse_mode)]
    pub socket_mode: u32,

    /// Peer API (gRPC) listen address.
    #[arg(long, env = env::GRPC_ADDR, default_value = "0.0.0.0:50051")]
    pub grpc_addr: SocketAddr,

    /// tcp data plane listen address.
    #[arg(long, env = env::DATA_ADDR, default_value = "0.0.0.0:50052")]
    pub data_addr: SocketAddr,

    /// Address other agents reach this one at (default: $POD_IP, else the listen address, else
    /// the first non-loopback address).
    #[arg(long, env = env::ADVERTISE_ADDR)]
    pub advertise_addr: Option<IpAddr>,

    /// The pod's IP, from the downward API (the operator sets it): the advertised address when
    /// none is given. Read here, with every other setting, not where it is used.
    /// Empty counts as unset (a pod without an IP yet).
    #[arg(long, env = env::POD_IP, hide = true)]
    pub pod_ip: Option<String>,

    /// Binds the listen addresses left unspecified (0.0.0.0 or ::) to this IP instead. The
    /// operator sets the pod IP: with `hostNetwork` the ports are then open on that interface
    /// only, not on every address of the node.
    #[arg(long, env = env::LISTEN_IP)]
    pub listen_ip: Option<IpAddr>,

    /// Transports this agent may use, in order of preference.
    #[arg(
        long,
        env = env::TRANSPORTS,
        value_delimiter = ',',
        value_parser = parse_transport,
        default_value = "cuda-ipc,shm,rdma,tcp"
    )]
    pub transports: Vec<TransportKind>,

    /// TCP data connections per peer agent.
    #[arg(long, env = env::TCP_CONNECTIONS, default_value_t = 4)]
    pub tcp_connections: usize,

    /// Kernel buffers of each tcp data connection: `auto` (256 KiB when both ends share an
    /// address, autotuning elsewhere), `kernel` (autotuning always) or a size such as `1MiB`.
    #[arg(long, env = env::TCP_BUFFER, default_value = "auto", value_parser = bytesize::parse_tcp_buffer)]
    pub tcp_buffer: TcpBuffer,

    /// RDMA devices (and ports) the agent may use: `mlx5_0,mlx5_1:1`, `^mlx5_2` excludes (empty:
    /// every device allocated to the pod).
    #[arg(long, env = env::RDMA_DEVICES, default_value = "", value_parser = parse_rdma_devices)]
    pub rdma_devices: DeviceFilter,

    /// GID table index every RDMA port sends from (`auto`: RoCE v2 with IPv4 first).
    #[arg(long, env = env::RDMA_GID_INDEX, default_value = "auto", value_parser = parse_gid_index)]
    pub rdma_gid_index: GidChoice,

    /// RC QPs per peer agent on each RDMA NIC.
    #[arg(long, env = env::RDMA_QPS_PER_PEER, default_value_t = 2)]
    pub rdma_qps_per_peer: usize,

    /// Default time one batch may take.
    #[arg(long, env = env::BATCH_TIMEOUT_MS, default_value_t = 30_000)]
    pub batch_timeout_ms: u64,

    /// Most block ops in one submitted batch.
    #[arg(long, env = env::MAX_BATCH_OPS, default_value_t = DEFAULT_MAX_BATCH_OPS)]
    pub max_batch_ops: usize,

    /// How cuda-ipc moves a batch between GPUs of this node: sm (one kernel), ce (copy
    /// engines, no SMs), or auto (ce for a batch between two GPUs whose copies average 1 MiB
    /// or more, else sm).
    #[arg(long, env = env::CUDA_PATH, default_value = "auto")]
    pub cuda_path: CudaPath,

    /// How long dialling another agent may take.
    #[arg(long, env = env::CONNECT_TIMEOUT_MS, default_value_t = 3_000)]
    pub connect_timeout_ms: u64,

    /// Prometheus metrics (`/metrics`) and `/healthz` listen address.
    #[arg(long, env = env::METRICS_ADDR, default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,

    /// OTLP gRPC collector for traces (OTEL_EXPORTER_OTLP_ENDPOINT, when set, wins). None: no
    /// trace export.
    #[arg(long, env = env::OTLP_ENDPOINT)]
    pub otlp_endpoint: Option<String>,

    /// Share of traces kept, 0..=1 (OTEL_TRACES_SAMPLER, when set, wins).
    #[arg(long, env = env::TRACE_SAMPLE_RATIO, value_parser = parse_ratio)]
    pub trace_sample_ratio: Option<f64>,

    /// After SIGTERM, how long in-flight transfers may take to finish.
    #[arg(long, env = env::GRACE_SECS, default_value_t = 10)]
    pub grace_secs: u64,
}

/// What a pool's workers do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolRole {
    Prefill,
    Decode,
    Both,
}

impl std::fmt::Display for PoolRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PoolRole::Prefill => "prefill",
            PoolRole::Decode => "decode",
            PoolRole::Both => "both",
        })
    }
}

/// A validated agent configuration: what `serve` runs. Tests build one with [`AgentConfig::local`]
/// and change fields, rather than writing command lines.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Unique in the fabric.
    pub name: String,
    pub fabric: String,
    pub namespace: String,
    pub pool: String,
    pub pool_role: Option<PoolRole>,
    /// None: an in-memory registry (this agent alone, or agents of one process sharing a store).
    pub etcd: Option<EtcdConfig>,
    pub peer_token: Option<PeerToken>,
    /// mTLS on the peer API; None: plain TCP.
    pub tls: Option<PeerTls>,
    /// With `tls`, TLS on the tcp data port too.
    pub tls_data_port: bool,
    /// Data port records sealed by the kernel where it offers TLS.
    pub tls_kernel_records: bool,
    pub socket_dir: PathBuf,
    pub socket_group: Option<u32>,
    pub socket_mode: u32,
    pub grpc_addr: SocketAddr,
    pub data_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// None: `$POD_IP`, else the listen address, else the first non-loopback address.
    pub advertise_addr: Option<IpAddr>,
    pub transports: Vec<TransportKind>,
    pub tcp_connections: usize,
    pub tcp_buffer: TcpBuffer,
    pub rdma_devices: DeviceFilter,
    pub rdma_gid_index: GidChoice,
    pub rdma_qps_per_peer: usize,
    pub batch_timeout: Duration,
    pub max_batch_ops: usize,
    pub cuda_path: CudaPath,
    pub connect_timeout: Duration,
    pub trace: TraceConfig,
    pub grace: Duration,
}

impl AgentArgs {
    /// Checks every setting and resolves defaults that depend on the environment (the name from
    /// `$NODE_NAME`, trace settings from `OTEL_*`).
    pub fn validate(self) -> Result<AgentConfig> {
        let pod_ip = match self.pod_ip.as_deref().filter(|ip| !ip.is_empty()) {
            None => None,
            Some(ip) => Some(ip.parse::<IpAddr>().map_err(|_| {
                Error::config(
                    "pod-ip",
                    ip,
                    "must be an IP address (the pod's status.podIP)",
                )
            })?),
        };
        if self.transports.is_empty() {
            return Err(Error::config("transports", "", "name at least one"));
        }
        if self.lease_ttl_secs < 2 {
            return Err(Error::config(
                "lease-ttl-secs",
                self.lease_ttl_secs,
                "must be at least 2",
            ));
        }
        if self.max_batch_ops == 0 {
            return Err(Error::config("max-batch-ops", 0, "must be positive"));
        }
        if self.tcp_connections == 0 {
            return Err(Error::config("tcp-connections", 0, "must be positive"));
        }
        if let Some(reason) = self.tcp_buffer.invalid() {
            return Err(Error::config("tcp-buffer", self.tcp_buffer, reason));
        }
        for (field, ms) in [
            ("batch-timeout-ms", self.batch_timeout_ms),
            ("connect-timeout-ms", self.connect_timeout_ms),
        ] {
            if ms == 0 {
                return Err(Error::config(field, 0, "must be positive"));
            }
        }
        let name = self.name.clone().unwrap_or_else(default_name);
        check_segment_name(&name)
            .map_err(|_| Error::config("name", &name, "1..=253 of [A-Za-z0-9-_.:]"))?;
        check_dns_label("fabric", &self.fabric)?;
        check_dns_label("namespace", &self.namespace)?;
        // Parsed here rather than by clap, whose message would echo the secret.
        let peer_token = self
            .peer_token
            .as_deref()
            .map(|t| {
                t.parse::<PeerToken>()
                    .map_err(|reason| Error::config("peer-token", "(hidden)", reason))
            })
            .transpose()?;
        let tls = self.peer_tls()?;
        let etcd = if self.etcd_endpoints.is_empty() {
            None
        } else {
            let mut config = EtcdConfig::new(self.etcd_endpoints.clone(), self.fabric.clone());
            config.namespace = self.namespace.clone();
            config.prefix = self.etcd_key_prefix.clone();
            config.lease_ttl = Duration::from_secs(self.lease_ttl_secs);
            config.tls = self
                .etcd_tls_dir
                .as_deref()
                .map(EtcdTls::from_dir)
                .transpose()?;
            config.auth = match (self.etcd_username, self.etcd_password) {
                (Some(u), Some(p)) => Some((u, p)),
                (None, None) => None,
                _ => {
                    return Err(Error::config(
                        "etcd-username/etcd-password",
                        "(one of them)",
                        "set both or neither",
                    ));
                }
            };
            config.validate()?;
            Some(config)
        };
        Ok(AgentConfig {
            name,
            fabric: self.fabric,
            namespace: self.namespace,
            pool: self.pool,
            pool_role: self.pool_role,
            etcd,
            peer_token,
            tls,
            tls_data_port: self.tls_data_port,
            tls_kernel_records: self.tls_kernel_records,
            socket_dir: self.socket_dir,
            socket_group: self.socket_group,
            socket_mode: self.socket_mode,
            grpc_addr: on_listen_ip(self.grpc_addr, self.listen_ip),
            data_addr: on_listen_ip(self.data_addr, self.listen_ip),
            metrics_addr: on_listen_ip(self.metrics_addr, self.listen_ip),
            advertise_addr: self.advertise_addr.or(pod_ip),
            transports: self.transports,
            tcp_connections: self.tcp_connections,
            tcp_buffer: self.tcp_buffer,
            rdma_devices: self.rdma_devices,
            rdma_gid_index: self.rdma_gid_index,
            rdma_qps_per_peer: self.rdma_qps_per_peer,
            batch_timeout: Duration::from_millis(self.batch_timeout_ms),
            max_batch_ops: self.max_batch_ops,
            cuda_path: self.cuda_path,
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            trace: TraceConfig::resolve(self.otlp_endpoint, self.trace_sample_ratio),
            grace: Duration::from_secs(self.grace_secs),
        })
    }

    /// The TLS material, from `--tls-dir` or the three files (all or none of them).
    fn peer_tls(&self) -> Result<Option<PeerTls>> {
        let name = PeerTls::name_of(&self.fabric, &self.namespace);
        let tls = match (&self.tls_dir, &self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(dir), None, None, None) => Some(PeerTls::from_dir(dir, &name)?),
            (Some(dir), ..) => {
                return Err(Error::config(
                    "tls-dir",
                    dir.display(),
                    "give tls-dir or the files tls-cert, tls-key, tls-ca, not both",
                ));
            }
            (None, Some(cert), Some(key), Some(ca)) => Some(PeerTls::load(cert, key, ca, &name)?),
            (None, None, None, None) => None,
            (None, cert, key, _) => {
                let missing = if cert.is_none() {
                    "tls-cert"
                } else if key.is_none() {
                    "tls-key"
                } else {
                    "tls-ca"
                };
                return Err(Error::config(
                    missing,
                    "(unset)",
                    "tls-cert, tls-key and tls-ca go together (or give tls-dir)",
                ));
            }
        };
        Ok(tls)
    }
}

impl AgentConfig {
    /// What the configuration resolved to, as `kvfabric agent --check-config` prints it (no
    /// secrets: only whether a peer token and etcd credentials are set).
    pub fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "fabric": self.fabric,
            "namespace": self.namespace,
            "pool": self.pool,
            "pool_role": self.pool_role.map(|r| r.to_string()),
            "registry": self.etcd.as_ref().map_or_else(
                || serde_json::json!({ "backend": "memory" }),
                |e| serde_json::json!({
                    "backend": "etcd",
                    "endpoints": e.endpoints,
                    "root": e.root(),
                    "tls": e.tls.is_some(),
                    "auth": e.auth.is_some(),
                    "lease_ttl_secs": e.lease_ttl.as_secs(),
                }),
            ),
            "peer_token": self.peer_token.is_some(),
            "tls": self.tls.as_ref().map(|t| serde_json::json!({
                "cert": t.cert_path,
                "ca": t.ca_path,
                "name": t.name,
                "data_port": self.tls_data_port,
                "kernel_records": self.tls_kernel_records,
            })),
            "socket_dir": self.socket_dir,
            "socket_group": self.socket_group,
            "socket_mode": format!("{:o}", self.socket_mode),
            "grpc_addr": self.grpc_addr,
            "data_addr": self.data_addr,
            "metrics_addr": self.metrics_addr,
            "advertise_addr": self.advertise_addr,
            "transports": self.transports.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
            "tcp_connections": self.tcp_connections,
            "tcp_buffer": self.tcp_buffer.to_string(),
            "batch_timeout_ms": self.batch_timeout.as_millis() as u64,
            "max_batch_ops": self.max_batch_ops,
            "connect_timeout_ms": self.connect_timeout.as_millis() as u64,
            "otlp_endpoint": self.trace.endpoint,
            "grace_secs": self.grace.as_secs(),
        })
    }

    /// An agent of fabric `test` on loopback ports chosen by the kernel, with the in-memory
    /// registry and every transport but RDMA; sockets in `socket_dir`.
    pub fn local(name: &str, socket_dir: impl Into<PathBuf>) -> AgentConfig {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        AgentConfig {
            name: name.into(),
            fabric: "test".into(),
            namespace: DEFAULT_NAMESPACE.into(),
            pool: "default".into(),
            pool_role: None,
            etcd: None,
            peer_token: None,
            tls: None,
            tls_data_port: true,
            tls_kernel_records: false,
            socket_dir: socket_dir.into(),
            socket_group: None,
            socket_mode: 0o660,
            grpc_addr: any,
            data_addr: any,
            metrics_addr: any,
            advertise_addr: None,
            transports: vec![
                TransportKind::CudaIpc,
                TransportKind::Shm,
                TransportKind::Tcp,
            ],
            tcp_connections: 4,
            tcp_buffer: TcpBuffer::Auto,
            rdma_devices: DeviceFilter::default(),
            rdma_gid_index: GidChoice::default(),
            rdma_qps_per_peer: 2,
            batch_timeout: Duration::from_secs(30),
            max_batch_ops: DEFAULT_MAX_BATCH_OPS,
            cuda_path: CudaPath::default(),
            connect_timeout: Duration::from_secs(3),
            trace: TraceConfig::default(),
            grace: Duration::from_secs(10),
        }
    }
}

/// `$NODE_NAME` (the DaemonSet sets it from the downward API), else the host name.
fn default_name() -> String {
    std::env::var(env::NODE_NAME)
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| {
            rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned()
        })
}

/// Fabric and namespace names become etcd key segments and socket paths: DNS labels only.
fn check_dns_label(field: &'static str, value: &str) -> Result<()> {
    if kvfabric_proto::contract::is_dns_label(value) {
        Ok(())
    } else {
        Err(Error::config(
            field,
            kvfabric_proto::limits::echo(value),
            "a DNS label: 1..=63 of [a-z0-9-], not starting or ending with '-'",
        ))
    }
}

fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!("{s:?} is not a permission mode (octal, e.g. 0660)")),
    }
}

/// `tcp`, `shm`, `cuda-ipc` or `rdma`.
pub fn parse_transport(s: &str) -> Result<TransportKind, String> {
    match s.trim() {
        "tcp" => Ok(TransportKind::Tcp),
        "shm" => Ok(TransportKind::Shm),
        "cuda-ipc" => Ok(TransportKind::CudaIpc),
        "rdma" => Ok(TransportKind::Rdma),
        other => Err(format!(
            "{other:?} is not a transport (tcp, shm, cuda-ipc, rdma)"
        )),
    }
}

/// The inverse of [`parse_location`].
pub fn location_name(location: Location) -> String {
    match location {
        Location::Host { .. } => "host".into(),
        Location::Cuda { device } => format!("cuda:{device}"),
    }
}

/// `host` or `cuda:N`.
pub fn parse_location(s: &str) -> Result<Location, String> {
    if s == "host" {
        return Ok(Location::Host { numa: None });
    }
    s.strip_prefix("cuda:")
        .and_then(|d| d.parse::<u32>().ok())
        .map(|device| Location::Cuda { device })
        .ok_or_else(|| format!("{s:?} is not a location (host or cuda:N)"))
}

fn parse_rdma_devices(s: &str) -> Result<DeviceFilter, String> {
    s.parse().map_err(|e: kvfabric_engine::Error| e.to_string())
}

fn parse_gid_index(s: &str) -> Result<GidChoice, String> {
    s.parse().map_err(|e: kvfabric_engine::Error| e.to_string())
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a ratio between 0 and 1")),
    }
}

/// `addr` on `ip` when `addr` names no address of its own.
fn on_listen_ip(addr: SocketAddr, ip: Option<IpAddr>) -> SocketAddr {
    match ip {
        Some(ip) if addr.ip().is_unspecified() => SocketAddr::new(ip, addr.port()),
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::Parser;
    use kvfabric_testkit::TestCa;
    use kvfabric_testkit::tls::ExtendedKeyUsagePurpose;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: AgentArgs,
    }

    fn validate(flags: &[&str]) -> Result<AgentConfig> {
        let mut argv = vec!["agent", "--name", "a"];
        argv.extend_from_slice(flags);
        Cli::try_parse_from(argv)
            .expect("flags parse")
            .args
            .validate()
    }

    fn dir_flag(dir: &Path) -> Vec<String> {
        vec!["--tls-dir".into(), dir.display().to_string()]
    }

    fn validate_dir(dir: &Path) -> Result<AgentConfig> {
        let flags = dir_flag(dir);
        validate(&flags.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// The field a configuration error names.
    fn field(r: Result<AgentConfig>) -> (&'static str, String) {
        match r {
            Err(Error::Config { field, reason, .. }) => (field, reason),
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    fn secret_dir(ca: &TestCa, names: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        ca.write_dir(dir.path(), &ca.issue(names)).unwrap();
        dir
    }

    #[test]
    fn tcp_buffers_are_auto_kernel_or_a_size_in_range() {
        assert_eq!(validate(&[]).unwrap().tcp_buffer, TcpBuffer::Auto);
        let c = validate(&["--tcp-buffer", "kernel"]).unwrap();
        assert_eq!(c.tcp_buffer, TcpBuffer::Kernel);
        assert_eq!(c.summary()["tcp_buffer"], "kernel");
        let c = validate(&["--tcp-buffer", "1MiB"]).unwrap();
        assert_eq!(c.tcp_buffer, TcpBuffer::Bytes(1 << 20));
        assert_eq!(field(validate(&["--tcp-buffer", "1KiB"])).0, "tcp-buffer");
        assert!(Cli::try_parse_from(["agent", "--tcp-buffer", "lots"]).is_err());
        assert!(Cli::try_parse_from(["agent", "--tcp-buffer", "8GiB"]).is_err());
    }

    #[test]
    fn the_listen_ip_replaces_unspecified_addresses_only() {
        let c = validate(&[]).unwrap();
        assert_eq!(c.grpc_addr.to_string(), "0.0.0.0:50051");
        let c = validate(&[
            "--listen-ip",
            "10.1.2.3",
            "--metrics-addr",
            "127.0.0.1:9100",
        ])
        .unwrap();
        assert_eq!(c.grpc_addr.to_string(), "10.1.2.3:50051");
        assert_eq!(c.data_addr.to_string(), "10.1.2.3:50052");
        assert_eq!(c.metrics_addr.to_string(), "127.0.0.1:9100", "named: kept");
        let c = validate(&["--listen-ip", "fd00::7", "--grpc-addr", "[::]:1"]).unwrap();
        assert_eq!(c.grpc_addr.to_string(), "[fd00::7]:1");
        assert!(Cli::try_parse_from(["agent", "--listen-ip", "pod"]).is_err());
    }

    #[test]
    fn the_pod_ip_is_advertised_unless_an_address_is_given() {
        assert_eq!(validate(&[]).unwrap().advertise_addr, None);
        let c = validate(&["--pod-ip", "10.0.0.9"]).unwrap();
        assert_eq!(c.advertise_addr, Some("10.0.0.9".parse().unwrap()));
        let c = validate(&["--pod-ip", "10.0.0.9", "--advertise-addr", "192.168.1.5"]).unwrap();
        assert_eq!(c.advertise_addr, Some("192.168.1.5".parse().unwrap()));
        assert_eq!(validate(&["--pod-ip", ""]).unwrap().advertise_addr, None);
        assert_eq!(field(validate(&["--pod-ip", "pod"])).0, "pod-ip");
    }

    #[test]
    fn tls_is_off_unless_asked_for() {
        let config = validate(&[]).unwrap();
        assert!(config.tls.is_none());
        assert!(config.summary()["tls"].is_null());
    }

    #[test]
    fn a_mounted_secret_is_read_and_checked() {
        let ca = TestCa::new("ca");
        let dir = secret_dir(&ca, &[TLS_NAME]);
        let config = validate_dir(dir.path()).unwrap();
        let tls = config.tls.as_ref().expect("tls on");
        assert_eq!(tls.cert_path, dir.path().join("tls.crt"));
        assert_eq!(
            config.summary()["tls"]["ca"],
            dir.path().join("ca.crt").display().to_string()
        );
        // The key is never printed.
        let key = std::fs::read_to_string(dir.path().join("tls.key")).unwrap();
        let printed = format!("{config:?}");
        assert!(printed.contains("PeerTls"), "{printed}");
        assert!(!printed.contains(key.lines().nth(1).unwrap()));
    }

    #[test]
    fn the_three_files_may_be_named_one_by_one() {
        let ca = TestCa::new("ca");
        let dir = secret_dir(&ca, &[TLS_NAME]);
        let p = |n: &str| dir.path().join(n).display().to_string();
        let (c, k, a) = (p("tls.crt"), p("tls.key"), p("ca.crt"));
        let config = validate(&["--tls-cert", &c, "--tls-key", &k, "--tls-ca", &a]).unwrap();
        assert!(config.tls.is_some());
        assert_eq!(
            field(validate(&["--tls-cert", &c, "--tls-ca", &a])).0,
            "tls-key"
        );
        assert_eq!(
            field(validate(&["--tls-key", &k, "--tls-ca", &a])).0,
            "tls-cert"
        );
        assert_eq!(
            field(validate(&["--tls-cert", &c, "--tls-key", &k])).0,
            "tls-ca"
        );
        let both = ["--tls-dir", &p(""), "--tls-ca", &a];
        assert_eq!(field(validate(&both)).0, "tls-dir");
    }

    #[test]
    fn a_missing_file_is_named() {
        let ca = TestCa::new("ca");
        for name in ["tls.crt", "tls.key", "ca.crt"] {
            let dir = secret_dir(&ca, &[TLS_NAME]);
            std::fs::remove_file(dir.path().join(name)).unwrap();
            let want = match name {
                "tls.crt" => "tls-cert",
                "tls.key" => "tls-key",
                _ => "tls-ca",
            };
            assert_eq!(field(validate_dir(dir.path())).0, want, "without {name}");
        }
        assert_eq!(
            field(validate_dir(Path::new("/nonexistent/tls"))).0,
            "tls-dir"
        );
    }

    #[test]
    fn garbage_in_a_file_is_named() {
        let ca = TestCa::new("ca");
        for (name, want) in [
            ("tls.crt", "tls-cert"),
            ("tls.key", "tls-key"),
            ("ca.crt", "tls-ca"),
        ] {
            let dir = secret_dir(&ca, &[TLS_NAME]);
            std::fs::write(dir.path().join(name), "not PEM").unwrap();
            assert_eq!(field(validate_dir(dir.path())).0, want, "garbage {name}");
        }
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let ca = TestCa::new("ca");
        let dir = secret_dir(&ca, &[TLS_NAME]);
        std::fs::write(dir.path().join("tls.key"), ca.issue(&[TLS_NAME]).key_pem).unwrap();
        let (field, reason) = field(validate_dir(dir.path()));
        assert_eq!(field, "tls-key");
        assert!(reason.contains("does not match"), "{reason}");
    }

    #[test]
    fn a_certificate_of_another_ca_is_refused() {
        let (ca, other) = (TestCa::new("ca"), TestCa::new("other"));
        let dir = tempfile::tempdir().unwrap();
        other
            .write_dir(dir.path(), &other.issue(&[TLS_NAME]))
            .unwrap();
        std::fs::write(dir.path().join("ca.crt"), ca.pem()).unwrap();
        let (field, reason) = field(validate_dir(dir.path()));
        assert_eq!(field, "tls-cert");
        assert!(reason.contains("not a client certificate"), "{reason}");
    }

    #[test]
    fn a_certificate_without_the_agents_name_or_a_usage_is_refused() {
        let ca = TestCa::new("ca");
        let dir = secret_dir(&ca, &["someone-else"]);
        let (field, reason) = field(validate_dir(dir.path()));
        assert_eq!(field, "tls-cert");
        assert!(reason.contains(TLS_NAME), "{reason}");

        let server_only = ca.issue_for(&[TLS_NAME], &[ExtendedKeyUsagePurpose::ServerAuth]);
        ca.write_dir(dir.path(), &server_only).unwrap();
        assert!(field_of(validate_dir(dir.path())).contains("client"));
        let client_only = ca.issue_for(&[TLS_NAME], &[ExtendedKeyUsagePurpose::ClientAuth]);
        ca.write_dir(dir.path(), &client_only).unwrap();
        assert!(field_of(validate_dir(dir.path())).contains("server"));
    }

    fn field_of(r: Result<AgentConfig>) -> String {
        let (field, reason) = field(r);
        assert_eq!(field, "tls-cert");
        reason
    }

    #[test]
    fn the_data_port_follows_tls_unless_turned_off() {
        let ca = TestCa::new("ca");
        let dir = secret_dir(&ca, &[TLS_NAME]);
        let mut flags = dir_flag(dir.path());
        let on = validate(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert!(on.tls_data_port);
        assert_eq!(on.summary()["tls"]["data_port"], true);
        assert_eq!(on.summary()["tls"]["name"], TLS_NAME);
        flags.extend(["--tls-data-port".into(), "false".into()]);
        let config = validate(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert!(!config.tls_data_port);
        assert_eq!(config.summary()["tls"]["data_port"], false);
        // Kernel TLS for the records only when asked for.
        assert!(!on.tls_kernel_records);
        assert_eq!(on.summary()["tls"]["kernel_records"], false);
        flags.extend(["--tls-kernel-records".into(), "true".into()]);
        let config = validate(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert!(config.tls_kernel_records);
        assert_eq!(config.summary()["tls"]["kernel_records"], true);
    }

    /// The name of the fabric `validate` makes (the defaults).
    const TLS_NAME: &str = "default.default.kvfabric";

    #[test]
    fn the_tls_name_is_the_fabrics() {
        assert_eq!(
            TLS_NAME,
            kvfabric_proto::contract::tls_server_name("default", DEFAULT_NAMESPACE)
        );
        // A certificate of the name every fabric shared before is refused, naming the one
        // expected.
        let ca = TestCa::new("ca");
        let dir = secret_dir(&ca, &["kvfabric-agent"]);
        let (named, reason) = field(validate_dir(dir.path()));
        assert_eq!(named, "tls-cert");
        assert!(reason.contains("does not carry the DNS name"), "{reason}");
        assert!(reason.contains(TLS_NAME), "{reason}");
        // Another fabric's name is no better.
        let flags = [
            "--fabric",
            "other",
            "--tls-dir",
            &dir.path().display().to_string(),
        ]
        .map(str::to_owned);
        ca.write_dir(dir.path(), &ca.issue(&[TLS_NAME])).unwrap();
        let (named, reason) = field(validate(
            &flags.iter().map(String::as_str).collect::<Vec<_>>(),
        ));
        assert_eq!(named, "tls-cert");
        assert!(reason.contains("other.default.kvfabric"), "{reason}");
    }
}
