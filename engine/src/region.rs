//! Registered memory. A region is the unit of bounds and key checks: every byte a transfer touches
//! lies inside one region, checked before any I/O starts.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rustix::fs::{MemfdFlags, SealFlags, fcntl_add_seals, fcntl_get_seals, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

use tokio::sync::Notify;

use crate::cuda::CudaExport;
use crate::error::{Error, Result, Side};
pub use crate::location::Location;
use crate::prefault::Prefault;
pub use crate::region_id::{AccessKey, RegionId};

/// Where a region's bytes live and who frees them.
enum Backing {
    /// Allocated by the engine in a memfd so a process on the same node can map it.
    Memfd { fd: OwnedFd },
    /// A peer's memfd mapped into this process (shm transport).
    Mapped { fd: OwnedFd },
    /// The caller's memory; the caller keeps it alive until deregistration completes.
    Caller,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// GPU memory: `ptr` is a device address, never dereferenced on the host. `owner` frees an
    /// engine allocation on drop (None for caller memory); `export` lets same-node peers map it.
    Cuda {
        export: Option<CudaExport>,
        _owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    },
}

pub struct Region {
    id: RegionId,
    key: AccessKey,
    location: Location,
    pub(crate) ptr: NonNull<u8>,
    len: u64,
    backing: Backing,
    inflight: AtomicUsize,
    idle: Notify,
    /// Maps the pages the memfd's owner touched, in the background (see `Prefault`).
    prefault: Option<Prefault>,
}

// SAFETY: a Region is a raw range of memory; concurrent access is what a transfer engine does and
// is coordinated by the batch protocol, not by Rust references. The pointer stays valid for the
// Region's whole life (mapping released in Drop, caller memory guaranteed by `register_ptr`).
unsafe impl Send for Region {}
// SAFETY: see above; all interior state is atomic or immutable.
unsafe impl Sync for Region {}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("location", &self.location)
            .field("len", &self.len)
            .field("shareable", &self.shareable())
            .finish()
    }
}

fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

fn map_shared(fd: BorrowedFd<'_>, len: u64, flags: MapFlags) -> Result<NonNull<u8>> {
    let len_usize = usize::try_from(len).map_err(|_| Error::InvalidConfig {
        field: "len",
        value: len.to_string(),
        reason: "does not fit the address space",
    })?;
    // SAFETY: a fresh shared mapping of an fd we hold; no existing memory is aliased.
    let ptr = unsafe {
        mmap(
            std::ptr::null_mut(),
            len_usize,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED | flags,
            fd,
            0,
        )
    }
    .map_err(|e| Error::io(format!("mmap {len} bytes"), e.into()))?;
    NonNull::new(ptr.cast()).ok_or_else(|| Error::io("mmap", std::io::Error::other("null mapping")))
}

