//! The generated schema holds the validation the apiserver must apply: required fields, enums,
//! ranges, list-map markers and the CEL rules; the CEL rules are evaluated here with kube's
//! client-side CEL validator, so a typo in a rule fails a test rather than a cluster.

use kube::CustomResourceExt;
use kube::core::cel::Validator;
use kvfabric_crds::TransferFabric;
use serde_json::{Value, json};

fn schema() -> Value {
    let crd = TransferFabric::crd();
    assert_eq!(crd.spec.versions.len(), 1);
    let v = &crd.spec.versions[0];
    serde_json::to_value(
        v.schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("schema"),
    )
    .expect("json")
}

fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    let mut cur = v;
    for part in path.split('.') {
        cur = match part.parse::<usize>() {
            Ok(i) => &cur[i],
            Err(_) => &cur[part],
        };
    }
    cur
}

fn required(v: &Value, path: &str) -> Vec<String> {
    at(v, path)["required"]
        .as_array()
        .unwrap_or_else(|| panic!("{path} has no required list"))
        .iter()
        .map(|s| s.as_str().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn names_scope_and_printer_columns() {
    let crd = TransferFabric::crd();
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("transferfabrics.kvfabric.io")
    );
    assert_eq!(crd.spec.group, "kvfabric.io");
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crd.spec.names.kind, "TransferFabric");
    assert_eq!(crd.spec.names.short_names, Some(vec!["tf".to_owned()]));
    let v = &crd.spec.versions[0];
    assert_eq!(v.name, "v1alpha1");
    assert!(v.served && v.storage);
    assert!(
        v.subresources
            .as_ref()
            .and_then(|s| s.status.as_ref())
            .is_some()
    );
    let cols: Vec<_> = v
        .additional_printer_columns
        .as_ref()
        .expect("columns")
        .iter()
        .map(|c| (c.name.as_str(), c.json_path.as_str()))
        .collect();
    assert_eq!(
        cols,
        vec![
            ("Pools", ".spec.pools[*].name"),
            ("Ready", ".status.conditions[?(@.type==\"Ready\")].status"),
            ("Reason", ".status.conditions[?(@.type==\"Ready\")].reason"),
            ("Agents", ".status.agentsReady"),
            ("Desired", ".status.agentsDesired"),
            ("Age", ".metadata.creationTimestamp"),
        ]
    );
}

#[test]
fn required_fields() {
    let s = schema();
    let spec = required(&s, "properties.spec");
    assert!(spec.contains(&"pools".to_owned()));
    assert!(spec.contains(&"etcd".to_owned()));
    // The image is the operator's setting: nothing of the agent is required.
    assert!(!spec.contains(&"agent".to_owned()));
    assert!(
        at(&s, "properties.spec.properties.agent.properties")
            .get("image")
            .is_none()
    );
    assert_eq!(
        required(&s, "properties.spec.properties.etcd"),
        vec!["endpoints"]
    );
    assert!(required(&s, "properties.spec.properties.pools.items").contains(&"name".to_owned()));
    assert_eq!(
        required(
            &s,
            "properties.spec.properties.agent.properties.rdma.properties.resources.items"
        ),
        vec!["resourceName"]
    );
    // Required fields carry no default, or the apiserver would fill them in.
    for p in [
        "properties.spec.properties.etcd",
        "properties.spec.properties.pools",
        "properties.spec.properties.etcd.properties.endpoints",
    ] {
        assert!(at(&s, p).get("default").is_none(), "{p} has a default");
    }
}

#[test]
fn no_host_path_or_image_field_is_left() {
    // Whoever may create a TransferFabric must not pick a host path or the image of the agents.
    let agent = at(&schema(), "properties.spec.properties.agent.properties").clone();
    for gone in [
        "image",
        "imagePullPolicy",
        "socketDir",
        "shm",
        "hostIPC",
        "volumes",
    ] {
        assert!(
            agent.get(gone).is_none(),
            "spec.agent.{gone} is still there"
        );
    }
}

#[test]
fn enums() {
    let s = schema();
    let spec = "properties.spec.properties";
    assert_eq!(
        at(&s, &format!("{spec}.transports.items.enum")),
        &json!(["rdma", "cuda-ipc", "shm", "tcp"])
    );
    assert_eq!(
        at(&s, &format!("{spec}.pools.items.properties.role.enum")),
        &json!(["Prefill", "Decode", "Both"])
    );
    assert_eq!(
        at(
            &s,
            &format!("{spec}.agent.properties.sockets.properties.mode.enum")
        ),
        &json!(["0600", "0660", "0666"])
    );
}

