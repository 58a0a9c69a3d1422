//! The operator↔agent contract, end to end: render the DaemonSets the operator builds for the
//! example fabric (`kvfabric-operator render`), resolve their environment as the kubelet would
//! (ConfigMap values, Secrets, the downward API), and start `kvfabric agent --check-config`
//! with exactly that environment. The agent must accept it, resolve it to the fabric, namespace,
//! pool and registry root the operator meant, and read every variable the operator sets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvfabric_proto::contract::{self, env};
use serde_yaml_ng::Value;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn rendered(example: &str) -> Vec<Value> {
    let out = Command::new(kvfabric_e2e::operator_bin())
        .args(["render", "--file"])
        .arg(workspace().join(example))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect()
}

/// The agent container's environment as the kubelet would give it.
fn resolve(ds: &Value, config_maps: &[&Value]) -> BTreeMap<String, String> {
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap();
    let agent = containers
        .iter()
        .find(|c| c["name"].as_str() == Some("agent"))
        .expect("an agent container");
    let mut out = BTreeMap::new();
    for from in agent["envFrom"].as_sequence().into_iter().flatten() {
        let name = from["configMapRef"]["name"].as_str().expect("configMapRef");
        let cm = config_maps
            .iter()
            .find(|c| c["metadata"]["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("config map {name} is rendered too"));
        for (k, v) in cm["data"].as_mapping().unwrap() {
            out.insert(k.as_str().unwrap().into(), v.as_str().unwrap().into());
        }
    }
    for e in agent["env"].as_sequence().unwrap() {
        let name = e["name"].as_str().unwrap().to_string();
        let value = if let Some(v) = e["value"].as_str() {
            v.to_string()
        } else if let Some(path) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            match path {
                "spec.nodeName" => "gpu-node-1".into(),
                "status.podIP" => "10.0.3.7".into(),
                "metadata.name" => "agent-abcde".into(),
                "metadata.namespace" => ds["metadata"]["namespace"].as_str().unwrap().into(),
                other => panic!("unexpected fieldRef {other}"),
            }
        } else if e["valueFrom"]["secretKeyRef"].is_mapping() {
            format!("secret-value-of-{name}-0123456789")
        } else {
            panic!("env {name}: a source this test does not know: {e:?}");
        };
        out.insert(name, value);
    }
    out
}

/// What `kvfabric agent --help` says it reads.
fn agent_reads() -> String {
    let out = Command::new(kvfabric_e2e::kvfabric_bin())
        .args(["agent", "--help"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_agent_accepts_the_environment_the_operator_gives_it() {
    let docs = rendered("charts/kvfabric/examples/prefill-decode.yaml");
    let config_maps = kind(&docs, "ConfigMap");
    let daemonsets = kind(&docs, "DaemonSet");
    assert!(daemonsets.len() >= 2, "a DaemonSet per pool");
    let help = agent_reads();
    // Set for the runtime or the logs, not for the agent's configuration.
    let not_config = [
        env::POD_NAME,
        env::POD_NAMESPACE,
        env::NVIDIA_VISIBLE_DEVICES,
        env::NVIDIA_DRIVER_CAPABILITIES,
        env::CUDA_CACHE_PATH,
        env::NODE_NAME,
        env::POD_IP,
    ];
    for ds in daemonsets {
        let vars = resolve(ds, &config_maps);
        for name in vars.keys() {
            assert!(
                env::RESERVED.contains(&name.as_str()) || name == env::LOG,
                "the operator sets {name}, which is not in the contract"
            );
            if !not_config.contains(&name.as_str()) {
                assert!(
                    help.contains(&format!("[env: {name}="))
                        || help.contains(&format!("[env: {name}]")),
                    "the operator sets {name}, which `kvfabric agent` does not read"
                );
            }
        }
        let out = Command::new(kvfabric_e2e::kvfabric_bin())
            .args(["agent", "--check-config"])
            .env_clear()
            .envs(&vars)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the agent refused the operator's environment {vars:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ns = ds["metadata"]["namespace"].as_str().unwrap();
        let fabric = &vars[env::FABRIC];
        assert_eq!(got["namespace"], ns);
        assert_eq!(got["fabric"], fabric.as_str());
        assert_eq!(got["pool"], vars[env::POOL].as_str());
        assert_eq!(got["name"], "gpu-node-1", "named after its node");
        assert_eq!(got["socket_dir"], contract::socket::DEFAULT_DIR);
        assert_eq!(got["peer_token"], true);
        let root = contract::registry_root(&vars[env::ETCD_KEY_PREFIX], ns, fabric) + "/";
        assert_eq!(got["registry"]["root"], root.as_str(), "{got}");
        assert_eq!(
            got["socket_mode"],
            vars[env::SOCKET_MODE].trim_start_matches('0')
        );
    }
}