impl Region {
    /// Allocates `len` bytes (rounded up to a page) in a fresh memfd.
    pub(crate) fn alloc(id: RegionId, len: u64) -> Result<Region> {
        if len == 0 {
            return Err(Error::InvalidConfig {
                field: "len",
                value: "0".into(),
                reason: "a region needs at least one byte",
            });
        }
        let fd = memfd_create(
            "kvfabric-region",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| Error::io("memfd_create", e.into()))?;
        // Exactly `len`: a peer that maps the fd sizes its bounds from the file, not from us.
        rustix::fs::ftruncate(&fd, len)
            .map_err(|e| Error::io(format!("ftruncate memfd to {len}"), e.into()))?;
        // Sealed so no holder of the fd can shrink it under a peer's mapping (SIGBUS there).
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| Error::io("seal memfd", e.into()))?;
        let ptr = map_shared(fd.as_fd(), len, MapFlags::empty())?;
        Ok(Region::new(
            id,
            Location::Host { numa: None },
            ptr,
            len,
            Backing::Memfd { fd },
        ))
    }

    /// Sealed shared memory registered with no engine: what a worker allocates before handing
    /// the memfd to its agent.
    pub fn shared_memory(len: u64) -> Result<Region> {
        Region::alloc(RegionId(0), len)
    }

    /// Adopts a memfd another process on this node created and shares (a worker registering its
    /// KV memory with its agent). The file is sealed against shrinking first, so its owner cannot
    /// pull pages out from under our mapping; a file that cannot be sealed is refused.
    pub(crate) fn from_memfd(id: RegionId, fd: OwnedFd) -> Result<Region> {
        let refuse = |reason: String| Error::NotShareable { region: id, reason };
        let seals = fcntl_get_seals(&fd).map_err(|e| {
            refuse(format!(
                "not a sealable memfd ({e}); create it with MFD_ALLOW_SEALING"
            ))
        })?;
        // Transfers write into the memory: a file sealed against writes can never be used.
        for (seal, name) in [
            (SealFlags::WRITE, "F_SEAL_WRITE"),
            (SealFlags::FUTURE_WRITE, "F_SEAL_FUTURE_WRITE"),
        ] {
            if seals.contains(seal) {
                return Err(refuse(format!(
                    "the memfd is sealed against writes ({name}); transfers write into it"
                )));
            }
        }
        if !seals.contains(SealFlags::SHRINK) {
            fcntl_add_seals(&fd, SealFlags::SHRINK).map_err(|e| {
                refuse(format!(
                    "cannot seal it against shrinking ({e}); create it with MFD_ALLOW_SEALING"
                ))
            })?;
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat memfd", e.into()))?;
        let len = u64::try_from(stat.st_size).unwrap_or(0);
        if len == 0 {
            return Err(refuse("the file is empty".into()));
        }
        // Only what the owner touched is mapped now: populating it all would allocate (and
        // charge to this process's cgroup) every page the owner never touched.
        let ptr = map_shared(fd.as_fd(), len, MapFlags::empty())?;
        let mut region = Region::new(
            id,
            Location::Host { numa: None },
            ptr,
            len,
            Backing::Memfd { fd },
        );
        region.prefault();
        Ok(region)
    }

    /// Wraps caller memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes until the region is deregistered and
    /// every lease on it is dropped.
    pub(crate) unsafe fn from_ptr(
        id: RegionId,
        location: Location,
        ptr: NonNull<u8>,
        len: u64,
    ) -> Region {
        Region::new(id, location, ptr, len, Backing::Caller)
    }

    /// Maps a peer's memfd (shm transport). The mapping length comes from the fd itself, never
    /// from what the peer claims, so bounds checks hold even against a lying peer; and the file
    /// must be sealed against shrinking, or the peer could fault our copies (SIGBUS).
    pub(crate) fn map_peer(id: RegionId, key: AccessKey, fd: OwnedFd) -> Result<Region> {
        if !fcntl_get_seals(&fd).is_ok_and(|s| s.contains(SealFlags::SHRINK)) {
            return Err(Error::NotShareable {
                region: id,
                reason: "peer sent a file that is not sealed against shrinking".into(),
            });
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat peer memfd", e.into()))?;
        let len = u64::try_from(stat.st_size).unwrap_or(0);
        if len == 0 {
            return Err(Error::NotShareable {
                region: id,
                reason: "peer sent an empty file".into(),
            });
        }
        // Only what the peer touched is mapped now, for the reason `from_memfd` gives: the
        // peer's pool may be mostly pages nobody touched yet.
        let ptr = map_shared(fd.as_fd(), len, MapFlags::empty())?;
        let mut region = Region::new(
            id,
            Location::Host { numa: None },
            ptr,
            len,
            Backing::Mapped { fd },
        );
        region.key = key;
        region.prefault();
        Ok(region)
    }

    /// A GPU region at device address `ptr` (never dereferenced on the host).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cuda(
        id: RegionId,
        device: u32,
        ptr: u64,
        len: u64,
        export: Option<CudaExport>,
        owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<Region> {
        let ptr = NonNull::new(ptr as usize as *mut u8).ok_or(Error::InvalidConfig {
            field: "ptr",
            value: "0x0".into(),
            reason: "a device region needs a non-null address",
        })?;
        Ok(Region::new(
            id,
            Location::Cuda { device },
            ptr,
            len,
            Backing::Cuda {
                export,
                _owner: owner,
            },
        ))
    }

    /// Replaces the random access key (a registrar that hands the key to its readers itself).
    pub(crate) fn with_key(mut self, key: AccessKey) -> Self {
        self.key = key;
        self
    }

    fn new(id: RegionId, location: Location, ptr: NonNull<u8>, len: u64, backing: Backing) -> Self {
        Region {
            id,
            key: AccessKey::random(),
            location,
            ptr,
            len,
            backing,
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            prefault: None,
        }
    }

    /// Starts mapping the pages our memfd already holds (a fresh mapping faults page by page).
    fn prefault(&mut self) {
        let (Backing::Memfd { fd } | Backing::Mapped { fd }) = &self.backing else {
            return;
        };
        // Best effort: without a second fd the pages fault in as they are first used.
        if let Ok(fd) = fd.try_clone() {
            self.prefault = Prefault::spawn(fd, self.ptr, self.len);
        }
    }

    pub fn id(&self) -> RegionId {
        self.id
    }
    pub fn key(&self) -> AccessKey {
        self.key
    }
    pub fn location(&self) -> Location {
        self.location
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn shareable(&self) -> bool {
        matches!(self.backing, Backing::Memfd { .. })
    }
    /// The device address of a GPU region.
    pub fn device_ptr(&self) -> Option<u64> {
        matches!(self.location, Location::Cuda { .. }).then_some(self.ptr.as_ptr() as usize as u64)
    }
    /// What a same-node peer needs to map this GPU region, if it can be exported.
    pub fn cuda_export(&self) -> Option<CudaExport> {
        match &self.backing {
            Backing::Cuda { export, .. } => *export,
            _ => None,
        }
    }
    /// The memfd behind a shareable region (to hand to another process on the node).
    pub fn memfd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Memfd { fd } => Some(fd.as_fd()),
            _ => None,
        }
    }

    pub(crate) fn check_key(&self, key: AccessKey, side: Side) -> Result<()> {
        if key == self.key {
            Ok(())
        } else {
            Err(Error::WrongKey {
                region: self.id,
                side,
            })
        }
    }

    /// Bounds-checked raw range. `op` and `field` only label the error.
    pub fn range(&self, op: usize, field: &'static str, offset: u64, len: u64) -> Result<RawRange> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(RawRange {
                // SAFETY: offset + len <= self.len, so the result stays inside the mapping.
                ptr: unsafe { self.ptr.as_ptr().add(offset as usize) },
                len: len as usize,
            }),
            _ => Err(Error::OutOfBounds {
                op,
                field,
                region: self.id,
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// The whole region as a byte slice.
    ///
    /// # Safety
    /// No transfer may write into the region while the slice is alive.
    ///
    /// # Panics
    /// On a GPU region: its address is not host memory (use `cuda::copy_to_host`).
    pub unsafe fn as_slice(&self) -> &[u8] {
        self.assert_host();
        // SAFETY: valid mapping of self.len bytes; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len as usize) }
    }

    /// The whole region as a mutable byte slice.
    ///
    /// # Safety
    /// No transfer may touch the region, and no other slice of it may exist, while it is alive.
    ///
    /// # Panics
    /// On a GPU region: its address is not host memory (use `cuda::copy_from_host`).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        self.assert_host();
        // SAFETY: valid mapping of self.len bytes; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len as usize) }
    }

    fn assert_host(&self) {
        assert!(
            matches!(self.location, Location::Host { .. }),
            "region {} is {} memory: its bytes are not addressable from the host",
            self.id,
            self.location
        );
    }

    /// Holds the region for the duration of one piece of work; deregistration waits for it.
    pub(crate) fn lease(self: &Arc<Self>) -> Lease {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        Lease(self.clone())
    }

    pub(crate) async fn drained(&self) {
        loop {
            let notified = self.idle.notified();
            if self.inflight.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Pieces of work currently holding the region.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Before the mapping goes: the prefault thread works in it.
        drop(self.prefault.take());
        if matches!(self.backing, Backing::Memfd { .. } | Backing::Mapped { .. }) {
            let mapped = self.len.div_ceil(page_size()) * page_size();
            // SAFETY: we created this mapping with exactly this base and (page-rounded) length;
            // the last Arc is gone so nothing can reach it any more.
            let _ = unsafe { munmap(self.ptr.as_ptr().cast(), mapped as usize) };
        }
    }
}

/// A region held by in-flight work.
#[derive(Debug)]
pub struct Lease(Arc<Region>);

impl Lease {
    pub fn region(&self) -> &Arc<Region> {
        &self.0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// A checked pointer + length inside a region, valid while the lease that produced it is held.
#[derive(Debug, Clone, Copy)]
pub struct RawRange {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: a RawRange is only created by `Region::range` and only used while a Lease on that region
// keeps the memory mapped.
unsafe impl Send for RawRange {}
// SAFETY: as above.
unsafe impl Sync for RawRange {}

impl RawRange {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// # Safety
    /// The range's region must be leased and no one may write into the range meanwhile.
    pub(crate) unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        // SAFETY: bounds checked at construction; liveness by the caller's lease.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// # Safety
    /// The range's region must be leased and the range must not be aliased meanwhile.
    pub(crate) unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        // SAFETY: bounds checked at construction; liveness and exclusivity by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident kB of the mapping that starts at `ptr` (/proc/self/smaps).
    fn rss_kib(ptr: NonNull<u8>) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", ptr.as_ptr() as usize);
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        lines
            .find_map(|l| l.strip_prefix("Rss:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("the mapping is in smaps")
    }

    #[test]
    fn a_registered_memfd_gets_the_pages_its_owner_touched_mapped_and_nothing_else() {
        let fd = memfd_create(
            "prefault-test",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        let len: u64 = 8 << 20;
        rustix::fs::ftruncate(&fd, len).unwrap();
        // The owner touched the third MiB only.
        rustix::io::pwrite(&fd, &vec![7u8; 1 << 20], 2 << 20).unwrap();
        let allocated = |fd: &OwnedFd| rustix::fs::fstat(fd).unwrap().st_blocks as u64 * 512;
        assert_eq!(allocated(&fd), 1 << 20);
        let probe = fd.try_clone().unwrap();

        let region = Region::from_memfd(RegionId(1), fd).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while rss_kib(region.ptr) < 1024 {
            assert!(
                std::time::Instant::now() < deadline,
                "the touched MiB was never mapped"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        while !region.prefault.as_ref().is_none_or(Prefault::is_done) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(rss_kib(region.ptr), 1024, "only the touched MiB is mapped");
        assert_eq!(
            allocated(&probe),
            1 << 20,
            "no page the owner never touched was allocated"
        );
    }
}
