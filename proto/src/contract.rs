//! What the operator and the agent must agree on: the environment the operator's DaemonSet and
//! ConfigMap set (and nothing the agent does not read), where the agent's sockets live, and
//! where a fabric's keys live in etcd. Both sides use these names; a test renders the
//! operator's DaemonSet and parses its environment with the agent's own parser.

/// Files in the agent's socket directory.
pub mod socket {
    /// The local gRPC API (workers on the node).
    pub const LOCAL: &str = "agent.sock";
    /// Where workers hand over memfds before naming them in `RegisterSegment`.
    pub const FD: &str = "agent.fd.sock";
    /// The shm data plane between agents of one node.
    pub const SHM: &str = "shm.sock";
    /// Socket directory of an agent run by hand.
    pub const DEFAULT_DIR: &str = "/var/run/kvfabric";
}

/// The environment of the agent container. The operator sets these (and `spec.agent.env` may set
/// none of them: the registry root, the socket directory and the addresses keep fabrics apart);
/// the agent reads each as a flag's default (`kvfabric agent --help`).
pub mod env {
    pub const FABRIC: &str = "KVFABRIC_FABRIC";
    /// The fabric's namespace: the second level of the registry root.
    pub const NAMESPACE: &str = "KVFABRIC_NAMESPACE";
    pub const POOL: &str = "KVFABRIC_POOL";
    /// The pool's role (`prefill`, `decode`, `both`), published in the agent's registry entry.
    pub const POOL_ROLE: &str = "KVFABRIC_POOL_ROLE";
    pub const AGENT_NAME: &str = "KVFABRIC_AGENT_NAME";
    pub const ETCD_ENDPOINTS: &str = "KVFABRIC_ETCD_ENDPOINTS";
    /// The first level of the registry root (`/kvfabric`), without the namespace.
    pub const ETCD_KEY_PREFIX: &str = "KVFABRIC_ETCD_KEY_PREFIX";
    pub const ETCD_USERNAME: &str = "KVFABRIC_ETCD_USERNAME";
    pub const ETCD_PASSWORD: &str = "KVFABRIC_ETCD_PASSWORD";
    /// Directory with `ca.crt`, `tls.crt`, `tls.key`.
    pub const ETCD_TLS_DIR: &str = "KVFABRIC_ETCD_TLS_DIR";
    pub const PEER_TOKEN: &str = "KVFABRIC_PEER_TOKEN";
    /// mTLS between agents: a directory holding `tls.crt`, `tls.key` and `ca.crt` (a mounted
    /// `kubernetes.io/tls` Secret), or the three files named one by one.
    pub const TLS_DIR: &str = "KVFABRIC_TLS_DIR";
    pub const TLS_CERT: &str = "KVFABRIC_TLS_CERT";
    pub const TLS_KEY: &str = "KVFABRIC_TLS_KEY";
    pub const TLS_CA: &str = "KVFABRIC_TLS_CA";
    /// With mTLS, TLS on the tcp data port too (`true`, the default, or `false`).
    pub const TLS_DATA_PORT: &str = "KVFABRIC_TLS_DATA_PORT";
    /// With TLS on the data port, records sealed by the kernel where it offers TLS (`true`, the
    /// default) or always in userspace (`false`).
    pub const TLS_KERNEL_RECORDS: &str = "KVFABRIC_TLS_KERNEL_RECORDS";
    pub const LEASE_TTL_SECS: &str = "KVFABRIC_LEASE_TTL_SECS";
    pub const SOCKET_DIR: &str = "KVFABRIC_SOCKET_DIR";
    /// Numeric group id the agent gives its sockets.
    pub const SOCKET_GROUP: &str = "KVFABRIC_SOCKET_GROUP";
    /// Octal mode the agent gives its sockets (`0600`, `0660` or `0666`).
    pub const SOCKET_MODE: &str = "KVFABRIC_SOCKET_MODE";
    pub const GRPC_ADDR: &str = "KVFABRIC_GRPC_ADDR";
    pub const DATA_ADDR: &str = "KVFABRIC_DATA_ADDR";
    pub const METRICS_ADDR: &str = "KVFABRIC_METRICS_ADDR";
    pub const ADVERTISE_ADDR: &str = "KVFABRIC_ADVERTISE_ADDR";
    pub const TRANSPORTS: &str = "KVFABRIC_TRANSPORTS";
    pub const TCP_CONNECTIONS: &str = "KVFABRIC_TCP_CONNECTIONS";
    /// Kernel buffers of each tcp data connection: `auto`, `kernel` or a size.
    pub const TCP_BUFFER: &str = "KVFABRIC_TCP_BUFFER";
    pub const RDMA_DEVICES: &str = "KVFABRIC_RDMA_DEVICES";
    pub const RDMA_GID_INDEX: &str = "KVFABRIC_RDMA_GID_INDEX";
    pub const RDMA_QPS_PER_PEER: &str = "KVFABRIC_RDMA_QPS_PER_PEER";
    pub const BATCH_TIMEOUT_MS: &str = "KVFABRIC_BATCH_TIMEOUT_MS";
    pub const MAX_BATCH_OPS: &str = "KVFABRIC_MAX_BATCH_OPS";
    pub const CUDA_PATH: &str = "KVFABRIC_CUDA_PATH";
    pub const CONNECT_TIMEOUT_MS: &str = "KVFABRIC_CONNECT_TIMEOUT_MS";
    pub const OTLP_ENDPOINT: &str = "KVFABRIC_OTLP_ENDPOINT";
    pub const TRACE_SAMPLE_RATIO: &str = "KVFABRIC_TRACE_SAMPLE_RATIO";
    pub const GRACE_SECS: &str = "KVFABRIC_GRACE_SECS";
    pub const LOG: &str = "KVFABRIC_LOG";
    /// Node name (downward API): the agent's default name.
    pub const NODE_NAME: &str = "NODE_NAME";
    /// Pod IP (downward API): the address other agents reach this one at by default.
    pub const POD_IP: &str = "POD_IP";
    /// The IP the agent's unspecified listen addresses bind to (the operator: the pod IP).
    pub const LISTEN_IP: &str = "KVFABRIC_LISTEN_IP";
    /// Pod name and namespace (downward API), for logs.
    pub const POD_NAME: &str = "POD_NAME";
    pub const POD_NAMESPACE: &str = "POD_NAMESPACE";
    /// GPUs the NVIDIA toolkit (runtime class or NRI plugin) injects.
    pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
    /// Driver libraries the NVIDIA toolkit injects (`compute,utility`: libcuda and nvidia-smi).
    pub const NVIDIA_DRIVER_CAPABILITIES: &str = "NVIDIA_DRIVER_CAPABILITIES";
    /// Where the CUDA driver caches the kernels it JIT-compiles from the engine's PTX (the root
    /// filesystem is read-only).
    pub const CUDA_CACHE_PATH: &str = "CUDA_CACHE_PATH";

