//! Strict checks of the Helm chart's rendered manifests and of the example TransferFabric.
//!
//! k8s-openapi types ignore unknown fields when deserializing, so a typo such as `readinesProbe`
//! would pass a plain parse. Each document is therefore parsed into its typed struct, serialized
//! back, and compared with the original: a key of the original that did not survive the round
//! trip is an unknown field, and the test fails naming its path.
//!
//! The rendered output comes from `scripts/helm-check.sh` (which sets `KVFABRIC_RENDERED_DIR` and
//! runs this test after validating the same files against the Kubernetes 1.29 and 1.35
//! schemas); without it the chart checks record a skip (`kvfabric_testkit::skip`; a failure in CI). The files hold the chart
//! (`default.yaml`, `all-features.yaml`) and the operator's own objects for the example and the
//! all-features fabrics (`objects-*.yaml`, from `kvfabric-operator render`).

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::api::storage::v1::CSIDriver;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kvfabric_crds::TransferFabric;
use kvfabric_operator::pod_security::{Level, violations};
use kvfabric_testkit::skip::{Why, skip};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.values().all(is_empty),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

fn scalar_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// Every path of `orig` that is missing from (or differs in) `back`.
fn lost(orig: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    match (orig, back) {
        (Value::Object(o), Value::Object(b)) => {
            for (k, v) in o {
                if is_empty(v) {
                    continue;
                }
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(bv) => lost(v, bv, &p, out),
                    None => out.push(format!("{p} (unknown field)")),
                }
            }
        }
        (Value::Array(o), Value::Array(b)) => {
            if o.len() != b.len() {
                out.push(format!("{path} (length {} became {})", o.len(), b.len()));
                return;
            }
            for (i, (ov, bv)) in o.iter().zip(b).enumerate() {
                lost(ov, bv, &format!("{path}[{i}]"), out);
            }
        }
        (o, b) if is_empty(o) && is_empty(b) => {}
        (o, b) => {
            if !scalar_eq(o, b) {
                out.push(format!("{path} ({o} became {b})"));
            }
        }
    }
}

