//! Writes real frames into the frame fuzzer's seed corpus: a target engine and an initiator talk
//! through a recording proxy (handshake with and without the segment key, write and read
//! chunks with checksums and trace context, table chunks, a refused chunk, a KeepAlive), and every frame each
//! side sent is cut out and written to `DIR/<direction>-<n>-<kind>`.
//!
//!     cargo run -p kvfabric-engine --example fuzz_seeds -- fuzz/seeds/frame

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfabric_engine::frame::{
    FLAG_CRC, FLAG_ERROR, FLAG_TRACE, FrameKind, HEADER_LEN, Header, TABLE_HEAD_LEN, TRACE_LEN,
    TableHead,
};
use kvfabric_engine::{
    AccessKey, Batch, BlockOp, BlockPair, BlockTable, Engine, EngineConfig, Plane, PlaneSide,
    Preference, TraceContext, TransportKind,
};

type Tape = Arc<Mutex<Vec<u8>>>;
/// Per connection: what the initiator sent, what the target sent.
type Tapes = Arc<Mutex<Vec<(Tape, Tape)>>>;

/// Copies `from` to `to`, keeping a copy of every byte.
fn pump(mut from: TcpStream, mut to: TcpStream, tape: Tape) {
    let mut buf = [0u8; 64 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        tape.lock().unwrap().extend_from_slice(&buf[..n]);
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// A proxy in front of `target` that records each connection's two directions.
fn proxy(target: std::net::SocketAddr) -> (std::net::SocketAddr, Tapes) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let tapes: Tapes = Arc::default();
    let t = tapes.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let client = client.unwrap();
            let server = TcpStream::connect(target).unwrap();
            let (up, down): (Tape, Tape) = Default::default();
            t.lock().unwrap().push((up.clone(), down.clone()));
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || pump(client, server, up));
            std::thread::spawn(move || pump(s2, c2, down));
        }
    });
    (addr, tapes)
}

/// Bytes of the frame at the start of `b` (header, body, payload, trailer), given who sent it.
fn frame_len(h: &Header, b: &[u8], from_initiator: bool) -> usize {
    let crc = if h.has(FLAG_CRC) {
        h.count as usize * 4
    } else {
        0
    };
    HEADER_LEN
        + match h.kind {
            _ if h.has(FLAG_ERROR) => h.len as usize,
            FrameKind::WriteManifest => h.manifest_len() + h.len as usize + crc,
            FrameKind::ReadManifest => h.manifest_len(),
            FrameKind::WriteTable | FrameKind::ReadTable => {
                let at = HEADER_LEN + if h.has(FLAG_TRACE) { TRACE_LEN } else { 0 };
                let head =
                    TableHead::decode(h, b[at..at + TABLE_HEAD_LEN].try_into().unwrap()).unwrap();
                let manifest = at - HEADER_LEN + TABLE_HEAD_LEN + head.body_len();
                match h.kind {
                    FrameKind::WriteTable => manifest + h.len as usize + crc,
                    _ => manifest,
                }
            }
            FrameKind::ReadData if !from_initiator => h.len as usize + crc,
            _ => h.len as usize,
        }
}

fn main() {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or("fuzz/seeds/frame".into()));
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let target = Engine::new(EngineConfig {
            name: "seed-target".into(),
            segment_key: Some(42),
            // Short, so an idle initiator sends a KeepAlive while we wait.
            idle_timeout: Duration::from_millis(300),
            ..EngineConfig::default()
        })
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let real = listener.local_addr().unwrap();
        let t = target.clone();
        tokio::spawn(async move { t.serve_tcp(listener, std::future::pending()).await });
        let remote = target.alloc(1 << 16).unwrap();
        let (addr, tapes) = proxy(real);
        let mut d = target.descriptor();
        d.endpoints.tcp = Some(addr);
        let me = Engine::new(EngineConfig {
            name: "seed-initiator".into(),
            tcp_connections: 1,
            ..EngineConfig::default()
        })
        .unwrap();
        let local = me.alloc(1 << 16).unwrap();
        let op = |lo, ro, len| BlockOp {
            local_region: local.id(),
            local_offset: lo,
            remote_region: remote.id(),
            remote_offset: ro,
            len,
        };
        let trace = TraceContext {
            trace_id: [0x11; 16],
            span_id: [0x22; 8],
            flags: 1,
        };
        // With the segment key: the Welcome carries the descriptor.
        let peer = me
            .connect(
                &d,
                target.data_secret(),
                Preference::Only(TransportKind::Tcp),
                Some(42),
            )
            .await
            .unwrap();
        let ops = vec![op(0, 128, 64), op(256, 512, 100), op(1024, 4096, 33)];
        // Two planes (K and V, say) of three blocks each.
        let table = BlockTable {
            planes: [0u64, 1]
                .map(|kv| Plane {
                    local: PlaneSide {
                        region: local.id(),
                        base: kv * 8192,
                        stride: 512,
                    },
                    remote: PlaneSide {
                        region: remote.id(),
                        base: 16384 + kv * 8192,
                        stride: 1024,
                    },
                    block_bytes: 500,
                })
                .to_vec(),
            blocks: [(0, 2), (5, 0), (1, 7)]
                .map(|(local, remote)| BlockPair { local, remote })
                .to_vec(),
        };
        for batch in [
            Batch::table(kvfabric_engine::Opcode::Write, table.clone())
                .with_checksum(true)
                .with_trace(trace),
            Batch::table(kvfabric_engine::Opcode::Read, table.clone()),
            Batch::write(ops.clone())
                .with_checksum(true)
                .with_trace(trace),
            Batch::read(ops.clone()).with_checksum(true),
            Batch::read(ops.clone()),
            Batch::write(vec![op(0, 0, 200)]),
            Batch::write(vec![op(0, 0, 16)]).with_remote_key(AccessKey(7)),
        ] {
            let _ = peer.submit(batch).unwrap().wait().await;
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        drop(peer);
        // Naming no segment: the Welcome carries no descriptor.
        let mut unnamed = d.clone();
        unnamed.name.clear();
        let peer = me
            .connect(
                &unnamed,
                target.data_secret(),
                Preference::Only(TransportKind::Tcp),
                Some(42),
            )
            .await
            .unwrap();
        peer.submit(Batch::read(vec![op(0, 0, 8)]))
            .unwrap()
            .wait()
            .await
            .unwrap();
        drop(peer);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut n = 0;
        for (c, (up, down)) in tapes.lock().unwrap().iter().enumerate() {
            for (side, tape, from_initiator) in [("initiator", up, true), ("target", down, false)] {
                let tape = tape.lock().unwrap();
                let mut at = 0;
                while at + HEADER_LEN <= tape.len() {
                    let h = Header::decode(&tape[at..]).unwrap();
                    let len = frame_len(&h, &tape[at..], from_initiator).min(tape.len() - at);
                    let name = format!("{side}-{c}-{at:05}-{:?}", h.kind).to_lowercase();
                    std::fs::write(dir.join(name), &tape[at..at + len]).unwrap();
                    at += len;
                    n += 1;
                }
            }
        }
        println!("{n} frames written to {}", dir.display());
    });
}
