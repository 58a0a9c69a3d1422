//! The fabric's ConfigMap: what every agent needs to join the registry, as environment-style keys
//! the agent container loads with `envFrom`. Only what the agents read belongs here: every key
//! is part of the config hash, and a change of it restarts every agent of the fabric.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kvfabric_crds::TransferFabric;
use sha2::{Digest, Sha256};

use crate::Result;
use crate::contract::env;
use crate::meta::{child_meta, configmap_name, fabric_labels, name_and_namespace};

/// The desired ConfigMap `<fabric>-config`.
pub fn desired_configmap(fabric: &TransferFabric) -> Result<ConfigMap> {
    let (name, ns) = name_and_namespace(fabric)?;
    let spec = &fabric.spec;
    let mut data = BTreeMap::from([
        (env::FABRIC.to_owned(), name.clone()),
        (
            env::ETCD_ENDPOINTS.to_owned(),
            spec.etcd.endpoints.join(","),
        ),
        (env::NAMESPACE.to_owned(), ns.clone()),
        (
            env::ETCD_KEY_PREFIX.to_owned(),
            spec.etcd.key_prefix.clone(),
        ),
        (
            env::TRANSPORTS.to_owned(),
            spec.transports
                .iter()
                .map(|t| t.as_str())
                .collect::<Vec<_>>()
                .join(","),
        ),
    ]);
    if let Some(tracing) = &spec.tracing {
        if let Some(endpoint) = &tracing.otlp_endpoint {
            data.insert(env::OTLP_ENDPOINT.to_owned(), endpoint.clone());
        }
        data.insert(
            env::TRACE_SAMPLE_RATIO.to_owned(),
            tracing.sample_ratio.to_string(),
        );
    }
    Ok(ConfigMap {
        metadata: child_meta(fabric, configmap_name(&name), fabric_labels(&name))?,
        data: Some(data),
        ..ConfigMap::default()
    })
}

/// SHA-256 (hex) over the ConfigMap's data, key by key in order, each key and value
/// length-prefixed so no two maps hash alike.
pub fn config_hash(cm: &ConfigMap) -> String {
    let mut h = Sha256::new();
    for (k, v) in cm.data.iter().flatten() {
        for part in [k, v] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{full, minimal};

    #[test]
    fn every_field_lands() {
        let cm = desired_configmap(&full()).expect("builds");
        assert_eq!(cm.metadata.name.as_deref(), Some("tf-config"));
        assert!(cm.metadata.owner_references.is_some());
        let d = cm.data.expect("data");
        assert_eq!(d[env::FABRIC], "tf");
        assert_eq!(
            d[env::ETCD_ENDPOINTS],
            "http://etcd-0:2379,http://etcd-1:2379"
        );
        assert_eq!(d[env::TRANSPORTS], "rdma,cuda-ipc,tcp");
        assert_eq!(d[env::OTLP_ENDPOINT], "http://otel-collector:4317");
        assert_eq!(d[env::TRACE_SAMPLE_RATIO], "0.25");
        // Every key must be a valid environment variable name for envFrom.
        for k in d.keys() {
            assert!(k.chars().all(|c| c.is_ascii_uppercase() || c == '_'), "{k}");
        }
    }

    #[test]
    fn the_agents_are_told_their_namespace() {
        let mut f = full();
        let a = desired_configmap(&f).expect("builds").data.expect("data");
        assert_eq!(a[env::ETCD_KEY_PREFIX], "/kvfabric");
        assert_eq!(a[env::NAMESPACE], "llm");
        f.metadata.namespace = Some("team-b".into());
        let b = desired_configmap(&f).expect("builds").data.expect("data");
        assert_eq!(b[env::NAMESPACE], "team-b");
        // So their registry roots differ.
        let root = |d: &BTreeMap<String, String>| {
            crate::contract::registry_root(&d[env::ETCD_KEY_PREFIX], &d[env::NAMESPACE], "x")
        };
        assert_ne!(root(&a), root(&b));
    }

    #[test]
    fn tracing_keys_absent_without_tracing() {
        let d = desired_configmap(&minimal())
            .expect("builds")
            .data
            .expect("data");
        assert!(!d.contains_key(env::OTLP_ENDPOINT));
        assert!(!d.contains_key(env::TRACE_SAMPLE_RATIO));
        assert_eq!(d[env::TRANSPORTS], "rdma,cuda-ipc,shm,tcp");
    }

    #[test]
    fn the_hash_follows_what_the_agents_read_and_nothing_else() {
        let base = full();
        let h = |f: &TransferFabric| config_hash(&desired_configmap(f).expect("builds"));
        let h0 = h(&base);
        assert_eq!(h0.len(), 64);
        assert_eq!(h0, h(&base.clone()), "stable");
        let mut endpoints = base.clone();
        endpoints
            .spec
            .etcd
            .endpoints
            .push("http://etcd-2:2379".into());
        let mut transports = base.clone();
        transports.spec.transports.pop();
        let mut tracing = base.clone();
        if let Some(t) = tracing.spec.tracing.as_mut() {
            t.sample_ratio = 0.5;
        }
        for changed in [&endpoints, &transports, &tracing] {
            assert_ne!(h(changed), h0);
        }
        // A new pool must not restart the agents of the others.
        let mut pools = base.clone();
        pools.spec.pools.push(kvfabric_crds::Pool {
            name: "extra".into(),
            ..kvfabric_crds::Pool::default()
        });
        assert_eq!(h(&pools), h0);
        // Length prefixes: moving a character from a key into its value changes the hash.
        let cm = |k: &str, v: &str| ConfigMap {
            data: Some(BTreeMap::from([(k.to_owned(), v.to_owned())])),
            ..ConfigMap::default()
        };
        assert_ne!(config_hash(&cm("AB", "C")), config_hash(&cm("A", "BC")));
    }
}
