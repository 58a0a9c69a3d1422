//! cuda-ipc, GPU to GPU on one node: the peer's GPU regions are mapped into this process with
//! their IPC handles (from its segment descriptor; cached per region, closed when the region
//! leaves the descriptor or the link is dropped), and each batch is ONE piece of GPU work on the
//! local device: a kernel over a device-side op list, or over a block table whose addresses it
//! computes itself (SM path), or one batched copy-engine call (CE path). Completion comes from
//! the lane (the caller polling its own batch briefly, then the lane's completion thread).

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Piece, PlannedTable, Transport, TransportKind, TransportStats};
use crate::batch::Job;
use crate::block_table::plane_end;
use crate::cuda::driver::{self, Imported};
use crate::cuda::lane::{DeviceCopy, Done, INLINE_OPS, Lane, LaneOptions, Work};
use crate::cuda::table_list::DevicePlane;
use crate::cuda::{CudaExport, CudaPath};
use crate::error::{Error, Result, Side};
use crate::op::Opcode;
use crate::region::{AccessKey, Location, RegionId};
use crate::segment::SegmentDescriptor;

/// What we know of one peer GPU region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Remote {
    export: CudaExport,
    key: AccessKey,
    device: u32,
}

/// A batch resolved to this process's device addresses.
struct Planned<W> {
    local: u32,
    /// (source device, destination device), for the copy engines' location hints.
    hints: (u32, u32),
    work: W,
    /// Mappings the copies go through, held until the GPU is done with them.
    keep: Vec<Arc<dyn Any + Send + Sync>>,
}

/// Peer regions resolved to mappings on the executing device, the last one remembered: batches
/// mostly target one region.
struct Mappings<'a> {
    link: &'a CudaIpcLink,
    remotes: &'a HashMap<RegionId, Remote>,
    exec: u32,
    last: Option<(RegionId, Remote, u64, u64)>,
    keep: Vec<Arc<dyn Any + Send + Sync>>,
}

impl Mappings<'_> {
    /// Region `region` (presented with `key`): its description, the device address where it
    /// starts in this process, and its length as the mapping bounds it.
    fn get(&mut self, region: RegionId, key: AccessKey) -> Result<(Remote, u64, u64)> {
        if let Some((id, r, at, len)) = self.last
            && id == region
        {
            if r.key != key {
                return Err(Error::WrongKey {
                    region,
                    side: Side::Remote,
                });
            }
            return Ok((r, at, len));
        }
        let r = *self.remotes.get(&region).ok_or(Error::UnknownRegion {
            region,
            side: Side::Remote,
        })?;
        if r.key != key {
            return Err(Error::WrongKey {
                region,
                side: Side::Remote,
            });
        }
        let m = self.link.import(region, &r, self.exec)?;
        // Plain numbers from here, not an Arc clone per op: every submitting thread would
        // bounce the same refcount cache line.
        let (at, len) = (
            m.base + r.export.offset,
            m.len.saturating_sub(r.export.offset),
        );
        self.keep.push(m);
        self.last = Some((region, r, at, len));
        Ok((r, at, len))
    }
}

#[derive(Debug)]
pub(crate) struct CudaIpcLink {
    peer: String,
    path: CudaPath,
    lane_options: LaneOptions,
    /// Replaced whole when the peer's descriptor changes; a batch plans on a snapshot.
    remotes: Mutex<Arc<HashMap<RegionId, Remote>>>,
    /// Mappings by (peer region, local device they were opened on).
    imports: Mutex<HashMap<(RegionId, u32), Arc<Imported>>>,
    lanes: Mutex<HashMap<u32, Arc<Lane>>>,
    moved: Arc<AtomicU64>,
    push_by_peer: bool,
    /// Batches in flight by direction (`Opcode as usize`), for `executor`.
    in_flight: Arc<[AtomicUsize; 2]>,
    /// (device that runs copies, device whose memory it reads) pairs with peer access enabled,
    /// or refused (false).
    peered: Mutex<HashMap<(u32, u32), bool>>,
}

fn remotes_of(d: &SegmentDescriptor) -> HashMap<RegionId, Remote> {
    d.regions
        .iter()
        .filter_map(|r| match (r.location, r.ipc) {
            (Location::Cuda { device }, Some(export)) => Some((
                r.id,
                Remote {
                    export,
                    key: r.key,
                    device,
                },
            )),
            _ => None,
        })
        .collect()
}

