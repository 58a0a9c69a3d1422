//! Block tables: a batch as inference engines describe it. Planes (one per layer and K/V, say)
//! say where block 0 of each lies and how far apart blocks are on each side; block-id pairs,
//! shared by every plane, say which blocks move. One request of 32 blocks over 64 planes is 32
//! pairs, not 2048 ops, and it is checked per plane: its cost grows with planes + blocks.
//!
//! Block `j` of plane `p` is element `p × blocks + j`: errors and checksums number elements so,
//! and transports that expand a table on the host visit them in that order.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, Side};
use crate::op::Opcode;
use crate::region::RegionId;

/// Most planes one table may have (and one tcp table manifest may carry).
pub const MAX_PLANES: usize = 4096;

/// One side of a plane: block `i` starts at `base + i × stride` of `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaneSide {
    pub region: RegionId,
    pub base: u64,
    pub stride: u64,
}

/// One plane: where its blocks lie on both sides, and how many bytes of each block move. A
/// destination plane's stride must be at least `block_bytes`; a source's may be anything (0
/// sends one block to every destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plane {
    pub local: PlaneSide,
    pub remote: PlaneSide,
    pub block_bytes: u64,
}

impl Plane {
    pub fn side(&self, side: Side) -> &PlaneSide {
        match side {
            Side::Local => &self.local,
            Side::Remote => &self.remote,
        }
    }
}

/// A local block id and the remote block id it pairs with. `repr(C)`: uploaded to the GPU as
/// is.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockPair {
    pub local: u32,
    pub remote: u32,
}

impl BlockPair {
    pub fn id(&self, side: Side) -> u32 {
        match side {
            Side::Local => self.local,
            Side::Remote => self.remote,
        }
    }
}

/// Planes and the block-id pairs every plane moves.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockTable {
    pub planes: Vec<Plane>,
    pub blocks: Vec<BlockPair>,
}

/// The largest block id a table names on each side (what bounds are checked against).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableShape {
    pub max_local: u32,
    pub max_remote: u32,
}

impl TableShape {
    pub fn max(&self, side: Side) -> u32 {
        match side {
            Side::Local => self.max_local,
            Side::Remote => self.max_remote,
        }
    }
}

/// The side a batch writes into.
pub(crate) fn destination(opcode: Opcode) -> Side {
    match opcode {
        Opcode::Read => Side::Local,
        Opcode::Write => Side::Remote,
    }
}

/// What of a plane's side the checks below need, for the initiator (its table) and the target
/// (the side of it a manifest carries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SideView {
    pub region: RegionId,
    pub base: u64,
    pub stride: u64,
    pub len: u64,
}

/// Where the last byte of block `max_id` of a plane side ends, or None past 2^64. The one
/// bounds formula for planes: tables (both ends and the target), the GPU's table lists, and the
/// agent's holds (whose block ids are u64) all use it.
pub fn plane_end(base: u64, stride: u64, max_id: impl Into<u64>, len: u64) -> Option<u64> {
    max_id
        .into()
        .checked_mul(stride)?
        .checked_add(base)?
        .checked_add(len)
}

impl BlockTable {
    /// Element `(plane, block)`'s number.
    pub fn element(&self, plane: usize, block: usize) -> usize {
        plane * self.blocks.len() + block
    }

    /// Planes × blocks (None past usize).
    pub fn elements(&self) -> Option<usize> {
        self.planes.len().checked_mul(self.blocks.len())
    }

    /// Bytes the table moves: every plane's block bytes × blocks (None past 2^64).
    pub fn bytes(&self) -> Option<u64> {
        let n = self.blocks.len() as u64;
        self.planes.iter().try_fold(0u64, |sum, p| {
            sum.checked_add(p.block_bytes.checked_mul(n)?)
        })
    }

