//! One agent DaemonSet per pool.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapEnvSource, ConfigMapVolumeSource, Container, ContainerPort,
    EmptyDirVolumeSource, EnvFromSource, EnvVar, EnvVarSource, HostPathVolumeSource,
    ObjectFieldSelector, PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SecretKeySelector,
    SecretVolumeSource, SecurityContext, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvfabric_crds::{Pool, ShmMedium, TransferFabric};

use crate::Result;
use crate::meta::{
    AGENT_METRICS_PORT, GRPC_PORT, POOL_LABEL, child_meta, configmap_name, daemonset_name,
    fabric_labels, name_and_namespace, pool_selector, service_account_name,
};

/// Pod annotation Multus reads to attach secondary (e.g. SR-IOV) networks.
pub const MULTUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";
/// Where the fabric ConfigMap is mounted in the agent.
pub const CONFIG_MOUNT: &str = "/etc/kvfabric/config";
/// Where the etcd TLS secret is mounted in the agent.
pub const ETCD_TLS_MOUNT: &str = "/etc/kvfabric/etcd-tls";
/// Name of the agent container.
pub const AGENT_CONTAINER: &str = "agent";

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

fn env(fabric: &TransferFabric, pool: &Pool) -> Vec<EnvVar> {
    let agent = &fabric.spec.agent;
    let mut env = vec![
        field_env("NODE_NAME", "spec.nodeName"),
        field_env("POD_IP", "status.podIP"),
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        value_env("KVFABRIC_POOL", &pool.name),
        value_env("KVFABRIC_POOL_ROLE", pool.role.as_str()),
        value_env("KVFABRIC_SOCKET_DIR", &agent.socket_dir),
        value_env("KVFABRIC_CONFIG_DIR", CONFIG_MOUNT),
    ];
    if agent.gpu.enabled {
        env.push(value_env(
            "NVIDIA_VISIBLE_DEVICES",
            &agent.gpu.visible_devices,
        ));
    }
    if let Some(secret) = &fabric.spec.etcd.auth_secret {
        env.push(secret_env("KVFABRIC_ETCD_USERNAME", secret, "username"));
        env.push(secret_env("KVFABRIC_ETCD_PASSWORD", secret, "password"));
    }
    if fabric.spec.etcd.tls_secret.is_some() {
        env.push(value_env("KVFABRIC_ETCD_TLS_DIR", ETCD_TLS_MOUNT));
    }
    if let Some(secret) = &fabric.spec.peer_token_secret {
        env.push(secret_env("KVFABRIC_PEER_TOKEN", secret, "token"));
    }
    // The user's env wins over ours: server-side apply rejects duplicate names in a list map.
    env.retain(|e| !agent.env.iter().any(|u| u.name == e.name));
    env.extend(agent.env.iter().cloned());
    env
}

fn resources(fabric: &TransferFabric) -> Option<ResourceRequirements> {
    let agent = &fabric.spec.agent;
    let mut res = agent.resources.clone();
    if let Some(rdma) = &agent.rdma {
        // Extended resources are limit-only: the scheduler sets the request equal to the limit.
        let r = res.get_or_insert_with(ResourceRequirements::default);
        r.limits
            .get_or_insert_with(BTreeMap::new)
            .insert(rdma.resource_name.clone(), Quantity(rdma.count.to_string()));
    }
    res
}

