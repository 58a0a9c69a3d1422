//! What the target of a tcp chunk checks before a byte moves, and what passes: each entry's (or
//! table plane's) region and key, its range inside the region, GPU ranges only with staging, for
//! writes destinations apart. Pure over the region table (no socket), so the `serve` fuzz
//! target drives it with whatever a peer could send.

use super::TransportKind;
use super::staging::{Span, device_of};
use crate::block_table::{SideView, check_destinations, plane_end};
use crate::error::{Error, Result, Side};
use crate::frame::{Entry, TableManifest};
use crate::op::check_disjoint;
use crate::region::{Lease, Location, RawRange};
use crate::region_table::RegionTable;

/// A manifest that passed every check: the leases keep the memory alive while we use it.
#[derive(Debug)]
pub(crate) struct Checked {
    pub(crate) ranges: Vec<RawRange>,
    /// Where each range lives.
    pub(crate) locations: Vec<Location>,
    /// The first GPU any range lives on: the chunk must be staged.
    pub(crate) device: Option<u32>,
    _leases: Vec<Lease>,
}

impl Checked {
    /// Each entry's region and key, its range inside the region, GPU ranges only with staging;
    /// for writes, destinations apart.
    pub(crate) fn entries(
        known: &RegionTable,
        staging_bytes: u64,
        entries: &[Entry],
        writes: bool,
    ) -> Result<Checked> {
        let mut leases: Vec<Lease> = Vec::new();
        let mut ranges = Vec::with_capacity(entries.len());
        let mut locations = Vec::with_capacity(entries.len());
        let mut device = None;
        for (i, e) in entries.iter().enumerate() {
            if e.len == 0 {
                return Err(Error::ZeroLength { op: i });
            }
            let region = match leases.last() {
                Some(l) if l.region().id() == e.region => {
                    l.region().check_key(e.key, Side::Remote)?;
                    l.region().clone()
                }
                _ => {
                    let lease = known.lease_checked(e.region, e.key, Side::Remote)?;
                    let r = lease.region().clone();
                    leases.push(lease);
                    r
                }
            };
            // A device pointer is no host address: a socket never reads or writes through it;
            // its bytes go through the staging ring, or nowhere when staging is off.
            if let Some(d) = device_of(region.location()) {
                if staging_bytes == 0 {
                    return Err(Error::StagingNotConfigured {
                        op: i,
                        region: region.id(),
                        location: region.location(),
                        transport: TransportKind::Tcp,
                    });
                }
                device = device.or(Some(d));
            }
            ranges.push(region.range(i, "remote_offset", e.offset, e.len)?);
            locations.push(region.location());
        }
        if writes {
            check_disjoint(entries.len(), |i| {
                let e = &entries[i];
                (e.region, e.offset, e.len)
            })?;
        }
        Ok(Checked {
            ranges,
            locations,
            device,
            _leases: leases,
        })
    }

    /// A table manifest checked as [`Checked::entries`] checks entries, but per plane: its region and key,
    /// the bounds of its largest block id, staging; for writes, destinations apart. Then each
    /// element's range, in element order.
    pub(crate) fn table(
        known: &RegionTable,
        staging_bytes: u64,
        table: &TableManifest,
        writes: bool,
    ) -> Result<Checked> {
        let blocks = table.blocks.len();
        let max = table.blocks.iter().copied().max().unwrap_or(0);
        let mut leases: Vec<Lease> = Vec::new();
        let mut regions = Vec::with_capacity(table.planes.len());
        let mut device = None;
        for (i, p) in table.planes.iter().enumerate() {
            let region = match leases.iter().find(|l| l.region().id() == p.region) {
                Some(l) => {
                    l.region().check_key(p.key, Side::Remote)?;
                    l.region().clone()
                }
                None => {
                    let lease = known.lease_checked(p.region, p.key, Side::Remote)?;
                    let r = lease.region().clone();
                    leases.push(lease);
                    r
                }
            };
            if p.block_bytes == 0 {
                return Err(Error::InvalidPlane {
                    plane: i,
                    field: "block_bytes",
                    value: 0,
                    reason: "blocks need at least one byte",
                });
            }
            let end =
                plane_end(p.base, p.stride, max, p.block_bytes).ok_or(Error::InvalidPlane {
                    plane: i,
                    field: "remote.stride",
                    value: p.stride,
                    reason: "base + largest block id × stride + block_bytes passes 2^64",
                })?;
            if end > region.len() {
                return Err(Error::PlaneOutOfBounds {
                    plane: i,
                    side: Side::Remote,
                    region: region.id(),
                    block: max,
                    offset: end - p.block_bytes,
                    len: p.block_bytes,
                    region_len: region.len(),
                });
            }
            if let Some(d) = device_of(region.location()) {
                if staging_bytes == 0 {
                    return Err(Error::StagingNotConfigured {
                        op: i * blocks,
                        region: region.id(),
                        location: region.location(),
                        transport: TransportKind::Tcp,
                    });
                }
                device = device.or(Some(d));
            }
            regions.push(region);
        }
        if writes {
            let views: Vec<SideView> = table
                .planes
                .iter()
                .map(|p| SideView {
                    region: p.region,
                    base: p.base,
                    stride: p.stride,
                    len: p.block_bytes,
                })
                .collect();
            check_destinations(&views, blocks, |j| table.blocks[j], Side::Remote)?;
        }
        let n = table.planes.len() * blocks;
        let (mut ranges, mut locations) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (i, (p, region)) in table.planes.iter().zip(&regions).enumerate() {
            for (j, &id) in table.blocks.iter().enumerate() {
                // Exact: the largest id's block ends inside the region (checked above).
                let offset = p.base + u64::from(id) * p.stride;
                ranges.push(region.range(
                    i * blocks + j,
                    "remote_offset",
                    offset,
                    p.block_bytes,
                )?);
                locations.push(region.location());
            }
        }
        Ok(Checked {
            ranges,
            locations,
            device,
            _leases: leases,
        })
    }

    pub(crate) fn spans(&self) -> Vec<Span> {
        self.ranges
            .iter()
            .copied()
            .zip(self.locations.iter().copied())
            .collect()
    }
}
