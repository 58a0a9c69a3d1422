//! GPU memory: typed errors everywhere a GPU is missing or misused, and, on a machine with CUDA
//! devices, the copy machinery itself. Tests that need a device print "skipped: no CUDA device"
//! and pass elsewhere.

mod common;

use kvfabric_engine::cuda::{self, CudaExport, IpcHandle};
use kvfabric_engine::{
    Batch, BlockOp, Engine, EngineConfig, Error, Location, Preference, RegionDesc, RegionId,
    TransportKind,
};

/// The number of CUDA devices, or None (after saying so) when there is no driver or no device.
fn gpus(test: &str) -> Option<u32> {
    match cuda::device_count() {
        Ok(n) if n > 0 => Some(n),
        Ok(_) => {
            println!("{test}: skipped: no CUDA device");
            None
        }
        Err(e) => {
            println!("{test}: skipped: no CUDA device ({e})");
            None
        }
    }
}

#[test]
fn without_a_driver_gpu_calls_are_typed_errors_not_panics() {
    let engine = Engine::new(common::config("no-driver")).unwrap();
    match cuda::device_count() {
        Err(Error::NoCudaDriver { reason }) => {
            assert!(!reason.is_empty());
            let err = engine.alloc_cuda(0, 4096).unwrap_err();
            assert!(matches!(err, Error::NoCudaDriver { .. }), "{err}");
            assert!(err.to_string().starts_with("no CUDA driver"), "{err}");
            // SAFETY: refused before the pointer is used.
            let err = unsafe { engine.register_cuda(0, 0x1000, 4096) }.unwrap_err();
            assert!(matches!(err, Error::NoCudaDriver { .. }), "{err}");
        }
        Ok(n) => println!("driver present with {n} devices: the no-driver path is not reachable"),
        Err(other) => panic!("expected NoCudaDriver, got {other}"),
    }
}

#[test]
fn devices_lists_every_gpu_with_its_bus_id_and_memory() {
    match cuda::devices() {
        Err(Error::NoCudaDriver { reason }) => {
            println!("skipped: no CUDA device ({reason})");
        }
        Err(other) => panic!("expected a list or NoCudaDriver, got {other}"),
        Ok(list) => {
            assert_eq!(list.len() as u32, cuda::device_count().unwrap());
            for (i, g) in list.iter().enumerate() {
                assert_eq!(g.ordinal, i as u32);
                assert!(!g.name.is_empty(), "{g:?}");
                assert!(g.memory_bytes > 0, "{g:?}");
                // "00000000:3B:00.0": domain, bus, device.function.
                assert_eq!(g.pci_bus_id.matches(':').count(), 2, "{g:?}");
                assert!(g.pci_bus_id.contains('.'), "{g:?}");
                println!("{g:?}");
            }
        }
    }
}

#[test]
fn a_region_on_a_device_that_does_not_exist_is_refused() {
    let engine = Engine::new(common::config("no-device")).unwrap();
    let err = engine.alloc_cuda(977, 4096).unwrap_err();
    match err {
        Error::NoSuchDevice { device, count } => {
            assert_eq!(device, 977);
            assert!(
                err.to_string()
                    .contains(&format!("this machine has {count}"))
            );
        }
        Error::NoCudaDriver { .. } => {}
        other => panic!("expected NoSuchDevice or NoCudaDriver, got {other}"),
    }
    let err = engine.alloc_cuda(0, 0).unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig { field: "len", .. }),
        "{err}"
    );
}

