//! Logs and traces. `tracing` spans are the one instrumentation; when an OTLP endpoint is set,
//! they are also exported as OpenTelemetry spans (gRPC, batched on a background thread: the data
//! path never waits for the collector; spans it cannot take are dropped and counted).
//!
//! Configuration, standard variables first: `OTEL_EXPORTER_OTLP_ENDPOINT` (else the fabric's
//! `KVFABRIC_OTLP_ENDPOINT`), `OTEL_SERVICE_NAME` (default `kvfabric-agent`),
//! `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` (else `KVFABRIC_TRACE_SAMPLE_RATIO` as a
//! parent-based ratio; default: every trace).

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt, TraceFlags, TraceState, TracerProvider};
use opentelemetry::{Context, KeyValue, SpanId, TraceId};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter,
};
use prometheus_client::metrics::counter::Counter;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::error::{Error, Result};

/// Where spans go, resolved from the environment and flags.
#[derive(Debug, Clone, Default)]
pub struct TraceConfig {
    pub endpoint: Option<String>,
    pub sample_ratio: Option<f64>,
    pub service_name: Option<String>,
}

impl TraceConfig {
    /// Standard OTEL_* variables win over the fabric's settings (`fabric_endpoint`, `ratio`).
    pub fn resolve(fabric_endpoint: Option<String>, ratio: Option<f64>) -> TraceConfig {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        TraceConfig {
            endpoint: env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
                .or(fabric_endpoint),
            sample_ratio: if env("OTEL_TRACES_SAMPLER").is_some() {
                None
            } else {
                ratio
            },
            service_name: env("OTEL_SERVICE_NAME"),
        }
    }
}

/// Counters the exporter feeds (shared with the metrics registry).
#[derive(Debug, Clone, Default)]
pub struct SpanCounters {
    pub exported: Counter,
    pub dropped: Counter,
}

/// Keeps the trace pipeline alive; `shutdown` flushes what is queued (bounded). Clones share it.
#[derive(Debug, Default, Clone)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    pub counters: SpanCounters,
}

impl Telemetry {
    pub fn tracing_enabled(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is queued now (bounded by the exporter's timeout).
    pub fn flush(&self) {
        if let Some(p) = &self.provider {
            let _ = p.force_flush();
        }
    }

    pub fn shutdown(&self) {
        if let Some(p) = &self.provider {
            let _ = p.force_flush();
            let _ = p.shutdown_with_timeout(Duration::from_secs(2));
        }
    }
}

/// Installs the global subscriber: the log filter, human logs on stderr, and the OTLP layer when
/// `trace` has an endpoint. Call from within a tokio runtime (the exporter's I/O lives on it).
pub fn init(
    filter: EnvFilter,
    trace: Option<TraceConfig>,
    default_service: &str,
) -> Result<Telemetry> {
    // The log filter picks what is printed; traces keep every kvfabric span whatever it says.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let Some(cfg) = trace.filter(|c| c.endpoint.is_some()) else {
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        return Ok(Telemetry::default());
    };
    let endpoint = cfg.endpoint.clone().unwrap_or_default();
    let counters = SpanCounters::default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint_str(&endpoint)
        .build()
        .map_err(|e| Error::config("otlp-endpoint", &endpoint, e.to_string()))?;
    let exporter = Counted {
        inner: Arc::new(exporter),
        counters: counters.clone(),
        runtime: tokio::runtime::Handle::try_current()
            .map_err(|e| Error::io("telemetry", std::io::Error::other(e)))?,
    };
    let service = cfg
        .service_name
        .clone()
        .unwrap_or_else(|| default_service.to_string());
    let mut builder = SdkTracerProvider::builder()
        .with_span_processor(BatchSpanProcessor::builder(exporter).build())
        .with_resource(Resource::builder().with_service_name(service).build());
    if let Some(ratio) = cfg.sample_ratio {
        builder = builder.with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            ratio,
        ))));
    }
    let provider = builder.build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    // Every info span (the kvfabric ones, and those of a worker embedding the client), but not
    // the transport plumbing underneath, which would trace the exporter's own calls.
    let spans = tracing_subscriber::filter::Targets::new()
        .with_default(tracing::Level::INFO)
        .with_target("h2", tracing::Level::WARN)
        .with_target("hyper", tracing::Level::WARN)
        .with_target("hyper_util", tracing::Level::WARN)
        .with_target("tower", tracing::Level::WARN)
        .with_target("tonic", tracing::Level::WARN)
        .with_target("opentelemetry", tracing::Level::WARN)
        .with_target("opentelemetry_sdk", tracing::Level::WARN)
        .with_target("opentelemetry_otlp", tracing::Level::WARN)
        .with_target("etcd_client", tracing::Level::WARN);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("kvfabric"))
        .with_filter(spans);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(layer)
        .try_init();
    tracing::info!(%endpoint, "exporting traces over OTLP");
    Ok(Telemetry {
        provider: Some(provider),
        counters,
    })
}