    /// Every name the operator may set.
    pub const RESERVED: [&str; 29] = [
        AGENT_NAME,
        NODE_NAME,
        POD_IP,
        LISTEN_IP,
        POD_NAME,
        POD_NAMESPACE,
        FABRIC,
        NAMESPACE,
        ETCD_ENDPOINTS,
        ETCD_KEY_PREFIX,
        TRANSPORTS,
        OTLP_ENDPOINT,
        TRACE_SAMPLE_RATIO,
        POOL,
        POOL_ROLE,
        SOCKET_DIR,
        SOCKET_GROUP,
        SOCKET_MODE,
        GRPC_ADDR,
        DATA_ADDR,
        METRICS_ADDR,
        ETCD_USERNAME,
        ETCD_PASSWORD,
        ETCD_TLS_DIR,
        PEER_TOKEN,
        TLS_DIR,
        NVIDIA_VISIBLE_DEVICES,
        NVIDIA_DRIVER_CAPABILITIES,
        CUDA_CACHE_PATH,
    ];
}

/// Peer API (gRPC) port; also serves the standard gRPC health service.
pub const GRPC_PORT: i32 = 50051;
/// tcp data plane port.
pub const DATA_PORT: i32 = 50052;
/// Prometheus `/metrics`, `/healthz` and `/livez` port.
pub const METRICS_PORT: i32 = 9090;

/// gRPC health service the readiness probe asks: SERVING only while the agent is in the
/// registry (connected, lease held) and not draining.
pub const READY_SERVICE: &str = "kvfabric.v1.PeerAgent";
/// gRPC health service the liveness and startup probes ask (the empty name: the server as a
/// whole): SERVING while the gRPC server runs, whatever etcd does, so an etcd outage does not
/// restart every agent.
pub const LIVE_SERVICE: &str = "";

/// A small emptyDir, the only writable place in the agent container besides the socket
/// directory ([`socket::DEFAULT_DIR`] there; the host directory is per fabric and pool).
pub const TMP_DIR: &str = "/tmp";
/// Where the etcd TLS Secret is mounted.
pub const ETCD_TLS_MOUNT: &str = "/etc/kvfabric/etcd-tls";
/// Where the agent's own certificate (`TransferFabric.spec.tlsSecret`) is mounted.
pub const TLS_MOUNT: &str = "/etc/kvfabric/tls";
/// The DNS name every agent's certificate of one fabric carries (a subject alternative name):
/// agents verify it of the server when they dial each other (by pod IP, which one shared
/// certificate cannot list) and of the client certificate when they are dialled. It names the
/// fabric and its namespace, so that a CA (a cert-manager ClusterIssuer) shared by many fabrics
/// does not let one fabric's agents into another's.
pub fn tls_server_name(fabric: &str, namespace: &str) -> String {
    format!("{fabric}.{namespace}.{TLS_NAME_SUFFIX}")
}

/// The last label of every [`tls_server_name`].
pub const TLS_NAME_SUFFIX: &str = "kvfabric";
/// Path of the `kvfabric` binary in the agent image.
pub const AGENT_BINARY: &str = "/usr/local/bin/kvfabric";
/// Path of the socket directory helper in the agent image.
pub const SOCKET_DIR_HELPER: &str = "/usr/local/bin/kvfabric-socket-dir";
/// User and group of the agent image (`nonroot`).
pub const AGENT_USER: i64 = 65532;

