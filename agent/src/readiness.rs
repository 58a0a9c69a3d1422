//! Whether this agent should get work, as the probes ask it (`kvfabric_proto::contract`): the
//! server as a whole (health service `""`, the liveness and startup probes) is SERVING while it
//! runs, whatever etcd does, so an etcd outage restarts no agent; the APIs (readiness, and
//! `/healthz`) are SERVING only while the agent is in the registry — registered, connected,
//! lease held — not draining, and, with mTLS, while the certificate in use has not expired (an
//! agent whose certificate expired fails every handshake with its peers; with readiness down,
//! the Service and the operator see it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use tracing::{info, warn};

use kvfabric_proto::contract::LIVE_SERVICE;
use kvfabric_proto::pb::local_agent_server::LocalAgentServer;
use kvfabric_proto::pb::peer_agent_server::PeerAgentServer;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::local_api::LocalApi;
use crate::peer_api::PeerApi;
use crate::peer_tls::PeerTls;
use crate::registry::SharedRegistry;

/// How often the registry's connection state is looked at.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

#[derive(Debug)]
pub(crate) struct Readiness {
    health: HealthReporter,
    ready: AtomicBool,
    draining: AtomicBool,
    /// Why the certificate in use cannot serve (it expired); None while it can.
    certificate: Mutex<Option<String>>,
}

impl Readiness {
    /// Live, not ready.
    pub(crate) async fn new(health: HealthReporter) -> Arc<Readiness> {
        health
            .set_service_status(LIVE_SERVICE, ServingStatus::Serving)
            .await;
        let r = Arc::new(Readiness {
            health,
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            certificate: Mutex::new(None),
        });
        r.publish(false).await;
        r
    }

    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Why the agent is not ready, when the reason is more than "not in the registry".
    pub(crate) fn reason(&self) -> Option<String> {
        self.certificate.lock().clone()
    }

    /// Ready while `in_registry`, unless draining or the certificate expired.
    pub(crate) async fn set(&self, in_registry: bool) {
        let ready = in_registry
            && !self.draining.load(Ordering::Acquire)
            && self.certificate.lock().is_none();
        if self.ready.swap(ready, Ordering::AcqRel) != ready {
            self.publish(ready).await;
        }
    }

    /// Not ready from now on; live until the server stops.
    pub(crate) async fn drain(&self) {
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

    /// Follows the registry's connection, and the expiry of the certificate in use (`tls`,
    /// which reloads keep current), until the task is aborted.
    pub(crate) fn follow(
        self: &Arc<Self>,
        registry: SharedRegistry,
        tls: Option<PeerTls>,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(FOLLOW_EVERY);
            loop {
                tick.tick().await;
                if let Some(tls) = &tls {
                    me.certificate_check(tls.expired(SystemTime::now()));
                }
                me.set(registry.state().connected).await;
            }
        })
    }

    fn certificate_check(&self, expired: Option<String>) {
        let mut certificate = self.certificate.lock();
        if *certificate == expired {
            return;
        }
        match &expired {
            Some(why) => warn!(reason = %why, "not ready: the certificate in use expired"),
            None => info!("a valid certificate is in use again"),
        }
        *certificate = expired;
    }
}
