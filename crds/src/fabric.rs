//! The `TransferFabric` custom resource.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, PodResourceClaim, ResourceRequirements, Toleration,
};
use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::{JsonSchema, Schema};
use serde::{Deserialize, Serialize};

use crate::Transport;

/// API group of every kvfabric resource.
pub const GROUP: &str = "kvfabric.io";
/// Served and stored version.
pub const VERSION: &str = "v1alpha1";
/// Default root of the registry keys in etcd.
pub const DEFAULT_KEY_PREFIX: &str = "/kvfabric";
/// Longest `spec.etcd.keyPrefix`, the leading slash included.
pub const MAX_KEY_PREFIX: usize = 64;

/// A kvfabric deployment: agent pools on labelled nodes, the etcd registry they share, and the
/// transports they may use.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "kvfabric.io",
    version = "v1alpha1",
    kind = "TransferFabric",
    plural = "transferfabrics",
    shortname = "tf",
    namespaced,
    status = "TransferFabricStatus",
    printcolumn = r#"{"name":"Pools","type":"string","jsonPath":".spec.pools[*].name"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Agents","type":"integer","jsonPath":".status.agentsReady"}"#,
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".status.agentsDesired"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new(crate::validate::FABRIC_NAME_RULE).message("the name must be a DNS-1035 label of at most 56 characters (lower-case letters, digits and '-', starting with a letter): <name>-agents names the agents' Service")
)]
#[x_kube(
    validation = Rule::new("size(self.pools) >= 1").message("at least one pool is required"),
    validation = Rule::new("self.pools.all(p, self.pools.exists_one(q, q.name == p.name))").message("pool names must be unique"),
    validation = Rule::new("self.pools.all(p, p.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'))").message("pool names must be DNS labels (lower-case alphanumerics and '-', starting and ending alphanumeric)"),
    validation = Rule::new("self.transports.all(t, self.transports.exists_one(u, u == t))").message("transports must be unique")
)]
#[schemars(transform = require_spec_fields)]
#[serde(rename_all = "camelCase")]
pub struct TransferFabricSpec {
    /// Agent pools; each becomes one DaemonSet on the nodes its selector picks.
    #[schemars(length(min = 1, max = 32))]
    #[serde(default)]
    pub pools: Vec<Pool>,

    /// How the agent pods are built.
    #[serde(default)]
    pub agent: AgentSpec,

    /// The NetworkPolicy in front of the agents.
    #[serde(default)]
    pub network_policy: NetworkPolicySpec,

    /// Transports in order of preference; the agent picks the first one both ends support.
    #[schemars(length(min = 1, max = 4))]
    #[serde(default = "default_transports")]
    pub transports: Vec<Transport>,

    /// The etcd registry the agents share.
    #[serde(default)]
    pub etcd: EtcdSpec,

    /// Secret whose `token` (at least 16 printable ASCII characters) the agents of this fabric
    /// present to each other's peer API, which hands out region keys. Without it, whoever
    /// reaches an agent's peer port can learn them (the fabric's NetworkPolicy keeps other pods
    /// out, but not on the host network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_token_secret: Option<String>,

    /// `kubernetes.io/tls` Secret with `tls.crt`, `tls.key` and `ca.crt` (cert-manager writes
    /// these): mTLS on the agents' peer API and tcp data port. The certificate must name
    /// `<fabric>.<namespace>.kvfabric` (a DNS subject alternative name) and allow client and
    /// server use; agents admit only peers whose certificate the CA signed for that name, and
    /// take a renewed certificate without a restart. With it the probes ask `/livez` and `/healthz` on the metrics
    /// port (the kubelet's gRPC probe cannot present a certificate). Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_secret: Option<String>,

    /// OpenTelemetry export from the agents; off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingSpec>,
}

fn default_transports() -> Vec<Transport> {
    Transport::KNOWN.to_vec()
}

