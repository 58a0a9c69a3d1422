//! What the operator promises the agent and the agent must honour: environment variable names,
//! ports, paths inside the agent container, gRPC health service names and the registry key
//! layout. Every builder takes these names from here, and the tests read them from here, so
//! one list says what a DaemonSet sets.

/// Environment of the agent container, as the operator sets it.
pub mod env {
    /// Node name (downward API), the default agent name.
    pub const NODE_NAME: &str = "NODE_NAME";
    /// Pod IP (downward API), the address other agents reach this one at.
    pub const POD_IP: &str = "POD_IP";
    /// Pod name (downward API).
    pub const POD_NAME: &str = "POD_NAME";
    /// Pod namespace (downward API), the fabric's namespace.
    pub const POD_NAMESPACE: &str = "POD_NAMESPACE";
    /// Fabric name (ConfigMap).
    pub const FABRIC: &str = "KVFABRIC_FABRIC";
    /// Comma-separated etcd client URLs (ConfigMap).
    pub const ETCD_ENDPOINTS: &str = "KVFABRIC_ETCD_ENDPOINTS";
    /// `<keyPrefix>/<namespace>` (ConfigMap); the agent writes under `<this>/<fabric>/`.
    pub const ETCD_KEY_PREFIX: &str = "KVFABRIC_ETCD_KEY_PREFIX";
    /// Comma-separated transports in order of preference (ConfigMap).
    pub const TRANSPORTS: &str = "KVFABRIC_TRANSPORTS";
    /// OTLP/gRPC collector (ConfigMap, only with tracing).
    pub const OTLP_ENDPOINT: &str = "KVFABRIC_OTLP_ENDPOINT";
    /// Trace sample ratio, 0..=1 (ConfigMap, only with tracing).
    pub const TRACE_SAMPLE_RATIO: &str = "KVFABRIC_TRACE_SAMPLE_RATIO";
    /// Pool of this DaemonSet.
    pub const POOL: &str = "KVFABRIC_POOL";
    /// Role of the pool (`Prefill`, `Decode`, `Both`), for the agent to advertise.
    pub const POOL_ROLE: &str = "KVFABRIC_POOL_ROLE";
    /// Directory of the agent's sockets inside its container ([`super::SOCKET_DIR`]).
    pub const SOCKET_DIR: &str = "KVFABRIC_SOCKET_DIR";
    /// Numeric group id the agent gives its sockets.
    pub const SOCKET_GROUP: &str = "KVFABRIC_SOCKET_GROUP";
    /// Octal mode the agent gives its sockets (`0600`, `0660` or `0666`).
    pub const SOCKET_MODE: &str = "KVFABRIC_SOCKET_MODE";
    /// Peer API listen address.
    pub const GRPC_ADDR: &str = "KVFABRIC_GRPC_ADDR";
    /// tcp data plane listen address.
    pub const DATA_ADDR: &str = "KVFABRIC_DATA_ADDR";
    /// Metrics and `/healthz` listen address.
    pub const METRICS_ADDR: &str = "KVFABRIC_METRICS_ADDR";
    /// etcd user (from `etcd.authSecret`).
    pub const ETCD_USERNAME: &str = "KVFABRIC_ETCD_USERNAME";
    /// etcd password (from `etcd.authSecret`).
    pub const ETCD_PASSWORD: &str = "KVFABRIC_ETCD_PASSWORD";
    /// Directory with `ca.crt`, `tls.crt`, `tls.key` (from `etcd.tlsSecret`).
    pub const ETCD_TLS_DIR: &str = "KVFABRIC_ETCD_TLS_DIR";
    /// The fabric's peer token (from `peerTokenSecret`).
    pub const PEER_TOKEN: &str = "KVFABRIC_PEER_TOKEN";
    /// GPUs the NVIDIA toolkit (runtime class or NRI plugin) injects.
    pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
    /// Driver libraries the NVIDIA toolkit injects (`compute,utility`: libcuda and nvidia-smi).
    pub const NVIDIA_DRIVER_CAPABILITIES: &str = "NVIDIA_DRIVER_CAPABILITIES";
    /// Where the CUDA driver caches the kernels it JIT-compiles from the engine's PTX (the
    /// root filesystem is read-only).
    pub const CUDA_CACHE_PATH: &str = "CUDA_CACHE_PATH";

