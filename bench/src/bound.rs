//! A row's bound: the best of the raw variants of its path — what kvfabric would reach if it cost
//! nothing — measured in the same run, taking turns with kvfabric. tcp: raw streams, 1…N of them,
//! on hot buffers; shm: memcpy of the row's pattern and contiguous memcpy, on as many threads as
//! the engine copies with; one small read: raw ping-pong, blocking and busy-polling. A ratio above
//! 100% means the bound is not the limit of the path: the row is flagged as a ceiling bug.
//!
//! A tcp row has a second limit: hot streams never touch DRAM, and kvfabric's pools live there.
//! The kernel copies every byte twice (into the socket buffer, out of it); those two copies
//! between pools of the row's size, on 1…2N threads with nothing else, bound the row too. The
//! row is judged against the lower of the two; the other stays beside it.

use std::net::SocketAddr;

use kvfabric_engine::{Engine, Location, Opcode, TransportKind};
use serde::Serialize;

use crate::ceiling::{self, Buffers, Ceiling, Flow, StreamShape};
use crate::error::Result;
use crate::initiator::RowPlan;
use crate::pattern;
use crate::stats::median;

/// Socket buffer sizes the raw streams try besides autotuning (and kvfabric's own): small ones
/// keep a same-host stream's bytes in the last-level cache between its two copies.
const SOCKET_BUFFERS: [u32; 3] = [64 << 10, 256 << 10, 1 << 20];

/// Each variant gets at least this long per round.
const MIN_PROBE_SECS: f64 = 0.1;

/// What a variant is the limit of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    /// The path itself, on memory that stays in the caches.
    Path,
    /// The copies the path must make between pools in DRAM.
    Memory,
}

/// The variants of one row's path, prepared once and each measured once per round.
pub struct Bound {
    probes: Vec<(Limit, Probe)>,
    /// The row's own shape without kvfabric: reported beside the bound, not part of it.
    same_shape: Option<Probe>,
    /// Two private pools of the row's size for the copy variants (never the row's own memory).
    pools: Option<(Vec<u8>, Vec<u8>)>,
    /// Per probe (the same-shape one last), one result per round.
    seen: Vec<Vec<Ceiling>>,
}

enum Probe {
    Memcpy {
        block: usize,
        per_batch: usize,
        threads: usize,
        contiguous: bool,
    },
    PingPong {
        size: u64,
        spin: bool,
    },
    Stream(StreamShape),
    /// The kernel's two copies of a tcp row's bytes, between the pools (`ceiling::scattered_copies`).
    TwoCopies {
        block: usize,
        per_batch: usize,
        threads: usize,
    },
    /// Rdma: the line rate of the engine's ports (sysfs `rate`), not measured here; the
    /// measured ceiling is perftest's `ib_write_bw`/`ib_read_bw` on the same NICs (docs/rdma.md).
    LineRate {
        name: String,
        gbps: f64,
    },
    /// The same bytes between the same GPUs as one contiguous peer copy (or, for a latency
    /// row, one small peer copy and its synchronisation).
    PeerCopy {
        dst: u32,
        src: u32,
        bytes: u64,
        /// Latency rows: (block size, pool size).
        latency: Option<(u64, u64)>,
    },
}

/// One variant's best round and what it is the limit of.
#[derive(Debug, Clone, Serialize)]
pub struct Part {
    pub limit: Limit,
    #[serde(flatten)]
    pub ceiling: Ceiling,
}

/// What a row is measured against.
#[derive(Debug, Clone, Serialize)]
pub struct Judged {
    /// The bound: the best variant of the tightest limit.
    pub best: Ceiling,
    /// The best variant of each other limit (a tcp row: the hot streams when the copies in DRAM
    /// are the lower), beside the bound.
    pub others: Vec<Ceiling>,
    /// Every variant, its best round.
    pub parts: Vec<Part>,
    pub same_shape: Option<Ceiling>,
    /// kvfabric / bound (latency: bound p50 / kvfabric p50).
    pub ratio: f64,
    /// kvfabric beat its bound: the bound does not bound.
    pub ceiling_bug: bool,
}

