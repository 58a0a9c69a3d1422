//! Checks the apiserver would have made had the object passed through the CRD schema. Objects can
//! bypass it (an older CRD, `--validate=false` on a webhook-less dry path, direct etcd writes), so
//! the reconciler repeats them and reports a typed error instead of building broken DaemonSets.

use std::collections::HashSet;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::{Error, GpuMode, MAX_KEY_PREFIX, Result, TransferFabricSpec, Transport};

/// Longest pool name: `<fabric>-<pool>-agent` must stay a valid object name and label value.
pub const MAX_POOL_NAME: usize = 40;

use kvfabric_proto::contract::is_dns_label;

/// Longest fabric name: `<fabric>-agents`, the agents' Service, is a DNS-1035 label (≤ 63).
pub const MAX_FABRIC_NAME: usize = 56;

/// The CRD's CEL rule for the fabric's name, the same check as [`fabric_name_problem`]: the
/// API server accepts any DNS subdomain as a custom resource's name, but the Service the
/// operator derives from it needs a DNS-1035 label.
pub const FABRIC_NAME_RULE: &str =
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 56";

/// Why `name` cannot name a fabric, if it cannot: it must be a DNS-1035 label of at most
/// [`MAX_FABRIC_NAME`] characters (no dots, starting with a letter).
pub fn fabric_name_problem(name: &str) -> Option<Error> {
    let ok = is_dns_label(name)
        && name.len() <= MAX_FABRIC_NAME
        && name.as_bytes()[0].is_ascii_lowercase();
    (!ok).then(|| {
        Error::invalid(
            "metadata.name",
            name,
            format!(
                "must be a DNS-1035 label of at most {MAX_FABRIC_NAME} characters (lower-case \
                 letters, digits and '-', starting with a letter): <name>-agents names the \
                 agents' Service"
            ),
        )
    })
}

/// The resource the agent must never take: every GPU stays schedulable for the workers.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

fn is_key_prefix(s: &str) -> bool {
    let Some(rest) = s.strip_prefix('/') else {
        return false;
    };
    let b = rest.as_bytes();
    s.len() <= MAX_KEY_PREFIX
        && !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// `<domain>/<name>` as the schema's pattern says: a lower-case domain and a name of
/// alphanumerics, '-', '_' and '.', each starting and ending alphanumeric.
fn is_extended_resource(s: &str) -> bool {
    let Some((domain, name)) = s.split_once('/') else {
        return false;
    };
    let ends_ok = |p: &[u8]| {
        !p.is_empty() && p[0].is_ascii_alphanumeric() && p[p.len() - 1].is_ascii_alphanumeric()
    };
    s.len() <= 253
        && ends_ok(domain.as_bytes())
        && ends_ok(name.as_bytes())
        && domain
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'-' | b'.'))
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A fully qualified CDI device name, `vendor.com/class=name`.
fn is_cdi_device(s: &str) -> bool {
    match s.split_once('=') {
        Some((kind, name)) => {
            is_extended_resource(kind)
                && !name.is_empty()
                && name
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b':'))
        }
        None => false,
    }
}

