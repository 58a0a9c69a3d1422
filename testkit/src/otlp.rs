//! An OTLP/gRPC trace receiver: collects every span sent to it. The e2e tests check traces with
//! it; `kvfabric bench --through-agent --trace` exports to one in-process, so tracing costs what
//! it would against a real collector.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tokio_stream::wrappers::TcpListenerStream;

/// One received span, flattened.
#[derive(Debug, Clone)]
pub struct Span {
    pub service: String,
    pub name: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    pub parent_span_id: Vec<u8>,
    pub attributes: Vec<(String, String)>,
}

impl Span {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone, Default)]
struct Sink(Arc<Mutex<Vec<Span>>>);

fn text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .map(text)
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    out.push(Span {
                        service: service.clone(),
                        name: s.name,
                        trace_id: s.trace_id,
                        span_id: s.span_id,
                        parent_span_id: s.parent_span_id,
                        attributes: s
                            .attributes
                            .iter()
                            .map(|a| (a.key.clone(), text(a)))
                            .collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The receiver; stops when dropped.
#[derive(Debug)]
pub struct Receiver {
    pub addr: SocketAddr,
    sink: Sink,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    pub async fn start(ip: IpAddr) -> crate::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind((ip, 0))
            .await
            .map_err(|e| crate::Error::io("bind the OTLP receiver", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| crate::Error::io("OTLP receiver address", e))?;
        let sink = Sink::default();
        let svc = TraceServiceServer::new(sink.clone());
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        Ok(Receiver { addr, sink, task })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<Span> {
        self.sink
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn count(&self) -> usize {
        self.sink.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
