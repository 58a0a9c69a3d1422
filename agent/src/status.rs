//! The status document (`kvfabric status`, the local API's Status call): agents and segments from
//! the registry, this agent's segments and open data connections.

use comfy_table::Table;
use comfy_table::presets::UTF8_FULL_CONDENSED;
use serde::{Deserialize, Serialize};

use crate::bytesize::human;
use crate::cli::location_name;
use crate::node::Node;
use crate::registry::{AgentEntry, RegistryState};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusDoc {
    pub agent: String,
    pub fabric: String,
    pub pool: String,
    pub peer_addr: String,
    pub transports: Vec<String>,
    pub registry: RegistryState,
    pub agents: Vec<AgentEntry>,
    pub segments: Vec<SegmentRow>,
    pub connections: Vec<ConnectionRow>,
    /// Bytes moved by connections that have since closed.
    pub closed_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SegmentRow {
    pub name: String,
    pub agent: String,
    pub regions: usize,
    pub bytes: u64,
    pub locations: Vec<String>,
    /// Registered with this agent.
    pub local: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectionRow {
    pub agent: String,
    pub transport: String,
    pub reason: String,
    pub connections: usize,
    pub bytes: u64,
    pub batches: u64,
    pub errors: u64,
    pub open_secs: u64,
}

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

/// Tables for people.
pub fn render(doc: &StatusDoc) -> String {
    let r = &doc.registry;
    let mut out = format!(
        "agent {} (fabric {}, pool {}), peer API {}, transports {}\n\
         registry {} {} — {}, lease {} (ttl {} s), re-registrations {}, resyncs {}{}\n",
        doc.agent,
        doc.fabric,
        doc.pool,
        doc.peer_addr,
        doc.transports.join(","),
        r.backend,
        r.endpoints.join(","),
        if r.connected {
            "connected"
        } else {
            "DISCONNECTED"
        },
        r.lease_id,
        r.lease_ttl_secs,
        r.reregistrations,
        r.resyncs,
        r.last_error
            .as_ref()
            .map(|e| format!(", last error: {e}"))
            .unwrap_or_default(),
    );
    let table = |header: &[&str]| {
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED);
        t.set_header(header.to_vec());
        t
    };
    let mut agents = table(&["agent", "pool", "peer API", "GPUs", "RDMA", "started"]);
    for a in &doc.agents {
        agents.add_row(vec![
            a.name.clone(),
            a.pool.clone(),
            a.peer_addr.to_string(),
            a.devices.gpus.len().to_string(),
            a.devices.rdma.len().to_string(),
            a.started_at.to_string(),
        ]);
    }
    let mut segments = table(&["segment", "agent", "regions", "bytes", "where"]);
    for s in &doc.segments {
        segments.add_row(vec![
            format!("{}{}", s.name, if s.local { " *" } else { "" }),
            s.agent.clone(),
            s.regions.to_string(),
            human(s.bytes),
            s.locations.join(","),
        ]);
    }
    let mut conns = table(&[
        "peer agent",
        "transport",
        "why",
        "conns",
        "moved",
        "batches",
        "errors",
        "open",
    ]);
    for c in &doc.connections {
        conns.add_row(vec![
            c.agent.clone(),
            c.transport.clone(),
            c.reason.clone(),
            c.connections.to_string(),
            human(c.bytes),
            c.batches.to_string(),
            c.errors.to_string(),
            format!("{} s", c.open_secs),
        ]);
    }
    out.push_str(&format!(
        "\nagents ({})\n{agents}\n\nsegments ({}; * = registered here)\n{segments}\n\n\
         connections ({})\n{conns}\n",
        doc.agents.len(),
        doc.segments.len(),
        doc.connections.len()
    ));
    out
}

/// `kvfabric status`: asks the local agent, prints tables (or the JSON document).
pub async fn show(args: crate::cli::StatusArgs) -> crate::Result<()> {
    let client = crate::client::Client::connect(&args.socket_dir).await?;
    let doc = client.status().await?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).map_err(|e| crate::Error::io("status", e.into()))?
        );
    } else {
        print!("{}", render(&doc));
    }
    Ok(())
}