impl TransferFabricSpec {
    /// Every problem in the spec, each naming the field and its value.
    pub fn problems(&self) -> Vec<Error> {
        let mut out = Vec::new();
        self.pool_problems(&mut out);
        self.agent_problems(&mut out);
        self.transport_problems(&mut out);
        self.etcd_problems(&mut out);
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

    fn pool_problems(&self, out: &mut Vec<Error>) {
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
    }

    fn agent_problems(&self, out: &mut Vec<Error>) {
        let agent = &self.agent;
        if let Some(rdma) = &agent.rdma {
            if rdma.resources.is_empty() && agent.resource_claims.is_empty() {
                out.push(Error::invalid(
                    "spec.agent.rdma.resources",
                    "[]",
                    "rdma needs its devices: name device plugin resources, or resourceClaims that allocate them",
                ));
            }
            let mut seen = HashSet::new();
            for (i, r) in rdma.resources.iter().enumerate() {
                let field = format!("spec.agent.rdma.resources[{i}]");
                if !is_extended_resource(&r.resource_name) {
                    out.push(Error::invalid(
                        format!("{field}.resourceName"),
                        &r.resource_name,
                        "must be an extended resource name <domain>/<name>",
                    ));
                } else if r.resource_name == GPU_RESOURCE {
                    out.push(Error::invalid(
                        format!("{field}.resourceName"),
                        &r.resource_name,
                        "the agent never takes a GPU away from the workers",
                    ));
                }
                if !(1..=64).contains(&r.count) {
                    out.push(Error::invalid(
                        format!("{field}.count"),
                        r.count,
                        "must be between 1 and 64",
                    ));
                }
                if !seen.insert(r.resource_name.as_str()) {
                    out.push(Error::invalid(
                        format!("{field}.resourceName"),
                        &r.resource_name,
                        "duplicate resource",
                    ));
                }
            }
        }
        for (i, net) in agent.networks.iter().enumerate() {
            if net.trim().is_empty() {
                out.push(Error::invalid(
                    format!("spec.agent.networks[{i}]"),
                    net,
                    "must not be empty",
                ));
            }
        }
        if agent.host_network && !agent.networks.is_empty() {
            out.push(Error::invalid(
                "spec.agent.networks",
                agent.networks.join(","),
                "Multus never attaches networks to a hostNetwork pod: set hostNetwork false, or drop networks",
            ));
        }
        if let Some(res) = &agent.resources {
            for (kind, map) in [("limits", &res.limits), ("requests", &res.requests)] {
                if map.as_ref().is_some_and(|m| m.contains_key(GPU_RESOURCE)) {
                    out.push(Error::invalid(
                        format!("spec.agent.resources.{kind}"),
                        GPU_RESOURCE,
                        "the agent never takes a GPU away from the workers; see spec.agent.gpu",
                    ));
                }
            }
        }
        self.claim_problems(out);
        let gpu = &agent.gpu;
        if let Some(class) = &gpu.runtime_class_name
            && !is_dns_label(class)
        {
            out.push(Error::invalid(
                "spec.agent.gpu.runtimeClassName",
                class,
                "must be a DNS label",
            ));
        }
        if gpu.visible_devices.trim().is_empty() {
            out.push(Error::invalid(
                "spec.agent.gpu.visibleDevices",
                &gpu.visible_devices,
                "must not be empty (all, none, or a list of GPU UUIDs or indexes)",
            ));
        }
        let p = agent.ports;
        if p.grpc == p.data || p.grpc == p.metrics || p.data == p.metrics {
            out.push(Error::invalid(
                "spec.agent.ports",
                format!("grpc {}, data {}, metrics {}", p.grpc, p.data, p.metrics),
                "three different ports",
            ));
        }
        for (name, port) in p.named() {
            if !(1..=65535).contains(&port) {
                out.push(Error::invalid(
                    format!("spec.agent.ports.{name}"),
                    port,
                    "a TCP port, 1 to 65535",
                ));
            }
        }
        if let Some(m) = &agent.max_unavailable {
            let ok = match m {
                IntOrString::Int(n) => *n >= 1,
                IntOrString::String(p) => p
                    .strip_suffix('%')
                    .and_then(|n| n.parse::<u8>().ok())
                    .is_some_and(|n| (1..=100).contains(&n)),
            };
            if !ok {
                let shown = match m {
                    IntOrString::Int(n) => n.to_string(),
                    IntOrString::String(p) => p.clone(),
                };
                out.push(Error::invalid(
                    "spec.agent.maxUnavailable",
                    shown,
                    "a number of nodes (at least 1) or a percentage from 1% to 100%",
                ));
            }
        }
        if gpu.enabled && gpu.mode == GpuMode::Claim && agent.resource_claims.is_empty() {
            out.push(Error::invalid(
                "spec.agent.gpu.mode",
                "Claim",
                "Claim mode needs the claim that brings the GPUs in spec.agent.resourceClaims",
            ));
        }
        if gpu.enabled && gpu.mode == GpuMode::Cdi && gpu.cdi_devices.is_empty() {
            out.push(Error::invalid(
                "spec.agent.gpu.cdiDevices",
                "[]",
                "Cdi mode names at least one device (management.nvidia.com/gpu=all: every GPU)",
            ));
        }
        for (i, dev) in gpu.cdi_devices.iter().enumerate() {
            if !is_cdi_device(dev) {
                out.push(Error::invalid(
                    format!("spec.agent.gpu.cdiDevices[{i}]"),
                    dev,
                    "must be a fully qualified CDI device name, vendor.com/class=name",
                ));
            }
        }
        if !(1..=i64::from(i32::MAX)).contains(&agent.sockets.group) {
            out.push(Error::invalid(
                "spec.agent.sockets.group",
                agent.sockets.group,
                "must be a group id between 1 and 2147483647",
            ));
        }
    }

    fn claim_problems(&self, out: &mut Vec<Error>) {
        let agent = &self.agent;
        let mut names = HashSet::new();
        for (i, claim) in agent.resource_claims.iter().enumerate() {
            let field = format!("spec.agent.resourceClaims[{i}]");
            if !is_dns_label(&claim.name) {
                out.push(Error::invalid(
                    format!("{field}.name"),
                    &claim.name,
                    "must be a DNS label",
                ));
            }
            if !names.insert(claim.name.as_str()) {
                out.push(Error::invalid(
                    format!("{field}.name"),
                    &claim.name,
                    "duplicate claim name",
                ));
            }
            if claim.resource_claim_name.is_some() == claim.resource_claim_template_name.is_some() {
                out.push(Error::invalid(
                    &field,
                    &claim.name,
                    "name exactly one of resourceClaimName and resourceClaimTemplateName",
                ));
            }
        }
        let container_claims = agent
            .resources
            .as_ref()
            .and_then(|r| r.claims.as_ref())
            .into_iter()
            .flatten();
        for (i, c) in container_claims.enumerate() {
            if !names.contains(c.name.as_str()) {
                out.push(Error::invalid(
                    format!("spec.agent.resources.claims[{i}].name"),
                    &c.name,
                    "names no entry of spec.agent.resourceClaims",
                ));
            }
        }
    }

    fn transport_problems(&self, out: &mut Vec<Error>) {
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
    }

    fn etcd_problems(&self, out: &mut Vec<Error>) {
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
        if !is_key_prefix(&self.etcd.key_prefix) {
            out.push(Error::invalid(
                "spec.etcd.keyPrefix",
                &self.etcd.key_prefix,
                format!(
                    "must be '/' and one path segment of alphanumerics, '-', '.' and '_' (at most {MAX_KEY_PREFIX} characters): the namespace and fabric follow it"
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AgentSpec, EtcdSpec, Pool, PoolRole, RdmaResource, RdmaSpec, TracingSpec};
    use k8s_openapi::api::core::v1::{PodResourceClaim, ResourceClaim, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use std::collections::BTreeMap;

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
            agent: AgentSpec::default(),
            network_policy: Default::default(),
            transports: Transport::KNOWN.to_vec(),
            etcd: EtcdSpec {
                endpoints: vec!["http://etcd:2379".into()],
                ..EtcdSpec::default()
            },
            peer_token_secret: None,
            tls_secret: None,
            tracing: None,
        }
    }

    fn messages(s: &TransferFabricSpec) -> Vec<String> {
        s.problems().iter().map(ToString::to_string).collect()
    }

    fn rdma(names: &[&str]) -> Option<RdmaSpec> {
        Some(RdmaSpec {
            resources: names
                .iter()
                .map(|n| RdmaResource {
                    resource_name: (*n).into(),
                    count: 1,
                })
                .collect(),
        })
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
    fn rdma_resources_multi_rail() {
        let mut s = spec();
        s.agent.rdma = rdma(&["nvidia.com/sriov_rdma_rail0", "nvidia.com/sriov_rdma_rail1"]);
        assert!(s.validate().is_ok(), "{:?}", messages(&s));
        s.agent.rdma = rdma(&["rdma/rdma_shared_device_a", "rdma/rdma_shared_device_a"]);
        let m = messages(&s);
        assert!(
            m.iter()
                .any(|e| e.contains("spec.agent.rdma.resources[1].resourceName")
                    && e.contains("duplicate")),
            "{m:?}"
        );
        s.agent.rdma = rdma(&[]);
        assert!(messages(&s)[0].contains("spec.agent.rdma.resources"));
        // NICs from DRA: rdma without device plugin resources.
        s.agent.resource_claims = vec![PodResourceClaim {
            name: "nics".into(),
            resource_claim_template_name: Some("rdma-nics".into()),
            resource_claim_name: None,
        }];
        assert!(s.validate().is_ok(), "{:?}", messages(&s));
        s.agent.resource_claims.clear();
        for bad in ["no-domain", "Upper.Case/x", "a/-x", "a/b c"] {
            s.agent.rdma = rdma(&[bad]);
            let m = messages(&s);
            assert!(
                m.iter()
                    .any(|e| e.contains("resourceName") && e.contains(bad)),
                "{bad}: {m:?}"
            );
        }
        s.agent.rdma = rdma(&[GPU_RESOURCE]);
        assert!(messages(&s)[0].contains("never takes a GPU"));
    }

    #[test]
    fn rdma_count_bounds() {
        for count in [0, -3, 65] {
            let mut s = spec();
            s.agent.rdma = Some(RdmaSpec {
                resources: vec![RdmaResource {
                    resource_name: "rdma/rdma_shared_device_a".into(),
                    count,
                }],
            });
            let m = messages(&s);
            assert_eq!(m.len(), 1, "{m:?}");
            assert!(
                m[0].contains("spec.agent.rdma.resources[0].count")
                    && m[0].contains(&count.to_string())
            );
        }
    }

    #[test]
    fn host_network_with_multus_networks_is_refused() {
        let mut s = spec();
        s.agent.networks = vec!["sriov-rail0".into()];
        assert!(s.validate().is_ok());
        s.agent.host_network = true;
        let m = messages(&s);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(
            m[0].contains("spec.agent.networks") && m[0].contains("hostNetwork"),
            "{m:?}"
        );
    }

    fn claim(name: &str, template: Option<&str>, claim: Option<&str>) -> PodResourceClaim {
        PodResourceClaim {
            name: name.into(),
            resource_claim_template_name: template.map(Into::into),
            resource_claim_name: claim.map(Into::into),
        }
    }

    #[test]
    fn resource_claims() {
        let mut s = spec();
        s.agent.resource_claims = vec![claim("rdma-nics", Some("rdma-nics"), None)];
        assert!(s.validate().is_ok());
        s.agent.resource_claims = vec![
            claim("both", Some("t"), Some("c")),
            claim("neither", None, None),
            claim("Bad_Name", Some("t"), None),
        ];
        let m = messages(&s);
        assert!(
            m.iter()
                .any(|e| e.contains("spec.agent.resourceClaims[0]") && e.contains("exactly one")),
            "{m:?}"
        );
        assert!(
            m.iter()
                .any(|e| e.contains("spec.agent.resourceClaims[1]") && e.contains("exactly one")),
            "{m:?}"
        );
        assert!(
            m.iter()
                .any(|e| e.contains("spec.agent.resourceClaims[2].name")),
            "{m:?}"
        );

        // A container claim must name a pod claim, or the API server rejects the DaemonSet.
        let mut s = spec();
        s.agent.resources = Some(ResourceRequirements {
            claims: Some(vec![ResourceClaim {
                name: "gpus".into(),
                request: None,
            }]),
            ..ResourceRequirements::default()
        });
        let m = messages(&s);
        assert!(
            m.iter()
                .any(|e| e.contains("spec.agent.resources.claims[0].name") && e.contains("gpus")),
            "{m:?}"
        );
        s.agent.resource_claims = vec![claim("gpus", Some("all-gpus-admin"), None)];
        assert!(s.validate().is_ok(), "{:?}", messages(&s));
    }

    #[test]
    fn the_agent_never_requests_a_gpu() {
        let mut s = spec();
        s.agent.resources = Some(ResourceRequirements {
            limits: Some(BTreeMap::from([(
                GPU_RESOURCE.into(),
                Quantity("1".into()),
            )])),
            ..ResourceRequirements::default()
        });
        let m = messages(&s);
        assert!(m[0].contains("spec.agent.resources.limits"), "{m:?}");
    }

    #[test]
    fn fabric_names_are_dns_1035_labels_short_enough_for_the_service() {
        for ok in ["a", "tf", "llama-70b", &"a".repeat(MAX_FABRIC_NAME)] {
            assert!(fabric_name_problem(ok).is_none(), "{ok}");
        }
        for bad in [
            "llama.70b",
            "7b",
            "-a",
            "a-",
            "Llama",
            "",
            &"a".repeat(MAX_FABRIC_NAME + 1),
        ] {
            let e = fabric_name_problem(bad).expect(bad).to_string();
            assert!(e.contains("metadata.name"), "{e}");
        }
        // The CRD's rule carries the same bound.
        assert!(FABRIC_NAME_RULE.contains(&format!("<= {MAX_FABRIC_NAME}")));
    }

    #[test]
    fn ports_are_three_different_tcp_ports() {
        let mut s = spec();
        s.agent.ports.data = s.agent.ports.grpc;
        let m = messages(&s);
        assert!(m.len() == 1 && m[0].contains("spec.agent.ports"), "{m:?}");
        let mut s = spec();
        s.agent.ports.metrics = 70000;
        let m = messages(&s);
        assert!(
            m.len() == 1 && m[0].contains("spec.agent.ports.metrics"),
            "{m:?}"
        );
    }

    #[test]
    fn max_unavailable_is_a_count_or_a_percentage() {
        for (v, ok) in [
            (IntOrString::Int(1), true),
            (IntOrString::String("25%".into()), true),
            (IntOrString::Int(0), false),
            (IntOrString::String("0%".into()), false),
            (IntOrString::String("150%".into()), false),
            (IntOrString::String("two".into()), false),
        ] {
            let mut s = spec();
            s.agent.max_unavailable = Some(v.clone());
            let m = messages(&s);
            assert_eq!(m.is_empty(), ok, "{v:?}: {m:?}");
            assert!(m.iter().all(|e| e.contains("spec.agent.maxUnavailable")));
        }
    }

    #[test]
    fn gpu_fields() {
        let mut s = spec();
        s.agent.gpu.enabled = true;
        s.agent.gpu.cdi_devices = vec!["nvidia.com/gpu=all".into(), "nvidia.com/gpu".into()];
        s.agent.gpu.runtime_class_name = Some("Nvidia Runtime".into());
        s.agent.gpu.visible_devices = " ".into();
        let m = messages(&s);
        assert_eq!(m.len(), 3, "{m:?}");
        assert!(
            m.iter().any(|e| e.contains("spec.agent.gpu.cdiDevices[1]")),
            "{m:?}"
        );
        assert!(
            m.iter()
                .any(|e| e.contains("spec.agent.gpu.runtimeClassName")),
            "{m:?}"
        );
        assert!(
            m.iter()
                .any(|e| e.contains("spec.agent.gpu.visibleDevices")),
            "{m:?}"
        );
        let mut none = spec();
        none.agent.gpu.enabled = true;
        none.agent.gpu.cdi_devices.clear();
        let m = messages(&none);
        assert!(
            m.len() == 1 && m[0].contains("spec.agent.gpu.cdiDevices"),
            "{m:?}"
        );
        none.agent.gpu.mode = GpuMode::Env;
        assert!(messages(&none).is_empty(), "Env mode names no CDI device");
        none.agent.gpu.mode = GpuMode::Claim;
        let m = messages(&none);
        assert!(
            m.len() == 1 && m[0].contains("spec.agent.gpu.mode"),
            "{m:?}"
        );
    }

    #[test]
    fn socket_group_range() {
        let mut s = spec();
        for group in [0, -1, 1 << 31] {
            s.agent.sockets.group = group;
            assert!(messages(&s)[0].contains("spec.agent.sockets.group"));
        }
    }

    #[test]
    fn key_prefix_is_one_segment() {
        let mut s = spec();
        for good in ["/kvfabric", "/kv-fabric.prod_1", "/a"] {
            s.etcd.key_prefix = good.into();
            assert!(s.validate().is_ok(), "{good}");
        }
        // A prefix with more segments could spell another namespace's keys:
        // `/kvfabric/ns-b` + `ns-a` + fabric vs `/kvfabric` + `ns-b` + fabric `ns-a`.
        for bad in [
            "kvfabric",
            "/",
            "/kvfabric/",
            "/kvfabric/other-ns",
            "/-x",
            &format!("/{}", "a".repeat(64)),
        ] {
            s.etcd.key_prefix = bad.into();
            let m = messages(&s);
            assert!(
                m.iter().any(|e| e.contains("spec.etcd.keyPrefix")),
                "{bad}: {m:?}"
            );
        }
    }

    #[test]
    fn etcd_and_tracing() {
        let mut s = spec();
        s.etcd.endpoints.clear();
        s.tracing = Some(TracingSpec {
            otlp_endpoint: None,
            sample_ratio: 1.5,
        });
        let m = messages(&s);
        assert!(m.iter().any(|e| e.contains("spec.etcd.endpoints")));
        assert!(
            m.iter()
                .any(|e| e.contains("spec.tracing.sampleRatio") && e.contains("1.5"))
        );
    }

    #[test]
    fn long_values_are_cut_when_echoed() {
        let mut s = spec();
        s.pools[0].name = "X".repeat(10_000);
        let m = messages(&s);
        assert!(m[0].len() < 300, "{}", m[0].len());
        assert!(m[0].contains('…'));
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