fn volumes_and_mounts(fabric: &TransferFabric, name: &str) -> (Vec<Volume>, Vec<VolumeMount>) {
    let agent = &fabric.spec.agent;
    let shm = match agent.shm.medium {
        ShmMedium::Memory => Volume {
            name: "shm".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".to_owned()),
                size_limit: Some(Quantity(agent.shm.size_limit.clone())),
            }),
            ..Volume::default()
        },
        ShmMedium::HostPath => Volume {
            name: "shm".to_owned(),
            host_path: Some(HostPathVolumeSource {
                path: agent.shm.host_path.clone(),
                type_: Some("Directory".to_owned()),
            }),
            ..Volume::default()
        },
    };
    let mut volumes = vec![
        Volume {
            name: "socket-dir".to_owned(),
            host_path: Some(HostPathVolumeSource {
                path: agent.socket_dir.clone(),
                type_: Some("DirectoryOrCreate".to_owned()),
            }),
            ..Volume::default()
        },
        shm,
        Volume {
            name: "config".to_owned(),
            config_map: Some(ConfigMapVolumeSource {
                name: configmap_name(name),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
    ];
    let mount = |volume: &str, path: &str, read_only: bool| VolumeMount {
        name: volume.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    };
    let mut mounts = vec![
        mount("socket-dir", &agent.socket_dir, false),
        mount("shm", "/dev/shm", false),
        mount("config", CONFIG_MOUNT, true),
    ];
    if let Some(secret) = &fabric.spec.etcd.tls_secret {
        volumes.push(Volume {
            name: "etcd-tls".to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.clone()),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(mount("etcd-tls", ETCD_TLS_MOUNT, true));
    }
    (volumes, mounts)
}

/// The desired DaemonSet `<fabric>-<pool>-agent`.
pub fn desired_daemonset(fabric: &TransferFabric, pool: &Pool) -> Result<DaemonSet> {
    let (name, _) = name_and_namespace(fabric)?;
    let agent = &fabric.spec.agent;
    let selector = pool_selector(&name, &pool.name);
    let mut labels = fabric_labels(&name);
    labels.insert(POOL_LABEL.to_owned(), pool.name.clone());

    let annotations = (!agent.networks.is_empty())
        .then(|| BTreeMap::from([(MULTUS_ANNOTATION.to_owned(), agent.networks.join(","))]));
    let (volumes, volume_mounts) = volumes_and_mounts(fabric, &name);

    let container = Container {
        name: AGENT_CONTAINER.to_owned(),
        image: Some(agent.image.clone()),
        image_pull_policy: agent.image_pull_policy.map(|p| p.as_str().to_owned()),
        args: Some(vec!["agent".to_owned()]),
        env: Some(env(fabric, pool)),
        env_from: Some(vec![EnvFromSource {
            config_map_ref: Some(ConfigMapEnvSource {
                name: configmap_name(&name),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        }]),
        ports: Some(vec![
            ContainerPort {
                name: Some("grpc".to_owned()),
                container_port: GRPC_PORT,
                protocol: Some("TCP".to_owned()),
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("metrics".to_owned()),
                container_port: AGENT_METRICS_PORT,
                protocol: Some("TCP".to_owned()),
                ..ContainerPort::default()
            },
        ]),
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction {
                port: IntOrString::String("grpc".to_owned()),
                ..TCPSocketAction::default()
            }),
            period_seconds: Some(10),
            ..Probe::default()
        }),
        resources: resources(fabric),
        security_context: Some(SecurityContext {
            // Pinning (registering) transfer buffers for RDMA and CUDA needs mlock beyond the
            // default RLIMIT_MEMLOCK.
            capabilities: Some(Capabilities {
                add: Some(vec!["IPC_LOCK".to_owned()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(volume_mounts),
        ..Container::default()
    };

    let pod = PodSpec {
        service_account_name: Some(service_account_name(&name)),
        automount_service_account_token: Some(false),
        host_network: agent.host_network.then_some(true),
        // Keeps cluster DNS (etcd's service name) resolvable when on the host network.
        dns_policy: agent
            .host_network
            .then(|| "ClusterFirstWithHostNet".to_owned()),
        host_ipc: agent.host_ipc.then_some(true),
        priority_class_name: agent.priority_class_name.clone(),
        runtime_class_name: agent
            .gpu
            .enabled
            .then(|| agent.gpu.runtime_class_name.clone()),
        node_selector: (!pool.node_selector.is_empty()).then(|| pool.node_selector.clone()),
        tolerations: (!pool.tolerations.is_empty()).then(|| pool.tolerations.clone()),
        affinity: pool.affinity.clone(),
        containers: vec![container],
        volumes: Some(volumes),
        ..PodSpec::default()
    };

    Ok(DaemonSet {
        metadata: child_meta(fabric, daemonset_name(&name, &pool.name), labels.clone())?,
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations,
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
    use crate::fixtures::{NAME, NS, UID, full, minimal};
    use kvfabric_crds::ShmMedium;

    fn build(f: &TransferFabric, pool: usize) -> DaemonSet {
        desired_daemonset(f, &f.spec.pools[pool]).expect("builds")
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

    fn env_value<'a>(c: &'a Container, name: &str) -> Option<&'a EnvVar> {
        c.env.as_ref()?.iter().find(|e| e.name == name)
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
    fn downward_api_config_and_pool_env() {
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
        let val = |n: &str| env_value(c, n).and_then(|e| e.value.clone());
        assert_eq!(val("KVFABRIC_POOL").as_deref(), Some("prefill"));
        assert_eq!(val("KVFABRIC_POOL_ROLE").as_deref(), Some("Prefill"));
        assert_eq!(
            val("KVFABRIC_SOCKET_DIR").as_deref(),
            Some("/var/run/kvfabric")
        );
        assert_eq!(val("RUST_LOG").as_deref(), Some("debug"), "extra env");
        let env_from = c.env_from.as_ref().expect("envFrom");
        assert_eq!(
            env_from[0].config_map_ref.as_ref().map(|r| r.name.as_str()),
            Some("tf-config")
        );
        let mounts = c.volume_mounts.as_ref().expect("mounts");
        assert!(
            mounts
                .iter()
                .any(|m| m.name == "config" && m.mount_path == CONFIG_MOUNT)
        );
        let vols = pod(&ds).volumes.as_ref().expect("volumes");
        let cfg = vols
            .iter()
            .find(|v| v.name == "config")
            .expect("config volume");
        assert_eq!(
            cfg.config_map.as_ref().map(|c| c.name.as_str()),
            Some("tf-config")
        );
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
                .any(|m| m.mount_path == ETCD_TLS_MOUNT)
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
    fn rdma_networks_and_capabilities() {
        let f = full();
        let ds = build(&f, 0);
        let c = agent(&ds);
        let limits = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .expect("limits");
        assert_eq!(
            limits.get("rdma/hca_shared_devices_a"),
            Some(&Quantity("2".into()))
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
        assert!(
            !requests.contains_key("nvidia.com/gpu"),
            "never takes a GPU"
        );
        let ann = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .expect("annotations");
        assert_eq!(
            ann.get(MULTUS_ANNOTATION).map(String::as_str),
            Some("sriov-net-a,sriov-net-b")
        );
        let caps = c
            .security_context
            .as_ref()
            .and_then(|s| s.capabilities.as_ref())
            .and_then(|c| c.add.as_ref())
            .expect("caps");
        assert_eq!(caps, &vec!["IPC_LOCK".to_owned()]);

        let min = minimal();
        let ds = build(&min, 0);
        assert!(agent(&ds).resources.is_none(), "no rdma, no resources");
        assert!(
            ds.spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .is_none()
        );
    }

    #[test]
    fn gpu_access_without_a_gpu_request() {
        let f = full();
        let ds = build(&f, 0);
        assert_eq!(pod(&ds).runtime_class_name.as_deref(), Some("nvidia"));
        assert_eq!(
            env_value(agent(&ds), "NVIDIA_VISIBLE_DEVICES").and_then(|e| e.value.as_deref()),
            Some("all")
        );
        let min = minimal();
        let ds = build(&min, 0);
        assert!(pod(&ds).runtime_class_name.is_none());
        assert!(env_value(agent(&ds), "NVIDIA_VISIBLE_DEVICES").is_none());
    }

    #[test]
    fn shm_socket_and_host_namespaces() {
        let mut f = full();
        let ds = build(&f, 0);
        let p = pod(&ds);
        assert_eq!(p.host_network, Some(true));
        assert_eq!(p.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
        assert_eq!(p.host_ipc, Some(true));
        let vols = p.volumes.as_ref().expect("volumes");
        let shm = vols.iter().find(|v| v.name == "shm").expect("shm");
        let ed = shm.empty_dir.as_ref().expect("emptyDir");
        assert_eq!(ed.medium.as_deref(), Some("Memory"));
        assert_eq!(ed.size_limit, Some(Quantity("8Gi".into())));
        let sock = vols
            .iter()
            .find(|v| v.name == "socket-dir")
            .expect("socket");
        let hp = sock.host_path.as_ref().expect("hostPath");
        assert_eq!(hp.path, "/var/run/kvfabric");
        assert_eq!(hp.type_.as_deref(), Some("DirectoryOrCreate"));
        let mounts = agent(&ds).volume_mounts.as_ref().expect("mounts");
        assert!(
            mounts
                .iter()
                .any(|m| m.name == "shm" && m.mount_path == "/dev/shm")
        );
        assert!(
            mounts
                .iter()
                .any(|m| m.name == "socket-dir" && m.mount_path == "/var/run/kvfabric")
        );

        f.spec.agent.shm.medium = ShmMedium::HostPath;
        f.spec.agent.shm.host_path = "/run/kvfabric-shm".into();
        let ds = build(&f, 0);
        let vols = pod(&ds).volumes.as_ref().expect("volumes");
        let shm = vols.iter().find(|v| v.name == "shm").expect("shm");
        assert_eq!(
            shm.host_path.as_ref().map(|h| h.path.as_str()),
            Some("/run/kvfabric-shm")
        );

        let min = minimal();
        let ds = build(&min, 0);
        assert_eq!(pod(&ds).host_network, None);
        assert_eq!(pod(&ds).host_ipc, None);
        assert_eq!(pod(&ds).dns_policy, None);
    }

    #[test]
    fn scheduling_image_and_priority() {
        let f = full();
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
        let c = agent(&ds);
        assert_eq!(
            c.image.as_deref(),
            Some("ghcr.io/example/kvfabric-agent:0.1.0")
        );
        assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"));
        let ports: Vec<_> = c
            .ports
            .as_ref()
            .expect("ports")
            .iter()
            .map(|p| p.container_port)
            .collect();
        assert_eq!(ports, vec![50051, 9090]);

        // The second pool has no scheduling constraints.
        let ds = build(&f, 1);
        assert_eq!(ds.metadata.name.as_deref(), Some("tf-decode-agent"));
        assert!(pod(&ds).node_selector.is_none());
        assert!(pod(&ds).tolerations.is_none());
        assert!(pod(&ds).affinity.is_none());
    }

    #[test]
    fn user_env_overrides_ours_without_duplicates() {
        let mut f = full();
        f.spec.agent.env.push(EnvVar {
            name: "KVFABRIC_SOCKET_DIR".into(),
            value: Some("/custom".into()),
            ..EnvVar::default()
        });
        let ds = build(&f, 0);
        let env = agent(&ds).env.as_ref().expect("env");
        let hits: Vec<_> = env
            .iter()
            .filter(|e| e.name == "KVFABRIC_SOCKET_DIR")
            .collect();
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].value.as_deref(), Some("/custom"));
    }
}
