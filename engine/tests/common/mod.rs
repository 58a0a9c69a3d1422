#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use kvfabric_engine::auth;
use kvfabric_engine::frame::{
    Challenge, FLAG_ERROR, FrameKind, HEADER_LEN, Header, Hello, PROTOCOL_VERSION,
};
use kvfabric_engine::{DataSecret, Engine, EngineConfig, Region, RemoteError, SegmentDescriptor};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use tokio::sync::watch;

/// An engine serving tcp and shm on fresh local endpoints, stopped when dropped.
pub struct Target {
    pub engine: Engine,
    stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

pub fn config(name: &str) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        tcp_connections: 3,
        // Small chunks so even modest batches spread over every connection.
        chunk_bytes: 64 << 10,
        batch_timeout: Duration::from_secs(20),
        shm_parallel_min: 256 << 10,
        ..EngineConfig::default()
    }
}

pub async fn target(config: EngineConfig) -> Target {
    let engine = Engine::new(config).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uds = tokio::net::UnixListener::bind(dir.path().join("shm.sock")).unwrap();
    let (stop, rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    tokio::spawn({
        let e = engine.clone();
        let s = stopped(rx.clone());
        async move { e.serve_tcp(tcp, s).await }
    });
    tokio::spawn({
        let e = engine.clone();
        let s = stopped(rx);
        async move { e.serve_shm(uds, s).await }
    });
    while engine.descriptor().endpoints.tcp.is_none() || engine.descriptor().endpoints.shm.is_none()
    {
        tokio::task::yield_now().await;
    }
    Target {
        engine,
        stop,
        _dir: dir,
    }
}

pub fn random_region(engine: &Engine, len: u64, seed: u64) -> Arc<Region> {
    let r = engine.alloc(len).unwrap();
    // SAFETY: new region, no transfers yet.
    SmallRng::seed_from_u64(seed).fill_bytes(unsafe { r.as_mut_slice() });
    r
}

/// A snapshot of a region's bytes.
pub fn bytes(r: &Region) -> Vec<u8> {
    // SAFETY: tests read only while no batch is in flight.
    unsafe { r.as_slice() }.to_vec()
}

/// A raw data connection that has completed the handshake, for speaking the wire by hand.
pub fn raw_connect(d: &SegmentDescriptor, secret: &DataSecret) -> TcpStream {
    let mut s = TcpStream::connect(d.endpoints.tcp.unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let reply = raw_hello(&mut s, secret, PROTOCOL_VERSION, &d.name, None);
    assert_eq!(reply.0.kind, FrameKind::Welcome);
    assert!(!reply.0.has(FLAG_ERROR), "handshake refused: {:?}", reply.1);
    s
}

/// Reads the target's challenge.
pub fn read_challenge<S: Read>(s: &mut S) -> Challenge {
    let (h, body) = read_frame(s);
    assert_eq!(h.kind, FrameKind::Challenge, "{body:?}");
    serde_json::from_slice(&body).unwrap()
}

/// The Hello that answers `challenge` with `secret`'s proof (and `key`'s), as `from`.
pub fn hello_for(
    challenge: &Challenge,
    secret: &DataSecret,
    protocol: u32,
    segment: &str,
    key: Option<u64>,
) -> Hello {
    let nonce = auth::nonce();
    let from = "raw-test";
    let x = auth::Exchange {
        target: &challenge.nonce,
        initiator: &nonce,
        from,
    };
    Hello {
        protocol,
        segment: segment.into(),
        from: from.into(),
        nonce,
        proof: x.initiator_proof(secret),
        key_proof: key.map(|k| x.key_proof(secret, k)),
    }
}

pub fn send_frame<S: Write>(s: &mut S, kind: FrameKind, body: &[u8]) {
    s.write_all(&Header::new(kind, 0, 0, body.len() as u64).encode())
        .unwrap();
    s.write_all(body).unwrap();
}

/// Answers the challenge with `secret`'s proof and returns the target's reply.
pub fn raw_hello<S: Read + Write>(
    s: &mut S,
    secret: &DataSecret,
    protocol: u32,
    segment: &str,
    key: Option<u64>,
) -> (Header, Vec<u8>) {
    let challenge = read_challenge(s);
    let hello = hello_for(&challenge, secret, protocol, segment, key);
    send_frame(s, FrameKind::Hello, &serde_json::to_vec(&hello).unwrap());
    read_frame(s)
}

/// Reads one control-style frame (header plus `len` body bytes).
pub fn read_frame<S: Read>(s: &mut S) -> (Header, Vec<u8>) {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = Header::decode(&h).unwrap();
    let mut body = vec![0u8; h.len as usize];
    s.read_exact(&mut body).unwrap();
    (h, body)
}

pub fn remote_error(body: &[u8]) -> RemoteError {
    serde_json::from_slice(body).unwrap()
}

/// This process's threads whose name starts with `prefix` that were running or runnable (state
/// R in /proc) in more than half of `samples` looks, `every` apart, and ran on a core for at
/// least a tenth of that time: threads that spin. A thread that sleeps (in a futex, poll, the
/// driver's blocking sync) reads S, one woken now and then for a moment is R in few samples, and
/// one that would park but waits for a core on a loaded machine reads R without running.
pub fn spinning_threads(prefix: &str, samples: usize, every: std::time::Duration) -> Vec<String> {
    use std::collections::HashMap;
    // (tid, name) → (looks in state R, ns on a core at the first look, at the last).
    let mut seen: HashMap<(u32, String), (usize, Option<u64>, u64)> = HashMap::new();
    let start = std::time::Instant::now();
    for _ in 0..samples {
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
                continue; // gone meanwhile
            };
            let Some((head, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let name = head.split_once('(').map_or("", |(_, n)| n).to_string();
            if !name.starts_with(prefix) {
                continue;
            }
            let tid: u32 = task.file_name().to_string_lossy().parse().unwrap_or(0);
            // schedstat's first field: nanoseconds on a core.
            let on_cpu = std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
            let state = rest.trim_start().chars().next().unwrap_or('?');
            let e = seen.entry((tid, name)).or_default();
            e.0 += usize::from(state == 'R');
            if let Some(ns) = on_cpu {
                e.1.get_or_insert(ns);
                e.2 = ns;
            }
        }
        std::thread::sleep(every);
    }
    let window = start.elapsed().as_nanos() as u64;
    let mut names: Vec<String> = seen
        .into_iter()
        .filter(|(_, (r, first, last))| {
            *r * 2 > samples && first.is_none_or(|f| (last - f) * 10 >= window)
        })
        .map(|((tid, name), (r, first, last))| {
            let ran = first.map_or(0, |f| last - f) / 1000;
            format!("{name} (tid {tid}, R in {r}/{samples}, {ran} µs on a core)")
        })
        .collect();
    names.sort();
    names
}
