//! The local API answers a client that sends the `:authority` grpcio sends on a Unix socket:
//! the socket path, percent-encoded, which the `h2` crate alone refuses (RST_STREAM
//! PROTOCOL_ERROR, "INTERNAL: Stream removed" in grpcio). The client here writes the frames
//! and HPACK fields as grpcio does — the authority taken into its dynamic table by the first
//! request, referred to by index after — so it runs wherever the tests run; python/tests/
//! test_grpcio.py runs grpcio itself.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory};
use kvfabric_proto::contract::socket;
use kvfabric_testkit::InProcessAgent;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A literal field with incremental indexing whose name is static-table entry `name`.
fn indexed_literal(name: usize, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loona_hpack::encoder::encode_integer_into(name, 6, 0x40, &mut out).unwrap();
    loona_hpack::encoder::encode_integer_into(value.len(), 7, 0, &mut out).unwrap();
    out.extend_from_slice(value);
    out
}

/// grpcio's authority for `unix://<path>`: the path without its leading '/', '/' as %2F.
fn grpcio_authority(path: &std::path::Path) -> Vec<u8> {
    let p = path.to_str().unwrap().trim_start_matches('/');
    p.replace('/', "%2F").into_bytes()
}

struct Reply {
    status: Option<Vec<u8>>,
    grpc_status: Option<Vec<u8>>,
    message: Vec<u8>,
    reset: Option<u32>,
}

/// Health/Check twice on one connection, then every frame back until both streams end.
fn health_checks(sock: PathBuf) -> Vec<Reply> {
    let authority = grpcio_authority(&sock);
    assert!(
        http::uri::Authority::try_from(&authority[..]).is_err(),
        "h2 alone refuses it"
    );
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let first = [
        vec![0x83, 0x86], // :method POST, :scheme http
        indexed_literal(4, b"/grpc.health.v1.Health/Check"),
        indexed_literal(1, &authority),
        indexed_literal(31, b"application/grpc"),
        vec![0x40, 2, b't', b'e', 8],
        b"trailers".to_vec(),
    ]
    .concat();
    // The dynamic table: 62 te, 63 content-type, 64 :authority, 65 :path.
    let second = [0x83, 0x86, 0x80 | 65, 0x80 | 64, 0x80 | 63, 0x80 | 62];
    let empty_request = [0u8; 5];
    let out = [
        PREFACE.to_vec(),
        frame(SETTINGS, 0, 0, &[]),
        frame(HEADERS, END_HEADERS, 1, &first),
        frame(DATA, END_STREAM, 1, &empty_request),
        frame(HEADERS, END_HEADERS, 3, &second),
        frame(DATA, END_STREAM, 3, &empty_request),
    ]
    .concat();
    s.write_all(&out).unwrap();

    let mut replies: Vec<Reply> = (0..2)
        .map(|_| Reply {
            status: None,
            grpc_status: None,
            message: Vec::new(),
            reset: None,
        })
        .collect();
    let mut decoder = loona_hpack::Decoder::new();
    let mut ended = 0;
    while ended < 2 {
        let mut h = [0u8; 9];
        s.read_exact(&mut h).unwrap();
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let mut payload = vec![0; len];
        s.read_exact(&mut payload).unwrap();
        let reply = match stream {
            1 => &mut replies[0],
            3 => &mut replies[1],
            _ => {
                assert_ne!(
                    kind, GOAWAY,
                    "the server closed the connection: {payload:?}"
                );
                if kind == SETTINGS && flags & ACK == 0 {
                    s.write_all(&frame(SETTINGS, ACK, 0, &[])).unwrap();
                }
                continue;
            }
        };
        match kind {
            HEADERS => {
                assert_ne!(flags & END_HEADERS, 0, "small replies fit one frame");
                for (name, value) in decoder.decode(&payload).unwrap() {
                    match &name[..] {
                        b":status" => reply.status = Some(value),
                        b"grpc-status" => reply.grpc_status = Some(value),
                        _ => {}
                    }
                }
            }
            DATA => reply.message.extend_from_slice(&payload),
            RST_STREAM => {
                reply.reset = Some(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                ended += 1;
                continue;
            }
            _ => {}
        }
        if flags & END_STREAM != 0 {
            ended += 1;
        }
    }
    replies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_percent_encoded_socket_path_as_authority_is_answered() {
    let agent = InProcessAgent::start(
        InProcessAgent::config("authority"),
        MemoryStore::new().registry(),
        Telemetry::default(),
    )
    .await
    .unwrap();
    let sock = agent.socket_dir().join(socket::LOCAL);
    let replies = tokio::task::spawn_blocking(move || health_checks(sock))
        .await
        .unwrap();
    for (i, r) in replies.iter().enumerate() {
        // PROTOCOL_ERROR (1) here is h2 refusing the authority.
        assert_eq!(r.reset, None, "request {i} was reset");
        assert_eq!(r.status.as_deref(), Some(&b"200"[..]), "request {i}");
        assert_eq!(r.grpc_status.as_deref(), Some(&b"0"[..]), "request {i}");
        // One uncompressed message: HealthCheckResponse { status: SERVING }.
        assert_eq!(r.message, [0, 0, 0, 0, 2, 0x08, 0x01], "request {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_http2_stream_closes_only_its_connection() {
    let agent = InProcessAgent::start(
        InProcessAgent::config("authority-bad"),
        MemoryStore::new().registry(),
        Telemetry::default(),
    )
    .await
    .unwrap();
    let sock = agent.socket_dir().join(socket::LOCAL);
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // A frame past the 16 KiB SETTINGS_MAX_FRAME_SIZE the server advertises.
        let mut out = PREFACE.to_vec();
        out.extend_from_slice(&frame(HEADERS, END_HEADERS, 1, &vec![0x82; 20_000]));
        let _ = s.write_all(&out);
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(_) => true,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    })
    .await
    .unwrap();
    assert!(closed, "the connection is closed");
    let client = Client::connect(agent.socket_dir()).await.unwrap();
    let m = HostMemory::alloc(1 << 20).unwrap();
    client.register("still-served", &[&m], None).await.unwrap();
}
