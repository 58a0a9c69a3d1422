//! Data connections authenticate before the target says anything about itself: a stranger (no
//! secret, a wrong one, a replayed proof) learns no descriptor, key or error detail on tcp or
//! shm and reads no memory; an authenticated caller sees region keys only with the segment key.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{
    config, hello_for, random_region, raw_hello, read_challenge, read_frame, remote_error,
    send_frame, target,
};
use kvfabric_engine::frame::{
    Challenge, Entry, FLAG_ERROR, FrameKind, Header, PROTOCOL_VERSION, Welcome,
};
use kvfabric_engine::{
    AccessKey, Batch, BlockOp, DataSecret, Engine, EngineConfig, Error, Preference,
    SegmentDescriptor, TransportKind,
};

const TCP: Preference = Preference::Only(TransportKind::Tcp);
const SHM: Preference = Preference::Only(TransportKind::Shm);

/// Both data ports of `d`, as raw streams.
enum Raw {
    Tcp(TcpStream),
    Shm(UnixStream),
}

impl Raw {
    fn open(d: &SegmentDescriptor, shm: bool) -> Raw {
        let raw = if shm {
            Raw::Shm(UnixStream::connect(d.endpoints.shm.as_ref().unwrap()).unwrap())
        } else {
            Raw::Tcp(TcpStream::connect(d.endpoints.tcp.unwrap()).unwrap())
        };
        let t = Some(Duration::from_secs(10));
        match &raw {
            Raw::Tcp(s) => s.set_read_timeout(t).unwrap(),
            Raw::Shm(s) => s.set_read_timeout(t).unwrap(),
        }
        raw
    }

    /// Everything the target sends until it hangs up.
    fn rest(&mut self) -> Vec<u8> {
        let mut all = Vec::new();
        self.read_to_end(&mut all).unwrap();
        all
    }
}

impl Read for Raw {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Raw::Tcp(s) => s.read(buf),
            Raw::Shm(s) => s.read(buf),
        }
    }
}

impl Write for Raw {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Raw::Tcp(s) => s.write(buf),
            Raw::Shm(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Whether `bytes` contain anything of `d` a stranger must not learn: its name, node, a
/// region key (as the little-endian word manifests carry, or as JSON writes it), or a
/// region id field.
fn leaks(bytes: &[u8], d: &SegmentDescriptor) -> Option<String> {
    let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    if has(d.name.as_bytes()) {
        return Some(format!("segment name {:?}", d.name));
    }
    if has(d.node.as_bytes()) {
        return Some("node id".into());
    }
    for r in &d.regions {
        let key = r.key;
        // AccessKey hides its value from Debug; the descriptor's JSON shows it.
        let json = serde_json::to_string(&key).unwrap();
        if has(json.as_bytes()) || has(&serde_json::from_str::<u64>(&json).unwrap().to_le_bytes()) {
            return Some(format!("key of region {}", r.id));
        }
    }
    if has(b"regions") || has(b"endpoints") {
        return Some("descriptor fields".into());
    }
    None
}

/// The frames of `bytes` (headers and control bodies), in order.
fn frames(mut bytes: &[u8]) -> Vec<(Header, Vec<u8>)> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let h = Header::decode(bytes).unwrap();
        let end = 32 + h.len as usize;
        out.push((h, bytes[32..end].to_vec()));
        bytes = &bytes[end..];
    }
    out
}

