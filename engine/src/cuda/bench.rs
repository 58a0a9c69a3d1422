//! What only `kvfabric bench` (and the engine's GPU tests) use, behind the cargo feature
//! `bench-helpers`: the device pattern and its check, peer-copy ceilings, and the self-test.
//! Without `cuda` the functions exist and answer `Error::NoCudaDriver`.

use serde::{Deserialize, Serialize};

/// What `verify` found in a device pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceVerdict {
    pub bad_words: u64,
    /// Index of the first 8-byte word that differs.
    pub first_bad_word: Option<u64>,
}

/// What `selftest` checked.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SelftestReport {
    pub devices: (u32, u32),
    pub rounds: usize,
    pub copies: usize,
    pub bytes: u64,
    pub paths: Vec<String>,
}

/// Word `i` of block `b` of a pool filled from `seed` (the bench's device pattern; the same mix
/// as `kvf_word` in copy.cu).
pub fn pattern_word(seed: u64, b: u64, i: u64) -> u64 {
    let mut x = seed
        .wrapping_add(b.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(i.wrapping_mul(0xD1B5_4A32_D192_ED03));
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x
}

#[cfg(feature = "cuda")]
pub use imp::*;
#[cfg(not(feature = "cuda"))]
pub use stub::*;

#[cfg(feature = "cuda")]
mod imp {
    use std::ffi::c_void;
    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use cudarc::driver::sys;
    use rand::rngs::SmallRng;
    use rand::{Rng, RngCore, SeedableRng};

    use super::super::CudaPath;
    use super::super::driver::{self, Device, DeviceMem, Event, Stream, check, enable_peer};
    use super::super::lane::{DeviceCopy, Lane, LaneOptions, Work};
    use super::super::ops::region_device;
    use super::super::table_list::DevicePlane;
    use super::{DeviceVerdict, SelftestReport};
    use crate::block_table::BlockPair;
    use crate::error::{Error, Result};
    use crate::region::{Region, RegionId};

    /// One plane of a selftest table: (base, stride) on the source and destination buffers,
    /// block bytes, and the (source, destination) id pairs every plane of the table shares.
    struct TestPlane {
        src: (u64, u64),
        dst: (u64, u64),
        len: u64,
        ids: Vec<(u32, u32)>,
    }

    /// A random table over two buffers of `size` bytes: destination planes in areas of their
    /// own (so no two destination blocks meet), unaligned bases and strides, blocks from a byte
    /// to several 64 KiB kernel pieces; sources anywhere, ids drawn freely.
    fn random_table(rng: &mut SmallRng, size: u64) -> Vec<TestPlane> {
        let planes = rng.random_range(1..=40u64);
        let blocks = rng.random_range(1..=64u64);
        let area = size / planes;
        let most = (area / blocks - 64).min(200 << 10);
        let lens: Vec<u64> = (0..planes)
            .map(|_| match rng.random_range(0..3) {
                0 => 4096.min(most),
                1 => rng.random_range(1..=most.min(100)),
                _ => rng.random_range(1..=most),
            })
            .collect();
        // Destination ids: distinct, below what each plane's area holds.
        let dst_stride: Vec<u64> = lens.iter().map(|l| l + rng.random_range(0..64)).collect();
        // Less the base's offset of up to 15 bytes, so no plane reaches into the next area.
        let room = dst_stride
            .iter()
            .map(|s| (area - 16) / s)
            .min()
            .unwrap_or(1);
        let mut free: Vec<u32> = (0..room.min(1 << 20) as u32).collect();
        let mut ids = Vec::with_capacity(blocks as usize);
        for i in 0..blocks as usize {
            let j = rng.random_range(i..free.len());
            free.swap(i, j);
            ids.push(free[i]);
        }
        let sources = rng.random_range(1..=blocks as u32 * 2);
        let pairs: Vec<(u32, u32)> = ids
            .iter()
            .map(|&d| (rng.random_range(0..sources), d))
            .collect();
        (0..planes as usize)
            .map(|p| {
                let len = lens[p];
                let dst_base = p as u64 * area + rng.random_range(0..16);
                // A source stride that keeps its largest id inside the buffer.
                let src_stride = rng.random_range(0..=(size - len) / u64::from(sources));
                let span = u64::from(sources - 1) * src_stride + len;
                let src_base = rng.random_range(0..=size - span);
                TestPlane {
                    src: (src_base, src_stride),
                    dst: (dst_base, dst_stride[p]),
                    len,
                    ids: pairs.clone(),
                }
            })
            .collect()
    }

    /// The buffer `from` and the other one, the first to read, the second to write.
    fn pair_mut(host: &mut [Vec<u8>; 2], from: usize) -> (&Vec<u8>, &mut Vec<u8>) {
        let (x, y) = host.split_at_mut(1);
        if from == 0 {
            (&x[0], &mut y[0])
        } else {
            (&y[0], &mut x[0])
        }
    }

    fn whole_blocks(region: &Region, block_size: u64) -> Result<(u64, u64)> {
        if block_size == 0 || !block_size.is_multiple_of(8) {
            return Err(Error::InvalidConfig {
                field: "block_size",
                value: block_size.to_string(),
                reason: "device patterns need a positive multiple of 8 bytes",
            });
        }
        let blocks = region.len() / block_size;
        Ok((blocks, blocks * block_size / 8))
    }

    fn grid(dev: &Device) -> u32 {
        dev.sm_count * 4
    }

    /// Fills every whole block of a GPU region with the device pattern of `seed`.
    pub fn fill(region: &Arc<Region>, block_size: u64, seed: u64) -> Result<()> {
        let (dev, ptr) = region_device(region)?;
        let (_, words) = whole_blocks(region, block_size)?;
        let k = dev.kernels()?;
        let stream = Stream::new(dev)?;
        let (mut p, mut w, mut wpb, mut s) = (ptr, words, block_size / 8, seed);
        let mut params = [
            (&mut p as *mut u64).cast::<c_void>(),
            (&mut w as *mut u64).cast(),
            (&mut wpb as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
        ];
        // SAFETY: kvf_fill(u64*, u64, u64, u64); writes `words` words inside the region.
        unsafe { driver::launch(k.fill, grid(dev), stream.0, &mut params)? };
        // SAFETY: live stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.0)
        })
    }

    /// Checks every whole block of a GPU region: block `b` must hold source block `source_of[b]` of
    /// `source_seed`, or its own poison (`poison_seed`) where `source_of[b] == u32::MAX`.
    pub fn verify(
        region: &Arc<Region>,
        block_size: u64,
        source_of: &[u32],
        source_seed: u64,
        poison_seed: u64,
    ) -> Result<DeviceVerdict> {
        let (dev, ptr) = region_device(region)?;
        let (blocks, words) = whole_blocks(region, block_size)?;
        if (source_of.len() as u64) < blocks {
            return Err(Error::InvalidConfig {
                field: "source_of",
                value: source_of.len().to_string(),
                reason: "needs one entry per block of the region",
            });
        }
        let k = dev.kernels()?;
        let map = DeviceMem::alloc(dev, blocks.max(1) * 4)?;
        let bytes: Vec<u8> = source_of[..blocks as usize]
            .iter()
            .flat_map(|s| s.to_le_bytes())
            .collect();
        driver::copy_htod(dev, map.ptr, &bytes)?;
        let result = DeviceMem::alloc(dev, 16)?;
        let init: Vec<u8> = [0u64, u64::MAX]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        driver::copy_htod(dev, result.ptr, &init)?;
        let stream = Stream::new(dev)?;
        let (mut p, mut w, mut wpb, mut m, mut ss, mut ps, mut r) = (
            ptr,
            words,
            block_size / 8,
            map.ptr,
            source_seed,
            poison_seed,
            result.ptr,
        );
        let mut params = [
            (&mut p as *mut u64).cast::<c_void>(),
            (&mut w as *mut u64).cast(),
            (&mut wpb as *mut u64).cast(),
            (&mut m as *mut u64).cast(),
            (&mut ss as *mut u64).cast(),
            (&mut ps as *mut u64).cast(),
            (&mut r as *mut u64).cast(),
        ];
        // SAFETY: kvf_verify's seven parameters, all pointers to live device buffers of the sizes
        // the kernel reads.
        unsafe { driver::launch(k.verify, grid(dev), stream.0, &mut params)? };
        // SAFETY: live stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.0)
        })?;
        let mut out = [0u8; 16];
        driver::copy_dtoh(dev, &mut out, result.ptr)?;
        let bad = u64::from_le_bytes(out[..8].try_into().expect("8 bytes"));
        let first = u64::from_le_bytes(out[8..].try_into().expect("8 bytes"));
        Ok(DeviceVerdict {
            bad_words: bad,
            first_bad_word: (bad > 0).then_some(first),
        })
    }

    struct PeerPair {
        src: DeviceMem,
        dst: DeviceMem,
        stream: Stream,
    }

    fn peer_pair(dst: u32, src: u32, bytes: u64) -> Result<PeerPair> {
        let (d, s) = (driver::device(dst)?, driver::device(src)?);
        enable_peer(d, s)?;
        enable_peer(s, d)?;
        let src_mem = DeviceMem::alloc(s, bytes)?;
        let src_region = Arc::new(Region::cuda(
            RegionId(0),
            src,
            src_mem.ptr,
            bytes,
            None,
            None,
        )?);
        // Never time zeros: the source holds the bench pattern.
        fill(&src_region, 8, 0x5eed)?;
        Ok(PeerPair {
            src: src_mem,
            dst: DeviceMem::alloc(d, bytes)?,
            stream: Stream::new(d)?,
        })
    }

    impl PeerPair {
        fn copy(&self) -> Result<()> {
            self.copy_part(0, 0, self.src.len)
        }

        fn copy_part(&self, from: u64, to: u64, len: u64) -> Result<()> {
            debug_assert!(from + len <= self.src.len && to + len <= self.dst.len);
            // SAFETY: both ranges lie inside the buffers (callers pick them so), which live until
            // the stream is synchronized.
            check("cuMemcpyPeerAsync", unsafe {
                sys::cuMemcpyPeerAsync(
                    self.dst.ptr + to,
                    self.dst.device.ctx,
                    self.src.ptr + from,
                    self.src.device.ctx,
                    len as usize,
                    self.stream.0,
                )
            })
        }
        fn sync(&self) -> Result<()> {
            // SAFETY: live stream.
            check("cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(self.stream.0)
            })
        }
    }

    /// The ceiling of a cuda-ipc row: one contiguous cuMemcpyPeerAsync of `bytes` from `src` to `dst`,
    /// timed with events; the median of `iters` copies after a warm-up, in GB/s.
    pub fn peer_copy_gbps(dst: u32, src: u32, bytes: u64, iters: usize) -> Result<f64> {
        let pair = peer_pair(dst, src, bytes)?;
        let (start, end) = (
            Event::new(pair.dst.device, false, true)?,
            Event::new(pair.dst.device, false, true)?,
        );
        pair.copy()?;
        pair.sync()?;
        let mut ms = Vec::with_capacity(iters);
        for _ in 0..iters.max(1) {
            start.record(&pair.stream)?;
            pair.copy()?;
            end.record(&pair.stream)?;
            end.synchronize()?;
            ms.push(end.elapsed_ms(&start)? as f64);
        }
        ms.sort_by(f64::total_cmp);
        let median = ms[ms.len() / 2];
        Ok(bytes as f64 / (median / 1e3) / 1e9)
    }

    /// The ceiling of a latency row: one `bytes` cuMemcpyPeerAsync and a stream synchronize, from
    /// the host's point of view, between random `bytes`-aligned places of two `pool`-byte buffers
    /// (the row's own pattern: in a pool of many GiB each op also pays cold address translations);
    /// the median of `iters`, in µs.
    pub fn peer_copy_latency_us(
        dst: u32,
        src: u32,
        bytes: u64,
        pool: u64,
        iters: usize,
    ) -> Result<f64> {
        let pool = pool.max(bytes);
        let pair = peer_pair(dst, src, pool)?;
        let places = pool / bytes;
        let mut rng = SmallRng::seed_from_u64(0x1a7e);
        let mut lat: Vec<Duration> = Vec::with_capacity(iters);
        for i in 0..=iters.max(1) {
            let (from, to) = (
                rng.random_range(0..places) * bytes,
                rng.random_range(0..places) * bytes,
            );
            let t = Instant::now();
            pair.copy_part(from, to, bytes)?;
            pair.sync()?;
            // The first copy warms the stream up.
            if i > 0 {
                lat.push(t.elapsed());
            }
        }
        lat.sort();
        Ok(lat[lat.len() / 2].as_secs_f64() * 1e6)
    }

    /// Random copies of random lengths at random (mostly unaligned) offsets between two devices, in
    /// both directions and on both paths, each checked byte for byte against the same copies done on
    /// host mirrors; and block tables (random planes, unaligned bases and strides, blocks up to
    /// several kernel pieces) through the table kernel. Runs the transport's own machinery,
    /// without IPC (one process).
    pub fn selftest(devices: (u32, u32), rounds: usize, seed: u64) -> Result<SelftestReport> {
        const SIZE: usize = 16 << 20;
        let (a, b) = (driver::device(devices.0)?, driver::device(devices.1)?);
        enable_peer(a, b)?;
        enable_peer(b, a)?;
        let mut rng = SmallRng::seed_from_u64(seed);
        let mem = [
            DeviceMem::alloc(a, SIZE as u64)?,
            DeviceMem::alloc(b, SIZE as u64)?,
        ];
        let mut host = [vec![0u8; SIZE], vec![0u8; SIZE]];
        for (m, h) in mem.iter().zip(host.iter_mut()) {
            rng.fill_bytes(h);
            driver::copy_htod(m.device, m.ptr, h)?;
        }
        // The lanes of every completion mode: sleeping (no window, no doorbell), polling (the
        // default: a window, small batches of `run_here` through the doorbell) and spinning.
        let lane = Lane::new(
            a,
            LaneOptions {
                spin: false,
                poll: Duration::ZERO,
                doorbell_idle: Duration::ZERO,
            },
        )?;
        let polling = Lane::new(
            a,
            LaneOptions {
                spin: false,
                poll: Duration::from_micros(200),
                doorbell_idle: Duration::from_micros(500),
            },
        )?;
        let spinning = Lane::new(
            a,
            LaneOptions {
                spin: true,
                poll: Duration::from_micros(200),
                doorbell_idle: Duration::from_micros(500),
            },
        )?;
        let modes = [
            ("sm", &lane, CudaPath::Sm, false, 48usize),
            ("ce", &lane, CudaPath::Ce, false, 48),
            ("sm-doorbell", &polling, CudaPath::Sm, true, 5),
            ("sm-run-here", &polling, CudaPath::Sm, true, 48),
            ("sm-spin-doorbell", &spinning, CudaPath::Sm, true, 5),
        ];
        let tables = [
            ("sm-table", &lane, false),
            ("sm-table-run-here", &polling, true),
        ];
        let mut report = SelftestReport {
            devices,
            rounds,
            copies: 0,
            bytes: 0,
            paths: modes
                .iter()
                .map(|m| m.0.to_string())
                .chain(tables.iter().map(|t| t.0.to_string()))
                .collect(),
        };
        let check = |round: usize, path_name: &str, from: usize, to: usize, host: &[Vec<u8>; 2]| {
            for (i, (m, h)) in mem.iter().zip(host.iter()).enumerate() {
                let mut back = vec![0u8; SIZE];
                driver::copy_dtoh(m.device, &mut back, m.ptr)?;
                if let Some(at) = back.iter().zip(h.iter()).position(|(x, y)| x != y) {
                    return Err(Error::Cuda {
                        call: "gpu selftest",
                        code: format!(
                            "round {round}, path {path_name}, copy {from}→{to}: buffer {i} \
                             differs from its host mirror at byte {at}"
                        ),
                    });
                }
            }
            Ok(())
        };
        let wait = |lane: &Lane, work: Work<'_>, here: bool| -> Result<()> {
            // Counted small: run_here polls whatever the size (the selftest's batches are).
            let bytes = 0;
            let (tx, rx) = mpsc::channel();
            let done: super::super::lane::Done = Box::new(move |r| {
                let _ = tx.send(r);
            });
            if here {
                let deadline = Instant::now() + Duration::from_secs(10);
                lane.run_here(work, bytes, done, Vec::new(), deadline)?;
            } else {
                lane.submit(work, done, Vec::new())?;
            }
            rx.recv().map_err(|_| Error::ShuttingDown)?
        };
        for round in 0..rounds {
            for &(path_name, lane, path, here, most) in &modes {
                // 0 → 1 is a push from the lane's device, 1 → 0 a pull into it.
                for (from, to) in [(0usize, 1usize), (1, 0)] {
                    let k = rng.random_range(1..=most);
                    let slot = SIZE / k;
                    let mut copies = Vec::with_capacity(k);
                    for j in 0..k {
                        // Doorbell batches stay within its 64 KiB.
                        let max = if most <= 5 {
                            12 << 10
                        } else if rng.random_bool(0.3) {
                            64
                        } else {
                            slot / 2
                        };
                        let len = rng.random_range(1..=max.min(slot / 2));
                        let dst_off = j * slot + rng.random_range(0..slot - len);
                        let src_off = rng.random_range(0..SIZE - len);
                        copies.push(DeviceCopy {
                            src: mem[from].ptr + src_off as u64,
                            dst: mem[to].ptr + dst_off as u64,
                            len: len as u64,
                        });
                        let (src, dst) = pair_mut(&mut host, from);
                        dst[dst_off..dst_off + len].copy_from_slice(&src[src_off..src_off + len]);
                        report.bytes += len as u64;
                    }
                    report.copies += copies.len();
                    let hints = (mem[from].device.ordinal, mem[to].device.ordinal);
                    // Doorbell batches go one copy each, back to back: the kernel serves them while
                    // it lingers (and is relaunched for the next round, after the checks' pause).
                    let batches: Vec<&[DeviceCopy]> = if most <= 5 {
                        copies.chunks(1).collect()
                    } else {
                        vec![&copies[..]]
                    };
                    for batch in batches {
                        let work = Work::Copies {
                            path,
                            copies: batch,
                            hints,
                        };
                        wait(lane, work, here)?;
                    }
                    check(round, path_name, from, to, &host)?;
                }
            }
            for &(path_name, lane, here) in &tables {
                for (from, to) in [(0usize, 1usize), (1, 0)] {
                    let table = random_table(&mut rng, SIZE as u64);
                    // Local is the lane's side in name only: pulls copy remote → local.
                    let pull = rng.random_bool(0.5);
                    let (local, remote) = if pull { (to, from) } else { (from, to) };
                    let planes: Vec<DevicePlane> = table
                        .iter()
                        .map(|t| {
                            let (l, r) = if pull { (t.dst, t.src) } else { (t.src, t.dst) };
                            DevicePlane {
                                local: mem[local].ptr + l.0,
                                local_stride: l.1,
                                remote: mem[remote].ptr + r.0,
                                remote_stride: r.1,
                                len: t.len,
                            }
                        })
                        .collect();
                    let blocks: Vec<BlockPair> = table[0]
                        .ids
                        .iter()
                        .map(|&(s, d)| {
                            let (l, r) = if pull { (d, s) } else { (s, d) };
                            BlockPair {
                                local: l,
                                remote: r,
                            }
                        })
                        .collect();
                    let (src, dst) = pair_mut(&mut host, from);
                    for t in &table {
                        for &(s, d) in &t.ids {
                            let so = (t.src.0 + u64::from(s) * t.src.1) as usize;
                            let d_o = (t.dst.0 + u64::from(d) * t.dst.1) as usize;
                            let n = t.len as usize;
                            dst[d_o..d_o + n].copy_from_slice(&src[so..so + n]);
                        }
                        report.bytes += t.len * t.ids.len() as u64;
                        report.copies += t.ids.len();
                    }
                    let work = Work::Table {
                        planes: &planes,
                        blocks: &blocks,
                        pull,
                    };
                    wait(lane, work, here)?;
                    check(round, path_name, from, to, &host)?;
                }
            }
        }
        Ok(report)
    }
}