impl CudaIpcLink {
    pub(crate) fn connect(
        remote: &SegmentDescriptor,
        path: CudaPath,
        lane_options: LaneOptions,
        push_by_peer: bool,
    ) -> Result<Self> {
        driver::driver()?;
        Ok(CudaIpcLink {
            peer: remote.name.clone(),
            path,
            lane_options,
            remotes: Mutex::new(Arc::new(remotes_of(remote))),
            imports: Mutex::default(),
            lanes: Mutex::default(),
            moved: Arc::default(),
            push_by_peer,
            in_flight: Arc::default(),
            peered: Mutex::default(),
        })
    }

    fn lane(&self, device: u32) -> Result<Arc<Lane>> {
        let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = lanes.get(&device) {
            return Ok(l.clone());
        }
        let lane = Lane::new(driver::device(device)?, self.lane_options)?;
        lanes.insert(device, lane.clone());
        Ok(lane)
    }

    fn import(&self, region: RegionId, remote: &Remote, local: u32) -> Result<Arc<Imported>> {
        let mut imports = self.imports.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = imports.get(&(region, local)) {
            return Ok(i.clone());
        }
        let mapped =
            Imported::open(driver::device(local)?, &remote.export.handle).map_err(|e| {
                Error::InvalidIpcHandle {
                    region,
                    reason: format!("{e} (the exporting process may have exited)"),
                }
            })?;
        let mapped = Arc::new(mapped);
        imports.insert((region, local), mapped.clone());
        Ok(mapped)
    }

    /// The local device of a batch whose first local piece lives at `first`.
    fn local_device(first: Location) -> Result<u32> {
        match first {
            Location::Cuda { device } => Ok(device),
            other => Err(Error::InvalidConfig {
                field: "local region",
                value: other.to_string(),
                reason: "cuda-ipc moves GPU memory only",
            }),
        }
    }

