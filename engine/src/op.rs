//! Block ops: validation and coalescing, before anything reaches a transport.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
pub use crate::opcode::Opcode;
use crate::region::RegionId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockOp {
    pub local_region: RegionId,
    pub local_offset: u64,
    pub remote_region: RegionId,
    pub remote_offset: u64,
    pub len: u64,
}

/// Checks a batch on its own, without the regions it names: not empty, no zero-length op, no
/// range whose end passes 2^64, and destination ranges that do not overlap within the batch
/// (their result would depend on the order the transport happens to use). [`Peer`] submission
/// checks region bounds between the shape and the overlaps instead (see [`check_shape`] and
/// [`check_destinations`]).
///
/// [`Peer`]: crate::Peer
pub fn validate(ops: &[BlockOp], opcode: Opcode) -> Result<()> {
    check_shape(ops)?;
    for (i, o) in ops.iter().enumerate() {
        for (field, offset) in [
            ("local_offset", o.local_offset),
            ("remote_offset", o.remote_offset),
        ] {
            if offset.checked_add(o.len).is_none() {
                return Err(Error::RangeOverflow {
                    op: i,
                    field,
                    offset,
                    len: o.len,
                });
            }
        }
    }
    check_destinations(ops, opcode)
}

/// Refuses empty batches and zero-length ops: the checks that need neither regions nor
/// arithmetic, run first.
pub(crate) fn check_shape(ops: &[BlockOp]) -> Result<()> {
    if ops.is_empty() {
        return Err(Error::EmptyBatch);
    }
    if let Some(i) = ops.iter().position(|o| o.len == 0) {
        return Err(Error::ZeroLength { op: i });
    }
    Ok(())
}

/// Refuses destination ranges that overlap within the batch. Run after the bounds checks: its
/// arithmetic is safe on any input, but only ranges inside their regions give it meaning.
pub(crate) fn check_destinations(ops: &[BlockOp], opcode: Opcode) -> Result<()> {
    check_disjoint(ops.len(), |i| {
        let o = &ops[i];
        match opcode {
            Opcode::Read => (o.local_region, o.local_offset, o.len),
            Opcode::Write => (o.remote_region, o.remote_offset, o.len),
        }
    })
}

/// Fails on the first two of `n` destination ranges `(region, offset, len)` that overlap. Shared
/// by the initiator (its batch) and the target (each manifest it is sent). Callers check bounds
/// first; a range whose end passes 2^64 is taken to end at 2^64.
pub(crate) fn check_disjoint(n: usize, dest: impl Fn(usize) -> (RegionId, u64, u64)) -> Result<()> {
    /// Up to this many ops every pair is compared: a latency-bound batch of one op must not pay
    /// for a bitmap as large as its offset.
    const PAIRWISE: usize = 16;
    if n <= PAIRWISE {
        for b in 1..n {
            let (rb, ob, lb) = dest(b);
            for a in 0..b {
                let (ra, oa, la) = dest(a);
                if ra == rb && oa < ob.saturating_add(lb) && ob < oa.saturating_add(la) {
                    return Err(Error::OverlappingDestination {
                        first: a,
                        second: b,
                        region: rb,
                        offset: oa.max(ob),
                    });
                }
            }
        }
        return Ok(());
    }
    if disjoint_uniform_blocks(n, &dest) {
        return Ok(());
    }
    // Sorting plain (region, offset, index) tuples, not indices through a key closure: a batch
    // of 4 KiB blocks has ~10^5 ops and this sort is most of what submitting it costs.
    let mut order: Vec<(RegionId, u64, usize)> = (0..n)
        .map(|i| {
            let (region, offset, _) = dest(i);
            (region, offset, i)
        })
        .collect();
    order.sort_unstable();
    for w in order.windows(2) {
        let ((ra, oa, ia), (rb, ob, ib)) = (w[0], w[1]);
        if ra == rb && oa.saturating_add(dest(ia).2) > ob {
            return Err(Error::OverlappingDestination {
                first: ia.min(ib),
                second: ia.max(ib),
                region: rb,
                offset: ob,
            });
        }
    }
    Ok(())
}

