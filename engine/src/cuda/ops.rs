//! Driver-backed operations on GPU regions: allocation and registration, device discovery, and
//! host copies for tests (the bench's helpers are in `bench.rs`).

use std::ffi::c_void;

use cudarc::driver::sys;

use super::CudaExport;
use super::driver::{self, Device, DeviceMem, check};
use crate::error::{Error, Result};
use crate::region::{Location, Region, RegionId};

pub fn device_count() -> Result<u32> {
    Ok(driver::driver()?.devices.len() as u32)
}

/// A dma-buf for the device memory `[ptr, ptr + len)` on `device`, so an RDMA device can
/// register it (`ibv_reg_dmabuf_mr`) without the nvidia-peermem module. The buffer covers the
/// page-aligned span around the range; the second value is `ptr`'s offset inside it.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn dmabuf(device: u32, ptr: u64, len: u64) -> Result<(std::os::fd::OwnedFd, u64)> {
    use std::os::fd::FromRawFd;
    let dev = driver::device(device)?;
    dev.bind()?;
    let mut handle = 0;
    // SAFETY: a valid out-pointer; the ordinal exists (device() checked it).
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut handle, device as i32)
    })?;
    let mut supported = 0;
    // SAFETY: as above.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut supported,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            handle,
        )
    })?;
    if supported == 0 {
        return Err(Error::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: format!("cuda:{device} does not support dma-buf export"),
        });
    }
    let page = rustix::param::page_size() as u64;
    let base = ptr & !(page - 1);
    let end = (ptr + len).div_ceil(page) * page;
    let mut fd: i32 = -1;
    // SAFETY: `fd` receives an int as the driver documents for DMA_BUF_FD; the range was
    // registered with the engine, so it is device memory of this context.
    check("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            base,
            (end - base) as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: format!("returned fd {fd}"),
        });
    }
    // SAFETY: the driver just opened this fd for us; nothing else owns it.
    Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, ptr - base))
}

/// Every GPU the driver sees: name, PCI bus id and memory, for discovery and topology.
pub fn devices() -> Result<Vec<super::CudaDeviceInfo>> {
    let d = driver::driver()?;
    let text = |call: &'static str, buf: &[u8], r: sys::CUresult| -> Result<String> {
        check(call, r)?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    };
    let mut out = Vec::with_capacity(d.devices.len());
    for dev in &d.devices {
        let mut handle = 0;
        // SAFETY: a valid out-pointer; the ordinal came from cuDeviceGetCount at load.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut handle, dev.ordinal as i32)
        })?;
        let mut name = [0u8; 256];
        // SAFETY: the buffer is as long as the length passed; the driver NUL-terminates.
        let r =
            unsafe { sys::cuDeviceGetName(name.as_mut_ptr().cast(), name.len() as i32, handle) };
        let name = text("cuDeviceGetName", &name, r)?;
        let mut bus = [0u8; 32];
        // SAFETY: as above (a bus id is at most 13 bytes with its NUL).
        let r =
            unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr().cast(), bus.len() as i32, handle) };
        let pci_bus_id = text("cuDeviceGetPCIBusId", &bus, r)?;
        let mut bytes = 0usize;
        // SAFETY: a valid out-pointer and device handle.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut bytes, handle)
        })?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: a valid out-pointer and device handle.
        check("cuDeviceGetUuid", unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, handle)
        })?;
        out.push(super::CudaDeviceInfo {
            ordinal: dev.ordinal,
            name,
            pci_bus_id,
            memory_bytes: bytes as u64,
            uuid: super::uuid_text(uuid.bytes.map(|b| b as u8)),
        });
    }
    Ok(out)
}

pub(crate) fn alloc_region(id: RegionId, device: u32, len: u64) -> Result<Region> {
    let dev = driver::device(device)?;
    let mem = DeviceMem::alloc(dev, len)?;
    // Fresh device memory holds whatever the last user left; a region starts zeroed, as host
    // regions do.
    // SAFETY: the allocation is `len` bytes and the context is current (alloc bound it).
    check("cuMemsetD8", unsafe {
        sys::cuMemsetD8_v2(mem.ptr, 0, len as usize)
    })?;
    let export = mem
        .ipc_handle()
        .ok()
        .map(|handle| CudaExport { handle, offset: 0 });
    let ptr = mem.ptr;
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(mem);
    Region::cuda(id, device, ptr, len, export, Some(owner))
}

