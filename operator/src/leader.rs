//! Leader election over a coordination.k8s.io/v1 Lease (kube-lease-manager, server-side apply
//! with the operator's field manager), so only one replica reconciles.

use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::meta::MANAGER;
use crate::{Error, Result};

/// Seconds a Lease stays valid without renewal.
pub const LEASE_DURATION_SECS: u64 = 15;
/// Seconds of slack before a holder is considered gone (clock skew between nodes).
pub const LEASE_GRACE_SECS: u64 = 5;

/// A running campaign for the Lease.
#[derive(Debug)]
pub struct Leadership {
    /// `true` while this replica holds the Lease.
    pub is_leader: watch::Receiver<bool>,
    task: JoinHandle<kube_lease_manager::Result<LeaseManager>>,
    lease: String,
}

/// Starts campaigning for `namespace/name` as `identity`.
pub async fn campaign(
    client: Client,
    namespace: &str,
    name: &str,
    identity: &str,
) -> Result<Leadership> {
    let lease = format!("{namespace}/{name}");
    let manager = LeaseManagerBuilder::new(client, name)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_field_manager(MANAGER)
        .with_duration(LEASE_DURATION_SECS)
        .with_grace(LEASE_GRACE_SECS)
        .build()
        .await
        .map_err(|e| Error::Leader {
            lease: lease.clone(),
            message: e.to_string(),
        })?;
    let (is_leader, task) = manager.watch().await;
    Ok(Leadership {
        is_leader,
        task,
        lease,
    })
}

impl Leadership {
    /// Waits until this replica holds the Lease.
    pub async fn acquired(&mut self) -> Result<()> {
        let lease = self.lease.clone();
        self.is_leader
            .wait_for(|held| *held)
            .await
            .map(|_| ())
            .map_err(|_| Error::Leader {
                lease,
                message: "the lease manager stopped".to_owned(),
            })
    }

    /// A future that resolves when the Lease is lost (or the manager stops).
    pub fn lost(&self) -> impl Future<Output = ()> + Send + Sync + 'static {
        let mut rx = self.is_leader.clone();
        async move {
            let _ = rx.wait_for(|held| !*held).await;
        }
    }

    /// Stops campaigning and hands the Lease back so a standby takes over without waiting for
    /// it to expire.
    pub async fn release(self) {
        drop(self.is_leader);
        match self.task.await {
            Ok(Ok(manager)) => {
                if let Err(e) = manager.release().await {
                    tracing::warn!(lease = %self.lease, error = %e, "releasing the lease failed");
                }
            }
            Ok(Err(e)) => tracing::warn!(lease = %self.lease, error = %e, "lease manager failed"),
            Err(e) => tracing::warn!(lease = %self.lease, error = %e, "lease manager task failed"),
        }
    }
}
