//! `kvfabric bench --through-agent`: the same pulls (or pushes, `--op write`), once engine to
//! engine and once worker → local agent → peer agent → worker memory (two agents in this process
//! on a shared in-memory registry, tcp on loopback), alternating rounds; with `--tls` a second
//! pair of agents with mTLS joins the rounds, so TLS is measured against plaintext in the same
//! run. Every destination byte is verified after each phase, the source pool at the end.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_engine::{AccessKey, Batch, BlockOp, Engine, EngineConfig, Preference, TransportKind};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::Serialize;
use tokio::sync::watch;

use crate::args::{BenchArgs, CorruptArg, OpArg};
use crate::error::{Error, Result};
use crate::pattern::{self, Expectation, Verdict};
use crate::stats::median;
use crate::verify::settle;
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, Op};
use kvfabric_testkit::InProcessAgent;

const ROUNDS: usize = 3;
/// Fills of the source pool and (the poison) of the destination.
const SOURCE_SEED: u64 = 7;
const POISON_SEED: u64 = 8;

#[derive(Debug, Serialize)]
pub struct Report {
    pub block_size: u64,
    pub blocks_per_batch: usize,
    pub concurrency: usize,
    /// read (pull) or write (push).
    pub op: &'static str,
    pub engine_gbps: Vec<f64>,
    pub agent_gbps: Vec<f64>,
    pub engine_median_gbps: f64,
    pub agent_median_gbps: f64,
    /// through the agents / engine only.
    pub ratio: f64,
    /// With `--tls`: the same through a pair of agents with mTLS on both ports.
    pub tls_gbps: Vec<f64>,
    pub tls_median_gbps: Option<f64>,
    /// mTLS / plaintext, both through the agents.
    pub tls_ratio: Option<f64>,
    /// AES-128-GCM (the suite the agents agree on) sealing 16 KiB records on one core, GB/s,
    /// measured in this run.
    pub aead_gbps: Option<f64>,
    /// What mTLS can reach here: the plaintext path's CPU time per byte plus one seal and one
    /// open per byte at `aead_gbps`, spread over every core (never above plaintext), GB/s.
    pub tls_bound_gbps: Option<f64>,
    /// With `--tls`: where the data port's records were sealed.
    pub tls_records: Option<String>,
    /// Bytes compared with what they must hold: the destination after every phase, the source
    /// at the end.
    pub verified: u64,
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

pub async fn run(
    args: &BenchArgs,
    telemetry: &Telemetry,
    block: u64,
    per_batch: usize,
) -> Result<Report> {
    if block == 0 {
        return Err(Error::config("block-size", 0, "must be positive"));
    }
    let batch_bytes = block * per_batch as u64;
    let pool = args.pool_bytes.max(batch_bytes);
    // The verifier compares whole blocks: a tail would be bytes no check names.
    if !pool.is_multiple_of(block) {
        return Err(Error::config(
            "pool-bytes",
            pool,
            format!(
                "not a whole number of {} blocks",
                kvfabric_proto::bytesize::human(block)
            ),
        ));
    }
    let blocks_in_pool = u32::try_from(pool / block)
        .map_err(|_| Error::config("pool-bytes", pool, "more than 2^32 blocks"))?;
    let src = HostMemory::alloc(pool)?;
    let dst = HostMemory::alloc(batch_bytes)?;
    // SAFETY: fresh memory, nothing transfers yet.
    pattern::fill_pool(SOURCE_SEED, block as usize, unsafe { src.as_mut_slice() });
    let mut places: Vec<u32> = (0..blocks_in_pool).collect();
    places.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(8));
    places.truncate(per_batch);
    let ops: Vec<Op> = places
        .iter()
        .enumerate()
        .map(|(i, &place)| Op {
            local_region: 0,
            local_offset: i as u64 * block,
            remote_region: 0,
            remote_offset: u64::from(place) * block,
            len: block,
        })
        .collect();
    // Destination block i must hold source block places[i] after every phase.
    let expectation = Expectation {
        block_size: block,
        source_seed: SOURCE_SEED,
        poison_seed: POISON_SEED,
        written: places
            .iter()
            .enumerate()
            .map(|(i, &p)| (i as u32, p))
            .collect(),
    };

