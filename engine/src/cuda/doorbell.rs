//! The doorbell: the lowest-latency way to run one small batch. Launching a kernel costs
//! microseconds of driver time before the GPU even starts (3.9 µs per launch call measured on
//! the H200 machines, 8.7 µs launch-to-completion for a 4 KiB copy), so a lane keeps a
//! one-CTA kernel (`kvf_doorbell` in copy.cu) lingering on its GPU while small batches keep
//! coming: the host writes the ops into a ring in pinned host memory, each 8-byte word carrying
//! the entry's sequence number beside 4 bytes of data, so the kernel finds and validates an entry
//! in one read; it copies the ops with all its threads, fences, and bumps `tail`, which the caller
//! polls (3.6 µs for a 4 KiB op on one H200 in a C++ prototype, against 8.7 µs launched). After
//! `idle` without work the kernel exits (freeing its SM and letting a device synchronize return),
//! and the next batch launches it again.

use std::ffi::c_void;
use std::ptr::{read_volatile, write_volatile};
use std::sync::Mutex;
use std::sync::atomic::{Ordering, fence};
use std::time::Duration;

use cudarc::driver::sys;

use super::driver::{self, Device, Pinned, Stream, check};
use super::lane::DeviceCopy;
use super::oplist::split_aligned;
use crate::error::Result;

/// `KVF_RING` and `KVF_INLINE_OPS` of copy.cu.
const RING: u64 = 64;
pub(crate) const MAX_OPS: usize = 16;
/// Batches larger than this go through a launch: one CTA moves about 16 GB/s over NVLink, so
/// beyond this the full grid of a launched kernel finishes sooner despite the launch.
pub(crate) const MAX_BYTES: u64 = 64 << 10;

/// Word offsets in `KvfRing` (copy.cu).
const STOP: usize = 0;
const TAIL: usize = 16;
const STATE: usize = 17;
const STARTED: usize = 18;
const ENTRIES: usize = 32;
/// Words per ring entry (a header and six per op are used).
const ENTRY_WORDS: usize = 128;

struct Host {
    /// Entries published so far.
    head: u64,
    /// The last launch generation (0: never launched).
    generation: u64,
}

pub(crate) struct Doorbell {
    device: &'static Device,
    ring: Pinned,
    ring_dev: u64,
    stream: Stream,
    idle_ns: u64,
    host: Mutex<Host>,
}

// SAFETY: the ring is shared with the GPU by design; the host's side of it is written only under
// `host`'s lock, and the kernel's side only read (volatile).
unsafe impl Send for Doorbell {}
// SAFETY: as above.
unsafe impl Sync for Doorbell {}

impl std::fmt::Debug for Doorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Doorbell({:?})", self.device)
    }
}

/// A batch in the ring: done once the kernel's `tail` has passed `seq`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket {
    seq: u64,
}

impl Doorbell {
    pub(crate) fn new(device: &'static Device, idle: Duration) -> Result<Doorbell> {
        device.kernels()?;
        let words = ENTRIES + RING as usize * ENTRY_WORDS;
        let (ring, ring_dev) = Pinned::mapped(device, words * 8)?;
        Ok(Doorbell {
            device,
            ring,
            ring_dev,
            stream: Stream::new(device)?,
            idle_ns: idle.as_nanos().min(u64::MAX as u128) as u64,
            host: Mutex::new(Host {
                head: 0,
                generation: 0,
            }),
        })
    }

    fn word(&self, i: usize) -> *mut u64 {
        // SAFETY: every index used is inside the ring allocation (ENTRIES + RING * ENTRY_WORDS).
        unsafe { self.ring.ptr.cast::<u64>().add(i) }
    }

    fn load(&self, i: usize) -> u64 {
        // SAFETY: in bounds (see `word`); the GPU writes these words, hence volatile.
        unsafe { read_volatile(self.word(i)) }
    }

    fn store(&self, i: usize, v: u64) {
        // SAFETY: in bounds; the GPU reads these words, hence volatile.
        unsafe { write_volatile(self.word(i), v) }
    }

    /// The copies as ring ops, when the batch is small enough for the doorbell.
    pub(crate) fn fits(copies: &[DeviceCopy]) -> Option<Vec<[u64; 3]>> {
        let bytes: u64 = copies.iter().map(|c| c.len).sum();
        if bytes > MAX_BYTES || copies.len() > MAX_OPS {
            return None;
        }
        let ops: Vec<[u64; 3]> = copies
            .iter()
            .flat_map(|c| split_aligned(c.src, c.dst, c.len))
            .flatten()
            .map(|o| [o.src, o.dst, o.len])
            .collect();
        (ops.len() <= MAX_OPS).then_some(ops)
    }

    /// Publishes `ops` (from `fits`) and makes sure a kernel will serve them. None when the ring
    /// is full: the caller launches instead.
    pub(crate) fn ring(&self, ops: &[[u64; 3]]) -> Result<Option<Ticket>> {
        let mut host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let seq = host.head;
        if seq - self.load(TAIL) >= RING {
            return Ok(None);
        }
        let at = ENTRIES + (seq % RING) as usize * ENTRY_WORDS;
        // The kernel compares the high halves with the low 32 bits of seq + 1.
        let tag = (seq + 1) << 32;
        let halves = ops
            .iter()
            .flatten()
            .flat_map(|w| [*w & 0xffff_ffff, *w >> 32]);
        for (k, half) in halves.enumerate() {
            self.store(at + 1 + k, tag | half);
        }
        // The header last: the kernel's idle exit re-reads only the header (copy.cu).
        fence(Ordering::Release);
        self.store(at, tag | ops.len() as u64);
        host.head = seq + 1;
        // Dekker with the kernel's exit: the header is written, now read its state.
        fence(Ordering::SeqCst);
        let running = self.load(STATE) == 1;
        let pending = self.load(STARTED) < host.generation;
        if !running && !pending {
            if let Err(e) = self.launch(host.generation + 1) {
                // Nothing serves the ring now. The entry stays (the ring is in order) but with
                // no ops, or the next kernel would copy for a batch that has already failed.
                self.store(at, tag);
                return Err(e);
            }
            host.generation += 1;
        }
        Ok(Some(Ticket { seq }))
    }

    fn launch(&self, generation: u64) -> Result<()> {
        self.device.bind()?;
        let k = self.device.kernels()?;
        let (mut ring, mut idle, mut generation) = (self.ring_dev, self.idle_ns, generation);
        let mut params = [
            (&mut ring as *mut u64).cast::<c_void>(),
            (&mut idle as *mut u64).cast(),
            (&mut generation as *mut u64).cast(),
        ];
        // SAFETY: kvf_doorbell(KvfRing*, u64, u64); the ring outlives the kernel (Drop stops it
        // and synchronizes the stream before the memory goes).
        unsafe { driver::launch(k.doorbell, 1, self.stream.0, &mut params) }
    }

    pub(crate) fn finished(&self, ticket: Ticket) -> bool {
        self.load(TAIL) > ticket.seq
    }

    /// Whether a doorbell kernel holds (or is about to hold) an SM: one serves the ring, or
    /// the last launch has not started yet.
    pub(crate) fn resident(&self) -> bool {
        let host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        self.load(STATE) == 1 || self.load(STARTED) < host.generation
    }
}

impl Drop for Doorbell {
    fn drop(&mut self) {
        self.store(STOP, 1);
        fence(Ordering::SeqCst);
        if self.device.bind().is_ok() {
            // SAFETY: live stream; waits for a lingering kernel to see `stop` and exit.
            let _ = check("cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(self.stream.0)
            });
        }
    }
}