/// 1, 2, 4, … and `n` itself.
fn stream_counts(n: usize) -> Vec<usize> {
    (1..=n.max(1))
        .filter(|s| s.is_power_of_two() || *s == n)
        .collect()
}

/// Threads the two-copies variants try for `streams` streams: 1, 2, 4, … up to a sender and a
/// receiver per stream, or the machine's cores if fewer (more threads than cores copy no faster).
fn copy_threads(streams: usize, cores: usize) -> Vec<usize> {
    stream_counts((2 * streams).min(cores).max(1))
}

/// The hot raw streams a tcp row's bound takes the best of: 1…`n` streams, each with autotuned
/// buffers, each of `SOCKET_BUFFERS`, and kvfabric's own size.
fn stream_variants(flow: Flow, n: usize, own_buffer: Option<u32>) -> Vec<StreamShape> {
    let mut sizes: Vec<Option<u32>> = std::iter::once(None)
        .chain(SOCKET_BUFFERS.map(Some))
        .collect();
    if !sizes.contains(&own_buffer) {
        sizes.push(own_buffer);
    }
    stream_counts(n)
        .into_iter()
        .flat_map(|streams| {
            sizes.iter().map(move |&socket_buffer| StreamShape {
                flow,
                streams,
                buffers: Buffers::Hot,
                socket_buffer,
            })
        })
        .collect()
}

impl Bound {
    /// `own_buffer`: the socket buffers kvfabric's own tcp connections to the target get.
    pub fn new(
        plan: &RowPlan,
        kind: TransportKind,
        engine: &Engine,
        own_buffer: Option<u32>,
    ) -> Result<Self> {
        let config = engine.config();
        let mut pools = None;
        let mut same_shape = None;
        let probes = match kind {
            TransportKind::Rdma => {
                let nics = engine.rdma_devices()?;
                let known: Vec<f64> = nics.iter().filter_map(|n| n.rate_gbps).collect();
                vec![(
                    Limit::Path,
                    Probe::LineRate {
                        name: format!("line rate {}×NIC", nics.len()),
                        // Gb/s of the ports → GB/s like the rows; NaN (null in JSON) when unknown.
                        gbps: if known.len() == nics.len() {
                            known.iter().sum::<f64>() / 8.0
                        } else {
                            f64::NAN
                        },
                    },
                )]
            }
            TransportKind::CudaIpc => {
                let device = |l: Location| match l {
                    Location::Cuda { device } => device,
                    Location::Host { .. } => 0,
                };
                let (here, there) = (device(plan.location), device(plan.peer_location));
                let (dst, src) = match plan.op {
                    Opcode::Read if !plan.bidirectional => (here, there),
                    _ => (there, here),
                };
                vec![(
                    Limit::Path,
                    Probe::PeerCopy {
                        dst,
                        src,
                        bytes: plan.block_size * plan.per_batch as u64,
                        latency: plan
                            .is_latency()
                            .then_some((plan.block_size, plan.pool_bytes)),
                    },
                )]
            }
            TransportKind::Shm => {
                pools = Some(private_pools(plan));
                [false, true]
                    .map(|contiguous| {
                        let probe = Probe::Memcpy {
                            block: plan.block_size as usize,
                            per_batch: plan.per_batch,
                            threads: config.shm_threads,
                            contiguous,
                        };
                        (Limit::Path, probe)
                    })
                    .into()
            }
            _ if plan.is_latency() => [false, true]
                .map(|spin| {
                    let probe = Probe::PingPong {
                        size: plan.block_size,
                        spin,
                    };
                    (Limit::Path, probe)
                })
                .into(),
            _ => {
                let flow = if plan.bidirectional {
                    Flow::Both
                } else if plan.op == Opcode::Write {
                    Flow::ToTarget
                } else {
                    Flow::FromTarget
                };
                let n = config.tcp_connections;
                same_shape = Some(Probe::Stream(StreamShape {
                    flow,
                    streams: n,
                    buffers: Buffers::SameShape {
                        pool_bytes: plan.pool_bytes,
                        block_size: plan.block_size,
                    },
                    socket_buffer: own_buffer,
                }));
                pools = Some(private_pools(plan));
                let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
                let copies = copy_threads(n, cores).into_iter().map(|threads| {
                    let probe = Probe::TwoCopies {
                        block: plan.block_size as usize,
                        per_batch: plan.per_batch,
                        threads,
                    };
                    (Limit::Memory, probe)
                });
                stream_variants(flow, n, own_buffer)
                    .into_iter()
                    .map(|shape| (Limit::Path, Probe::Stream(shape)))
                    .chain(copies)
                    .collect()
            }
        };
        let seen = (0..probes.len() + same_shape.is_some() as usize)
            .map(|_| Vec::new())
            .collect();
        Ok(Bound {
            probes,
            same_shape,
            pools,
            seen,
        })
    }

