//! RDMA: device discovery over sysfs, the choices made before any verbs call (devices allowed
//! and allocated, GID, NIC per region), the plans and accounting of the data path (slices
//! striped over QPs and NICs, work-request chains, send-queue credits), the handshake carried by
//! the agents' peer API, and the retry/fallback policy.
//!
//! Everything here except `verbs` is plain logic and builds without libibverbs; `verbs` (cargo
//! feature `rdma`) is the part that talks to a device.

pub mod allocation;
pub mod credits;
pub mod handshake;
pub mod mtu;
pub mod plan;
pub mod retry;
pub mod select;
pub mod sysfs;
pub mod topology;
#[cfg(feature = "rdma")]
pub mod verbs;

pub use allocation::Allocation;
pub use credits::SendQueue;
pub use handshake::{ConnectInfo, QpInfo, QpParams, Route};
pub use mtu::Mtu;
pub use plan::{Lane, Plan, PlanConfig};
pub use retry::{Decision, PeerHealth, RetryPolicy, WcStatus};
pub use select::{DeviceFilter, GidChoice, UsablePort};
pub use sysfs::{Gid, GidEntry, GidKind, LinkLayer, Nic, PciPath, Port, PortState};
pub use topology::{MemoryPlace, NicChoice, NicPlace};