#[test]
fn ranges_sizes_and_list_maps() {
    let s = schema();
    let spec = "properties.spec.properties";
    let rdma = format!("{spec}.agent.properties.rdma.properties.resources");
    assert_eq!(
        at(&s, &format!("{rdma}.items.properties.count.minimum")),
        &json!(1.0)
    );
    assert_eq!(
        at(&s, &format!("{rdma}.items.properties.count.maximum")),
        &json!(64.0)
    );
    assert_eq!(at(&s, &format!("{rdma}.maxItems")), &json!(16));
    assert_eq!(
        at(&s, &format!("{rdma}.x-kubernetes-list-type")),
        &json!("map")
    );
    assert_eq!(
        at(&s, &format!("{rdma}.x-kubernetes-list-map-keys")),
        &json!(["resourceName"])
    );
    let claims = format!("{spec}.agent.properties.resourceClaims");
    assert_eq!(
        at(&s, &format!("{claims}.x-kubernetes-list-type")),
        &json!("map")
    );
    assert_eq!(
        at(&s, &format!("{claims}.x-kubernetes-list-map-keys")),
        &json!(["name"])
    );
    assert_eq!(
        at(
            &s,
            &format!("{spec}.tracing.properties.sampleRatio.minimum")
        ),
        &json!(0.0)
    );
    assert_eq!(
        at(
            &s,
            &format!("{spec}.tracing.properties.sampleRatio.maximum")
        ),
        &json!(1.0)
    );
    assert_eq!(at(&s, &format!("{spec}.pools.minItems")), &json!(1));
    assert_eq!(at(&s, &format!("{spec}.pools.maxItems")), &json!(32));
    assert_eq!(
        at(&s, &format!("{spec}.pools.items.properties.name.maxLength")),
        &json!(40)
    );
    assert_eq!(at(&s, &format!("{spec}.transports.minItems")), &json!(1));
    assert_eq!(at(&s, &format!("{spec}.transports.maxItems")), &json!(4));
    assert_eq!(
        at(&s, &format!("{spec}.etcd.properties.endpoints.minItems")),
        &json!(1)
    );
    let group = format!("{spec}.agent.properties.sockets.properties.group");
    assert_eq!(at(&s, &format!("{group}.minimum")), &json!(1.0));
    assert_eq!(at(&s, &format!("{group}.maximum")), &json!(2147483647.0));
}

fn pattern(s: &Value, path: &str) -> regex::Regex {
    let p = at(s, path)["pattern"]
        .as_str()
        .unwrap_or_else(|| panic!("{path} has no pattern"));
    regex::Regex::new(p).expect("the pattern compiles")
}

/// The schema's patterns agree with the operator's own checks (`TransferFabricSpec::problems`),
/// so what the apiserver admits is what the operator accepts.
#[test]
fn patterns_agree_with_the_operator_checks() {
    use kvfabric_crds::{EtcdSpec, RdmaResource, RdmaSpec, TransferFabricSpec};
    let s = schema();
    let spec = "properties.spec.properties";
    let prefix = pattern(&s, &format!("{spec}.etcd.properties.keyPrefix"));
    let rdma = pattern(
        &s,
        &format!("{spec}.agent.properties.rdma.properties.resources.items.properties.resourceName"),
    );
    let base = || TransferFabricSpec {
        pools: vec![kvfabric_crds::Pool {
            name: "p".into(),
            ..Default::default()
        }],
        agent: Default::default(),
        network_policy: Default::default(),
        transports: kvfabric_crds::Transport::KNOWN.to_vec(),
        etcd: EtcdSpec {
            endpoints: vec!["http://e:2379".into()],
            ..EtcdSpec::default()
        },
        peer_token_secret: None,
        tls_secret: None,
        tracing: None,
    };
    for v in [
        "/kvfabric",
        "/a",
        "/kv-fabric.prod_1",
        "kvfabric",
        "/",
        "/kvfabric/",
        "/kv/ns",
        "/-x",
        "/x-",
        "/ü",
    ] {
        let mut f = base();
        f.etcd.key_prefix = v.into();
        assert_eq!(
            prefix.is_match(v),
            f.validate().is_ok(),
            "keyPrefix {v:?}: schema and operator disagree"
        );
    }
    for v in [
        "rdma/rdma_shared_device_a",
        "nvidia.com/sriov_rdma_rail0",
        "a.b/C-d.e",
        "no-domain",
        "Upper/x",
        "a/-x",
        "a/x-",
        "a/b c",
        "a//b",
        "/x",
        "a/",
    ] {
        let mut f = base();
        f.agent.rdma = Some(RdmaSpec {
            resources: vec![RdmaResource {
                resource_name: v.into(),
                count: 1,
            }],
        });
        assert_eq!(
            rdma.is_match(v),
            f.validate().is_ok(),
            "resourceName {v:?}: schema and operator disagree"
        );
    }
}