    /// The peer's regions as this batch sees them, and the device that will copy it.
    fn mappings<'a>(
        &'a self,
        remotes: &'a HashMap<RegionId, Remote>,
        regions: impl Iterator<Item = RegionId> + Clone,
        opcode: Opcode,
        local: u32,
    ) -> Mappings<'a> {
        Mappings {
            link: self,
            remotes,
            exec: self.executor(regions, opcode, local, remotes),
            last: None,
            keep: Vec::new(),
        }
    }

    fn hints(opcode: Opcode, local: u32, remote: u32) -> (u32, u32) {
        match opcode {
            Opcode::Read => (remote, local),
            Opcode::Write => (local, remote),
        }
    }

    /// Resolves every piece to device addresses in this process, checking keys and bounds
    /// against the mapping's real size.
    fn plan(&self, pieces: &[Piece], opcode: Opcode) -> Result<Planned<Vec<DeviceCopy>>> {
        let Some(first) = pieces.first() else {
            return Err(Error::EmptyBatch);
        };
        let local = Self::local_device(first.location)?;
        let remotes = self.remotes();
        let mut maps = self.mappings(
            &remotes,
            pieces.iter().map(|p| p.remote.region),
            opcode,
            local,
        );
        let mut copies = Vec::with_capacity(pieces.len());
        let mut remote_device = local;
        for p in pieces {
            let region = p.remote.region;
            let (remote, at, region_len) = maps.get(region, p.remote.key)?;
            remote_device = remote.device;
            if p.remote
                .offset
                .checked_add(p.remote.len)
                .is_none_or(|end| end > region_len)
            {
                return Err(Error::OutOfBounds {
                    op: p.op,
                    field: "remote_offset",
                    region,
                    offset: p.remote.offset,
                    len: p.remote.len,
                    region_len,
                });
            }
            // Inside the mapping: offset + len <= region_len (checked above).
            let there = at + p.remote.offset;
            let here = p.local.ptr as usize as u64;
            let (src, dst) = match opcode {
                Opcode::Read => (there, here),
                Opcode::Write => (here, there),
            };
            copies.push(DeviceCopy {
                src,
                dst,
                len: p.remote.len,
            });
        }
        Ok(Planned {
            local: maps.exec,
            hints: Self::hints(opcode, local, remote_device),
            work: copies,
            keep: maps.keep,
        })
    }

    /// Resolves every plane of a table to device addresses in this process: its key, and the
    /// largest remote id's block against the mapping's real size. The ids stay as they are.
    fn plan_table(
        &self,
        table: &PlannedTable,
        opcode: Opcode,
    ) -> Result<Planned<Vec<DevicePlane>>> {
        let local = Self::local_device(table.planes[0].location)?;
        let remotes = self.remotes();
        let mut maps = self.mappings(
            &remotes,
            table.planes.iter().map(|p| p.remote.region),
            opcode,
            local,
        );
        let max = table.shape.max_remote;
        let mut planes = Vec::with_capacity(table.planes.len());
        let mut remote_device = local;
        for (i, p) in table.planes.iter().enumerate() {
            let r = &p.remote;
            let (remote, at, region_len) = maps.get(r.region, r.key)?;
            remote_device = remote.device;
            let end = plane_end(r.base, r.stride, max, r.block_bytes);
            if end.is_none_or(|end| end > region_len) {
                return Err(Error::PlaneOutOfBounds {
                    plane: i,
                    side: Side::Remote,
                    region: r.region,
                    block: max,
                    offset: r
                        .base
                        .saturating_add(u64::from(max).saturating_mul(r.stride)),
                    len: r.block_bytes,
                    region_len,
                });
            }
            planes.push(DevicePlane {
                local: p.local.ptr as usize as u64,
                local_stride: p.local_stride,
                // Inside the mapping: the largest block ends within region_len.
                remote: at + r.base,
                remote_stride: r.stride,
                len: r.block_bytes,
            });
        }
        Ok(Planned {
            local: maps.exec,
            hints: Self::hints(opcode, local, remote_device),
            work: planes,
            keep: maps.keep,
        })
    }

    fn remotes(&self) -> Arc<HashMap<RegionId, Remote>> {
        self.remotes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The device whose SMs copy the batch. Over NVLink a pull reaches 1–2% more than a push
    /// when one direction is busy, but two pulls in opposite directions stall each other (read
    /// requests share each direction with the other's data: 1.80× one direction on 2 × H200)
    /// while two pushes do not (1.97×). So each batch is pulled by its destination GPU, unless
    /// batches of the other direction are in flight on this link: then it is pushed by its
    /// source GPU. The peer's GPU runs a batch only when this process can use it
    /// (`cuda_push_by_peer`); anything unusual (several peer devices, no peer access) keeps the
    /// copy on the local device.
    fn executor(
        &self,
        mut regions: impl Iterator<Item = RegionId> + Clone,
        opcode: Opcode,
        local: u32,
        remotes: &HashMap<RegionId, Remote>,
    ) -> u32 {
        let both_ways = self.in_flight[other(opcode) as usize].load(Ordering::Acquire) > 0;
        let by_peer = match opcode {
            Opcode::Read => both_ways,
            Opcode::Write => !both_ways,
        };
        if !by_peer || !self.push_by_peer {
            return local;
        }
        let Some(peer) = regions
            .clone()
            .next()
            .and_then(|r| remotes.get(&r))
            .map(|r| r.device)
        else {
            return local;
        };
        if peer == local || regions.any(|r| remotes.get(&r).map(|r| r.device) != Some(peer)) {
            return local;
        }
        let mut peered = self.peered.lock().unwrap_or_else(|e| e.into_inner());
        let ok = *peered.entry((peer, local)).or_insert_with(|| {
            match (driver::device(peer), driver::device(local)) {
                (Ok(p), Ok(l)) => driver::enable_peer(p, l).is_ok(),
                _ => false,
            }
        });
        if ok { peer } else { local }
    }

    /// Plans the batch and hands it to the executing device's lane; `deadline` set: the caller
    /// blocks on it next (`Lane::run_here`).
    fn run(&self, pieces: &[Piece], job: &Arc<Job>, deadline: Option<Instant>) -> Result<()> {
        // Peer::submit has checked that every local region is on the first one's device.
        let planned = self.plan(pieces, job.opcode)?;
        let bytes: u64 = planned.work.iter().map(|c| c.len).sum();
        let path = self
            .path
            .for_batch(planned.work.len(), bytes, planned.hints);
        let work = Work::Copies {
            path,
            copies: &planned.work,
            hints: planned.hints,
        };
        self.start(planned.local, work, bytes, planned.keep, job, deadline)
    }

    /// A block table: one launch of the table kernel over planes and ids. Batches the kernel
    /// does not suit go as explicit copies: those for the copy engines, and ones small enough
    /// for kernel parameters or the doorbell.
    fn run_table(
        &self,
        table: &PlannedTable,
        job: &Arc<Job>,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let planned = self.plan_table(table, job.opcode)?;
        let elements = table.elements();
        let path = self.path.for_batch(elements, table.bytes, planned.hints);
        let pull = job.opcode == Opcode::Read;
        if path == CudaPath::Ce || elements <= INLINE_OPS {
            let copies: Vec<DeviceCopy> = planned
                .work
                .iter()
                .flat_map(|p| {
                    table.blocks.iter().map(move |b| {
                        // Exact: the plan checked the largest block of both sides.
                        let local = p.local + u64::from(b.local) * p.local_stride;
                        let remote = p.remote + u64::from(b.remote) * p.remote_stride;
                        let (src, dst) = if pull {
                            (remote, local)
                        } else {
                            (local, remote)
                        };
                        DeviceCopy {
                            src,
                            dst,
                            len: p.len,
                        }
                    })
                })
                .collect();
            let work = Work::Copies {
                path,
                copies: &copies,
                hints: planned.hints,
            };
            return self.start(
                planned.local,
                work,
                table.bytes,
                planned.keep,
                job,
                deadline,
            );
        }
        let work = Work::Table {
            planes: &planned.work,
            blocks: &table.blocks,
            pull,
        };
        self.start(
            planned.local,
            work,
            table.bytes,
            planned.keep,
            job,
            deadline,
        )
    }

    /// Hands `work` to device `exec`'s lane, counting the batch in flight until it is done.
    fn start(
        &self,
        exec: u32,
        work: Work<'_>,
        bytes: u64,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
        job: &Arc<Job>,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let lane = self.lane(exec)?;
        let done_job = job.clone();
        let moved = self.moved.clone();
        let in_flight = self.in_flight.clone();
        let direction = job.opcode as usize;
        in_flight[direction].fetch_add(1, Ordering::AcqRel);
        let done: Done = Box::new(move |r| {
            in_flight[direction].fetch_sub(1, Ordering::AcqRel);
            match r {
                Ok(()) => {
                    moved.fetch_add(bytes, Ordering::Relaxed);
                    done_job.piece_done(bytes)
                }
                Err(e) => done_job.piece_failed(e),
            }
        });
        // A lane that refuses the batch drops `done` unrun: count the batch out here then.
        let r = match deadline {
            Some(deadline) => lane.run_here(work, bytes, done, keep, deadline),
            None => lane.submit(work, done, keep),
        };
        if r.is_err() {
            self.in_flight[direction].fetch_sub(1, Ordering::AcqRel);
        }
        r
    }
}

