//! GPU memory on the copying transports: payload bytes that live on a GPU travel through pinned
//! host buffers (cuMemHostAlloc), a ring of `slots` units per connection and direction.
//!
//! Sending, the device → host copy of unit k+1.. (async on a stream, into the next free slot)
//! runs while unit k is written to the socket. Receiving, unit k lands in its slot and is
//! copied host → device asynchronously while unit k+1 is read. Nothing on the wire changes: the
//! peer cannot tell where the bytes live. Every call returns with no copy in flight (also when it
//! fails), so a later call never finds a slot that the GPU still reads or writes.
//!
//! Host spans mixed into a staged payload (a tcp target serving a chunk that names host and GPU
//! regions) are copied through the same slots on the CPU.
// Without the `cuda` feature no GPU region exists: the planning is compiled (and unit-tested)
// but only the stubs below are reachable.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::io::{self, Read, Write};

use crate::error::{Error, Result};
use crate::region::{Location, RawRange};

/// The largest unit staged at once: large enough for one write/read syscall to be cheap, small
/// enough that the ring holds several and the copy of one overlaps the I/O of another.
pub(crate) const UNIT_MAX: usize = 1 << 20;

/// The least `EngineConfig::staging_bytes` may be when it is not 0 (two slots of 4 KiB).
pub(crate) const STAGING_MIN: u64 = 8 << 10;

/// A contiguous stretch of a payload and where its bytes live.
pub(crate) type Span = (RawRange, Location);

/// `len` bytes at offset `at` of span `span`, staged at offset `to` of its unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seg {
    pub span: usize,
    pub at: usize,
    pub len: usize,
    pub to: usize,
}

/// One unit: `plan.segs[first..end]`, `bytes` long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unit {
    pub first: usize,
    pub end: usize,
    pub bytes: usize,
}

/// A payload (spans back to back, as on the wire) cut into units of at most `unit` bytes.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub segs: Vec<Seg>,
    pub units: Vec<Unit>,
}

pub(crate) fn plan(lens: impl IntoIterator<Item = usize>, unit: usize) -> Plan {
    let unit = unit.max(1);
    let mut p = Plan::default();
    let (mut fill, mut first) = (0usize, 0usize);
    for (span, len) in lens.into_iter().enumerate() {
        let mut at = 0;
        while at < len {
            let take = (len - at).min(unit - fill);
            p.segs.push(Seg {
                span,
                at,
                len: take,
                to: fill,
            });
            at += take;
            fill += take;
            if fill == unit {
                p.units.push(Unit {
                    first,
                    end: p.segs.len(),
                    bytes: fill,
                });
                first = p.segs.len();
                fill = 0;
            }
        }
    }
    if fill > 0 {
        p.units.push(Unit {
            first,
            end: p.segs.len(),
            bytes: fill,
        });
    }
    p
}

/// Unit size and slot count for `bytes` of staging (`bytes >= STAGING_MIN`).
pub(crate) fn geometry(bytes: u64) -> (usize, usize) {
    let unit = (bytes / 2).clamp(1, UNIT_MAX as u64) as usize;
    (unit, (bytes / unit as u64).max(2) as usize)
}

/// The GPU a span lives on, if any.
pub(crate) fn device_of(location: Location) -> Option<u32> {
    match location {
        Location::Cuda { device } => Some(device),
        Location::Host { .. } => None,
    }
}

/// Folds the crc32c of every segment of a unit's bytes into the running crc of its span.
fn crc_unit(plan: &Plan, unit: &Unit, bytes: &[u8], crcs: &mut [u32]) {
    for s in &plan.segs[unit.first..unit.end] {
        crcs[s.span] = crc32c::crc32c_append(crcs[s.span], &bytes[s.to..s.to + s.len]);
    }
}

#[cfg(feature = "cuda")]
pub(crate) use imp::{HostPin, Staging, Streams, copy_direct};
#[cfg(not(feature = "cuda"))]
pub(crate) use stub::{HostPin, Staging, Streams, copy_direct};

