//! Strict checks of the Helm chart's rendered manifests and of the example TransferFabric.
//!
//! k8s-openapi types ignore unknown fields when deserializing, so a typo such as `readinesProbe`
//! would pass a plain parse. Each document is therefore parsed into its typed struct, serialized
//! back, and compared with the original: a key of the original that did not survive the round
//! trip is an unknown field, and the test fails naming its path.
//!
//! The rendered output comes from `scripts/helm-check.sh` (which sets `KVFABRIC_RENDERED_DIR` and
//! runs this test); without it the chart checks are skipped with a message.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kvfabric_crds::TransferFabric;
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
    match_names: Vec<String>,
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
    let what = format!("{file}: {kind} {}", doc["metadata"]["name"]);
    match kind.as_str() {
        "Deployment" => {
            let d: Deployment = strict(doc, &what);
            check_deployment(&d, &what);
        }
        "ServiceAccount" => drop(strict::<ServiceAccount>(doc, &what)),
        "ClusterRole" => {
            let r: ClusterRole = strict(doc, &what);
            check_cluster_role(&r);
        }
        "ClusterRoleBinding" => drop(strict::<ClusterRoleBinding>(doc, &what)),
        "Role" => {
            let r: Role = strict(doc, &what);
            let rules = r.rules.unwrap_or_default();
            assert_eq!(rules.len(), 1, "{what}");
            assert_eq!(
                rules[0].resources.as_deref(),
                Some(&["leases".to_owned()][..])
            );
            assert_eq!(rules[0].verbs, vec!["get", "create", "update", "patch"]);
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
        "ServiceMonitor" => drop(strict::<ServiceMonitor>(doc, &what)),
        other => panic!("{what}: no strict check for kind {other:?}; add one"),
    }
    kind
}

fn check_deployment(d: &Deployment, what: &str) {
    let pod = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod");
    let psc = pod.security_context.as_ref().expect("pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true), "{what}");
    let c = &pod.containers[0];
    let sc = c.security_context.as_ref().expect("securityContext");
    assert_eq!(sc.read_only_root_filesystem, Some(true), "{what}");
    assert_eq!(sc.allow_privilege_escalation, Some(false), "{what}");
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
}

fn check_cluster_role(r: &ClusterRole) {
    let rules = r.rules.as_ref().expect("rules");
    let verbs = |group: &str, resource: &str| -> Vec<String> {
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
    };
    assert_eq!(
        verbs("kvfabric.io", "transferfabrics"),
        vec!["get", "list", "watch", "patch"]
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
    // The finalizer reads the etcd Secrets a fabric names: by name, never list or watch.
    assert_eq!(verbs("", "secrets"), vec!["get"]);
    for rule in rules {
        assert!(!rule.verbs.iter().any(|v| v == "*"), "no wildcard verbs");
        assert!(
            !rule.resources.iter().flatten().any(|r| r == "*"),
            "no wildcard resources"
        );
    }
}

#[test]
fn rendered_manifests_are_strictly_valid() {
    let dir = match std::env::var_os("KVFABRIC_RENDERED_DIR") {
        Some(d) => PathBuf::from(d),
        None => workspace().join("target/helm-rendered"),
    };
    if !dir.is_dir() {
        println!("skipped: run scripts/helm-check.sh first");
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "{} holds no rendered *.yaml",
        dir.display()
    );
    for file in &files {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let kinds: Vec<String> = documents(file).iter().map(|d| check(d, &name)).collect();
        for needed in [
            "CustomResourceDefinition",
            "Deployment",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
        ] {
            assert!(kinds.iter().any(|k| k == needed), "{name}: no {needed}");
        }
        if name.starts_with("all-features") {
            for needed in ["NetworkPolicy", "ServiceMonitor", "Role", "RoleBinding"] {
                assert!(kinds.iter().any(|k| k == needed), "{name}: no {needed}");
            }
        }
        if name.starts_with("default") {
            for absent in ["NetworkPolicy", "ServiceMonitor", "Role"] {
                assert!(
                    !kinds.iter().any(|k| k == absent),
                    "{name}: {absent} is optional"
                );
            }
        }
        println!("checked {name}: {kinds:?}");
    }
}

#[test]
fn example_fabric_is_strictly_valid() {
    let path = workspace().join("charts/kvfabric/examples/prefill-decode.yaml");
    let docs = documents(&path);
    assert_eq!(docs.len(), 1);
    let tf: TransferFabric = strict(&docs[0], "examples/prefill-decode.yaml");
    let roles: Vec<_> = tf.spec.pools.iter().map(|p| p.role).collect();
    assert_eq!(
        roles,
        vec![
            kvfabric_crds::PoolRole::Prefill,
            kvfabric_crds::PoolRole::Decode
        ]
    );
    tf.spec.validate().expect("passes the operator's checks");

    // And the CRD's own CEL rules, evaluated client-side.
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
        .validate(&schema, &docs[0], None)
        .unwrap_or_else(|e| panic!("example fails the CRD's CEL rules: {e:?}"));
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