/// The regions a batch names, numbered in first-seen order: the previous op's first (batches
/// visit regions in runs), then a scan while few, a map once a batch spans many (a KV cache
/// registered one region per layer).
#[derive(Debug, Default)]
pub(crate) struct RegionIndex {
    ids: Vec<RegionId>,
    map: HashMap<RegionId, usize>,
    last: usize,
}

impl RegionIndex {
    const SCAN: usize = 8;

    /// The number of `id`, and whether it is new.
    pub(crate) fn number(&mut self, id: RegionId) -> (usize, bool) {
        if self.ids.get(self.last) == Some(&id) {
            return (self.last, false);
        }
        let (n, new) = self.find_or_add(id);
        self.last = n;
        (n, new)
    }

    fn find_or_add(&mut self, id: RegionId) -> (usize, bool) {
        let found = if self.ids.len() <= Self::SCAN {
            self.ids.iter().position(|x| *x == id)
        } else {
            self.map.get(&id).copied()
        };
        if let Some(n) = found {
            return (n, false);
        }
        self.ids.push(id);
        let n = self.ids.len() - 1;
        if self.ids.len() > Self::SCAN {
            if self.map.is_empty() {
                self.map
                    .extend(self.ids.iter().enumerate().map(|(n, id)| (*id, n)));
            } else {
                self.map.insert(id, n);
            }
        }
        (n, true)
    }
}

/// The common KV case in one pass: every range the same length and every offset a multiple of
/// it, so two destinations overlap only by landing on the same block, which a bitmap per region
/// catches. False means "not shown disjoint this way": the sort decides (and names the ops).
fn disjoint_uniform_blocks(n: usize, dest: impl Fn(usize) -> (RegionId, u64, u64)) -> bool {
    /// Past this many bits in all (32 MiB) the bitmaps cost more than the sort they save.
    const MAX_BITS: u64 = 1 << 28;
    let len = dest(0).2;
    // One bitmap per region, by the region's number in `index`.
    let mut maps: Vec<Vec<u64>> = Vec::new();
    let mut index = RegionIndex::default();
    let mut bits = 0u64;
    for i in 0..n {
        let (region, offset, l) = dest(i);
        if l != len || len == 0 || !offset.is_multiple_of(len) {
            return false;
        }
        let block = offset / len;
        // A block past the budget cannot get a bit: refused before any size is computed from
        // it, so the sizes below stay under 2^28 + 64 (an offset near 2^64 once made them wrap
        // and asked for 2 EiB).
        if block >= MAX_BITS {
            return false;
        }
        let (n, new) = index.number(region);
        if new {
            maps.push(Vec::new());
        }
        let map = &mut maps[n];
        let word = (block / 64) as usize;
        if map.len() <= word {
            bits += (word + 1 - map.len()) as u64 * 64;
            if bits > MAX_BITS {
                return false;
            }
            map.resize(word + 1, 0);
        }
        let bit = 1u64 << (block % 64);
        if map[word] & bit != 0 {
            return false;
        }
        map[word] |= bit;
    }
    true
}

/// An op after coalescing, remembering the first caller op it came from (for error messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalesced {
    pub op: BlockOp,
    pub first_index: usize,
}

