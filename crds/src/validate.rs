//! Checks the apiserver would have made had the object passed through the CRD schema. Objects can
//! bypass it (an older CRD, `--validate=false` on a webhook-less dry path, direct etcd writes), so
//! the reconciler repeats them and reports a typed error instead of building broken DaemonSets.

use std::collections::HashSet;

use crate::{Error, Result, TransferFabricSpec, Transport};

/// Longest pool name: `<fabric>-<pool>-agent` must stay a valid object name and label value.
pub const MAX_POOL_NAME: usize = 40;

fn is_dns_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

impl TransferFabricSpec {
    /// Every problem in the spec, each naming the field and its value.
    pub fn problems(&self) -> Vec<Error> {
        let mut out = Vec::new();

        if self.pools.is_empty() {
            out.push(Error::invalid(
                "spec.pools",
                "[]",
                "at least one pool is required",
            ));
        }
        let mut seen = HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let field = format!("spec.pools[{i}].name");
            if !is_dns_label(&pool.name) {
                out.push(Error::invalid(&field, &pool.name, "must be a DNS label"));
            } else if pool.name.len() > MAX_POOL_NAME {
                out.push(Error::invalid(
                    &field,
                    &pool.name,
                    format!("must be at most {MAX_POOL_NAME} characters"),
                ));
            }
            if !seen.insert(pool.name.as_str()) {
                out.push(Error::invalid(&field, &pool.name, "duplicate pool name"));
            }
        }

        if self.agent.image.trim().is_empty() {
            out.push(Error::invalid(
                "spec.agent.image",
                &self.agent.image,
                "an image is required",
            ));
        }
        if let Some(rdma) = &self.agent.rdma {
            if rdma.count < 1 {
                out.push(Error::invalid(
                    "spec.agent.rdma.count",
                    rdma.count,
                    "must be at least 1",
                ));
            }
            if rdma.resource_name.trim().is_empty() {
                out.push(Error::invalid(
                    "spec.agent.rdma.resourceName",
                    &rdma.resource_name,
                    "a device plugin resource name is required",
                ));
            }
        }
        for (i, net) in self.agent.networks.iter().enumerate() {
            if net.trim().is_empty() {
                out.push(Error::invalid(
                    format!("spec.agent.networks[{i}]"),
                    net,
                    "must not be empty",
                ));
            }
        }

        if self.transports.is_empty() {
            out.push(Error::invalid(
                "spec.transports",
                "[]",
                "at least one transport is required",
            ));
        }
        let mut seen = HashSet::new();
        for (i, t) in self.transports.iter().enumerate() {
            let field = format!("spec.transports[{i}]");
            if let Transport::Unknown(v) = t {
                out.push(Error::invalid(
                    &field,
                    v,
                    "unknown transport; expected one of rdma, cuda-ipc, shm, tcp",
                ));
            }
            if !seen.insert(t) {
                out.push(Error::invalid(&field, t, "duplicate transport"));
            }
        }

        if self.etcd.endpoints.is_empty() {
            out.push(Error::invalid(
                "spec.etcd.endpoints",
                "[]",
                "at least one endpoint is required",
            ));
        }
        for (i, e) in self.etcd.endpoints.iter().enumerate() {
            if e.trim().is_empty() {
                out.push(Error::invalid(
                    format!("spec.etcd.endpoints[{i}]"),
                    e,
                    "must not be empty",
                ));
            }
        }
        if !self.etcd.key_prefix.starts_with('/') {
            out.push(Error::invalid(
                "spec.etcd.keyPrefix",
                &self.etcd.key_prefix,
                "must start with '/'",
            ));
        }