/// `with_endpoint` takes a String; this keeps the call site readable.
trait EndpointStr {
    fn with_endpoint_str(self, e: &str) -> Self;
}

impl<T: opentelemetry_otlp::WithExportConfig> EndpointStr for T {
    fn with_endpoint_str(self, e: &str) -> Self {
        self.with_endpoint(e.to_string())
    }
}

/// The OTLP exporter, run on the agent's runtime (tonic needs it) and counted.
#[derive(Debug)]
struct Counted {
    inner: Arc<opentelemetry_otlp::SpanExporter>,
    counters: SpanCounters,
    runtime: tokio::runtime::Handle,
}

impl SpanExporter for Counted {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let inner = self.inner.clone();
        let done = self
            .runtime
            .spawn(async move { inner.export(batch).await })
            .await;
        match done {
            Ok(Ok(())) => {
                self.counters.exported.inc_by(n);
                Ok(())
            }
            Ok(Err(e)) => {
                self.counters.dropped.inc_by(n);
                Err(e)
            }
            Err(e) => {
                self.counters.dropped.inc_by(n);
                Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                    e.to_string(),
                ))
            }
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called once when the provider is built, before any export shares `inner`.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

/// The W3C trace context of the current `tracing` span, for the data plane.
pub fn current_trace() -> Option<kvfabric_engine::TraceContext> {
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| kvfabric_engine::TraceContext {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        flags: sc.trace_flags().to_u8(),
    })
}

/// An OpenTelemetry parent context from a data-plane trace context.
pub fn remote_parent(t: &kvfabric_engine::TraceContext) -> Context {
    Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(t.trace_id),
        SpanId::from_bytes(t.span_id),
        TraceFlags::new(t.flags),
        true,
        TraceState::default(),
    ))
}

/// The trace id of the current span as hex (logs carry it, so they correlate with traces).
pub fn current_trace_id() -> Option<String> {
    let cx = tracing::Span::current().context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

struct MetadataMap<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataMap<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            value.parse(),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataRead<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataRead<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Puts the current span's context in gRPC metadata (`traceparent`, W3C).
pub fn inject(metadata: &mut tonic::metadata::MetadataMap) {
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut MetadataMap(metadata));
}

/// The caller's context from gRPC metadata, if it sent one.
pub fn extract(metadata: &tonic::metadata::MetadataMap) -> Context {
    TraceContextPropagator::new().extract(&MetadataRead(metadata))
}

/// Attributes on the span of a data-plane chunk served for a peer.
pub fn served_attributes(c: &kvfabric_engine::ServedChunk<'_>, agent: &str) -> Vec<KeyValue> {
    let mut v = vec![
        KeyValue::new("kvfabric.agent", agent.to_string()),
        KeyValue::new("kvfabric.peer", c.peer.to_string()),
        KeyValue::new("kvfabric.op", c.opcode.to_string()),
        KeyValue::new("kvfabric.blocks", i64::from(c.ops)),
        KeyValue::new("kvfabric.bytes", c.bytes as i64),
        KeyValue::new("kvfabric.duration_ms", c.elapsed.as_secs_f64() * 1e3),
        KeyValue::new("kvfabric.transport", "tcp"),
    ];
    if let Some(e) = &c.error {
        v.push(KeyValue::new("error", e.clone()));
    }
    v
}
