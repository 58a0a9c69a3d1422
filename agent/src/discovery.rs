//! What this node has: GPUs, RDMA devices, NUMA nodes, addresses. Published in the agent's
//! registry entry so peers (and `kvfabric status`) can see what transports a node can offer.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Devices {
    pub gpus: Vec<Gpu>,
    pub rdma: Vec<RdmaDevice>,
    pub numa_nodes: Vec<NumaNode>,
    /// Non-loopback interface addresses.
    pub addresses: Vec<Address>,
    /// Why a device class could not be listed (e.g. "no CUDA driver"), so an empty list is
    /// never ambiguous.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub ordinal: u32,
    pub name: String,
    pub pci_bus_id: String,
    pub memory_bytes: u64,
    pub numa_node: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RdmaDevice {
    pub name: String,
    pub ports: Vec<RdmaPort>,
    pub numa_node: Option<u32>,
    pub pci_address: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RdmaPort {
    pub port: u32,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NumaNode {
    pub id: u32,
    pub cpus: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Address {
    pub interface: String,
    pub ip: std::net::IpAddr,
}

// TEMPORARY (replaced by the rdma branch).
pub fn discover() -> Devices {
    Devices::default()
}
