//! Shared memory, initiator side: maps the peer's memfd regions (fetched once over its Unix
//! socket, then cached) and copies directly, on a small thread pool for large batches.
//!
//! A local GPU region copies straight to or from the peer's mapping with the copy engines
//! (cuMemcpyDtoHAsync / HtoDAsync), the mapping page-locked once (cuMemHostRegister) so the
//! copies run at the full host link rate with no staging copy.

use std::collections::HashMap;

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::fdpass::recv_fd;
use super::io::Until;
use super::staging::{DirectCopy, Direction, HostPin, Streams, copy_direct, device_of};
use super::{Piece, Transport, TransportKind, TransportStats};
use crate::auth::DataSecret;
use crate::batch::Job;
use crate::error::{Error, Result};
use crate::frame::{ENTRY_LEN, FLAG_ERROR, FrameError, FrameKind, HEADER_LEN, Header};
use crate::handshake::{self, Credentials, closed_or_io, read_remote_error};
use crate::op::Opcode;
use crate::region::{AccessKey, RawRange, Region, RegionId};
use crate::segment::SegmentDescriptor;

/// Pieces are cut to this size so one huge op still spreads over every copy thread.
const COPY_SLICE: usize = 1 << 20;

#[derive(Debug)]
pub(crate) struct ShmLink {
    inner: Arc<ShmInner>,
}

/// How to (re)open the control socket: the target closes it after its idle timeout, and a
/// mapping request finding it closed dials again.
#[derive(Debug)]
struct Dial {
    path: PathBuf,
    secret: DataSecret,
    segment: String,
    key: Option<u64>,
    from: String,
    /// Connect, handshake, and every mapping request's reply, each within this.
    timeout: Duration,
}

impl Dial {
    fn open(&self, peer: &str) -> Result<(UnixStream, Option<SegmentDescriptor>)> {
        let mut sock = UnixStream::connect(&self.path)
            .map_err(|e| Error::io(format!("connect shm socket {peer}"), e))?;
        let creds = Credentials {
            secret: &self.secret,
            segment: &self.segment,
            key: self.key,
            from: &self.from,
        };
        let until = &mut Until {
            s: &mut sock,
            deadline: Instant::now() + self.timeout,
        };
        let welcomed = handshake::client(until, peer, creds)?;
        // Mapping requests are answered at once; a target that does not is stuck.
        sock.set_read_timeout(Some(self.timeout))
            .and_then(|()| sock.set_write_timeout(Some(self.timeout)))
            .map_err(|e| Error::io("set shm socket timeouts", e))?;
        Ok((sock, welcomed.descriptor))
    }
}

#[derive(Debug)]
struct ShmInner {
    peer: String,
    dial: Dial,
    sock: Mutex<UnixStream>,
    maps: Mutex<HashMap<RegionId, Arc<Region>>>,
    /// Mappings page-locked for GPU copies (each keeps its mapping alive).
    pins: Mutex<HashMap<RegionId, Arc<HostPin>>>,
    /// Streams for GPU copies, per device.
    streams: Streams,
    pool: Arc<rayon::ThreadPool>,
    parallel_min: u64,
    moved: AtomicU64,
}

impl ShmLink {
    pub(crate) fn connect(
        path: &Path,
        creds: Credentials<'_>,
        timeout: Duration,
        pool: Arc<rayon::ThreadPool>,
        parallel_min: u64,
    ) -> Result<(ShmLink, Option<SegmentDescriptor>)> {
        let peer = path.display().to_string();
        let dial = Dial {
            path: path.to_path_buf(),
            secret: creds.secret.clone(),
            segment: creds.segment.into(),
            key: creds.key,
            from: creds.from.into(),
            timeout,
        };
        let (sock, descriptor) = dial.open(&peer)?;
        let inner = ShmInner {
            peer,
            dial,
            sock: Mutex::new(sock),
            maps: Mutex::default(),
            pins: Mutex::default(),
            streams: Streams::default(),
            pool,
            parallel_min,
            moved: AtomicU64::new(0),
        };
        Ok((
            ShmLink {
                inner: Arc::new(inner),
            },
            descriptor,
        ))
    }
}