/// Which way a direct copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    DeviceToHost,
    HostToDevice,
}

/// One direct copy between device memory (`dev`, a device address) and host memory (`host`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DirectCopy {
    pub device: u32,
    pub dev: RawRange,
    pub host: RawRange,
}

#[cfg(feature = "cuda")]
mod imp {
    use std::any::Any;
    use std::collections::HashMap;
    use std::io::IoSlice;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use cudarc::driver::sys;
    use tracing::warn;

    use super::*;
    use crate::cuda::batch_copy::{Place, batch_copy};
    use crate::cuda::driver::{self, Device, Event, Pinned, Stream, check};
    use crate::transport::io::write_all_vectored;

    /// Cleared once the driver refuses cuMemcpyBatchAsync; units then go as one async copy per
    /// segment.
    static BATCH_COPIES: AtomicBool = AtomicBool::new(true);

    /// A stream on one GPU and one event per slot.
    struct Queue {
        stream: Stream,
        events: Vec<Event>,
    }

    /// The pinned ring of one connection and direction. Used by one thread at a time.
    pub(crate) struct Staging {
        home: &'static Device,
        buf: Pinned,
        unit: usize,
        slots: usize,
        queues: HashMap<u32, Queue>,
        /// Per slot: the GPUs whose copies into or out of it may still run.
        pending: Vec<Vec<u32>>,
    }

