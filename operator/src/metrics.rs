//! Prometheus metrics of the operator.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label of the failures counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// [`crate::Error::kind`] of the failure.
    pub kind: String,
}

/// The operator's metrics and the registry that exports them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Reconciles started.
    pub reconciles: Counter,
    /// Reconciles that returned an error, by error kind.
    pub failures: Family<ErrorLabels, Counter>,
    /// Reconcile duration in seconds.
    pub duration: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvfabric_operator");
        let reconciles = Counter::default();
        let failures = Family::<ErrorLabels, Counter>::default();
        // 1 ms .. ~16 s: an apply of a handful of objects, up to API-server trouble.
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register("reconciles", "Reconciles started", reconciles.clone());
        registry.register(
            "reconcile_failures",
            "Reconciles that failed, by error kind",
            failures.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile",
            duration.clone(),
        );
        Self {
            registry,
            reconciles,
            failures,
            duration,
        }
    }
}

impl Metrics {
    /// Counts one failed reconcile.
    pub fn failure(&self, kind: &str) {
        self.failures
            .get_or_create(&ErrorLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
