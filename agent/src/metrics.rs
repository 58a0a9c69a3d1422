//! Prometheus metrics of the agent, served at `/metrics` (OpenMetrics text).

use std::sync::Arc;
use std::sync::atomic::AtomicI64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LinkLabels {
    pub transport: String,
    pub peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabels {
    pub transport: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The error's stable code (`wrong_key`, `timeout`, `peer_closed`, ...).
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServedLabels {
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    /// `peer` (the peer API), `local` (the local API), `fd` (the fd socket).
    pub port: String,
    /// `room`: an unproven connection shed for a newcomer; `deadline`: an unproven connection
    /// closed at its deadline; `full`: a newcomer refused, every slot held by a proven one.
    pub reason: String,
}

/// One port's [`Metrics::connections_shed`] counters, looked up once.
#[derive(Debug, Clone)]
pub struct Shedding {
    pub room: Counter,
    pub deadline: Counter,
    pub full: Counter,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Bytes moved for local workers, by transport and peer agent.
    pub bytes: Family<LinkLabels, Counter>,
    /// Batches completed for local workers, by transport and peer agent.
    pub batches: Family<LinkLabels, Counter>,
    /// Submit-to-completion time of those batches.
    pub batch_seconds: Family<TransportLabels, Histogram>,
    /// Failed requests, by error kind.
    pub errors: Family<ErrorLabels, Counter>,
    /// Bytes this agent served to peers (tcp target side), by op.
    pub served_bytes: Family<ServedLabels, Counter>,
    pub open_connections: Gauge,
    pub registry_connected: Gauge,
    pub registry_agents: Gauge,
    pub registry_segments: Gauge,
    pub registry_reregistrations: Gauge,
    /// Full re-reads of the registry by the watch (`RegistryState::resyncs`) and watches
    /// resumed without one (`RegistryState::watch_resumes`), brought up to the registry's own
    /// counts at each scrape ([`Metrics::sync_registry`]).
    pub registry_relists: Counter,
    pub registry_watch_resumes: Counter,
    /// Serializes [`Metrics::sync_registry`]: two scrapes at once must not both add the same
    /// difference.
    registry_sync: parking_lot::Mutex<()>,
    pub local_segments: Gauge,
    /// Spans handed to the collector, and spans lost (collector down, queue full).
    pub spans_exported: Counter,
    pub spans_dropped: Counter,
    /// Failed accepts on the gRPC and fd sockets (at the fd limit, they back off).
    pub accept_errors: Counter,
    /// Connections closed or refused to keep a port open to those who prove themselves.
    pub connections_shed: Family<ShedLabels, Counter>,
    /// Holds on this agent's segments that are live now.
    pub holds_live: Gauge,
    /// Holds created, ended by EndHold, and ended by their expiry.
    pub holds_created: Counter,
    pub holds_ended: Counter,
    pub holds_expired: Counter,
    /// Batches of local workers refused under a hold key: outside the grant, a write, or the
    /// hold ended or expired.
    pub hold_refused_batches: Counter,
    /// Renewed certificates taken into use without a restart, and new sets refused.
    pub tls_reloads: Counter,
    pub tls_reload_refusals: Counter,
}

fn histogram() -> Histogram {
    // 10 µs .. ~20 s: a 4 KiB pull up to a stalled multi-GiB batch.
    Histogram::new(exponential_buckets(1e-5, 2.0, 22))
}

impl Metrics {
    /// The span counters belong to the trace exporter; the metrics only publish them.
    pub fn new(spans: &crate::telemetry::SpanCounters) -> Self {
        let mut registry = Registry::with_prefix("kvfabric_agent");
        let m = Metrics {
            bytes: Family::default(),
            batches: Family::default(),
            batch_seconds: Family::new_with_constructor(histogram),
            errors: Family::default(),
            served_bytes: Family::default(),
            open_connections: Gauge::<i64, AtomicI64>::default(),
            registry_connected: Gauge::default(),
            registry_agents: Gauge::default(),
            registry_segments: Gauge::default(),
            registry_reregistrations: Gauge::default(),
            registry_relists: Counter::default(),
            registry_watch_resumes: Counter::default(),
            registry_sync: parking_lot::Mutex::new(()),
            local_segments: Gauge::default(),
            spans_exported: spans.exported.clone(),
            spans_dropped: spans.dropped.clone(),
            accept_errors: Counter::default(),
            connections_shed: Family::default(),
            holds_live: Gauge::default(),
            holds_created: Counter::default(),
            holds_ended: Counter::default(),
            holds_expired: Counter::default(),
            hold_refused_batches: Counter::default(),
            tls_reloads: Counter::default(),
            tls_reload_refusals: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "accept_errors",
            "Failed accepts on the agent's sockets (they back off at the fd limit)",
            m.accept_errors.clone(),
        );
        registry.register(
            "connections_shed",
            "Connections closed or refused to keep a port open, by port (peer, local, fd) and \
             reason (room: an unproven one shed for a newcomer; deadline: unproven past its \
             deadline; full: a newcomer refused, every slot proven)",
            m.connections_shed.clone(),
        );
        registry.register("bytes", "Bytes moved for local workers", m.bytes.clone());
        registry.register(
            "batches",
            "Batches completed for local workers",
            m.batches.clone(),
        );
        registry.register(
            "batch_duration_seconds",
            "Submit-to-completion time of a batch",
            m.batch_seconds.clone(),
        );
        registry.register("errors", "Failed requests by error kind", m.errors.clone());
        registry.register(
            "served_bytes",
            "Bytes served to peer agents",
            m.served_bytes.clone(),
        );
        registry.register(
            "open_connections",
            "Data connections to peer agents",
            m.open_connections.clone(),
        );
        registry.register(
            "registry_connected",
            "1 when the registry answered last",
            m.registry_connected.clone(),
        );
        registry.register(
            "registry_agents",
            "Agents in the registry cache",
            m.registry_agents.clone(),
        );
        registry.register(
            "registry_segments",
            "Segments in the registry cache",
            m.registry_segments.clone(),
        );
        registry.register(
            "registry_reregistrations",
            "Times the lease was lost and everything re-registered",
            m.registry_reregistrations.clone(),
        );
        registry.register(
            "registry_relists",
            "Times the registry watch read every entry again (etcd compacted the revisions it \
             needed); the first read at start is not counted",
            m.registry_relists.clone(),
        );
        registry.register(
            "registry_watch_resumes",
            "Times the registry watch was opened again from the last revision it applied, \
             without reading everything again (a member died, a connection dropped)",
            m.registry_watch_resumes.clone(),
        );
        registry.register(
            "local_segments",
            "Segments registered with this agent",
            m.local_segments.clone(),
        );
        registry.register(
            "spans_exported",
            "Spans the OTLP exporter delivered",
            m.spans_exported.clone(),
        );
        registry.register(
            "spans_dropped",
            "Spans lost because the collector could not take them",
            m.spans_dropped.clone(),
        );
        registry.register(
            "holds_live",
            "Holds on this agent's segments that are live",
            m.holds_live.clone(),
        );
        registry.register(
            "holds_created",
            "Holds created on this agent's segments",
            m.holds_created.clone(),
        );
        registry.register(
            "holds_ended",
            "Holds ended by their owner (EndHold)",
            m.holds_ended.clone(),
        );
        registry.register(
            "holds_expired",
            "Holds that reached their expiry",
            m.holds_expired.clone(),
        );
        registry.register(
            "hold_refused_batches",
            "Batches of local workers refused under a hold key (outside the grant, a write, or \
             the hold ended)",
            m.hold_refused_batches.clone(),
        );
        registry.register(
            "tls_reloads",
            "New certificate, key and CA files taken into use for new connections (peer API \
             and data port) without a restart",
            m.tls_reloads.clone(),
        );
        registry.register(
            "tls_reload_refusals",
            "Changed certificate, key or CA files refused (the key not the certificate's, not \
             of the CA, not for the fabric's name, not valid now); the set in use stays",
            m.tls_reload_refusals.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Sets the registry gauges and brings the registry counters up to `state` (its counts
    /// only grow).
    pub fn sync_registry(&self, state: &crate::registry::RegistryState) {
        self.registry_connected.set(i64::from(state.connected));
        self.registry_agents
            .set(i64::try_from(state.agents).unwrap_or(i64::MAX));
        self.registry_segments
            .set(i64::try_from(state.segments).unwrap_or(i64::MAX));
        self.registry_reregistrations
            .set(i64::try_from(state.reregistrations).unwrap_or(i64::MAX));
        let _one_at_a_time = self.registry_sync.lock();
        for (counter, count) in [
            (&self.registry_relists, state.resyncs),
            (&self.registry_watch_resumes, state.watch_resumes),
        ] {
            if let Some(more) = count.checked_sub(counter.get()).filter(|n| *n > 0) {
                counter.inc_by(more);
            }
        }
    }

    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&ErrorLabels { kind: kind.into() })
            .inc();
    }

    /// The shedding counters of `port`.
    pub fn shedding(&self, port: &str) -> Shedding {
        let counter = |reason: &str| {
            self.connections_shed
                .get_or_create(&ShedLabels {
                    port: port.into(),
                    reason: reason.into(),
                })
                .clone()
        };
        Shedding {
            room: counter("room"),
            deadline: counter("deadline"),
            full: counter("full"),
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

pub type SharedMetrics = Arc<Metrics>;

/// GETs an agent's `/metrics` and parses the OpenMetrics text into (`name{labels}`, value)
/// samples: for tests and tools that read an agent's numbers.
pub async fn scrape(addr: std::net::SocketAddr) -> crate::Result<Vec<(String, f64)>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fail =
        |reason: String| crate::Error::io(format!("scrape {addr}"), std::io::Error::other(reason));
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| crate::Error::io(format!("connect {addr}"), e))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .await
        .map_err(|e| crate::Error::io(format!("scrape {addr}"), e))?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)
        .await
        .map_err(|e| crate::Error::io(format!("scrape {addr}"), e))?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| fail("no HTTP header".into()))?;
    if !head.starts_with("HTTP/1.1 200") || !head.contains("openmetrics-text") {
        return Err(fail(format!("unexpected answer: {head}")));
    }
    if !body.trim_end().ends_with("# EOF") {
        return Err(fail("truncated exposition (no # EOF)".into()));
    }
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (name, value) = l
                .rsplit_once(' ')
                .ok_or_else(|| fail(format!("bad sample {l:?}")))?;
            let value: f64 = value
                .parse()
                .map_err(|_| fail(format!("bad value in {l:?}")))?;
            Ok((name.to_string(), value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::RegistryState;

    #[test]
    fn registry_counters_follow_the_registry_and_never_go_back() {
        let m = Metrics::new(&crate::telemetry::SpanCounters::default());
        let mut state = RegistryState {
            resyncs: 2,
            watch_resumes: 5,
            ..RegistryState::default()
        };
        m.sync_registry(&state);
        m.sync_registry(&state);
        assert_eq!(
            (m.registry_relists.get(), m.registry_watch_resumes.get()),
            (2, 5)
        );
        state.resyncs = 3;
        m.sync_registry(&state);
        assert_eq!(m.registry_relists.get(), 3);
        // A smaller count (another registry's, never the same one's) does not lower a counter.
        state.resyncs = 1;
        m.sync_registry(&state);
        assert_eq!(m.registry_relists.get(), 3);
        let text = m.encode();
        assert!(
            text.contains("kvfabric_agent_registry_relists_total 3"),
            "{text}"
        );
        assert!(
            text.contains("kvfabric_agent_registry_watch_resumes_total 5"),
            "{text}"
        );
    }
}
