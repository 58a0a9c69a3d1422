//! What the operator refuses beyond the CRD's own checks ([`TransferFabricSpec::problems`]):
//! what depends on the operator's contract with the agent or on the cluster it runs in.
//!
//! [`TransferFabricSpec::problems`]: kvfabric_crds::TransferFabricSpec::problems

use kvfabric_crds::{Error, TransferFabric, fabric_name_problem};

use crate::config::{AgentSettings, KubeVersion};
use crate::contract;

/// Every problem of the fabric, the CRD's checks first.
pub fn problems(fabric: &TransferFabric, settings: &AgentSettings) -> Vec<Error> {
    let mut out = Vec::new();
    if let Some(e) = fabric
        .metadata
        .name
        .as_deref()
        .and_then(fabric_name_problem)
    {
        out.push(e);
    }
    out.extend(fabric.spec.problems());
    let agent = &fabric.spec.agent;
    for (i, v) in agent.env.iter().enumerate() {
        if contract::env::RESERVED.contains(&v.name.as_str()) {
            out.push(Error::invalid(
                format!("spec.agent.env[{i}].name"),
                &v.name,
                "is set by the operator (registry prefix, sockets, addresses, secrets); use the matching spec field",
            ));
        }
    }
    let uses_dra = !agent.resource_claims.is_empty()
        || agent
            .resources
            .as_ref()
            .and_then(|r| r.claims.as_ref())
            .is_some_and(|c| !c.is_empty());
    if let Some(kube) = settings.kube
        && uses_dra
        && kube < KubeVersion::DRA
    {
        out.push(Error::invalid(
            "spec.agent.resourceClaims",
            agent
                .resource_claims
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(","),
            format!(
                "Dynamic Resource Allocation in this form needs Kubernetes {} or later; the API server is {kube}",
                KubeVersion::DRA
            ),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{full, minimal};
    use k8s_openapi::api::core::v1::EnvVar;

    fn messages(f: &TransferFabric, s: &AgentSettings) -> Vec<String> {
        problems(f, s).iter().map(ToString::to_string).collect()
    }

    #[test]
    fn fixtures_pass() {
        assert_eq!(
            messages(&full(), &AgentSettings::default()),
            Vec::<String>::new()
        );
        assert_eq!(
            messages(&minimal(), &AgentSettings::default()),
            Vec::<String>::new()
        );
    }

    #[test]
    fn reserved_env_is_refused() {
        // Overriding the key prefix would put the agents in another namespace's keys; the
        // socket directory, another fabric's sockets; one agent name for every node, one
        // registry entry for all of them.
        for name in [
            "KVFABRIC_AGENT_NAME",
            "KVFABRIC_ETCD_KEY_PREFIX",
            "KVFABRIC_SOCKET_DIR",
            "KVFABRIC_FABRIC",
        ] {
            let mut f = minimal();
            f.spec.agent.env.push(EnvVar {
                name: name.into(),
                value: Some("/elsewhere".into()),
                ..EnvVar::default()
            });
            let m = messages(&f, &AgentSettings::default());
            assert_eq!(m.len(), 1, "{m:?}");
            assert!(
                m[0].contains("spec.agent.env[0].name") && m[0].contains(name),
                "{m:?}"
            );
        }
        let mut f = minimal();
        f.spec.agent.env.push(EnvVar {
            name: "KVFABRIC_RDMA_DEVICES".into(),
            value: Some("mlx5_0".into()),
            ..EnvVar::default()
        });
        assert!(
            problems(&f, &AgentSettings::default()).is_empty(),
            "tuning knobs stay allowed"
        );
    }

    #[test]
    fn dra_needs_a_recent_api_server() {
        let old = AgentSettings {
            kube: Some(KubeVersion {
                major: 1,
                minor: 29,
            }),
            ..AgentSettings::default()
        };
        let m = messages(&full(), &old);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(
            m[0].contains("spec.agent.resourceClaims")
                && m[0].contains("1.31")
                && m[0].contains("1.29"),
            "{m:?}"
        );
        assert!(
            problems(&minimal(), &old).is_empty(),
            "no claims, no problem"
        );
        let new = AgentSettings {
            kube: Some(KubeVersion {
                major: 1,
                minor: 35,
            }),
            ..AgentSettings::default()
        };
        assert!(problems(&full(), &new).is_empty());
    }

    #[test]
    fn fabric_names_that_cannot_name_the_service_are_refused() {
        for bad in ["a".repeat(57), "llama.70b".into(), "7b".into()] {
            let mut f = minimal();
            f.metadata.name = Some(bad.clone());
            assert!(
                messages(&f, &AgentSettings::default())[0].contains("metadata.name"),
                "{bad}"
            );
        }
    }
}
