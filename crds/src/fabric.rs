//! The `TransferFabric` custom resource.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, EnvVar, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
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
/// Default host directory for the agent's Unix socket, shared with the workers on the node.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/kvfabric";

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
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
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

    /// Transports in order of preference; the agent picks the first one both ends support.
    #[schemars(length(min = 1, max = 4))]
    #[serde(default = "default_transports")]
    pub transports: Vec<Transport>,

    /// The etcd registry the agents share.
    #[serde(default)]
    pub etcd: EtcdSpec,

    /// Secret whose `token` (at least 16 printable ASCII characters) the agents of this fabric
    /// present to each other's peer API, which hands out region keys. Without it, whoever
    /// reaches an agent's peer port can learn them (the chart's NetworkPolicy keeps other pods
    /// out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_token_secret: Option<String>,

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

/// Image pull policy of the agent container.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullPolicy {
    /// Pull on every start.
    Always,
    /// Pull when the node lacks the image.
    IfNotPresent,
    /// Never pull.
    Never,
}

impl PullPolicy {
    /// The Kubernetes spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

/// How the agent pods are built.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[schemars(transform = require_agent_fields)]
#[serde(rename_all = "camelCase")]
pub struct AgentSpec {
    /// Agent container image.
    #[schemars(length(min = 1))]
    #[serde(default)]
    pub image: String,

    /// Pull policy of the agent image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,

    /// CPU / memory of the agent container. RDMA devices are added from `rdma`; a GPU is never
    /// requested (see `gpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Run in the node's network namespace (RDMA and TCP peers then see node addresses).
    #[serde(default)]
    pub host_network: bool,

    /// Share the node's IPC namespace. CUDA IPC and shm between a worker pod and the agent need a
    /// common /dev/shm: either both use hostIPC, or both mount the same hostPath as /dev/shm
    /// (`shm.medium: HostPath`). Off by default because the hostPath route needs no extra privilege.
    #[serde(default, rename = "hostIPC")]
    pub host_ipc: bool,

    /// Extra environment variables of the agent container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,

    /// PriorityClass of the agent pods (node agents usually run at system-node-critical).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,

    /// RDMA devices from a device plugin; no RDMA when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaSpec>,

    /// Secondary networks (Multus `k8s.v1.cni.cncf.io/networks`), e.g. SR-IOV networks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<String>,

    /// GPU access through the NVIDIA container runtime, without requesting `nvidia.com/gpu`.
    #[serde(default)]
    pub gpu: GpuSpec,

    /// The /dev/shm the agent uses for the shm transport.
    #[serde(default)]
    pub shm: ShmSpec,

    /// Host directory for the agent's Unix socket; workers mount the same path.
    #[serde(default = "default_socket_dir")]
    pub socket_dir: String,
}

fn default_socket_dir() -> String {
    DEFAULT_SOCKET_DIR.to_owned()
}

impl Default for AgentSpec {
    fn default() -> Self {
        Self {
            image: String::new(),
            image_pull_policy: None,
            resources: None,
            host_network: false,
            host_ipc: false,
            env: Vec::new(),
            priority_class_name: None,
            rdma: None,
            networks: Vec::new(),
            gpu: GpuSpec::default(),
            shm: ShmSpec::default(),
            socket_dir: default_socket_dir(),
        }
    }
}

/// RDMA devices taken from a device plugin.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RdmaSpec {
    /// Extended resource name, e.g. `rdma/hca_shared_devices_a` (shared RDMA device plugin) or
    /// `nvidia.com/mlnx_sriov_rdma` (SR-IOV device plugin VF pool).
    #[schemars(length(min = 1))]
    pub resource_name: String,

    /// How many devices each agent requests.
    #[schemars(range(min = 1))]
    #[serde(default = "default_rdma_count")]
    pub count: i64,
}

fn default_rdma_count() -> i64 {
    1
}

/// GPU visibility the way the NVIDIA GPU operator's own node DaemonSets get it: the `nvidia`
/// runtime class plus `NVIDIA_VISIBLE_DEVICES`, so the agent can map worker GPU memory without
/// taking a schedulable GPU away from the workloads.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// Turn GPU access on.
    #[serde(default)]
    pub enabled: bool,

    /// RuntimeClass that injects the NVIDIA container runtime hook.
    #[serde(default = "default_runtime_class")]
    pub runtime_class_name: String,

    /// Value of `NVIDIA_VISIBLE_DEVICES`.
    #[serde(default = "default_visible_devices")]
    pub visible_devices: String,
}

fn default_runtime_class() -> String {
    "nvidia".to_owned()
}

fn default_visible_devices() -> String {
    "all".to_owned()
}

impl Default for GpuSpec {
    fn default() -> Self {
        Self {
            enabled: false,
            runtime_class_name: default_runtime_class(),
            visible_devices: default_visible_devices(),
        }
    }
}

/// Where the agent's /dev/shm comes from.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ShmMedium {
    /// A tmpfs emptyDir private to the agent pod.
    #[default]
    Memory,
    /// A host directory that worker pods mount too, so shm segments are shared.
    HostPath,
}

/// The agent's /dev/shm volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ShmSpec {
    /// emptyDir (Memory) or hostPath.
    #[serde(default)]
    pub medium: ShmMedium,

    /// Size limit of the Memory emptyDir, a Kubernetes quantity.
    #[serde(default = "default_shm_size")]
    pub size_limit: String,

    /// Host directory used when `medium` is `HostPath`.
    #[serde(default = "default_shm_host_path")]
    pub host_path: String,
}

fn default_shm_size() -> String {
    "1Gi".to_owned()
}

fn default_shm_host_path() -> String {
    "/dev/shm".to_owned()
}

impl Default for ShmSpec {
    fn default() -> Self {
        Self {
            medium: ShmMedium::Memory,
            size_limit: default_shm_size(),
            host_path: default_shm_host_path(),
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

    /// Root of this fabric's keys; the agents write under `<keyPrefix>/<fabric>/`.
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

    /// `Ready`, `Progressing`, `Degraded` and one `<pool>Ready` per pool.
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    #[serde(default)]
    pub conditions: Vec<Condition>,

    /// Agents per pool.
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    #[serde(default)]
    pub pools: Vec<PoolStatus>,
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
    require(schema, &["pools", "agent", "etcd"]);
}

fn require_agent_fields(schema: &mut Schema) {
    require(schema, &["image"]);
}

fn require_etcd_fields(schema: &mut Schema) {
    require(schema, &["endpoints"]);
}
