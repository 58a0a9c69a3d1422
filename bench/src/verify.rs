//! After a row's timed phase: every byte of both pools against what it must hold — a destination
//! the source blocks last written into it and its own fill elsewhere, a source its own fill (a
//! stray write there is a bug as much as a wrong byte in a destination) — and the test hook that
//! breaks them first.

use std::collections::HashSet;
use std::sync::Arc;

use kvfabric_engine::{Opcode, Region, RegionDesc};

use crate::args::CorruptArg;
use crate::control::{Reply, Request};
use crate::error::{Error, Result};
use crate::initiator::{Initiator, RowPlan};
use crate::pattern::{self, Expectation, Verdict};

/// (destination block, source block) pairs a row wrote into each pool.
#[derive(Debug, Default)]
pub struct Written {
    pub local: Vec<(u32, u32)>,
    pub remote: Vec<(u32, u32)>,
}

/// What a pool is to the row: written into, read from, or both.
fn role(plan: &RowPlan, local: bool) -> &'static str {
    let pulled_into = plan.op == Opcode::Read;
    match (plan.bidirectional, pulled_into == local) {
        (true, _) => "destination and source",
        (false, true) => "destination",
        (false, false) => "source",
    }
}

fn pool_name(plan: &RowPlan, local: bool) -> String {
    let side = if local { "local pool" } else { "target's pool" };
    format!("{side} ({})", role(plan, local))
}

impl Initiator {
    /// Checks both pools; `seeds` are (local, remote) fills. Pulled data lands in the local pool,
    /// pushed data in the target's.
    pub(crate) fn verify_pools(
        &mut self,
        plan: &RowPlan,
        local: &Arc<Region>,
        remote: &RegionDesc,
        (local_seed, remote_seed): (u64, u64),
        written: Written,
    ) -> Result<Vec<(String, Verdict)>> {
        let mine = Expectation {
            block_size: plan.block_size,
            source_seed: remote_seed,
            poison_seed: local_seed,
            written: written.local,
        };
        let theirs = Expectation {
            block_size: plan.block_size,
            source_seed: local_seed,
            poison_seed: remote_seed,
            written: written.remote,
        };
        let local_verdict = mine.verify_region(local)?;
        let remote_verdict = match self.control.call(&Request::Verify {
            region: remote.id,
            expectation: theirs,
        })? {
            Reply::Verified { verdict } => verdict,
            other => {
                return Err(Error::Control {
                    peer: self.control_addr.to_string(),
                    reason: format!("expected verified, got {other:?}"),
                });
            }
        };
        Ok(vec![
            (pool_name(plan, true), local_verdict),
            (pool_name(plan, false), remote_verdict),
        ])
    }

    /// The test hook: changes the pools after the timed phase as a faulty transport would, and
    /// says where on stderr. `Destination`: one byte of the lowest written destination block
    /// flipped, one byte written into the lowest block never written; `Source`: one byte written
    /// into block 0 of the source pool.
    pub(crate) fn corrupt(
        &mut self,
        what: CorruptArg,
        plan: &RowPlan,
        local: &Region,
        remote: &RegionDesc,
        written: &Written,
    ) -> Result<()> {
        let into_local = plan.bidirectional || plan.op == Opcode::Read;
        let blocks = plan.pool_bytes / plan.block_size;
        // (in the local pool, block, byte in the block, what the block is)
        let pokes: Vec<(bool, u64, u64, &str)> = match what {
            CorruptArg::Destination => {
                let dests = if into_local {
                    &written.local
                } else {
                    &written.remote
                };
                let touched: HashSet<u64> = dests.iter().map(|&(d, _)| u64::from(d)).collect();
                let w = touched.iter().min().copied().ok_or_else(|| {
                    Error::config("test-corrupt", "destination", "the row wrote no block")
                })?;
                let u = (0..blocks).find(|b| !touched.contains(b)).ok_or_else(|| {
                    Error::config(
                        "test-corrupt",
                        "destination",
                        "the row wrote every block of the pool",
                    )
                })?;
                vec![
                    (into_local, w, 1, "written"),
                    (into_local, u, 2, "never written"),
                ]
            }
            CorruptArg::Source => vec![(!into_local, 0, 3, "source")],
        };
        for (in_local, block, at, why) in pokes {
            let offset = block * plan.block_size + at.min(plan.block_size - 1);
            if in_local {
                pattern::poke(local, offset, 0x5a)?;
            } else {
                match self.control.call(&Request::Poke {
                    region: remote.id,
                    offset,
                    xor: 0x5a,
                })? {
                    Reply::Poked => {}
                    other => {
                        return Err(Error::Control {
                            peer: self.control_addr.to_string(),
                            reason: format!("expected poked, got {other:?}"),
                        });
                    }
                }
            }
            eprintln!(
                "test hook (--test-corrupt): changed byte +{} of {} block {block} ({why})",
                offset - block * plan.block_size,
                if in_local {
                    "local pool"
                } else {
                    "target's pool"
                },
            );
        }
        Ok(())
    }
}

/// The bytes the verdicts compared, or the first pool with mismatches as an error naming its bad
/// blocks.
pub fn settle(row: &str, verdicts: Vec<(String, Verdict)>) -> Result<u64> {
    let mut bytes = 0;
    for (pool, verdict) in verdicts {
        if verdict.mismatches > 0 {
            return Err(Error::Verify {
                row: row.to_string(),
                pool,
                mismatches: verdict.mismatches,
                bad: verdict.bad.join("; "),
            });
        }
        bytes += verdict.bytes_checked;
    }
    Ok(bytes)
}
