//! What the local API's Status call answers: agents and segments from the registry, this agent's
//! segments and open data connections (the document type is `kvfabric_proto::status`).

pub use kvfabric_proto::status::{ConnectionRow, SegmentRow, StatusDoc};

use crate::config::location_name;
use crate::node::Node;

pub async fn collect(node: &Node) -> StatusDoc {
    let me = &node.config.name;
    let segments = node
        .registry
        .segments()
        .into_values()
        .map(|s| {
            let mut locations: Vec<String> = s
                .regions
                .iter()
                .map(|r| location_name(r.location))
                .collect();
            locations.dedup();
            SegmentRow {
                regions: s.regions.len(),
                bytes: s.regions.iter().map(|r| r.len).sum(),
                local: &s.agent == me,
                name: s.name,
                agent: s.agent,
                locations,
            }
        })
        .collect();
    let connections = node
        .links()
        .await
        .iter()
        .map(|l| {
            let stats = l.peer.stats();
            ConnectionRow {
                agent: l.agent.clone(),
                transport: l.peer.transport().to_string(),
                reason: l.reason.clone(),
                connections: stats.connections,
                bytes: stats.bytes,
                batches: l.batches.load(std::sync::atomic::Ordering::Relaxed),
                errors: l.errors.load(std::sync::atomic::Ordering::Relaxed),
                open_secs: l.opened.elapsed().as_secs(),
            }
        })
        .collect();
    StatusDoc {
        agent: me.clone(),
        fabric: node.config.fabric.clone(),
        pool: node.config.pool.clone(),
        peer_addr: node.peer_addr.to_string(),
        transports: node
            .config
            .transports
            .iter()
            .map(|t| t.to_string())
            .collect(),
        registry: node.registry.state(),
        agents: node.registry.agents().into_values().collect(),
        segments,
        connections,
        closed_bytes: node.closed_bytes(),
    }
}