fn try_strict<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<T, String> {
    let typed: T =
        serde_json::from_value(doc.clone()).map_err(|e| format!("does not parse: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("does not serialize: {e}"))?;
    let mut out = Vec::new();
    lost(doc, &back, "", &mut out);
    if out.is_empty() {
        Ok(typed)
    } else {
        Err(format!("fields the typed struct does not know: {out:#?}"))
    }
}

fn strict<T: DeserializeOwned + Serialize>(doc: &Value, what: &str) -> T {
    try_strict(doc).unwrap_or_else(|e| panic!("{what}: {e}"))
}

// The ServiceMonitor fields this chart uses, and nothing else.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    namespace_selector: NamespaceSelector,
    endpoints: Vec<Endpoint>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NamespaceSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    match_names: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    any: Option<bool>,
}

// The PodMonitor fields this chart uses, and nothing else.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMonitor {
    api_version: String,
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: PodMonitorSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMonitorSpec {
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    namespace_selector: NamespaceSelector,
    pod_metrics_endpoints: Vec<Endpoint>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Endpoint {
    port: String,
    path: String,
    interval: String,
    scrape_timeout: String,
}

fn documents(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| {
            Value::deserialize(d).unwrap_or_else(|e| panic!("{}: bad YAML: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// Parses one document strictly into the type of its kind; returns the kind.
fn check(doc: &Value, file: &str) -> String {
    let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
    let name = doc["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let what = format!("{file}: {kind} {name}");
    match kind.as_str() {
        "Deployment" => {
            let d: Deployment = strict(doc, &what);
            let pod = pod_spec_of(
                d.spec.as_ref().and_then(|s| s.template.spec.as_ref()),
                &what,
            );
            if pod.containers[0].name == "operator" {
                check_deployment(&d, &what);
            } else {
                check_worker(pod, &what);
            }
        }
        "DaemonSet" => {
            let d: DaemonSet = strict(doc, &what);
            if name.ends_with("-csi") {
                check_csi_daemonset(&d, &what);
            } else {
                check_agent_daemonset(&d, &what);
            }
        }
        "CSIDriver" => {
            let d: CSIDriver = strict(doc, &what);
            assert_eq!(
                d.metadata.name.as_deref(),
                Some(kvfabric_proto::contract::csi::DRIVER)
            );
            // Inline volumes only, nothing to attach, and the pod's namespace told to the driver
            // (its only way to keep pods to their own namespace's fabrics).
            assert_eq!(d.spec.attach_required, Some(false), "{what}");
            assert_eq!(d.spec.pod_info_on_mount, Some(true), "{what}");
            assert_eq!(d.spec.fs_group_policy.as_deref(), Some("None"), "{what}");
            assert_eq!(
                d.spec.volume_lifecycle_modes,
                Some(vec!["Ephemeral".to_owned()]),
                "{what}"
            );
        }
        "Job" => {
            let j: Job = strict(doc, &what);
            check_uninstall_job(&j, &what);
        }
        "StatefulSet" => drop(strict::<StatefulSet>(doc, &what)),
        "PodDisruptionBudget" => {
            let pdb: PodDisruptionBudget = strict(doc, &what);
            assert!(
                pdb.spec.and_then(|s| s.min_available).is_some(),
                "{what}: keeps an operator through drains"
            );
        }
        "ConfigMap" => drop(strict::<ConfigMap>(doc, &what)),
        "Namespace" => drop(strict::<Namespace>(doc, &what)),
        "ServiceAccount" => drop(strict::<ServiceAccount>(doc, &what)),
        "ClusterRole" => {
            let r: ClusterRole = strict(doc, &what);
            if name.ends_with("-uninstall") {
                check_uninstall_rules(r.rules.as_deref().unwrap_or_default(), &what);
            } else {
                check_operator_rules(r.rules.as_deref().unwrap_or_default(), &what);
            }
        }
        "ClusterRoleBinding" => drop(strict::<ClusterRoleBinding>(doc, &what)),
        "Role" => {
            let r: Role = strict(doc, &what);
            let rules = r.rules.unwrap_or_default();
            if name.ends_with("-leader-election") {
                assert_eq!(rules.len(), 1, "{what}");
                assert_eq!(
                    rules[0].resources.as_deref(),
                    Some(&["leases".to_owned()][..])
                );
                assert_eq!(rules[0].verbs, vec!["get", "create", "update", "patch"]);
            } else if name.ends_with("-etcd-secrets") {
                // The only Secret access: get, in one namespace, by name where names are given.
                assert_eq!(rules.len(), 1, "{what}");
                assert_eq!(
                    rules[0].resources.as_deref(),
                    Some(&["secrets".to_owned()][..])
                );
                assert_eq!(rules[0].verbs, vec!["get"], "{what}");
            } else if name.ends_with("-uninstall") {
                check_uninstall_rules(&rules, &what);
            } else {
                check_operator_rules(&rules, &what);
            }
        }
        "RoleBinding" => drop(strict::<RoleBinding>(doc, &what)),
        "Service" => drop(strict::<Service>(doc, &what)),
        "NetworkPolicy" => drop(strict::<NetworkPolicy>(doc, &what)),
        "CustomResourceDefinition" => {
            let crd: CustomResourceDefinition = strict(doc, &what);
            assert_eq!(
                crd.metadata.name.as_deref(),
                Some("transferfabrics.kvfabric.io")
            );
        }
        "ServiceMonitor" => {
            // The operator's own Service, in the release's namespace only.
            let sm: ServiceMonitor = strict(doc, &what);
            let ns = sm.spec.namespace_selector;
            assert!(
                ns.match_names.is_some() && ns.any.is_none(),
                "{what}: {ns:?}"
            );
        }
        "PodMonitor" => check_pod_monitor(strict(doc, &what), &what),
        "TransferFabric" => check_fabric(doc, &what),
        other => panic!("{what}: no strict check for kind {other:?}; add one"),
    }
    kind
}

/// The agents' PodMonitor selects exactly what the operator labels an agent pod with, on the
/// port the agent container names `metrics`, in the namespaces the operator watches.
fn check_pod_monitor(pm: PodMonitor, what: &str) {
    let agent = kvfabric_operator::meta::fabric_labels("any");
    let selected = pm.spec.selector.match_labels.clone().unwrap_or_default();
    assert!(!selected.is_empty(), "{what}: selects every pod");
    for (k, v) in &selected {
        assert_eq!(agent.get(k), Some(v), "{what}: agents do not carry {k}={v}");
    }
    let ports = kvfabric_crds::AgentPorts::default().named();
    for e in &pm.spec.pod_metrics_endpoints {
        // The agent container's port of that name is the CRD's metrics port.
        assert!(
            e.port == "metrics" && ports.iter().any(|(name, _)| *name == e.port),
            "{what}: {}",
            e.port
        );
        assert_eq!(e.path, "/metrics", "{what}");
    }
    let ns = &pm.spec.namespace_selector;
    assert!(
        (ns.any == Some(true)) ^ ns.match_names.as_ref().is_some_and(|n| !n.is_empty()),
        "{what}: every namespace, or the watched one: {ns:?}"
    );
}

/// A fabric: strict round trip, the CRD's CEL rules, and the operator's own checks.
fn check_fabric(doc: &Value, what: &str) {
    let tf: TransferFabric = strict(doc, what);
    let problems = kvfabric_operator::spec_checks::problems(
        &tf,
        &kvfabric_operator::config::AgentSettings::default(),
    );
    assert!(problems.is_empty(), "{what}: {problems:?}");
    use kube::CustomResourceExt;
    let crd = TransferFabric::crd();
    let schema = serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("schema"),
    )
    .expect("json");
    kube::core::cel::Validator::new()
        .validate(&schema, doc, None)
        .unwrap_or_else(|e| panic!("{what} fails the CRD's CEL rules: {e:?}"));
}

fn pod_spec_of<'a>(spec: Option<&'a PodSpec>, what: &str) -> &'a PodSpec {
    spec.unwrap_or_else(|| panic!("{what}: no pod spec"))
}

fn check_deployment(d: &Deployment, what: &str) {
    let pod = pod_spec_of(d.spec.as_ref().and_then(|s| s.template.spec.as_ref()), what);
    check_restricted(pod, what);
    let c = &pod.containers[0];
    // The chart's agent tolerations reach the operator as the JSON list it parses.
    let tolerations = c
        .args
        .iter()
        .flatten()
        .find_map(|a| a.strip_prefix("--agent-tolerations="))
        .expect("--agent-tolerations");
    serde_json::from_str::<Vec<k8s_openapi::api::core::v1::Toleration>>(tolerations)
        .unwrap_or_else(|e| panic!("{what}: --agent-tolerations {tolerations}: {e}"));
    // An upgrade never runs two operators side by side unless they elect a leader.
    let elects = c.args.iter().flatten().any(|a| a == "--leader-election");
    let strategy = d
        .spec
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
        .and_then(|s| s.type_.as_deref());
    assert_eq!(
        strategy,
        Some(if elects { "RollingUpdate" } else { "Recreate" }),
        "{what}: leader election {elects}"
    );
    let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|h| h.path.clone())
    };
    assert_eq!(
        path(&c.liveness_probe).as_deref(),
        Some("/healthz"),
        "{what}"
    );
    assert_eq!(
        path(&c.readiness_probe).as_deref(),
        Some("/readyz"),
        "{what}"
    );
    let env = c.env.as_ref().expect("env");
    let ns = env
        .iter()
        .find(|e| e.name == "POD_NAMESPACE")
        .expect("POD_NAMESPACE");
    assert_eq!(
        ns.value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("metadata.namespace")
    );
    let args = c.args.clone().unwrap_or_default();
    for flag in [
        "--agent-image=",
        "--agent-image-pull-policy=",
        "--socket-root=",
        "--socket-volume=",
    ] {
        assert!(
            args.iter().any(|a| a.starts_with(flag)),
            "{what}: no {flag}"
        );
    }
}

/// The Pod Security "restricted" profile, which the operator's own pods meet.
fn check_restricted(pod: &PodSpec, what: &str) {
    let psc = pod.security_context.as_ref().expect("pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true), "{what}");
    assert_eq!(
        psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
        Some("RuntimeDefault"),
        "{what}"
    );
    for c in &pod.containers {
        let sc = c.security_context.as_ref().expect("securityContext");
        assert_eq!(sc.read_only_root_filesystem, Some(true), "{what}");
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{what}");
        assert_eq!(
            sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
            Some(vec!["ALL".to_owned()]),
            "{what}"
        );
    }
    assert!(
        pod.volumes.iter().flatten().all(|v| v.host_path.is_none()),
        "{what}"
    );
}

/// The value of an operator Deployment flag.
fn operator_flag(docs: &[Value], flag: &str) -> Option<String> {
    docs.iter()
        .filter(|d| d["kind"] == "Deployment")
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .find_map(|a| {
            a.as_str()
                .and_then(|a| a.strip_prefix(flag))
                .map(str::to_owned)
        })
}

/// `--fabrics=` of the rendered uninstall Job.
fn uninstall_mode(docs: &[Value]) -> Option<String> {
    docs.iter()
        .filter(|d| d["kind"] == "Job")
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .find_map(|a| a.as_str()?.strip_prefix("--fabrics=").map(str::to_owned))
}

fn check_uninstall_job(j: &Job, what: &str) {
    let pod = pod_spec_of(j.spec.as_ref().and_then(|s| s.template.spec.as_ref()), what);
    check_restricted(pod, what);
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"), "{what}");
    let args = pod.containers[0].args.clone().unwrap_or_default();
    assert_eq!(args[0], "uninstall", "{what}");
    let hook = j
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("helm.sh/hook"))
        .map(String::as_str);
    let fabrics = args.iter().find_map(|a| a.strip_prefix("--fabrics="));
    match fabrics {
        Some("delete") => assert_eq!(
            hook,
            Some("pre-delete"),
            "{what}: the operator must still run"
        ),
        Some("orphan") => assert_eq!(
            hook,
            Some("post-delete"),
            "{what}: the operator must be gone"
        ),
        other => panic!("{what}: --fabrics {other:?}"),
    }
}

/// An agent DaemonSet from `kvfabric-operator render`: only the operator's own image and host
/// paths under the socket root, probes on gRPC health (HTTP on the metrics port with mTLS),
/// capabilities only with RDMA.
fn check_agent_daemonset(d: &DaemonSet, what: &str) {
    let pod = pod_spec_of(d.spec.as_ref().and_then(|s| s.template.spec.as_ref()), what);
    for v in pod.volumes.iter().flatten() {
        if let Some(hp) = &v.host_path {
            assert!(
                hp.path.starts_with("/var/run/kvfabric/"),
                "{what}: hostPath {}",
                hp.path
            );
        }
        if let Some(csi) = &v.csi {
            assert_eq!(v.name, "socket-dir", "{what}");
            check_csi_volume(csi, what);
        }
    }
    assert_eq!(pod.host_ipc, None, "{what}");
    let agent = &pod.containers[0];
    assert_eq!(
        agent.image.as_deref(),
        Some(kvfabric_operator::config::DEFAULT_AGENT_IMAGE),
        "{what}"
    );
    // With mTLS on the peer port (the TLS Secret's directory set), the kubelet cannot pass its
    // gRPC probe: health is asked on the metrics port.
    let mtls = agent
        .env
        .iter()
        .flatten()
        .any(|e| e.name == "KVFABRIC_TLS_DIR");
    let ready = agent.readiness_probe.as_ref().expect("readiness probe");
    let live = agent.liveness_probe.as_ref().expect("liveness probe");
    if mtls {
        let get = |p: &k8s_openapi::api::core::v1::Probe| {
            assert!(p.grpc.is_none(), "{what}: gRPC probe on the mTLS port");
            p.http_get.as_ref().and_then(|g| g.path.clone())
        };
        assert_eq!(get(ready).as_deref(), Some("/healthz"), "{what}");
        assert_eq!(get(live).as_deref(), Some("/livez"), "{what}");
    } else {
        assert_eq!(
            ready.grpc.as_ref().and_then(|g| g.service.as_deref()),
            Some("kvfabric.v1.PeerAgent"),
            "{what}"
        );
        assert!(live.grpc.is_some(), "{what}");
    }
    let sc = agent.security_context.as_ref().expect("securityContext");
    assert_eq!(sc.allow_privilege_escalation, Some(false), "{what}");
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]), "{what}");
    for cap in caps.add.iter().flatten() {
        assert_eq!(
            cap, "IPC_LOCK",
            "{what}: only IPC_LOCK, for RDMA memory registration"
        );
    }
    let annotations = d
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.as_ref())
        .expect("template annotations");
    assert!(
        annotations.contains_key("kvfabric.io/config-hash"),
        "{what}: no config hash"
    );
}