/// What a pool's workers do, so agents can advertise it in the registry.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PoolRole {
    /// Nodes that run prefill workers (KV producers).
    Prefill,
    /// Nodes that run decode workers (KV consumers).
    Decode,
    /// Nodes that do both.
    #[default]
    Both,
}

impl PoolRole {
    /// The CRD spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolRole::Prefill => "Prefill",
            PoolRole::Decode => "Decode",
            PoolRole::Both => "Both",
        }
    }
}

/// One set of nodes that runs agents.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    /// DNS label; part of the DaemonSet name `<fabric>-<pool>-agent`.
    #[schemars(length(min = 1, max = 40))]
    pub name: String,

    /// What the workers on these nodes do.
    #[serde(default)]
    pub role: PoolRole,

    /// Node labels the agent pods require.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// Taints the agent pods tolerate (GPU nodes are usually tainted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,

    /// Node and pod affinity of the agent pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
}

/// How the agent pods are built. The image, the host directory of the sockets and the pods'
/// users are the operator's settings, not fields here: whoever may create a TransferFabric must
/// not choose what runs, or which host path is mounted, on the GPU nodes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(
    validation = Rule::new("!(has(self.hostNetwork) && self.hostNetwork && has(self.networks) && size(self.networks) > 0)").message("Multus never attaches networks to a hostNetwork pod: set hostNetwork false, or drop networks"),
    validation = Rule::new("!has(self.resourceClaims) || self.resourceClaims.all(c, has(c.resourceClaimName) != has(c.resourceClaimTemplateName))").message("each resourceClaims entry names exactly one of resourceClaimName and resourceClaimTemplateName"),
    validation = Rule::new("!has(self.ports) || (self.ports.grpc != self.ports.data && self.ports.grpc != self.ports.metrics && self.ports.data != self.ports.metrics)").message("the agent's grpc, data and metrics ports must differ"),
    validation = Rule::new("!has(self.rdma) || (has(self.rdma.resources) && size(self.rdma.resources) > 0) || (has(self.resourceClaims) && size(self.resourceClaims) > 0)").message("rdma needs its devices: name device plugin resources in rdma.resources, or resourceClaims that allocate them")
)]
#[serde(rename_all = "camelCase")]
pub struct AgentSpec {
    /// CPU / memory of the agent container. RDMA devices are added from `rdma` and DRA claims
    /// from `resourceClaims`; a GPU is never requested (see `gpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Run in the node's network namespace (RoCE on the host's interfaces; TCP peers then see
    /// node addresses). NetworkPolicies do not apply to such pods: set `peerTokenSecret`.
    #[serde(default)]
    pub host_network: bool,

    /// The agent's ports. With `hostNetwork` they are the node's ports: two fabrics (or pools
    /// of overlapping nodes) on one node need different ones.
    #[serde(default)]
    pub ports: AgentPorts,

    /// Extra environment variables of the agent container (tuning such as `KVFABRIC_LOG` or
    /// `KVFABRIC_RDMA_DEVICES`); the variables the operator sets itself are refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,

    /// PriorityClass of the agent pods; `system-node-critical` when absent, as for the GPU
    /// Operator's node agents: a node under pressure evicts workloads before the agent their
    /// KV moves through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,

    /// How many nodes' agents a rollout replaces at once (a number or a percentage of the
    /// pool's nodes); 1 when absent. Each replaced agent's workers re-register with the new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,

    /// RDMA: devices from device plugins (or from `resourceClaims`), and the memory locking
    /// that registering buffers needs. No RDMA when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaSpec>,

    /// Secondary networks (Multus `k8s.v1.cni.cncf.io/networks`), e.g. the SR-IOV networks of
    /// the VF pools in `rdma`. Not with `hostNetwork`.
    #[schemars(length(max = 16))]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<String>,