#[test]
fn a_device_pointer_outside_every_registered_region_is_refused() {
    let engine = Engine::new(common::config("locate")).unwrap();
    let host = engine.alloc(8192).unwrap();
    let err = engine
        .locate(Location::Cuda { device: 0 }, 0x7f00_0000_1000, 4096)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnregisteredPointer {
                ptr: 0x7f00_0000_1000,
                len: 4096,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("cuda:0"), "{err}");
    // A host pointer inside a region resolves to that region and offset.
    // SAFETY: only the address is taken.
    let base = unsafe { host.as_slice() }.as_ptr() as u64;
    let here = Location::Host { numa: None };
    assert_eq!(
        engine.locate(here, base + 100, 50).unwrap(),
        (host.id(), 100)
    );
    let err = engine.locate(here, base + 8000, 500).unwrap_err();
    assert!(matches!(err, Error::UnregisteredPointer { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_over_tcp_without_staging_is_a_typed_error() {
    let target = common::target(common::config("staging-target")).await;
    let remote_host = target.engine.alloc(1 << 20).unwrap();
    let initiator = Engine::new(EngineConfig {
        staging_bytes: 0,
        ..common::config("staging-init")
    })
    .unwrap();
    let local = initiator.alloc(1 << 20).unwrap();
    let peer = initiator
        .connect(
            &target.engine.descriptor(),
            target.engine.data_secret(),
            Preference::Only(TransportKind::Tcp),
            None,
        )
        .await
        .unwrap();
    // The peer publishes a GPU region (as a prefill worker would).
    let mut d = peer.descriptor();
    d.regions.push(RegionDesc {
        id: RegionId(4242),
        len: 1 << 20,
        location: Location::Cuda { device: 1 },
        key: d.regions[0].key,
        shareable: false,
        ipc: None,
        rdma: Vec::new(),
    });
    peer.set_descriptor(d);
    let op = |remote| BlockOp {
        local_region: local.id(),
        local_offset: 0,
        remote_region: remote,
        remote_offset: 0,
        len: 4096,
    };
    let err = peer
        .submit(Batch::write(vec![op(RegionId(4242))]))
        .unwrap_err();
    match &err {
        Error::StagingNotConfigured {
            op: 0,
            region: RegionId(4242),
            location: Location::Cuda { device: 1 },
            transport: TransportKind::Tcp,
        } => {}
        other => panic!("expected StagingNotConfigured, got {other}"),
    }
    assert!(err.to_string().contains("staging"), "{err}");
    // Host to host on the same peer still works.
    peer.submit(Batch::write(vec![op(remote_host.id())]))
        .unwrap()
        .wait()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_ipc_handle_is_a_typed_error() {
    let Some(_) = gpus("a_garbage_ipc_handle_is_a_typed_error") else {
        return;
    };
    let engine = Engine::new(common::config("ipc-garbage")).unwrap();
    let local = engine.alloc_cuda(0, 1 << 20).unwrap();
    let mut d = engine.descriptor();
    d.name = "ghost".into();
    d.regions = vec![RegionDesc {
        id: RegionId(7),
        len: 1 << 20,
        location: Location::Cuda { device: 0 },
        key: kvfabric_engine::AccessKey(1),
        shareable: false,
        ipc: Some(CudaExport {
            handle: IpcHandle([0x5a; 64]),
            offset: 0,
        }),
        rdma: Vec::new(),
    }];
    let peer = engine
        .connect(
            &d,
            &kvfabric_engine::DataSecret::random(),
            Preference::Only(TransportKind::CudaIpc),
            None,
        )
        .await
        .unwrap();
    let result = peer
        .submit(Batch::read(vec![BlockOp {
            local_region: local.id(),
            local_offset: 0,
            remote_region: RegionId(7),
            remote_offset: 0,
            len: 4096,
        }]))
        .unwrap()
        .wait()
        .await;
    let err = result.unwrap_err();
    assert!(err.to_string().contains("region 7"), "{err}");
    assert!(err.to_string().contains("IPC"), "{err}");
}

#[test]
fn gpu_regions_fill_verify_and_copy_to_the_host() {
    let Some(_) = gpus("gpu_regions_fill_verify_and_copy_to_the_host") else {
        return;
    };
    let engine = Engine::new(common::config("fill")).unwrap();
    let r = engine.alloc_cuda(0, 1 << 20).unwrap();
    assert_eq!(r.location(), Location::Cuda { device: 0 });
    assert!(
        r.cuda_export().is_some(),
        "cuMemAlloc memory exports an IPC handle"
    );
    cuda::fill(&r, 4096, 99).unwrap();
    let blocks = (1 << 20) / 4096;
    let poison = vec![u32::MAX; blocks];
    assert_eq!(cuda::verify(&r, 4096, &poison, 1, 99).unwrap().bad_words, 0);
    let mut word = [0u8; 8];
    cuda::copy_to_host(&r, 4096 + 16, &mut word).unwrap();
    assert_eq!(u64::from_le_bytes(word), cuda::pattern_word(99, 1, 2));
    cuda::copy_from_host(&r, 4096 + 16, &[0xff; 8]).unwrap();
    let v = cuda::verify(&r, 4096, &poison, 1, 99).unwrap();
    assert_eq!(v.bad_words, 1);
    assert_eq!(v.first_bad_word, Some(512 + 2));
    let err = cuda::copy_to_host(&r, (1 << 20) - 4, &mut word).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
}

#[test]
fn gpu_selftest_random_sizes_and_unaligned_offsets_both_directions() {
    let Some(n) = gpus("gpu_selftest_random_sizes_and_unaligned_offsets_both_directions") else {
        return;
    };
    let report = cuda::selftest((0, n.min(2) - 1), 3, 7).unwrap();
    assert!(report.copies > 0);
}

// ---- GPU memory over tcp and shm, staged through pinned host buffers ----

use std::sync::Arc;
use std::time::Duration;

use kvfabric_engine::{AccessKey, Opcode, Peer, Region};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

/// Staging of 40 000 bytes: two slots of 20 000, so payloads cross unit, chunk (64 KiB) and
/// piece boundaries at odd places.
fn staged(name: &str) -> EngineConfig {
    EngineConfig {
        staging_bytes: 40_000,
        ..common::config(name)
    }
}

/// A region (host or GPU) and a host mirror of what it must hold.
struct Mirrored {
    region: Arc<Region>,
    mirror: Vec<u8>,
}

impl Mirrored {
    fn new(engine: &Engine, location: Location, len: usize, seed: u64) -> Mirrored {
        let mut mirror = vec![0u8; len];
        SmallRng::seed_from_u64(seed).fill_bytes(&mut mirror);
        let region = match location {
            Location::Cuda { device } => {
                let r = engine.alloc_cuda(device, len as u64).unwrap();
                cuda::copy_from_host(&r, 0, &mirror).unwrap();
                r
            }
            Location::Host { .. } => {
                let r = engine.alloc(len as u64).unwrap();
                // SAFETY: new region, no transfers yet.
                unsafe { r.as_mut_slice() }.copy_from_slice(&mirror);
                r
            }
        };
        Mirrored { region, mirror }
    }

    fn actual(&self) -> Vec<u8> {
        match self.region.location() {
            Location::Cuda { .. } => {
                let mut out = vec![0u8; self.mirror.len()];
                cuda::copy_to_host(&self.region, 0, &mut out).unwrap();
                out
            }
            Location::Host { .. } => common::bytes(&self.region),
        }
    }

    fn assert_exact(&self, what: &str) {
        let got = self.actual();
        assert_eq!(got.len(), self.mirror.len());
        if let Some(at) = got.iter().zip(&self.mirror).position(|(a, b)| a != b) {
            panic!(
                "{what}: {} region differs from its mirror at byte {at}",
                self.region.location()
            );
        }
    }
}

/// One op of a phase: (local region index, local offset, remote offset, len).
type PhaseOp = (usize, usize, usize, usize);

/// Walks `len` bytes placing ops of random sizes (mostly small, some spanning many units and
/// chunks) at unaligned offsets with random gaps: disjoint destinations.
fn places(rng: &mut SmallRng, len: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = rng.random_range(0..64);
    loop {
        let want = if rng.random_bool(0.15) {
            rng.random_range(1..300_000)
        } else if rng.random_bool(0.3) {
            rng.random_range(1..64)
        } else {
            rng.random_range(1..24_000)
        };
        if at + want > len {
            break;
        }
        out.push((at, want));
        at += want + rng.random_range(0..100);
    }
    out
}

/// Random ops with destinations disjoint across the whole phase, shuffled into `batches` batches
/// that are all in flight at once (every fourth with checksums; the last carried by a blocked
/// thread through `Peer::run`); then the mirrors are updated the same way.
async fn phase(
    peer: &Arc<Peer>,
    opcode: Opcode,
    locals: &mut [Mirrored],
    remote: &mut Mirrored,
    rng: &mut SmallRng,
    batches: usize,
) -> usize {
    let mut ops: Vec<PhaseOp> = Vec::new();
    match opcode {
        Opcode::Read => {
            for (i, l) in locals.iter().enumerate() {
                for (at, len) in places(rng, l.mirror.len()) {
                    ops.push((i, at, rng.random_range(0..=remote.mirror.len() - len), len));
                }
            }
        }
        Opcode::Write => {
            for (at, len) in places(rng, remote.mirror.len()) {
                let i = rng.random_range(0..locals.len());
                if len > locals[i].mirror.len() {
                    continue;
                }
                ops.push((
                    i,
                    rng.random_range(0..=locals[i].mirror.len() - len),
                    at,
                    len,
                ));
            }
        }
    }
    for i in (1..ops.len()).rev() {
        let j = rng.random_range(0..=i);
        ops.swap(i, j);
    }
    let mut groups: Vec<Vec<BlockOp>> = vec![Vec::new(); batches];
    for (k, &(i, lo, ro, len)) in ops.iter().enumerate() {
        groups[k % batches].push(BlockOp {
            local_region: locals[i].region.id(),
            local_offset: lo as u64,
            remote_region: remote.region.id(),
            remote_offset: ro as u64,
            len: len as u64,
        });
    }
    let mut handles = Vec::new();
    let mut blocked = None;
    for (b, group) in groups.into_iter().enumerate() {
        if group.is_empty() {
            continue;
        }
        let batch = Batch::new(opcode, group).with_checksum(b % 4 == 1);
        if b + 1 == batches {
            let peer = peer.clone();
            blocked = Some(tokio::task::spawn_blocking(move || peer.run(batch)));
        } else {
            handles.push(peer.submit(batch).unwrap());
        }
    }
    for h in handles {
        h.wait().await.unwrap();
    }
    if let Some(b) = blocked {
        b.await.unwrap().unwrap();
    }
    for &(i, lo, ro, len) in &ops {
        match opcode {
            Opcode::Read => {
                locals[i].mirror[lo..lo + len].copy_from_slice(&remote.mirror[ro..ro + len])
            }
            Opcode::Write => {
                remote.mirror[ro..ro + len].copy_from_slice(&locals[i].mirror[lo..lo + len])
            }
        }
    }
    ops.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_over_tcp_and_shm_is_staged_and_every_byte_arrives() {
    let Some(n) = gpus("gpu_memory_over_tcp_and_shm_is_staged_and_every_byte_arrives") else {
        return;
    };
    let host = Location::Host { numa: None };
    let other = Location::Cuda {
        device: n.min(2) - 1,
    };
    // (transport, where the target's region lives, staging bytes on both sides)
    let cases = [
        (TransportKind::Tcp, host, 40_000),
        (TransportKind::Tcp, other, 40_000),
        (TransportKind::Tcp, other, 8 << 20),
        (TransportKind::Tcp, host, 3 << 20),
        (TransportKind::Shm, host, 40_000),
    ];
    for (round, (kind, remote_at, staging_bytes)) in cases.into_iter().enumerate() {
        let config = |name: &str| EngineConfig {
            staging_bytes,
            ..staged(name)
        };
        let target = common::target(config("stg-target")).await;
        let initiator = Engine::new(config("stg-init")).unwrap();
        let mut rng = SmallRng::seed_from_u64(round as u64 + 40);
        let mut remote = Mirrored::new(&target.engine, remote_at, (3 << 20) + 123, rng.random());
        // A GPU region and a host one: batches mix them, so chunks split by location.
        let mut locals = vec![
            Mirrored::new(
                &initiator,
                Location::Cuda { device: 0 },
                (3 << 20) + 77,
                rng.random(),
            ),
            Mirrored::new(&initiator, host, 1 << 20, rng.random()),
        ];
        let peer = Arc::new(
            initiator
                .connect(
                    &target.engine.descriptor(),
                    target.engine.data_secret(),
                    Preference::Only(kind),
                    None,
                )
                .await
                .unwrap(),
        );
        assert_eq!(peer.transport(), kind);
        let mut ops = 0;
        for opcode in [Opcode::Write, Opcode::Read, Opcode::Write, Opcode::Read] {
            ops += phase(&peer, opcode, &mut locals, &mut remote, &mut rng, 12).await;
        }
        let what = format!("{kind} cuda:0 ↔ {remote_at}, staging {staging_bytes}");
        for l in &locals {
            l.assert_exact(&what);
        }
        remote.assert_exact(&what);
        println!(
            "{what}: {ops} ops, {} bytes moved, every byte exact",
            peer.stats().bytes
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_staging_off_gpu_ops_are_refused_typed_and_nothing_is_written() {
    let Some(_) = gpus("with_staging_off_gpu_ops_are_refused_typed_and_nothing_is_written") else {
        return;
    };
    // The initiator's staging is off: its GPU region is refused at submit, on tcp and shm.
    let target = common::target(staged("off-target")).await;
    let remote = common::random_region(&target.engine, 1 << 20, 5);
    let remote_before = common::bytes(&remote);
    let initiator = Engine::new(EngineConfig {
        staging_bytes: 0,
        ..common::config("off-init")
    })
    .unwrap();
    let local = initiator.alloc_cuda(0, 1 << 20).unwrap();
    let op = |local: RegionId, remote: RegionId| BlockOp {
        local_region: local,
        local_offset: 100,
        remote_region: remote,
        remote_offset: 3,
        len: 70_000,
    };
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let peer = initiator
            .connect(
                &target.engine.descriptor(),
                target.engine.data_secret(),
                Preference::Only(kind),
                None,
            )
            .await
            .unwrap();
        for batch in [
            Batch::write(vec![op(local.id(), remote.id())]),
            Batch::read(vec![op(local.id(), remote.id())]),
        ] {
            match peer.submit(batch).unwrap_err() {
                Error::StagingNotConfigured {
                    op: 0,
                    region,
                    location: Location::Cuda { device: 0 },
                    transport,
                } if region == local.id() && transport == kind => {}
                other => panic!("expected StagingNotConfigured over {kind}, got {other}"),
            }
        }
    }
    assert_eq!(common::bytes(&remote), remote_before);
    let mut zeros = vec![1u8; 1 << 20];
    cuda::copy_to_host(&local, 0, &mut zeros).unwrap();
    assert!(
        zeros.iter().all(|&b| b == 0),
        "the local GPU region was written"
    );

    // The target's staging is off: its GPU region is refused on the wire, typed, untouched.
    let target = common::target(EngineConfig {
        staging_bytes: 0,
        ..common::config("off-target-2")
    })
    .await;
    let remote_gpu = target.engine.alloc_cuda(0, 1 << 20).unwrap();
    let initiator = Engine::new(staged("on-init")).unwrap();
    let local = common::random_region(&initiator, 1 << 20, 6);
    let local_before = common::bytes(&local);
    let peer = initiator
        .connect(
            &target.engine.descriptor(),
            target.engine.data_secret(),
            Preference::Only(TransportKind::Tcp),
            None,
        )
        .await
        .unwrap();
    for batch in [
        Batch::write(vec![op(local.id(), remote_gpu.id())]),
        Batch::read(vec![op(local.id(), remote_gpu.id())]),
    ] {
        let err = peer.submit(batch).unwrap().wait().await.unwrap_err();
        match &err {
            Error::Remote(r) if r.code == "staging_not_configured" => {
                assert!(r.message.contains("cuda:0"), "{err}")
            }
            other => panic!("expected the target's StagingNotConfigured, got {other}"),
        }
    }
    cuda::copy_to_host(&remote_gpu, 0, &mut zeros).unwrap();
    assert!(
        zeros.iter().all(|&b| b == 0),
        "the target's GPU region was written"
    );
    assert_eq!(common::bytes(&local), local_before);
    // A GPU region of the peer over shm is no memfd: refused at submit, naming the region.
    let err = initiator
        .connect(
            &target.engine.descriptor(),
            target.engine.data_secret(),
            Preference::Only(TransportKind::Shm),
            None,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::TransportUnavailable { .. }),
        "shm to a segment with GPU regions: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_gone_mid_gpu_batch_is_a_typed_error_and_later_batches_are_exact() {
    let Some(_) = gpus("a_peer_gone_mid_gpu_batch_is_a_typed_error_and_later_batches_are_exact")
    else {
        return;
    };
    let config = |name: &str| EngineConfig {
        staging_bytes: 1 << 20,
        chunk_bytes: 1 << 20,
        tcp_connections: 2,
        ..common::config(name)
    };
    let gpu0 = Location::Cuda { device: 0 };
    let initiator = Engine::new(config("gone-init")).unwrap();
    let mut locals = vec![Mirrored::new(&initiator, gpu0, 48 << 20, 1)];
    let scratch = initiator.alloc_cuda(0, 48 << 20).unwrap();
    {
        let target = common::target(config("gone-target")).await;
        let remote = target.engine.alloc(48 << 20).unwrap();
        let peer = initiator
            .connect(
                &target.engine.descriptor(),
                target.engine.data_secret(),
                Preference::Only(TransportKind::Tcp),
                None,
            )
            .await
            .unwrap();
        let ops = |local: RegionId| -> Vec<BlockOp> {
            (0..48u64)
                .map(|i| BlockOp {
                    local_region: local,
                    local_offset: i << 20,
                    remote_region: remote.id(),
                    remote_offset: i << 20,
                    len: 1 << 20,
                })
                .collect()
        };
        let write = peer
            .submit(Batch::write(ops(locals[0].region.id())).with_timeout(Duration::from_secs(10)))
            .unwrap();
        let read = peer
            .submit(Batch::read(ops(scratch.id())).with_timeout(Duration::from_secs(10)))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
        drop(target);
        for (what, r) in [("write", write.wait().await), ("read", read.wait().await)] {
            match r {
                Ok(done) => println!(
                    "{what} finished before the peer left ({} bytes)",
                    done.bytes
                ),
                Err(
                    e @ (Error::PeerClosed { .. }
                    | Error::Io { .. }
                    | Error::Remote(_)
                    | Error::Timeout { .. }),
                ) => println!("{what}: {e}"),
                Err(other) => panic!("{what}: unexpected error {other}"),
            }
        }
    }
    // No batch holds the scratch region any more, and the write's source is untouched.
    tokio::time::timeout(Duration::from_secs(15), initiator.deregister(scratch.id()))
        .await
        .expect("deregister waited for a lease nobody releases")
        .unwrap();
    locals[0].assert_exact("source of the interrupted write");
    // A new peer: everything exact again.
    let target = common::target(config("gone-target-2")).await;
    let mut remote = Mirrored::new(&target.engine, gpu0, 8 << 20, 9);
    let peer = Arc::new(
        initiator
            .connect(
                &target.engine.descriptor(),
                target.engine.data_secret(),
                Preference::Only(TransportKind::Tcp),
                None,
            )
            .await
            .unwrap(),
    );
    let mut rng = SmallRng::seed_from_u64(77);
    for opcode in [Opcode::Write, Opcode::Read] {
        phase(&peer, opcode, &mut locals, &mut remote, &mut rng, 8).await;
    }
    locals[0].assert_exact("after the peer came back");
    remote.assert_exact("after the peer came back");
}

const IPC_CHILD: &str = "KVFABRIC_TEST_IPC_CHILD";

/// The child half of a cross-process test: announces its export (and `detail`) on stdout, then
/// waits to be killed.
fn announce_and_wait(export: &CudaExport, detail: impl std::fmt::Display) -> ! {
    println!(
        "KVF-IPC {} {detail}",
        serde_json::to_string(export).unwrap()
    );
    use std::io::Write as _;
    std::io::stdout().flush().unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The exporting child process, killed however the test ends.
struct Exporter(std::process::Child);

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs test `name` of this binary as the exporting child; returns it with the export and the
/// detail it announced.
fn spawn_exporter(name: &str) -> (Exporter, CudaExport, String) {
    use std::io::BufRead as _;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(IPC_CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let child = Exporter(child);
    let line = out
        .lines()
        .map_while(|l| l.ok())
        // libtest may print "test NAME ... " on the same line first.
        .find_map(|l| l.find("KVF-IPC ").map(|at| l[at..].to_string()))
        .expect("the child exported nothing");
    let mut parts = line.splitn(3, ' ').skip(1);
    let export: CudaExport = serde_json::from_str(parts.next().unwrap()).unwrap();
    let detail = parts.next().unwrap_or_default().to_string();
    (child, export, detail)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipc_handle_from_a_dead_process_is_a_typed_error() {
    if std::env::var_os(IPC_CHILD).is_some() {
        // The child: export a device allocation, say where, and wait to be killed.
        let engine = Engine::new(common::config("ipc-child")).unwrap();
        let r = engine.alloc_cuda(0, 1 << 20).unwrap();
        let export = r.cuda_export().expect("cuMemAlloc memory exports");
        announce_and_wait(&export, r.len());
    }
    let Some(_) = gpus("an_ipc_handle_from_a_dead_process_is_a_typed_error") else {
        return;
    };
    let (child, export, len) = spawn_exporter("an_ipc_handle_from_a_dead_process_is_a_typed_error");
    let len: u64 = len.parse().unwrap();
    drop(child);

    let engine = Engine::new(common::config("ipc-dead")).unwrap();
    let err = engine
        .import_cuda(0, export, len, AccessKey(1))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidIpcHandle { .. }), "{err}");
    println!("import of a dead process's handle: {err}");

    // The same handle in a peer's descriptor: the cuda-ipc batch fails typed.
    let local = engine.alloc_cuda(0, 1 << 20).unwrap();
    let mut d = engine.descriptor();
    d.name = "dead".into();
    d.regions = vec![RegionDesc {
        id: RegionId(9),
        len,
        location: Location::Cuda { device: 0 },
        key: AccessKey(1),
        shareable: false,
        ipc: Some(export),
        rdma: Vec::new(),
    }];
    let peer = engine
        .connect(
            &d,
            &kvfabric_engine::DataSecret::random(),
            Preference::Only(TransportKind::CudaIpc),
            None,
        )
        .await
        .unwrap();
    let err = peer
        .submit(Batch::read(vec![BlockOp {
            local_region: local.id(),
            local_offset: 0,
            remote_region: RegionId(9),
            remote_offset: 0,
            len: 4096,
        }]))
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidIpcHandle { .. }), "{err}");
}

#[test]
fn staging_bytes_is_validated() {
    for bad in [1u64, 4096, 8191] {
        let err = Engine::new(EngineConfig {
            staging_bytes: bad,
            ..common::config("stg-bad")
        })
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    field: "staging_bytes",
                    ..
                }
            ),
            "{err}"
        );
    }
    for good in [0u64, 8192, 40_000, 8 << 20] {
        Engine::new(EngineConfig {
            staging_bytes: good,
            ..common::config("stg-good")
        })
        .unwrap();
    }
}

/// Latency mode across processes: a spinning engine runs small batches (most through the lane's
/// doorbell kernel, back to back and after idle pauses that let the kernel exit) against a GPU
/// region another process exports; both memories end exactly as host mirrors say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_mode_small_batches_over_cuda_ipc_are_exact() {
    const NAME: &str = "latency_mode_small_batches_over_cuda_ipc_are_exact";
    const LEN: usize = 4 << 20;
    const SEED: u64 = 0xC0FFEE;
    if std::env::var_os(IPC_CHILD).is_some() {
        let device = cuda::device_count().unwrap() - 1;
        let engine = Engine::new(common::config("lat-child")).unwrap();
        let r = engine.alloc_cuda(device, LEN as u64).unwrap();
        // Word w of the region is pattern_word(SEED, w, 0).
        cuda::fill(&r, 8, SEED).unwrap();
        let export = r.cuda_export().expect("cuMemAlloc memory exports");
        announce_and_wait(&export, device);
    }
    let Some(_) = gpus(NAME) else {
        return;
    };
    let (_child, export, device) = spawn_exporter(NAME);
    let device: u32 = device.parse().unwrap();

    let engine = Engine::new(EngineConfig {
        cuda_spin: true,
        spin_wait: Duration::from_micros(200),
        ..common::config("lat-parent")
    })
    .unwrap();
    let local = engine.alloc_cuda(0, LEN as u64).unwrap();
    let mut d = engine.descriptor();
    d.name = "lat-child".into();
    d.regions = vec![RegionDesc {
        id: RegionId(7),
        len: LEN as u64,
        location: Location::Cuda { device },
        key: AccessKey(5),
        shareable: false,
        ipc: Some(export),
        rdma: Vec::new(),
    }];
    let peer = Arc::new(
        engine
            .connect(
                &d,
                &kvfabric_engine::DataSecret::random(),
                Preference::Only(TransportKind::CudaIpc),
                None,
            )
            .await
            .unwrap(),
    );
    let mut remote_mirror: Vec<u8> = (0..LEN as u64 / 8)
        .flat_map(|w| cuda::pattern_word(SEED, w, 0).to_le_bytes())
        .collect();
    let mut local_mirror = vec![0u8; LEN];
    let mut rng = SmallRng::seed_from_u64(2026);
    for round in 0..400 {
        if round % 50 == 49 {
            // Longer than the doorbell's idle time: the next batch relaunches it.
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        let opcode = if rng.random_bool(0.5) {
            Opcode::Read
        } else {
            Opcode::Write
        };
        // Up to four ops, each in its own quarter on both sides, so destinations never overlap.
        let n = rng.random_range(1..=4usize);
        let quarter = LEN / 4;
        let ops: Vec<BlockOp> = (0..n)
            .map(|k| {
                let len = rng.random_range(1..=16384usize);
                BlockOp {
                    local_region: local.id(),
                    local_offset: (k * quarter + rng.random_range(0..quarter - len)) as u64,
                    remote_region: RegionId(7),
                    remote_offset: (k * quarter + rng.random_range(0..quarter - len)) as u64,
                    len: len as u64,
                }
            })
            .collect();
        for o in &ops {
            let (lo, ro, len) = (
                o.local_offset as usize,
                o.remote_offset as usize,
                o.len as usize,
            );
            match opcode {
                Opcode::Read => {
                    local_mirror[lo..lo + len].copy_from_slice(&remote_mirror[ro..ro + len])
                }
                Opcode::Write => {
                    remote_mirror[ro..ro + len].copy_from_slice(&local_mirror[lo..lo + len])
                }
            }
        }
        let peer = peer.clone();
        tokio::task::spawn_blocking(move || peer.run(Batch::new(opcode, ops)))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    let mut back = vec![0u8; LEN];
    cuda::copy_to_host(&local, 0, &mut back).unwrap();
    assert!(
        back == local_mirror,
        "the local GPU region differs from its mirror"
    );
    // The remote region, read back whole (a launched kernel, not the doorbell).
    let scratch = engine.alloc_cuda(0, LEN as u64).unwrap();
    let whole = Batch::read(vec![BlockOp {
        local_region: scratch.id(),
        local_offset: 0,
        remote_region: RegionId(7),
        remote_offset: 0,
        len: LEN as u64,
    }]);
    peer.submit(whole).unwrap().wait().await.unwrap();
    cuda::copy_to_host(&scratch, 0, &mut back).unwrap();
    assert!(
        back == remote_mirror,
        "the other process's GPU region differs from its mirror"
    );
}

// ---- Block tables over cuda-ipc, and an idle link ----

use kvfabric_engine::{BlockPair, BlockTable, CudaPath, Plane, PlaneSide, Side};

/// A random table whose destination planes lie in `dest` (start, len) of their region, each in
/// an area of its own (unaligned bases and strides, block bytes from 1 to several 64 KiB kernel
/// pieces), and whose sources lie anywhere in a region of `src_len` bytes (ids drawn freely).
/// Small tables (16 elements or fewer, the doorbell's and inline launch's) come often.
/// Returns (source side, destination side, block bytes) per plane and (source, destination)
/// id pairs.
#[allow(clippy::type_complexity)]
fn random_gpu_table(
    rng: &mut SmallRng,
    dest: (u64, u64),
    src_len: u64,
) -> (Vec<((u64, u64), (u64, u64), u64)>, Vec<(u32, u32)>) {
    let (planes, blocks) = if rng.random_bool(0.3) {
        (rng.random_range(1..=4u64), rng.random_range(1..=4u64))
    } else {
        (rng.random_range(1..=64u64), rng.random_range(1..=64u64))
    };
    let area = dest.1 / planes;
    let most = (area / blocks - 64).min(200 << 10);
    let lens: Vec<u64> = (0..planes)
        .map(|_| match rng.random_range(0..3) {
            0 => 4096.min(most),
            1 => rng.random_range(1..=most.min(100)),
            _ => rng.random_range(1..=most),
        })
        .collect();
    let dst_stride: Vec<u64> = lens.iter().map(|l| l + rng.random_range(0..64)).collect();
    let room = dst_stride.iter().map(|s| (area - 16) / s).min().unwrap();
    let mut free: Vec<u32> = (0..room.min(1 << 20) as u32).collect();
    for i in 0..blocks as usize {
        let j = rng.random_range(i..free.len());
        free.swap(i, j);
    }
    let sources = rng.random_range(1..=blocks as u32 * 2);
    let ids: Vec<(u32, u32)> = free[..blocks as usize]
        .iter()
        .map(|&d| (rng.random_range(0..sources), d))
        .collect();
    let planes = (0..planes as usize)
        .map(|p| {
            let len = lens[p];
            let dst_base = dest.0 + p as u64 * area + rng.random_range(0..16);
            let src_stride = rng.random_range(0..=(src_len - len) / u64::from(sources));
            let span = u64::from(sources - 1) * src_stride + len;
            let src_base = rng.random_range(0..=src_len - span);
            ((src_base, src_stride), (dst_base, dst_stride[p]), len)
        })
        .collect();
    (planes, ids)
}

/// Block tables across processes over cuda-ipc, against a GPU region another process exports:
/// random plane layouts with unaligned bases and strides, both directions, four batches in
/// flight (two waited for on their own threads, two submitted), on the table kernel, through
/// the doorbell and inline launches (small tables), and on the copy engines; with the default
/// completion and with `spin_wait` 0. Every byte of both regions ends as host mirrors say. A
/// table whose largest block passes what the exporter really mapped is refused, typed, and
/// writes nothing, whatever the peer's descriptor claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_tables_over_cuda_ipc_are_exact() {
    const NAME: &str = "block_tables_over_cuda_ipc_are_exact";
    const LEN: usize = 32 << 20;
    const SEED: u64 = 0x7AB1E;
    if std::env::var_os(IPC_CHILD).is_some() {
        let device = cuda::device_count().unwrap() - 1;
        let engine = Engine::new(common::config("table-child")).unwrap();
        let r = engine.alloc_cuda(device, LEN as u64).unwrap();
        // Word w of the region is pattern_word(SEED, w, 0).
        cuda::fill(&r, 8, SEED).unwrap();
        let export = r.cuda_export().expect("cuMemAlloc memory exports");
        announce_and_wait(&export, device);
    }
    let Some(_) = gpus(NAME) else {
        return;
    };
    let (_child, export, device) = spawn_exporter(NAME);
    let device: u32 = device.parse().unwrap();
    let mut remote_mirror: Vec<u8> = (0..LEN as u64 / 8)
        .flat_map(|w| cuda::pattern_word(SEED, w, 0).to_le_bytes())
        .collect();
    let mut rng = SmallRng::seed_from_u64(16);
    let modes = [
        (CudaPath::Sm, None),
        (CudaPath::Sm, Some(Duration::ZERO)),
        (CudaPath::Ce, None),
    ];
    for (path, spin_wait) in modes {
        let defaults = common::config("table-parent");
        let engine = Engine::new(EngineConfig {
            cuda_path: path,
            spin_wait: spin_wait.unwrap_or(defaults.spin_wait),
            ..defaults
        })
        .unwrap();
        let mut local = Mirrored::new(&engine, Location::Cuda { device: 0 }, LEN, rng.random());
        let mut d = engine.descriptor();
        d.name = "table-child".into();
        d.regions = vec![RegionDesc {
            id: RegionId(7),
            len: LEN as u64,
            location: Location::Cuda { device },
            key: AccessKey(5),
            shareable: false,
            ipc: Some(export),
            rdma: Vec::new(),
        }];
        let secret = kvfabric_engine::DataSecret::random();
        let peer = Arc::new(
            engine
                .connect(&d, &secret, Preference::Only(TransportKind::CudaIpc), None)
                .await
                .unwrap(),
        );
        let quarter = (LEN / 4) as u64;
        for round in 0..6 {
            for opcode in [Opcode::Write, Opcode::Read] {
                let mut tables = Vec::new();
                for k in 0..4u64 {
                    let (planes, ids) =
                        random_gpu_table(&mut rng, (k * quarter, quarter), LEN as u64);
                    // Read: the destination is local.
                    let (src_mirror, dst_mirror) = match opcode {
                        Opcode::Read => (&remote_mirror, &mut local.mirror),
                        Opcode::Write => (&local.mirror, &mut remote_mirror),
                    };
                    let src_copy = src_mirror.clone();
                    for &((sb, ss), (db, ds), len) in &planes {
                        for &(s, dd) in &ids {
                            let so = (sb + u64::from(s) * ss) as usize;
                            let d_o = (db + u64::from(dd) * ds) as usize;
                            let n = len as usize;
                            dst_mirror[d_o..d_o + n].copy_from_slice(&src_copy[so..so + n]);
                        }
                    }
                    let side = |region, (base, stride)| PlaneSide {
                        region,
                        base,
                        stride,
                    };
                    let table = BlockTable {
                        planes: planes
                            .iter()
                            .map(|&(src, dst, len)| {
                                let (l, r) = match opcode {
                                    Opcode::Read => (dst, src),
                                    Opcode::Write => (src, dst),
                                };
                                Plane {
                                    local: side(local.region.id(), l),
                                    remote: side(RegionId(7), r),
                                    block_bytes: len,
                                }
                            })
                            .collect(),
                        blocks: ids
                            .iter()
                            .map(|&(s, dd)| match opcode {
                                Opcode::Read => BlockPair {
                                    local: dd,
                                    remote: s,
                                },
                                Opcode::Write => BlockPair {
                                    local: s,
                                    remote: dd,
                                },
                            })
                            .collect(),
                    };
                    tables.push(table);
                }
                let mut waits = Vec::new();
                let mut threads = Vec::new();
                for (k, table) in tables.into_iter().enumerate() {
                    let batch = Batch::table(opcode, table);
                    if k % 2 == 0 {
                        let peer = peer.clone();
                        threads.push(tokio::task::spawn_blocking(move || peer.run(batch)));
                    } else {
                        waits.push(peer.submit(batch).unwrap());
                    }
                }
                for h in waits {
                    h.wait()
                        .await
                        .unwrap_or_else(|e| panic!("{path} round {round} {opcode}: {e}"));
                }
                for t in threads {
                    t.await
                        .unwrap()
                        .unwrap_or_else(|e| panic!("{path} round {round} {opcode}: {e}"));
                }
            }
        }
        local.assert_exact(&format!("{path}: the local GPU region after the tables"));
        // The remote region, read back whole.
        let scratch = engine.alloc_cuda(0, LEN as u64).unwrap();
        let whole = Batch::read(vec![BlockOp {
            local_region: scratch.id(),
            local_offset: 0,
            remote_region: RegionId(7),
            remote_offset: 0,
            len: LEN as u64,
        }]);
        peer.submit(whole).unwrap().wait().await.unwrap();
        let mut back = vec![0u8; LEN];
        cuda::copy_to_host(&scratch, 0, &mut back).unwrap();
        assert!(
            back == remote_mirror,
            "{path}: the other process's GPU region differs from its mirror"
        );
        // The peer's descriptor now claims twice what it exported (the mapping stays): the
        // mapping, not the claim, bounds the table.
        let mut liar = d.clone();
        liar.regions[0].len = 2 * LEN as u64;
        peer.set_descriptor(liar);
        let lied_to = &peer;
        let past = BlockTable {
            planes: vec![Plane {
                local: PlaneSide {
                    region: local.region.id(),
                    base: 0,
                    stride: 4096,
                },
                remote: PlaneSide {
                    region: RegionId(7),
                    base: 0,
                    stride: 4096,
                },
                block_bytes: 4096,
            }],
            blocks: (0..64)
                .map(|i| BlockPair {
                    local: i,
                    remote: if i == 63 { (LEN / 4096) as u32 } else { i },
                })
                .collect(),
        };
        let e = lied_to
            .submit(Batch::table(Opcode::Read, past))
            .unwrap()
            .wait()
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::PlaneOutOfBounds {
                    plane: 0,
                    side: Side::Remote,
                    ..
                }
            ),
            "{e}"
        );
        local.assert_exact(&format!("{path}: after the refused table"));
    }
}

/// With the default settings a lone small op over cuda-ipc is waited for by its caller (the
/// doorbell kernel serving it), and 1 ms after the last one no engine thread runs and no kernel
/// stays resident. The doorbell is seen resident between ops of a burst, so its absence after
/// the pause is measured, not assumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_cuda_ipc_link_holds_no_core_and_no_sm() {
    const NAME: &str = "an_idle_cuda_ipc_link_holds_no_core_and_no_sm";
    const LEN: usize = 4 << 20;
    if std::env::var_os(IPC_CHILD).is_some() {
        let device = cuda::device_count().unwrap() - 1;
        let engine = Engine::new(common::config("idle-child")).unwrap();
        let r = engine.alloc_cuda(device, LEN as u64).unwrap();
        let export = r.cuda_export().expect("cuMemAlloc memory exports");
        announce_and_wait(&export, device);
    }
    let Some(_) = gpus(NAME) else {
        return;
    };
    let (_child, export, device) = spawn_exporter(NAME);
    let device: u32 = device.parse().unwrap();
    // The defaults, as a user gets them.
    let engine = Engine::new(EngineConfig {
        name: "idle-parent".into(),
        ..EngineConfig::default()
    })
    .unwrap();
    let local = engine.alloc_cuda(0, LEN as u64).unwrap();
    let mut d = engine.descriptor();
    d.name = "idle-child".into();
    d.regions = vec![RegionDesc {
        id: RegionId(7),
        len: LEN as u64,
        location: Location::Cuda { device },
        key: AccessKey(5),
        shareable: false,
        ipc: Some(export),
        rdma: Vec::new(),
    }];
    let peer = Arc::new(
        engine
            .connect(
                &d,
                &kvfabric_engine::DataSecret::random(),
                Preference::Only(TransportKind::CudaIpc),
                None,
            )
            .await
            .unwrap(),
    );
    let seen_resident = tokio::task::spawn_blocking({
        let peer = peer.clone();
        let local = local.id();
        move || {
            let mut seen = 0;
            for i in 0..500u64 {
                let op = BlockOp {
                    local_region: local,
                    local_offset: (i % 1024) * 4096,
                    remote_region: RegionId(7),
                    remote_offset: ((i * 7) % 1024) * 4096,
                    len: 4096,
                };
                peer.run(Batch::read(vec![op])).unwrap();
                seen += usize::from(peer.stats().resident_kernels > 0);
            }
            seen
        }
    })
    .await
    .unwrap();
    assert!(
        seen_resident > 0,
        "the doorbell was never resident during the burst: the check below would say nothing"
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    let spinning = tokio::task::spawn_blocking(|| {
        common::spinning_threads("kvf-", 20, Duration::from_micros(500))
    })
    .await
    .unwrap();
    assert!(spinning.is_empty(), "threads still running: {spinning:?}");
    assert_eq!(peer.stats().resident_kernels, 0, "a kernel stayed resident");
}
