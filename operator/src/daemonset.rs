//! One agent DaemonSet per pool.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, RollingUpdateDaemonSet,
};
use k8s_openapi::api::core::v1::{
    Affinity, CSIVolumeSource, Capabilities, ConfigMapEnvSource, Container, ContainerPort,
    EmptyDirVolumeSource, EnvFromSource, EnvVar, EnvVarSource, GRPCAction, HTTPGetAction,
    HostPathVolumeSource, LocalObjectReference, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ResourceClaim, ResourceRequirements, SeccompProfile, SecretKeySelector,
    SecretVolumeSource, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvfabric_crds::{GpuMode, Pool, TransferFabric};

use crate::Result;
use crate::config::{AgentSettings, SocketVolume};
use crate::contract::{self, env as e};
use crate::meta::{
    POOL_LABEL, child_meta, configmap_name, daemonset_name, fabric_labels, name_and_namespace,
    pool_selector, service_account_name,
};

/// Pod annotation Multus reads to attach secondary (e.g. SR-IOV) networks.
pub const MULTUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";
/// Pod annotation the NVIDIA Container Toolkit's NRI plugin reads: CDI devices for the agent
/// container (`nvidia.cdi.k8s.io/container.<container>`).
pub const CDI_ANNOTATION: &str = "nvidia.cdi.k8s.io/container.agent";
/// Pod template annotation with the hash of the fabric's ConfigMap: the agents read the map
/// through `envFrom` at start only, so a change of it must roll them.
pub const CONFIG_HASH_ANNOTATION: &str = "kvfabric.io/config-hash";
/// Lets `kubectl logs`/`exec` pick the agent over the init container.
pub const DEFAULT_CONTAINER_ANNOTATION: &str = "kubectl.kubernetes.io/default-container";
/// PriorityClass of agents whose fabric names none (the GPU Operator's node agents run at it).
pub const DEFAULT_PRIORITY_CLASS: &str = "system-node-critical";
/// Name of the agent container.
pub const AGENT_CONTAINER: &str = "agent";
/// Name of the init container that prepares the socket directory.
pub const SOCKET_DIR_CONTAINER: &str = "socket-dir";
/// Size limit of the agent's `/tmp` (the CUDA JIT cache of a few kernels).
pub const TMP_SIZE: &str = "256Mi";

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_owned(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn value_env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_owned(),
                key: key.to_owned(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// Whether the agent must run as root: RDMA memory registration beyond `RLIMIT_MEMLOCK` needs
/// `CAP_IPC_LOCK` in the effective set, and container runtimes give added capabilities to uid 0
/// only (no ambient capabilities for other users; file capabilities would need
/// `allowPrivilegeEscalation`). TCP, shm and cuda-ipc need no capability at all.
pub fn runs_as_root(fabric: &TransferFabric) -> bool {
    fabric.spec.agent.rdma.is_some()
}

fn agent_user(fabric: &TransferFabric) -> i64 {
    if runs_as_root(fabric) {
        0
    } else {
        contract::AGENT_USER
    }
}

fn env(fabric: &TransferFabric, pool: &Pool) -> Vec<EnvVar> {
    let agent = &fabric.spec.agent;
    let addr = |port: i32| format!("0.0.0.0:{port}");
    let mut env = vec![
        field_env(e::NODE_NAME, "spec.nodeName"),
        field_env(e::POD_IP, "status.podIP"),
        // The ports on the pod's own address only: with hostNetwork, not on every interface
        // of the node (other fabrics' agents and host processes keep theirs).
        field_env(e::LISTEN_IP, "status.podIP"),
        field_env(e::POD_NAME, "metadata.name"),
        field_env(e::POD_NAMESPACE, "metadata.namespace"),
        value_env(e::POOL, &pool.name),
        value_env(e::POOL_ROLE, pool.role.as_str()),
        value_env(e::SOCKET_DIR, contract::socket::DEFAULT_DIR),
        value_env(e::SOCKET_GROUP, agent.sockets.group.to_string()),
        value_env(e::SOCKET_MODE, agent.sockets.mode.as_str()),
        value_env(e::GRPC_ADDR, addr(agent.ports.grpc)),
        value_env(e::DATA_ADDR, addr(agent.ports.data)),
        value_env(e::METRICS_ADDR, addr(agent.ports.metrics)),
    ];
    if agent.gpu.enabled {
        // In Cdi mode the variable stays unset: under the NVIDIA runtime its legacy hook
        // would inject a second time what the CDI device already brings.
        if agent.gpu.mode == GpuMode::Env {
            env.push(value_env(
                e::NVIDIA_VISIBLE_DEVICES,
                &agent.gpu.visible_devices,
            ));
            env.push(value_env(e::NVIDIA_DRIVER_CAPABILITIES, "compute,utility"));
        }
        env.push(value_env(
            e::CUDA_CACHE_PATH,
            format!("{}/cuda-cache", contract::TMP_DIR),
        ));
    }
    if let Some(secret) = &fabric.spec.etcd.auth_secret {
        env.push(secret_env(e::ETCD_USERNAME, secret, "username"));
        env.push(secret_env(e::ETCD_PASSWORD, secret, "password"));
    }
    if fabric.spec.etcd.tls_secret.is_some() {
        env.push(value_env(e::ETCD_TLS_DIR, contract::ETCD_TLS_MOUNT));
    }
    if let Some(secret) = &fabric.spec.peer_token_secret {
        env.push(secret_env(e::PEER_TOKEN, secret, "token"));
    }
    if fabric.spec.tls_secret.is_some() {
        env.push(value_env(e::TLS_DIR, contract::TLS_MOUNT));
    }
    // Reserved names were refused by the spec checks, so the user's list only adds.
    env.extend(agent.env.iter().cloned());
    env
}

/// The agent container's CPU and memory when the fabric names none: requests keep it out of
/// BestEffort (evicted first), limits let it into namespaces whose ResourceQuota counts
/// `limits.*`. No CPU request would starve the tcp path's threads under load; 4 CPUs and
/// 2 GiB leave room for its buffers and connections (docs/operator.md; override in
/// `spec.agent.resources`).
pub const AGENT_REQUESTS: [(&str, &str); 2] = [("cpu", "500m"), ("memory", "512Mi")];
pub const AGENT_LIMITS: [(&str, &str); 2] = [("cpu", "4"), ("memory", "2Gi")];
/// The socket directory's init container: a chown and a chmod.
pub const INIT_REQUESTS: [(&str, &str); 2] = [("cpu", "10m"), ("memory", "16Mi")];
pub const INIT_LIMITS: [(&str, &str); 2] = [("cpu", "100m"), ("memory", "64Mi")];

fn quantities(list: &[(&str, &str)]) -> Option<BTreeMap<String, Quantity>> {
    Some(
        list.iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
            .collect(),
    )
}

fn requirements(requests: &[(&str, &str)], limits: &[(&str, &str)]) -> ResourceRequirements {
    ResourceRequirements {
        requests: quantities(requests),
        limits: quantities(limits),
        ..ResourceRequirements::default()
    }
}

fn resources(fabric: &TransferFabric) -> Option<ResourceRequirements> {
    let agent = &fabric.spec.agent;
    // The fabric's own resources stand as written (merging ours could put a default request
    // above its limit); RDMA devices and claims are added to either.
    let mut res = Some(
        agent
            .resources
            .clone()
            .unwrap_or_else(|| requirements(&AGENT_REQUESTS, &AGENT_LIMITS)),
    );
    for rdma in agent.rdma.iter().flat_map(|r| &r.resources) {
        // Extended resources are limit-only: the scheduler sets the request equal to the limit.
        res.get_or_insert_with(ResourceRequirements::default)
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert(rdma.resource_name.clone(), Quantity(rdma.count.to_string()));
    }
    // Each pod claim is used by the agent container; a claim listed by the user already stays
    // as written (it may name a `request`).
    for claim in &agent.resource_claims {
        let claims = res
            .get_or_insert_with(ResourceRequirements::default)
            .claims
            .get_or_insert_with(Vec::new);
        if !claims.iter().any(|c| c.name == claim.name) {
            claims.push(ResourceClaim {
                name: claim.name.clone(),
                request: None,
            });
        }
    }
    res
}

fn socket_dir_volume(
    fabric: &TransferFabric,
    pool: &Pool,
    settings: &AgentSettings,
) -> Result<Volume> {
    let (name, ns) = name_and_namespace(fabric)?;
    let volume = Volume {
        name: "socket-dir".to_owned(),
        ..Volume::default()
    };
    Ok(match settings.socket_volume {
        SocketVolume::HostPath => Volume {
            host_path: Some(HostPathVolumeSource {
                path: contract::host_socket_dir(&settings.socket_root, &ns, &name, &pool.name),
                type_: Some("DirectoryOrCreate".to_owned()),
            }),
            ..volume
        },
        // The driver finds `<socketRoot>/<the pod's namespace>/<fabric>/<pool>` itself; the
        // agent's copy is read-write (it binds the sockets), its workers' read-only.
        SocketVolume::Csi => Volume {
            csi: Some(CSIVolumeSource {
                driver: contract::csi::DRIVER.to_owned(),
                read_only: Some(false),
                volume_attributes: Some(BTreeMap::from([
                    (contract::csi::FABRIC_ATTRIBUTE.to_owned(), name),
                    (contract::csi::POOL_ATTRIBUTE.to_owned(), pool.name.clone()),
                ])),
                ..CSIVolumeSource::default()
            }),
            ..volume
        },
    })
}

fn mount(volume: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: volume.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The agent's health, as the kubelet asks it. The gRPC health service on the peer port, unless
/// that port requires a client certificate (mTLS), which the kubelet's gRPC probe cannot present:
/// then the metrics port's `/livez` and `/healthz`, which answer the same questions.
#[derive(Clone, Copy)]
enum Health {
    /// The process serves (startup, liveness).
    Live,
    /// In the registry and not draining (readiness).
    Ready,
}

fn probe(fabric: &TransferFabric, health: Health, period: i32, failures: i32) -> Probe {
    let (grpc, http_get) = if fabric.spec.tls_secret.is_some() {
        let path = match health {
            Health::Live => "/livez",
            Health::Ready => "/healthz",
        };
        let get = HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::Int(fabric.spec.agent.ports.metrics),
            ..HTTPGetAction::default()
        };
        (None, Some(get))
    } else {
        let service = match health {
            Health::Live => contract::LIVE_SERVICE,
            Health::Ready => contract::READY_SERVICE,
        };
        let grpc = GRPCAction {
            port: fabric.spec.agent.ports.grpc,
            service: (!service.is_empty()).then(|| service.to_owned()),
        };
        (Some(grpc), None)
    };
    Probe {
        grpc,
        http_get,
        period_seconds: Some(period),
        timeout_seconds: Some(5),
        failure_threshold: Some(failures),
        ..Probe::default()
    }
}

fn port(name: &str, number: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_owned()),
        container_port: number,
        protocol: Some("TCP".to_owned()),
        ..ContainerPort::default()
    }
}

fn agent_container(
    fabric: &TransferFabric,
    pool: &Pool,
    settings: &AgentSettings,
    configmap: String,
) -> Container {
    let mut mounts = vec![
        mount("socket-dir", contract::socket::DEFAULT_DIR, false),
        mount("tmp", contract::TMP_DIR, false),
    ];
    if fabric.spec.etcd.tls_secret.is_some() {
        mounts.push(mount("etcd-tls", contract::ETCD_TLS_MOUNT, true));
    }
    if fabric.spec.tls_secret.is_some() {
        mounts.push(mount("agent-tls", contract::TLS_MOUNT, true));
    }
    let add = runs_as_root(fabric).then(|| vec!["IPC_LOCK".to_owned()]);
    Container {
        name: AGENT_CONTAINER.to_owned(),
        image: Some(settings.image.clone()),
        image_pull_policy: Some(settings.pull_policy.as_str().to_owned()),
        command: Some(vec![contract::AGENT_BINARY.to_owned()]),
        args: Some(vec!["agent".to_owned()]),
        env: Some(env(fabric, pool)),
        env_from: Some(vec![EnvFromSource {
            config_map_ref: Some(ConfigMapEnvSource {
                name: configmap,
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        }]),
        ports: Some(
            fabric
                .spec
                .agent
                .ports
                .named()
                .into_iter()
                .map(|(name, number)| port(name, number))
                .collect(),
        ),
        // Up to a minute to bind and start serving; then a hung server is restarted, while an
        // agent that lost etcd or is draining only leaves the endpoints.
        startup_probe: Some(probe(fabric, Health::Live, 2, 30)),
        liveness_probe: Some(probe(fabric, Health::Live, 10, 3)),
        readiness_probe: Some(probe(fabric, Health::Ready, 5, 2)),
        resources: resources(fabric),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                add,
                drop: Some(vec!["ALL".to_owned()]),
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(mounts),
        ..Container::default()
    }
}

/// The init container that gives the hostPath socket directory (created by the kubelet as
/// root:root 0755) to the agent's user and the socket group, with a mode that lets exactly the
/// socket group in. It runs as root with CHOWN and FOWNER only.
fn socket_dir_container(fabric: &TransferFabric, settings: &AgentSettings) -> Container {
    let sockets = &fabric.spec.agent.sockets;
    Container {
        name: SOCKET_DIR_CONTAINER.to_owned(),
        image: Some(settings.image.clone()),
        image_pull_policy: Some(settings.pull_policy.as_str().to_owned()),
        command: Some(vec![contract::SOCKET_DIR_HELPER.to_owned()]),
        args: Some(vec![
            "--dir".to_owned(),
            contract::socket::DEFAULT_DIR.to_owned(),
            "--uid".to_owned(),
            agent_user(fabric).to_string(),
            "--gid".to_owned(),
            sockets.group.to_string(),
            "--mode".to_owned(),
            format!("{:o}", sockets.mode.directory_mode()),
        ]),
        security_context: Some(SecurityContext {
            run_as_user: Some(0),
            run_as_group: Some(0),
            run_as_non_root: Some(false),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                add: Some(vec!["CHOWN".to_owned(), "FOWNER".to_owned()]),
                drop: Some(vec!["ALL".to_owned()]),
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(vec![mount(
            "socket-dir",
            contract::socket::DEFAULT_DIR,
            false,
        )]),
        resources: Some(requirements(&INIT_REQUESTS, &INIT_LIMITS)),
        ..Container::default()
    }
}

fn annotations(fabric: &TransferFabric, config_hash: &str) -> BTreeMap<String, String> {
    let agent = &fabric.spec.agent;
    let mut out = BTreeMap::from([
        (CONFIG_HASH_ANNOTATION.to_owned(), config_hash.to_owned()),
        (
            DEFAULT_CONTAINER_ANNOTATION.to_owned(),
            AGENT_CONTAINER.to_owned(),
        ),
    ]);
    if !agent.networks.is_empty() {
        out.insert(MULTUS_ANNOTATION.to_owned(), agent.networks.join(","));
    }
    if agent.gpu.enabled && agent.gpu.mode == GpuMode::Cdi {
        out.insert(CDI_ANNOTATION.to_owned(), agent.gpu.cdi_devices.join(","));
    }
    out
}

/// The pool's tolerations, then the cluster's for every agent (operator settings) that the pool
/// does not already have.
fn tolerations(pool: &Pool, settings: &AgentSettings) -> Option<Vec<Toleration>> {
    let mut out = pool.tolerations.clone();
    for t in &settings.tolerations {
        if !out.contains(t) {
            out.push(t.clone());
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The GPU Operator's node label for NVML clients that are not its own (26.7 and later): "true"
/// on GPU nodes, `paused-for-driver-upgrade` (k8s-driver-manager) or `paused-for-mig-change`
/// (mig-parted) while the driver or the MIG layout changes, back to "true" after.
pub const GPU_CLIENT_LABEL: &str = "nvidia.com/gpu.deploy.client";

/// The pool's affinity; with GPU access, also: on the node only while [`GPU_CLIENT_LABEL`] is
/// "true" or absent (older GPU Operators, other clusters). The agent holds `/dev/nvidia*`
/// without requesting a GPU, so the driver upgrade's pod eviction (GPU requests only, daemon
/// pods skipped) never reaches it and the driver could not unload; flipping the label makes
/// the DaemonSet controller remove it and bring it back after.
fn affinity(fabric: &TransferFabric, pool: &Pool) -> Option<Affinity> {
    let mut affinity = pool.affinity.clone();
    if !fabric.spec.agent.gpu.enabled {
        return affinity;
    }
    let requirement = |operator: &str, values: Option<Vec<String>>| NodeSelectorRequirement {
        key: GPU_CLIENT_LABEL.to_owned(),
        operator: operator.to_owned(),
        values,
    };
    let either = [
        requirement("In", Some(vec!["true".to_owned()])),
        requirement("DoesNotExist", None),
    ];
    let required = affinity
        .get_or_insert_with(Affinity::default)
        .node_affinity
        .get_or_insert_with(NodeAffinity::default)
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(|| NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm::default()],
        });
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    // Terms are ORed and a term's expressions ANDed: each of the pool's terms, once with each.
    required.node_selector_terms = required
        .node_selector_terms
        .iter()
        .flat_map(|term| {
            either.iter().map(move |r| {
                let mut t = term.clone();
                t.match_expressions
                    .get_or_insert_with(Vec::new)
                    .push(r.clone());
                t
            })
        })
        .collect();
    affinity
}

/// The desired DaemonSet `<fabric>-<pool>-agent`. `config_hash` is [`crate::configmap::config_hash`]
/// of the fabric's ConfigMap.
pub fn desired_daemonset(
    fabric: &TransferFabric,
    pool: &Pool,
    settings: &AgentSettings,
    config_hash: &str,
) -> Result<DaemonSet> {
    let (name, _) = name_and_namespace(fabric)?;
    let agent = &fabric.spec.agent;
    let mut labels = fabric_labels(&name);
    labels.insert(POOL_LABEL.to_owned(), pool.name.clone());

    let mut volumes = vec![
        socket_dir_volume(fabric, pool, settings)?,
        Volume {
            name: "tmp".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity(TMP_SIZE.to_owned())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
    ];
    for (volume, secret) in [
        ("etcd-tls", &fabric.spec.etcd.tls_secret),
        ("agent-tls", &fabric.spec.tls_secret),
    ] {
        if let Some(secret) = secret {
            volumes.push(Volume {
                name: volume.to_owned(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(secret.clone()),
                    ..SecretVolumeSource::default()
                }),
                ..Volume::default()
            });
        }
    }
    let user = agent_user(fabric);
    let pod = PodSpec {
        service_account_name: Some(service_account_name(&name)),
        automount_service_account_token: Some(false),
        host_network: agent.host_network.then_some(true),
        // Keeps cluster DNS (etcd's service name) resolvable when on the host network.
        dns_policy: agent
            .host_network
            .then(|| "ClusterFirstWithHostNet".to_owned()),
        priority_class_name: Some(
            agent
                .priority_class_name
                .clone()
                .unwrap_or_else(|| DEFAULT_PRIORITY_CLASS.to_owned()),
        ),
        runtime_class_name: agent
            .gpu
            .enabled
            .then(|| agent.gpu.runtime_class_name.clone())
            .flatten(),
        node_selector: (!pool.node_selector.is_empty()).then(|| pool.node_selector.clone()),
        tolerations: tolerations(pool, settings),
        affinity: affinity(fabric, pool),
        image_pull_secrets: (!settings.pull_secrets.is_empty()).then(|| {
            settings
                .pull_secrets
                .iter()
                .map(|n| LocalObjectReference { name: n.clone() })
                .collect()
        }),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(user != 0),
            run_as_user: Some(user),
            run_as_group: Some(user),
            // The socket group: the agent's sockets get it, the init container may set it.
            supplemental_groups: Some(vec![agent.sockets.group]),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        resource_claims: (!agent.resource_claims.is_empty()).then(|| agent.resource_claims.clone()),
        init_containers: Some(vec![socket_dir_container(fabric, settings)]),
        containers: vec![agent_container(
            fabric,
            pool,
            settings,
            configmap_name(&name),
        )],
        volumes: Some(volumes),
        ..PodSpec::default()
    };

    Ok(DaemonSet {
        metadata: child_meta(fabric, daemonset_name(&name, &pool.name), labels.clone())?,
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(pool_selector(&name, &pool.name)),
                ..LabelSelector::default()
            },
            update_strategy: Some(DaemonSetUpdateStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDaemonSet {
                    max_unavailable: Some(
                        fabric
                            .spec
                            .agent
                            .max_unavailable
                            .clone()
                            .unwrap_or(IntOrString::Int(1)),
                    ),
                    ..RollingUpdateDaemonSet::default()
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations: Some(annotations(fabric, config_hash)),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..DaemonSetSpec::default()
        }),
        ..DaemonSet::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PullPolicy;
    use crate::fixtures::{NAME, NS, UID, full, minimal};
    use k8s_openapi::api::core::v1::PodResourceClaim;
    use kvfabric_crds::{RdmaResource, RdmaSpec, SocketMode};

    fn settings() -> AgentSettings {
        AgentSettings {
            image: "registry.example/kvfabric-agent:1.2.3".into(),
            pull_policy: PullPolicy::Always,
            pull_secrets: vec!["regcred".into()],
            ..AgentSettings::default()
        }
    }

    fn build(f: &TransferFabric, pool: usize) -> DaemonSet {
        desired_daemonset(f, &f.spec.pools[pool], &settings(), "hash-1").expect("builds")
    }

    fn pod(ds: &DaemonSet) -> &PodSpec {
        ds.spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("pod spec")
    }

    fn agent(ds: &DaemonSet) -> &Container {
        &pod(ds).containers[0]
    }

    fn init(ds: &DaemonSet) -> &Container {
        &pod(ds).init_containers.as_ref().expect("init")[0]
    }

    fn annotations(ds: &DaemonSet) -> &BTreeMap<String, String> {
        ds.spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .expect("annotations")
    }

    fn env_value<'a>(c: &'a Container, name: &str) -> Option<&'a EnvVar> {
        c.env.as_ref()?.iter().find(|e| e.name == name)
    }

    fn val(c: &Container, n: &str) -> Option<String> {
        env_value(c, n).and_then(|e| e.value.clone())
    }

    #[test]
    fn metadata_selector_and_owner() {
        let f = full();
        let ds = build(&f, 0);
        assert_eq!(ds.metadata.name.as_deref(), Some("tf-prefill-agent"));
        assert_eq!(ds.metadata.namespace.as_deref(), Some(NS));
        let owner = &ds.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(owner.uid, UID);
        assert_eq!(owner.kind, "TransferFabric");
        assert_eq!(owner.api_version, "kvfabric.io/v1alpha1");
        assert_eq!(owner.name, NAME);
        assert_eq!(owner.controller, Some(true));
        let labels = ds.metadata.labels.as_ref().expect("labels");
        assert_eq!(
            labels.get("kvfabric.io/fabric").map(String::as_str),
            Some(NAME)
        );
        assert_eq!(
            labels.get("kvfabric.io/pool").map(String::as_str),
            Some("prefill")
        );
        let spec = ds.spec.as_ref().expect("spec");
        let sel = spec.selector.match_labels.as_ref().expect("selector");
        assert_eq!(sel.len(), 2);
        let tmpl_labels = spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref())
            .expect("labels");
        for (k, v) in sel {
            assert_eq!(tmpl_labels.get(k), Some(v), "template must match selector");
        }
    }

    #[test]
    fn image_and_pull_settings_come_from_the_operator() {
        let ds = build(&full(), 0);
        for c in [agent(&ds), init(&ds)] {
            assert_eq!(
                c.image.as_deref(),
                Some("registry.example/kvfabric-agent:1.2.3")
            );
            assert_eq!(c.image_pull_policy.as_deref(), Some("Always"));
        }
        assert_eq!(
            agent(&ds).command.as_deref(),
            Some(&["/usr/local/bin/kvfabric".to_owned()][..])
        );
        assert_eq!(
            pod(&ds).image_pull_secrets,
            Some(vec![LocalObjectReference {
                name: "regcred".into()
            }])
        );
    }

    #[test]
    fn downward_api_pool_socket_and_address_env() {
        let f = full();
        let ds = build(&f, 0);
        let c = agent(&ds);
        let field = |n: &str| {
            env_value(c, n)
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.field_ref.as_ref())
                .map(|r| r.field_path.clone())
        };
        assert_eq!(field("NODE_NAME").as_deref(), Some("spec.nodeName"));
        assert_eq!(field("POD_IP").as_deref(), Some("status.podIP"));
        assert_eq!(field("KVFABRIC_LISTEN_IP").as_deref(), Some("status.podIP"));
        assert_eq!(val(c, "KVFABRIC_POOL").as_deref(), Some("prefill"));
        assert_eq!(val(c, "KVFABRIC_POOL_ROLE").as_deref(), Some("Prefill"));
        assert_eq!(
            val(c, "KVFABRIC_SOCKET_DIR").as_deref(),
            Some("/var/run/kvfabric")
        );
        assert_eq!(val(c, "KVFABRIC_SOCKET_GROUP").as_deref(), Some("2000"));
        assert_eq!(val(c, "KVFABRIC_SOCKET_MODE").as_deref(), Some("0660"));
        assert_eq!(
            val(c, "KVFABRIC_GRPC_ADDR").as_deref(),
            Some("0.0.0.0:50051")
        );
        assert_eq!(
            val(c, "KVFABRIC_DATA_ADDR").as_deref(),
            Some("0.0.0.0:50052")
        );
        assert_eq!(
            val(c, "KVFABRIC_METRICS_ADDR").as_deref(),
            Some("0.0.0.0:9090")
        );
        assert_eq!(val(c, "RUST_LOG").as_deref(), Some("debug"), "extra env");
        let env_from = c.env_from.as_ref().expect("envFrom");
        assert_eq!(
            env_from[0].config_map_ref.as_ref().map(|r| r.name.as_str()),
            Some("tf-config")
        );
        // Every name the operator sets is in the contract's reserved list.
        for v in c.env.as_ref().expect("env") {
            assert!(
                contract::env::RESERVED.contains(&v.name.as_str()) || v.name == "RUST_LOG",
                "{} is set but not in contract::env::RESERVED",
                v.name
            );
        }
    }

    #[test]
    fn etcd_secrets() {
        let f = full();
        let ds = build(&f, 0);
        let c = agent(&ds);
        let secret = |n: &str| {
            env_value(c, n)
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.secret_key_ref.as_ref())
                .map(|r| (r.name.clone(), r.key.clone()))
        };
        assert_eq!(
            secret("KVFABRIC_ETCD_USERNAME"),
            Some(("etcd-auth".into(), "username".into()))
        );
        assert_eq!(
            secret("KVFABRIC_ETCD_PASSWORD"),
            Some(("etcd-auth".into(), "password".into()))
        );
        let vols = pod(&ds).volumes.as_ref().expect("volumes");
        let tls = vols
            .iter()
            .find(|v| v.name == "etcd-tls")
            .expect("tls volume");
        assert_eq!(
            tls.secret.as_ref().and_then(|s| s.secret_name.as_deref()),
            Some("etcd-tls")
        );
        assert!(
            c.volume_mounts
                .as_ref()
                .expect("mounts")
                .iter()
                .any(|m| m.mount_path == contract::ETCD_TLS_MOUNT)
        );
        let min = minimal();
        let ds = build(&min, 0);
        assert!(env_value(agent(&ds), "KVFABRIC_ETCD_USERNAME").is_none());
        assert!(
            !pod(&ds)
                .volumes
                .as_ref()
                .expect("volumes")
                .iter()
                .any(|v| v.name == "etcd-tls")
        );
    }

    #[test]
    fn a_tls_secret_is_mounted_read_only_and_the_probes_move_to_the_metrics_port() {
        let mut f = full();
        f.spec.tls_secret = Some("kvfabric-agent-tls".into());
        let ds = build(&f, 0);
        let c = agent(&ds);
        assert_eq!(
            env_value(c, "KVFABRIC_TLS_DIR").and_then(|e| e.value.as_deref()),
            Some(contract::TLS_MOUNT)
        );
        let m = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "agent-tls")
            .expect("tls mount");
        assert_eq!(
            (m.mount_path.as_str(), m.read_only),
            (contract::TLS_MOUNT, Some(true))
        );
        let pod = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .unwrap();
        let v = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "agent-tls")
            .expect("tls volume");
        assert_eq!(
            v.secret.as_ref().and_then(|s| s.secret_name.as_deref()),
            Some("kvfabric-agent-tls")
        );
        let http = |p: &Option<Probe>| {
            let p = p.as_ref().expect("probe");
            assert!(p.grpc.is_none(), "a gRPC probe cannot pass mTLS");
            let get = p.http_get.clone().expect("http probe");
            assert_eq!(
                get.port,
                IntOrString::Int(contract::METRICS_PORT),
                "the default"
            );
            get.path.unwrap_or_default()
        };
        assert_eq!(http(&c.readiness_probe), "/healthz");
        assert_eq!(http(&c.liveness_probe), "/livez");
        assert_eq!(http(&c.startup_probe), "/livez");
        // Without the Secret: none of it.
        let plain = build(&full(), 0);
        let c = agent(&plain);
        assert!(env_value(c, "KVFABRIC_TLS_DIR").is_none());
        assert!(
            c.volume_mounts
                .iter()
                .flatten()
                .all(|m| m.name != "agent-tls")
        );
        assert!(c.readiness_probe.as_ref().unwrap().http_get.is_none());
    }

    #[test]
    fn peer_token_from_its_secret() {
        let token = |f: &TransferFabric| {
            let ds = build(f, 0);
            env_value(agent(&ds), "KVFABRIC_PEER_TOKEN")
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.secret_key_ref.as_ref())
                .map(|r| (r.name.clone(), r.key.clone()))
        };
        assert_eq!(
            token(&full()),
            Some(("kvfabric-peer-token".into(), "token".into()))
        );
        assert_eq!(token(&minimal()), None);
    }

    #[test]
    fn rdma_rails_as_limits_and_ipc_lock_as_root() {
        let f = full();
        let ds = build(&f, 0);
        let c = agent(&ds);
        let limits = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .expect("limits");
        assert_eq!(
            limits.get("nvidia.com/sriov_rdma_rail0"),
            Some(&Quantity("1".into()))
        );
        assert_eq!(
            limits.get("nvidia.com/sriov_rdma_rail1"),
            Some(&Quantity("1".into()))
        );
        assert_eq!(
            limits.get("memory"),
            Some(&Quantity("2Gi".into())),
            "user limits kept"
        );
        let requests = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .expect("requests");
        assert_eq!(requests.get("cpu"), Some(&Quantity("500m".into())));
        assert!(!limits.contains_key("nvidia.com/gpu"), "never takes a GPU");
        assert_eq!(
            annotations(&ds).get(MULTUS_ANNOTATION).map(String::as_str),
            Some("sriov-rail0,sriov-rail1")
        );
        let sc = c.security_context.as_ref().expect("sc");
        let caps = sc.capabilities.as_ref().expect("caps");
        assert_eq!(caps.add, Some(vec!["IPC_LOCK".to_owned()]));
        assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        let psc = pod(&ds).security_context.as_ref().expect("psc");
        assert_eq!(
            psc.run_as_user,
            Some(0),
            "IPC_LOCK is effective for uid 0 only"
        );
        assert_eq!(psc.run_as_non_root, Some(false));
    }

    #[test]
    fn every_container_has_requests_and_limits_unless_the_fabric_names_its_own() {
        // ResourceQuota namespaces refuse containers without them; BestEffort goes first.
        let ds = build(&minimal(), 0);
        let q = |m: &Option<BTreeMap<String, Quantity>>, k: &str| {
            m.as_ref().and_then(|m| m.get(k)).map(|q| q.0.clone())
        };
        let pod = pod(&ds);
        let init = &pod.init_containers.as_ref().expect("init")[0];
        for (c, requests, limits) in [
            (agent(&ds), AGENT_REQUESTS, AGENT_LIMITS),
            (init, INIT_REQUESTS, INIT_LIMITS),
        ] {
            let r = c.resources.as_ref().expect(&c.name);
            for (k, v) in requests {
                assert_eq!(q(&r.requests, k).as_deref(), Some(v), "{} {k}", c.name);
            }
            for (k, v) in limits {
                assert_eq!(q(&r.limits, k).as_deref(), Some(v), "{} {k}", c.name);
            }
        }
        // The fabric's own resources replace the defaults whole; RDMA devices are added.
        let f = full();
        let c = agent(&build(&f, 0)).clone();
        let r = c.resources.expect("resources");
        assert_eq!(
            r.requests,
            f.spec.agent.resources.as_ref().unwrap().requests,
            "the fabric's requests as written"
        );
    }

    #[test]
    fn without_rdma_the_agent_is_non_root_with_no_capability() {
        let ds = build(&minimal(), 0);
        let c = agent(&ds);
        let res = c.resources.as_ref().expect("default resources");
        assert!(res.claims.is_none() && res.limits.as_ref().is_some_and(|l| l.len() == 2));
        let sc = c.security_context.as_ref().expect("sc");
        let caps = sc.capabilities.as_ref().expect("caps");
        assert_eq!(caps.add, None);
        assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        let psc = pod(&ds).security_context.as_ref().expect("psc");
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(psc.run_as_user, Some(65532));
        assert_eq!(psc.run_as_group, Some(65532));
        assert_eq!(psc.supplemental_groups, Some(vec![65532]));
        assert_eq!(
            psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
            Some("RuntimeDefault")
        );
        assert!(!annotations(&ds).contains_key(MULTUS_ANNOTATION));
    }

    #[test]
    fn socket_directory_is_per_fabric_and_pool_and_owned_by_the_agent() {
        let f = full();
        let prefill = build(&f, 0);
        let decode = build(&f, 1);
        let host = |ds: &DaemonSet| {
            pod(ds)
                .volumes
                .as_ref()
                .and_then(|v| v.iter().find(|v| v.name == "socket-dir"))
                .and_then(|v| v.host_path.clone())
                .expect("hostPath")
        };
        assert_eq!(host(&prefill).path, "/var/run/kvfabric/llm/tf/prefill");
        assert_eq!(host(&decode).path, "/var/run/kvfabric/llm/tf/decode");
        assert_eq!(host(&prefill).type_.as_deref(), Some("DirectoryOrCreate"));
        let mut other = full();
        other.metadata.namespace = Some("team-b".into());
        assert_eq!(
            host(&build(&other, 0)).path,
            "/var/run/kvfabric/team-b/tf/prefill"
        );

        let prep = init(&prefill);
        assert_eq!(
            prep.command.as_deref(),
            Some(&["/usr/local/bin/kvfabric-socket-dir".to_owned()][..])
        );
        // RDMA fabric: the agent runs as root, the socket group comes from the spec.
        assert_eq!(
            prep.args.as_deref().expect("args").join(" "),
            "--dir /var/run/kvfabric --uid 0 --gid 2000 --mode 2750"
        );
        let sc = prep.security_context.as_ref().expect("sc");
        assert_eq!(sc.run_as_user, Some(0));
        let caps = sc.capabilities.as_ref().expect("caps");
        assert_eq!(
            caps.add,
            Some(vec!["CHOWN".to_owned(), "FOWNER".to_owned()])
        );
        assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));

        let mut min = minimal();
        min.spec.agent.sockets.mode = SocketMode::Owner;
        let ds = build(&min, 0);
        assert_eq!(
            init(&ds).args.as_deref().expect("args").join(" "),
            "--dir /var/run/kvfabric --uid 65532 --gid 65532 --mode 700"
        );
        assert_eq!(
            val(agent(&ds), "KVFABRIC_SOCKET_MODE").as_deref(),
            Some("0600")
        );
    }

    #[test]
    fn probes_use_grpc_health() {
        let ds = build(&full(), 0);
        let c = agent(&ds);
        let grpc = |p: &Option<Probe>| p.as_ref().and_then(|p| p.grpc.clone()).expect("grpc probe");
        let ready = grpc(&c.readiness_probe);
        assert_eq!(ready.port, 50051);
        assert_eq!(ready.service.as_deref(), Some("kvfabric.v1.PeerAgent"));
        let live = grpc(&c.liveness_probe);
        assert_eq!(live.service, None, "liveness asks the server as a whole");
        assert!(grpc(&c.startup_probe).service.is_none());
        assert!(
            c.readiness_probe
                .as_ref()
                .and_then(|p| p.tcp_socket.as_ref())
                .is_none()
        );
        let ports: Vec<_> = c
            .ports
            .as_ref()
            .expect("ports")
            .iter()
            .map(|p| (p.name.clone().unwrap_or_default(), p.container_port))
            .collect();
        assert_eq!(
            ports,
            vec![
                ("grpc".to_owned(), 50051),
                ("data".to_owned(), 50052),
                ("metrics".to_owned(), 9090)
            ]
        );
    }

    #[test]
    fn config_hash_is_in_the_pod_template() {
        let f = full();
        let a = desired_daemonset(&f, &f.spec.pools[0], &settings(), "aaa").expect("builds");
        let b = desired_daemonset(&f, &f.spec.pools[0], &settings(), "bbb").expect("builds");
        assert_eq!(annotations(&a)[CONFIG_HASH_ANNOTATION], "aaa");
        assert_ne!(
            a.spec.as_ref().map(|s| &s.template),
            b.spec.as_ref().map(|s| &s.template),
            "a new ConfigMap hash changes the template, so the DaemonSet rolls"
        );
    }

    #[test]
    fn gpu_access_without_a_gpu_request_or_runtime_class() {
        // Cdi mode (the default): the NRI plugin's annotation names the management device;
        // no NVIDIA_VISIBLE_DEVICES, which the NVIDIA runtime's hook would inject again.
        let f = full();
        let ds = build(&f, 0);
        assert_eq!(
            pod(&ds).runtime_class_name,
            None,
            "no RuntimeClass by default"
        );
        assert_eq!(
            annotations(&ds)
                .get("nvidia.cdi.k8s.io/container.agent")
                .map(String::as_str),
            Some("management.nvidia.com/gpu=all")
        );
        assert_eq!(
            agent(&ds).name,
            "agent",
            "the annotation names this container"
        );
        let c = agent(&ds);
        assert!(env_value(c, "NVIDIA_VISIBLE_DEVICES").is_none());
        assert!(env_value(c, "NVIDIA_DRIVER_CAPABILITIES").is_none());
        assert_eq!(
            val(c, "CUDA_CACHE_PATH").as_deref(),
            Some("/tmp/cuda-cache")
        );
        assert!(
            c.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.mount_path == "/tmp" && m.name == "tmp"),
            "the JIT cache needs a writable /tmp on a read-only root"
        );
        let mut two = full();
        two.spec.agent.gpu.cdi_devices = vec!["nvidia.com/gpu=0".into(), "nvidia.com/gpu=1".into()];
        assert_eq!(
            annotations(&build(&two, 0))
                .get(CDI_ANNOTATION)
                .map(String::as_str),
            Some("nvidia.com/gpu=0,nvidia.com/gpu=1")
        );

        // Env mode (the legacy runtime): the variable, no annotation, a RuntimeClass if set.
        let mut env = full();
        env.spec.agent.gpu.mode = GpuMode::Env;
        env.spec.agent.gpu.runtime_class_name = Some("nvidia".into());
        let ds = build(&env, 0);
        let c = agent(&ds);
        assert_eq!(val(c, "NVIDIA_VISIBLE_DEVICES").as_deref(), Some("all"));
        assert_eq!(
            val(c, "NVIDIA_DRIVER_CAPABILITIES").as_deref(),
            Some("compute,utility")
        );
        assert!(!annotations(&ds).contains_key(CDI_ANNOTATION));
        assert_eq!(pod(&ds).runtime_class_name.as_deref(), Some("nvidia"));

        // Claim mode (DRA admin access): the claim brings the GPUs; neither.
        let mut claim = full();
        claim.spec.agent.gpu.mode = GpuMode::Claim;
        let ds = build(&claim, 0);
        assert!(env_value(agent(&ds), "NVIDIA_VISIBLE_DEVICES").is_none());
        assert!(!annotations(&ds).contains_key(CDI_ANNOTATION));

        // GPU access off: neither.
        let min = minimal();
        let ds = build(&min, 0);
        assert!(pod(&ds).runtime_class_name.is_none());
        assert!(env_value(agent(&ds), "NVIDIA_VISIBLE_DEVICES").is_none());
        assert!(!annotations(&ds).contains_key(CDI_ANNOTATION));
    }

    #[test]
    fn gpu_agents_leave_a_node_while_the_gpu_operator_changes_its_driver_or_mig_layout() {
        let terms = |f: &TransferFabric, pool: usize| -> Vec<Vec<(String, String)>> {
            pod(&build(f, pool))
                .affinity
                .as_ref()
                .and_then(|a| a.node_affinity.as_ref())
                .and_then(|n| {
                    n.required_during_scheduling_ignored_during_execution
                        .as_ref()
                })
                .map(|r| {
                    r.node_selector_terms
                        .iter()
                        .map(|t| {
                            t.match_expressions
                                .iter()
                                .flatten()
                                .map(|e| {
                                    let v = e.values.clone().unwrap_or_default().join(",");
                                    (e.key.clone(), format!("{} {v}", e.operator))
                                })
                                .collect()
                        })
                        .collect()
                })
                .unwrap_or_default()
        };
        let client = |op: &str| (GPU_CLIENT_LABEL.to_owned(), op.to_owned());
        let present = ("nvidia.com/gpu.present".to_owned(), "In true".to_owned());
        let f = full();
        // The pool's term, ANDed with each way the label allows the agent; the terms ORed.
        assert_eq!(
            terms(&f, 0),
            vec![
                vec![present.clone(), client("In true")],
                vec![present, client("DoesNotExist ")],
            ]
        );
        // A pool without affinity of its own: the label alone.
        assert_eq!(
            terms(&f, 1),
            vec![vec![client("In true")], vec![client("DoesNotExist ")]]
        );
        // Without GPU access, nothing to release: no affinity added.
        assert!(pod(&build(&minimal(), 0)).affinity.is_none());
    }

    #[test]
    fn resource_claims_are_wired_into_pod_and_container() {
        let f = full();
        let ds = build(&f, 0);
        let claims = pod(&ds).resource_claims.as_ref().expect("pod claims");
        assert_eq!(
            claims,
            &vec![PodResourceClaim {
                name: "gpus".into(),
                resource_claim_template_name: Some("all-gpus-admin".into()),
                resource_claim_name: None,
            }]
        );
        let container: Vec<_> = agent(&ds)
            .resources
            .as_ref()
            .and_then(|r| r.claims.as_ref())
            .expect("container claims")
            .iter()
            .map(|c| c.name.clone())
            .collect();
        assert_eq!(container, vec!["gpus"]);
        assert!(pod(&build(&minimal(), 0)).resource_claims.is_none());
    }

    fn with_volume(kind: SocketVolume) -> AgentSettings {
        AgentSettings {
            socket_volume: kind,
            ..settings()
        }
    }

    #[test]
    fn csi_socket_volume_names_fabric_and_pool_and_no_host_path() {
        let f = minimal();
        let ds = desired_daemonset(&f, &f.spec.pools[0], &with_volume(SocketVolume::Csi), "h")
            .expect("builds");
        let volumes = pod(&ds).volumes.as_ref().expect("volumes");
        let v = volumes
            .iter()
            .find(|v| v.name == "socket-dir")
            .expect("socket-dir");
        let csi = v.csi.as_ref().expect("a csi volume");
        assert_eq!(csi.driver, "csi.kvfabric.io");
        assert_eq!(
            csi.read_only,
            Some(false),
            "the agent binds its sockets there"
        );
        let attrs = csi.volume_attributes.as_ref().expect("attributes");
        assert_eq!(attrs.get("fabric").map(String::as_str), Some(NAME));
        assert_eq!(
            attrs.get("pool").map(String::as_str),
            Some(f.spec.pools[0].name.as_str())
        );
        assert!(volumes.iter().all(|v| v.host_path.is_none()));
        // The same mount point as with a hostPath: the agent and its init container see no change.
        assert!(
            agent(&ds)
                .volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == "socket-dir" && m.mount_path == contract::socket::DEFAULT_DIR)
        );
    }

    /// docs/operator.md's Pod Security table, row by row.
    #[test]
    fn pod_security_levels_are_those_the_docs_give() {
        use crate::pod_security::{Level, violations};
        let f = minimal();
        let host = desired_daemonset(
            &f,
            &f.spec.pools[0],
            &with_volume(SocketVolume::HostPath),
            "h",
        )
        .expect("builds");
        assert_eq!(
            violations(Level::Baseline, pod(&host)),
            ["hostPath volume \"socket-dir\""]
        );
        // tcp, shm and CUDA IPC agents with the CSI volume: baseline (the init container runs
        // as root with CHOWN and FOWNER, which baseline allows and restricted does not).
        let csi = desired_daemonset(&f, &f.spec.pools[0], &with_volume(SocketVolume::Csi), "h")
            .expect("builds");
        assert_eq!(violations(Level::Baseline, pod(&csi)), Vec::<String>::new());
        assert!(!violations(Level::Restricted, pod(&csi)).is_empty());
        let mut gpu = minimal();
        gpu.spec.agent.gpu.enabled = true;
        let ds = desired_daemonset(
            &gpu,
            &gpu.spec.pools[0],
            &with_volume(SocketVolume::Csi),
            "h",
        )
        .expect("builds");
        assert_eq!(violations(Level::Baseline, pod(&ds)), Vec::<String>::new());
        // RDMA (IPC_LOCK as uid 0) and the host network stay privileged, whatever the volume.
        let rdma = full();
        assert!(rdma.spec.agent.rdma.is_some());
        let ds = desired_daemonset(
            &rdma,
            &rdma.spec.pools[0],
            &with_volume(SocketVolume::Csi),
            "h",
        )
        .expect("builds");
        let v = violations(Level::Baseline, pod(&ds));
        assert!(v.iter().any(|x| x.contains("IPC_LOCK")), "{v:?}");
        let mut hn = minimal();
        hn.spec.agent.host_network = true;
        let ds = desired_daemonset(&hn, &hn.spec.pools[0], &with_volume(SocketVolume::Csi), "h")
            .expect("builds");
        assert_eq!(violations(Level::Baseline, pod(&ds)), ["hostNetwork: true"]);
    }

    #[test]
    fn no_host_ipc_and_no_shm_volume() {
        let ds = build(&full(), 0);
        assert_eq!(pod(&ds).host_ipc, None);
        let vols: Vec<_> = pod(&ds)
            .volumes
            .as_ref()
            .expect("volumes")
            .iter()
            .map(|v| v.name.clone())
            .collect();
        assert_eq!(vols, vec!["socket-dir", "tmp", "etcd-tls"]);
        for v in pod(&ds).volumes.iter().flatten() {
            if let Some(hp) = &v.host_path {
                assert!(hp.path.starts_with("/var/run/kvfabric/"), "{}", hp.path);
            }
        }
    }

    #[test]
    fn scheduling_and_priority() {
        let mut f = full();
        // The pool's own affinity as written (GPU access adds to it: the next test).
        f.spec.agent.gpu.enabled = false;
        let ds = build(&f, 0);
        let p = pod(&ds);
        assert_eq!(
            p.node_selector
                .as_ref()
                .and_then(|n| n.get("kvfabric.io/role"))
                .map(String::as_str),
            Some("prefill")
        );
        assert_eq!(
            p.tolerations.as_ref().map(|t| t[0].key.as_deref()),
            Some(Some("nvidia.com/gpu"))
        );
        assert_eq!(p.affinity, f.spec.pools[0].affinity);
        assert_eq!(
            p.priority_class_name.as_deref(),
            Some("system-node-critical")
        );
        assert_eq!(p.service_account_name.as_deref(), Some("tf-agent"));
        assert_eq!(p.host_network, None);
        let ds = build(&f, 1);
        assert_eq!(ds.metadata.name.as_deref(), Some("tf-decode-agent"));
        assert!(pod(&ds).node_selector.is_none());
        assert!(pod(&ds).tolerations.is_none());
        assert!(pod(&ds).affinity.is_none());
        // The cluster's tolerations for every agent come after the pool's, once each.
        let gpu_taint = Toleration {
            key: Some("nvidia.com/gpu".into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        };
        let dedicated = Toleration {
            key: Some("dedicated".into()),
            value: Some("llm".into()),
            ..Toleration::default()
        };
        let settings = AgentSettings {
            tolerations: vec![gpu_taint.clone(), dedicated.clone()],
            ..AgentSettings::default()
        };
        let with = |f: &TransferFabric, pool: usize| {
            desired_daemonset(f, &f.spec.pools[pool], &settings, "h")
                .expect("builds")
                .spec
                .and_then(|s| s.template.spec)
                .and_then(|p| p.tolerations)
                .unwrap_or_default()
        };
        assert_eq!(with(&f, 0), vec![gpu_taint.clone(), dedicated.clone()]);
        assert_eq!(with(&f, 1), vec![gpu_taint, dedicated]);
        // Without a class of its own: the node agents' default; one node at a time.
        let min = build(&minimal(), 0);
        assert_eq!(
            pod(&min).priority_class_name.as_deref(),
            Some(DEFAULT_PRIORITY_CLASS)
        );
        let mut own = minimal();
        own.spec.agent.priority_class_name = Some("kvfabric".into());
        own.spec.agent.max_unavailable = Some(IntOrString::String("10%".into()));
        let own = build(&own, 0);
        assert_eq!(pod(&own).priority_class_name.as_deref(), Some("kvfabric"));
        let unavailable = |ds: &DaemonSet| {
            ds.spec
                .as_ref()
                .and_then(|s| s.update_strategy.as_ref())
                .and_then(|u| u.rolling_update.as_ref())
                .and_then(|r| r.max_unavailable.clone())
        };
        assert_eq!(unavailable(&min), Some(IntOrString::Int(1)));
        assert_eq!(unavailable(&own), Some(IntOrString::String("10%".into())));
    }

    #[test]
    fn host_network_keeps_cluster_dns() {
        let mut f = minimal();
        f.spec.agent.host_network = true;
        f.spec.agent.rdma = Some(RdmaSpec {
            resources: vec![RdmaResource {
                resource_name: "rdma/rdma_shared_device_a".into(),
                count: 1,
            }],
        });
        let ds = build(&f, 0);
        assert_eq!(pod(&ds).host_network, Some(true));
        assert_eq!(
            pod(&ds).dns_policy.as_deref(),
            Some("ClusterFirstWithHostNet")
        );
    }
}