    /// Dynamic Resource Allocation claims of the agent pods (Kubernetes 1.31 or later), e.g. RDMA
    /// NICs or, with `adminAccess`, every GPU of the node. Each becomes a pod `resourceClaims`
    /// entry and a container `resources.claims` entry. A DaemonSet's pods run on many nodes, so
    /// name a ResourceClaimTemplate.
    #[schemars(length(max = 8))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resource_claims: Vec<PodResourceClaim>,

    /// GPU access for mapping the workers' GPU memory, without requesting `nvidia.com/gpu`.
    #[serde(default)]
    pub gpu: GpuSpec,

    /// Ownership and mode of the agent's Unix sockets, which the workers on the node open.
    #[serde(default)]
    pub sockets: SocketSpec,
}

/// RDMA devices taken from device plugins, one extended resource per rail.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RdmaSpec {
    /// Extended resources, e.g. `rdma/rdma_shared_device_a` (NVIDIA network-operator's shared
    /// RDMA device plugin) or `nvidia.com/sriov_rdma_rail0` and `nvidia.com/sriov_rdma_rail1`
    /// (two SR-IOV device plugin VF pools of a multi-rail node). Empty when `resourceClaims`
    /// allocate the NICs.
    #[schemars(length(max = 16))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["resourceName"]))]
    #[serde(default)]
    pub resources: Vec<RdmaResource>,
}

/// One extended resource of an RDMA device plugin.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RdmaResource {
    /// Extended resource name, `<domain>/<name>`.
    #[schemars(
        length(min = 3, max = 253),
        regex(
            pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
        )
    )]
    pub resource_name: String,

    /// How many devices each agent requests.
    #[schemars(range(min = 1, max = 64))]
    #[serde(default = "default_rdma_count")]
    pub count: i64,
}

fn default_rdma_count() -> i64 {
    1
}

/// How the agent sees the node's GPUs. It must see every GPU whose memory a worker registers,
/// but it never requests `nvidia.com/gpu`, so every GPU stays schedulable for the workers: this
/// is the "GPU management container" case of the NVIDIA GPU Operator.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// Turn GPU access on.
    #[serde(default)]
    pub enabled: bool,

    /// What injects the GPUs into the agent container: `Cdi` (default), `Env` or `Claim`.
    #[serde(default)]
    pub mode: GpuMode,

    /// `Cdi` mode: fully qualified CDI devices put in the pod annotation
    /// `nvidia.cdi.k8s.io/container.agent`, which the NVIDIA Container Toolkit's NRI plugin
    /// reads. The default, `management.nvidia.com/gpu=all`, is the GPU Operator's device for
    /// management containers (the driver and every GPU, none allocated); the plugin injects it
    /// only in namespaces its administrator allows.
    #[schemars(length(min = 1, max = 16))]
    #[serde(default = "default_cdi_devices")]
    pub cdi_devices: Vec<String>,

    /// `Env` mode: value of `NVIDIA_VISIBLE_DEVICES`, read by the NVIDIA runtime (the node's
    /// default runtime, or the `nvidia` RuntimeClass).
    #[serde(default = "default_visible_devices")]
    pub visible_devices: String,

    /// RuntimeClass of the agent pods, e.g. `nvidia` for `Env` mode under a GPU Operator whose
    /// runtime is not the node's default; none by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
}

/// What injects the GPUs into the agent container.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GpuMode {
    /// CDI devices named in the pod annotation the NVIDIA Container Toolkit's NRI plugin
    /// reads (GPU Operator 25.10 or later, `cdi.nriPluginEnabled`).
    #[default]
    Cdi,
    /// `NVIDIA_VISIBLE_DEVICES`, read by the NVIDIA runtime's legacy hook.
    Env,
    /// The pod's resource claims bring the GPUs (DRA admin access, `resourceClaims`).
    Claim,
}

fn default_visible_devices() -> String {
    "all".to_owned()
}

fn default_cdi_devices() -> Vec<String> {
    vec![MANAGEMENT_GPUS.to_owned()]
}

