//! The fabric's ConfigMap: what every agent needs to join the registry, as environment-style keys
//! so the same map works with `envFrom` and as files under the config mount.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use kvfabric_crds::TransferFabric;

use crate::meta::{child_meta, configmap_name, fabric_labels, name_and_namespace};
use crate::{Error, Result};

/// Key: fabric name.
pub const KEY_FABRIC: &str = "KVFABRIC_FABRIC";
/// Key: comma-separated etcd endpoints.
pub const KEY_ETCD_ENDPOINTS: &str = "KVFABRIC_ETCD_ENDPOINTS";
/// Key: etcd key prefix.
pub const KEY_ETCD_KEY_PREFIX: &str = "KVFABRIC_ETCD_KEY_PREFIX";
/// Key: comma-separated transports in order of preference.
pub const KEY_TRANSPORTS: &str = "KVFABRIC_TRANSPORTS";
/// Key: OTLP endpoint (absent when tracing is off).
pub const KEY_OTLP_ENDPOINT: &str = "KVFABRIC_OTLP_ENDPOINT";
/// Key: trace sample ratio.
pub const KEY_TRACE_SAMPLE_RATIO: &str = "KVFABRIC_TRACE_SAMPLE_RATIO";
/// Key: JSON list of `{name, role}` of every pool.
pub const KEY_POOLS: &str = "KVFABRIC_POOLS";

/// The desired ConfigMap `<fabric>-config`.
pub fn desired_configmap(fabric: &TransferFabric) -> Result<ConfigMap> {
    let (name, _) = name_and_namespace(fabric)?;
    let spec = &fabric.spec;
    let pools: Vec<_> = spec
        .pools
        .iter()
        .map(|p| serde_json::json!({"name": p.name, "role": p.role.as_str()}))
        .collect();
    let mut data = BTreeMap::from([
        (KEY_FABRIC.to_owned(), name.clone()),
        (KEY_ETCD_ENDPOINTS.to_owned(), spec.etcd.endpoints.join(",")),
        (KEY_ETCD_KEY_PREFIX.to_owned(), spec.etcd.key_prefix.clone()),
        (
            KEY_TRANSPORTS.to_owned(),
            spec.transports
                .iter()
                .map(|t| t.as_str())
                .collect::<Vec<_>>()
                .join(","),
        ),
        (
            KEY_POOLS.to_owned(),
            serde_json::to_string(&pools).map_err(|source| Error::Serialize {
                what: "pool list",
                source,
            })?,
        ),
    ]);
    if let Some(tracing) = &spec.tracing {
        if let Some(endpoint) = &tracing.otlp_endpoint {
            data.insert(KEY_OTLP_ENDPOINT.to_owned(), endpoint.clone());
        }
        data.insert(
            KEY_TRACE_SAMPLE_RATIO.to_owned(),
            tracing.sample_ratio.to_string(),
        );
    }
    Ok(ConfigMap {
        metadata: child_meta(fabric, configmap_name(&name), fabric_labels(&name))?,
        data: Some(data),
        ..ConfigMap::default()
    })
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
        assert_eq!(d[KEY_FABRIC], "tf");
        assert_eq!(
            d[KEY_ETCD_ENDPOINTS],
            "http://etcd-0:2379,http://etcd-1:2379"
        );
        assert_eq!(d[KEY_ETCD_KEY_PREFIX], "/kvfabric");
        assert_eq!(d[KEY_TRANSPORTS], "rdma,cuda-ipc,tcp");
        assert_eq!(d[KEY_OTLP_ENDPOINT], "http://otel-collector:4317");
        assert_eq!(d[KEY_TRACE_SAMPLE_RATIO], "0.25");
        let pools: serde_json::Value = serde_json::from_str(&d[KEY_POOLS]).expect("json");
        assert_eq!(
            pools,
            serde_json::json!([{"name":"prefill","role":"Prefill"},{"name":"decode","role":"Decode"}])
        );
        // Every key must be a valid environment variable name for envFrom.
        for k in d.keys() {
            assert!(k.chars().all(|c| c.is_ascii_uppercase() || c == '_'), "{k}");
        }
    }

    #[test]
    fn tracing_keys_absent_without_tracing() {
        let d = desired_configmap(&minimal())
            .expect("builds")
            .data
            .expect("data");
        assert!(!d.contains_key(KEY_OTLP_ENDPOINT));
        assert!(!d.contains_key(KEY_TRACE_SAMPLE_RATIO));
        assert_eq!(d[KEY_TRANSPORTS], "rdma,cuda-ipc,shm,tcp");
    }
}