    impl std::fmt::Debug for Staging {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Staging({} × {} B pinned)", self.slots, self.unit)
        }
    }

    impl Staging {
        /// Allocates `bytes` of pinned memory (with `device`'s context; usable by every GPU).
        pub(crate) fn new(bytes: u64, device: u32) -> Result<Staging> {
            let home = driver::device(device)?;
            let (unit, slots) = geometry(bytes);
            let buf = Pinned::alloc(home, unit * slots)?;
            Ok(Staging {
                home,
                buf,
                unit,
                slots,
                queues: HashMap::new(),
                pending: vec![Vec::new(); slots],
            })
        }

        fn slot_ptr(&self, slot: usize) -> *mut u8 {
            debug_assert!(slot < self.slots);
            // SAFETY: slot < slots, so the offset stays inside the unit * slots allocation.
            unsafe { self.buf.ptr.add(slot * self.unit) }
        }

        fn queue(&mut self, device: u32) -> Result<&Queue> {
            if !self.queues.contains_key(&device) {
                let dev = driver::device(device)?;
                let stream = Stream::new(dev)?;
                let events = (0..self.slots)
                    .map(|_| Event::new(dev, false, false))
                    .collect::<Result<Vec<_>>>()?;
                self.queues.insert(device, Queue { stream, events });
            }
            Ok(&self.queues[&device])
        }

        /// Waits until no copy into or out of `slot` runs any more.
        fn wait(&mut self, slot: usize) -> Result<()> {
            let mut first_err = None;
            for device in std::mem::take(&mut self.pending[slot]) {
                let r = self.queues[&device].events[slot].synchronize();
                if let (Err(e), None) = (r, &first_err) {
                    first_err = Some(e);
                }
            }
            first_err.map_or(Ok(()), Err)
        }

        /// Waits for every slot: nothing in flight afterwards, whatever happened before.
        fn drain(&mut self) -> Result<()> {
            let mut first_err = None;
            for slot in 0..self.slots {
                if let (Err(e), None) = (self.wait(slot), &first_err) {
                    first_err = Some(e);
                }
            }
            first_err.map_or(Ok(()), Err)
        }

        /// Queues the copies of unit `u` between its spans and `slot`, per GPU, and records the
        /// slot's event on every stream used. Host segments are copied now, on this thread.
        fn issue(
            &mut self,
            plan: &Plan,
            u: usize,
            slot: usize,
            spans: &[Span],
            dir: Direction,
        ) -> Result<()> {
            let unit = plan.units[u];
            let base = self.slot_ptr(slot);
            // (device, device address, host address, len) in payload order.
            let mut copies: Vec<(u32, u64, u64, usize)> = Vec::new();
            for s in &plan.segs[unit.first..unit.end] {
                let (range, location) = spans[s.span];
                // SAFETY: s.at + s.len <= range.len (the plan covers each span exactly), and
                // s.to + s.len <= unit <= slot size.
                let (there, here) = unsafe { (range.ptr.add(s.at), base.add(s.to)) };
                match device_of(location) {
                    Some(d) => copies.push((d, there as usize as u64, here as usize as u64, s.len)),
                    None => {
                        let (src, dst) = match dir {
                            Direction::DeviceToHost => (there, here),
                            Direction::HostToDevice => (here, there),
                        };
                        // SAFETY: both ranges are checked and leased by the caller (the host
                        // span) or owned by us (the slot, which no copy uses: it was waited
                        // for); they never overlap (pinned ring vs registered region).
                        unsafe { std::ptr::copy_nonoverlapping(src, dst, s.len) };
                    }
                }
            }
            copies.sort_by_key(|c| c.0);
            for group in copies.chunk_by(|a, b| a.0 == b.0) {
                let device = group[0].0;
                driver::device(device)?.bind()?;
                let q = self.queue(device)?;
                enqueue(q, device, group, dir)?;
                q.events[slot].record(&q.stream)?;
                self.pending[slot].push(device);
            }
            Ok(())
        }

        /// Writes `head`, then the bytes of `spans` back to back, staging GPU bytes through the
        /// ring. With `crcs`, folds each span's crc32c into `crcs[span]` (start them at 0).
        pub(crate) fn send<W: Write>(
            &mut self,
            w: &mut W,
            head: &[u8],
            spans: &[Span],
            crcs: Option<&mut [u32]>,
            io: &dyn Fn(io::Error) -> Error,
        ) -> Result<()> {
            let r = self.send_inner(w, head, spans, crcs, io);
            if r.is_err() {
                let _ = self.drain();
            }
            r
        }

        fn send_inner<W: Write>(
            &mut self,
            w: &mut W,
            head: &[u8],
            spans: &[Span],
            mut crcs: Option<&mut [u32]>,
            io: &dyn Fn(io::Error) -> Error,
        ) -> Result<()> {
            let plan = plan(spans.iter().map(|s| s.0.len), self.unit);
            let n = plan.units.len();
            if n == 0 {
                return w.write_all(head).map_err(io);
            }
            self.home.bind()?;
            let mut issued = 0;
            while issued < n.min(self.slots) {
                self.issue(
                    &plan,
                    issued,
                    issued % self.slots,
                    spans,
                    Direction::DeviceToHost,
                )?;
                issued += 1;
            }
            for i in 0..n {
                let slot = i % self.slots;
                self.wait(slot)?;
                let unit = plan.units[i];
                // SAFETY: the slot holds `unit.bytes` staged bytes and no copy touches it now.
                let bytes = unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), unit.bytes) };
                if let Some(crcs) = crcs.as_deref_mut() {
                    crc_unit(&plan, &unit, bytes, crcs);
                }
                if i == 0 {
                    let mut bufs = [IoSlice::new(head), IoSlice::new(bytes)];
                    write_all_vectored(w, &mut bufs).map_err(io)?;
                } else {
                    w.write_all(bytes).map_err(io)?;
                }
                if issued < n {
                    self.issue(
                        &plan,
                        issued,
                        issued % self.slots,
                        spans,
                        Direction::DeviceToHost,
                    )?;
                    issued += 1;
                }
            }
            Ok(())
        }

        /// Reads the bytes of `spans` back to back into them, staging GPU bytes through the
        /// ring; returns once every byte has arrived in place. `crcs` as for `send`.
        pub(crate) fn recv<R: Read>(
            &mut self,
            r: &mut R,
            spans: &[Span],
            crcs: Option<&mut [u32]>,
            io: &dyn Fn(io::Error) -> Error,
        ) -> Result<()> {
            let result = self.recv_inner(r, spans, crcs, io);
            // Completion means the bytes are in device memory; failure means no copy still runs.
            let drained = self.drain();
            result.and(drained)
        }

        fn recv_inner<R: Read>(
            &mut self,
            r: &mut R,
            spans: &[Span],
            mut crcs: Option<&mut [u32]>,
            io: &dyn Fn(io::Error) -> Error,
        ) -> Result<()> {
            let plan = plan(spans.iter().map(|s| s.0.len), self.unit);
            self.home.bind()?;
            for i in 0..plan.units.len() {
                let slot = i % self.slots;
                self.wait(slot)?;
                let unit = plan.units[i];
                // SAFETY: as in send; we are the only writer of the slot until we queue its copy.
                let bytes =
                    unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot), unit.bytes) };
                r.read_exact(bytes).map_err(io)?;
                if let Some(crcs) = crcs.as_deref_mut() {
                    crc_unit(&plan, &unit, bytes, crcs);
                }
                self.issue(&plan, i, slot, spans, Direction::HostToDevice)?;
            }
            Ok(())
        }
    }

    impl Drop for Staging {
        fn drop(&mut self) {
            // The pinned ring is freed below: nothing may still copy into or out of it.
            let _ = self.drain();
            let _ = self.home.bind();
            self.queues.clear();
        }
    }

    /// Queues `group` (one device's copies of a unit) on `q.stream`.
    fn enqueue(
        q: &Queue,
        device: u32,
        group: &[(u32, u64, u64, usize)],
        dir: Direction,
    ) -> Result<()> {
        if group.len() > 1 && BATCH_COPIES.load(Ordering::Relaxed) {
            match batch(q, device, group, dir) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    warn!(error = %e, "cuMemcpyBatchAsync refused; staging falls back to one async copy per segment");
                    BATCH_COPIES.store(false, Ordering::Relaxed);
                }
            }
        }
        for &(_, dev, host, len) in group {
            one(q.stream.0, dev, host, len, dir)?;
        }
        Ok(())
    }

    fn one(stream: sys::CUstream, dev: u64, host: u64, len: usize, dir: Direction) -> Result<()> {
        match dir {
            // SAFETY: `dev` is a bounds-checked, leased device range and `host` a slot or
            // registered host range of `len` bytes; both stay valid until the slot's event, which
            // the caller waits for before reusing or freeing either.
            Direction::DeviceToHost => check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(host as usize as *mut _, dev, len, stream)
            }),
            // SAFETY: as above.
            Direction::HostToDevice => check("cuMemcpyHtoDAsync", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev, host as usize as *const _, len, stream)
            }),
        }
    }

    /// One driver call for all of a unit's copies on one GPU.
    fn batch(
        q: &Queue,
        device: u32,
        group: &[(u32, u64, u64, usize)],
        dir: Direction,
    ) -> Result<()> {
        let (gpu, host) = (Place::Device(device), Place::Host);
        let (src, dst) = match dir {
            Direction::DeviceToHost => (gpu, host),
            Direction::HostToDevice => (host, gpu),
        };
        let copies = group.iter().map(|&(_, dev, host, len)| match dir {
            Direction::DeviceToHost => (host, dev, len),
            Direction::HostToDevice => (dev, host, len),
        });
        // SAFETY: the ranges are valid as in `one`.
        unsafe { batch_copy(q.stream.0, copies, src, dst) }
    }

    /// A host range page-locked with cuMemHostRegister for as long as this value lives (the shm
    /// transport pins a peer's mapping once, so the GPU copies to and from it directly).
    pub(crate) struct HostPin {
        home: &'static Device,
        base: *mut u8,
        pinned: bool,
        /// What keeps the range mapped; dropped only after the range is unregistered.
        _keep: Arc<dyn Any + Send + Sync>,
    }

    // SAFETY: only an address and a flag; unregistering is allowed from any thread.
    unsafe impl Send for HostPin {}
    // SAFETY: as above; immutable after creation.
    unsafe impl Sync for HostPin {}

    impl std::fmt::Debug for HostPin {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "HostPin({:p}, pinned: {})", self.base, self.pinned)
        }
    }

    impl HostPin {
        /// Pins `range` (page-aligned base) for every GPU. When the driver refuses, copies still
        /// work (the driver stages pageable memory itself), only slower: that is logged.
        ///
        /// # Safety
        /// `keep` must keep the range mapped for as long as it lives.
        pub(crate) unsafe fn new(
            device: u32,
            range: RawRange,
            keep: Arc<dyn Any + Send + Sync>,
        ) -> Result<HostPin> {
            let home = driver::device(device)?;
            home.bind()?;
            let page = rustix::param::page_size();
            let len = range.len.div_ceil(page) * page;
            // SAFETY: the caller keeps the (page-rounded) mapping alive while we exist.
            let r = unsafe {
                sys::cuMemHostRegister_v2(range.ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
            };
            let pinned = check("cuMemHostRegister", r)
                .inspect_err(|e| warn!(error = %e, "peer mapping not page-locked; GPU copies to it go through the driver's own staging"))
                .is_ok();
            Ok(HostPin {
                home,
                base: range.ptr,
                pinned,
                _keep: keep,
            })
        }

        /// The base address pinned.
        pub(crate) fn base(&self) -> *mut u8 {
            self.base
        }
    }

    impl Drop for HostPin {
        fn drop(&mut self) {
            if self.pinned && self.home.bind().is_ok() {
                // SAFETY: registered in `new`; every copy through it has completed (callers hold
                // an Arc to us until their stream is synchronized).
                let _ = unsafe { sys::cuMemHostUnregister(self.base.cast()) };
            }
        }
    }

    /// Idle streams per GPU for direct copies, reused across calls.
    #[derive(Default)]
    pub(crate) struct Streams(std::sync::Mutex<HashMap<u32, Vec<Stream>>>);

    impl std::fmt::Debug for Streams {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Streams(..)")
        }
    }

    /// Copies between device and host memory directly (no staging), on one stream per GPU
    /// taken from `streams`, and returns when every copy has landed.
    pub(crate) fn copy_direct(
        copies: &[DirectCopy],
        dir: Direction,
        streams: &Streams,
    ) -> Result<()> {
        let streams = &streams.0;
        let mut taken: Vec<(u32, Stream)> = Vec::new();
        let mut result = Ok(());
        for c in copies {
            let dev = driver::device(c.device)?;
            dev.bind()?;
            let stream = match taken.iter().position(|(d, _)| *d == c.device) {
                Some(i) => &taken[i].1,
                None => {
                    let s = streams
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_mut(&c.device)
                        .and_then(Vec::pop);
                    let s = match s {
                        Some(s) => s,
                        None => Stream::new(dev)?,
                    };
                    taken.push((c.device, s));
                    &taken.last().expect("just pushed").1
                }
            };
            result = one(
                stream.0,
                c.dev.ptr as usize as u64,
                c.host.ptr as usize as u64,
                c.dev.len,
                dir,
            );
            if result.is_err() {
                break;
            }
        }
        for (device, stream) in taken {
            let synced = driver::device(device).and_then(|d| d.bind()).and_then(|_| {
                // SAFETY: a live stream.
                check("cuStreamSynchronize", unsafe {
                    sys::cuStreamSynchronize(stream.0)
                })
            });
            if synced.is_ok() {
                streams
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(device)
                    .or_default()
                    .push(stream);
            }
            if result.is_ok() {
                result = synced;
            }
        }
        result
    }
}

