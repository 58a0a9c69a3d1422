use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::error::{Error, Result, Side};
use crate::region::{AccessKey, Lease, Location, Region, RegionId};
use crate::segment::RegionDesc;

/// The regions this engine exposes, by id. Lookups happen per manifest, not per byte.
#[derive(Debug, Default)]
pub struct RegionTable {
    next: AtomicU64,
    map: RwLock<HashMap<RegionId, Arc<Region>>>,
}

impl RegionTable {
    fn next_id(&self) -> RegionId {
        RegionId(self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn insert(&self, region: Region) -> Arc<Region> {
        let region = Arc::new(region);
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(region.id(), region.clone());
        region
    }

    pub fn alloc(&self, len: u64) -> Result<Arc<Region>> {
        Ok(self.insert(Region::alloc(self.next_id(), len)?))
    }

    /// # Safety
    /// See [`Region::from_ptr`].
    pub unsafe fn register_ptr(
        &self,
        location: Location,
        ptr: NonNull<u8>,
        len: u64,
    ) -> Result<Arc<Region>> {
        if len == 0 {
            return Err(Error::InvalidConfig {
                field: "len",
                value: "0".into(),
                reason: "a region needs at least one byte",
            });
        }
        // SAFETY: forwarded to the caller.
        let region = unsafe { Region::from_ptr(self.next_id(), location, ptr, len) };
        Ok(self.insert(region))
    }

    fn nonzero(len: u64) -> Result<()> {
        if len == 0 {
            return Err(Error::InvalidConfig {
                field: "len",
                value: "0".into(),
                reason: "a region needs at least one byte",
            });
        }
        Ok(())
    }

    /// Adopts a memfd shared by another process, under `key`.
    pub fn register_memfd(&self, fd: std::os::fd::OwnedFd, key: AccessKey) -> Result<Arc<Region>> {
        Ok(self.insert(Region::from_memfd(self.next_id(), fd)?.with_key(key)))
    }

    /// Maps another process's GPU allocation (its CUDA IPC export) as a region of `len` bytes,
    /// under `key`.
    pub fn import_cuda(
        &self,
        device: u32,
        export: crate::cuda::CudaExport,
        len: u64,
        key: AccessKey,
    ) -> Result<Arc<Region>> {
        Self::nonzero(len)?;
        let region = crate::cuda::import_region(self.next_id(), device, export, len)?;
        Ok(self.insert(region.with_key(key)))
    }

    /// Allocates device memory on `device` (cuMemAlloc, zeroed, exported for CUDA IPC).
    pub fn alloc_cuda(&self, device: u32, len: u64) -> Result<Arc<Region>> {
        Self::nonzero(len)?;
        let region = crate::cuda::alloc_region(self.next_id(), device, len)?;
        Ok(self.insert(region))
    }

    /// Registers caller device memory: `ptr..ptr+len` must lie in one allocation on `device`.
    ///
    /// # Safety
    /// The memory must stay allocated until the region is deregistered and every lease on it is
    /// dropped.
    pub unsafe fn register_cuda(&self, device: u32, ptr: u64, len: u64) -> Result<Arc<Region>> {
        Self::nonzero(len)?;
        let region = crate::cuda::register_region(self.next_id(), device, ptr, len)?;
        Ok(self.insert(region))
    }

    /// The region (and offset in it) that holds `ptr..ptr+len` at `location`: how a worker that
    /// knows its KV blocks by address names them in block ops.
    pub fn locate(&self, location: Location, ptr: u64, len: u64) -> Result<(RegionId, u64)> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        map.values()
            .filter(|r| r.location() == location)
            .find_map(|r| {
                let base = r.device_ptr().unwrap_or_else(|| {
                    r.range(0, "ptr", 0, 0).map_or(0, |x| x.ptr as usize as u64)
                });
                let end = ptr.checked_add(len)?;
                (ptr >= base && end <= base.checked_add(r.len())?).then_some((r.id(), ptr - base))
            })
            .ok_or(Error::UnregisteredPointer { location, ptr, len })
    }

    pub fn get(&self, id: RegionId, side: Side) -> Result<Arc<Region>> {
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or(Error::UnknownRegion { region: id, side })
    }

    /// Looks a region up for a peer: it must exist and the key must match.
    pub fn lease_checked(&self, id: RegionId, key: AccessKey, side: Side) -> Result<Lease> {
        let region = self.get(id, side)?;
        region.check_key(key, side)?;
        Ok(region.lease())
    }

    /// Removes the region from view at once (new ops get `UnknownRegion`), then waits until every
    /// in-flight batch that holds it has finished.
    pub async fn deregister(&self, id: RegionId) -> Result<()> {
        let region = self
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
            .ok_or(Error::UnknownRegion {
                region: id,
                side: Side::Local,
            })?;
        region.drained().await;
        Ok(())
    }

    pub fn descriptors(&self) -> Vec<RegionDesc> {
        let mut v: Vec<RegionDesc> = self
            .map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|r| RegionDesc::of(r))
            .collect();
        v.sort_by_key(|d| d.id);
        v
    }
}
