//! What the local API's Status call answers: agents and segments from the registry, this agent's
//! segments and open data connections (the document type is `kvfabric_proto::status`).

pub(crate) use kvfabric_proto::status::{ConnectionRow, SegmentRow, StatusDoc};

use crate::config::location_name;
use kvfabric_engine::Location;

use crate::node::Node;

/// Every segment of the fabric the registry knows, and every segment registered here (published
/// or, while the registry is unreachable, not yet).
pub(crate) async fn collect(node: &Node) -> StatusDoc {
    let me = &node.config.name;
    let local: Vec<_> = node.local_segments();
    let is_local = |name: &str| local.iter().any(|l| l.name == name);
    let published = node.registry.segments();
    let row = |name: String, agent: String, regions: Vec<(u64, Location)>, published: bool| {
        let mut locations: Vec<String> = regions.iter().map(|r| location_name(r.1)).collect();
        locations.dedup();
        SegmentRow {
            regions: regions.len(),
            bytes: regions.iter().map(|r| r.0).sum(),
            local: agent == *me && is_local(&name),
            published,
            name,
            agent,
            locations,
        }
    };
    let mut segments: Vec<SegmentRow> = published
        .values()
        .map(|s| {
            let regions = s.regions.iter().map(|r| (r.len, r.location)).collect();
            row(s.name.clone(), s.agent.clone(), regions, true)
        })
        .collect();
    for l in local.iter().filter(|l| !published.contains_key(&l.name)) {
        let regions = l.regions.iter().map(|r| (r.len(), r.location())).collect();
        segments.push(row(l.name.clone(), me.clone(), regions, false));
    }
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
        data_tls: node
            .engine
            .config()
            .tls
            .as_ref()
            .map(|t| t.record_layer().describe()),
    }
}
