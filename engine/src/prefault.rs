//! Mapping, in the background, the pages a shared memfd already holds. A fresh mapping of a
//! worker's or a peer's memfd faults page by page as transfers first touch it: a first 16 MiB
//! pull through the agent took twice as long as the next one over the same pages. Populating
//! at registration would stall it (a 1.5 GiB pool: ~100 ms; pools of hundreds of GiB: seconds,
//! past the registration's deadline), hence a thread; and only the file's data ranges are
//! populated, so no page the owner never touched is allocated or charged to us.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use rustix::fs::{SeekFrom, seek};
use rustix::mm::{Advice, madvise};

/// Populated per call: the thread looks at its stop flag this often (a region's drop waits for
/// at most one step, a few ms).
const STEP: u64 = 64 << 20;

/// The thread mapping one region's pages; dropping it stops the thread and waits for it, so the
/// region may unmap right after.
pub(crate) struct Prefault {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The mapping's address, handed to the thread (the region outlives it: see `Drop`).
struct Mapping(NonNull<u8>);

// SAFETY: the thread only passes the address to madvise, within the mapping's bounds, while the
// region that owns the mapping waits for it in its drop.
unsafe impl Send for Mapping {}

impl Prefault {
    /// Maps `fd`'s data ranges in our mapping of it at `ptr..ptr+len`; None when no thread
    /// could be started (the pages then fault in as they are first used).
    pub(crate) fn spawn(fd: OwnedFd, ptr: NonNull<u8>, len: u64) -> Option<Prefault> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let mapping = Mapping(ptr);
        let thread = std::thread::Builder::new()
            .name("kvf-prefault".into())
            .spawn(move || {
                let mapping = mapping;
                populate(&fd, mapping.0, len, &flag);
            })
            .ok()?;
        Some(Prefault {
            stop,
            thread: Some(thread),
        })
    }

    #[cfg(test)]
    pub(crate) fn is_done(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Populates (writable) each data range of `fd` in the mapping at `ptr`, `STEP` at a time, until
/// done or `stop`. Holes stay unmapped and unallocated. A kernel without MADV_POPULATE_WRITE
/// (before 5.14) populates nothing.
fn populate(fd: &OwnedFd, ptr: NonNull<u8>, len: u64, stop: &AtomicBool) {
    let mut at = 0;
    while at < len && !stop.load(Ordering::Relaxed) {
        // ENXIO: no data at or past `at`.
        let Ok(start) = seek(fd.as_fd(), SeekFrom::Data(at)) else {
            break;
        };
        let hole = seek(fd.as_fd(), SeekFrom::Hole(start)).map_or(len, |e| e.min(len));
        let end = hole.min(start.saturating_add(STEP));
        if start >= end {
            break;
        }
        // SAFETY: [start, end) lies inside the live mapping of `len` bytes at `ptr` (the owner
        // waits for this thread before unmapping); populating changes no byte.
        let populated = unsafe {
            madvise(
                ptr.as_ptr().add(start as usize).cast(),
                (end - start) as usize,
                Advice::LinuxPopulateWrite,
            )
        };
        if populated.is_err() {
            break;
        }
        at = end;
    }
}
