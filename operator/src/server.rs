//! The HTTP server: `/metrics`, `/healthz`, `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;
use crate::{Error, Result};

/// Where the process stands, for `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Starting up (CRD check, connecting).
    Starting = 0,
    /// Waiting for the Lease: healthy, not reconciling.
    Standby = 1,
    /// The controller is running.
    Running = 2,
    /// Shutting down.
    Stopping = 3,
}

/// State shared with the handlers.
#[derive(Debug)]
pub struct Health {
    phase: AtomicU8,
    metrics: Arc<Metrics>,
}

impl Health {
    /// Health over the given metrics, in phase `Starting`.
    pub fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            phase: AtomicU8::new(Phase::Starting as u8),
            metrics,
        })
    }

    /// Moves to `phase`.
    pub fn set(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::SeqCst);
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::SeqCst) {
            1 => Phase::Standby,
            2 => Phase::Running,
            3 => Phase::Stopping,
            _ => Phase::Starting,
        }
    }
}

async fn metrics(State(h): State<Arc<Health>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        h.metrics.encode(),
    )
}

async fn healthz() -> &'static str {
    "ok"
}

// A standby replica reports ready too: with leader election, a rolling update starts the new pod
// while the old one holds the Lease, and a standby that never turned ready would stall it.
async fn readyz(State(h): State<Arc<Health>>) -> (StatusCode, &'static str) {
    match h.phase() {
        Phase::Running => (StatusCode::OK, "ok: leader, controller running"),
        Phase::Standby => (StatusCode::OK, "ok: standby, waiting for the lease"),
        Phase::Starting => (StatusCode::SERVICE_UNAVAILABLE, "starting"),
        Phase::Stopping => (StatusCode::SERVICE_UNAVAILABLE, "stopping"),
    }
}

/// The router, separate from [`serve`] so tests can call it without a socket.
pub fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(health)
}

/// Binds `addr` and serves until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Io {
            action: format!("binding the metrics address {addr}"),
            source,
        })?;
    axum::serve(listener, router(health))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| Error::Io {
            action: format!("serving HTTP on {addr}"),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    #[tokio::test]
    async fn endpoints() {
        let metrics = Arc::new(Metrics::default());
        metrics.reconciles.inc();
        metrics.failure("conflict");
        metrics.duration.observe(0.01);
        let health = Health::new(metrics);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let h = health.clone();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router(h)).await;
        });

        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(
            get(addr, "/readyz").await.starts_with("HTTP/1.1 503"),
            "not ready while starting"
        );
        health.set(Phase::Standby);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        health.set(Phase::Running);
        let r = get(addr, "/readyz").await;
        assert!(r.starts_with("HTTP/1.1 200") && r.contains("leader"), "{r}");
        let m = get(addr, "/metrics").await;
        assert!(m.contains("kvfabric_operator_reconciles_total 1"), "{m}");
        assert!(
            m.contains("kvfabric_operator_reconcile_failures_total{kind=\"conflict\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("kvfabric_operator_reconcile_duration_seconds_count 1"),
            "{m}"
        );
        health.set(Phase::Stopping);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        task.abort();
    }
}
