//! A block table after the initiator's checks, as transports take it: each plane's local side
//! resolved to the checked range it spans, its remote side as the target will check it, and the
//! block-id pairs shared by all. Transports that copy on the host expand it here, in one pass;
//! cuda-ipc hands planes and ids to its kernel instead.

use std::sync::Arc;

use super::Piece;
use crate::block_table::{BlockPair, TableShape};
use crate::frame::{Entry, TablePlane};
use crate::region::{Location, RawRange, RegionId};

/// One plane, checked: every block the table names lies inside `local` and inside the remote
/// region as its descriptor says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlannedPlane {
    /// From block 0 of the local side to the end of its largest block id's block.
    pub local: RawRange,
    pub local_region: RegionId,
    pub local_base: u64,
    pub local_stride: u64,
    pub location: Location,
    /// The remote side, key included, and the plane's block bytes.
    pub remote: TablePlane,
}

#[derive(Debug, Clone)]
pub(crate) struct PlannedTable {
    pub planes: Vec<PlannedPlane>,
    pub blocks: Arc<[BlockPair]>,
    /// The largest ids: what cuda-ipc checks its mappings against.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub shape: TableShape,
    /// Bytes the table moves.
    pub bytes: u64,
}

impl PlannedTable {
    pub fn elements(&self) -> usize {
        self.planes.len() * self.blocks.len()
    }

    /// Element `(p, j)`: block `j` of plane `p`.
    pub fn piece(&self, p: usize, j: usize) -> Piece {
        let plane = &self.planes[p];
        let b = self.blocks[j];
        let len = plane.remote.block_bytes;
        // Exact: the plan checked base + largest id × stride + len on both sides.
        let at = u64::from(b.local) * plane.local_stride;
        Piece {
            local: RawRange {
                // SAFETY: at + len <= plane.local.len (the largest local id's block ends inside
                // the checked extent, and this id is no larger).
                ptr: unsafe { plane.local.ptr.add(at as usize) },
                len: len as usize,
            },
            remote: Entry {
                region: plane.remote.region,
                key: plane.remote.key,
                offset: plane.remote.base + u64::from(b.remote) * plane.remote.stride,
                len,
            },
            local_region: plane.local_region,
            local_offset: plane.local_base + at,
            op: p * self.blocks.len() + j,
            location: plane.location,
        }
    }

    /// Every element, plane by plane, each block in table order.
    pub fn each(&self) -> impl Iterator<Item = Piece> + '_ {
        (0..self.planes.len())
            .flat_map(move |p| (0..self.blocks.len()).map(move |j| self.piece(p, j)))
    }

    /// The elements with neighbours merged (blocks allocated back to back become one copy):
    /// what a transport that copies on the host wants.
    pub fn pieces(&self) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::with_capacity(self.elements());
        for next in self.each() {
            if let Some(last) = out.last_mut()
                && adjoins(last, &next)
            {
                last.local.len += next.local.len;
                last.remote.len += next.remote.len;
                continue;
            }
            out.push(next);
        }
        out
    }
}

/// `next` continues `last` on both sides (same regions, key and place, bytes right after).
fn adjoins(last: &Piece, next: &Piece) -> bool {
    last.local_region == next.local_region
        && last.location == next.location
        && last.remote.region == next.remote.region
        && last.remote.key == next.remote.key
        && last.local.ptr.wrapping_add(last.local.len) == next.local.ptr
        && last.remote.offset.checked_add(last.remote.len) == Some(next.remote.offset)
        && last.local.len.checked_add(next.local.len).is_some()
}