    /// Checks the table on its own, without the regions it names, in O(planes log planes +
    /// blocks): planes and blocks present, no plane of zero-length blocks, no plane whose last
    /// block ends past 2^64 on either side, and destinations that cannot overlap (no
    /// destination id twice, destination strides of at least a block, destination planes of one
    /// region apart). Region bounds are the caller's ([`crate::Peer`] submission, the target).
    pub fn validate(&self, opcode: Opcode) -> Result<TableShape> {
        if self.planes.is_empty() || self.blocks.is_empty() {
            return Err(Error::EmptyBatch);
        }
        if self.planes.len() > MAX_PLANES {
            return Err(Error::BatchTooLarge {
                field: "planes",
                value: self.planes.len() as u64,
                limit: MAX_PLANES as u64,
            });
        }
        let shape = self.blocks.iter().fold(
            TableShape {
                max_local: 0,
                max_remote: 0,
            },
            |s, b| TableShape {
                max_local: s.max_local.max(b.local),
                max_remote: s.max_remote.max(b.remote),
            },
        );
        for (i, p) in self.planes.iter().enumerate() {
            if p.block_bytes == 0 {
                return Err(Error::InvalidPlane {
                    plane: i,
                    field: "block_bytes",
                    value: 0,
                    reason: "blocks need at least one byte",
                });
            }
            for (side, field) in [
                (Side::Local, "local.stride"),
                (Side::Remote, "remote.stride"),
            ] {
                let s = p.side(side);
                if plane_end(s.base, s.stride, shape.max(side), p.block_bytes).is_none() {
                    return Err(Error::InvalidPlane {
                        plane: i,
                        field,
                        value: s.stride,
                        reason: "base + largest block id × stride + block_bytes passes 2^64",
                    });
                }
            }
        }
        let dest = destination(opcode);
        let views: Vec<SideView> = self
            .planes
            .iter()
            .map(|p| {
                let s = p.side(dest);
                SideView {
                    region: s.region,
                    base: s.base,
                    stride: s.stride,
                    len: p.block_bytes,
                }
            })
            .collect();
        check_destinations(&views, self.blocks.len(), |j| self.blocks[j].id(dest), dest)?;
        Ok(shape)
    }
}

/// Refuses a table whose destination blocks could overlap: a destination id twice, a plane
/// whose blocks are closer than their length, or two planes of one region that could share a
/// byte. Shared by the initiator (its table) and the target (each table manifest it is sent).
/// Arithmetic is checked or saturating, so any input is safe; bounds give it meaning.
pub(crate) fn check_destinations(
    planes: &[SideView],
    blocks: usize,
    id: impl Fn(usize) -> u32,
    side: Side,
) -> Result<()> {
    check_unique_ids(blocks, &id, side)?;
    let (min, max) = (0..blocks).fold((u32::MAX, 0u32), |(lo, hi), j| {
        let i = id(j);
        (lo.min(i), hi.max(i))
    });
    if blocks > 1 {
        let field = match side {
            Side::Local => "local.stride",
            Side::Remote => "remote.stride",
        };
        if let Some((i, p)) = planes.iter().enumerate().find(|(_, p)| p.stride < p.len) {
            return Err(Error::InvalidPlane {
                plane: i,
                field,
                value: p.stride,
                reason: "a destination plane's blocks would overlap: stride < block_bytes",
            });
        }
    }
    check_planes_apart(planes, min, max, blocks > 1)
}

/// Fails on the first two elements that name the same destination id. A bitmap while the
/// largest id is within 64 × blocks (8 bytes per block at most), a sort beyond.
fn check_unique_ids(blocks: usize, id: impl Fn(usize) -> u32, side: Side) -> Result<()> {
    let max = (0..blocks).map(&id).max().unwrap_or(0) as usize;
    let dup = |first: usize, second: usize| Error::DuplicateBlock {
        first,
        second,
        side,
        block: id(second),
    };
    if max / 64 <= blocks {
        let mut seen = vec![0u64; max / 64 + 1];
        for j in 0..blocks {
            let i = id(j) as usize;
            let bit = 1u64 << (i % 64);
            if seen[i / 64] & bit != 0 {
                let first = (0..j).find(|&k| id(k) as usize == i).expect("seen before");
                return Err(dup(first, j));
            }
            seen[i / 64] |= bit;
        }
        return Ok(());
    }
    let mut order: Vec<(u32, usize)> = (0..blocks).map(|j| (id(j), j)).collect();
    order.sort_unstable();
    match order.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(dup(w[0].1, w[1].1)),
        None => Ok(()),
    }
}

