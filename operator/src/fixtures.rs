//! Test objects shared by the unit and mocked-API tests.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    PodResourceClaim, ResourceRequirements, Toleration,
};
use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::ObjectMeta;
use kvfabric_crds::{
    AgentPorts, AgentSpec, EtcdSpec, GpuSpec, NetworkPolicySpec, Pool, PoolRole, RdmaResource,
    RdmaSpec, SocketMode, SocketSpec, TracingSpec, TransferFabric, TransferFabricSpec, Transport,
};

pub const NS: &str = "llm";
pub const NAME: &str = "tf";
pub const UID: &str = "0b7b4b52-7c8e-4ac7-9a56-6d0c5bb0f1a0";

/// A fabric with every optional field set.
pub fn full() -> TransferFabric {
    let mut f = TransferFabric::new(
        NAME,
        TransferFabricSpec {
            pools: vec![
                Pool {
                    name: "prefill".into(),
                    role: PoolRole::Prefill,
                    node_selector: BTreeMap::from([("kvfabric.io/role".into(), "prefill".into())]),
                    tolerations: vec![Toleration {
                        key: Some("nvidia.com/gpu".into()),
                        operator: Some("Exists".into()),
                        effect: Some("NoSchedule".into()),
                        ..Toleration::default()
                    }],
                    affinity: Some(Affinity {
                        node_affinity: Some(NodeAffinity {
                            required_during_scheduling_ignored_during_execution: Some(
                                NodeSelector {
                                    node_selector_terms: vec![NodeSelectorTerm {
                                        match_expressions: Some(vec![NodeSelectorRequirement {
                                            key: "nvidia.com/gpu.present".into(),
                                            operator: "In".into(),
                                            values: Some(vec!["true".into()]),
                                        }]),
                                        ..NodeSelectorTerm::default()
                                    }],
                                },
                            ),
                            ..NodeAffinity::default()
                        }),
                        ..Affinity::default()
                    }),
                },
                Pool {
                    name: "decode".into(),
                    role: PoolRole::Decode,
                    ..Pool::default()
                },
            ],
            agent: AgentSpec {
                resources: Some(ResourceRequirements {
                    requests: Some(BTreeMap::from([("cpu".into(), Quantity("500m".into()))])),
                    limits: Some(BTreeMap::from([("memory".into(), Quantity("2Gi".into()))])),
                    ..ResourceRequirements::default()
                }),
                host_network: false,
                ports: AgentPorts::default(),
                env: vec![EnvVar {
                    name: "RUST_LOG".into(),
                    value: Some("debug".into()),
                    ..EnvVar::default()
                }],
                priority_class_name: Some("system-node-critical".into()),
                max_unavailable: None,
                rdma: Some(RdmaSpec {
                    resources: vec![
                        RdmaResource {
                            resource_name: "nvidia.com/sriov_rdma_rail0".into(),
                            count: 1,
                        },
                        RdmaResource {
                            resource_name: "nvidia.com/sriov_rdma_rail1".into(),
                            count: 1,
                        },
                    ],
                }),
                networks: vec!["sriov-rail0".into(), "sriov-rail1".into()],
                resource_claims: vec![PodResourceClaim {
                    name: "gpus".into(),
                    resource_claim_template_name: Some("all-gpus-admin".into()),
                    resource_claim_name: None,
                }],
                gpu: GpuSpec {
                    enabled: true,
                    ..GpuSpec::default()
                },
                sockets: SocketSpec {
                    group: 2000,
                    mode: SocketMode::Group,
                },
            },
            network_policy: NetworkPolicySpec {
                enabled: true,
                metrics_from: vec![NetworkPolicyPeer {
                    namespace_selector: Some(LabelSelector {
                        match_labels: Some(BTreeMap::from([(
                            "kubernetes.io/metadata.name".into(),
                            "monitoring".into(),
                        )])),
                        ..LabelSelector::default()
                    }),
                    ..NetworkPolicyPeer::default()
                }],
            },
            transports: vec![Transport::Rdma, Transport::CudaIpc, Transport::Tcp],
            etcd: EtcdSpec {
                endpoints: vec!["http://etcd-0:2379".into(), "http://etcd-1:2379".into()],
                tls_secret: Some("etcd-tls".into()),
                auth_secret: Some("etcd-auth".into()),
                key_prefix: "/kvfabric".into(),
            },
            peer_token_secret: Some("kvfabric-peer-token".into()),
            tls_secret: None,
            tracing: Some(TracingSpec {
                otlp_endpoint: Some("http://otel-collector:4317".into()),
                sample_ratio: 0.25,
            }),
        },
    );
    f.metadata = ObjectMeta {
        name: Some(NAME.into()),
        namespace: Some(NS.into()),
        uid: Some(UID.into()),
        generation: Some(1),
        ..ObjectMeta::default()
    };
    f
}

/// A fabric with only what is required.
pub fn minimal() -> TransferFabric {
    let mut f = full();
    f.spec.pools[0] = Pool {
        name: "prefill".into(),
        role: PoolRole::Prefill,
        ..Pool::default()
    };
    f.spec.agent = AgentSpec::default();
    f.spec.network_policy = NetworkPolicySpec::default();
    f.spec.etcd = EtcdSpec {
        endpoints: vec!["http://etcd:2379".into()],
        ..EtcdSpec::default()
    };
    f.spec.tracing = None;
    f.spec.peer_token_secret = None;
    f.spec.transports = Transport::KNOWN.to_vec();
    f
}
