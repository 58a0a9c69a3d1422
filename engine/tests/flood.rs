//! Callers that never finish their handshake hold a bounded number of threads, for at most the
//! handshake deadline, and cannot keep a real peer out. One test in its own binary: it counts
//! the process's threads.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::{bytes, config, random_region, read_challenge};
use kvfabric_engine::{Batch, BlockOp, Engine, EngineConfig, Preference, TransportKind};

const TCP: Preference = Preference::Only(TransportKind::Tcp);
const SHM: Preference = Preference::Only(TransportKind::Shm);

/// The names of this process's threads.
fn threads() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect();
    names.sort();
    names
}

/// Waits (2 s at most) until at most `bound` threads are left: threads of connections that
/// were shut down to make room take a moment to end.
async fn threads_settle_at_most(bound: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let now = threads();
        if now.len() <= bound {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {} threads, at most {bound} expected: {now:?}",
            now.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn op(local: &kvfabric_engine::Region, remote: &kvfabric_engine::Region, len: u64) -> BlockOp {
    BlockOp {
        local_region: local.id(),
        local_offset: 0,
        remote_region: remote.id(),
        remote_offset: 0,
        len,
    }
}

/// Reads until the target hangs up.
fn closed_within(s: &mut impl Read, limit: Duration) {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("not closed within {limit:?}: {e}"),
        }
        assert!(started.elapsed() < limit, "not closed within {limit:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_never_speak_hold_few_threads_briefly_and_cannot_keep_a_peer_out() {
    let t = common::target(EngineConfig {
        max_unauthenticated: 8,
        max_connections: 64,
        handshake_timeout: Duration::from_secs(3),
        ..config("target")
    })
    .await;
    let remote = random_region(&t.engine, 65536, 2);
    let d = t.engine.descriptor();
    let before = threads().len();
    // 300 callers on each data port that never send a byte.
    let mut tcp: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(d.endpoints.tcp.unwrap()).unwrap())
        .collect();
    let mut shm: Vec<UnixStream> = (0..300)
        .map(|_| UnixStream::connect(d.endpoints.shm.as_ref().unwrap()).unwrap())
        .collect();
    // At most 8 handshakes per listener hold a thread.
    threads_settle_at_most(before + 2 * 8, "under the flood").await;
    // A real peer still gets in, over both transports, while the flood goes on.
    let started = Instant::now();
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 65536, 1);
    let mut peers = Vec::new();
    for pref in [TCP, SHM] {
        let peer = me
            .connect(&d, t.engine.data_secret(), pref, None)
            .await
            .unwrap();
        peer.submit(Batch::read(vec![op(&local, &remote, 65536)]))
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert!(bytes(&local) == bytes(&remote));
        peers.push(peer);
    }
    // It did not wait for the strangers' deadline: the latest of them is still waiting.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let last = tcp.last_mut().unwrap();
    read_challenge(last);
    last.set_nonblocking(true).unwrap();
    let still = last.read(&mut [0u8; 64]);
    assert!(
        matches!(&still, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the newest stranger should still be in its handshake: {still:?}"
    );
    last.set_nonblocking(false).unwrap();
    // Every stranger is hung up on by the deadline (or sooner, to make room), and its thread
    // is gone.
    for s in &mut tcp {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        closed_within(s, Duration::from_secs(5));
    }
    for s in &mut shm {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        closed_within(s, Duration::from_secs(5));
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Of the connection threads only the peer's remain (3 tcp, 1 shm); no stranger's.
    let serving = |name: &str| threads().iter().filter(|t| *t == name).count();
    let deadline = Instant::now() + Duration::from_secs(2);
    while (serving("kvf-tcp-serve"), serving("kvf-shm-serve")) != (3, 1) {
        assert!(Instant::now() < deadline, "{:?}", threads());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
