//! RDMA: device discovery over sysfs, the choices made before any verbs call (devices allowed
//! and allocated, GID, NIC per region), the plans and accounting of the data path (slices
//! striped over QPs and NICs, work-request chains, send-queue credits), the handshake carried by
//! the agents' peer API, and the retry/fallback policy.
//!
//! Everything here except `verbs` is plain logic and builds without libibverbs; `verbs` (cargo
//! feature `rdma`) is the part that talks to a device.

pub mod allocation;
pub mod config;
pub mod credits;
pub mod handshake;
pub mod lane;
pub mod mr_cache;
pub mod mtu;
pub mod plan;
pub mod retry;
pub mod select;
pub mod session;
pub mod sysfs;
pub mod topology;
#[cfg(feature = "rdma")]
pub mod verbs;

pub use allocation::Allocation;
pub use config::RdmaConfig;
pub use credits::SendQueue;
pub use handshake::{ConnectInfo, QpInfo, QpParams, Route};
pub use mtu::Mtu;
pub use plan::{Lane, Plan, PlanConfig};
pub use retry::{Decision, PeerHealth, RetryPolicy, WcStatus};
pub use select::{DeviceFilter, GidChoice, UsablePort};
pub use sysfs::{Gid, GidEntry, GidKind, LinkLayer, Nic, PciPath, Port, PortState};
pub use topology::{MemoryPlace, NicChoice, NicPlace};

/// Carries a connection offer to the peer's engine and brings back its answer: what
/// [`crate::Engine::connect_with`] uses to set RDMA QPs up, and again to rebuild them after a
/// failure. The engine knows no network protocol for this; the agent implements it with its
/// peer API (`RdmaConnect`), the bench with its control channel, a test with a direct call to
/// the other engine's [`crate::Engine::rdma_accept`].
///
/// Called from a blocking context (never from an async task), possibly from an engine thread
/// long after the connect, and may block until the peer answered.
pub trait RdmaExchange: Send + Sync + std::fmt::Debug {
    fn exchange(&self, offer: &ConnectInfo) -> crate::Result<ConnectInfo>;
}

/// An RDMA port this engine uses.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RdmaNicInfo {
    pub name: String,
    pub port: u32,
    pub link_layer: String,
    pub gid_index: u32,
    /// The GID and why it was chosen.
    pub gid: String,
    pub numa_node: Option<u32>,
    /// The port's line rate in Gb/s (sysfs `rate`), when known.
    pub rate_gbps: Option<f64>,
}

/// The line rate of a sysfs port `rate` ("100 Gb/sec (4X EDR)", "25 Gb/sec (1X EDR)") in Gb/s.
pub fn parse_rate_gbps(rate: &str) -> Option<f64> {
    let mut words = rate.split_whitespace();
    let value: f64 = words.next()?.parse().ok()?;
    match words.next()? {
        "Gb/sec" => Some(value),
        "Mb/sec" => Some(value / 1000.0),
        _ => None,
    }
    .filter(|v| v.is_finite() && *v > 0.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn port_rates_parse_to_gbps() {
        assert_eq!(super::parse_rate_gbps("100 Gb/sec (4X EDR)"), Some(100.0));
        assert_eq!(super::parse_rate_gbps("400 Gb/sec (4X NDR)"), Some(400.0));
        assert_eq!(super::parse_rate_gbps("2.5 Gb/sec (1X SDR)"), Some(2.5));
        assert_eq!(super::parse_rate_gbps("10 Mb/sec"), Some(0.01));
        assert_eq!(super::parse_rate_gbps("fast"), None);
        assert_eq!(super::parse_rate_gbps("0 Gb/sec"), None);
        assert_eq!(super::parse_rate_gbps(""), None);
    }
}