    // Engine to engine.
    let engine_cfg = |name: &str| EngineConfig {
        name: name.into(),
        tcp_connections: args.connections,
        tcp_buffer: args.tcp_buffer,
        ..EngineConfig::default()
    };
    let target = Engine::new(engine_cfg("bench-engine-target"))?;
    let initiator = Engine::new(engine_cfg("bench-engine-initiator"))?;
    let write = args.op == Some(OpArg::Write);
    // The target holds the source for pulls, the destination for pushes.
    let (t_pool, i_pool) = if write { (&dst, &src) } else { (&src, &dst) };
    let t_mem = target.register_memfd(dup(t_pool)?, AccessKey::random())?;
    let i_mem = initiator.register_memfd(dup(i_pool)?, AccessKey::random())?;
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
        .map(|o| {
            let (local_offset, remote_offset) = if write {
                (o.remote_offset, o.local_offset)
            } else {
                (o.local_offset, o.remote_offset)
            };
            BlockOp {
                local_region: i_mem.id(),
                local_offset,
                remote_region: t_mem.id(),
                remote_offset,
                len: o.len,
            }
        })
        .collect();
    // A push goes from the prefill's pool: its ops name the source place locally.
    let push_ops: Vec<Op> = ops
        .iter()
        .map(|o| Op {
            local_offset: o.remote_offset,
            remote_offset: o.local_offset,
            ..*o
        })
        .collect();

    // Through two agents (and two more with mTLS).
    let (pairs, _tls_dir) = agent_pairs(args, telemetry, &src, &dst).await?;

    let slice = Duration::from_secs_f64((args.duration / ROUNDS as f64).max(0.5));
    let (mut engine_gbps, mut agent_gbps, mut tls_gbps) = (Vec::new(), Vec::new(), Vec::new());
    let mut verdicts: Vec<(String, Verdict)> = Vec::new();
    let poison = || {
        // SAFETY: no transfer in flight between phases.
        pattern::fill_pool(POISON_SEED, block as usize, unsafe { dst.as_mut_slice() });
    };
    let check = |phase: &str, round: usize| {
        // SAFETY: called after every batch of the phase completed.
        let verdict = expectation.verify(unsafe { dst.as_slice() });
        (
            format!("destination after {phase}, round {}", round + 1),
            verdict,
        )
    };
    for round in 0..ROUNDS {
        poison();
        let bytes = timed(args.concurrency, slice, |_| {
            let (peer, ops) = (peer.clone(), engine_ops.clone());
            let batch = if write {
                Batch::write(ops)
            } else {
                Batch::read(ops)
            };
            async move { Ok(peer.submit(batch)?.wait().await?.bytes) }
        })
        .await?;
        engine_gbps.push(bytes);
        verdicts.push(check("engine → engine", round));

        for (i, pair) in pairs.iter().enumerate() {
            poison();
            let bytes = timed(args.concurrency, slice, |_| {
                pair.batch(write, &ops, &push_ops)
            })
            .await?;
            if i == 0 {
                agent_gbps.push(bytes);
            } else {
                tls_gbps.push(bytes);
            }
            if round == 0 && i == 0 && args.test_corrupt == Some(CorruptArg::Destination) {
                corrupt(CorruptArg::Destination, &dst, block);
            }
            let path = if i == 0 {
                "the agents"
            } else {
                "the agents (mTLS)"
            };
            verdicts.push(check(path, round));
        }
    }
    if args.test_corrupt == Some(CorruptArg::Source) {
        corrupt(CorruptArg::Source, &src, block);
    }
    let _ = stop.send(true);
    for pair in pairs {
        let [a, b] = pair.agents;
        b.stop().await?;
        a.stop().await?;
    }
    let _ = serving.await;
    let source = Expectation {
        block_size: block,
        source_seed: SOURCE_SEED,
        poison_seed: SOURCE_SEED,
        written: Vec::new(),
    };
    // SAFETY: every transfer has ended.
    verdicts.push((
        "source pool".into(),
        source.verify(unsafe { src.as_slice() }),
    ));
    let verified = settle("through-agent (tcp, loopback)", verdicts)?;
    let rates = Rates {
        engine: engine_gbps,
        agents: agent_gbps,
        tls: tls_gbps,
    };
    Ok(report(args, telemetry, block, per_batch, rates, verified))
}