/// The target's whole answer to a stranger: its challenge, then the one generic refusal.
fn assert_only_challenge_and_refusal(all: &[u8], d: &SegmentDescriptor, what: &str) {
    if let Some(leak) = leaks(all, d) {
        panic!("{what}: the stranger learned the {leak}");
    }
    let f = frames(all);
    assert_eq!(f.len(), 2, "{what}: {f:?}");
    assert_eq!(f[0].0.kind, FrameKind::Challenge, "{what}");
    let challenge: Challenge = serde_json::from_slice(&f[0].1).unwrap();
    assert_eq!(challenge.protocol, PROTOCOL_VERSION);
    assert_eq!(f[1].0.kind, FrameKind::Welcome, "{what}");
    assert!(f[1].0.has(FLAG_ERROR), "{what}");
    let e = remote_error(&f[1].1);
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("unauthenticated", "authentication failed"),
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_with_a_wrong_or_no_secret_learns_nothing_on_tcp_or_shm() {
    let t = target(EngineConfig {
        segment_key: Some(42),
        ..config("target-with-keys")
    })
    .await;
    let region = random_region(&t.engine, 65536, 1);
    let d = t.engine.descriptor();
    let wrong = DataSecret::random();
    for shm in [false, true] {
        let what = if shm { "shm" } else { "tcp" };
        // A wrong secret, naming the segment and presenting the right segment key.
        let mut s = Raw::open(&d, shm);
        let (h, body) = raw_hello(&mut s, &wrong, PROTOCOL_VERSION, &d.name, Some(42));
        let mut all = h.encode().to_vec();
        all.extend_from_slice(&body);
        let rest = s.rest();
        assert!(rest.is_empty(), "{what}: more after the refusal: {rest:?}");
        // The challenge as read by raw_hello is not in `all`; check it separately below.
        assert!(h.has(FLAG_ERROR) && h.kind == FrameKind::Welcome, "{what}");
        assert_eq!(remote_error(&body).code, "unauthenticated", "{what}");
        assert!(leaks(&all, &d).is_none(), "{what}");

        // No secret at all: a Hello without a valid proof (zeros), then EOF.
        let mut s = Raw::open(&d, shm);
        let mut all = Vec::new();
        let mut head = [0u8; 32];
        s.read_exact(&mut head).unwrap();
        all.extend_from_slice(&head);
        let mut body = vec![0u8; Header::decode(&head).unwrap().len as usize];
        s.read_exact(&mut body).unwrap();
        all.extend_from_slice(&body);
        let hello = serde_json::json!({
            "protocol": PROTOCOL_VERSION, "segment": "", "from": "stranger",
            "nonce": "00".repeat(32), "proof": "00".repeat(32),
        });
        send_frame(&mut s, FrameKind::Hello, hello.to_string().as_bytes());
        all.extend_from_slice(&s.rest());
        assert_only_challenge_and_refusal(&all, &d, what);

        // Garbage (an HTTP request) instead of a Hello.
        let mut s = Raw::open(&d, shm);
        s.write_all(b"GET / HTTP/1.1\r\nHost: kvfabric.example\r\n\r\n")
            .unwrap();
        assert_only_challenge_and_refusal(&s.rest(), &d, what);
    }
    // Through the engine's own API the same: a typed error, on both transports.
    let me = Engine::new(config("stranger")).unwrap();
    let mut known = d.clone();
    known.regions.clear();
    for pref in [TCP, SHM] {
        let err = me
            .connect(&known, &wrong, pref, Some(42))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::AuthFailed { .. }), "{err}");
        assert_eq!(err.code(), "unauthenticated");
    }
    drop(region);
}