    /// Measures every variant once, `secs` in all. Blocking.
    pub fn measure_round(&mut self, control: SocketAddr, secs: f64) -> Result<()> {
        let Bound {
            probes,
            same_shape,
            pools,
            seen,
        } = self;
        let each = (secs / seen.len() as f64).max(MIN_PROBE_SECS);
        let every = probes.iter().map(|(_, p)| p).chain(same_shape.iter());
        for (probe, runs) in every.zip(seen) {
            runs.push(probe.measure(control, pools, each)?);
        }
        Ok(())
    }

    /// Each variant's best round (the same-shape baseline's median) against kvfabric's `gbps`
    /// (or, for a latency row, its `p50_us`).
    pub fn judge(&self, gbps: f64, p50_us: f64) -> Judged {
        let (parts, rest) = self.seen.split_at(self.probes.len());
        let parts = self
            .probes
            .iter()
            .zip(parts)
            .map(|((limit, _), runs)| (*limit, best_round(runs)))
            .collect();
        judge(
            parts,
            rest.first().map(|runs| median_round(runs)),
            gbps,
            p50_us,
        )
    }
}

/// Two pools of the row's size holding real data (never untouched zero pages).
fn private_pools(plan: &RowPlan) -> (Vec<u8>, Vec<u8>) {
    let bs = plan.block_size as usize;
    let mut src = vec![0u8; plan.pool_bytes as usize];
    pattern::fill_pool(5, bs, &mut src);
    let mut dst = vec![0u8; plan.pool_bytes as usize];
    pattern::fill_pool(6, bs, &mut dst);
    (src, dst)
}

/// A variant's best round: the most GB/s, the fastest round trip. A bound is the limit of the
/// path, and on a shared machine a round that other work slowed is not that limit (the median
/// of short rounds fell below kvfabric's whole-run rate at a load of 10 on 2 cores).
fn best_round(runs: &[Ceiling]) -> Ceiling {
    Ceiling {
        name: runs[0].name.clone(),
        gbps: runs.iter().map(|c| c.gbps).fold(f64::NAN, f64::max),
        p50_us: runs
            .iter()
            .map(|c| c.p50_us)
            .collect::<Option<Vec<f64>>>()
            .map(|v| v.into_iter().fold(f64::NAN, f64::min)),
    }
}

fn median_round(runs: &[Ceiling]) -> Ceiling {
    Ceiling {
        name: runs[0].name.clone(),
        gbps: median(&mut runs.iter().map(|c| c.gbps).collect::<Vec<_>>()),
        p50_us: runs
            .iter()
            .map(|c| c.p50_us)
            .collect::<Option<Vec<f64>>>()
            .map(|mut v| median(&mut v)),
    }
}