#[cfg(not(feature = "cuda"))]
mod stub {
    use std::sync::Arc;

    use super::{DeviceVerdict, SelftestReport};
    use crate::error::{Error, Result};
    use crate::region::Region;

    fn off<T>() -> Result<T> {
        Err(Error::NoCudaDriver {
            reason: "this build has no CUDA support (cargo feature `cuda` is off)".into(),
        })
    }

    pub fn fill(_region: &Arc<Region>, _block_size: u64, _seed: u64) -> Result<()> {
        off()
    }
    pub fn verify(
        _region: &Arc<Region>,
        _block_size: u64,
        _source_of: &[u32],
        _source_seed: u64,
        _poison_seed: u64,
    ) -> Result<DeviceVerdict> {
        off()
    }
    pub fn peer_copy_gbps(_dst: u32, _src: u32, _bytes: u64, _iters: usize) -> Result<f64> {
        off()
    }
    pub fn peer_copy_latency_us(
        _dst: u32,
        _src: u32,
        _bytes: u64,
        _pool: u64,
        _iters: usize,
    ) -> Result<f64> {
        off()
    }
    pub fn selftest(_devices: (u32, u32), _rounds: usize, _seed: u64) -> Result<SelftestReport> {
        off()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_words_differ_by_seed_block_and_word() {
        let a = pattern_word(1, 2, 3);
        assert_ne!(a, pattern_word(2, 2, 3));
        assert_ne!(a, pattern_word(1, 3, 3));
        assert_ne!(a, pattern_word(1, 2, 4));
        assert_eq!(a, pattern_word(1, 2, 3));
    }
}