impl Transport for ShmLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn submit(&self, pieces: Vec<Piece>, job: Arc<Job>) {
        job.expect_pieces(1);
        let inner = self.inner.clone();
        self.inner.pool.spawn(move || inner.complete(&pieces, &job));
    }

    /// A batch below `parallel_min` is copied by the caller itself: it would be copied by one
    /// pool thread anyway, and the caller then needs no wake-up.
    fn run_here(&self, pieces: Vec<Piece>, job: Arc<Job>, _deadline: Instant) {
        let bytes: u64 = pieces.iter().map(|p| p.remote.len).sum();
        if bytes >= self.inner.parallel_min {
            return self.submit(pieces, job);
        }
        job.expect_pieces(1);
        self.inner.complete(&pieces, &job);
    }

    /// Forgets the mappings of regions the peer no longer publishes (or published anew under
    /// another key), so their memory can be freed; in-flight copies hold their own reference.
    fn regions_changed(&self, descriptor: &SegmentDescriptor) {
        let mut maps = self.inner.maps.lock().unwrap_or_else(|e| e.into_inner());
        maps.retain(|id, r| descriptor.region(*id).is_some_and(|d| d.key == r.key()));
        self.inner
            .pins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|id, p| maps.get(id).is_some_and(|r| base(r) == p.base()));
    }

    fn mapped(&self) -> usize {
        self.inner
            .maps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    fn stats(&self) -> TransportStats {
        TransportStats {
            connections: 1,
            bytes: self.inner.moved.load(Ordering::Relaxed),
            resident_kernels: 0,
        }
    }
}

impl ShmInner {
    /// Runs the batch and completes its one piece.
    fn complete(&self, pieces: &[Piece], job: &Job) {
        match self.run(pieces, job) {
            Ok(bytes) => {
                self.moved.fetch_add(bytes, Ordering::Relaxed);
                job.piece_done(bytes)
            }
            Err(e) => job.piece_failed(e),
        }
    }

    fn run(&self, pieces: &[Piece], job: &Job) -> Result<u64> {
        let mut held: Vec<Arc<Region>> = Vec::new();
        let mut copies: Vec<(RawRange, RawRange, usize)> = Vec::with_capacity(pieces.len());
        // GPU pieces: (copy, op), and the pinned mappings they go through.
        let mut gpu: Vec<(DirectCopy, usize)> = Vec::new();
        let mut pinned: Vec<Arc<HostPin>> = Vec::new();
        let mut total = 0u64;
        for p in pieces {
            let region = match held.last() {
                Some(r) if r.id() == p.remote.region => r.clone(),
                _ => {
                    let r = self.mapping(p.remote.region, p.remote.key)?;
                    held.push(r.clone());
                    r
                }
            };
            // Checked against the mapping's real size, whatever the descriptor said.
            let remote = region.range(p.op, "remote_offset", p.remote.offset, p.remote.len)?;
            total += p.remote.len;
            if let Some(device) = device_of(p.location) {
                if !pinned.iter().any(|x| x.base() == base(&region)) {
                    pinned.push(self.pin(&region, device)?);
                }
                gpu.push((
                    DirectCopy {
                        device,
                        dev: p.local,
                        host: remote,
                    },
                    p.op,
                ));
                continue;
            }
            let (src, dst) = match job.opcode {
                Opcode::Read => (remote, p.local),
                Opcode::Write => (p.local, remote),
            };
            copies.push((src, dst, p.op));
        }
        if job.is_cancelled() {
            return Err(Error::Cancelled { batch: job.id });
        }
        if !gpu.is_empty() {
            let dir = match job.opcode {
                Opcode::Read => Direction::HostToDevice,
                Opcode::Write => Direction::DeviceToHost,
            };
            let list: Vec<DirectCopy> = gpu.iter().map(|g| g.0).collect();
            copy_direct(&list, dir, &self.streams)?;
            if job.checksum {
                self.check_gpu(&gpu)?;
            }
        }
        if total >= self.parallel_min {
            let slices: Vec<(RawRange, RawRange)> = copies
                .iter()
                .flat_map(|&(src, dst, _)| split(src, dst))
                .collect();
            slices.par_iter().for_each(|&(s, d)| copy(s, d));
        } else {
            copies.iter().for_each(|&(s, d, _)| copy(s, d));
        }
        if job.checksum {
            for &(src, dst, op) in &copies {
                // SAFETY: both ranges are leased/mapped and the copy above has finished.
                let (expected, computed) = unsafe {
                    (
                        crc32c::crc32c(src.as_slice()),
                        crc32c::crc32c(dst.as_slice()),
                    )
                };
                if expected != computed {
                    return Err(Error::Checksum {
                        op,
                        expected,
                        computed,
                    });
                }
            }
        }
        Ok(total)
    }

