//! Driver-backed operations on GPU regions: allocation and registration, the bench's fill and
//! verify kernels, host copies for tests, the peer-copy ceiling, and the GPU self-test.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use super::driver::{self, Device, DeviceMem, Event, Stream, check, enable_peer};
use super::lane::{DeviceCopy, Lane};
use super::{CudaExport, CudaPath, DeviceVerdict, SelftestReport};
use crate::error::{Error, Result};
use crate::region::{Location, Region, RegionId};

pub fn device_count() -> Result<u32> {
    Ok(driver::driver()?.devices.len() as u32)
}

/// A dma-buf for the device memory `[ptr, ptr + len)` on `device`, so an RDMA device can
/// register it (`ibv_reg_dmabuf_mr`) without the nvidia-peermem module. The buffer covers the
/// page-aligned span around the range; the second value is `ptr`'s offset inside it.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn dmabuf(device: u32, ptr: u64, len: u64) -> Result<(std::os::fd::OwnedFd, u64)> {
    use std::os::fd::FromRawFd;
    let dev = driver::device(device)?;
    dev.bind()?;
    let mut handle = 0;
    // SAFETY: a valid out-pointer; the ordinal exists (device() checked it).
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut handle, device as i32)
    })?;
    let mut supported = 0;
    // SAFETY: as above.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut supported,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            handle,
        )
    })?;
    if supported == 0 {
        return Err(Error::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: format!("cuda:{device} does not support dma-buf export"),
        });
    }
    let page = rustix::param::page_size() as u64;
    let base = ptr & !(page - 1);
    let end = (ptr + len).div_ceil(page) * page;
    let mut fd: i32 = -1;
    // SAFETY: `fd` receives an int as the driver documents for DMA_BUF_FD; the range was
    // registered with the engine, so it is device memory of this context.
    check("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut i32).cast(),
            base,
            (end - base) as usize,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(Error::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: format!("returned fd {fd}"),
        });
    }
    // SAFETY: the driver just opened this fd for us; nothing else owns it.
    Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, ptr - base))
}

/// Every GPU the driver sees: name, PCI bus id and memory, for discovery and topology.
pub fn devices() -> Result<Vec<super::CudaDeviceInfo>> {
    let d = driver::driver()?;
    let text = |call: &'static str, buf: &[u8], r: sys::CUresult| -> Result<String> {
        check(call, r)?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    };
    let mut out = Vec::with_capacity(d.devices.len());
    for dev in &d.devices {
        let mut handle = 0;
        // SAFETY: a valid out-pointer; the ordinal came from cuDeviceGetCount at load.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut handle, dev.ordinal as i32)
        })?;
        let mut name = [0u8; 256];
        // SAFETY: the buffer is as long as the length passed; the driver NUL-terminates.
        let r =
            unsafe { sys::cuDeviceGetName(name.as_mut_ptr().cast(), name.len() as i32, handle) };
        let name = text("cuDeviceGetName", &name, r)?;
        let mut bus = [0u8; 32];
        // SAFETY: as above (a bus id is at most 13 bytes with its NUL).
        let r =
            unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr().cast(), bus.len() as i32, handle) };
        let pci_bus_id = text("cuDeviceGetPCIBusId", &bus, r)?;
        let mut bytes = 0usize;
        // SAFETY: a valid out-pointer and device handle.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut bytes, handle)
        })?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: a valid out-pointer and device handle.
        check("cuDeviceGetUuid", unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, handle)
        })?;
        out.push(super::CudaDeviceInfo {
            ordinal: dev.ordinal,
            name,
            pci_bus_id,
            memory_bytes: bytes as u64,
            uuid: super::uuid_text(uuid.bytes.map(|b| b as u8)),
        });
    }
    Ok(out)
}

pub(crate) fn alloc_region(id: RegionId, device: u32, len: u64) -> Result<Region> {
    let dev = driver::device(device)?;
    let mem = DeviceMem::alloc(dev, len)?;
    // Fresh device memory holds whatever the last user left; a region starts zeroed, as host
    // regions do.
    // SAFETY: the allocation is `len` bytes and the context is current (alloc bound it).
    check("cuMemsetD8", unsafe {
        sys::cuMemsetD8_v2(mem.ptr, 0, len as usize)
    })?;
    let export = mem
        .ipc_handle()
        .ok()
        .map(|handle| CudaExport { handle, offset: 0 });
    let ptr = mem.ptr;
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(mem);
    Region::cuda(id, device, ptr, len, export, Some(owner))
}

