//! Result rows: a table for people, one JSON object per row for scripts.

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, Table};
use serde::Serialize;

use crate::bound::Part;
use crate::ceiling::Ceiling;
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
    /// Bytes compared with what they must hold after the timed phase: every byte of both pools
    /// (the destination's written and unwritten blocks, the source's for stray writes).
    pub verified: u64,
    pub checksum: bool,
    /// The bound: the best raw variant of the tightest limit of the path (see `bound`).
    pub ceiling_name: String,
    pub ceiling_gbps: f64,
    /// For latency rows: the bound's p50 round trip (of its best round).
    pub ceiling_p50_us: Option<f64>,
    /// kvfabric / bound (for latency rows: bound p50 / kvfabric p50).
    pub ratio: f64,
    /// The ratio is above 100%: the bound is not the limit of the path (a bug of the bench).
    pub ceiling_bug: bool,
    /// The best variant of each other limit, beside the bound (tcp: hot streams or the copies
    /// in DRAM, whichever is the higher).
    pub other_bounds: Vec<Ceiling>,
    /// Every variant of every limit, each at its best round.
    pub bound: Vec<Part>,
    /// The row's own shape without kvfabric, where measured (not part of the bound).
    pub same_shape: Option<Ceiling>,
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
        "bound",
        "bound",
        "ratio",
        "other bound",
        "same shape",
    ]);
    for r in rows {
        // Another limit and the same-shape reference, each with kvfabric's ratio to it.
        let beside = |c: &Ceiling, ratio: String| format!("{:.2} GB/s ({ratio})", c.gbps);
        let others: Vec<String> = r
            .other_bounds
            .iter()
            .map(|c| {
                let pct = format!("{:.0}%", r.gbps / c.gbps * 100.0);
                format!("{}: {}", c.name, beside(c, pct))
            })
            .collect();
        let same_shape = r.same_shape.as_ref().map(|c| match c.p50_us {
            Some(p50) => format!("{p50:.1} µs"),
            None => beside(c, format!("{:.2}×", r.gbps / c.gbps)),
        });
        let ceiling = match r.ceiling_p50_us {
            Some(p50) => format!("{p50:.1} µs"),
            None => format!("{:.2} GB/s", r.ceiling_gbps),
        };
        let ratio = format!("{:.0}%", r.ratio * 100.0);
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
            human(r.verified),
            r.ceiling_name.clone(),
            ceiling,
            if r.ceiling_bug {
                format!("{ratio} CEILING BUG")
            } else {
                ratio
            },
            others.join(", "),
            same_shape.unwrap_or_default(),
        ]);
    }
    for i in [6, 7, 8, 9, 10, 11, 13, 14, 16] {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    let mut out = t.to_string();
    if rows
        .iter()
        .any(|r| r.transport == "tcp" && r.same_shape.is_some())
    {
        out.push_str(
            "\ntcp: the bound is the lower of two limits measured in this run: the kernel's two \
             copies of every byte between pools in DRAM with nothing else (2 copies), and raw TCP \
             on buffers that stay in the caches (hot); same shape is raw TCP over the row's own \
             memory pattern, a reference kvfabric beats, not a bound.",
        );
    }
    for r in rows.iter().filter(|r| r.ceiling_bug) {
        out.push_str(&format!(
            "\nceiling bug: {} {} {} reached {:.0}% of its bound ({}): the bound is not the limit of the path",
            r.transport,
            r.op,
            human(r.block_size),
            r.ratio * 100.0,
            r.ceiling_name
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(op: &str, gbps: f64, bound: f64) -> Row {
        let part = Ceiling {
            name: "raw tcp ×1 hot".into(),
            gbps: bound,
            p50_us: None,
        };
        Row {
            transport: "tcp".into(),
            selection: String::new(),
            op: op.into(),
            layout: "ops".into(),
            block_size: 64 << 10,
            blocks_per_batch: 16,
            ops_per_sec: 160.0,
            concurrency: 4,
            batches: 10,
            bytes: 10 * 16 * (64 << 10),
            seconds: 1.0,
            gbps,
            p50_us: 100.0,
            p99_us: 200.0,
            verified: 8 << 20,
            checksum: false,
            ceiling_name: part.name.clone(),
            ceiling_gbps: bound,
            ceiling_p50_us: None,
            ratio: gbps / bound,
            ceiling_bug: gbps > bound,
            other_bounds: Vec::new(),
            bound: vec![Part {
                limit: crate::bound::Limit::Path,
                ceiling: part,
            }],
            same_shape: None,
        }
    }

    #[test]
    fn a_row_above_its_bound_is_flagged_in_the_table_and_the_json() {
        let rows = [row("write", 1.0, 2.0), row("read", 3.0, 2.0)];
        let out = table(&rows);
        assert_eq!(out.matches("CEILING BUG").count(), 1, "{out}");
        assert!(out.contains("150% CEILING BUG"), "{out}");
        assert!(out.contains("50%"), "{out}");
        let notes: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("ceiling bug:"))
            .collect();
        assert_eq!(notes.len(), 1, "{out}");
        assert!(
            notes[0].contains("tcp read 64 KiB reached 150% of its bound (raw tcp ×1 hot)"),
            "{out}"
        );
        let json = |r: &Row| serde_json::to_value(r).unwrap();
        assert_eq!(json(&rows[0])["ceiling_bug"], false);
        assert_eq!(json(&rows[1])["ceiling_bug"], true);
    }
}