/// Without the secret no manifest is ever read: even the right region key, pipelined behind a
/// forged Hello, reads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_read_memory_even_with_the_region_key() {
    let t = target(config("target")).await;
    let region = random_region(&t.engine, 65536, 7);
    let d = t.engine.descriptor();
    let key = d.regions[0].key;
    for guess in [key, AccessKey(key.0 ^ 1), AccessKey(0)] {
        let mut s = Raw::open(&d, false);
        let challenge = read_challenge(&mut s);
        let forged = hello_for(
            &challenge,
            &DataSecret::random(),
            PROTOCOL_VERSION,
            "",
            None,
        );
        let mut wire = Header::new(
            FrameKind::Hello,
            0,
            0,
            serde_json::to_vec(&forged).unwrap().len() as u64,
        )
        .encode()
        .to_vec();
        wire.extend_from_slice(&serde_json::to_vec(&forged).unwrap());
        wire.extend_from_slice(&Header::new(FrameKind::ReadManifest, 1, 1, 65536).encode());
        Entry {
            region: region.id(),
            key: guess,
            offset: 0,
            len: 65536,
        }
        .encode_into(&mut wire);
        s.write_all(&wire).unwrap();
        let rest = s.rest();
        let f = frames(&rest);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(remote_error(&f[0].1).code, "unauthenticated");
        // Not one byte of the region came back.
        // SAFETY: no batch is in flight.
        let memory = unsafe { region.as_slice() };
        assert!(
            !rest
                .windows(16)
                .any(|w| memory.windows(16).step_by(16).any(|m| m == w))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proof_replayed_from_an_earlier_connection_is_refused() {
    let t = target(config("target")).await;
    let d = t.engine.descriptor();
    let secret = t.engine.data_secret();
    for shm in [false, true] {
        let mut first = Raw::open(&d, shm);
        let challenge = read_challenge(&mut first);
        let hello = serde_json::to_vec(&hello_for(
            &challenge,
            secret,
            PROTOCOL_VERSION,
            &d.name,
            None,
        ))
        .unwrap();
        send_frame(&mut first, FrameKind::Hello, &hello);
        let (h, _) = read_frame(&mut first);
        assert!(!h.has(FLAG_ERROR), "the original is accepted");
        // The same bytes on a fresh connection (a new challenge) are worth nothing.
        let mut second = Raw::open(&d, shm);
        read_challenge(&mut second);
        send_frame(&mut second, FrameKind::Hello, &hello);
        let (h, body) = read_frame(&mut second);
        assert!(h.has(FLAG_ERROR));
        assert_eq!(remote_error(&body).code, "unauthenticated");
        assert!(second.rest().is_empty());
    }
}

/// The Welcome an authenticated caller gets, parsed.
fn welcome(d: &SegmentDescriptor, secret: &DataSecret, segment: &str, key: Option<u64>) -> Welcome {
    let mut s = Raw::open(d, false);
    let (h, body) = raw_hello(&mut s, secret, PROTOCOL_VERSION, segment, key);
    assert!(!h.has(FLAG_ERROR), "{:?}", remote_error(&body));
    let w: Welcome = serde_json::from_slice(&body).unwrap();
    if w.descriptor.is_none() {
        assert_eq!(leaks(&body, d), None, "{}", String::from_utf8_lossy(&body));
    }
    w
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_caller_with_the_segment_key_is_told_region_keys() {
    // No segment key configured: nobody is told keys, whatever it names.
    let open = target(config("open-target")).await;
    random_region(&open.engine, 4096, 1);
    let d = open.engine.descriptor();
    let secret = open.engine.data_secret();
    for (segment, key) in [("open-target", None), ("", None), ("open-target", Some(42))] {
        assert!(welcome(&d, secret, segment, key).descriptor.is_none());
    }
    // A segment key: told to whoever names the segment and proves the key, nobody else.
    let keyed = target(EngineConfig {
        segment_key: Some(42),
        ..config("keyed-target")
    })
    .await;
    random_region(&keyed.engine, 4096, 2);
    let d = keyed.engine.descriptor();
    let secret = keyed.engine.data_secret();
    let told = welcome(&d, secret, &d.name, Some(42)).descriptor.unwrap();
    assert_eq!(told.regions, d.regions);
    assert!(welcome(&d, secret, "", Some(42)).descriptor.is_none());
    // Through the API: without the segment key the peer knows only what it was given.
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 4096, 3);
    let d = open.engine.descriptor();
    let mut given = d.clone();
    given.regions.clear();
    let peer = me
        .connect(&given, open.engine.data_secret(), TCP, None)
        .await
        .unwrap();
    assert!(peer.descriptor().regions.is_empty());
    let err = peer
        .submit(Batch::read(vec![BlockOp {
            local_region: local.id(),
            local_offset: 0,
            remote_region: d.regions[0].id,
            remote_offset: 0,
            len: 16,
        }]))
        .unwrap_err();
    assert!(matches!(err, Error::UnknownRegion { .. }), "{err}");
    // With it, the peer's own descriptor (with keys) replaces what it was given.
    let d = keyed.engine.descriptor();
    let mut given = d.clone();
    given.regions.clear();
    let peer = me
        .connect(&given, keyed.engine.data_secret(), SHM, Some(42))
        .await
        .unwrap();
    assert_eq!(peer.descriptor().regions, d.regions);
}

/// The initiator checks the target's proof: a listener at the right address that does not hold
/// the secret is refused before any batch goes to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_target_is_refused_by_the_initiator() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let nonce = kvfabric_engine::auth::nonce();
        let challenge = Challenge {
            protocol: PROTOCOL_VERSION,
            nonce,
        };
        send_frame(
            &mut s,
            FrameKind::Challenge,
            &serde_json::to_vec(&challenge).unwrap(),
        );
        let _ = read_frame(&mut s);
        // Whatever it claims, it cannot make the proof.
        let welcome = Welcome {
            protocol: PROTOCOL_VERSION,
            proof: [7; 32],
            idle_timeout_ms: 0,
            descriptor: None,
        };
        send_frame(
            &mut s,
            FrameKind::Welcome,
            &serde_json::to_vec(&welcome).unwrap(),
        );
        let _ = s.read_to_end(&mut Vec::new());
    });
    let mut d = Engine::new(config("real")).unwrap().descriptor();
    d.endpoints.tcp = Some(addr);
    let me = Engine::new(EngineConfig {
        tcp_connections: 1,
        ..config("initiator")
    })
    .unwrap();
    let err = me
        .connect(&d, &DataSecret::random(), TCP, None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::AuthFailed { reason, .. } if reason.contains("does not hold")),
        "{err}"
    );
}

/// A configured secret is the one used (an owner that hands it out before the engine starts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_secret_is_used_and_a_generated_one_is_random() {
    let secret = DataSecret::random();
    let t = target(EngineConfig {
        data_secret: Some(secret.clone()),
        ..config("configured")
    })
    .await;
    assert_eq!(t.engine.data_secret(), &secret);
    let me = Engine::new(config("initiator")).unwrap();
    me.connect(&t.engine.descriptor(), &secret, TCP, None)
        .await
        .unwrap();
    let a = Engine::new(config("a")).unwrap();
    let b = Engine::new(config("b")).unwrap();
    assert_ne!(a.data_secret(), b.data_secret());
}