/// The GPU Operator's CDI device for management containers: the driver and every GPU.
pub const MANAGEMENT_GPUS: &str = "management.nvidia.com/gpu=all";

impl Default for GpuSpec {
    fn default() -> Self {
        Self {
            enabled: false,
            mode: GpuMode::default(),
            cdi_devices: default_cdi_devices(),
            visible_devices: default_visible_devices(),
            runtime_class_name: None,
        }
    }
}

/// The agent's TCP ports.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AgentPorts {
    /// Peer API (gRPC) and its health service.
    #[schemars(range(min = 1, max = 65535))]
    #[serde(default = "default_grpc_port")]
    pub grpc: i32,
    /// The engine's tcp data port.
    #[schemars(range(min = 1, max = 65535))]
    #[serde(default = "default_data_port")]
    pub data: i32,
    /// Prometheus metrics.
    #[schemars(range(min = 1, max = 65535))]
    #[serde(default = "default_metrics_port")]
    pub metrics: i32,
}

fn default_grpc_port() -> i32 {
    50051
}

fn default_data_port() -> i32 {
    50052
}

fn default_metrics_port() -> i32 {
    9090
}

impl Default for AgentPorts {
    fn default() -> Self {
        Self {
            grpc: default_grpc_port(),
            data: default_data_port(),
            metrics: default_metrics_port(),
        }
    }
}

impl AgentPorts {
    /// `(name, port)` of each, as the container and the Service name them.
    pub fn named(&self) -> [(&'static str, i32); 3] {
        [
            ("grpc", self.grpc),
            ("data", self.data),
            ("metrics", self.metrics),
        ]
    }
}

/// Who may open the agent's sockets.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SocketMode {
    /// Only the agent's own user.
    #[serde(rename = "0600")]
    Owner,
    /// The agent's user and members of `group` (the workers, through `supplementalGroups`).
    #[default]
    #[serde(rename = "0660")]
    Group,
    /// Every process that can reach the directory on the node.
    #[serde(rename = "0666")]
    World,
}

impl SocketMode {
    /// The CRD spelling, an octal file mode.
    pub fn as_str(self) -> &'static str {
        match self {
            SocketMode::Owner => "0600",
            SocketMode::Group => "0660",
            SocketMode::World => "0666",
        }
    }

    /// Mode of the directory that holds the sockets: searchable by exactly those who may open
    /// them, and set-group-ID so that the sockets inherit its group.
    pub fn directory_mode(self) -> u32 {
        match self {
            SocketMode::Owner => 0o700,
            SocketMode::Group => 0o2750,
            SocketMode::World => 0o2755,
        }
    }
}

/// Ownership and mode of the agent's Unix sockets.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SocketSpec {
    /// Group id of the socket directory and sockets; workers that use the agent add it to their
    /// `securityContext.supplementalGroups`.
    #[schemars(range(min = 1, max = 2147483647))]
    #[serde(default = "default_socket_group")]
    pub group: i64,

    /// File mode of the sockets.
    #[serde(default)]
    pub mode: SocketMode,
}

/// Default group of the agent's sockets: the agent image's own group.
pub const DEFAULT_SOCKET_GROUP: i64 = 65532;

fn default_socket_group() -> i64 {
    DEFAULT_SOCKET_GROUP
}

impl Default for SocketSpec {
    fn default() -> Self {
        Self {
            group: DEFAULT_SOCKET_GROUP,
            mode: SocketMode::Group,
        }
    }
}

/// The NetworkPolicy the operator puts in front of the agents.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// Create the policy `<fabric>-agents`: the peer API and the data port admit only this
    /// fabric's agents, the metrics port admits `metricsFrom`.
    #[serde(default = "default_true")]
    pub enabled: bool,

    /// Who may scrape the agents' metrics port; every source when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics_from: Vec<NetworkPolicyPeer>,
}