#[test]
fn defaults() {
    let s = schema();
    let spec = "properties.spec.properties";
    assert_eq!(
        at(&s, &format!("{spec}.etcd.properties.keyPrefix.default")),
        &json!("/kvfabric")
    );
    let gpu = format!("{spec}.agent.properties.gpu.properties");
    assert!(
        at(&s, &format!("{gpu}.runtimeClassName"))
            .get("default")
            .is_none(),
        "no RuntimeClass by default: GPU Operator clusters with the NRI plugin have none"
    );
    assert_eq!(
        at(&s, &format!("{gpu}.visibleDevices.default")),
        &json!("all")
    );
    assert_eq!(at(&s, &format!("{gpu}.enabled.default")), &json!(false));
    let sockets = format!("{spec}.agent.properties.sockets.properties");
    assert_eq!(at(&s, &format!("{sockets}.group.default")), &json!(65532));
    assert_eq!(at(&s, &format!("{sockets}.mode.default")), &json!("0660"));
    assert_eq!(
        at(
            &s,
            &format!("{spec}.networkPolicy.properties.enabled.default")
        ),
        &json!(true)
    );
}

#[test]
fn status_conditions_are_a_map_list_keyed_on_type() {
    let s = schema();
    let c = at(&s, "properties.status.properties.conditions");
    assert_eq!(c["x-kubernetes-list-type"], json!("map"));
    assert_eq!(c["x-kubernetes-list-map-keys"], json!(["type"]));
    let item = &c["items"]["properties"];
    for f in [
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    ] {
        assert!(item.get(f).is_some(), "condition lacks {f}");
    }
    assert!(at(&s, "properties.status.properties.observedGeneration").is_object());
    let pools = at(&s, "properties.status.properties.pools.items.properties");
    for f in ["name", "desired", "ready"] {
        assert!(pools.get(f).is_some(), "pool status lacks {f}");
    }
}

#[test]
fn cel_rules_are_present() {
    let s = schema();
    let rules: Vec<&str> = at(&s, "properties.spec.x-kubernetes-validations")
        .as_array()
        .expect("rules")
        .iter()
        .map(|r| r["rule"].as_str().expect("rule"))
        .collect();
    assert!(rules.contains(&"size(self.pools) >= 1"));
    assert!(
        rules
            .iter()
            .any(|r| r.contains("exists_one(q, q.name == p.name)"))
    );
    assert!(rules.iter().any(|r| r.contains("p.name.matches(")));
    assert!(
        rules
            .iter()
            .any(|r| r.contains("self.transports.exists_one(u, u == t)"))
    );
}

fn good() -> Value {
    json!({
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "TransferFabric",
        "metadata": {"name": "tf", "namespace": "ns"},
        "spec": {
            "pools": [{"name": "prefill", "role": "Prefill"}, {"name": "decode", "role": "Decode"}],
            "agent": {"hostNetwork": false, "networks": ["sriov-rail0"]},
            "transports": ["rdma", "tcp"],
            "etcd": {"endpoints": ["http://etcd:2379"]}
        }
    })
}

