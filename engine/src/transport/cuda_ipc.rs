//! cuda-ipc, GPU to GPU on one node: the peer's GPU regions are mapped into this process with
//! their IPC handles (from its segment descriptor; cached per region, closed when the region
//! leaves the descriptor or the link is dropped), and each batch is ONE piece of GPU work on the
//! local device: a kernel over a device-side op list (SM path) or one batched copy-engine call
//! (CE path). Completion comes from the lane's completion thread, not from the submitter.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Piece, Transport, TransportKind, TransportStats};
use crate::batch::Job;
use crate::cuda::driver::{self, Imported};
use crate::cuda::lane::{DeviceCopy, Done, Lane};
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
struct Planned {
    local: u32,
    /// (source device, destination device), for the copy engines' location hints.
    hints: (u32, u32),
    copies: Vec<DeviceCopy>,
    /// Mappings the copies go through, held until the GPU is done with them.
    keep: Vec<Arc<dyn Any + Send + Sync>>,
}

#[derive(Debug)]
pub(crate) struct CudaIpcLink {
    peer: String,
    path: CudaPath,
    spin: bool,
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
        spin: bool,
        push_by_peer: bool,
    ) -> Result<Self> {
        driver::driver()?;
        Ok(CudaIpcLink {
            peer: remote.name.clone(),
            path,
            spin,
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
        let lane = Lane::new(driver::device(device)?, self.spin)?;
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

    /// Resolves every piece to device addresses in this process, checking keys and bounds
    /// against the mapping's real size.
    fn plan(&self, pieces: &[Piece], opcode: Opcode) -> Result<Planned> {
        let Some(first) = pieces.first() else {
            return Err(Error::EmptyBatch);
        };
        let Location::Cuda { device: local } = first.location else {
            return Err(Error::InvalidConfig {
                field: "local region",
                value: first.location.to_string(),
                reason: "cuda-ipc moves GPU memory only",
            });
        };
        let remotes = self
            .remotes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let exec = self.executor(pieces, opcode, local, &remotes);
        let mut keep: Vec<Arc<dyn Any + Send + Sync>> = Vec::new();
        // (region, mapping base, mapping length) of the last mapping used. Plain numbers, not an
        // Arc clone per op: every submitting thread would bounce the same refcount cache line.
        let mut held: Option<(RegionId, u64, u64)> = None;
        let mut copies = Vec::with_capacity(pieces.len());
        let mut remote_device = local;
        let mut last: Option<(RegionId, Remote)> = None;
        for p in pieces {
            let region = p.remote.region;
            // Batches mostly target one region: skip the map lookup while it stays the same.
            let remote = match last {
                Some((id, r)) if id == region => r,
                _ => {
                    let r = *remotes.get(&region).ok_or(Error::UnknownRegion {
                        region,
                        side: Side::Remote,
                    })?;
                    last = Some((region, r));
                    r
                }
            };
            let remote = &remote;
            if remote.key != p.remote.key {
                return Err(Error::WrongKey {
                    region,
                    side: Side::Remote,
                });
            }
            remote_device = remote.device;
            let (base, mapped_len) = match held {
                Some((id, base, len)) if id == region => (base, len),
                _ => {
                    let m = self.import(region, remote, exec)?;
                    let (base, len) = (m.base, m.len);
                    keep.push(m);
                    held = Some((region, base, len));
                    (base, len)
                }
            };
            let region_len = mapped_len.saturating_sub(remote.export.offset);
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
            // Inside the mapping: offset + len <= mapped_len - export.offset (checked above).
            let there = base + remote.export.offset + p.remote.offset;
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
        let hints = match opcode {
            Opcode::Read => (remote_device, local),
            Opcode::Write => (local, remote_device),
        };
        Ok(Planned {
            local: exec,
            hints,
            copies,
            keep,
        })
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
        pieces: &[Piece],
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
        let Some(peer) = remotes.get(&pieces[0].remote.region).map(|r| r.device) else {
            return local;
        };
        if peer == local
            || pieces
                .iter()
                .any(|p| remotes.get(&p.remote.region).map(|r| r.device) != Some(peer))
        {
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
        let Planned {
            local,
            hints,
            copies,
            keep,
        } = self.plan(pieces, job.opcode)?;
        let bytes: u64 = copies.iter().map(|c| c.len).sum();
        let path = self.path.for_batch(copies.len(), bytes, hints);
        let lane = self.lane(local)?;
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
            Some(deadline) => lane.run_here(path, &copies, hints, done, keep, deadline),
            None => lane.submit(path, &copies, hints, done, keep),
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

    fn stats(&self) -> TransportStats {
        TransportStats {
            connections: self.lanes.lock().unwrap_or_else(|e| e.into_inner()).len(),
            bytes: self.moved.load(Ordering::Relaxed),
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
