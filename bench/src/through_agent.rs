//! `kvfabric bench --through-agent`: the same pulls, once engine to engine and once worker →
//! local agent → peer agent → worker memory (two agents in this process on a shared in-memory
//! registry, tcp on loopback), alternating rounds, every destination byte verified.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_engine::{AccessKey, Batch, BlockOp, Engine, EngineConfig, Preference, TransportKind};
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use serde::Serialize;
use tokio::sync::watch;

use crate::args::BenchArgs;
use crate::error::{Error, Result};
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, Op};
use kvfabric_testkit::InProcessAgent;

const ROUNDS: usize = 3;

#[derive(Debug, Serialize)]
pub struct Report {
    pub block_size: u64,
    pub blocks_per_batch: usize,
    pub concurrency: usize,
    pub engine_gbps: Vec<f64>,
    pub agent_gbps: Vec<f64>,
    pub engine_median_gbps: f64,
    pub agent_median_gbps: f64,
    /// through the agents / engine only.
    pub ratio: f64,
    pub verified: bool,
    /// Every span exported (100% sampling) to an in-process OTLP receiver.
    pub tracing: bool,
    pub spans_exported: u64,
    pub spans_dropped: u64,
}

fn dup(m: &HostMemory) -> Result<OwnedFd> {
    m.memfd()
        .ok_or_else(|| Error::config("pool", "host memory", "has no memfd"))?
        .try_clone_to_owned()
        .map_err(|e| Error::io("dup memfd", e))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

pub async fn run(
    args: &BenchArgs,
    telemetry: &Telemetry,
    block: u64,
    per_batch: usize,
) -> Result<Report> {
    let batch_bytes = block * per_batch as u64;
    let pool = args.pool_bytes.max(batch_bytes);
    let blocks_in_pool = pool / block;
    let src = HostMemory::alloc(pool)?;
    let dst = HostMemory::alloc(batch_bytes)?;
    // SAFETY: fresh memory, nothing transfers yet.
    rand::rngs::SmallRng::seed_from_u64(7).fill_bytes(unsafe { src.as_mut_slice() });
    let mut places: Vec<u64> = (0..blocks_in_pool).collect();
    places.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(8));
    let ops: Vec<Op> = (0..per_batch as u64)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * block,
            remote_region: 0,
            remote_offset: places[i as usize] * block,
            len: block,
        })
        .collect();

    // Engine to engine.
    let engine_cfg = |name: &str| EngineConfig {
        name: name.into(),
        tcp_connections: args.connections,
        ..EngineConfig::default()
    };
    let target = Engine::new(engine_cfg("bench-engine-target"))?;
    let initiator = Engine::new(engine_cfg("bench-engine-initiator"))?;
    let key = AccessKey::random();
    let t_src = target.register_memfd(dup(&src)?, key)?;
    let i_dst = initiator.register_memfd(dup(&dst)?, AccessKey::random())?;
    let (stop, rx) = watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Error::io("bind", e))?;
    let serving = tokio::spawn({
        let (t, mut rx) = (target.clone(), rx.clone());
        async move {
            t.serve_tcp(listener, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
        }
    });
    while target.descriptor().endpoints.tcp.is_none() {
        tokio::task::yield_now().await;
    }
    let peer = Arc::new(
        initiator
            .connect(
                &target.descriptor(),
                target.data_secret(),
                Preference::Only(TransportKind::Tcp),
                None,
            )
            .await?,
    );
    let engine_ops: Vec<BlockOp> = ops
        .iter()
        .map(|o| BlockOp {
            local_region: i_dst.id(),
            local_offset: o.local_offset,
            remote_region: t_src.id(),
            remote_offset: o.remote_offset,
            len: o.len,
        })
        .collect();

    // Through two agents.
    let store = MemoryStore::new();
    let tls_dir = tempfile::tempdir().map_err(|e| Error::io("tls dir", e))?;
    let tls = if args.tls {
        let ca = kvfabric_testkit::TestCa::new("kvfabric bench");
        let name = kvfabric_proto::contract::TLS_SERVER_NAME;
        ca.write_dir(tls_dir.path(), &ca.issue(&[name]))?;
        Some(kvfabric_agent::peer_tls::PeerTls::from_dir(tls_dir.path())?)
    } else {
        None
    };
    let config = |name: &str| {
        let mut c = InProcessAgent::config(name);
        c.fabric = "bench".into();
        c.transports = vec![TransportKind::Tcp];
        c.tcp_connections = args.connections;
        c.tls = tls.clone();
        c
    };
    let a =
        InProcessAgent::start(config("bench-prefill"), store.registry(), telemetry.clone()).await?;
    let b =
        InProcessAgent::start(config("bench-decode"), store.registry(), telemetry.clone()).await?;
    let prefill = Client::connect(a.socket_dir()).await?;
    let decode = Client::connect(b.socket_dir()).await?;
    let p = prefill.register("bench-kv-src", &[&src], None).await?;
    let d = decode.register("bench-kv-dst", &[&dst], None).await?;

    let slice = Duration::from_secs_f64((args.duration / ROUNDS as f64).max(0.5));
    let (mut engine_gbps, mut agent_gbps) = (Vec::new(), Vec::new());
    let mut verified = true;
    for _ in 0..ROUNDS {
        // SAFETY: no transfer in flight between phases.
        unsafe { dst.as_mut_slice() }.fill(0);
        let bytes = timed(args.concurrency, slice, |_| {
            let (peer, ops) = (peer.clone(), engine_ops.clone());
            async move { Ok(peer.submit(Batch::read(ops))?.wait().await?.bytes) }
        })
        .await?;
        engine_gbps.push(bytes);
        verified &= matches(&ops, &dst, &src);

        // SAFETY: as above.
        unsafe { dst.as_mut_slice() }.fill(0);
        let bytes = timed(args.concurrency, slice, |_| {
            let (decode, d, ops, key) = (decode.clone(), d.clone(), ops.clone(), p.key);
            async move { Ok(decode.read(&d, "bench-kv-src", key, &ops).await?.bytes) }
        })
        .await?;
        agent_gbps.push(bytes);
        verified &= matches(&ops, &dst, &src);
    }
    let _ = stop.send(true);
    b.stop().await?;
    a.stop().await?;
    let _ = serving.await;
    let (e, a) = (median(&engine_gbps), median(&agent_gbps));
    if !verified {
        return Err(Error::Verify {
            row: "through-agent".into(),
            mismatches: 1,
            first: "a destination block differs from its source".into(),
        });
    }
    Ok(Report {
        block_size: block,
        blocks_per_batch: per_batch,
        concurrency: args.concurrency,
        engine_gbps,
        agent_gbps,
        engine_median_gbps: e,
        agent_median_gbps: a,
        ratio: a / e,
        verified,
        tracing: telemetry.tracing_enabled(),
        spans_exported: telemetry.counters.exported.get(),
        spans_dropped: telemetry.counters.dropped.get(),
    })
}