#[cfg(not(feature = "cuda"))]
mod stub {
    use super::*;

    fn off() -> Error {
        Error::NoCudaDriver {
            reason: "this build has no CUDA support (cargo feature `cuda` is off)".into(),
        }
    }

    /// Without the `cuda` feature no GPU region exists, so nothing is ever staged.
    #[derive(Debug)]
    pub(crate) enum Staging {}

    impl Staging {
        pub(crate) fn new(_bytes: u64, _device: u32) -> Result<Staging> {
            Err(off())
        }
        pub(crate) fn send<W: Write>(
            &mut self,
            _w: &mut W,
            _head: &[u8],
            _spans: &[Span],
            _crcs: Option<&mut [u32]>,
            _io: &dyn Fn(io::Error) -> Error,
        ) -> Result<()> {
            match *self {}
        }
        pub(crate) fn recv<R: Read>(
            &mut self,
            _r: &mut R,
            _spans: &[Span],
            _crcs: Option<&mut [u32]>,
            _io: &dyn Fn(io::Error) -> Error,
        ) -> Result<()> {
            match *self {}
        }
    }

    #[derive(Debug)]
    pub(crate) enum HostPin {}

    impl HostPin {
        /// # Safety
        /// Nothing to uphold: this build never pins.
        pub(crate) unsafe fn new(
            _device: u32,
            _range: RawRange,
            _keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
        ) -> Result<HostPin> {
            Err(off())
        }
        pub(crate) fn base(&self) -> *mut u8 {
            match *self {}
        }
    }