fn other(opcode: Opcode) -> Opcode {
    match opcode {
        Opcode::Read => Opcode::Write,
        Opcode::Write => Opcode::Read,
    }
}

impl Transport for CudaIpcLink {
    fn kind(&self) -> TransportKind {
        TransportKind::CudaIpc
    }

    fn submit(&self, pieces: Vec<Piece>, job: Arc<Job>) {
        job.expect_pieces(1);
        if let Err(e) = self.run(&pieces, &job, None) {
            job.piece_failed(e);
        }
    }

    fn run_here(&self, pieces: Vec<Piece>, job: Arc<Job>, deadline: Instant) {
        job.expect_pieces(1);
        if let Err(e) = self.run(&pieces, &job, Some(deadline)) {
            job.piece_failed(e);
        }
    }

    fn submit_table(&self, table: PlannedTable, job: Arc<Job>) {
        job.expect_pieces(1);
        if let Err(e) = self.run_table(&table, &job, None) {
            job.piece_failed(e);
        }
    }

    fn run_table_here(&self, table: PlannedTable, job: Arc<Job>, deadline: Instant) {
        job.expect_pieces(1);
        if let Err(e) = self.run_table(&table, &job, Some(deadline)) {
            job.piece_failed(e);
        }
    }

    fn stats(&self) -> TransportStats {
        let lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        TransportStats {
            connections: lanes.len(),
            bytes: self.moved.load(Ordering::Relaxed),
            resident_kernels: lanes.values().map(|l| l.resident_kernels()).sum(),
        }
    }

    fn mapped(&self) -> usize {
        self.imports.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Drops the mappings of regions the peer no longer publishes (or re-exported), so their
    /// memory can be freed on its side; in-flight copies keep theirs until they complete.
    fn regions_changed(&self, descriptor: &SegmentDescriptor) {
        let now = remotes_of(descriptor);
        let mut remotes = self.remotes.lock().unwrap_or_else(|e| e.into_inner());
        self.imports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(id, _), _| remotes.get(id).is_some_and(|r| now.get(id) == Some(r)));
        *remotes = Arc::new(now);
        tracing::debug!(peer = %self.peer, regions = remotes.len(), "cuda-ipc regions updated");
    }
}
