//! The CUDA driver, loaded at run time through cudarc's dynamic loading. Nothing here links
//! against CUDA, so the engine builds and runs on machines without it; the first use probes for
//! libcuda and answers `NoCudaDriver` instead of the panic cudarc would raise.

use std::ffi::{CString, c_void};
use std::fmt;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::ipc::IpcHandle;
use crate::error::{Error, Result};

/// Threads per CTA of every kernel in copy.cu (its `__launch_bounds__`).
pub(crate) const THREADS: u32 = 512;

static PTX: &str = include_str!("copy.ptx");

pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            call,
            code: format!("{r:?} ({})", r as u32),
        })
    }
}

pub(crate) struct Driver {
    pub devices: Vec<Device>,
}

pub(crate) struct Device {
    pub ordinal: u32,
    pub ctx: sys::CUcontext,
    pub sm_count: u32,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}

// SAFETY: a CUcontext handle may be made current on any thread; the driver synchronizes itself.
unsafe impl Send for Device {}
// SAFETY: as above; the handle is never mutated after creation.
unsafe impl Sync for Device {}

pub(crate) struct Kernels {
    pub copy: sys::CUfunction,
    pub copy_inline: sys::CUfunction,
    pub copy_table: sys::CUfunction,
    pub doorbell: sys::CUfunction,
    #[cfg(feature = "bench-helpers")]
    pub fill: sys::CUfunction,
    #[cfg(feature = "bench-helpers")]
    pub verify: sys::CUfunction,
}

// SAFETY: function handles are immutable and usable from any thread with the context current.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();

/// The loaded driver, or `NoCudaDriver` with the reason it could not be loaded.
pub(crate) fn driver() -> Result<&'static Driver> {
    match DRIVER.get_or_init(load) {
        Ok(d) => Ok(d),
        Err(reason) => Err(Error::NoCudaDriver {
            reason: reason.clone(),
        }),
    }
}

pub(crate) fn device(ordinal: u32) -> Result<&'static Device> {
    let d = driver()?;
    d.devices.get(ordinal as usize).ok_or(Error::NoSuchDevice {
        device: ordinal,
        count: d.devices.len() as u32,
    })
}

fn load() -> std::result::Result<Driver, String> {
    // SAFETY: only dlopens the candidate library names; nothing is called through them.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcuda.so.1 not found (no NVIDIA driver on this machine)".into());
    }
    // cudarc panics when an entry point is missing (a driver older than the API bound here);
    // that must stay a typed error, not take the process down.
    match std::panic::catch_unwind(init) {
        Ok(r) => r,
        Err(_) => {
            Err("the CUDA driver lacks an entry point kvfabric needs (driver too old?)".into())
        }
    }
}

fn init() -> std::result::Result<Driver, String> {
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        let r = sys::cuInit(0);
        if r == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            return Ok(Driver {
                devices: Vec::new(),
            });
        }
        check("cuInit", r).map_err(|e| e.to_string())?;
        let mut count = 0;
        check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count)).map_err(|e| e.to_string())?;
        let mut devices = Vec::new();
        for ordinal in 0..count.max(0) {
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal)).map_err(|e| e.to_string())?;
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            )
            .map_err(|e| e.to_string())?;
            let mut sms = 0;
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(
                    &mut sms,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                ),
            )
            .map_err(|e| e.to_string())?;
            devices.push(Device {
                ordinal: ordinal as u32,
                ctx,
                sm_count: sms.max(1) as u32,
                kernels: OnceLock::new(),
            });
        }
        Ok(Driver { devices })
    }
}

impl Device {
    /// Makes this device's primary context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: the context was retained at load and is never released.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// The kernels of copy.cu, JIT-compiled from the committed PTX the first time.
    pub(crate) fn kernels(&self) -> Result<&Kernels> {
        let k = self
            .kernels
            .get_or_init(|| self.load_kernels().map_err(|e| e.to_string()));
        k.as_ref().map_err(|reason| Error::Cuda {
            call: "cuModuleLoadData(copy.ptx)",
            code: reason.clone(),
        })
    }