    /// Nothing to pool without CUDA (a field, so both builds construct it alike).
    #[derive(Debug, Default)]
    pub(crate) struct Streams(std::marker::PhantomData<()>);

    pub(crate) fn copy_direct(
        _copies: &[DirectCopy],
        _dir: Direction,
        _streams: &Streams,
    ) -> Result<()> {
        Err(off())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_covers_every_byte_once_in_wire_order_and_no_unit_exceeds_its_size() {
        let mut seed = 0x9e37_79b9_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..200 {
            let unit = 1 + (next() % 5000) as usize;
            let lens: Vec<usize> = (0..1 + next() % 20)
                .map(|_| 1 + (next() % 12_000) as usize)
                .collect();
            let p = plan(lens.iter().copied(), unit);
            let total: usize = lens.iter().sum();
            assert_eq!(p.units.len(), total.div_ceil(unit), "round {round}");
            // Walking the segments in order visits the payload byte by byte.
            let (mut span, mut at) = (0usize, 0usize);
            for (i, u) in p.units.iter().enumerate() {
                assert!(u.bytes <= unit && u.bytes > 0);
                if i + 1 < p.units.len() {
                    assert_eq!(u.bytes, unit, "only the last unit may be short");
                }
                let mut to = 0;
                for s in &p.segs[u.first..u.end] {
                    assert_eq!((s.span, s.at, s.to), (span, at, to), "round {round}");
                    to += s.len;
                    at += s.len;
                    if at == lens[span] {
                        span += 1;
                        at = 0;
                    }
                }
                assert_eq!(to, u.bytes);
            }
            assert_eq!((span, at), (lens.len(), 0));
        }
        assert!(plan([], 10).units.is_empty());
    }

    #[test]
    fn geometry_keeps_two_slots_at_least_and_units_at_most_one_mib() {
        assert_eq!(geometry(STAGING_MIN), (4096, 2));
        assert_eq!(geometry(40_000), (20_000, 2));
        assert_eq!(geometry(8 << 20), (1 << 20, 8));
        assert_eq!(geometry(3 << 20), (1 << 20, 3));
    }

    #[test]
    fn crcs_folded_unit_by_unit_equal_the_crc_of_each_span() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let lens = [1usize, 4095, 3000, 2904];
        let p = plan(lens, 1000);
        let mut crcs = vec![0u32; lens.len()];
        let mut off = 0;
        for u in &p.units {
            crc_unit(&p, u, &data[off..off + u.bytes], &mut crcs);
            off += u.bytes;
        }
        let mut at = 0;
        for (i, len) in lens.iter().enumerate() {
            assert_eq!(crcs[i], crc32c::crc32c(&data[at..at + len]));
            at += len;
        }
    }
}