/// Merges ops that are adjacent on both sides, in submission order. KV blocks of one request
/// are often allocated back to back; one large op costs one header instead of many. An iterator:
/// a batch of 4 KiB blocks has ~10^5 ops, and the submitter builds its pieces straight from it.
pub fn coalesce(ops: &[BlockOp]) -> impl Iterator<Item = Coalesced> + '_ {
    let mut rest = ops.iter().enumerate().peekable();
    std::iter::from_fn(move || {
        let (first_index, first) = rest.next()?;
        let mut op = *first;
        while let Some(&(_, next)) = rest.peek() {
            // Checked: ops that were never bounds-checked (fuzzing, `validate` alone) may end
            // past 2^64; such ends adjoin nothing, and lengths that would sum past it stay apart.
            let adjacent = op.local_region == next.local_region
                && op.remote_region == next.remote_region
                && op.local_offset.checked_add(op.len) == Some(next.local_offset)
                && op.remote_offset.checked_add(op.len) == Some(next.remote_offset);
            let Some(len) = op.len.checked_add(next.len).filter(|_| adjacent) else {
                break;
            };
            op.len = len;
            rest.next();
        }
        Some(Coalesced { op, first_index })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(lo: u64, ro: u64, len: u64) -> BlockOp {
        BlockOp {
            local_region: RegionId(1),
            local_offset: lo,
            remote_region: RegionId(2),
            remote_offset: ro,
            len,
        }
    }

    #[test]
    fn coalesces_only_ops_adjacent_on_both_sides() {
        let ops = [
            op(0, 100, 10),
            op(10, 110, 10),
            op(20, 200, 10),
            op(30, 210, 5),
        ];
        let c: Vec<_> = coalesce(&ops).collect();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].op, op(0, 100, 20));
        assert_eq!(c[1].op, op(20, 200, 15));
        assert_eq!(c[1].first_index, 2);
    }

    #[test]
    fn zero_length_and_empty_batches_are_refused() {
        assert!(matches!(
            validate(&[], Opcode::Read),
            Err(Error::EmptyBatch)
        ));
        let err = validate(&[op(0, 0, 4), op(8, 8, 0)], Opcode::Write).unwrap_err();
        assert!(matches!(err, Error::ZeroLength { op: 1 }), "{err}");
    }

    #[test]
    fn overlapping_destinations_name_both_ops() {
        // Read: the destination is local.
        let err =
            validate(&[op(0, 0, 8), op(100, 100, 8), op(4, 200, 8)], Opcode::Read).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OverlappingDestination {
                    first: 0,
                    second: 2,
                    ..
                }
            ),
            "{err}"
        );
        // The same ops are fine as a write: remote destinations are disjoint.
        validate(
            &[op(0, 0, 8), op(100, 100, 8), op(4, 200, 8)],
            Opcode::Write,
        )
        .unwrap();
        // Overlapping sources are fine (one block sent twice).
        validate(&[op(0, 0, 8), op(0, 8, 8)], Opcode::Write).unwrap();
    }

    #[test]
    fn small_batches_are_checked_pair_by_pair() {
        // Adjacent, far apart, other region: fine, whatever the offsets.
        let mut ops = vec![op(0, 0, 8), op(8, 8, 8), op(1 << 40, 16, 3)];
        ops.push(BlockOp {
            local_region: RegionId(9),
            ..op(4, 24, 8)
        });
        validate(&ops, Opcode::Read).unwrap();
        // One byte of overlap, not block-aligned: op 1 [8, 16) and op 3 [15, 20).
        ops[3] = op(15, 24, 5);
        let err = validate(&ops, Opcode::Read).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OverlappingDestination {
                    first: 1,
                    second: 3,
                    offset: 15,
                    ..
                }
            ),
            "{err}"
        );
    }

    /// The batch's read destinations, as `check_disjoint` sees them.
    fn local_dests(ops: &[BlockOp]) -> impl Fn(usize) -> (RegionId, u64, u64) + '_ {
        |i| (ops[i].local_region, ops[i].local_offset, ops[i].len)
    }

    #[test]
    fn region_numbers_stay_put_past_the_scan() {
        let mut index = RegionIndex::default();
        for round in 0..3 {
            for id in (0..40u64).rev() {
                let (n, new) = index.number(RegionId(1000 + id));
                assert_eq!(n as u64, 39 - id, "round {round}");
                assert_eq!(new, round == 0);
            }
        }
    }

    /// The bitmap pass refuses `ops`, and the sort names ops `a` and `b`.
    fn overlap_named(ops: &[BlockOp], a: usize, b: usize) {
        assert!(!disjoint_uniform_blocks(ops.len(), local_dests(ops)));
        let err = validate(ops, Opcode::Read).unwrap_err();
        assert!(
            matches!(err, Error::OverlappingDestination { first, second, .. } if (first, second) == (a, b)),
            "{err}"
        );
    }

    #[test]
    fn uniform_blocks_take_the_bitmap_path_and_duplicates_still_name_both_ops() {
        let ops: Vec<BlockOp> = (0..1000)
            .map(|i| op(i * 4096, (999 - i) * 4096, 4096))
            .collect();
        assert!(disjoint_uniform_blocks(ops.len(), local_dests(&ops)));
        validate(&ops, Opcode::Read).unwrap();
        let mut dup = ops.clone();
        dup[700].local_offset = dup[3].local_offset;
        overlap_named(&dup, 3, 700);
        // Unaligned or mixed lengths fall back to the sort.
        let mut odd = ops.clone();
        odd[5].local_offset += 1;
        assert!(!disjoint_uniform_blocks(odd.len(), local_dests(&odd)));
        validate(&odd, Opcode::Read).unwrap_err();
    }

    /// The Submit that once aborted the process: 17 one-byte ops (past the pairwise limit, so
    /// the bitmap runs), the first at 2^64 - 1. The bitmap's size wrapped to 0 and it asked for
    /// 2 EiB.
    fn seventeen_from_the_top() -> Vec<BlockOp> {
        let mut ops: Vec<BlockOp> = (0..17).map(|i| op(i, i, 1)).collect();
        ops[0].local_offset = u64::MAX;
        ops
    }

    #[test]
    fn offsets_near_2_64_are_typed_errors_not_giant_bitmaps() {
        let ops = seventeen_from_the_top();
        let err = validate(&ops, Opcode::Read).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RangeOverflow {
                    op: 0,
                    field: "local_offset",
                    offset: u64::MAX,
                    len: 1
                }
            ),
            "{err}"
        );
        // Ends that still fit (the last block below 2^64) reach the overlap check itself: the
        // bitmap declines them and the sort decides, both ways.
        let top: Vec<BlockOp> = (0..17).map(|i| op(u64::MAX - 1 - i, i, 1)).collect();
        assert!(!disjoint_uniform_blocks(top.len(), local_dests(&top)));
        validate(&top, Opcode::Read).unwrap();
        let mut dup = top.clone();
        dup[16].local_offset = dup[2].local_offset;
        overlap_named(&dup, 2, 16);
        // And on the remote side, for a write.
        let mut w: Vec<BlockOp> = (0..17).map(|i| op(i, i, 1)).collect();
        w[5].remote_offset = u64::MAX;
        let err = validate(&w, Opcode::Write).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RangeOverflow {
                    op: 5,
                    field: "remote_offset",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn coalescing_never_wraps_offsets_or_lengths() {
        // Adjacent on paper only by wrapping: kept apart.
        let ops = [op(u64::MAX, 0, 1), op(0, 1, 1)];
        assert_eq!(coalesce(&ops).count(), 2);
        // Lengths that would add past 2^64 stay apart too.
        let big = u64::MAX / 2 + 1;
        let ops = [op(0, 0, big), op(big, big, big)];
        let c: Vec<_> = coalesce(&ops).collect();
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].op.len, c[1].op.len), (big, big));
    }

    #[test]
    fn one_region_per_layer_stays_on_the_bitmap_path_in_any_order() {
        // 64 layer regions, the same block numbers in each, visited in runs and interleaved.
        let at = |layer: u64, block: u64| BlockOp {
            local_region: RegionId(100 + layer),
            ..op(block * 4096, 0, 4096)
        };
        let runs: Vec<BlockOp> = (0..64)
            .flat_map(|l| (0..50).map(move |b| at(l, b)))
            .collect();
        let interleaved: Vec<BlockOp> = (0..50)
            .flat_map(|b| (0..64).map(move |l| at(l, b)))
            .collect();
        for ops in [&runs, &interleaved] {
            assert!(disjoint_uniform_blocks(ops.len(), local_dests(ops)));
            let mut dup = ops.clone();
            dup[3000] = dup[1234];
            overlap_named(&dup, 1234, 3000);
        }
        // Offsets whose bitmaps together would pass 32 MiB go to the sort instead.
        let far: Vec<BlockOp> = (0..20).map(|l| at(l, (1 << 24) + l)).collect();
        assert!(!disjoint_uniform_blocks(far.len(), local_dests(&far)));
        validate(&far, Opcode::Read).unwrap();
    }
}