/// A pod's `csi.kvfabric.io` volume names a fabric and a pool, nothing else.
fn check_csi_volume(csi: &k8s_openapi::api::core::v1::CSIVolumeSource, what: &str) {
    use kvfabric_proto::contract::csi as c;
    assert_eq!(csi.driver, c::DRIVER, "{what}");
    let attrs = csi.volume_attributes.clone().unwrap_or_default();
    let keys: Vec<&str> = attrs.keys().map(String::as_str).collect();
    assert_eq!(keys, [c::FABRIC_ATTRIBUTE, c::POOL_ATTRIBUTE], "{what}");
}

/// A worker of the examples: passes `restricted`, and reaches its agent through the CSI volume,
/// read-only, never a hostPath.
fn check_worker(pod: &PodSpec, what: &str) {
    assert_eq!(
        violations(Level::Restricted, pod),
        Vec::<String>::new(),
        "{what}"
    );
    let csi: Vec<_> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.csi.as_ref())
        .collect();
    assert_eq!(csi.len(), 1, "{what}: one socket volume");
    check_csi_volume(csi[0], what);
    assert_eq!(csi[0].read_only, Some(true), "{what}: workers only dial");
}

/// The CSI driver's DaemonSet: privileged (it mounts), Bidirectional on the kubelet's pods
/// directory only, its flags those `kvfabric-csi` parses, the node name from the downward API.
fn check_csi_daemonset(d: &DaemonSet, what: &str) {
    let pod = pod_spec_of(d.spec.as_ref().and_then(|s| s.template.spec.as_ref()), what);
    assert_eq!(
        pod.automount_service_account_token,
        Some(false),
        "{what}: no API access"
    );
    let c = &pod.containers[0];
    assert_eq!(
        c.command.as_deref(),
        Some(&[kvfabric_proto::contract::csi::BINARY.to_owned()][..]),
        "{what}"
    );
    let args = c.args.clone().unwrap_or_default();
    let mut argv = vec!["kvfabric-csi".to_owned(), "--node-id=n".to_owned()];
    argv.extend(args.iter().cloned());
    let cli = <kvfabric_csi::config::Cli as clap::Parser>::try_parse_from(&argv)
        .unwrap_or_else(|e| panic!("{what}: {args:?}: {e}"));
    let config = cli.config().unwrap_or_else(|e| panic!("{what}: {e}"));
    let node = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "KVFABRIC_NODE_NAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(node.as_deref(), Some("spec.nodeName"), "{what}");
    let sc = c.security_context.as_ref().expect("securityContext");
    assert_eq!(sc.privileged, Some(true), "{what}: bind mounts need it");
    let mounts = c.volume_mounts.clone().unwrap_or_default();
    let bidirectional: Vec<&str> = mounts
        .iter()
        .filter(|m| m.mount_propagation.as_deref() == Some("Bidirectional"))
        .map(|m| m.mount_path.as_str())
        .collect();
    let pods = config.kubelet_dir.join("pods");
    assert_eq!(bidirectional, [pods.to_str().expect("utf-8")], "{what}");
    // The sockets the kubelet finds are where the driver binds them, in the mounted host dirs.
    for socket in [config.csi_socket(), config.registration_socket()] {
        let dir = socket.parent().expect("parent");
        let mount = mounts
            .iter()
            .find(|m| std::path::Path::new(&m.mount_path) == dir)
            .unwrap_or_else(|| panic!("{what}: {} not mounted", dir.display()));
        let host = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.host_path.as_ref())
            .map(|h| h.path.clone());
        assert_eq!(
            host.as_deref(),
            dir.to_str(),
            "{what}: same path on the host"
        );
    }
    assert!(
        mounts
            .iter()
            .any(|m| std::path::Path::new(&m.mount_path) == config.socket_root),
        "{what}: the socket root is mounted"
    );
}

