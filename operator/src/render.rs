//! `kvfabric-operator render`: every object the operator would apply for the TransferFabrics in
//! a file, as YAML, through the same builders the controller uses. Users review or diff it
//! before applying a fabric; the chart checks validate it against the Kubernetes schemas.

use std::path::Path;

use kvfabric_crds::TransferFabric;
use serde::Deserialize;
use serde_json::Value;

use crate::config::AgentSettings;
use crate::configmap::{config_hash, desired_configmap};
use crate::daemonset::desired_daemonset;
use crate::network_policy::desired_network_policy;
use crate::service::desired_service;
use crate::service_account::desired_service_account;
use crate::{Error, Result, spec_checks};

/// Stands in for the uid the API server gives a new fabric (owner references need one).
pub const PLACEHOLDER_UID: &str = "00000000-0000-0000-0000-000000000000";

fn to_value<T: serde::Serialize>(what: &'static str, obj: &T) -> Result<Value> {
    serde_json::to_value(obj).map_err(|source| Error::Serialize { what, source })
}

/// The children of one fabric, in the order the controller applies them.
pub fn objects(fabric: &TransferFabric, settings: &AgentSettings) -> Result<Vec<Value>> {
    if let Some(e) = spec_checks::problems(fabric, settings).into_iter().next() {
        return Err(Error::InvalidSpec(e));
    }
    let configmap = desired_configmap(fabric)?;
    let hash = config_hash(&configmap);
    let mut out = vec![
        to_value("ServiceAccount", &desired_service_account(fabric)?)?,
        to_value("ConfigMap", &configmap)?,
        to_value("Service", &desired_service(fabric)?)?,
    ];
    if let Some(np) = desired_network_policy(fabric)? {
        out.push(to_value("NetworkPolicy", &np)?);
    }
    for pool in &fabric.spec.pools {
        out.push(to_value(
            "DaemonSet",
            &desired_daemonset(fabric, pool, settings, &hash)?,
        )?);
    }
    Ok(out)
}

/// The TransferFabric documents of a multi-document YAML text (other kinds are skipped), with
/// the uid the API server would add.
pub fn fabrics(file: &str, text: &str) -> Result<Vec<TransferFabric>> {
    let bad = |message: String| Error::Manifest {
        file: file.to_owned(),
        message,
    };
    let mut out = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc).map_err(|e| bad(format!("document {i}: {e}")))?;
        if value["kind"] != "TransferFabric" {
            continue;
        }
        let mut fabric: TransferFabric = serde_json::from_value(value)
            .map_err(|e| bad(format!("document {i}: not a TransferFabric: {e}")))?;
        if fabric.metadata.namespace.is_none() {
            return Err(bad(format!("document {i}: metadata.namespace is required")));
        }
        fabric
            .metadata
            .uid
            .get_or_insert_with(|| PLACEHOLDER_UID.to_owned());
        out.push(fabric);
    }
    if out.is_empty() {
        return Err(bad("holds no TransferFabric".to_owned()));
    }
    Ok(out)
}

/// `render --file`: the objects of every fabric in `path`, as one multi-document YAML text.
pub fn render_file(path: &Path, settings: &AgentSettings) -> Result<String> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        action: format!("read {file}"),
        source,
    })?;
    let mut out = String::new();
    for fabric in fabrics(&file, &text)? {
        for obj in objects(&fabric, settings)? {
            let yaml = serde_yaml_ng::to_string(&obj).map_err(|e| Error::Manifest {
                file: file.clone(),
                message: format!("rendering YAML: {e}"),
            })?;
            out.push_str("---\n");
            out.push_str(&yaml);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::full;

    #[test]
    fn kinds_in_apply_order_with_api_versions() {
        let objs = objects(&full(), &AgentSettings::default()).expect("renders");
        let kinds: Vec<(&str, &str)> = objs
            .iter()
            .map(|o| {
                (
                    o["apiVersion"].as_str().unwrap_or_default(),
                    o["kind"].as_str().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("v1", "ServiceAccount"),
                ("v1", "ConfigMap"),
                ("v1", "Service"),
                ("networking.k8s.io/v1", "NetworkPolicy"),
                ("apps/v1", "DaemonSet"),
                ("apps/v1", "DaemonSet"),
            ]
        );
    }

    #[test]
    fn invalid_fabrics_are_refused_not_rendered() {
        let mut f = full();
        f.spec.agent.host_network = true;
        let e = objects(&f, &AgentSettings::default()).expect_err("hostNetwork with networks");
        assert!(e.to_string().contains("spec.agent.networks"), "{e}");
    }

    #[test]
    fn fabrics_are_read_from_multi_document_yaml() {
        let text = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: llm\n---\napiVersion: kvfabric.io/v1alpha1\nkind: TransferFabric\nmetadata:\n  name: tf\n  namespace: llm\nspec:\n  pools: [{name: p}]\n  etcd: {endpoints: [\"http://etcd:2379\"]}\n";
        let f = fabrics("x.yaml", text).expect("reads");
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].metadata.uid.as_deref(), Some(PLACEHOLDER_UID));
        let e = fabrics(
            "x.yaml",
            "kind: TransferFabric\nmetadata: {name: tf}\nspec: {}\n",
        )
        .expect_err("no namespace");
        assert!(e.to_string().contains("metadata.namespace"), "{e}");
        assert!(fabrics("x.yaml", "kind: Namespace\n").is_err());
    }
}
