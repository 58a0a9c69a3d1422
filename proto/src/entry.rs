//! What an agent publishes about itself in the registry, and what `kvfabric status` shows of it:
//! its name, pool, node, peer API address and the devices it found.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

/// What an agent publishes about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentEntry {
    /// Unique in the fabric (default: the node name).
    pub name: String,
    /// Pool this agent serves (`prefill`, `decode`, ...).
    pub pool: String,
    /// What the pool's workers do (`prefill`, `decode`, `both`), when the operator said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Machine identity (kernel boot id): same node ⇔ same value.
    pub node: String,
    /// Peer gRPC API (handshake, descriptors) of this agent.
    pub peer_addr: SocketAddr,
    /// GPUs, RDMA devices, NUMA nodes and addresses found at start.
    pub devices: Devices,
    /// Unix seconds when this agent started (tells a restart from a re-registration).
    pub started_at: u64,
    /// Random per start of the agent: peers that find another value here know it restarted
    /// (new regions, new data secret), even within one second and on the same address.
    #[serde(default)]
    pub instance: u64,
}

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
    /// The driver's device number on this node (what `CUDA_VISIBLE_DEVICES` renumbers).
    pub ordinal: u32,
    /// `GPU-xxxxxxxx-…`, as nvidia-smi prints it: the name that means the same device in every
    /// process, whatever devices each one sees.
    #[serde(default)]
    pub uuid: String,
    pub name: String,
    /// In sysfs form (`0000:3b:00.0`) so it compares with RDMA devices' PCI addresses.
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
    /// Bytes; known from sysfs for RoCE ports only (InfiniBand reports it through verbs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_mtu: Option<u32>,
    /// The GID a connection would use by default, and why (see `rdma::select`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid_index: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NumaNode {
    pub id: u32,
    pub cpus: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Address {
    pub interface: String,
    pub ip: IpAddr,
}
