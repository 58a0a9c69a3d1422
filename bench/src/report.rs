//! Result rows: a table for people, one JSON object per row for scripts.

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, Table};
use serde::Serialize;

use kvfabric_proto::bytesize::human;

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub transport: String,
    pub selection: String,
    pub op: String,
    /// "ops" (explicit block ops) or "planes:N" (block tables of N planes).
    pub layout: String,
    pub block_size: u64,
    pub blocks_per_batch: usize,
    /// Block ops moved per second: what the host had to describe and complete.
    pub ops_per_sec: f64,
    pub concurrency: usize,
    pub batches: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub verified: bool,
    pub checksum: bool,
    pub ceiling_name: String,
    pub ceiling_gbps: f64,
    /// For latency rows: the ceiling's median round trip.
    pub ceiling_p50_us: Option<f64>,
    /// kvfabric / ceiling (for latency rows: ceiling p50 / kvfabric p50).
    pub ratio: f64,
}

pub fn table(rows: &[Row]) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "transport",
        "op",
        "layout",
        "block",
        "ops/batch",
        "inflight",
        "batches",
        "ops/s",
        "GB/s",
        "p50 µs",
        "p99 µs",
        "verified",
        "ceiling",
        "ceiling",
        "ratio",
    ]);
    for r in rows {
        let ceiling = match r.ceiling_p50_us {
            Some(p50) => format!("{p50:.1} µs"),
            None => format!("{:.2} GB/s", r.ceiling_gbps),
        };
        t.add_row([
            r.transport.clone(),
            r.op.clone(),
            r.layout.clone(),
            human(r.block_size),
            r.blocks_per_batch.to_string(),
            r.concurrency.to_string(),
            r.batches.to_string(),
            format!("{:.2} M", r.ops_per_sec / 1e6),
            format!("{:.2}", r.gbps),
            format!("{:.1}", r.p50_us),
            format!("{:.1}", r.p99_us),
            if r.verified { "every byte" } else { "FAILED" }.to_string(),
            r.ceiling_name.clone(),
            ceiling,
            format!("{:.0}%", r.ratio * 100.0),
        ]);
    }
    for i in [6, 7, 8, 9, 10, 13, 14] {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t.to_string()
}
