//! The initiator: runs each row against a target reached through its control address. A row
//! alternates kvfabric and its bound over a few rounds (both see the same drift of this shared
//! machine), reports the median of each, then verifies every byte of both pools.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kvfabric_engine::{
    Batch, BlockOp, BlockPair, BlockTable, CudaPath, DataSecret, Engine, Location, Opcode, Peer,
    Plane, PlaneSide, Preference, RegionDesc, SegmentDescriptor, TransportKind,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::args::{CorruptArg, TransportArg};
use crate::bound::Bound;
use crate::control::{ControlClient, ControlExchange, Reply, Request};
use crate::error::{Error, Result};
use crate::pattern;
use crate::report::Row;
use crate::stats::{median, percentile};
use crate::verify::{Written, settle};
use kvfabric_proto::bytesize::human;

/// kvfabric and its bound take turns this many times within a row.
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
    pub location: Location,
    pub peer_location: Location,
    /// Half the slots pull and half push at once (`op` is then ignored).
    pub bidirectional: bool,
    /// Only labels the row; the engine was configured with it.
    pub cuda_path: CudaPath,
    /// Batches as block tables of this many planes (None: op lists). Each pool is cut into
    /// `planes` equal areas, one per plane, and a batch is `per_batch / planes` block-id pairs.
    pub planes: Option<u32>,
}

impl RowPlan {
    /// A single one-block batch in flight: the row measures latency, not bandwidth.
    pub fn is_latency(&self) -> bool {
        self.per_batch == 1 && self.concurrency == 1
    }

    /// Planes per batch (1 for op lists) and block ops per plane (a table's id pairs).
    fn shape(&self) -> (usize, usize) {
        let planes = self.planes.map_or(1, |p| p as usize);
        (planes, self.per_batch / planes)
    }