fn default_true() -> bool {
    true
}

impl Default for NetworkPolicySpec {
    fn default() -> Self {
        Self {
            enabled: true,
            metrics_from: Vec::new(),
        }
    }
}

/// The etcd registry.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[schemars(transform = require_etcd_fields)]
#[serde(rename_all = "camelCase")]
pub struct EtcdSpec {
    /// Client URLs, e.g. `http://etcd.kvfabric:2379`.
    #[schemars(length(min = 1))]
    #[serde(default)]
    pub endpoints: Vec<String>,

    /// Secret with `ca.crt`, `tls.crt`, `tls.key` for TLS to etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_secret: Option<String>,

    /// Secret with `username` and `password` for etcd authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_secret: Option<String>,

    /// Root of the registry keys, one path segment: the agents write under
    /// `<keyPrefix>/<namespace>/<fabric>/`, so fabrics named alike in two namespaces never share
    /// keys.
    #[schemars(
        length(min = 2, max = 64),
        regex(pattern = r"^/[A-Za-z0-9]([-A-Za-z0-9._]*[A-Za-z0-9])?$")
    )]
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
}

fn default_key_prefix() -> String {
    DEFAULT_KEY_PREFIX.to_owned()
}

impl Default for EtcdSpec {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            tls_secret: None,
            auth_secret: None,
            key_prefix: default_key_prefix(),
        }
    }
}

/// OpenTelemetry trace export of the agents.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TracingSpec {
    /// OTLP/gRPC endpoint, e.g. `http://otel-collector:4317`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,

    /// Fraction of transfers traced.
    #[schemars(range(min = 0.0, max = 1.0))]
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
}

fn default_sample_ratio() -> f64 {
    1.0
}

/// What the operator observed.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TransferFabricStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `Ready`, `Progressing`, `Degraded`, kstatus's `Reconciling` and `Stalled`, and one
    /// `<pool>Ready` per pool.
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    #[serde(default)]
    pub conditions: Vec<Condition>,

    /// Agents per pool.
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    #[serde(default)]
    pub pools: Vec<PoolStatus>,
    /// Ready agents of every pool (`kubectl get tf` shows it beside `agentsDesired`).
    #[serde(default)]
    pub agents_ready: i32,

    /// Nodes that should run an agent, over every pool.
    #[serde(default)]
    pub agents_desired: i32,
}

/// Agents of one pool, from its DaemonSet status.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    /// Pool name.
    pub name: String,
    /// Nodes that should run an agent.
    pub desired: i32,
    /// Agents that are ready.
    pub ready: i32,
    /// Host directory of this pool's agent sockets, which its workers mount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket_dir: Option<String>,
}

/// Marks `fields` required in an object schema and drops their defaults.
///
/// The Rust fields carry `#[serde(default)]` so that an object which bypassed the schema still
/// deserializes and the reconciler can name the missing field in a `Degraded` condition; the
/// apiserver, though, must reject such objects, so the schema says "required" and has no default.
fn require(schema: &mut Schema, fields: &[&str]) {
    if let Some(props) = schema
        .get_mut("properties")
        .and_then(serde_json::Value::as_object_mut)
    {
        for field in fields {
            if let Some(p) = props
                .get_mut(*field)
                .and_then(serde_json::Value::as_object_mut)
            {
                p.remove("default");
            }
        }
    }
    let required = schema
        .ensure_object()
        .entry("required")
        .or_insert_with(|| serde_json::Value::Array(Vec::new()));
    if let Some(list) = required.as_array_mut() {
        for field in fields {
            if !list.iter().any(|v| v == *field) {
                list.push(serde_json::Value::from(*field));
            }
        }
    }
}

fn require_spec_fields(schema: &mut Schema) {
    require(schema, &["pools", "etcd"]);
}

fn require_etcd_fields(schema: &mut Schema) {
    require(schema, &["endpoints"]);
}