        if let Some(tracing) = &self.tracing
            && !(0.0..=1.0).contains(&tracing.sample_ratio)
        {
            out.push(Error::invalid(
                "spec.tracing.sampleRatio",
                tracing.sample_ratio,
                "must be between 0.0 and 1.0",
            ));
        }
        out
    }

    /// The first problem of [`Self::problems`], if any.
    pub fn validate(&self) -> Result<()> {
        match self.problems().into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AgentSpec, EtcdSpec, Pool, PoolRole, RdmaSpec, TracingSpec};

    fn spec() -> TransferFabricSpec {
        TransferFabricSpec {
            pools: vec![
                Pool {
                    name: "prefill".into(),
                    role: PoolRole::Prefill,
                    ..Pool::default()
                },
                Pool {
                    name: "decode".into(),
                    role: PoolRole::Decode,
                    ..Pool::default()
                },
            ],
            agent: AgentSpec {
                image: "kvfabric/agent:0.1.0".into(),
                ..AgentSpec::default()
            },
            transports: Transport::KNOWN.to_vec(),
            etcd: EtcdSpec {
                endpoints: vec!["http://etcd:2379".into()],
                ..EtcdSpec::default()
            },
            peer_token_secret: None,
            tracing: None,
        }
    }

    fn messages(s: &TransferFabricSpec) -> Vec<String> {
        s.problems().iter().map(ToString::to_string).collect()
    }

    #[test]
    fn good_spec_has_no_problems() {
        assert!(spec().validate().is_ok());
    }

    #[test]
    fn duplicate_pool_names_name_the_field_and_value() {
        let mut s = spec();
        s.pools[1].name = "prefill".into();
        let m = messages(&s);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(m[0].contains("spec.pools[1].name"), "{m:?}");
        assert!(m[0].contains("\"prefill\""), "{m:?}");
        assert!(m[0].contains("duplicate"), "{m:?}");
    }

    #[test]
    fn bad_pool_names() {
        let mut s = spec();
        s.pools[0].name = "Bad_Name".into();
        s.pools[1].name = "a".repeat(41);
        let m = messages(&s);
        assert!(
            m.iter()
                .any(|e| e.contains("spec.pools[0].name") && e.contains("DNS label"))
        );
        assert!(
            m.iter()
                .any(|e| e.contains("spec.pools[1].name") && e.contains("at most 40"))
        );
    }

    #[test]
    fn no_pools() {
        let mut s = spec();
        s.pools.clear();
        assert!(messages(&s)[0].contains("spec.pools"));
    }

    #[test]
    fn unknown_and_duplicate_transports() {
        let mut s = spec();
        s.transports = vec![
            Transport::from("carrier-pigeon".to_owned()),
            Transport::Tcp,
            Transport::Tcp,
        ];
        let m = messages(&s);
        assert!(
            m.iter()
                .any(|e| e.contains("spec.transports[0]") && e.contains("carrier-pigeon"))
        );
        assert!(
            m.iter()
                .any(|e| e.contains("spec.transports[2]") && e.contains("duplicate"))
        );
        s.transports.clear();
        assert!(messages(&s)[0].contains("spec.transports"));
    }

    #[test]
    fn rdma_count_must_be_positive() {
        for count in [0, -3] {
            let mut s = spec();
            s.agent.rdma = Some(RdmaSpec {
                resource_name: "rdma/hca_shared_devices_a".into(),
                count,
            });
            let m = messages(&s);
            assert_eq!(m.len(), 1);
            assert!(m[0].contains("spec.agent.rdma.count") && m[0].contains(&count.to_string()));
        }
        let mut s = spec();
        s.agent.rdma = Some(RdmaSpec {
            resource_name: " ".into(),
            count: 1,
        });
        assert!(messages(&s)[0].contains("spec.agent.rdma.resourceName"));
    }

    #[test]
    fn image_required() {
        let mut s = spec();
        s.agent.image = "  ".into();
        assert!(messages(&s)[0].contains("spec.agent.image"));
    }

    #[test]
    fn etcd_and_tracing() {
        let mut s = spec();
        s.etcd.endpoints.clear();
        s.etcd.key_prefix = "kvfabric".into();
        s.tracing = Some(TracingSpec {
            otlp_endpoint: None,
            sample_ratio: 1.5,
        });
        let m = messages(&s);
        assert!(m.iter().any(|e| e.contains("spec.etcd.endpoints")));
        assert!(
            m.iter()
                .any(|e| e.contains("spec.etcd.keyPrefix") && e.contains("kvfabric"))
        );
        assert!(
            m.iter()
                .any(|e| e.contains("spec.tracing.sampleRatio") && e.contains("1.5"))
        );
    }

    #[test]
    fn unknown_transport_survives_deserialization() {
        let t: Vec<Transport> = serde_json::from_str(r#"["rdma","warp"]"#).expect("json");
        assert_eq!(t, vec![Transport::Rdma, Transport::Unknown("warp".into())]);
        assert_eq!(
            serde_json::to_string(&t).expect("json"),
            r#"["rdma","warp"]"#
        );
    }
}