fn cel(obj: &Value) -> Result<(), String> {
    Validator::new()
        .validate(&schema(), obj, None)
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn cel_accepts_a_good_fabric() {
    cel(&good()).expect("valid");
}

#[test]
fn cel_rejects_duplicate_pool_names() {
    let mut o = good();
    o["spec"]["pools"][1]["name"] = json!("prefill");
    let err = cel(&o).expect_err("duplicate pools must fail");
    assert!(err.contains("pool names must be unique"), "{err}");
}

#[test]
fn cel_rejects_no_pools() {
    let mut o = good();
    o["spec"]["pools"] = json!([]);
    let err = cel(&o).expect_err("empty pools must fail");
    assert!(err.contains("at least one pool"), "{err}");
}

#[test]
fn cel_rejects_non_dns_pool_names() {
    let mut o = good();
    o["spec"]["pools"][0]["name"] = json!("Pre_fill");
    let err = cel(&o).expect_err("bad name must fail");
    assert!(err.contains("DNS labels"), "{err}");
}

#[test]
fn cel_rejects_multus_networks_on_the_host_network() {
    let mut o = good();
    o["spec"]["agent"]["hostNetwork"] = json!(true);
    let err = cel(&o).expect_err("hostNetwork with networks must fail");
    assert!(err.contains("hostNetwork"), "{err}");
    o["spec"]["agent"]["networks"] = json!([]);
    cel(&o).expect("hostNetwork alone is fine");
}

#[test]
fn cel_rejects_a_claim_without_exactly_one_source() {
    let mut o = good();
    o["spec"]["agent"]["resourceClaims"] =
        json!([{"name": "nics", "resourceClaimTemplateName": "rdma-nics"}]);
    cel(&o).expect("a template claim is fine");
    o["spec"]["agent"]["resourceClaims"] = json!([{"name": "nics"}]);
    let err = cel(&o).expect_err("a claim naming nothing must fail");
    assert!(err.contains("exactly one"), "{err}");
    o["spec"]["agent"]["resourceClaims"] =
        json!([{"name": "nics", "resourceClaimName": "a", "resourceClaimTemplateName": "b"}]);
    let err = cel(&o).expect_err("a claim naming both must fail");
    assert!(err.contains("exactly one"), "{err}");
}

#[test]
fn cel_rejects_rdma_without_devices() {
    let mut o = good();
    o["spec"]["agent"]["rdma"] = json!({"resources": []});
    let err = cel(&o).expect_err("rdma with no devices must fail");
    assert!(err.contains("rdma needs its devices"), "{err}");
    o["spec"]["agent"]["rdma"] =
        json!({"resources": [{"resourceName": "rdma/rdma_shared_device_a", "count": 1}]});
    cel(&o).expect("device plugin resources");
    o["spec"]["agent"]["rdma"] = json!({});
    o["spec"]["agent"]["resourceClaims"] =
        json!([{"name": "nics", "resourceClaimTemplateName": "rdma-nics"}]);
    cel(&o).expect("NICs from DRA");
}

#[test]
fn cel_rejects_duplicate_transports() {
    let mut o = good();
    o["spec"]["transports"] = json!(["tcp", "tcp"]);
    let err = cel(&o).expect_err("duplicate transports must fail");
    assert!(err.contains("transports must be unique"), "{err}");
}

#[test]
fn cel_takes_only_fabric_names_that_can_name_the_service() {
    for ok in [
        "tf",
        "llama-70b",
        &"a".repeat(kvfabric_crds::MAX_FABRIC_NAME),
    ] {
        let mut o = good();
        o["metadata"]["name"] = json!(ok);
        cel(&o).unwrap_or_else(|e| panic!("{ok}: {e}"));
        assert!(kvfabric_crds::fabric_name_problem(ok).is_none(), "{ok}");
    }
    for bad in [
        "llama.70b",
        "7b",
        &"a".repeat(kvfabric_crds::MAX_FABRIC_NAME + 1),
    ] {
        let mut o = good();
        o["metadata"]["name"] = json!(bad);
        let err = cel(&o).expect_err(bad);
        assert!(err.contains("DNS-1035"), "{bad}: {err}");
        // The operator's own check (no admission webhook) agrees.
        assert!(kvfabric_crds::fabric_name_problem(bad).is_some(), "{bad}");
    }
}

#[test]
fn cel_refuses_one_port_for_two_uses() {
    let mut o = good();
    o["spec"]["agent"]["ports"] = json!({"grpc": 6000, "data": 6000, "metrics": 6001});
    let err = cel(&o).expect_err("shared port");
    assert!(err.contains("ports must differ"), "{err}");
    o["spec"]["agent"]["ports"]["data"] = json!(6002);
    cel(&o).expect("three ports");
}