/// Host directory of one pool's sockets: `<socketRoot>/<namespace>/<fabric>/<pool>`, so no agent
/// of another fabric or pool on the node ever replaces them.
pub fn host_socket_dir(socket_root: &str, namespace: &str, fabric: &str, pool: &str) -> String {
    format!(
        "{}/{namespace}/{fabric}/{pool}",
        socket_root.trim_end_matches('/')
    )
}

/// The CSI driver that hands pods a pool's socket directory as an ephemeral inline volume
/// (`kvfabric-csi`; a `CSIDriver` object of this name comes with the chart's `csi.enabled`).
pub mod csi {
    /// The driver's name: the `CSIDriver` object, the pods' `csi.driver` and the kubelet's key.
    pub const DRIVER: &str = "csi.kvfabric.io";
    /// Volume attribute naming the fabric (in the pod's own namespace).
    pub const FABRIC_ATTRIBUTE: &str = "fabric";
    /// Volume attribute naming the fabric's pool.
    pub const POOL_ATTRIBUTE: &str = "pool";
    /// Set by the kubelet (the `CSIDriver`'s `podInfoOnMount`), never by the pod: the namespace
    /// whose fabrics the pod may reach.
    pub const POD_NAMESPACE_ATTRIBUTE: &str = "csi.storage.k8s.io/pod.namespace";
    /// Set by the kubelet on ephemeral inline volumes, the only kind the driver serves.
    pub const EPHEMERAL_ATTRIBUTE: &str = "csi.storage.k8s.io/ephemeral";
    /// The kubelet's other pod-info attributes: known, not used.
    pub const POD_INFO_ATTRIBUTES: [&str; 3] = [
        "csi.storage.k8s.io/pod.name",
        "csi.storage.k8s.io/pod.uid",
        "csi.storage.k8s.io/serviceAccount.name",
    ];
    /// Path of the driver in the agent image.
    pub const BINARY: &str = "/usr/local/bin/kvfabric-csi";
}

/// Default registry key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "/kvfabric";

/// A DNS label (RFC 1123): 1–63 of `[a-z0-9-]`, not starting or ending with '-'. What Kubernetes
/// requires of namespace, fabric and pool names, which become etcd key segments and socket
/// directory names here, so never `.`, `..` or a `/`.
pub fn is_dns_label(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Namespace of a fabric whose agent is not told one (an agent run outside Kubernetes).
pub const DEFAULT_NAMESPACE: &str = "default";

/// Where one fabric's keys live: `<prefix>/<namespace>/<fabric>`, so fabrics of the same name in
/// two namespaces never share keys. Agents write `<root>/agents/<agent>` and
/// `<root>/segments/<segment>`; the operator deletes everything under `<root>/` when the fabric
/// goes. Namespace and fabric names are DNS labels and the prefix is one path segment, so no
/// root is a prefix of another's keys.
pub fn registry_root(prefix: &str, namespace: &str, fabric: &str) -> String {
    format!("{}/{namespace}/{fabric}", prefix.trim_end_matches('/'))
}

/// The remote key a worker presents for a segment registered with `fabric_access`: its agent
/// proves fabric membership to the owner's (peer token, mTLS) and presents the key the owner
/// answers with; no worker holds it. No segment has it as its own key.
pub const FABRIC_KEY: u64 = 0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_dirs_differ_per_fabric_and_pool() {
        let dirs = [
            host_socket_dir("/var/run/kvfabric", "llm", "a", "prefill"),
            host_socket_dir("/var/run/kvfabric", "llm", "a", "decode"),
            host_socket_dir("/var/run/kvfabric", "llm", "b", "prefill"),
            host_socket_dir("/var/run/kvfabric/", "other", "a", "prefill"),
        ];
        assert_eq!(dirs[0], "/var/run/kvfabric/llm/a/prefill");
        assert_eq!(dirs[3], "/var/run/kvfabric/other/a/prefill");
        for (i, x) in dirs.iter().enumerate() {
            for y in &dirs[i + 1..] {
                assert_ne!(x, y);
            }
        }
    }

    #[test]
    fn reserved_names_are_unique() {
        let mut names = env::RESERVED.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), env::RESERVED.len());
    }

    #[test]
    fn roots_of_same_named_fabrics_differ_by_namespace() {
        let a = registry_root("/kvfabric", "team-a", "prod");
        let b = registry_root("/kvfabric/", "team-b", "prod");
        assert_eq!(a, "/kvfabric/team-a/prod");
        assert_eq!(b, "/kvfabric/team-b/prod");
        assert!(!format!("{b}/").starts_with(&format!("{a}/")));
        // A fabric's root never covers a fabric whose name it begins.
        let ab = registry_root("/k", "ns", "ab") + "/";
        assert!(!ab.starts_with(&(registry_root("/k", "ns", "a") + "/")));
    }
}
