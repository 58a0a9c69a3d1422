//! The KV-cache shape a default bench run moves: one block op is one layer's K (or V) for one
//! block of tokens, as a paged-attention engine lays it out.

use crate::args::LayoutArgs;
use kvfabric_proto::bytesize::human;

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