/// Per limit, the best of its `parts` (the fastest round trip when they are round trips, else
/// the most GB/s); the bound is the tightest of those, and kvfabric's ratio is to it.
fn judge(
    parts: Vec<(Limit, Ceiling)>,
    same_shape: Option<Ceiling>,
    gbps: f64,
    p50_us: f64,
) -> Judged {
    let latency = parts.iter().all(|(_, p)| p.p50_us.is_some());
    let round_trip = |c: &Ceiling| c.p50_us.unwrap_or(f64::NAN);
    let mut limits: Vec<Ceiling> = [Limit::Path, Limit::Memory]
        .into_iter()
        .filter_map(|limit| {
            let of = parts.iter().filter(|(l, _)| *l == limit).map(|(_, c)| c);
            if latency {
                of.min_by(|a, b| round_trip(a).total_cmp(&round_trip(b)))
            } else {
                of.max_by(|a, b| a.gbps.total_cmp(&b.gbps))
            }
            .cloned()
        })
        .collect();
    // Tightest first: the slowest round trip, the fewest GB/s.
    if latency {
        limits.sort_by(|a, b| round_trip(b).total_cmp(&round_trip(a)));
    } else {
        limits.sort_by(|a, b| a.gbps.total_cmp(&b.gbps));
    }
    let mut limits = limits.into_iter();
    let best = limits.next().expect("every row has a bound");
    let ratio = match best.p50_us {
        Some(bound) if latency => bound / p50_us,
        _ => gbps / best.gbps,
    };
    Judged {
        best,
        others: limits.collect(),
        parts: parts
            .into_iter()
            .map(|(limit, ceiling)| Part { limit, ceiling })
            .collect(),
        same_shape,
        ratio,
        ceiling_bug: ratio > 1.0,
    }
}

