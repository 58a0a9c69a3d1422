//! The driver's batched copy, `cuMemcpyBatchAsync` (CUDA 12.8+, `_v2` since 13.0): one call for
//! many copies, carried out by the copy engines with no SM involved. Used by the cuda-ipc lane's
//! copy-engine path (device ↔ device) and by the staging of GPU payloads (device ↔ pinned host).

use cudarc::driver::sys;

use super::driver::check;
use crate::error::{Error, Result};

/// Where one side of the copies lives: the driver's hint for the copy engines.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Place {
    Device(u32),
    Host,
}

impl Place {
    fn location(self) -> sys::CUmemLocation {
        match self {
            Place::Device(id) => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: id as i32,
            },
            Place::Host => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
        }
    }
}

/// Queues `copies` (destination, source, bytes) on `stream` in one driver call, every source in
/// `src` and every destination in `dst`, ordered after the stream's earlier work. A driver that
/// lacks the entry point or refuses the call is an `Error::Cuda`; the caller falls back to one
/// copy at a time.
///
/// # Safety
/// Every range must be valid for its side's access until the stream's work completes.
pub(crate) unsafe fn batch_copy(
    stream: sys::CUstream,
    copies: impl Iterator<Item = (u64, u64, usize)>,
    src: Place,
    dst: Place,
) -> Result<()> {
    let (mut dsts, mut srcs, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
    for (d, s, len) in copies {
        dsts.push(d);
        srcs.push(s);
        sizes.push(len);
    }
    let mut attrs = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: src.location(),
        dstLocHint: dst.location(),
        flags: 0,
    }];
    let mut idx = [0usize];
    let call = || {
        // SAFETY: the three arrays hold `sizes.len()` entries, the one attribute applies from
        // index 0, and all outlive the call (the driver copies them before returning); the
        // ranges are valid by this function's contract.
        unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                attrs.as_mut_ptr(),
                idx.as_mut_ptr(),
                1,
                stream,
            )
        }
    };
    // A driver without the entry point makes cudarc panic; that is a refusal, not a crash.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(r) => check("cuMemcpyBatchAsync", r),
        Err(_) => Err(Error::Cuda {
            call: "cuMemcpyBatchAsync",
            code: "entry point missing from the driver".into(),
        }),
    }
}
