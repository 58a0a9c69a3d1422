//! `kvfabric status`: the local agent's status document as tables (or JSON).

use std::path::PathBuf;

use clap::Args;
use comfy_table::Table;
use comfy_table::presets::UTF8_FULL_CONDENSED;
use kvfabric_proto::bytesize::human;
use kvfabric_proto::contract::{env, socket};
use kvfabric_proto::status::StatusDoc;

/// `kvfabric status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// The local agent's socket directory.
    #[arg(long, env = env::SOCKET_DIR, default_value = socket::DEFAULT_DIR)]
    pub socket_dir: PathBuf,

    /// The status document as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Tables for people.
pub fn render(doc: &StatusDoc) -> String {
    let r = &doc.registry;
    let mut out = format!(
        "agent {} (fabric {}, pool {}), peer API {}, transports {}\n\
         registry {} {} — {}, lease {} (ttl {} s), re-registrations {}, relists {}, watch resumes {}{}\n",
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
        r.watch_resumes,
        r.last_error
            .as_ref()
            .map(|e| format!(", last error: {e}"))
            .unwrap_or_default(),
    );
    out.push_str(&format!(
        "tcp data port: {}\n",
        doc.data_tls
            .as_deref()
            .unwrap_or("plaintext (no --tls-dir, or --tls-data-port=false)")
    ));
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
            format!(
                "{}{}{}",
                s.name,
                if s.local { " *" } else { "" },
                if s.published {
                    ""
                } else {
                    " (not yet in the registry)"
                }
            ),
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
pub async fn show(args: StatusArgs) -> kvfabric_client::Result<()> {
    let client = kvfabric_client::Client::connect(&args.socket_dir).await?;
    let doc = client.status().await?;
    if args.json {
        let text = serde_json::to_string_pretty(&doc)
            .map_err(|e| kvfabric_client::Error::io("status", e.into()))?;
        println!("{text}");
    } else {
        print!("{}", render(&doc));
    }
    Ok(())
}
