//! Whether this agent should get work, as the probes ask it (`kvfabric_proto::contract`): the
//! server as a whole (health service `""`, the liveness and startup probes) is SERVING while it
//! runs, whatever etcd does, so an etcd outage restarts no agent; the APIs (readiness, and
//! `/healthz`) are SERVING only while the agent is in the registry — registered, connected,
//! lease held — and not draining.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvfabric_proto::contract::LIVE_SERVICE;
use kvfabric_proto::pb::local_agent_server::LocalAgentServer;
use kvfabric_proto::pb::peer_agent_server::PeerAgentServer;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::local_api::LocalApi;
use crate::peer_api::PeerApi;
use crate::registry::SharedRegistry;

/// How often the registry's connection state is looked at.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

#[derive(Debug)]
pub struct Readiness {
    health: HealthReporter,
    ready: AtomicBool,
    draining: AtomicBool,
}

impl Readiness {
    /// Live, not ready.
    pub async fn new(health: HealthReporter) -> Arc<Readiness> {
        health
            .set_service_status(LIVE_SERVICE, ServingStatus::Serving)
            .await;
        let r = Arc::new(Readiness {
            health,
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        });
        r.publish(false).await;
        r
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Ready while `in_registry`, unless draining.
    pub async fn set(&self, in_registry: bool) {
        let ready = in_registry && !self.draining.load(Ordering::Acquire);
        if self.ready.swap(ready, Ordering::AcqRel) != ready {
            self.publish(ready).await;
        }
    }

    /// Not ready from now on; live until the server stops.
    pub async fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        self.set(false).await;
        // Published even if it was not ready already, so the last word is NOT_SERVING.
        self.publish(false).await;
    }

    async fn publish(&self, ready: bool) {
        if ready {
            self.health
                .set_serving::<LocalAgentServer<LocalApi>>()
                .await;
            self.health.set_serving::<PeerAgentServer<PeerApi>>().await;
        } else {
            self.health
                .set_not_serving::<LocalAgentServer<LocalApi>>()
                .await;
            self.health
                .set_not_serving::<PeerAgentServer<PeerApi>>()
                .await;
        }
    }

    /// Follows the registry's connection until the task is aborted.
    pub fn follow(self: &Arc<Self>, registry: SharedRegistry) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(FOLLOW_EVERY);
            loop {
                tick.tick().await;
                me.set(registry.state().connected).await;
            }
        })
    }
}
