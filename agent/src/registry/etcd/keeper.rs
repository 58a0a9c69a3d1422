//! The keeper: keeps the lease alive and, when it is lost, re-registers everything this agent owns.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use etcd_client::{PutOptions, Txn, TxnOp};
use kvfabric_rt::Backoff;

use super::{Inner, Owned, TXN_OPS, classify, is_lease_not_found, to_json};
use crate::error::Result;

impl Inner {
    pub(super) async fn keeper(self: Arc<Self>, mut lease: i64, mut ttl: i64) {
        loop {
            let KeepAlive::Lost(why) = self.keep_alive(lease, ttl).await;
            // Writes from now on are remembered for the re-registration, not sent.
            self.lease.store(0, Ordering::SeqCst);
            tracing::warn!(
                lease = format!("{lease:x}"),
                why,
                "registry lease lost; re-registering"
            );
            let old = lease;
            let mut backoff = Backoff::new(Duration::from_millis(50), self.backoff_cap());
            loop {
                match self.reregister().await {
                    Ok((new, new_ttl)) => {
                        (lease, ttl) = (new, new_ttl);
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "re-registration failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
            self.status.lock().reregistrations += 1;
            tracing::info!(
                old = format!("{old:x}"),
                new = format!("{lease:x}"),
                "registry re-registered under a new lease"
            );
            // If etcd kept the old lease (it extends leases across its own restarts), its keys
            // moved to the new one; revoking it frees it early.
            let mut client = self.client.lease_client();
            let _ = tokio::time::timeout(self.request_timeout, client.revoke(old)).await;
        }
    }

    /// Grants a new lease and re-puts everything this agent owns under it.
    async fn reregister(&self) -> Result<(i64, i64)> {
        let (lease, ttl) = self.grant().await?;
        let owned = self.owned.lock().await;
        self.lease.store(lease, Ordering::SeqCst);
        self.unpublished.store(false, Ordering::SeqCst);
        if let Err(e) = self.put_all(&owned, lease, "re-register").await {
            self.lease.store(0, Ordering::SeqCst);
            drop(owned);
            let mut client = self.client.lease_client();
            let _ = tokio::time::timeout(self.request_timeout, client.revoke(lease)).await;
            return Err(e);
        }
        Ok((lease, ttl))
    }

    /// Publishes what writes failed to publish while the lease lived on (etcd was briefly
    /// unreachable), by re-putting everything owned under the same lease.
    async fn republish(self: Arc<Self>, lease: i64) {
        let owned = self.owned.lock().await;
        if self.lease.load(Ordering::SeqCst) != lease {
            return; // a re-registration or the shutdown took over
        }
        match self
            .put_all(&owned, lease, "publish remembered entries")
            .await
        {
            Ok(()) => {
                tracing::info!("registry published the entries remembered while etcd was away")
            }
            Err(e) => {
                self.unpublished.store(true, Ordering::SeqCst);
                if is_lease_not_found(&e) {
                    self.report_lost(lease);
                }
            }
        }
    }

    /// Puts every entry in `owned` under `lease`, in transactions of `TXN_OPS`.
    async fn put_all(&self, owned: &Owned, lease: i64, op: &str) -> Result<()> {
        let mut puts = Vec::new();
        if let Some(agent) = &owned.agent {
            puts.push((self.agent_key(&agent.name), to_json(agent)?));
        }
        for segment in owned.segments.values() {
            puts.push((self.segment_key(&segment.name), to_json(segment)?));
        }
        for chunk in puts.chunks(TXN_OPS) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|(key, value)| {
                    TxnOp::put(
                        key.as_str(),
                        value.as_slice(),
                        Some(PutOptions::new().with_lease(lease)),
                    )
                })
                .collect();
            self.call_retrying(op, || {
                let mut kv = self.client.kv_client();
                let txn = Txn::new().and_then(ops.clone());
                async move { kv.txn(txn).await }
            })
            .await?;
        }
        Ok(())
    }

    /// After a keepalive succeeded: publishes what failed to publish meanwhile, off the
    /// keepalive loop (keepalives go on while it runs).
    fn publish_if_needed(self: &Arc<Self>, lease: i64) {
        if self.unpublished.swap(false, Ordering::SeqCst) {
            tokio::spawn(self.clone().republish(lease));
        }
    }

    /// Keeps `lease` alive until it is lost.
    async fn keep_alive(self: &Arc<Self>, lease: i64, ttl: i64) -> KeepAlive {
        let ttl = Duration::from_secs(ttl.max(1) as u64);
        let period = (ttl / 3).max(Duration::from_millis(100));
        let mut last_ok = Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(50), self.backoff_cap());
        loop {
            if last_ok.elapsed() >= ttl {
                return KeepAlive::Lost("no keepalive answered for a whole TTL");
            }
            if self.lost_lease.load(Ordering::SeqCst) == lease {
                return KeepAlive::Lost("a write found the lease gone");
            }
            let open = self
                .call_retrying("lease keepalive", || {
                    let mut client = self.client.lease_client();
                    async move { client.keep_alive(lease).await }
                })
                .await;
            let (mut keeper, mut stream) = match open {
                Ok(pair) => pair,
                Err(e) if e.to_string().contains("lease not found") => {
                    return KeepAlive::Lost("etcd answered: lease not found");
                }
                Err(_) => {
                    let wait = backoff
                        .next_delay()
                        .min(ttl.saturating_sub(last_ok.elapsed()));
                    tokio::time::sleep(wait).await;
                    continue;
                }
            };
            last_ok = Instant::now();
            backoff.reset();
            self.publish_if_needed(lease);
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // the first tick is immediate; the open just renewed the lease
            loop {
                tokio::select! {
                    _ = self.lease_lost.notified() => {
                        if self.lost_lease.load(Ordering::SeqCst) == lease {
                            return KeepAlive::Lost("a write found the lease gone");
                        }
                    }
                    _ = tick.tick() => {
                        if last_ok.elapsed() >= ttl {
                            return KeepAlive::Lost("no keepalive answered for a whole TTL");
                        }
                        if let Err(e) = keeper.keep_alive().await {
                            self.failed(&classify("lease keepalive", &self.endpoints_str, e));
                            break;
                        }
                    }
                    msg = stream.message() => match msg {
                        Ok(Some(resp)) if resp.ttl() <= 0 => {
                            return KeepAlive::Lost("etcd answered: lease not found");
                        }
                        Ok(Some(_)) => {
                            last_ok = Instant::now();
                            self.ok();
                            self.publish_if_needed(lease);
                        }
                        Ok(None) => {
                            self.failed(&self.unavailable("lease keepalive", "stream closed"));
                            break;
                        }
                        Err(e) => {
                            self.failed(&classify("lease keepalive", &self.endpoints_str, e));
                            break;
                        }
                    },
                }
            }
        }
    }
}

/// How a keepalive run ended.
enum KeepAlive {
    Lost(&'static str),
}
