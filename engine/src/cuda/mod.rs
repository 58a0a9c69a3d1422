//! GPU memory: CUDA regions, IPC export/import, and the copy machinery of the cuda-ipc transport.
//!
//! Everything that calls the driver lives behind the `cuda` feature. Without it (or without a
//! driver at run time) the same functions exist and answer `Error::NoCudaDriver`, so callers need
//! no cfg of their own.

#[cfg(feature = "bench-helpers")]
mod bench;
pub mod ipc;
pub mod oplist;
pub mod table_list;

#[cfg(feature = "cuda")]
pub(crate) mod batch_copy;
#[cfg(feature = "cuda")]
mod doorbell;
#[cfg(feature = "cuda")]
pub(crate) mod driver;
#[cfg(feature = "cuda")]
pub(crate) mod lane;
#[cfg(feature = "cuda")]
mod ops;

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The bench's helpers (device patterns, verification, peer-copy ceilings, the self-test).
#[cfg(feature = "bench-helpers")]
pub use bench::*;
pub use ipc::{CudaExport, IpcHandle};

#[cfg(feature = "cuda")]
pub use ops::*;
#[cfg(not(feature = "cuda"))]
pub use stub::*;

/// How the cuda-ipc transport moves a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaPath {
    /// Per batch: the copy engines when it goes from one GPU to another and its copies average
    /// at least [`AUTO_CE_MEAN_COPY`], otherwise one kernel.
    #[default]
    Auto,
    /// One kernel launch over a device-side op list (uses SMs; fastest for small blocks).
    Sm,
    /// The copy engines through the driver's batched memcpy (no SMs).
    Ce,
}

/// `Auto` hands a batch between two GPUs to the copy engines from this mean copy size up. The
/// driver spends ~1.2 µs of the submitting thread per copy, in which NVLink moves ~470 KB; from
/// twice that the copy engines keep the link full, beat the SM path (2 × H200: 101% of a
/// contiguous peer copy against 96% at 1 MiB, 1.97× against 1.94× both ways) and leave every SM
/// to the model. Below it the driver's per-copy time is the limit (at 256 KiB both ways reach
/// only 1.37×). Within one GPU the kernel wins at every size (H200, 1 MiB blocks: 742 GB/s
/// through the copy engines, ~2 TB/s through the kernel).
pub const AUTO_CE_MEAN_COPY: u64 = 1 << 20;

impl CudaPath {
    /// The path a batch of `copies` copies moving `bytes` in all from GPU `devices.0` to GPU
    /// `devices.1` takes: never `Auto`.
    pub fn for_batch(self, copies: usize, bytes: u64, devices: (u32, u32)) -> CudaPath {
        match self {
            CudaPath::Auto
                if devices.0 != devices.1
                    && copies > 0
                    && bytes / copies as u64 >= AUTO_CE_MEAN_COPY =>
            {
                CudaPath::Ce
            }
            CudaPath::Auto => CudaPath::Sm,
            path => path,
        }
    }
}

impl std::fmt::Display for CudaPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CudaPath::Auto => "auto",
            CudaPath::Sm => "sm",
            CudaPath::Ce => "ce",
        })
    }
}

impl FromStr for CudaPath {
    type Err = Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "auto" => Ok(CudaPath::Auto),
            "sm" => Ok(CudaPath::Sm),
            "ce" => Ok(CudaPath::Ce),
            other => Err(Error::InvalidConfig {
                field: "cuda_path",
                value: other.into(),
                reason: "expected auto, sm or ce",
            }),
        }
    }
}

/// One GPU as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaDeviceInfo {
    pub ordinal: u32,
    pub name: String,
    /// As the driver writes it, e.g. `00000000:3B:00.0`.
    pub pci_bus_id: String,
    pub memory_bytes: u64,
    /// As nvidia-smi writes it, `GPU-` and 32 hex digits in 8-4-4-4-12 groups: the name a
    /// process can give for a device whatever its `CUDA_VISIBLE_DEVICES` numbering.
    #[serde(default)]
    pub uuid: String,
}

/// A device UUID as nvidia-smi writes it.
pub fn uuid_text(bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// The 32 hex digits of a device UUID written either way (`GPU-` prefix or not, any case,
/// dashes or not), or None when it is not one.
pub fn uuid_digits(text: &str) -> Option<String> {
    let t = text.trim();
    let t = t
        .strip_prefix("GPU-")
        .or_else(|| t.strip_prefix("gpu-"))
        .unwrap_or(t);
    let hex: String = t.chars().filter(|&c| c != '-').collect();
    (hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()))
        .then(|| hex.to_ascii_lowercase())
}

