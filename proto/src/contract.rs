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

/// Environment variables the agent reads (each also a `kvfabric agent` flag).
pub mod env {
    pub const FABRIC: &str = "KVFABRIC_FABRIC";
    pub const NAMESPACE: &str = "KVFABRIC_NAMESPACE";
    pub const POOL: &str = "KVFABRIC_POOL";
    pub const AGENT_NAME: &str = "KVFABRIC_AGENT_NAME";
    pub const ETCD_ENDPOINTS: &str = "KVFABRIC_ETCD_ENDPOINTS";
    pub const ETCD_KEY_PREFIX: &str = "KVFABRIC_ETCD_KEY_PREFIX";
    pub const ETCD_USERNAME: &str = "KVFABRIC_ETCD_USERNAME";
    pub const ETCD_PASSWORD: &str = "KVFABRIC_ETCD_PASSWORD";
    pub const ETCD_TLS_DIR: &str = "KVFABRIC_ETCD_TLS_DIR";
    pub const PEER_TOKEN: &str = "KVFABRIC_PEER_TOKEN";
    pub const LEASE_TTL_SECS: &str = "KVFABRIC_LEASE_TTL_SECS";
    pub const SOCKET_DIR: &str = "KVFABRIC_SOCKET_DIR";
    pub const SOCKET_GROUP: &str = "KVFABRIC_SOCKET_GROUP";
    pub const SOCKET_MODE: &str = "KVFABRIC_SOCKET_MODE";
    pub const GRPC_ADDR: &str = "KVFABRIC_GRPC_ADDR";
    pub const DATA_ADDR: &str = "KVFABRIC_DATA_ADDR";
    pub const METRICS_ADDR: &str = "KVFABRIC_METRICS_ADDR";
    pub const ADVERTISE_ADDR: &str = "KVFABRIC_ADVERTISE_ADDR";
    pub const TRANSPORTS: &str = "KVFABRIC_TRANSPORTS";
    pub const TCP_CONNECTIONS: &str = "KVFABRIC_TCP_CONNECTIONS";
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
    /// Set by the DaemonSet from the downward API: the node's name (the agent's default name).
    pub const NODE_NAME: &str = "NODE_NAME";
    /// Set by the DaemonSet from the downward API: what peers dial by default.
    pub const POD_IP: &str = "POD_IP";
}

/// Default registry key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "/kvfabric";

/// Namespace of a fabric whose agent is not told one (an agent run outside Kubernetes).
pub const DEFAULT_NAMESPACE: &str = "default";

/// Where one fabric's keys live: `<prefix>/<namespace>/<fabric>`, so fabrics of the same name in
/// two namespaces never share keys. Agents write `<root>/agents/<agent>` and
/// `<root>/segments/<segment>`; the operator deletes everything under `<root>/` when the fabric
/// goes. Namespace and fabric names are DNS labels, so no root is a prefix of another's keys.
pub fn registry_root(prefix: &str, namespace: &str, fabric: &str) -> String {
    format!("{}/{namespace}/{fabric}", prefix.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_of_same_named_fabrics_differ_by_namespace() {
        let a = registry_root("/kvfabric", "team-a", "prod");
        let b = registry_root("/kvfabric/", "team-b", "prod");
        assert_eq!(a, "/kvfabric/team-a/prod");
        assert_eq!(b, "/kvfabric/team-b/prod");
        assert!(!format!("{b}/").starts_with(&format!("{a}/")));
    }
}
