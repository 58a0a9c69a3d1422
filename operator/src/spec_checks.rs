//! What the operator refuses beyond the CRD's own checks ([`TransferFabricSpec::problems`]):
//! what depends on the operator's contract with the agent or on the cluster it runs in.
//!
//! [`TransferFabricSpec::problems`]: kvfabric_crds::TransferFabricSpec::problems

use kvfabric_crds::{Error, Pool, TransferFabric, fabric_name_problem};

use crate::config::{AgentSettings, KubeVersion};
use crate::contract;

/// Whether two pools' agents may land on one node: unless their node selectors name one label
/// with different values (affinity is not read: may share, to be safe).
fn may_share_nodes(a: &Pool, b: &Pool) -> bool {
    !a.node_selector
        .iter()
        .any(|(k, v)| b.node_selector.get(k).is_some_and(|w| w != v))
}

/// With `hostNetwork` the agent's ports are the node's: two pools (of this fabric, or of
/// another host-network fabric in `others`) that may share a node must not use one port, or
/// the second agent on the node cannot bind and crash-loops.
pub fn host_port_problems(fabric: &TransferFabric, others: &[TransferFabric]) -> Vec<Error> {
    let mut out = Vec::new();
    let agent = &fabric.spec.agent;
    if !agent.host_network {
        return out;
    }
    let pools = &fabric.spec.pools;
    for (i, a) in pools.iter().enumerate() {
        if let Some(b) = pools[i + 1..].iter().find(|b| may_share_nodes(a, b)) {
            out.push(Error::invalid(
                "spec.pools",
                format!("{} and {}", a.name, b.name),
                "host-network pools whose nodes may overlap would bind the same host ports: \
                 give them node selectors with different values for one label",
            ));
        }
    }
    let me = (
        fabric.metadata.namespace.as_deref(),
        fabric.metadata.name.as_deref(),
    );
    for other in others {
        let them = (
            other.metadata.namespace.as_deref(),
            other.metadata.name.as_deref(),
        );
        if them == me || !other.spec.agent.host_network {
            continue;
        }
        let theirs = other.spec.agent.ports.named().map(|(_, p)| p);
        let Some((name, port)) = agent
            .ports
            .named()
            .into_iter()
            .find(|(_, p)| theirs.contains(p))
        else {
            continue;
        };
        let overlap = pools
            .iter()
            .any(|a| other.spec.pools.iter().any(|b| may_share_nodes(a, b)));
        if overlap {
            out.push(Error::invalid(
                format!("spec.agent.ports.{name}"),
                port,
                format!(
                    "TransferFabric {}/{} runs host-network agents on this port on nodes this \
                     fabric's pools may share: give one of them other ports",
                    them.0.unwrap_or_default(),
                    them.1.unwrap_or_default()
                ),
            ));
        }
    }
    out
}

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

    #[test]
    fn host_network_ports_never_meet_on_a_node() {
        let mut a = full();
        a.spec.agent.host_network = true;
        a.spec.pools[1]
            .node_selector
            .insert("kvfabric.io/role".into(), "decode".into());
        assert!(host_port_problems(&a, &[]).is_empty(), "disjoint pools");
        // Both pools anywhere: the same ports twice on a node.
        let mut both = a.clone();
        for p in &mut both.spec.pools {
            p.node_selector.clear();
        }
        let m = host_port_problems(&both, &[]);
        assert!(
            m.len() == 1 && m[0].to_string().contains("spec.pools"),
            "{m:?}"
        );

        // Another host-network fabric on the same nodes and ports.
        let mut b = a.clone();
        b.metadata.name = Some("other".into());
        let m = host_port_problems(&a, std::slice::from_ref(&b));
        assert!(
            m.len() == 1 && m[0].to_string().contains("spec.agent.ports.grpc"),
            "{m:?}"
        );
        assert!(m[0].to_string().contains("llm/other"), "{m:?}");
        // Other ports, or other nodes, or not on the host network: no conflict.
        let mut moved = b.clone();
        moved.spec.agent.ports.grpc = 51051;
        moved.spec.agent.ports.data = 51052;
        moved.spec.agent.ports.metrics = 9091;
        let mut elsewhere = b.clone();
        for p in &mut elsewhere.spec.pools {
            p.node_selector
                .insert("kvfabric.io/role".into(), "other".into());
        }
        let mut pod_network = b.clone();
        pod_network.spec.agent.host_network = false;
        for ok in [moved, elsewhere, pod_network] {
            assert!(host_port_problems(&a, &[ok]).is_empty());
        }
    }
}
