//! Memory another process shares with an engine (a worker handing its KV memory to its agent),
//! and keys presented on a worker's behalf.

mod common;

use std::os::fd::OwnedFd;

use common::{bytes, config, random_region, target};
use kvfabric_engine::{
    AccessKey, Batch, BlockOp, Engine, Error, Preference, RegionId, TransportKind,
};
use rustix::fs::{MemfdFlags, memfd_create};

fn memfd(len: u64, flags: MemfdFlags) -> OwnedFd {
    let fd = memfd_create("worker-kv", flags).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

fn op(local: RegionId, remote: RegionId, len: u64) -> BlockOp {
    BlockOp {
        local_region: local,
        local_offset: 0,
        remote_region: remote,
        remote_offset: 0,
        len,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_memfd_is_sealed_shared_and_guarded_by_the_registrars_key() {
    let t = target(config("agent-a")).await;
    let key = AccessKey(0x5eed);
    let fd = memfd(64 << 10, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING);
    // The worker keeps its own handle on the memory.
    let workers = fd.try_clone().unwrap();
    let shared = t.engine.register_memfd(fd, key).unwrap();
    assert!(shared.shareable());
    assert_eq!(shared.len(), 64 << 10);
    // Sealed: the worker can no longer shrink it under the agent's mapping (SIGBUS there).
    let err = rustix::fs::ftruncate(&workers, 4096).unwrap_err();
    assert_eq!(err, rustix::io::Errno::PERM, "shrinking must be refused");
    assert_eq!(rustix::fs::fstat(&workers).unwrap().st_size, 64 << 10);
    assert!(
        rustix::fs::fcntl_get_seals(&workers)
            .unwrap()
            .contains(rustix::fs::SealFlags::SHRINK)
    );
    // SAFETY: no transfer runs yet.
    unsafe { shared.as_mut_slice() }.fill(0xab);

    let me = Engine::new(config("agent-b")).unwrap();
    let local = random_region(&me, 64 << 10, 3);
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        // SAFETY: no transfer in flight.
        unsafe { local.as_mut_slice() }.fill(0);
        let read_back = || bytes(&local)[..4096].iter().all(|&b| b == 0xab);
        let peer = me
            .connect(
                &t.engine.descriptor(),
                t.engine.data_secret(),
                Preference::Only(kind),
                None,
            )
            .await
            .unwrap();
        let read =
            |k: AccessKey| Batch::read(vec![op(local.id(), shared.id(), 4096)]).with_remote_key(k);
        let err = peer
            .submit(read(AccessKey(1)))
            .unwrap()
            .wait()
            .await
            .unwrap_err();
        let wrong_key = match &err {
            Error::WrongKey { region, .. } => *region == shared.id(),
            Error::Remote(r) => r.code == "wrong_key",
            _ => false,
        };
        assert!(wrong_key, "{kind}: {err:?}");
        assert!(!read_back(), "{kind}: read with a wrong key");
        peer.submit(read(key)).unwrap().wait().await.unwrap();
        assert!(read_back(), "{kind}: not read with the right key");
    }
}

#[tokio::test]
async fn memory_that_cannot_be_sealed_is_refused() {
    let engine = Engine::new(config("agent")).unwrap();
    let unsealable = memfd(4096, MemfdFlags::CLOEXEC);
    let err = engine.register_memfd(unsealable, AccessKey(1)).unwrap_err();
    assert!(
        matches!(&err, Error::NotShareable { reason, .. } if reason.contains("MFD_ALLOW_SEALING")),
        "{err}"
    );
    let file: OwnedFd = tempfile::tempfile().unwrap().into();
    let err = engine.register_memfd(file, AccessKey(1)).unwrap_err();
    assert!(matches!(err, Error::NotShareable { .. }), "{err}");
    let empty = memfd(0, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING);
    let err = engine.register_memfd(empty, AccessKey(1)).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    assert!(engine.descriptor().regions.is_empty());
}