    /// How the row's batches are given: "ops" or "planes:N".
    pub fn layout(&self) -> String {
        match self.planes {
            None => "ops".into(),
            Some(n) => format!("planes:{n}"),
        }
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
        if self.bidirectional && !self.concurrency.is_multiple_of(2) {
            return Err(Error::config(
                "concurrency",
                self.concurrency,
                "--bidirectional needs an even number (half pull, half push)",
            ));
        }
        // The verifier compares whole blocks: a tail would be bytes no row writes and no check
        // names.
        if !self.pool_bytes.is_multiple_of(self.block_size) {
            return Err(Error::config(
                "pool-bytes",
                self.pool_bytes,
                format!("not a whole number of {} blocks", human(self.block_size)),
            ));
        }
        let (planes, pairs) = self.shape();
        if pairs == 0 || !self.per_batch.is_multiple_of(planes) {
            return Err(Error::config(
                "blocks-per-batch",
                self.per_batch,
                format!("must be a positive multiple of the layout's {planes} planes"),
            ));
        }
        // Block ids per plane (each plane owns an equal share of the pool).
        let blocks = self.pool_bytes / self.block_size / planes as u64;
        // Bidirectional rows read sources from the lower half of each pool and write into the
        // upper half, so neither direction overwrites what the other is still reading.
        let (room, need) = if self.bidirectional {
            (blocks / 2, (pairs * self.concurrency / 2) as u64)
        } else {
            (blocks, (pairs * self.concurrency) as u64)
        };
        if room < need {
            return Err(Error::config(
                "pool-bytes",
                self.pool_bytes,
                format!(
                    "holds {blocks} blocks of {} per plane, but {} batches in flight × {pairs} blocks need {need} distinct destination blocks",
                    human(self.block_size),
                    self.concurrency,
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
    /// The test hook `--test-corrupt`.
    pub corrupt: Option<CorruptArg>,
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
            corrupt: None,
        })
    }

    fn prepare(
        &mut self,
        plan: &RowPlan,
        seed: u64,
    ) -> Result<(SegmentDescriptor, RegionDesc, DataSecret)> {
        match self.control.call(&Request::Prepare {
            bytes: plan.pool_bytes,
            block_size: plan.block_size,
            seed,
            location: plan.peer_location,
        })? {
            Reply::Prepared {
                descriptor,
                region,
                secret,
            } => Ok((descriptor, region, secret)),
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
        let (descriptor, remote, secret) = self.prepare(plan, remote_seed)?;
        let local = pattern::alloc_pool(
            &self.engine,
            plan.location,
            plan.pool_bytes,
            plan.block_size,
            local_seed,
        )?;

        let preference = match plan.transport {
            TransportArg::Tcp => Preference::Only(TransportKind::Tcp),
            TransportArg::Shm => Preference::Only(TransportKind::Shm),
            TransportArg::CudaIpc => Preference::Only(TransportKind::CudaIpc),
            TransportArg::Rdma => Preference::Only(TransportKind::Rdma),
            TransportArg::Auto => Preference::Auto,
        };
        // Rdma connections are exchanged over the control channel.
        let exchange: Option<Arc<dyn kvfabric_engine::RdmaExchange>> =
            (plan.transport == TransportArg::Rdma).then(|| {
                Arc::new(ControlExchange {
                    addr: self.control_addr,
                    peer: self.engine.config().name.clone(),
                }) as Arc<dyn kvfabric_engine::RdmaExchange>
            });
        let peer = Arc::new(
            self.engine
                .connect_with(&descriptor, &secret, preference, plan.key, exchange)
                .await?,
        );
        let selection = peer.selection().clone();
        let mut label = match plan.transport {
            TransportArg::Auto => format!("auto→{}", selection.kind),
            _ => selection.kind.to_string(),
        };
        if selection.kind == TransportKind::CudaIpc {
            label = format!("{label} {}", plan.cuda_path);
        }
        let op_label = if plan.bidirectional {
            "bidir".to_string()
        } else {
            plan.op.to_string()
        };
        if !self.quiet {
            eprintln!(
                "{} {} {} × {} ({}): transport {} ({})",
                label,
                op_label,
                human(plan.block_size),
                plan.per_batch,
                plan.layout(),
                selection.kind,
                selection.reason
            );
        }

        let round = RowPlan {
            duration: plan.duration / ROUNDS as f64,
            ..plan.clone()
        };
        let own_buffer = self.control.buffer_size(self.engine.config().tcp_buffer);
        let mut bound = Bound::new(plan, selection.kind, &self.engine, own_buffer)?;
        let mut timed = Timed::default();
        let mut ours = Vec::new();
        for _ in 0..ROUNDS {
            let t = self
                .timed(&round, &peer, local.id(), &remote, &label)
                .await?;
            ours.push(t.bytes as f64 / t.seconds / 1e9);
            timed.absorb(t);
            tokio::task::block_in_place(|| bound.measure_round(self.control_addr, round.duration))?;
        }
        // A table's (destination id, source id) pairs hold for every plane's area.
        let (planes, _) = plan.shape();
        let per_plane = (plan.pool_bytes / plan.block_size / planes as u64) as u32;
        for written in [&mut timed.read_written, &mut timed.write_written] {
            if planes > 1 {
                *written = (0..planes as u32)
                    .flat_map(|p| written.iter().map(move |&(d, s)| (d, s, p)))
                    .map(|(d, s, p)| (p * per_plane + d, p * per_plane + s))
                    .collect();
            }
        }
        let row = format!("{label} {op_label} {}", human(plan.block_size));
        let written = Written {
            local: std::mem::take(&mut timed.read_written),
            remote: std::mem::take(&mut timed.write_written),
        };
        if let Some(what) = self.corrupt {
            self.corrupt(what, plan, &local, &remote, &written)?;
        }
        let verdicts = self.verify_pools(plan, &local, &remote, (local_seed, remote_seed), written);
        drop(peer);
        self.control.call(&Request::Release { region: remote.id })?;
        self.engine.deregister(local.id()).await?;
        let verified = settle(&row, verdicts?)?;

        let mut lat = timed.latencies;
        let p50 = percentile(&mut lat, 0.5).as_secs_f64() * 1e6;
        let p99 = percentile(&mut lat, 0.99).as_secs_f64() * 1e6;
        let gbps = median(&mut ours);
        let judged = bound.judge(gbps, p50);
        Ok(Row {
            transport: label,
            selection: selection.reason,
            op: op_label,
            layout: plan.layout(),
            block_size: plan.block_size,
            blocks_per_batch: plan.per_batch,
            ops_per_sec: (timed.batches * plan.per_batch as u64) as f64 / timed.seconds,
            concurrency: plan.concurrency,
            batches: timed.batches,
            bytes: timed.bytes,
            seconds: timed.seconds,
            gbps,
            p50_us: p50,
            p99_us: p99,
            verified,
            checksum: plan.checksum,
            ceiling_name: judged.best.name,
            ceiling_gbps: judged.best.gbps,
            ceiling_p50_us: judged.best.p50_us,
            ratio: judged.ratio,
            ceiling_bug: judged.ceiling_bug,
            other_bounds: judged.others,
            bound: judged.parts,
            same_shape: judged.same_shape,
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
        let (planes, pairs) = plan.shape();
        // Block ids per plane: the slots share these out as they would a pool's blocks.
        let blocks = (plan.pool_bytes / plan.block_size / planes as u64) as u32;
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
        // Every slot moves one untimed batch first (streams, pinned buffers, mappings, JIT are
        // set up then), and the clock starts when all of them have.
        let warmed = Arc::new(std::sync::Barrier::new(plan.concurrency));
        for k in 0..plan.concurrency {
            let warmed = warmed.clone();
            let peer = peer.clone();
            let moved = moved.clone();
            let plan = plan.clone();
            let remote_id = remote.id;
            let shape = SlotShape::of(&plan, k, blocks);
            let table_planes = plan
                .planes
                .map(|_| table_planes(planes, blocks, plan.block_size, local, remote_id));
            // Each slot is a plain thread that blocks on its batch: the engine's completing
            // thread wakes it directly, with no async scheduler in between.
            slots.push(tokio::task::spawn_blocking(move || {
                let mut rng = SmallRng::seed_from_u64(k as u64 + 1);
                // Each slot owns a disjoint share of destination blocks, so the final content
                // of every destination block is well defined.
                let mut mine: Vec<u32> = (shape.first_dest..blocks).step_by(shape.stride).collect();
                let mut latencies = Vec::new();
                // The slot's m-th destination block → the source block last written into it.
                // Indexed by m, not by block: a slot's share of a 12 GiB pool of 4 KiB blocks
                // then fits in cache, and recording a write costs no cache miss.
                let mut last: Vec<u32> = vec![u32::MAX; mine.len()];
                let mut batches = 0u64;
                let bs = plan.block_size;
                let mut ops = Vec::with_capacity(plan.per_batch);
                let mut pairs_of = Vec::with_capacity(pairs);
                let mut began: Option<Instant> = None;
                loop {
                    if let Some(t) = began
                        && t.elapsed() >= span
                    {
                        break;
                    }
                    for i in 0..pairs {
                        let j = rng.random_range(i..mine.len());
                        mine.swap(i, j);
                        let d = mine[i];
                        let s = rng.random_range(0..shape.sources);
                        last[shape.index_of(d)] = s;
                        let (lo, ro) = match shape.op {
                            Opcode::Read => (d, s),
                            Opcode::Write => (s, d),
                        };
                        if table_planes.is_some() {
                            pairs_of.push(BlockPair {
                                local: lo,
                                remote: ro,
                            });
                            continue;
                        }
                        ops.push(BlockOp {
                            local_region: local,
                            local_offset: lo as u64 * bs,
                            remote_region: remote_id,
                            remote_offset: ro as u64 * bs,
                            len: bs,
                        });
                    }
                    let t = Instant::now();
                    let batch = match &table_planes {
                        Some(planes) => Batch::table(
                            shape.op,
                            BlockTable {
                                planes: planes.clone(),
                                blocks: std::mem::replace(&mut pairs_of, Vec::with_capacity(pairs)),
                            },
                        ),
                        None => Batch::new(
                            shape.op,
                            std::mem::replace(&mut ops, Vec::with_capacity(plan.per_batch)),
                        ),
                    }
                    .with_checksum(plan.checksum);
                    let result = peer.run(batch);
                    if began.is_none() {
                        // Reach the barrier even on failure, or the other slots would wait forever.
                        warmed.wait();
                        result?;
                        began = Some(Instant::now());
                        continue;
                    }
                    let result = result?;
                    latencies.push(t.elapsed());
                    batches += 1;
                    moved.fetch_add(result.bytes, Ordering::Relaxed);
                }
                let ended = Instant::now();
                let written: Vec<(u32, u32)> = last
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| **s != u32::MAX)
                    .map(|(m, s)| (shape.block_at(m), *s))
                    .collect();
                let began = began.expect("set after the warm-up batch");
                Ok::<_, Error>((shape.op, batches, latencies, written, began, ended))
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
        let (mut first, mut last) = (None::<Instant>, None::<Instant>);
        for slot in slots {
            match slot.await {
                Ok(Ok((op, batches, lat, written, began, ended))) => {
                    first = Some(first.map_or(began, |f| f.min(began)));
                    last = Some(last.map_or(ended, |l| l.max(ended)));
                    timed.batches += batches;
                    timed.latencies.extend(lat);
                    match op {
                        Opcode::Read => timed.read_written.extend(written),
                        Opcode::Write => timed.write_written.extend(written),
                    }
                }
                Ok(Err(e)) => failure = Some(e),
                Err(e) => failure = Some(Error::io("bench slot", std::io::Error::other(e))),
            }
        }
        timed.seconds = match (first, last) {
            (Some(f), Some(l)) => (l - f).as_secs_f64(),
            _ => start.elapsed().as_secs_f64(),
        };
        ticker.abort();
        bar.finish_and_clear();
        if let Some(e) = failure {
            return Err(e);
        }
        timed.bytes = moved.load(Ordering::Relaxed);
        Ok(timed)
    }
}

/// The planes of a row's tables: plane `p` owns blocks `p × per_plane ..` of each pool, at the
/// same place on both sides.
fn table_planes(
    planes: usize,
    per_plane: u32,
    block: u64,
    local: kvfabric_engine::RegionId,
    remote: kvfabric_engine::RegionId,
) -> Vec<Plane> {
    (0..planes as u64)
        .map(|p| {
            let base = p * u64::from(per_plane) * block;
            Plane {
                local: PlaneSide {
                    region: local,
                    base,
                    stride: block,
                },
                remote: PlaneSide {
                    region: remote,
                    base,
                    stride: block,
                },
                block_bytes: block,
            }
        })
        .collect()
}

#[derive(Default)]
struct Timed {
    batches: u64,
    bytes: u64,
    seconds: f64,
    latencies: Vec<Duration>,
    /// (destination block, source block) pairs pulled into the local pool.
    read_written: Vec<(u32, u32)>,
    /// … and pushed into the target's pool.
    write_written: Vec<(u32, u32)>,
}

impl Timed {
    /// Adds a later round; its writes come after ours, so they win in the expectation.
    fn absorb(&mut self, later: Timed) {
        self.batches += later.batches;
        self.bytes += later.bytes;
        self.seconds += later.seconds;
        self.latencies.extend(later.latencies);
        self.read_written.extend(later.read_written);
        self.write_written.extend(later.write_written);
    }
}

/// Which blocks one slot writes and reads.
struct SlotShape {
    op: Opcode,
    /// The slot's destination blocks: first_dest, first_dest + stride, …
    first_dest: u32,
    stride: usize,
    /// Sources are drawn from blocks 0..sources.
    sources: u32,
}

impl SlotShape {
    /// The position of destination block `d` among the slot's.
    fn index_of(&self, d: u32) -> usize {
        ((d - self.first_dest) as usize) / self.stride
    }

    /// The slot's `m`-th destination block.
    fn block_at(&self, m: usize) -> u32 {
        self.first_dest + (m * self.stride) as u32
    }

    fn of(plan: &RowPlan, k: usize, blocks: u32) -> SlotShape {
        if plan.bidirectional {
            // Even slots pull, odd slots push; each direction writes only the upper half of its
            // destination pool and reads only the lower half of its source pool.
            let half = blocks / 2;
            let group = plan.concurrency / 2;
            SlotShape {
                op: if k.is_multiple_of(2) {
                    Opcode::Read
                } else {
                    Opcode::Write
                },
                first_dest: half + (k / 2) as u32,
                stride: group,
                sources: half,
            }
        } else {
            SlotShape {
                op: plan.op,
                first_dest: k as u32,
                stride: plan.concurrency,
                sources: blocks,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(concurrency: usize, bidirectional: bool) -> RowPlan {
        RowPlan {
            transport: TransportArg::Auto,
            op: Opcode::Read,
            block_size: 4096,
            per_batch: 8,
            concurrency,
            pool_bytes: 1 << 20,
            duration: 1.0,
            checksum: false,
            key: None,
            location: Location::Host { numa: None },
            peer_location: Location::Host { numa: None },
            bidirectional,
            cuda_path: CudaPath::Sm,
            planes: None,
        }
    }

    #[test]
    fn slots_own_disjoint_destinations_that_index_densely() {
        for (concurrency, bidirectional) in [(1, false), (3, false), (4, true), (6, true)] {
            let plan = plan(concurrency, bidirectional);
            let blocks = 256u32;
            // Pulls land in the local pool, pushes in the target's: one owner map per pool.
            let mut owner = [vec![None; blocks as usize], vec![None; blocks as usize]];
            for k in 0..concurrency {
                let pool = if bidirectional { k % 2 } else { 0 };
                let shape = SlotShape::of(&plan, k, blocks);
                let mine: Vec<u32> = (shape.first_dest..blocks).step_by(shape.stride).collect();
                for (m, &d) in mine.iter().enumerate() {
                    assert_eq!(
                        shape.index_of(d),
                        m,
                        "{concurrency} {bidirectional} slot {k}"
                    );
                    assert_eq!(shape.block_at(m), d);
                    if let Some(o) = owner[pool][d as usize].replace(k) {
                        panic!("block {d} owned by slots {o} and {k}");
                    }
                }
            }
        }
    }
}