/// Each phase's rounds, GB/s.
struct Rates {
    engine: Vec<f64>,
    agents: Vec<f64>,
    tls: Vec<f64>,
}

/// The medians and ratios of the rounds; with mTLS, AES-GCM's rate measured now and the bound
/// it implies.
fn report(
    args: &BenchArgs,
    telemetry: &Telemetry,
    block: u64,
    per_batch: usize,
    rates: Rates,
    verified: u64,
) -> Report {
    let Rates {
        engine: engine_gbps,
        agents: agent_gbps,
        tls: tls_gbps,
    } = rates;
    let write = args.op == Some(OpArg::Write);
    let (e, a) = (
        median(&mut engine_gbps.clone()),
        median(&mut agent_gbps.clone()),
    );
    let t = (!tls_gbps.is_empty()).then(|| median(&mut tls_gbps.clone()));
    let aead = t.map(|_| kvfabric_engine::seal_gbps(Duration::from_millis(300)));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let bound = aead.map(|x| (1.0 / (1.0 / a + 2.0 / (x * cores))).min(a));
    Report {
        block_size: block,
        blocks_per_batch: per_batch,
        concurrency: args.concurrency,
        op: if write { "write" } else { "read" },
        engine_gbps,
        agent_gbps,
        engine_median_gbps: e,
        agent_median_gbps: a,
        ratio: a / e,
        tls_gbps,
        tls_median_gbps: t,
        tls_ratio: t.map(|t| t / a),
        aead_gbps: aead,
        tls_bound_gbps: bound,
        tls_records: t
            .map(|_| kvfabric_engine::RecordLayer::chosen(args.tls_kernel_records).describe()),
        verified,
        tracing: telemetry.tracing_enabled(),
        spans_exported: telemetry.counters.exported.get(),
        spans_dropped: telemetry.counters.dropped.get(),
    }
}

/// A pair of agents with plaintext ports and, with `--tls`, a pair with mTLS on both ports
/// (certificates of a throwaway CA, in the directory returned: the agents watch it until they
/// stop). The prefill's worker registers `src`, the decode's `dst`.
async fn agent_pairs(
    args: &BenchArgs,
    telemetry: &Telemetry,
    src: &HostMemory,
    dst: &HostMemory,
) -> Result<(Vec<Pair>, tempfile::TempDir)> {
    let store = MemoryStore::new();
    let tls_dir = tempfile::tempdir().map_err(|e| Error::io("tls dir", e))?;
    let tls = if args.tls {
        let ca = kvfabric_testkit::TestCa::new("kvfabric bench");
        let name = kvfabric_proto::contract::tls_server_name(
            "bench",
            kvfabric_proto::contract::DEFAULT_NAMESPACE,
        );
        ca.write_dir(tls_dir.path(), &ca.issue(&[&name]))?;
        Some(kvfabric_agent::peer_tls::PeerTls::from_dir(
            tls_dir.path(),
            &name,
        )?)
    } else {
        None
    };
    let config = |name: &str, tls: Option<kvfabric_agent::peer_tls::PeerTls>| {
        let mut c = InProcessAgent::config(name);
        c.fabric = "bench".into();
        c.transports = vec![TransportKind::Tcp];
        c.tcp_connections = args.connections;
        c.tcp_buffer = args.tcp_buffer;
        c.tls = tls;
        c.tls_kernel_records = args.tls_kernel_records;
        c
    };
    let mut pairs = Vec::new();
    for (suffix, tls) in [("", None)]
        .into_iter()
        .chain(tls.map(|t| ("-tls", Some(t))))
    {
        let a = InProcessAgent::start(
            config(&format!("bench-prefill{suffix}"), tls.clone()),
            store.registry(),
            telemetry.clone(),
        )
        .await?;
        let b = InProcessAgent::start(
            config(&format!("bench-decode{suffix}"), tls),
            store.registry(),
            telemetry.clone(),
        )
        .await?;
        let prefill = Client::connect(a.socket_dir()).await?;
        let decode = Client::connect(b.socket_dir()).await?;
        let src_name = format!("bench-kv-src{suffix}");
        let dst_name = format!("bench-kv-dst{suffix}");
        let p = prefill.register(&src_name, &[src], None).await?;
        let d = decode.register(&dst_name, &[dst], None).await?;
        pairs.push(Pair {
            agents: [a, b],
            prefill,
            decode,
            p,
            d,
            src_name,
            dst_name,
        });
    }
    Ok((pairs, tls_dir))
}