#[cfg(not(feature = "cuda"))]
mod stub {
    use crate::error::{Error, Result};
    use crate::region::Region;

    fn off<T>() -> Result<T> {
        Err(Error::NoCudaDriver {
            reason: "this build has no CUDA support (cargo feature `cuda` is off)".into(),
        })
    }

    pub fn device_count() -> Result<u32> {
        off()
    }
    pub fn devices() -> Result<Vec<super::CudaDeviceInfo>> {
        off()
    }
    pub fn copy_to_host(_region: &Region, _offset: u64, _out: &mut [u8]) -> Result<()> {
        off()
    }
    pub fn export(_device: u32, _ptr: u64, _len: u64) -> Result<super::CudaExport> {
        off()
    }
    pub fn copy_from_host(_region: &Region, _offset: u64, _data: &[u8]) -> Result<()> {
        off()
    }
    pub(crate) fn alloc_region(_id: crate::RegionId, _device: u32, _len: u64) -> Result<Region> {
        off()
    }
    pub(crate) fn import_region(
        _id: crate::RegionId,
        _device: u32,
        _export: super::CudaExport,
        _len: u64,
    ) -> Result<Region> {
        off()
    }
    pub(crate) fn register_region(
        _id: crate::RegionId,
        _device: u32,
        _ptr: u64,
        _len: u64,
    ) -> Result<Region> {
        off()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_copy_engines_only_for_large_mean_copies() {
        let mib = 1 << 20;
        let across = (1, 0);
        assert_eq!(
            CudaPath::Auto.for_batch(512, 512 * mib, across),
            CudaPath::Ce
        );
        assert_eq!(
            CudaPath::Auto.for_batch(512, 512 * mib, (0, 1)),
            CudaPath::Ce
        );
        // Within one GPU the kernel, however large the copies.
        assert_eq!(
            CudaPath::Auto.for_batch(512, 512 * mib, (1, 1)),
            CudaPath::Sm
        );
        // 4 KiB blocks, 16 KiB blocks, 256 KiB blocks: the driver's per-copy time would limit.
        for block in [4 << 10, 16 << 10, 256 << 10] {
            assert_eq!(
                CudaPath::Auto.for_batch(1000, 1000 * block, across),
                CudaPath::Sm
            );
        }
        // The mean decides: one huge copy among many small ones still averages small.
        assert_eq!(
            CudaPath::Auto.for_batch(1000, 64 * mib, across),
            CudaPath::Sm
        );
        assert_eq!(CudaPath::Auto.for_batch(0, 0, across), CudaPath::Sm);
        for fixed in [CudaPath::Sm, CudaPath::Ce] {
            assert_eq!(fixed.for_batch(1, 1 << 30, across), fixed);
            assert_eq!(fixed.for_batch(1000, 4 << 20, (0, 0)), fixed);
        }
    }

    #[test]
    fn device_uuids_read_back_however_they_are_written() {
        let bytes = [
            0x8f, 0x1a, 0x2b, 0x3c, 0x4d, 0x5e, 0x6f, 0x70, 0x81, 0x92, 0xa3, 0xb4, 0xc5, 0xd6,
            0xe7, 0xf8,
        ];
        let text = uuid_text(bytes);
        assert_eq!(text, "GPU-8f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8");
        let digits = Some("8f1a2b3c4d5e6f708192a3b4c5d6e7f8".to_string());
        assert_eq!(uuid_digits(&text), digits);
        // torch prints it without the prefix; some tools upper-case it or drop the dashes.
        assert_eq!(uuid_digits("8f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7f8"), digits);
        assert_eq!(uuid_digits("GPU-8F1A2B3C4D5E6F708192A3B4C5D6E7F8"), digits);
        for bad in [
            "",
            "GPU-",
            "8f1a2b3c",
            "GPU-8f1a2b3c-4d5e-6f70-8192-a3b4c5d6e7fz",
            "0",
        ] {
            assert_eq!(uuid_digits(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn paths_parse_as_they_print() {
        for p in [CudaPath::Auto, CudaPath::Sm, CudaPath::Ce] {
            assert_eq!(p.to_string().parse::<CudaPath>().unwrap(), p);
        }
        let e = "gpu".parse::<CudaPath>().unwrap_err().to_string();
        assert!(e.contains("gpu") && e.contains("auto, sm or ce"), "{e}");
    }
}
