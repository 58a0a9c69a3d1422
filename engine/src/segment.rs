//! What a peer publishes about itself so others can reach its memory.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::cuda::CudaExport;
use crate::error::{Error, Result};
use crate::region::{AccessKey, Location, Region, RegionId};

/// Bumped whenever a field changes meaning; readers refuse versions they do not know.
pub const DESCRIPTOR_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDescriptor {
    pub version: u32,
    pub name: String,
    /// Identifies the machine (boot id), so peers can tell whether shared memory can reach it.
    pub node: String,
    pub regions: Vec<RegionDesc>,
    pub endpoints: Endpoints,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    pub id: RegionId,
    pub len: u64,
    pub location: Location,
    pub key: AccessKey,
    /// Backed by a memfd, so a process on the same node can map it.
    pub shareable: bool,
    /// A GPU region's CUDA IPC export, so a process on the same node can map it (cuda-ipc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipc: Option<CudaExport>,
    /// The region's RDMA registrations, one per NIC it is registered with, so a peer can READ
    /// or WRITE it one-sidedly (rdma).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rdma: Vec<RdmaKey>,
}

/// What a peer needs to reach a region through one NIC: the address the registration covers
/// from (the virtual address, or the IOVA of a dma-buf registration) and the rkey.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaKey {
    pub nic: String,
    pub addr: u64,
    pub rkey: u32,
}

impl RegionDesc {
    pub fn of(region: &Region) -> Self {
        RegionDesc {
            id: region.id(),
            len: region.len(),
            location: region.location(),
            key: region.key(),
            shareable: region.shareable(),
            ipc: region.cuda_export(),
            rdma: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoints {
    pub tcp: Option<SocketAddr>,
    pub shm: Option<PathBuf>,
}

impl SegmentDescriptor {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("descriptor serializes")
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let d: SegmentDescriptor =
            serde_json::from_str(text).map_err(|e| Error::InvalidConfig {
                field: "segment descriptor",
                value: e.to_string(),
                reason: "not a valid descriptor",
            })?;
        if d.version != DESCRIPTOR_VERSION {
            return Err(Error::InvalidConfig {
                field: "segment descriptor version",
                value: d.version.to_string(),
                reason: "unsupported version",
            });
        }
        Ok(d)
    }

    pub fn region(&self, id: RegionId) -> Option<&RegionDesc> {
        self.regions.iter().find(|r| r.id == id)
    }
}

/// This machine's identity for locality decisions: the kernel boot id is shared by every process
/// and network namespace on one node, and differs between nodes.
pub fn local_node_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-node".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trips_and_refuses_unknown_versions() {
        let d = SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "prefill-0".into(),
            node: "n".into(),
            regions: vec![RegionDesc {
                id: RegionId(3),
                len: 4096,
                location: Location::Cuda { device: 1 },
                key: AccessKey(7),
                shareable: false,
                ipc: Some(CudaExport {
                    handle: crate::cuda::IpcHandle([9; 64]),
                    offset: 64,
                }),
                rdma: vec![RdmaKey {
                    nic: "mlx5_0".into(),
                    addr: 0x7f00_0000_0000,
                    rkey: 0x1234,
                }],
            }],
            endpoints: Endpoints {
                tcp: Some("127.0.0.1:9".parse().unwrap()),
                shm: Some("/tmp/x.sock".into()),
            },
        };
        assert_eq!(SegmentDescriptor::from_json(&d.to_json()).unwrap(), d);
        let future = d.to_json().replace("\"version\":1", "\"version\":99");
        let err = SegmentDescriptor::from_json(&future).unwrap_err();
        assert!(err.to_string().contains("99"), "{err}");
        assert!(SegmentDescriptor::from_json("{garbage").is_err());
    }
}