    /// Every name the operator may set; `spec.agent.env` may not set one of them, since the
    /// registry prefix, the socket directory and the addresses are what keep fabrics apart.
    pub const RESERVED: [&str; 25] = [
        NODE_NAME,
        POD_IP,
        POD_NAME,
        POD_NAMESPACE,
        FABRIC,
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
        NVIDIA_VISIBLE_DEVICES,
        NVIDIA_DRIVER_CAPABILITIES,
        CUDA_CACHE_PATH,
    ];
}

/// Peer API (gRPC) port; also serves the standard gRPC health service.
pub const GRPC_PORT: i32 = 50051;
/// tcp data plane port.
pub const DATA_PORT: i32 = 50052;
/// Prometheus `/metrics` and `/healthz` port.
pub const METRICS_PORT: i32 = 9090;

/// gRPC health service the readiness probe asks: SERVING only while the agent is registered in
/// etcd (connected, lease held) and not draining.
pub const READY_SERVICE: &str = "kvfabric.v1.PeerAgent";
/// gRPC health service the liveness and startup probes ask (the empty name: the server as a
/// whole): SERVING while the gRPC server runs, whatever etcd does, so an etcd outage does not
/// restart every agent.
pub const LIVE_SERVICE: &str = "";

/// The agent's socket directory inside its container (the host directory is per fabric and pool).
pub const SOCKET_DIR: &str = "/var/run/kvfabric";
/// A small emptyDir, the only writable place besides the socket directory.
pub const TMP_DIR: &str = "/tmp";
/// Where the etcd TLS Secret is mounted.
pub const ETCD_TLS_MOUNT: &str = "/etc/kvfabric/etcd-tls";

/// Path of the `kvfabric` binary in the agent image.
pub const AGENT_BINARY: &str = "/usr/local/bin/kvfabric";
/// Path of the socket directory helper in the agent image.
pub const SOCKET_DIR_HELPER: &str = "/usr/local/bin/kvfabric-socket-dir";
/// User and group of the agent image (`nonroot`).
pub const AGENT_USER: i64 = 65532;

/// What the agents get as `KVFABRIC_ETCD_KEY_PREFIX`: the fabric's key root with its namespace.
pub fn agent_key_prefix(key_prefix: &str, namespace: &str) -> String {
    format!("{}/{namespace}", key_prefix.trim_end_matches('/'))
}

/// Every key of one fabric starts with this: `<keyPrefix>/<namespace>/<fabric>/`, the agent's
/// own root (`<KVFABRIC_ETCD_KEY_PREFIX>/<KVFABRIC_FABRIC>/`). The trailing slash keeps fabric
/// `a` from covering fabric `ab`; namespace and fabric names hold no '/', and the schema allows
/// one segment of prefix, so no two fabrics' roots nest.
pub fn registry_prefix(key_prefix: &str, namespace: &str, fabric: &str) -> String {
    format!("{}/{fabric}/", agent_key_prefix(key_prefix, namespace))
}

/// Host directory of one pool's sockets: `<socketRoot>/<namespace>/<fabric>/<pool>`, so no
/// agent of another fabric or pool on the node ever replaces them.
pub fn host_socket_dir(socket_root: &str, namespace: &str, fabric: &str, pool: &str) -> String {
    format!(
        "{}/{namespace}/{fabric}/{pool}",
        socket_root.trim_end_matches('/')
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_named_fabrics_in_two_namespaces_get_disjoint_prefixes() {
        let a = registry_prefix("/kvfabric", "team-a", "llama");
        let b = registry_prefix("/kvfabric", "team-b", "llama");
        assert_eq!(a, "/kvfabric/team-a/llama/");
        assert_ne!(a, b);
        assert!(!a.starts_with(&b) && !b.starts_with(&a));
        assert_eq!(
            registry_prefix("/kvfabric/", "ns", "tf"),
            "/kvfabric/ns/tf/"
        );
        assert!(!registry_prefix("/k", "ns", "ab").starts_with(&registry_prefix("/k", "ns", "a")));
    }

    #[test]
    fn the_agent_root_is_the_finalizer_prefix() {
        // The agent computes `<KVFABRIC_ETCD_KEY_PREFIX>/<KVFABRIC_FABRIC>/`.
        let agent_root = format!("{}/{}/", agent_key_prefix("/kvfabric", "llm"), "llama");
        assert_eq!(agent_root, registry_prefix("/kvfabric", "llm", "llama"));
    }

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
}
