//! The headless Service that gives every agent a DNS name and exposes its ports.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvfabric_crds::TransferFabric;

use crate::Result;
use crate::meta::{agent_selector, child_meta, fabric_labels, name_and_namespace, service_name};

/// The desired headless Service `<fabric>-agents` selecting every pool's agents.
pub fn desired_service(fabric: &TransferFabric) -> Result<Service> {
    let (name, _) = name_and_namespace(fabric)?;
    let port = |port_name: &str, port: i32| ServicePort {
        name: Some(port_name.to_owned()),
        port,
        target_port: Some(IntOrString::String(port_name.to_owned())),
        protocol: Some("TCP".to_owned()),
        ..ServicePort::default()
    };
    Ok(Service {
        metadata: child_meta(fabric, service_name(&name), fabric_labels(&name))?,
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            // Peers look each other up before they are ready (they register in etcd on their own).
            publish_not_ready_addresses: Some(true),
            selector: Some(agent_selector(&name)),
            ports: Some(
                fabric
                    .spec
                    .agent
                    .ports
                    .named()
                    .into_iter()
                    .map(|(name, number)| port(name, number))
                    .collect(),
            ),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::fixtures::full;
    use crate::meta::FABRIC_LABEL;

    #[test]
    fn headless_with_grpc_data_and_metrics() {
        let svc = desired_service(&full()).expect("builds");
        assert_eq!(svc.metadata.name.as_deref(), Some("tf-agents"));
        assert!(svc.metadata.owner_references.is_some());
        let spec = svc.spec.expect("spec");
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
        // Agents only: a worker with the fabric label is not an endpoint.
        assert_eq!(
            spec.selector.expect("selector"),
            BTreeMap::from([
                (FABRIC_LABEL.to_owned(), "tf".to_owned()),
                ("app.kubernetes.io/component".to_owned(), "agent".to_owned()),
            ])
        );
        let ports: Vec<_> = spec
            .ports
            .expect("ports")
            .into_iter()
            .map(|p| (p.name.unwrap_or_default(), p.port))
            .collect();
        assert_eq!(
            ports,
            vec![
                ("grpc".to_owned(), 50051),
                ("data".to_owned(), 50052),
                ("metrics".to_owned(), 9090)
            ]
        );
    }
}