impl Probe {
    fn measure(
        &self,
        control: SocketAddr,
        pools: &mut Option<(Vec<u8>, Vec<u8>)>,
        secs: f64,
    ) -> Result<Ceiling> {
        Ok(match self {
            Probe::Memcpy {
                block,
                per_batch,
                threads,
                contiguous,
            } => {
                let (src, dst) = pools.as_mut().expect("copy probes come with pools");
                if *contiguous {
                    ceiling::memcpy_contiguous(src, dst, *threads, secs)
                } else {
                    ceiling::scattered_copies(src, dst, *block, *per_batch, *threads, secs, false)
                }
            }
            Probe::LineRate { name, gbps } => Ceiling {
                name: name.clone(),
                gbps: *gbps,
                p50_us: None,
            },
            Probe::PingPong { size, spin } => ceiling::tcp_ping_pong(control, *size, *spin, secs)?,
            Probe::Stream(shape) => ceiling::tcp_stream(control, *shape, secs)?,
            Probe::TwoCopies {
                block,
                per_batch,
                threads,
            } => {
                let (src, dst) = pools.as_mut().expect("copy probes come with pools");
                ceiling::scattered_copies(src, dst, *block, *per_batch, *threads, secs, true)
            }
            Probe::PeerCopy {
                dst,
                src,
                bytes,
                latency,
            } => match *latency {
                Some((size, pool)) => {
                    let us =
                        kvfabric_engine::cuda::peer_copy_latency_us(*dst, *src, size, pool, 2000)?;
                    Ceiling {
                        name: "cuMemcpyPeerAsync+sync".into(),
                        gbps: size as f64 / us / 1e3,
                        p50_us: Some(us),
                    }
                }
                None => Ceiling {
                    name: "cuMemcpyPeerAsync contiguous".into(),
                    gbps: kvfabric_engine::cuda::peer_copy_gbps(*dst, *src, *bytes, 20)?,
                    p50_us: None,
                },
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(name: &str, gbps: f64, p50_us: Option<f64>) -> Ceiling {
        Ceiling {
            name: name.into(),
            gbps,
            p50_us,
        }
    }

    fn path(parts: &[Ceiling]) -> Vec<(Limit, Ceiling)> {
        parts.iter().map(|c| (Limit::Path, c.clone())).collect()
    }

    #[test]
    fn the_bound_is_the_best_variant_and_beating_it_is_flagged() {
        let parts = path(&[part("×1", 2.0, None), part("×2", 3.0, None)]);
        let j = judge(parts.clone(), Some(part("same", 1.0, None)), 2.7, 0.0);
        assert_eq!(j.best.name, "×2");
        assert!((j.ratio - 0.9).abs() < 1e-9);
        assert!(!j.ceiling_bug);
        assert_eq!(j.same_shape.unwrap().name, "same");
        let j = judge(parts, None, 3.3, 0.0);
        assert!(j.ceiling_bug, "{j:?}");
    }

    #[test]
    fn a_latency_bound_is_the_fastest_round_trip() {
        let parts = path(&[
            part("blocking", 0.3, Some(12.0)),
            part("busy", 0.4, Some(10.0)),
        ]);
        let j = judge(parts.clone(), None, 0.2, 12.5);
        assert_eq!(j.best.name, "busy");
        assert!((j.ratio - 0.8).abs() < 1e-9);
        assert!(!j.ceiling_bug);
        assert!(judge(parts, None, 0.5, 9.0).ceiling_bug);
    }

    #[test]
    fn a_tcp_row_is_judged_against_the_lower_of_its_two_limits() {
        let mut parts = path(&[part("hot ×1", 9.0, None), part("hot ×2", 13.0, None)]);
        parts.push((Limit::Memory, part("2 copies ×1", 6.0, None)));
        parts.push((Limit::Memory, part("2 copies ×2", 10.0, None)));
        let j = judge(parts.clone(), None, 8.0, 0.0);
        assert_eq!(j.best.name, "2 copies ×2");
        assert!((j.ratio - 0.8).abs() < 1e-9);
        assert_eq!(j.others.len(), 1);
        assert_eq!(j.others[0].name, "hot ×2");
        assert_eq!(j.parts.len(), 4);
        // Beating the lower limit is a ceiling bug even below the higher one.
        assert!(judge(parts.clone(), None, 11.0, 0.0).ceiling_bug);
        // The hot streams bound when they are the lower.
        parts.push((Limit::Memory, part("2 copies ×4", 20.0, None)));
        let j = judge(parts, None, 8.0, 0.0);
        assert_eq!(
            (j.best.name.as_str(), j.others[0].name.as_str()),
            ("hot ×2", "2 copies ×4")
        );
    }

    #[test]
    fn the_copies_try_a_sender_and_a_receiver_per_stream_up_to_the_cores() {
        assert_eq!(copy_threads(4, 2), [1, 2]);
        assert_eq!(copy_threads(4, 16), [1, 2, 4, 8]);
        assert_eq!(copy_threads(3, 16), [1, 2, 4, 6]);
        assert_eq!(copy_threads(1, 1), [1]);
    }

    #[test]
    fn each_variant_counts_its_best_round() {
        let rounds = [
            part("×1", 2.0, Some(14.0)),
            part("×1", 3.5, Some(12.0)),
            part("×1", 1.0, Some(50.0)),
        ];
        let best = best_round(&rounds);
        assert_eq!((best.gbps, best.p50_us), (3.5, Some(12.0)));
        let mid = median_round(&rounds);
        assert_eq!((mid.gbps, mid.p50_us), (2.0, Some(14.0)));
        let throughput = [part("×1", 2.0, None), part("×1", 4.0, None)];
        assert_eq!(best_round(&throughput).p50_us, None);
    }

    #[test]
    fn tcp_bounds_try_the_kernels_buffers_small_ones_and_kvfabrics_own() {
        let sizes = |own| {
            stream_variants(Flow::FromTarget, 2, own)
                .iter()
                .map(|s| (s.streams, s.socket_buffer))
                .collect::<Vec<_>>()
        };
        let k = 1 << 10;
        assert_eq!(
            sizes(Some(256 * k)),
            [
                (1, None),
                (1, Some(64 * k)),
                (1, Some(256 * k)),
                (1, Some(1024 * k)),
                (2, None),
                (2, Some(64 * k)),
                (2, Some(256 * k)),
                (2, Some(1024 * k))
            ]
        );
        assert_eq!(sizes(Some(8 * k)).len(), 10);
        assert!(sizes(Some(8 * k)).contains(&(2, Some(8 * k))));
        assert_eq!(sizes(None).len(), 8);
    }

    #[test]
    fn tcp_bounds_try_one_to_n_streams() {
        assert_eq!(stream_counts(1), [1]);
        assert_eq!(stream_counts(4), [1, 2, 4]);
        assert_eq!(stream_counts(6), [1, 2, 4, 6]);
    }
}