/// Two agents with a worker each: the prefill's holds the source pool, the decode's the
/// destination.
struct Pair {
    agents: [InProcessAgent; 2],
    prefill: Client,
    decode: Client,
    p: kvfabric_client::Segment,
    d: kvfabric_client::Segment,
    src_name: String,
    dst_name: String,
}

impl Pair {
    /// One batch: the decode pulls, or the prefill pushes.
    fn batch(
        &self,
        write: bool,
        ops: &[Op],
        push_ops: &[Op],
    ) -> impl Future<Output = Result<u64>> + Send + 'static {
        let (prefill, decode) = (self.prefill.clone(), self.decode.clone());
        let (p, d) = (self.p.clone(), self.d.clone());
        let (src_name, dst_name) = (self.src_name.clone(), self.dst_name.clone());
        let ops = if write {
            push_ops.to_vec()
        } else {
            ops.to_vec()
        };
        async move {
            let done = if write {
                prefill.write(&p, &dst_name, d.key, &ops).await?
            } else {
                decode.read(&d, &src_name, p.key, &ops).await?
            };
            Ok(done.bytes)
        }
    }
}

/// The test hook (`--test-corrupt`): `Destination` flips one byte of destination block 0 after
/// the first phase through the agents (every destination block is written here, so there is no
/// untouched one to write into); `Source` writes one byte into source block 0 after the last.
fn corrupt(what: CorruptArg, pool: &HostMemory, block: u64) {
    let (name, at) = match what {
        CorruptArg::Destination => ("destination", 1),
        CorruptArg::Source => ("source", 3),
    };
    let at = at.min(block - 1) as usize;
    // SAFETY: between phases; no transfer in flight.
    unsafe { pool.as_mut_slice()[at] ^= 0x5a };
    eprintln!("test hook (--test-corrupt): changed byte +{at} of {name} pool block 0");
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
    if let Some(m) = r.tls_median_gbps {
        t.add_row(vec![
            "the same, mTLS on both ports".to_string(),
            kvfabric_proto::bytesize::human(r.block_size),
            r.blocks_per_batch.to_string(),
            rounds(&r.tls_gbps),
            format!("{m:.2}"),
        ]);
    }
    let tracing = if r.tracing {
        format!(
            "tracing on (100% sampled, OTLP to an in-process receiver): {} spans exported, {} dropped",
            r.spans_exported, r.spans_dropped
        )
    } else {
        "tracing off".into()
    };
    let tls = match (
        r.tls_ratio,
        r.tls_median_gbps,
        r.tls_bound_gbps,
        r.aead_gbps,
    ) {
        (Some(x), Some(m), Some(bound), Some(aead)) => format!(
            "\nmTLS through the agents: {:.1}% of plaintext through the agents (target ≥ 80%); \
             {:.1}% of what {} cores can do ({bound:.2} GB/s: plaintext's CPU per byte plus one \
             seal and one open at {aead:.2} GB/s, AES-128-GCM on one core, measured now); {}",
            x * 100.0,
            m / bound * 100.0,
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            r.tls_records.as_deref().unwrap_or_default(),
        ),
        _ => String::new(),
    };
    format!(
        "{t}\n{}: through the agents {:.1}% of engine only (target ≥ 95%){tls}\nverified: {} (every byte of the destination after each phase, and of the source); {tracing}",
        r.op,
        r.ratio * 100.0,
        kvfabric_proto::bytesize::human(r.verified)
    )
}