fn rule_verbs(
    rules: &[k8s_openapi::api::rbac::v1::PolicyRule],
    group: &str,
    resource: &str,
) -> Vec<String> {
    rules
        .iter()
        .find(|rule| {
            rule.api_groups
                .as_ref()
                .is_some_and(|g| g.iter().any(|x| x == group))
                && rule
                    .resources
                    .as_ref()
                    .is_some_and(|r| r.iter().any(|x| x == resource))
        })
        .map(|rule| rule.verbs.clone())
        .unwrap_or_default()
}

fn check_operator_rules(rules: &[k8s_openapi::api::rbac::v1::PolicyRule], what: &str) {
    let verbs = |g: &str, r: &str| rule_verbs(rules, g, r);
    assert_eq!(
        verbs("kvfabric.io", "transferfabrics"),
        vec!["get", "list", "watch", "patch"],
        "{what}"
    );
    assert_eq!(
        verbs("kvfabric.io", "transferfabrics/status"),
        vec!["patch"]
    );
    assert_eq!(
        verbs("kvfabric.io", "transferfabrics/finalizers"),
        vec!["update"]
    );
    assert!(verbs("apps", "daemonsets").contains(&"delete".to_owned()));
    assert!(
        !verbs("", "configmaps").contains(&"delete".to_owned()),
        "GC deletes them"
    );
    assert_eq!(verbs("events.k8s.io", "events"), vec!["create", "patch"]);
    assert_eq!(
        verbs("", "pods"),
        vec!["list"],
        "{what}: pods are read, never watched"
    );
    assert_eq!(verbs("", "events"), vec!["list"], "{what}");
    assert!(verbs("networking.k8s.io", "networkpolicies").contains(&"create".to_owned()));
    // No Secret cluster-wide (or namespace-wide here): only the etcd-secrets Roles read them.
    assert!(
        verbs("", "secrets").is_empty(),
        "{what}: the operator must not read Secrets"
    );
    for rule in rules {
        assert!(!rule.verbs.iter().any(|v| v == "*"), "no wildcard verbs");
        assert!(
            !rule.resources.iter().flatten().any(|r| r == "*"),
            "no wildcard resources"
        );
    }
}