pub(crate) fn register_region(id: RegionId, device: u32, ptr: u64, len: u64) -> Result<Region> {
    let export = checked_export(device, ptr, len)?.ok();
    Region::cuda(id, device, ptr, len, export, None)
}

/// What another process opens to reach `ptr..ptr+len` of this one's device memory: the CUDA
/// IPC handle of the allocation holding it, and the range's offset in that allocation. The
/// range must lie in one allocation on `device` (how NIXL's users and PyTorch's caching
/// allocator hand over memory: a pointer inside a larger block).
pub fn export(device: u32, ptr: u64, len: u64) -> Result<CudaExport> {
    checked_export(device, ptr, len)?
}

/// The range checked as memory of `device` inside one allocation (Err), then its export
/// (inner Err: the driver would not export it, e.g. memory from cuMemCreate).
fn checked_export(device: u32, ptr: u64, len: u64) -> Result<Result<CudaExport>> {
    let dev = driver::device(device)?;
    dev.bind()?;
    let not_ours = |reason: &'static str| Error::InvalidConfig {
        field: "ptr",
        value: format!("{ptr:#x}"),
        reason,
    };
    let mut ordinal: i32 = -1;
    // SAFETY: DEVICE_ORDINAL writes one int into the out-pointer.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(not_ours("not memory the CUDA driver knows"));
    }
    if ordinal != device as i32 {
        return Err(not_ours("memory of another device than the one given"));
    }
    let (base, size) = driver::allocation_of(dev, ptr)?;
    if ptr.checked_add(len).is_none_or(|end| end > base + size) {
        return Err(Error::InvalidConfig {
            field: "len",
            value: len.to_string(),
            reason: "extends past the end of the CUDA allocation",
        });
    }
    Ok(driver::ipc_handle(dev, base).map(|handle| CudaExport {
        handle,
        offset: ptr - base,
    }))
}

/// Maps another process's allocation (CUDA IPC) and wraps `export.offset..+len` of it. The
/// mapping's real size bounds the region, whatever the exporter claims.
pub(crate) fn import_region(
    id: RegionId,
    device: u32,
    export: CudaExport,
    len: u64,
) -> Result<Region> {
    let dev = driver::device(device)?;
    let imported = driver::Imported::open(dev, &export.handle).map_err(|e| match e {
        Error::Cuda { .. } => Error::InvalidIpcHandle {
            region: id,
            reason: format!("{e} (garbage, or the exporting process has exited)"),
        },
        other => other,
    })?;
    if export
        .offset
        .checked_add(len)
        .is_none_or(|end| end > imported.len)
    {
        return Err(Error::InvalidConfig {
            field: "len",
            value: format!("{}+{len}", export.offset),
            reason: "extends past the end of the exported allocation",
        });
    }
    let ptr = imported.base + export.offset;
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(imported);
    Region::cuda(id, device, ptr, len, Some(export), Some(owner))
}

pub(super) fn region_device(region: &Region) -> Result<(&'static Device, u64)> {
    match (region.location(), region.device_ptr()) {
        (Location::Cuda { device }, Some(ptr)) => Ok((driver::device(device)?, ptr)),
        (location, _) => Err(Error::InvalidConfig {
            field: "region",
            value: format!("{} ({location})", region.id()),
            reason: "not a GPU region",
        }),
    }
}

/// Copies `out.len()` bytes at `offset` of a GPU region to the host (tests, verification).
pub fn copy_to_host(region: &Region, offset: u64, out: &mut [u8]) -> Result<()> {
    let (dev, ptr) = region_device(region)?;
    region.range(0, "offset", offset, out.len() as u64)?;
    driver::copy_dtoh(dev, out, ptr + offset)
}

/// Copies `data` into a GPU region at `offset` (tests, setup).
pub fn copy_from_host(region: &Region, offset: u64, data: &[u8]) -> Result<()> {
    let (dev, ptr) = region_device(region)?;
    region.range(0, "offset", offset, data.len() as u64)?;
    driver::copy_htod(dev, ptr + offset, data)
}
