//! How an engine uses RDMA: which devices, which GID, how many QPs per peer, how batches become
//! work requests, the QP timeouts and the retry policy. Defaults suit one-sided READ/WRITE of
//! KV blocks (64 KiB and up) in a data centre.

use std::path::PathBuf;

use super::handshake::QpParams;
use super::plan::PlanConfig;
use super::retry::RetryPolicy;
use super::select::{DeviceFilter, GidChoice};
use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Open the RDMA devices, publish rkeys for this engine's regions and accept/open rdma
    /// connections. Default true; it only has an effect in a build with the cargo feature `rdma`
    /// on a machine with a usable device. Turning it off pins no memory.
    pub enabled: bool,
    /// Which devices (and ports) may be used: `mlx5_0,mlx5_1:1`, `^mlx5_2` (see
    /// [`DeviceFilter`]). Default: every device the pod was allocated.
    pub devices: DeviceFilter,
    /// Which GID each port sends from. Default: RoCE v2 with IPv4 first (InfiniBand: its GID).
    pub gid: GidChoice,
    /// RC QPs opened to each peer on each local NIC. A batch is striped over all of them.
    /// Default 2.
    pub qps_per_peer: usize,
    /// Slice size, signalling interval and WRs per post.
    pub plan: PlanConfig,
    /// Send-queue depth, ACK timeout and retries of every QP.
    pub qp: QpParams,
    /// Retries of a failed slice and QP rebuilds before RDMA to a peer is given up for tcp.
    pub retry: RetryPolicy,
    /// Where sysfs is mounted (`/`; tests point it at a fixture tree).
    pub sysfs_root: PathBuf,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            enabled: true,
            devices: DeviceFilter::default(),
            gid: GidChoice::Auto,
            qps_per_peer: 2,
            plan: PlanConfig::default(),
            qp: QpParams::default(),
            retry: RetryPolicy::default(),
            sysfs_root: PathBuf::from("/"),
        }
    }
}

impl RdmaConfig {
    pub fn validate(&self) -> Result<()> {
        if !(1..=64).contains(&self.qps_per_peer) {
            return Err(Error::InvalidConfig {
                field: "rdma_qps_per_peer",
                value: self.qps_per_peer.to_string(),
                reason: "must be 1..=64",
            });
        }
        self.qp.validate()?;
        self.plan.validate(self.qp.sq_depth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        RdmaConfig::default().validate().unwrap();
        let err = RdmaConfig {
            qps_per_peer: 0,
            ..RdmaConfig::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("rdma_qps_per_peer"), "{err}");
        let mut c = RdmaConfig::default();
        c.qp.sq_depth = 8;
        // The default plan signals every 16 WRs: more than a queue of 8 holds.
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("rdma_signal_every"), "{err}");
        let mut c = RdmaConfig::default();
        c.qp.retry_cnt = 9;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("rdma_retry_cnt")
        );
    }
}
