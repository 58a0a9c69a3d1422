//! GPU memory: typed errors everywhere a GPU is missing or misused, and, on a machine with CUDA
//! devices, the copy machinery itself. Tests that need a device print "skipped: no CUDA device"
//! and pass elsewhere.

mod common;

use kvfabric_engine::cuda::{self, CudaExport, IpcHandle};
use kvfabric_engine::{
    Batch, BlockOp, Engine, Error, Location, Preference, RegionDesc, RegionId, TransportKind,
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
    let initiator = Engine::new(common::config("staging-init")).unwrap();
    let local = initiator.alloc(1 << 20).unwrap();
    let peer = initiator
        .connect(
            &target.engine.descriptor(),
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
        .connect(&d, Preference::Only(TransportKind::CudaIpc), None)
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