fn check_uninstall_rules(rules: &[k8s_openapi::api::rbac::v1::PolicyRule], what: &str) {
    assert_eq!(rules.len(), 1, "{what}");
    assert_eq!(
        rule_verbs(rules, "kvfabric.io", "transferfabrics"),
        vec!["get", "list", "delete", "patch"],
        "{what}"
    );
}

#[test]
fn rendered_manifests_are_strictly_valid() {
    let dir = match std::env::var_os("KVFABRIC_RENDERED_DIR") {
        Some(d) => PathBuf::from(d),
        None => workspace().join("target/helm-rendered"),
    };
    if !dir.is_dir() {
        return skip(
            Why::Missing("rendered chart"),
            format!(
                "{} is absent: run scripts/helm-check.sh first",
                dir.display()
            ),
        );
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let names: Vec<String> = files
        .iter()
        .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    for needed in [
        "default.yaml",
        "all-features.yaml",
        "objects-example-1.29.yaml",
        "objects-example-1.35.yaml",
        "objects-kind-1.29.yaml",
        "objects-kind-1.35.yaml",
        "objects-all-features-1.29.yaml",
        "objects-all-features-1.35.yaml",
        "objects-dra-1.35.yaml",
        "pod-monitor.yaml",
    ] {
        assert!(
            names.iter().any(|n| n == needed),
            "{} lacks {needed}",
            dir.display()
        );
    }
    for (file, name) in files.iter().zip(&names) {
        let docs = documents(file);
        let kinds: Vec<String> = docs.iter().map(|d| check(d, name)).collect();
        let has = |k: &str| kinds.iter().any(|x| x == k);
        if name == "default.yaml" {
            for needed in [
                "CustomResourceDefinition",
                "Deployment",
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Service",
                "Job",
            ] {
                assert!(has(needed), "{name}: no {needed}");
            }
            for absent in [
                "NetworkPolicy",
                "ServiceMonitor",
                "PodMonitor",
                "Role",
                "PodDisruptionBudget",
                "CSIDriver",
                "DaemonSet",
            ] {
                assert!(!has(absent), "{name}: {absent} is optional");
            }
            check_default_images(&docs);
            // `helm uninstall` keeps every tenant's fabrics unless deleting them was asked for.
            assert_eq!(
                uninstall_mode(&docs).as_deref(),
                Some("orphan"),
                "{name}: the default uninstall deletes fabrics"
            );
        }
        if name == "all-features.yaml" {
            for needed in [
                "PodDisruptionBudget",
                "NetworkPolicy",
                "ServiceMonitor",
                "PodMonitor",
                "Role",
                "RoleBinding",
                "Job",
                "CSIDriver",
                "DaemonSet",
            ] {
                assert!(has(needed), "{name}: no {needed}");
            }
            assert_eq!(uninstall_mode(&docs).as_deref(), Some("delete"), "{name}");
            // watchNamespace: Roles in that namespace only, no ClusterRole for the operator.
            assert!(
                !has("ClusterRole"),
                "{name}: a ClusterRole despite watchNamespace"
            );
        }
        if name == "default.yaml" || name == "all-features.yaml" {
            // The operator builds CSI volumes exactly when the chart installs the driver.
            let volume = operator_flag(&docs, "--socket-volume=");
            let expected = if has("CSIDriver") { "csi" } else { "host-path" };
            assert_eq!(volume.as_deref(), Some(expected), "{name}");
        }
        if name.starts_with("objects-baseline-") {
            // docs/operator.md: agents without RDMA or host network, on the CSI volume, pass
            // baseline.
            for d in &docs {
                if d["kind"] == "DaemonSet" {
                    let ds: DaemonSet = strict(d, name);
                    let pod = pod_spec_of(
                        ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()),
                        name,
                    );
                    assert_eq!(
                        violations(Level::Baseline, pod),
                        Vec::<String>::new(),
                        "{name}"
                    );
                    assert!(
                        pod.volumes.iter().flatten().any(|v| v.csi.is_some()),
                        "{name}"
                    );
                }
            }
        }
        if name.starts_with("objects-") {
            assert!(
                has("DaemonSet") && has("ConfigMap") && has("ServiceAccount"),
                "{name}: {kinds:?}"
            );
        }
        println!("checked {name}: {kinds:?}");
    }
}

