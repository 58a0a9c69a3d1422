//! What the local API's authority rewrite costs per request: the bytes of many gRPC requests
//! on one connection (HEADERS as HPACK with the client's dynamic table, a Submit-sized DATA
//! frame, a WINDOW_UPDATE now and then) read by hyper-sized reads, once straight and once
//! through `AuthorityRewrite`. `cargo bench -p kvfabric-agent --bench authority`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvfabric_agent::authority::AuthorityRewrite;
use tokio::io::{AsyncRead, AsyncReadExt};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const REQUESTS: u32 = 20_000;
/// A Submit of a few dozen ops.
const SUBMIT_BYTES: usize = 2_000;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn indexed_literal(name: usize, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loona_hpack::encoder::encode_integer_into(name, 6, 0x40, &mut out).unwrap();
    loona_hpack::encoder::encode_integer_into(value.len(), 7, 0, &mut out).unwrap();
    out.extend_from_slice(value);
    out
}

fn connection(authority: &[u8]) -> Vec<u8> {
    let first = [
        vec![0x83, 0x86],
        indexed_literal(4, b"/kvfabric.local.v1.LocalAgent/Submit"),
        indexed_literal(1, authority),
        indexed_literal(31, b"application/grpc"),
        indexed_literal(58, b"tonic/0.14.9"),
        vec![0x40, 2, b't', b'e', 8],
        b"trailers".to_vec(),
    ]
    .concat();
    // 62 te, 63 user-agent, 64 content-type, 65 :authority, 66 :path.
    let later = [
        0x83,
        0x86,
        0x80 | 66,
        0x80 | 65,
        0x80 | 64,
        0x80 | 63,
        0x80 | 62,
    ];
    let mut message = vec![0, 0, 0, 0x07, 0xcb];
    message.resize(5 + SUBMIT_BYTES - 5, 0x5a);
    let mut bytes = [PREFACE, &frame(0x4, 0, 0, &[])].concat();
    for i in 0..REQUESTS {
        let stream = 2 * i + 1;
        let block: &[u8] = if i == 0 { &first } else { &later };
        bytes.extend_from_slice(&frame(0x1, 0x4, stream, block));
        bytes.extend_from_slice(&frame(0x0, 0x1, stream, &message));
        if i % 8 == 7 {
            bytes.extend_from_slice(&frame(0x8, 0, 0, &65_535u32.to_be_bytes()));
        }
    }
    bytes
}

/// Reads `r` to its end with 8 KiB reads (hyper's first read size) and returns the time.
async fn drain(mut r: impl AsyncRead + Unpin) -> Duration {
    let mut buf = vec![0u8; 8192];
    let start = Instant::now();
    let mut total = 0usize;
    loop {
        let n = r.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        total += n;
        black_box(&buf[..n]);
    }
    black_box(total);
    start.elapsed()
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for (what, authority) in [
        (
            "grpcio authority (rewritten)",
            &b"run%2Fkvfabric%2Fagent.sock"[..],
        ),
        ("valid authority (kept)", b"localhost"),
    ] {
        let bytes = connection(authority);
        let mut straight = Vec::new();
        let mut rewritten = Vec::new();
        for _ in 0..15 {
            straight.push(rt.block_on(drain(&bytes[..])));
            rewritten.push(rt.block_on(drain(AuthorityRewrite::new(&bytes[..]))));
        }
        straight.sort();
        rewritten.sort();
        let per = |d: Duration| d.as_nanos() as f64 / f64::from(REQUESTS);
        let (s, r) = (per(straight[7]), per(rewritten[7]));
        println!(
            "{what}: {REQUESTS} requests of {SUBMIT_BYTES} B, median of 15: straight {s:.0} ns/request, through the rewrite {r:.0} ns/request, overhead {:.0} ns/request",
            r - s
        );
    }
}
