//! Names, labels and owner references shared by every child object.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use kvfabric_crds::TransferFabric;

use crate::{Error, Result};

/// The single field manager of every server-side apply the operator makes.
pub const MANAGER: &str = "kvfabric-operator";
/// Label naming the fabric a child belongs to; also how stale DaemonSets are found.
pub const FABRIC_LABEL: &str = "kvfabric.io/fabric";
/// Label naming the pool of an agent DaemonSet and its pods.
pub const POOL_LABEL: &str = "kvfabric.io/pool";
/// Standard component label.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";

/// Name of the fabric's ConfigMap.
pub fn configmap_name(fabric: &str) -> String {
    format!("{fabric}-config")
}

/// Name of the agents' ServiceAccount.
pub fn service_account_name(fabric: &str) -> String {
    format!("{fabric}-agent")
}

/// Name of the headless Service in front of the agents.
pub fn service_name(fabric: &str) -> String {
    format!("{fabric}-agents")
}

/// Name of the NetworkPolicy in front of the agents.
pub fn network_policy_name(fabric: &str) -> String {
    format!("{fabric}-agents")
}

/// Name of a pool's DaemonSet.
pub fn daemonset_name(fabric: &str, pool: &str) -> String {
    format!("{fabric}-{pool}-agent")
}

/// Labels on every child of a fabric: Kubernetes' recommended ones (the fabric is the
/// instance, kvfabric the application it is part of, the operator's version the version).
pub fn fabric_labels(fabric: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_owned(),
            "kvfabric-agent".to_owned(),
        ),
        ("app.kubernetes.io/instance".to_owned(), fabric.to_owned()),
        (
            "app.kubernetes.io/part-of".to_owned(),
            "kvfabric".to_owned(),
        ),
        (
            "app.kubernetes.io/version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        ),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGER.to_owned(),
        ),
        (COMPONENT_LABEL.to_owned(), "agent".to_owned()),
        (FABRIC_LABEL.to_owned(), fabric.to_owned()),
    ])
}

/// The fabric's agent pods, and nothing else: workers may carry the fabric label too (to be
/// let through its NetworkPolicy), so the component label is part of every agent selector.
pub fn agent_selector(fabric: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (FABRIC_LABEL.to_owned(), fabric.to_owned()),
        (COMPONENT_LABEL.to_owned(), "agent".to_owned()),
    ])
}

/// Selector labels of one pool's agent pods (immutable once the DaemonSet exists).
pub fn pool_selector(fabric: &str, pool: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (FABRIC_LABEL.to_owned(), fabric.to_owned()),
        (POOL_LABEL.to_owned(), pool.to_owned()),
    ])
}

/// Name and namespace of a fabric, or an error naming what is missing.
pub fn name_and_namespace(fabric: &TransferFabric) -> Result<(String, String)> {
    let ns = fabric.namespace().ok_or(Error::MissingField {
        field: "metadata.namespace",
    })?;
    let name = fabric.meta().name.clone().ok_or(Error::MissingField {
        field: "metadata.name",
    })?;
    Ok((name, ns))
}

/// Metadata of a child: name, namespace, labels and a controller owner reference, so the
/// garbage collector removes children with the fabric and `Controller::owns` maps them back.
pub fn child_meta(
    fabric: &TransferFabric,
    name: String,
    labels: BTreeMap<String, String>,
) -> Result<ObjectMeta> {
    let (_, ns) = name_and_namespace(fabric)?;
    let mut owner: OwnerReference =
        fabric
            .controller_owner_ref(&())
            .ok_or(Error::MissingField {
                field: "metadata.uid",
            })?;
    // Foreground deletion of the fabric then waits for its children; this is why the ClusterRole
    // grants `update` on transferfabrics/finalizers (OwnerReferencesPermissionEnforcement).
    owner.block_owner_deletion = Some(true);
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(ns),
        labels: Some(labels),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_carry_the_recommended_labels_and_agent_selectors_only_agents() {
        let l = fabric_labels("tf");
        for (k, v) in [
            ("app.kubernetes.io/name", "kvfabric-agent"),
            ("app.kubernetes.io/instance", "tf"),
            ("app.kubernetes.io/part-of", "kvfabric"),
            ("app.kubernetes.io/version", env!("CARGO_PKG_VERSION")),
            ("app.kubernetes.io/managed-by", MANAGER),
        ] {
            assert_eq!(l.get(k).map(String::as_str), Some(v), "{k}");
        }
        // The selector is a subset of the agents' labels, and more than the fabric label.
        let sel = agent_selector("tf");
        assert!(sel.iter().all(|(k, v)| l.get(k) == Some(v)));
        assert!(sel.len() > 1 && sel.contains_key(COMPONENT_LABEL));
    }
}