fn matches(ops: &[Op], dst: &HostMemory, src: &HostMemory) -> bool {
    // SAFETY: called after every batch of the phase completed.
    let (d, s) = unsafe { (dst.as_slice(), src.as_slice()) };
    ops.iter().all(|o| {
        let (l, r, n) = (
            o.local_offset as usize,
            o.remote_offset as usize,
            o.len as usize,
        );
        d[l..l + n] == s[r..r + n]
    })
}

/// Keeps `concurrency` batches in flight for `slice`; returns GB/s.
async fn timed<F, Fut>(concurrency: usize, slice: Duration, batch: F) -> Result<f64>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<u64>> + Send + 'static,
{
    let start = Instant::now();
    let deadline = start + slice;
    let mut set = tokio::task::JoinSet::new();
    let mut bytes = 0u64;
    for i in 0..concurrency {
        set.spawn(batch(i));
    }
    while let Some(done) = set.join_next().await {
        bytes += done.map_err(|e| Error::io("bench task", std::io::Error::other(e)))??;
        if Instant::now() < deadline {
            set.spawn(batch(0));
        }
    }
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
}

pub fn table(r: &Report) -> String {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header([
        "path (tcp, loopback)",
        "block",
        "ops/batch",
        "rounds GB/s",
        "median GB/s",
    ]);
    let rounds = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    t.add_row(vec![
        "engine → engine".to_string(),
        kvfabric_proto::bytesize::human(r.block_size),
        r.blocks_per_batch.to_string(),
        rounds(&r.engine_gbps),
        format!("{:.2}", r.engine_median_gbps),
    ]);
    t.add_row(vec![
        "worker → agent → agent → worker".to_string(),
        kvfabric_proto::bytesize::human(r.block_size),
        r.blocks_per_batch.to_string(),
        rounds(&r.agent_gbps),
        format!("{:.2}", r.agent_median_gbps),
    ]);
    let tracing = if r.tracing {
        format!(
            "tracing on (100% sampled, OTLP to an in-process receiver): {} spans exported, {} dropped",
            r.spans_exported, r.spans_dropped
        )
    } else {
        "tracing off".into()
    };
    format!(
        "{t}\nthrough the agents: {:.1}% of engine only (target ≥ 95%); every byte verified: {}; {tracing}",
        r.ratio * 100.0,
        r.verified
    )
}