pub(crate) fn register_region(id: RegionId, device: u32, ptr: u64, len: u64) -> Result<Region> {
    let dev = driver::device(device)?;
    dev.bind()?;
    let not_ours = |reason: &'static str| Error::InvalidConfig {
        field: "ptr",
        value: format!("{ptr:#x}"),
        reason,
    };
    let mut ordinal: i32 = -1;
    // SAFETY: DEVICE_ORDINAL writes one int into the out-pointer.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(not_ours("not memory the CUDA driver knows"));
    }
    if ordinal != device as i32 {
        return Err(not_ours("memory of another device than the one given"));
    }
    let (base, size) = driver::allocation_of(dev, ptr)?;
    if ptr.checked_add(len).is_none_or(|end| end > base + size) {
        return Err(Error::InvalidConfig {
            field: "len",
            value: len.to_string(),
            reason: "extends past the end of the CUDA allocation",
        });
    }
    let export = driver::ipc_handle(dev, base).ok().map(|handle| CudaExport {
        handle,
        offset: ptr - base,
    });
    Region::cuda(id, device, ptr, len, export, None)
}

/// Maps another process's allocation (CUDA IPC) and wraps `export.offset..+len` of it. The
/// mapping's real size bounds the region, whatever the exporter claims.
pub(crate) fn import_region(
    id: RegionId,
    device: u32,
    export: CudaExport,
    len: u64,
) -> Result<Region> {
    let dev = driver::device(device)?;
    let imported = driver::Imported::open(dev, &export.handle).map_err(|e| match e {
        Error::Cuda { .. } => Error::InvalidIpcHandle {
            region: id,
            reason: format!("{e} (garbage, or the exporting process has exited)"),
        },
        other => other,
    })?;
    if export
        .offset
        .checked_add(len)
        .is_none_or(|end| end > imported.len)
    {
        return Err(Error::InvalidConfig {
            field: "len",
            value: format!("{}+{len}", export.offset),
            reason: "extends past the end of the exported allocation",
        });
    }
    let ptr = imported.base + export.offset;
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(imported);
    Region::cuda(id, device, ptr, len, Some(export), Some(owner))
}

fn region_device(region: &Region) -> Result<(&'static Device, u64)> {
    match (region.location(), region.device_ptr()) {
        (Location::Cuda { device }, Some(ptr)) => Ok((driver::device(device)?, ptr)),
        (location, _) => Err(Error::InvalidConfig {
            field: "region",
            value: format!("{} ({location})", region.id()),
            reason: "not a GPU region",
        }),
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

/// Copies `out.len()` bytes at `offset` of a GPU region to the host (tests, verification).
pub fn copy_to_host(region: &Region, offset: u64, out: &mut [u8]) -> Result<()> {
    let (dev, ptr) = region_device(region)?;
    region.range(0, "offset", offset, out.len() as u64)?;
    driver::copy_dtoh(dev, out, ptr + offset)
}

/// Copies `data` into a GPU region at `offset` (tests, setup).
pub fn copy_from_host(region: &Region, offset: u64, data: &[u8]) -> Result<()> {
    let (dev, ptr) = region_device(region)?;
    region.range(0, "offset", offset, data.len() as u64)?;
    driver::copy_htod(dev, ptr + offset, data)
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
/// host mirrors. Runs the transport's own machinery, without IPC (one process).
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
    let lane = Lane::new(a, false)?;
    // A spinning lane: small batches of `run_here` go through its doorbell, others are waited
    // for on the calling thread.
    let spinning = Lane::new(a, true)?;
    let modes = [
        ("sm", &lane, CudaPath::Sm, false, 48usize),
        ("ce", &lane, CudaPath::Ce, false, 48),
        ("sm-doorbell", &spinning, CudaPath::Sm, true, 5),
        ("sm-run-here", &spinning, CudaPath::Sm, true, 48),
    ];
    let mut report = SelftestReport {
        devices,
        rounds,
        copies: 0,
        bytes: 0,
        paths: modes.iter().map(|m| m.0.to_string()).collect(),
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
                    let (src, dst) = if from == 0 {
                        let (x, y) = host.split_at_mut(1);
                        (&x[0], &mut y[0])
                    } else {
                        let (x, y) = host.split_at_mut(1);
                        (&y[0], &mut x[0])
                    };
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
                    let (tx, rx) = mpsc::channel();
                    let done: super::lane::Done = Box::new(move |r| {
                        let _ = tx.send(r);
                    });
                    if here {
                        let deadline = Instant::now() + Duration::from_secs(10);
                        lane.run_here(path, batch, hints, done, Vec::new(), deadline)?;
                    } else {
                        lane.submit(path, batch, hints, done, Vec::new())?;
                    }
                    rx.recv().map_err(|_| Error::ShuttingDown)??;
                }
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
            }
        }
    }
    Ok(report)
}