    fn load_kernels(&self) -> Result<Kernels> {
        self.bind()?;
        let image = CString::new(PTX).map_err(|_| Error::Cuda {
            call: "cuModuleLoadData",
            code: "copy.ptx contains a NUL byte".into(),
        })?;
        let mut module = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; the module is kept for the process's life.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
        })?;
        let get = |name: &str| -> Result<sys::CUfunction> {
            let cname = CString::new(name).expect("kernel names have no NUL");
            let mut f = std::ptr::null_mut();
            // SAFETY: valid module and NUL-terminated name.
            check("cuModuleGetFunction", unsafe {
                sys::cuModuleGetFunction(&mut f, module, cname.as_ptr())
            })?;
            Ok(f)
        };
        Ok(Kernels {
            copy: get("kvf_copy")?,
            copy_inline: get("kvf_copy_inline")?,
            copy_table: get("kvf_copy_table")?,
            doorbell: get("kvf_doorbell")?,
            #[cfg(feature = "bench-helpers")]
            fill: get("kvf_fill")?,
            #[cfg(feature = "bench-helpers")]
            verify: get("kvf_verify")?,
        })
    }
}

/// Lets kernels on `from` reach memory allocated on `to` (idempotent).
pub(crate) fn enable_peer(from: &Device, to: &Device) -> Result<()> {
    if from.ordinal == to.ordinal {
        return Ok(());
    }
    from.bind()?;
    // SAFETY: both contexts are live.
    match unsafe { sys::cuCtxEnablePeerAccess(to.ctx, 0) } {
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        r => check("cuCtxEnablePeerAccess", r),
    }
}

/// Launches `f` with `grid` CTAs of THREADS threads on `stream`.
///
/// # Safety
/// `params` must match the kernel's parameter list, pointing at values that live until the call
/// returns, and every device pointer among them must stay valid until the work completes.
pub(crate) unsafe fn launch(
    f: sys::CUfunction,
    grid: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            f,
            grid.max(1),
            1,
            1,
            THREADS,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

/// Device memory from cuMemAlloc, freed on drop.
pub(crate) struct DeviceMem {
    pub device: &'static Device,
    pub ptr: u64,
    pub len: u64,
}

impl fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceMem({:?}, {:#x}+{})",
            self.device, self.ptr, self.len
        )
    }
}

impl DeviceMem {
    pub(crate) fn alloc(device: &'static Device, len: u64) -> Result<DeviceMem> {
        device.bind()?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; the context is current.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len.max(1) as usize)
        })?;
        Ok(DeviceMem { device, ptr, len })
    }

    pub(crate) fn ipc_handle(&self) -> Result<IpcHandle> {
        ipc_handle(self.device, self.ptr)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc above and not freed elsewhere; no work uses it any
            // more (regions drain their leases before the last reference goes).
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

pub(crate) fn ipc_handle(device: &Device, ptr: u64) -> Result<IpcHandle> {
    device.bind()?;
    // SAFETY: an all-zero handle is a valid out-value.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; ptr is device memory of this context.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, ptr)
    })?;
    let mut out = [0u8; 64];
    for (o, b) in out.iter_mut().zip(h.reserved.iter()) {
        *o = *b as u8;
    }
    Ok(IpcHandle(out))
}

/// The base and size of the allocation that holds `ptr`.
pub(crate) fn allocation_of(device: &Device, ptr: u64) -> Result<(u64, u64)> {
    device.bind()?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers.
    check("cuMemGetAddressRange", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size as u64))
}

/// Another process's allocation mapped into this one (cuIpcOpenMemHandle), closed on drop.
pub(crate) struct Imported {
    pub device: &'static Device,
    pub base: u64,
    pub len: u64,
}

impl fmt::Debug for Imported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Imported({:?}, {:#x}+{})",
            self.device, self.base, self.len
        )
    }
}