/// The chart's default images are this release's: the operator's from Chart.yaml's appVersion,
/// the agent's the operator's own default, both what `scripts/build-images.sh` builds.
fn check_default_images(docs: &[Value]) {
    let version = env!("CARGO_PKG_VERSION");
    let chart = std::fs::read_to_string(workspace().join("charts/kvfabric/Chart.yaml"))
        .expect("Chart.yaml");
    assert!(
        chart.contains(&format!("appVersion: \"{version}\"")),
        "Chart.yaml appVersion must be the workspace version {version}"
    );
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("deployment");
    let c = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        c["image"],
        format!("ghcr.io/kvfabric/kvfabric-operator:{version}")
    );
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        args.contains(
            &format!(
                "--agent-image={}",
                kvfabric_operator::config::DEFAULT_AGENT_IMAGE
            )
            .as_str()
        ),
        "{args:?}"
    );
}

#[test]
fn examples_are_strictly_valid() {
    let chart = workspace().join("charts/kvfabric");
    let example = documents(&chart.join("examples/prefill-decode.yaml"));
    let kinds: Vec<String> = example
        .iter()
        .map(|d| check(d, "examples/prefill-decode.yaml"))
        .collect();
    assert_eq!(kinds, vec!["Namespace", "TransferFabric"]);
    // The fabric's namespace admits what the agents need.
    assert_eq!(
        example[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "privileged"
    );
    let tf: TransferFabric = strict(&example[1], "example");
    let roles: Vec<_> = tf.spec.pools.iter().map(|p| p.role).collect();
    assert_eq!(
        roles,
        vec![
            kvfabric_crds::PoolRole::Prefill,
            kvfabric_crds::PoolRole::Decode
        ]
    );
    // Consistent: on the host network, so no Multus network; a shared-HCA device plugin resource.
    assert!(tf.spec.agent.host_network && tf.spec.agent.networks.is_empty());
    let etcd = documents(&chart.join("examples/etcd.yaml"));
    let kinds: Vec<String> = etcd
        .iter()
        .map(|d| check(d, "examples/etcd.yaml"))
        .collect();
    assert_eq!(kinds, vec!["Service", "StatefulSet"]);
    assert_eq!(
        tf.spec.etcd.endpoints,
        vec!["http://etcd.kvfabric.svc:2379"],
        "the example fabric uses the example etcd"
    );
    let kind = documents(&chart.join("examples/kind.yaml"));
    let kinds: Vec<String> = kind
        .iter()
        .map(|d| check(d, "examples/kind.yaml"))
        .collect();
    assert_eq!(kinds, vec!["Namespace", "TransferFabric"]);
    let demo: TransferFabric = strict(&kind[1], "kind example");
    assert!(
        demo.spec.agent.rdma.is_none() && !demo.spec.agent.gpu.enabled,
        "runs on a laptop"
    );
    let baseline = documents(&chart.join("examples/baseline.yaml"));
    let kinds: Vec<String> = baseline
        .iter()
        .map(|d| check(d, "examples/baseline.yaml"))
        .collect();
    assert_eq!(kinds, vec!["Namespace", "TransferFabric", "Deployment"]);
    assert_eq!(
        baseline[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "baseline"
    );
    let tf: TransferFabric = strict(&baseline[1], "baseline example");
    assert!(
        tf.spec.agent.rdma.is_none() && !tf.spec.agent.host_network,
        "baseline agents use neither RDMA nor the host network"
    );
    let worker: Deployment = strict(&baseline[2], "baseline worker");
    let pod = worker.spec.and_then(|s| s.template.spec).expect("pod");
    let attrs = pod
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.csi.as_ref())
        .and_then(|c| c.volume_attributes.clone())
        .expect("csi volume");
    assert_eq!(attrs.get("fabric"), tf.metadata.name.as_ref());
    assert!(
        tf.spec
            .pools
            .iter()
            .any(|p| Some(&p.name) == attrs.get("pool"))
    );
    let groups = pod
        .security_context
        .and_then(|s| s.supplemental_groups)
        .unwrap_or_default();
    assert!(
        groups.contains(&tf.spec.agent.sockets.group),
        "the worker may open the sockets"
    );
    for f in ["ci/fabric-all-features.yaml", "ci/fabric-dra.yaml"] {
        for d in documents(&chart.join(f)) {
            assert_eq!(check(&d, f), "TransferFabric");
        }
    }
}

#[test]
fn round_trip_detects_unknown_fields() {
    let doc = serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "x", "labelz": {"a": "b"}}
    });
    let err = try_strict::<ServiceAccount>(&doc).expect_err("an unknown field must fail");
    assert!(err.contains(".metadata.labelz"), "{err}");
    let sm = serde_json::json!({
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {},
        "spec": {"selector": {}, "namespaceSelector": {"matchNames": []}, "endpoints": [],
                 "jobLabel": "x"}
    });
    let err = try_strict::<ServiceMonitor>(&sm).expect_err("unknown ServiceMonitor field");
    assert!(err.contains("jobLabel"), "{err}");
}
