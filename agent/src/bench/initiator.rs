//! The initiator: runs each row against a target reached through its control address. A row
//! alternates kvfabric and its ceiling over a few rounds (both see the same drift of this shared
//! machine), reports the median of each, then verifies every destination byte.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kvfabric_engine::{
    Batch, BlockOp, Engine, Opcode, Peer, Preference, RegionDesc, SegmentDescriptor, TransportKind,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::ceiling::{self, Ceiling};
use super::control::{ControlClient, Reply, Request};
use super::pattern::{self, Expectation};
use super::report::Row;
use super::stats::percentile;
use crate::bytesize::human;
use crate::cli::TransportArg;
use crate::error::{Error, Result};

/// kvfabric and the ceiling take turns this many times within a row.
const ROUNDS: usize = 3;

#[derive(Debug, Clone)]
pub struct RowPlan {
    pub transport: TransportArg,
    pub op: Opcode,
    pub block_size: u64,
    pub per_batch: usize,
    pub concurrency: usize,
    pub pool_bytes: u64,
    pub duration: f64,
    pub checksum: bool,
    pub key: Option<u64>,
}

impl RowPlan {
    /// A single one-block batch in flight: the row measures latency, not bandwidth.
    pub fn is_latency(&self) -> bool {
        self.per_batch == 1 && self.concurrency == 1
    }

    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(Error::config("block-size", 0, "must be positive"));
        }
        if self.per_batch == 0 {
            return Err(Error::config("blocks-per-batch", 0, "must be positive"));
        }
        if self.concurrency == 0 {
            return Err(Error::config("concurrency", 0, "must be positive"));
        }
        if !(self.duration > 0.0 && self.duration.is_finite()) {
            return Err(Error::config(
                "duration",
                self.duration,
                "must be positive seconds",
            ));
        }
        let blocks = self.pool_bytes / self.block_size;
        let need = (self.per_batch * self.concurrency) as u64;
        if blocks < need {
            return Err(Error::config(
                "pool-bytes",
                self.pool_bytes,
                format!(
                    "holds {blocks} blocks of {}, but {} batches in flight × {} blocks need {need} distinct destination blocks",
                    human(self.block_size),
                    self.concurrency,
                    self.per_batch
                ),
            ));
        }
        if blocks > u32::MAX as u64 {
            return Err(Error::config(
                "pool-bytes",
                self.pool_bytes,
                "more than 2^32 blocks",
            ));
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct Initiator {
    pub engine: Engine,
    pub control_addr: SocketAddr,
    pub control: ControlClient,
    pub quiet: bool,
}

#[derive(Default)]
struct Timed {
    batches: u64,
    bytes: u64,
    seconds: f64,
    latencies: Vec<Duration>,
    written: Vec<(u32, u32)>,
}

impl Timed {
    /// Adds a later round; its writes come after ours, so they win in the expectation.
    fn absorb(&mut self, later: Timed) {
        self.batches += later.batches;
        self.bytes += later.bytes;
        self.seconds += later.seconds;
        self.latencies.extend(later.latencies);
        self.written.extend(later.written);
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What a row's ceiling needs, prepared once and measured once per round.
enum CeilingKit {
    /// Two private pools of the row's size: the memcpy must not touch the row's own memory.
    Memcpy {
        src: Vec<u8>,
        dst: Vec<u8>,
        block: usize,
        per_batch: usize,
    },
    PingPong {
        size: u64,
    },
    Stream(ceiling::StreamShape),
}

impl CeilingKit {
    fn new(
        plan: &RowPlan,
        kind: TransportKind,
        config: &kvfabric_engine::EngineConfig,
    ) -> Result<Self> {
        Ok(match kind {
            TransportKind::Shm => {
                let bs = plan.block_size as usize;
                // Real data on both sides: never copy from untouched zero pages.
                let mut src = vec![0u8; plan.pool_bytes as usize];
                pattern::fill_pool(5, bs, &mut src);
                let mut dst = vec![0u8; plan.pool_bytes as usize];
                pattern::fill_pool(6, bs, &mut dst);
                CeilingKit::Memcpy {
                    src,
                    dst,
                    block: bs,
                    per_batch: plan.per_batch,
                }
            }
            _ if plan.is_latency() => CeilingKit::PingPong {
                size: plan.block_size,
            },
            _ => CeilingKit::Stream(ceiling::StreamShape {
                towards_target: plan.op == Opcode::Write,
                streams: config.tcp_connections,
                pool_bytes: plan.pool_bytes,
                block_size: plan.block_size,
            }),
        })
    }

    async fn measure(&mut self, control: SocketAddr, secs: f64) -> Result<Ceiling> {
        let join = |e: tokio::task::JoinError| Error::io("ceiling", std::io::Error::other(e));
        match self {
            CeilingKit::Memcpy {
                src,
                dst,
                block,
                per_batch,
            } => Ok(tokio::task::block_in_place(|| {
                ceiling::memcpy(src, dst, *block, *per_batch, secs)
            })),
            CeilingKit::PingPong { size } => {
                let size = *size;
                tokio::task::spawn_blocking(move || ceiling::tcp_ping_pong(control, size, secs))
                    .await
                    .map_err(join)?
            }
            CeilingKit::Stream(shape) => {
                let shape = *shape;
                tokio::task::spawn_blocking(move || ceiling::tcp_stream(control, shape, secs))
                    .await
                    .map_err(join)?
            }
        }
    }
}

impl Initiator {
    pub fn new(engine: Engine, control_addr: SocketAddr, quiet: bool) -> Result<Self> {
        let mut control = ControlClient::connect(control_addr)?;
        match control.call(&Request::Hello)? {
            Reply::Segment { .. } => {}
            other => {
                return Err(Error::Control {
                    peer: control_addr.to_string(),
                    reason: format!("expected segment, got {other:?}"),
                });
            }
        }
        Ok(Initiator {
            engine,
            control_addr,
            control,
            quiet,
        })
    }

    fn prepare(&mut self, plan: &RowPlan, seed: u64) -> Result<(SegmentDescriptor, RegionDesc)> {
        match self.control.call(&Request::Prepare {
            bytes: plan.pool_bytes,
            block_size: plan.block_size,
            seed,
        })? {
            Reply::Prepared { descriptor, region } => Ok((descriptor, region)),
            other => Err(Error::Control {
                peer: self.control_addr.to_string(),
                reason: format!("expected prepared, got {other:?}"),
            }),
        }
    }

    pub async fn run_row(&mut self, plan: &RowPlan) -> Result<Row> {
        plan.validate()?;
        let mut seeds = SmallRng::from_os_rng();
        let (local_seed, remote_seed): (u64, u64) = (seeds.random(), seeds.random());
        let bs = plan.block_size as usize;
        let (descriptor, remote) = self.prepare(plan, remote_seed)?;
        let local = self.engine.alloc(plan.pool_bytes)?;
        // SAFETY: the region is new; no transfer uses it yet.
        pattern::fill_pool(local_seed, bs, unsafe { local.as_mut_slice() });

        let preference = match plan.transport {
            TransportArg::Tcp => Preference::Only(TransportKind::Tcp),
            TransportArg::Shm => Preference::Only(TransportKind::Shm),
            TransportArg::Auto => Preference::Auto,
        };
        let peer = Arc::new(
            self.engine
                .connect(&descriptor, preference, plan.key)
                .await?,
        );
        let selection = peer.selection().clone();
        let label = match plan.transport {
            TransportArg::Auto => format!("auto→{}", selection.kind),
            _ => selection.kind.to_string(),
        };
        if !self.quiet {
            eprintln!(
                "{} {} {} × {}: transport {} ({})",
                label,
                plan.op,
                human(plan.block_size),
                plan.per_batch,
                selection.kind,
                selection.reason
            );
        }

        let round = RowPlan {
            duration: plan.duration / ROUNDS as f64,
            ..plan.clone()
        };
        let mut ceiling_kit = CeilingKit::new(plan, selection.kind, self.engine.config())?;
        let mut timed = Timed::default();
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let t = self
                .timed(&round, &peer, local.id(), &remote, &label)
                .await?;
            ours.push(t.bytes as f64 / t.seconds / 1e9);
            timed.absorb(t);
            theirs.push(
                ceiling_kit
                    .measure(self.control_addr, round.duration)
                    .await?,
            );
        }
        drop(ceiling_kit);

        // Verify after the timed phase: every destination byte, written or not.
        let (source_seed, poison_seed) = match plan.op {
            Opcode::Read => (remote_seed, local_seed),
            Opcode::Write => (local_seed, remote_seed),
        };
        let expectation = Expectation {
            block_size: plan.block_size,
            source_seed,
            poison_seed,
            written: timed.written.clone(),
        };
        let verdict = match plan.op {
            // SAFETY: all batches have completed; nothing writes into the local pool now.
            Opcode::Read => expectation.verify(unsafe { local.as_slice() }),
            Opcode::Write => match self.control.call(&Request::Verify {
                region: remote.id,
                expectation,
            })? {
                Reply::Verified { verdict } => verdict,
                other => {
                    return Err(Error::Control {
                        peer: self.control_addr.to_string(),
                        reason: format!("expected verified, got {other:?}"),
                    });
                }
            },
        };
        drop(peer);
        self.control.call(&Request::Release { region: remote.id })?;

        self.engine.deregister(local.id()).await?;
        if verdict.mismatches > 0 {
            return Err(Error::Verify {
                row: format!("{label} {} {}", plan.op, human(plan.block_size)),
                mismatches: verdict.mismatches,
                first: verdict.first.unwrap_or_default(),
            });
        }

        let mut lat = timed.latencies;
        let p50 = percentile(&mut lat, 0.5).as_secs_f64() * 1e6;
        let p99 = percentile(&mut lat, 0.99).as_secs_f64() * 1e6;
        let gbps = median(&mut ours);
        let ceiling_gbps = median(&mut theirs.iter().map(|c| c.gbps).collect::<Vec<_>>());
        let ceiling_p50 = theirs
            .iter()
            .map(|c| c.p50_us)
            .collect::<Option<Vec<f64>>>()
            .map(|mut v| median(&mut v));
        let ratio = match ceiling_p50 {
            Some(c) => c / p50,
            None => gbps / ceiling_gbps,
        };
        Ok(Row {
            transport: label,
            selection: selection.reason,
            op: plan.op.to_string(),
            block_size: plan.block_size,
            blocks_per_batch: plan.per_batch,
            concurrency: plan.concurrency,
            batches: timed.batches,
            bytes: timed.bytes,
            seconds: timed.seconds,
            gbps,
            p50_us: p50,
            p99_us: p99,
            verified: true,
            checksum: plan.checksum,
            ceiling_name: theirs[0].name.clone(),
            ceiling_gbps,
            ceiling_p50_us: ceiling_p50,
            ratio,
        })
    }

    async fn timed(
        &self,
        plan: &RowPlan,
        peer: &Arc<Peer>,
        local: kvfabric_engine::RegionId,
        remote: &RegionDesc,
        label: &str,
    ) -> Result<Timed> {
        let blocks = (plan.pool_bytes / plan.block_size) as u32;
        let bar = if self.quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new((plan.duration * 1000.0) as u64)
        };
        bar.set_style(
            ProgressStyle::with_template("{prefix:>28} [{bar:30}] {elapsed:>3} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{label} {} {}", plan.op, human(plan.block_size)));
        let moved = Arc::new(AtomicU64::new(0));
        let span = Duration::from_secs_f64(plan.duration);
        let mut slots = Vec::new();
        let start = Instant::now();
        for k in 0..plan.concurrency {
            let peer = peer.clone();
            let moved = moved.clone();
            let plan = plan.clone();
            let remote_id = remote.id;
            // Each slot is a plain thread that blocks on its batch: the engine's completing
            // thread wakes it directly, with no async scheduler in between.
            slots.push(tokio::task::spawn_blocking(move || {
                let mut rng = SmallRng::seed_from_u64(k as u64 + 1);
                // Each slot owns a disjoint share of destination blocks, so the final content
                // of every destination block is well defined.
                let mut mine: Vec<u32> = (k as u32..blocks).step_by(plan.concurrency).collect();
                let mut latencies = Vec::new();
                let mut written: HashMap<u32, u32> = HashMap::new();
                let mut batches = 0u64;
                let bs = plan.block_size;
                while start.elapsed() < span {
                    for i in 0..plan.per_batch {
                        let j = rng.random_range(i..mine.len());
                        mine.swap(i, j);
                    }
                    let pairs: Vec<(u32, u32)> = mine[..plan.per_batch]
                        .iter()
                        .map(|&d| (d, rng.random_range(0..blocks)))
                        .collect();
                    let ops = pairs
                        .iter()
                        .map(|&(d, s)| {
                            let (lo, ro) = match plan.op {
                                Opcode::Read => (d, s),
                                Opcode::Write => (s, d),
                            };
                            BlockOp {
                                local_region: local,
                                local_offset: lo as u64 * bs,
                                remote_region: remote_id,
                                remote_offset: ro as u64 * bs,
                                len: bs,
                            }
                        })
                        .collect();
                    let t = Instant::now();
                    let batch = Batch::new(plan.op, ops).with_checksum(plan.checksum);
                    let result = peer.run(batch)?;
                    latencies.push(t.elapsed());
                    written.extend(pairs);
                    batches += 1;
                    moved.fetch_add(result.bytes, Ordering::Relaxed);
                }
                Ok::<_, Error>((batches, latencies, written))
            }));
        }
        let ticker = {
            let bar = bar.clone();
            let moved = moved.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let secs = start.elapsed().as_secs_f64();
                    bar.set_position((secs * 1000.0) as u64);
                    let gb = moved.load(Ordering::Relaxed) as f64 / 1e9;
                    bar.set_message(format!("{:.2} GB/s", gb / secs));
                }
            })
        };
        let mut timed = Timed::default();
        let mut failure = None;
        for slot in slots {
            match slot.await {
                Ok(Ok((batches, lat, written))) => {
                    timed.batches += batches;
                    timed.latencies.extend(lat);
                    timed.written.extend(written);
                }
                Ok(Err(e)) => failure = Some(e),
                Err(e) => failure = Some(Error::io("bench slot", std::io::Error::other(e))),
            }
        }
        timed.seconds = start.elapsed().as_secs_f64();
        ticker.abort();
        bar.finish_and_clear();
        if let Some(e) = failure {
            return Err(e);
        }
        timed.bytes = moved.load(Ordering::Relaxed);
        Ok(timed)
    }
}
