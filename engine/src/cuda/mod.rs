//! GPU memory: CUDA regions, IPC export/import, and the copy machinery of the cuda-ipc transport.
//!
//! Everything that calls the driver lives behind the `cuda` feature. Without it (or without a
//! driver at run time) the same functions exist and answer `Error::NoCudaDriver`, so callers need
//! no cfg of their own.

pub mod ipc;
pub mod oplist;

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

pub use ipc::{CudaExport, IpcHandle};
pub use oplist::pattern_word;

#[cfg(feature = "cuda")]
pub use ops::*;
#[cfg(not(feature = "cuda"))]
pub use stub::*;

/// How the cuda-ipc transport moves a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaPath {
    /// One kernel launch over a device-side op list (uses SMs; fastest for small blocks).
    #[default]
    Sm,
    /// The copy engines through the driver's batched memcpy (no SMs).
    Ce,
}

impl std::fmt::Display for CudaPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CudaPath::Sm => "sm",
            CudaPath::Ce => "ce",
        })
    }
}

impl FromStr for CudaPath {
    type Err = Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "sm" => Ok(CudaPath::Sm),
            "ce" => Ok(CudaPath::Ce),
            other => Err(Error::InvalidConfig {
                field: "cuda_path",
                value: other.into(),
                reason: "expected sm or ce",
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
}

/// What `verify` found in a device pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceVerdict {
    pub bad_words: u64,
    /// Index of the first 8-byte word that differs.
    pub first_bad_word: Option<u64>,
}

/// What `selftest` checked.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SelftestReport {
    pub devices: (u32, u32),
    pub rounds: usize,
    pub copies: usize,
    pub bytes: u64,
    pub paths: Vec<String>,
}

#[cfg(not(feature = "cuda"))]
mod stub {
    use std::sync::Arc;

    use super::{DeviceVerdict, SelftestReport};
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
    pub fn fill(_region: &Arc<Region>, _block_size: u64, _seed: u64) -> Result<()> {
        off()
    }
    pub fn verify(
        _region: &Arc<Region>,
        _block_size: u64,
        _source_of: &[u32],
        _source_seed: u64,
        _poison_seed: u64,
    ) -> Result<DeviceVerdict> {
        off()
    }
    pub fn copy_to_host(_region: &Region, _offset: u64, _out: &mut [u8]) -> Result<()> {
        off()
    }
    pub fn copy_from_host(_region: &Region, _offset: u64, _data: &[u8]) -> Result<()> {
        off()
    }
    pub fn peer_copy_gbps(_dst: u32, _src: u32, _bytes: u64, _iters: usize) -> Result<f64> {
        off()
    }
    pub fn peer_copy_latency_us(
        _dst: u32,
        _src: u32,
        _bytes: u64,
        _pool: u64,
        _iters: usize,
    ) -> Result<f64> {
        off()
    }
    pub fn selftest(_devices: (u32, u32), _rounds: usize, _seed: u64) -> Result<SelftestReport> {
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