/// Destination planes of one region must not share a byte for any ids in `min..=max`. Planes
/// whose extents (first id's block to last id's block) are apart are; planes whose extents
/// interleave (K and V of a layer in alternate halves of each block, all layers of a block side
/// by side) must then share one stride, and their blocks' places within a stride (`base mod
/// stride`, `len` long) must be apart on that circle: then no two of their blocks meet, whatever
/// the ids. Sorting: O(planes log planes).
fn check_planes_apart(planes: &[SideView], min: u32, max: u32, strided: bool) -> Result<()> {
    let extent = |p: &SideView| {
        let at = |i: u32| u64::from(i).saturating_mul(p.stride).saturating_add(p.base);
        (at(min), at(max).saturating_add(p.len))
    };
    let mut order: Vec<(RegionId, u64, u64, usize)> = planes
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (start, end) = extent(p);
            (p.region, start, end, i)
        })
        .collect();
    order.sort_unstable();
    let overlap = |a: usize, b: usize| Error::OverlappingPlanes {
        first: a.min(b),
        second: a.max(b),
        region: planes[a].region,
    };
    // Clusters: runs of planes of one region whose extents chain into each other.
    let mut at = 0;
    while at < order.len() {
        let (region, _, mut end, _) = order[at];
        let mut next = at + 1;
        while next < order.len() && order[next].0 == region && order[next].1 < end {
            end = end.max(order[next].2);
            next += 1;
        }
        let cluster: Vec<usize> = order[at..next].iter().map(|o| o.3).collect();
        at = next;
        if cluster.len() < 2 {
            continue;
        }
        // One block per plane: extents are the blocks themselves, and these meet.
        if !strided {
            return Err(overlap(cluster[0], cluster[1]));
        }
        let stride = planes[cluster[0]].stride;
        if let Some(&b) = cluster.iter().find(|&&b| planes[b].stride != stride) {
            return Err(overlap(cluster[0], b));
        }
        // Places within a stride, on a circle of `stride` bytes (every len <= stride here).
        // u128: a stride may be near 2^64.
        let mut places: Vec<(u128, u128, usize)> = cluster
            .iter()
            .map(|&i| {
                let p = &planes[i];
                (u128::from(p.base % stride), u128::from(p.len), i)
            })
            .collect();
        places.sort_unstable();
        for w in places.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(overlap(w[0].2, w[1].2));
            }
        }
        let (first, last) = (places[0], places[places.len() - 1]);
        if last.0 + last.1 > first.0 + u128::from(stride) {
            return Err(overlap(first.2, last.2));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(region: u64, base: u64, stride: u64) -> PlaneSide {
        PlaneSide {
            region: RegionId(region),
            base,
            stride,
        }
    }

    fn plane(local: PlaneSide, remote: PlaneSide, block_bytes: u64) -> Plane {
        Plane {
            local,
            remote,
            block_bytes,
        }
    }

    fn pairs(ids: &[(u32, u32)]) -> Vec<BlockPair> {
        ids.iter()
            .map(|&(local, remote)| BlockPair { local, remote })
            .collect()
    }

    /// A layer per region, K and V in its halves: the shape a paged-attention engine registers.
    fn layers(n: u64, blocks: u64, bs: u64) -> Vec<Plane> {
        (0..n)
            .flat_map(|l| {
                (0..2).map(move |kv| {
                    let s = side(100 + l, kv * blocks * bs, bs);
                    plane(s, side(200 + l, kv * blocks * bs, bs), bs)
                })
            })
            .collect()
    }

    #[test]
    fn a_kv_layout_passes_and_reports_its_largest_ids() {
        let t = BlockTable {
            planes: layers(32, 1000, 4096),
            blocks: pairs(&[(5, 900), (999, 3), (0, 0)]),
        };
        let shape = t.validate(Opcode::Read).unwrap();
        assert_eq!((shape.max_local, shape.max_remote), (999, 900));
        assert_eq!(t.elements(), Some(64 * 3));
        assert_eq!(t.bytes(), Some(64 * 3 * 4096));
        assert_eq!(t.element(2, 1), 7);
        t.validate(Opcode::Write).unwrap();
    }

    #[test]
    fn empty_tables_and_zero_length_planes_are_refused() {
        let mut t = BlockTable {
            planes: layers(1, 10, 64),
            blocks: Vec::new(),
        };
        assert!(matches!(t.validate(Opcode::Read), Err(Error::EmptyBatch)));
        t.blocks = pairs(&[(1, 1)]);
        t.planes[1].block_bytes = 0;
        let e = t.validate(Opcode::Read).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidPlane {
                    plane: 1,
                    field: "block_bytes",
                    ..
                }
            ),
            "{e}"
        );
        t.planes.clear();
        assert!(matches!(t.validate(Opcode::Read), Err(Error::EmptyBatch)));
        t.planes = vec![layers(1, 1, 1)[0]; MAX_PLANES + 1];
        assert!(matches!(
            t.validate(Opcode::Read),
            Err(Error::BatchTooLarge {
                field: "planes",
                ..
            })
        ));
    }

    #[test]
    fn planes_whose_last_block_passes_2_64_are_typed_errors() {
        let t = BlockTable {
            planes: vec![plane(
                side(1, 0, 4096),
                side(2, u64::MAX - 8190, 4096),
                4096,
            )],
            blocks: pairs(&[(0, 0), (1, 1)]),
        };
        let e = t.validate(Opcode::Read).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidPlane {
                    plane: 0,
                    field: "remote.stride",
                    ..
                }
            ),
            "{e}"
        );
        // The id times the stride alone can pass 2^64.
        let t = BlockTable {
            planes: vec![plane(side(1, 0, u64::MAX / 2), side(2, 0, 1), 1)],
            blocks: pairs(&[(0, 0), (3, 1)]),
        };
        assert!(matches!(
            t.validate(Opcode::Write),
            Err(Error::InvalidPlane {
                field: "local.stride",
                ..
            })
        ));
    }

    #[test]
    fn a_destination_id_twice_names_both_blocks_on_either_path() {
        // Small ids: the bitmap; one huge id: the sort.
        for far in [7u32, u32::MAX] {
            let t = BlockTable {
                planes: layers(2, 1 << 20, 16),
                blocks: pairs(&[(3, 1), (far, 2), (9, 3), (3, 4)]),
            };
            let e = t.validate(Opcode::Read).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::DuplicateBlock {
                        first: 0,
                        second: 3,
                        side: Side::Local,
                        block: 3
                    }
                ),
                "{far}: {e}"
            );
            // The same ids are a source when writing: read twice, written once each.
            let mut w = t.clone();
            for b in &mut w.blocks {
                std::mem::swap(&mut b.local, &mut b.remote);
            }
            w.validate(Opcode::Read).unwrap();
            w.validate(Opcode::Write).unwrap_err();
        }
    }

    #[test]
    fn destination_strides_shorter_than_a_block_are_refused_but_sources_may_repeat() {
        // Remote stride 0: one remote block read into every local block.
        let mut t = BlockTable {
            planes: vec![plane(side(1, 0, 4096), side(2, 64, 0), 4096)],
            blocks: pairs(&[(0, 0), (1, 1), (2, 2)]),
        };
        t.validate(Opcode::Read).unwrap();
        let e = t.validate(Opcode::Write).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidPlane {
                    plane: 0,
                    field: "remote.stride",
                    value: 0,
                    ..
                }
            ),
            "{e}"
        );
        // One block alone has no neighbour to overlap.
        t.blocks.truncate(1);
        t.validate(Opcode::Write).unwrap();
    }

    #[test]
    fn destination_planes_that_meet_are_refused_whatever_their_order() {
        // Two layers' planes in one region, V of layer 0 starting inside K of layer 1.
        let bs = 4096;
        let mk = |bases: &[u64]| BlockTable {
            planes: bases
                .iter()
                .map(|&b| plane(side(1, b, bs), side(2, b, bs), bs))
                .collect(),
            blocks: pairs(&[(0, 0), (9, 9)]),
        };
        mk(&[0, 10 * bs, 20 * bs]).validate(Opcode::Read).unwrap();
        let e = mk(&[20 * bs, 0, 9 * bs])
            .validate(Opcode::Read)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::OverlappingPlanes {
                    first: 1,
                    second: 2,
                    ..
                }
            ),
            "{e}"
        );
        // Planes in different regions never meet.
        let mut apart = mk(&[0, 0]);
        apart.planes[1].local.region = RegionId(9);
        apart.validate(Opcode::Read).unwrap();
        // But they do on the side written.
        apart.validate(Opcode::Write).unwrap_err();
    }

    #[test]
    fn interleaved_planes_pass_when_their_places_in_a_stride_are_apart() {
        // K and V of every block side by side (stride 2 blocks), two layers in one region whose
        // extents do not meet, and all four planes of a block interleaved in another.
        let bs = 4096;
        let n = 100;
        let kv = |base: u64, stride: u64| plane(side(1, base, stride), side(2, base, stride), bs);
        let t = BlockTable {
            planes: vec![
                kv(0, 2 * bs),
                kv(bs, 2 * bs),
                kv(2 * bs * n, 2 * bs),
                kv(2 * bs * n + bs, 2 * bs),
            ],
            blocks: pairs(&[(0, 7), (n as u32 - 1, 3), (50, 50)]),
        };
        t.validate(Opcode::Read).unwrap();
        let all: Vec<Plane> = (0..4).map(|k| kv(k * bs, 4 * bs)).collect();
        let t = BlockTable {
            planes: all,
            blocks: t.blocks.clone(),
        };
        t.validate(Opcode::Read).unwrap();
        // A plane that straddles two places, or wraps past the end of the stride, meets another.
        let mut bad = t.clone();
        bad.planes[2].local.base = 2 * bs + 1;
        let e = bad.validate(Opcode::Read).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OverlappingPlanes {
                    first: 2,
                    second: 3,
                    ..
                }
            ),
            "{e}"
        );
        let mut wraps = t.clone();
        wraps.planes[3].local.base = 3 * bs + 8;
        let e = wraps.validate(Opcode::Read).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OverlappingPlanes {
                    first: 0,
                    second: 3,
                    ..
                }
            ),
            "{e}"
        );
        // Interleaved planes of different strides are refused.
        let mut mixed = t.clone();
        mixed.planes[1].local.stride = 8 * bs;
        mixed.validate(Opcode::Read).unwrap_err();
    }

    /// Every table the checks accept, expanded by brute force, has no two destination blocks
    /// sharing a byte; and tables with such blocks are refused.
    #[test]
    fn what_the_checks_accept_never_overlaps() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(16);
        let mut accepted = 0;
        for _ in 0..3000 {
            let planes: Vec<Plane> = (0..rng.random_range(1..5))
                .map(|_| {
                    let len = rng.random_range(1..40);
                    let s = side(
                        rng.random_range(1..3),
                        rng.random_range(0..200),
                        rng.random_range(0..90),
                    );
                    plane(s, side(9, 0, 1000), len)
                })
                .collect();
            let blocks: Vec<BlockPair> = (0..rng.random_range(1..5))
                .map(|k| BlockPair {
                    local: rng.random_range(0..6),
                    remote: k,
                })
                .collect();
            let t = BlockTable { planes, blocks };
            let mut bytes: Vec<(RegionId, u64)> = Vec::new();
            for p in &t.planes {
                for b in &t.blocks {
                    let at = p.local.base + u64::from(b.local) * p.local.stride;
                    bytes.extend((at..at + p.block_bytes).map(|x| (p.local.region, x)));
                }
            }
            let n = bytes.len();
            bytes.sort_unstable();
            bytes.dedup();
            let overlaps = bytes.len() != n;
            match t.validate(Opcode::Read) {
                Ok(_) => {
                    assert!(!overlaps, "accepted an overlapping table: {t:?}");
                    accepted += 1;
                }
                Err(e) => assert!(
                    matches!(
                        e,
                        Error::DuplicateBlock { .. }
                            | Error::OverlappingPlanes { .. }
                            | Error::InvalidPlane { .. }
                    ),
                    "{e}"
                ),
            }
        }
        assert!(
            accepted > 300,
            "only {accepted} accepted: the test says little"
        );
    }
}
