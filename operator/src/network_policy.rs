//! The NetworkPolicy `<fabric>-agents`: the peer API and the tcp data port admit only the
//! fabric's own agents, the metrics port admits `spec.networkPolicy.metricsFrom` (everyone when
//! empty). Workers reach their agent over the Unix socket, so they need no rule. Egress stays
//! open: etcd, OTLP collectors and peers live wherever the spec says.

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvfabric_crds::TransferFabric;

use crate::Result;
use crate::meta::{
    agent_selector, child_meta, fabric_labels, name_and_namespace, network_policy_name,
};

/// Whether the fabric gets a NetworkPolicy: asked for, and meaningful. Policies do not apply to
/// hostNetwork pods (the peer token guards those), so none is made for them.
pub fn wanted(fabric: &TransferFabric) -> bool {
    fabric.spec.network_policy.enabled && !fabric.spec.agent.host_network
}

fn agents(fabric: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some(agent_selector(fabric)),
        ..LabelSelector::default()
    }
}

fn tcp(port: i32) -> NetworkPolicyPort {
    NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".to_owned()),
        ..NetworkPolicyPort::default()
    }
}

/// The desired NetworkPolicy, or `None` when [`wanted`] says no.
pub fn desired_network_policy(fabric: &TransferFabric) -> Result<Option<NetworkPolicy>> {
    if !wanted(fabric) {
        return Ok(None);
    }
    let (name, _) = name_and_namespace(fabric)?;
    let metrics_from = &fabric.spec.network_policy.metrics_from;
    let ports = fabric.spec.agent.ports;
    Ok(Some(NetworkPolicy {
        metadata: child_meta(fabric, network_policy_name(&name), fabric_labels(&name))?,
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(agents(&name)),
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(agents(&name)),
                        ..NetworkPolicyPeer::default()
                    }]),
                    ports: Some(vec![tcp(ports.grpc), tcp(ports.data)]),
                },
                NetworkPolicyIngressRule {
                    from: (!metrics_from.is_empty()).then(|| metrics_from.clone()),
                    ports: Some(vec![tcp(ports.metrics)]),
                },
            ]),
            ..NetworkPolicySpec::default()
        }),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{full, minimal};
    use crate::meta::{COMPONENT_LABEL, FABRIC_LABEL};

    #[test]
    fn peers_and_data_only_from_the_fabric_metrics_from_the_listed_sources() {
        let np = desired_network_policy(&full())
            .expect("builds")
            .expect("wanted");
        assert_eq!(np.metadata.name.as_deref(), Some("tf-agents"));
        assert!(np.metadata.owner_references.is_some());
        let spec = np.spec.expect("spec");
        let sel = spec
            .pod_selector
            .expect("selector")
            .match_labels
            .expect("labels");
        assert_eq!(sel[FABRIC_LABEL], "tf");
        assert_eq!(sel[COMPONENT_LABEL], "agent");
        assert_eq!(spec.policy_types, Some(vec!["Ingress".to_owned()]));
        let rules = spec.ingress.expect("ingress");
        let ports = |i: usize| -> Vec<IntOrString> {
            rules[i]
                .ports
                .iter()
                .flatten()
                .filter_map(|p| p.port.clone())
                .collect()
        };
        assert_eq!(
            ports(0),
            vec![IntOrString::Int(50051), IntOrString::Int(50052)]
        );
        let from = rules[0].from.as_ref().expect("from");
        assert_eq!(from.len(), 1);
        assert_eq!(
            from[0]
                .pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .map(|m| m[FABRIC_LABEL].as_str()),
            Some("tf")
        );
        assert!(from[0].namespace_selector.is_none(), "same namespace only");
        assert_eq!(ports(1), vec![IntOrString::Int(9090)]);
        assert_eq!(rules[1].from.as_ref().map(Vec::len), Some(1));

        let open = desired_network_policy(&minimal())
            .expect("builds")
            .expect("wanted");
        let rules = open.spec.expect("spec").ingress.expect("ingress");
        assert!(
            rules[1].from.is_none(),
            "metrics open to every source by default"
        );
    }

    #[test]
    fn none_when_disabled_or_on_the_host_network() {
        let mut f = full();
        f.spec.network_policy.enabled = false;
        assert!(desired_network_policy(&f).expect("builds").is_none());
        let mut f = full();
        f.spec.agent.networks.clear();
        f.spec.agent.host_network = true;
        assert!(desired_network_policy(&f).expect("builds").is_none());
    }
}
