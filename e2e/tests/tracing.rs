//! One prefill→decode transfer between two agent processes, traced: an OTLP receiver in the test
//! collects the spans of the worker (this process), the decode agent and the prefill agent, and
//! the test checks they form one trace with the expected chain and attributes. And with the
//! collector unreachable, transfers go on and the dropped-span counter rises.

mod common;

use std::time::Duration;

use common::{BLOCK, etcd_on, prefill_and_decode, sees, within};

use kvfabric_agent::metrics::scrape;
use kvfabric_agent::telemetry::{self, TraceConfig};
use kvfabric_e2e::Network;
use kvfabric_e2e::worker::{first_mismatch, random_memory, scattered};
use kvfabric_testkit::otlp::{Receiver, Span};
use tracing::Instrument;

const FAST_EXPORT: [(&str, &str); 1] = [("OTEL_BSP_SCHEDULE_DELAY", "100")];

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_the_worker_both_agents_and_the_transport() {
    let net = Network::new(2);
    let Some(etcd) = etcd_on(net.gateway).await else {
        return;
    };
    let receiver = Receiver::start(net.gateway).await.unwrap();
    // This process is the decode worker; it exports its spans to the same receiver.
    let worker = telemetry::init(
        tracing_subscriber::EnvFilter::new("info"),
        Some(TraceConfig {
            endpoint: Some(receiver.endpoint()),
            sample_ratio: None,
            service_name: Some("decode-worker".into()),
        }),
        "decode-worker",
    )
    .unwrap();
    let otlp = receiver.endpoint();
    let flags = ["--transports", "tcp", "--otlp-endpoint", &otlp];
    let (_a, b, prefill, decode) = prefill_and_decode(&net, &etcd, &flags, &FAST_EXPORT).await;
    let src = random_memory(256 * BLOCK, 1);
    let dst = random_memory(64 * BLOCK, 2);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&decode, "prefill-0")
    })
    .await;

    let ops = scattered(64, BLOCK, 256);
    let root = tracing::info_span!("decode.step");
    decode
        .read(&d, "prefill-0", p.key, &ops)
        .instrument(root)
        .await
        .unwrap();
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
    worker.shutdown();

    // Wait for every side's spans.
    let chain = || {
        let spans = receiver.spans();
        // Other tests in this process submit too (their spans reach this exporter as well):
        // take the submit under this test's own root span.
        let root = spans.iter().find(|s| s.name == "decode.step")?;
        let w = spans
            .iter()
            .find(|s| s.name == "kvfabric.worker.submit" && s.parent_span_id == root.span_id)?
            .clone();
        assert_eq!(w.service, "decode-worker");
        let of = |name: &str| -> Vec<Span> {
            spans
                .iter()
                .filter(|s| s.name == name && s.trace_id == w.trace_id)
                .cloned()
                .collect()
        };
        let submit = of("kvfabric.agent.submit").pop()?;
        let transport = of("kvfabric.transport.tcp").pop()?;
        let select = of("kvfabric.transport.select").pop()?;
        let served = of("kvfabric.peer.serve");
        (!served.is_empty()).then_some((w, submit, transport, select, served))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while chain().is_none() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Some((w, submit, transport, select, served)) = chain() else {
        let got: Vec<_> = receiver
            .spans()
            .iter()
            .map(|s| format!("{} {} {}", s.service, s.name, hex(&s.trace_id)))
            .collect();
        panic!("incomplete trace; received:\n{}", got.join("\n"));
    };

    // The parent/child chain across three processes.
    assert_eq!(submit.parent_span_id, w.span_id, "agent submit ← worker");
    assert_eq!(
        transport.parent_span_id, submit.span_id,
        "transport ← agent submit"
    );
    assert_eq!(
        select.parent_span_id, submit.span_id,
        "selection ← agent submit"
    );
    for s in &served {
        assert_eq!(
            s.parent_span_id, transport.span_id,
            "peer serve ← transport"
        );
        assert_eq!(s.attr("kvfabric.agent"), Some("prefill-node"));
        assert_eq!(s.service, "kvfabric-agent");
    }
    let served_bytes: i64 = served
        .iter()
        .map(|s| s.attr("kvfabric.bytes").unwrap().parse::<i64>().unwrap())
        .sum();
    assert_eq!(served_bytes as u64, 64 * BLOCK);

    // Attributes of the agent's span.
    for (k, v) in [
        ("kvfabric.agent", "decode-node"),
        ("kvfabric.fabric", "e2e"),
        ("kvfabric.src.segment", "prefill-0"),
        ("kvfabric.dst.segment", "decode-0"),
        ("kvfabric.src.node", "prefill-node"),
        ("kvfabric.dst.node", "decode-node"),
        ("kvfabric.transport", "tcp"),
        ("kvfabric.op", "read"),
        ("kvfabric.blocks", "64"),
        ("kvfabric.retries", "0"),
    ] {
        assert_eq!(submit.attr(k), Some(v), "{k} in {:?}", submit.attributes);
    }
    assert_eq!(
        submit.attr("kvfabric.bytes"),
        Some(&*(64 * BLOCK).to_string())
    );
    for k in [
        "kvfabric.pool",
        "kvfabric.coalesced_ops",
        "kvfabric.duration_ms",
        "kvfabric.gbps",
        "kvfabric.transport.reason",
    ] {
        assert!(
            submit.attr(k).is_some(),
            "{k} missing in {:?}",
            submit.attributes
        );
    }
    assert_eq!(select.attr("kvfabric.transport"), Some("tcp"));
    assert!(select.attr("kvfabric.transport.reason").is_some());
    assert_eq!(transport.attr("kvfabric.peer"), Some("prefill-node"));

    // The decode agent's log lines carry the trace id.
    let trace = hex(&w.trace_id);
    assert!(
        b.log().contains(&trace),
        "trace id {trace} not in the agent log:\n{}",
        b.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_drops_and_counts_spans_while_transfers_go_on() {
    let net = Network::new(2);
    let Some(etcd) = etcd_on(net.gateway).await else {
        return;
    };
    // Nothing listens there.
    let dead = format!("http://{}:1", net.gateway);
    let flags = ["--transports", "tcp", "--otlp-endpoint", &dead];
    let (_a, b, prefill, decode) = prefill_and_decode(&net, &etcd, &flags, &FAST_EXPORT).await;
    let src = random_memory(64 * BLOCK, 3);
    let dst = random_memory(64 * BLOCK, 4);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "segment visible", || {
        sees(&decode, "prefill-0")
    })
    .await;
    let ops = scattered(64, BLOCK, 64);
    for _ in 0..20 {
        decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    }
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
    let metrics = b.ready.metrics;
    let dropped = || async move {
        scrape(metrics)
            .await
            .unwrap()
            .iter()
            .find(|(n, _)| n == "kvfabric_agent_spans_dropped_total")
            .map_or(0.0, |(_, v)| *v)
    };
    within(
        Duration::from_secs(15),
        "dropped spans counted",
        || async move { dropped().await >= 20.0 },
    )
    .await;
    // Still serving.
    decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
}
