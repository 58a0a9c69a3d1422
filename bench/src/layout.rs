//! The KV-cache shape a default bench run moves: one block op is one layer's K (or V) for one
//! block of tokens, as a paged-attention engine lays it out.

use crate::args::LayoutArgs;
use kvfabric_proto::bytesize::human;

/// How a bench batch reaches the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchForm {
    /// Explicit block ops.
    Ops,
    /// Block tables of this many planes (None: the model's layers × K/V).
    Planes(Option<u32>),
}

/// `ops`, `planes` or `planes:N`.
pub fn parse_form(s: &str) -> Result<BatchForm, String> {
    match s.split_once(':') {
        None if s == "ops" => Ok(BatchForm::Ops),
        None if s == "planes" => Ok(BatchForm::Planes(None)),
        Some(("planes", n)) => match n.parse::<u32>() {
            Ok(n) if (1..=kvfabric_engine::MAX_PLANES as u32).contains(&n) => {
                Ok(BatchForm::Planes(Some(n)))
            }
            _ => Err(format!(
                "{n:?} is not a plane count (1..={})",
                kvfabric_engine::MAX_PLANES
            )),
        },
        _ => Err(format!("{s:?}: expected ops, planes or planes:N")),
    }
}

#[derive(Debug, Clone)]
pub struct Layout {
    pub args: LayoutArgs,
}

impl Layout {
    /// Bytes of one block op: tokens × kv heads × head dim × element size.
    pub fn block_bytes(&self) -> u64 {
        let a = &self.args;
        a.tokens_per_block * a.kv_heads * a.head_dim * a.dtype_bytes
    }

    /// Bytes of one block op on a rank of a tensor-parallel decode worker: its share of the KV
    /// heads (one head per rank unless --tp says otherwise).
    pub fn sharded_block_bytes(&self) -> u64 {
        let a = &self.args;
        let heads = (a.kv_heads / a.tp.unwrap_or(a.kv_heads).max(1)).max(1);
        a.tokens_per_block * heads * a.head_dim * a.dtype_bytes
    }

    /// Planes of a block table: K and V of every layer.
    pub fn planes(&self) -> u32 {
        (self.args.layers * 2).clamp(1, kvfabric_engine::MAX_PLANES as u64) as u32
    }

    /// Block ops for one request: its blocks × layers × {K, V}.
    pub fn ops_per_request(&self) -> u64 {
        let a = &self.args;
        a.request_tokens.div_ceil(a.tokens_per_block) * a.layers * 2
    }

    pub fn describe(&self) -> String {
        let a = &self.args;
        format!(
            "KV layout {}: {} layers × K,V, {} tokens/block, {} kv heads × {} dims × {} B → {} per block op; \
             a {}-token request = {} block ops ({})",
            a.model,
            a.layers,
            a.tokens_per_block,
            a.kv_heads,
            a.head_dim,
            a.dtype_bytes,
            human(self.block_bytes()),
            a.request_tokens,
            self.ops_per_request(),
            human(self.block_bytes() * self.ops_per_request()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        l: LayoutArgs,
    }

    #[test]
    fn one_kv_head_per_rank_is_4_kib_and_forms_parse() {
        let l = Layout {
            args: T::parse_from(["t"]).l,
        };
        assert_eq!(l.sharded_block_bytes(), 4 << 10);
        assert_eq!(l.planes(), 64);
        let l = Layout {
            args: T::parse_from(["t", "--tp", "2"]).l,
        };
        assert_eq!(l.sharded_block_bytes(), 16 << 10);
        assert_eq!(parse_form("ops"), Ok(BatchForm::Ops));
        assert_eq!(parse_form("planes"), Ok(BatchForm::Planes(None)));
        assert_eq!(parse_form("planes:8"), Ok(BatchForm::Planes(Some(8))));
        for bad in ["planes:0", "planes:x", "plane", "planes:99999"] {
            assert!(parse_form(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn llama3_8b_blocks_are_32_kib() {
        let l = Layout {
            args: T::parse_from(["t"]).l,
        };
        assert_eq!(l.block_bytes(), 32 << 10);
        assert_eq!(l.ops_per_request(), 2048);
        assert!(
            l.describe().contains("32 KiB per block op"),
            "{}",
            l.describe()
        );
    }
}