impl Imported {
    pub(crate) fn open(device: &'static Device, handle: &IpcHandle) -> Result<Imported> {
        device.bind()?;
        // SAFETY: an all-zero handle is a valid value to overwrite.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (o, b) in h.reserved.iter_mut().zip(handle.0.iter()) {
            *o = *b as _;
        }
        let mut base = 0;
        // SAFETY: valid out-pointer; the driver validates the handle's contents.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        let mut mapped = Imported {
            device,
            base,
            len: 0,
        };
        // The size comes from the mapping itself, never from what the peer claims.
        mapped.len = allocation_of(device, base)?.1;
        Ok(mapped)
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: opened by cuIpcOpenMemHandle; in-flight copies hold an Arc to us.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        }
    }
}

/// Page-locked host memory (cuMemHostAlloc), freed on drop.
pub(crate) struct Pinned {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: plain memory owned by this value; users coordinate access through the slot protocol.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(crate) fn alloc(device: &Device, len: usize) -> Result<Pinned> {
        device.bind()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(Pinned { ptr: p.cast(), len })
    }

    /// Pinned memory the GPU reads and writes in place (zeroed), with its device address.
    pub(crate) fn mapped(device: &Device, len: usize) -> Result<(Pinned, u64)> {
        device.bind()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                len.max(1),
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        })?;
        let pinned = Pinned { ptr: p.cast(), len };
        // SAFETY: `len` bytes just allocated.
        unsafe { std::ptr::write_bytes(pinned.ptr, 0, len) };
        let mut dptr = 0;
        // SAFETY: `p` is a live mapped allocation; flags must be 0.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0)
        })?;
        Ok((pinned, dptr))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc; no copy reads it any more.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

pub(crate) struct Stream(pub sys::CUstream);

// SAFETY: a stream handle may be used from any thread.
unsafe impl Send for Stream {}

impl Stream {
    pub(crate) fn new(device: &Device) -> Result<Stream> {
        device.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer. Non-blocking: no implicit sync with the legacy stream.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream(s))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created above; destroying a stream with pending work is allowed (it drains).
        let _ = unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

pub(crate) struct Event(pub sys::CUevent);

// SAFETY: an event handle may be used from any thread.
unsafe impl Send for Event {}

impl Event {
    /// `blocking`: a thread waiting in cuEventSynchronize sleeps instead of spinning.
    pub(crate) fn new(device: &Device, blocking: bool, timing: bool) -> Result<Event> {
        device.bind()?;
        let mut flags = 0;
        if blocking {
            flags |= sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        }
        if !timing {
            flags |= sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        }
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, flags)
        })?;
        Ok(Event(e))
    }

    pub(crate) fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: both handles are live.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.0, stream.0)
        })
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        // SAFETY: live handle.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.0)
        })
    }

    /// Polls until the event completes (lowest latency, one core busy meanwhile).
    pub(crate) fn spin(&self) -> Result<()> {
        while !self.query()? {
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Whether the work before the event has completed (an error if it failed).
    pub(crate) fn query(&self) -> Result<bool> {
        // SAFETY: live handle.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| true),
        }
    }

    #[cfg(feature = "bench-helpers")]
    pub(crate) fn elapsed_ms(&self, since: &Event) -> Result<f32> {
        let mut ms = 0.0f32;
        // SAFETY: both events were created with timing and recorded.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, since.0, self.0)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created above.
        let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// Synchronous host → device copy (setup and tests, never the data path).
pub(crate) fn copy_htod(device: &Device, dst: u64, src: &[u8]) -> Result<()> {
    device.bind()?;
    // SAFETY: src is a live slice; dst was bounds-checked by the caller.
    check("cuMemcpyHtoD", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
    })
}

/// Synchronous device → host copy (setup and tests, never the data path).
pub(crate) fn copy_dtoh(device: &Device, dst: &mut [u8], src: u64) -> Result<()> {
    device.bind()?;
    // SAFETY: dst is a live slice; src was bounds-checked by the caller.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
    })
}