    /// Compares each GPU copy's two ends by crc32c (the device side read back to the host).
    fn check_gpu(&self, gpu: &[(DirectCopy, usize)]) -> Result<()> {
        for &(c, op) in gpu {
            let mut back = vec![0u8; c.dev.len];
            let into = RawRange {
                ptr: back.as_mut_ptr(),
                len: back.len(),
            };
            let read_back = DirectCopy { host: into, ..c };
            copy_direct(&[read_back], Direction::DeviceToHost, &self.streams)?;
            // SAFETY: the mapping is held by the caller and the copies have completed.
            let (expected, computed) = (
                crc32c::crc32c(unsafe { c.host.as_slice() }),
                crc32c::crc32c(&back),
            );
            if expected != computed {
                return Err(Error::Checksum {
                    op,
                    expected,
                    computed,
                });
            }
        }
        Ok(())
    }

    /// The peer's mapping `region`, page-locked for GPU copies (once; kept until the region
    /// leaves the peer's descriptor).
    fn pin(&self, region: &Arc<Region>, device: u32) -> Result<Arc<HostPin>> {
        let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pins.get(&region.id())
            && p.base() == base(region)
        {
            return Ok(p.clone());
        }
        let whole = region.range(0, "len", 0, region.len())?;
        // SAFETY: the pin holds the mapping (an Arc of its region) until it is unregistered.
        let pin = Arc::new(unsafe { HostPin::new(device, whole, region.clone())? });
        pins.insert(region.id(), pin.clone());
        Ok(pin)
    }

    /// The peer's region mapped here, asking the peer for its memfd the first time.
    fn mapping(&self, id: RegionId, key: AccessKey) -> Result<Arc<Region>> {
        if let Some(r) = self.maps.lock().unwrap_or_else(|e| e.into_inner()).get(&id)
            && r.key() == key
        {
            return Ok(r.clone());
        }
        let fd = {
            let mut sock = self.sock.lock().unwrap_or_else(|e| e.into_inner());
            match self.request_fd(&mut sock, id, key) {
                // Closed while idle (the target's idle timeout): dial again, ask again.
                Err(Error::PeerClosed { .. }) => {
                    *sock = self.dial.open(&self.peer)?.0;
                    self.request_fd(&mut sock, id, key)?
                }
                other => other?,
            }
        };
        let region = Arc::new(Region::map_peer(id, key, fd)?);
        self.maps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, region.clone());
        Ok(region)
    }

    fn request_fd(&self, sock: &mut UnixStream, id: RegionId, key: AccessKey) -> Result<OwnedFd> {
        let io = |e| closed_or_io(e, &self.peer);
        let mut req = Header::new(FrameKind::MapRegion, id.0, 1, ENTRY_LEN as u64)
            .encode()
            .to_vec();
        crate::frame::Entry {
            region: id,
            key,
            offset: 0,
            len: 0,
        }
        .encode_into(&mut req);
        std::io::Write::write_all(sock, &req).map_err(io)?;

        let mut head = [0u8; HEADER_LEN];
        let fd = match recv_fd(sock, &mut head) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(Error::PeerClosed {
                    peer: self.peer.clone(),
                });
            }
            other => other.map_err(io)?,
        };
        let h = Header::decode(&head)?;
        if h.kind != FrameKind::MapReply || h.tag != id.0 {
            return Err(FrameError::Unexpected {
                kind: h.kind,
                expected: "the MapReply for the requested region",
            }
            .into());
        }
        if h.has(FLAG_ERROR) {
            return Err(read_remote_error(sock, &h, &self.peer)?);
        }
        fd.ok_or_else(|| {
            FrameError::Body {
                what: "map reply",
                reason: "no file descriptor attached".into(),
            }
            .into()
        })
    }
}

/// Where a mapping starts.
fn base(region: &Region) -> *mut u8 {
    region
        .range(0, "base", 0, 0)
        .map_or(std::ptr::null_mut(), |r| r.ptr)
}

fn split(src: RawRange, dst: RawRange) -> impl Iterator<Item = (RawRange, RawRange)> {
    (0..src.len).step_by(COPY_SLICE).map(move |at| {
        let len = COPY_SLICE.min(src.len - at);
        // SAFETY: at + len <= src.len == dst.len, inside both checked ranges.
        unsafe {
            (
                RawRange {
                    ptr: src.ptr.add(at),
                    len,
                },
                RawRange {
                    ptr: dst.ptr.add(at),
                    len,
                },
            )
        }
    })
}

fn copy(src: RawRange, dst: RawRange) {
    debug_assert_eq!(src.len, dst.len);
    // SAFETY: both ranges are bounds-checked and held (job leases, mapped regions); destination
    // ranges of one batch are disjoint, and a source never overlaps its destination because they
    // live in different mappings.
    unsafe { std::ptr::copy_nonoverlapping(src.ptr, dst.ptr, src.len) };
}
