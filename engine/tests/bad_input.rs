//! Bad input gets a typed error naming the field and value, no panic, no byte written outside
//! the destination, and the target keeps serving its other peers.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use common::{
    bytes, config, random_region, raw_connect, raw_hello, read_challenge, read_frame, remote_error,
    send_frame, target,
};
use kvfabric_engine::frame::{
    Challenge, Entry, FLAG_CRC, FLAG_ERROR, FrameError, FrameKind, Header, Hello, PROTOCOL_VERSION,
    Welcome,
};
use kvfabric_engine::{
    AccessKey, Batch, BlockOp, DataSecret, Endpoints, Engine, EngineConfig, Error, Preference,
    RegionId, SegmentDescriptor, Side, TcpBuffer, TransportKind,
};

const TCP: Preference = Preference::Only(TransportKind::Tcp);
const SHM: Preference = Preference::Only(TransportKind::Shm);

fn op(local: RegionId, lo: u64, remote: RegionId, ro: u64, len: u64) -> BlockOp {
    BlockOp {
        local_region: local,
        local_offset: lo,
        remote_region: remote,
        remote_offset: ro,
        len,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_unknown_region_zero_length_and_overlap_are_refused_before_io() {
    let t = target(config("target")).await;
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 8192, 1);
    let remote = random_region(&t.engine, 8192, 2);
    let peer = me
        .connect(&t.engine.descriptor(), t.engine.data_secret(), TCP, None)
        .await
        .unwrap();
    let (l, r) = (local.id(), remote.id());
    let (lb, rb) = (bytes(&local), bytes(&remote));

    let err = peer
        .submit(Batch::write(vec![op(l, 0, r, 8000, 400)]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBounds {
                op: 0,
                field: "remote_offset",
                offset: 8000,
                len: 400,
                region_len: 8192,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("8000"), "{err}");
    let err = peer
        .submit(Batch::read(vec![
            op(l, 0, r, 0, 10),
            op(l, u64::MAX - 1, r, 100, 10),
        ]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBounds {
                op: 1,
                field: "local_offset",
                ..
            }
        ),
        "{err}"
    );
    let err = peer
        .submit(Batch::read(vec![op(RegionId(999), 0, r, 0, 10)]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnknownRegion {
                region: RegionId(999),
                side: Side::Local
            }
        ),
        "{err}"
    );
    let err = peer
        .submit(Batch::read(vec![op(l, 0, RegionId(555), 0, 10)]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnknownRegion {
                region: RegionId(555),
                side: Side::Remote
            }
        ),
        "{err}"
    );
    let err = peer
        .submit(Batch::read(vec![op(l, 0, r, 0, 0)]))
        .unwrap_err();
    assert!(matches!(err, Error::ZeroLength { op: 0 }), "{err}");
    let err = peer
        .submit(Batch::write(vec![
            op(l, 0, r, 100, 50),
            op(l, 500, r, 120, 50),
        ]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::OverlappingDestination {
                first: 0,
                second: 1,
                offset: 120,
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        peer.submit(Batch::read(vec![])),
        Err(Error::EmptyBatch)
    ));

    assert!(
        bytes(&local) == lb && bytes(&remote) == rb,
        "nothing may be written"
    );
    // And the connection still works.
    peer.submit(Batch::write(vec![op(l, 0, r, 0, 100)]))
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(bytes(&remote)[..100], lb[..100]);
}

/// The Submit that once aborted the process: 17 one-byte ops (one past the pairwise overlap
/// check, so the bitmap ran) whose first `local_offset` is 2^64 - 1. The overlap check ran before
/// the bounds checks, its size arithmetic wrapped and it asked for 2 EiB. Now the bounds come
/// first and name the op.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seventeen_one_byte_ops_from_2_64_minus_1_are_out_of_bounds_not_an_abort() {
    let t = target(config("target")).await;
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 8192, 1);
    let remote = random_region(&t.engine, 8192, 2);
    let (l, r) = (local.id(), remote.id());
    let mut ops: Vec<BlockOp> = (0..17).map(|i| op(l, i, r, i, 1)).collect();
    ops[0].local_offset = u64::MAX;
    for pref in [TCP, SHM] {
        let peer = me
            .connect(&t.engine.descriptor(), t.engine.data_secret(), pref, None)
            .await
            .unwrap();
        for batch in [Batch::read(ops.clone()), Batch::write(ops.clone())] {
            let err = peer.submit(batch).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::OutOfBounds {
                        op: 0,
                        field: "local_offset",
                        offset: u64::MAX,
                        len: 1,
                        region_len: 8192,
                        ..
                    }
                ),
                "{pref:?}: {err}"
            );
        }
        // The remote side the same way, and the peer still works.
        let mut remote_top = ops.clone();
        remote_top[0].local_offset = 100;
        remote_top[16].remote_offset = u64::MAX;
        let err = peer.submit(Batch::write(remote_top)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfBounds {
                    op: 16,
                    field: "remote_offset",
                    ..
                }
            ),
            "{pref:?}: {err}"
        );
        peer.submit(Batch::read(vec![op(l, 0, r, 0, 64)]))
            .unwrap()
            .wait()
            .await
            .unwrap();
    }
    assert_eq!(bytes(&local)[..64], bytes(&remote)[..64]);
}

/// A caller's timeout too large to add to a clock reading waits (for ever, in effect) instead
/// of panicking the submitting thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_past_the_clock_s_range_is_no_panic() {
    let t = target(config("target")).await;
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 8192, 1);
    let remote = random_region(&t.engine, 8192, 2);
    let peer = me
        .connect(&t.engine.descriptor(), t.engine.data_secret(), TCP, None)
        .await
        .unwrap();
    let ops = vec![op(local.id(), 0, remote.id(), 0, 4096)];
    let batch = Batch::read(ops.clone()).with_timeout(Duration::MAX);
    let done = tokio::task::spawn_blocking(move || peer.run(batch).map(|r| r.bytes))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done, 4096);
    let peer = me
        .connect(&t.engine.descriptor(), t.engine.data_secret(), SHM, None)
        .await
        .unwrap();
    let h = peer
        .submit(Batch::write(ops).with_timeout(Duration::MAX))
        .unwrap();
    assert_eq!(h.wait().await.unwrap().bytes, 4096);
    let err = Engine::new(EngineConfig {
        max_batch_ops: 1 << 33,
        ..config("x")
    })
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "max_batch_ops",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn socket_buffers_out_of_range_are_refused_naming_the_field() {
    for n in [0, 4095, (64 << 20) + 1] {
        let err = Engine::new(EngineConfig {
            tcp_buffer: TcpBuffer::Bytes(n),
            ..config("x")
        })
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    field: "tcp_buffer",
                    ..
                }
            ),
            "{n}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_batches_are_refused() {
    let t = target(config("target")).await;
    let me = Engine::new(EngineConfig {
        max_batch_ops: 4,
        ..config("initiator")
    })
    .unwrap();
    let local = random_region(&me, 8192, 1);
    let remote = random_region(&t.engine, 8192, 2);
    let peer = me
        .connect(&t.engine.descriptor(), t.engine.data_secret(), TCP, None)
        .await
        .unwrap();
    let ops = (0..5)
        .map(|i| op(local.id(), i * 10, remote.id(), i * 10, 10))
        .collect();
    let err = peer.submit(Batch::read(ops)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BatchTooLarge {
                field: "ops",
                value: 5,
                limit: 4
            }
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_region_key_is_refused_by_the_target_and_nothing_is_written() {
    let t = target(config("target")).await;
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 65536, 1);
    let remote = random_region(&t.engine, 65536, 2);
    let rb = bytes(&remote);
    for pref in [TCP, SHM] {
        let peer = me
            .connect(&t.engine.descriptor(), t.engine.data_secret(), pref, None)
            .await
            .unwrap();
        let mut forged = t.engine.descriptor();
        forged.regions[0].key = AccessKey(forged.regions[0].key.0 ^ 1);
        peer.set_descriptor(forged);
        let ops = vec![op(local.id(), 0, remote.id(), 0, 4096)];
        let err = peer
            .submit(Batch::write(ops))
            .unwrap()
            .wait()
            .await
            .unwrap_err();
        match (&err, pref) {
            (Error::Remote(r), TCP) => assert_eq!(r.code, "wrong_key", "{err}"),
            (Error::Remote(r), _) => assert_eq!(r.code, "wrong_key", "{err}"),
            _ => panic!("unexpected {err}"),
        }
        assert!(bytes(&remote) == rb, "{pref:?}: wrong key must not write");
        // The same connection goes on serving correct requests.
        peer.set_descriptor(t.engine.descriptor());
        let ops = vec![op(local.id(), 0, remote.id(), 0, 4096)];
        peer.submit(Batch::read(ops)).unwrap().wait().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_segment_key_and_protocol_version_fail_the_handshake() {
    let t = target(EngineConfig {
        segment_key: Some(42),
        ..config("target")
    })
    .await;
    let me = Engine::new(config("initiator")).unwrap();
    let d = t.engine.descriptor();
    for pref in [TCP, SHM] {
        let err = me
            .connect(&d, t.engine.data_secret(), pref, Some(41))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::WrongSegmentKey { .. }), "{err}");
        let err = me
            .connect(&d, t.engine.data_secret(), pref, None)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::WrongSegmentKey { .. }), "{err}");
        me.connect(&d, t.engine.data_secret(), pref, Some(42))
            .await
            .unwrap();
    }
    let mut other = d.clone();
    other.name = "someone-else".into();
    let err = me
        .connect(&other, t.engine.data_secret(), TCP, Some(42))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::UnknownSegment { .. }), "{err}");

    let mut s = std::net::TcpStream::connect(d.endpoints.tcp.unwrap()).unwrap();
    let (h, body) = raw_hello(
        &mut s,
        t.engine.data_secret(),
        PROTOCOL_VERSION + 1,
        &d.name,
        Some(42),
    );
    assert_eq!(h.kind, FrameKind::Welcome);
    assert!(h.has(FLAG_ERROR));
    let e = remote_error(&body);
    assert_eq!(e.code, "protocol_version");
    assert!(
        e.message
            .contains(&format!("peer {}", PROTOCOL_VERSION + 1)),
        "{}",
        e.message
    );
    // The target still serves others.
    me.connect(&d, t.engine.data_secret(), TCP, Some(42))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_truncated_frames_close_only_that_connection() {
    let t = target(config("target")).await;
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 65536, 1);
    let remote = random_region(&t.engine, 65536, 2);
    let d = t.engine.descriptor();
    let peer = me
        .connect(&d, t.engine.data_secret(), TCP, None)
        .await
        .unwrap();
    let rb = bytes(&remote);

    // Garbage instead of a frame: the target names the problem and hangs up.
    let mut s = raw_connect(&d, t.engine.data_secret());
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n-----")
        .unwrap();
    let (h, body) = read_frame(&mut s);
    assert!(h.has(FLAG_ERROR));
    assert_eq!(remote_error(&body).code, "malformed_frame");
    assert!(remote_error(&body).message.contains("bad magic"));
    let mut rest = Vec::new();
    assert_eq!(
        s.read_to_end(&mut rest).unwrap(),
        0,
        "connection must be closed"
    );

    // Garbage before the handshake: the one refusal a stranger gets, no detail.
    let mut s = std::net::TcpStream::connect(d.endpoints.tcp.unwrap()).unwrap();
    read_challenge(&mut s);
    s.write_all(&[0xff; 64]).unwrap();
    let (h, body) = read_frame(&mut s);
    assert!(h.has(FLAG_ERROR));
    assert_eq!(remote_error(&body).code, "unauthenticated");
    assert_eq!(remote_error(&body).message, "authentication failed");

    // A write manifest promising 4096 bytes of which only 100 arrive.
    let mut s = raw_connect(&d, t.engine.data_secret());
    let key = d.regions[0].key;
    let mut frame = Header::new(FrameKind::WriteManifest, 7, 1, 4096)
        .encode()
        .to_vec();
    Entry {
        region: remote.id(),
        key,
        offset: 1000,
        len: 4096,
    }
    .encode_into(&mut frame);
    frame.extend_from_slice(&[0xAB; 100]);
    s.write_all(&frame).unwrap();
    // We send no more: the target sees the end and must close (not wait, not write more).
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(
        s.read_to_end(&mut Vec::new()).unwrap(),
        0,
        "closed without a word"
    );

    // A header cut short: the same.
    let mut s = raw_connect(&d, t.engine.data_secret());
    s.write_all(&Header::new(FrameKind::ReadManifest, 1, 3, 30).encode()[..20])
        .unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(
        s.read_to_end(&mut Vec::new()).unwrap(),
        0,
        "closed without a word"
    );

    // The target has closed both, so whatever it wrote is in place now.
    let after = bytes(&remote);
    // Only the 100 delivered bytes may have landed, and only inside the destination range.
    assert!(after[..1000] == rb[..1000] && after[1100..] == rb[1100..]);
    // Everyone else is still served.
    let ops = vec![op(local.id(), 0, remote.id(), 0, 65536)];
    peer.submit(Batch::write(ops))
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert!(bytes(&remote) == bytes(&local));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_manifests_are_drained_and_the_connection_stays_usable() {
    let t = target(config("target")).await;
    let remote = random_region(&t.engine, 65536, 2);
    let rb = bytes(&remote);
    let d = t.engine.descriptor();
    let key = d.regions[0].key;
    let mut s = raw_connect(&d, t.engine.data_secret());

    let send = |s: &mut std::net::TcpStream, h: Header, entries: &[Entry], payload: &[u8]| {
        let mut frame = h.encode().to_vec();
        entries.iter().for_each(|e| e.encode_into(&mut frame));
        frame.extend_from_slice(payload);
        s.write_all(&frame).unwrap();
        read_frame(s)
    };
    let e = |offset, len| Entry {
        region: remote.id(),
        key,
        offset,
        len,
    };
    // Out of bounds (crafted past the initiator's own checks).
    let (h, body) = send(
        &mut s,
        Header::new(FrameKind::WriteManifest, 1, 1, 100),
        &[e(65500, 100)],
        &[1; 100],
    );
    assert_eq!((h.kind, h.tag), (FrameKind::Ack, 1));
    assert_eq!(remote_error(&body).code, "out_of_bounds");
    assert!(remote_error(&body).message.contains("65500"));
    // Offset + len overflowing u64.
    let (_, body) = send(
        &mut s,
        Header::new(FrameKind::WriteManifest, 2, 1, 10),
        &[e(u64::MAX - 4, 10)],
        &[1; 10],
    );
    assert_eq!(remote_error(&body).code, "out_of_bounds");
    // Overlapping destinations.
    let (_, body) = send(
        &mut s,
        Header::new(FrameKind::WriteManifest, 3, 2, 20),
        &[e(0, 10), e(5, 10)],
        &[1; 20],
    );
    assert_eq!(remote_error(&body).code, "overlapping_destination");
    // Zero length.
    let (_, body) = send(
        &mut s,
        Header::new(FrameKind::WriteManifest, 4, 1, 0),
        &[e(0, 0)],
        &[],
    );
    assert_eq!(remote_error(&body).code, "zero_length");
    // Unknown region and wrong key.
    let unknown = Entry {
        region: RegionId(4242),
        key,
        offset: 0,
        len: 10,
    };
    let (_, body) = send(
        &mut s,
        Header::new(FrameKind::WriteManifest, 5, 1, 10),
        &[unknown],
        &[1; 10],
    );
    assert_eq!(remote_error(&body).code, "unknown_region");
    let wrong = Entry {
        key: AccessKey(key.0 ^ 7),
        ..e(0, 10)
    };
    let (h, body) = send(
        &mut s,
        Header::new(FrameKind::ReadManifest, 6, 1, 10),
        &[wrong],
        &[],
    );
    assert_eq!((h.kind, h.tag), (FrameKind::ReadData, 6));
    assert_eq!(remote_error(&body).code, "wrong_key");
    // A checksum that does not match what arrived.
    let mut payload = vec![9u8; 10];
    payload.extend_from_slice(&0xdead_beefu32.to_le_bytes());
    let (_, body) = send(
        &mut s,
        Header::new(FrameKind::WriteManifest, 8, 1, 10).with_flags(FLAG_CRC),
        &[e(200, 10)],
        &payload,
    );
    assert_eq!(remote_error(&body).code, "checksum");
    // Nothing outside the (checksummed) destination was written...
    let after = bytes(&remote);
    assert!(after[..200] == rb[..200] && after[210..] == rb[210..]);
    // ...and the same connection still moves data.
    let (h, _) = send(
        &mut s,
        Header::new(FrameKind::WriteManifest, 9, 1, 4),
        &[e(0, 4)],
        &[5, 6, 7, 8],
    );
    assert!(!h.has(FLAG_ERROR));
    assert_eq!(bytes(&remote)[..4], [5, 6, 7, 8]);
}

/// A fake target that completes the handshake (with the returned secret) and then misbehaves.
fn fake_target(behaviour: fn(std::net::TcpStream)) -> (SegmentDescriptor, DataSecret) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let real = SegmentDescriptor {
        version: kvfabric_engine::DESCRIPTOR_VERSION,
        name: "fake".into(),
        node: "elsewhere".into(),
        regions: vec![kvfabric_engine::RegionDesc {
            id: RegionId(1),
            len: 1 << 20,
            location: kvfabric_engine::Location::Host { numa: None },
            key: AccessKey(1),
            shareable: false,
            ipc: None,
            rdma: Vec::new(),
        }],
        endpoints: Endpoints {
            tcp: Some(addr),
            shm: None,
        },
    };
    let secret = DataSecret::random();
    let theirs = secret.clone();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let mut s = s.unwrap();
            let secret = secret.clone();
            std::thread::spawn(move || {
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
                let (_, body) = read_frame(&mut s);
                let hello: Hello = serde_json::from_slice(&body).unwrap();
                let x = kvfabric_engine::auth::Exchange {
                    target: &nonce,
                    initiator: &hello.nonce,
                    from: &hello.from,
                };
                assert!(x.check_initiator(&secret, &hello.proof));
                let welcome = serde_json::to_vec(&Welcome {
                    protocol: PROTOCOL_VERSION,
                    proof: x.target_proof(&secret),
                    idle_timeout_ms: 0,
                    descriptor: None,
                })
                .unwrap();
                send_frame(&mut s, FrameKind::Welcome, &welcome);
                behaviour(s);
            });
        }
    });
    (real, theirs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_closes_mid_batch_fails_the_batch_promptly() {
    let (d, secret) = fake_target(|mut s| {
        // Take part of the first chunk, then vanish.
        let mut buf = [0u8; 1000];
        let _ = s.read_exact(&mut buf);
    });
    let me = Engine::new(EngineConfig {
        tcp_connections: 1,
        ..config("initiator")
    })
    .unwrap();
    let local = random_region(&me, 1 << 20, 1);
    let peer = me.connect(&d, &secret, TCP, None).await.unwrap();
    let started = std::time::Instant::now();
    let err = peer
        .submit(Batch::write(vec![op(
            local.id(),
            0,
            RegionId(1),
            0,
            1 << 20,
        )]))
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PeerClosed { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // The dead connection is not reused silently: the next batch fails fast too.
    let err = peer
        .submit(Batch::read(vec![op(local.id(), 0, RegionId(1), 0, 10)]))
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PeerClosed { .. }), "{err}");
    // Nothing holds the region any more.
    me.deregister(local.id()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out_and_cancel_works_and_deregister_waits() {
    let (d, secret) = fake_target(|mut s| {
        // Read everything, answer nothing, keep the connection open until the client leaves.
        let mut buf = [0u8; 4096];
        while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
    });
    let me = Engine::new(EngineConfig {
        tcp_connections: 1,
        ..config("initiator")
    })
    .unwrap();
    let local = random_region(&me, 1 << 20, 1);
    let peer = me.connect(&d, &secret, TCP, None).await.unwrap();
    let ops = vec![op(local.id(), 0, RegionId(1), 0, 4096)];

    let h = peer
        .submit(Batch::read(ops.clone()).with_timeout(Duration::from_millis(300)))
        .unwrap();
    let id = h.id();
    let err = h.wait().await.unwrap_err();
    assert!(
        matches!(err, Error::Timeout { batch, millis: 300 } if batch == id),
        "{err}"
    );

    let h = peer.submit(Batch::read(ops.clone())).unwrap();
    let cancel = h.canceller();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        cancel.cancel();
    });
    let err = h.wait().await.unwrap_err();
    assert!(matches!(err, Error::Cancelled { .. }), "{err}");

    // Chunks of those batches are still on the wire: deregistration must wait for them.
    let dereg = tokio::spawn({
        let me = me.clone();
        let id = local.id();
        async move { me.deregister(id).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !dereg.is_finished(),
        "deregister returned while batches still hold the region"
    );
    assert!(local.inflight() > 0);
    // New batches no longer see the region.
    let err = peer.submit(Batch::read(ops)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::UnknownRegion {
                side: Side::Local,
                ..
            }
        ),
        "{err}"
    );
    // Once the connection goes away the in-flight pieces are failed and released.
    drop(peer);
    tokio::time::timeout(Duration::from_secs(5), dereg)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// What a batch keeps (`Batch::keeping`) outlives its handle's answer while pieces are still on
/// the wire, and goes once they are accounted for: the agent's hold revocation waits on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_batch_keeps_goes_only_when_no_piece_can_land() {
    let (d, secret) = fake_target(|mut s| {
        let mut buf = [0u8; 4096];
        while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
    });
    let me = Engine::new(EngineConfig {
        tcp_connections: 1,
        ..config("initiator")
    })
    .unwrap();
    let local = random_region(&me, 1 << 20, 1);
    let peer = me.connect(&d, &secret, TCP, None).await.unwrap();
    let kept: Arc<dyn std::any::Any + Send + Sync> = Arc::new(());
    let watch = Arc::downgrade(&kept);
    let err = peer
        .submit(
            Batch::read(vec![op(local.id(), 0, RegionId(1), 0, 4096)])
                .with_timeout(Duration::from_millis(200))
                .keeping(kept),
        )
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        watch.upgrade().is_some(),
        "released while its piece was still on the wire"
    );
    // The connection goes: its pieces fail, and the batch lets go of what it kept.
    drop(peer);
    let start = std::time::Instant::now();
    while watch.upgrade().is_some() {
        assert!(start.elapsed() < Duration::from_secs(5), "never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A batch refused before it starts lets go at once.
    let peer = me.connect(&d, &secret, TCP, None).await.unwrap();
    let kept: Arc<dyn std::any::Any + Send + Sync> = Arc::new(());
    let watch = Arc::downgrade(&kept);
    peer.submit(Batch::read(vec![op(local.id(), 0, RegionId(1), 1 << 20, 1)]).keeping(kept))
        .unwrap_err();
    assert!(watch.upgrade().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_refuses_caller_memory_and_unknown_regions() {
    let t = target(config("target")).await;
    let mut buf = vec![0u8; 8192];
    // SAFETY: `buf` outlives the region (deregistered below before it drops).
    let caller = unsafe {
        t.engine.register_ptr(
            kvfabric_engine::Location::Host { numa: None },
            std::ptr::NonNull::new(buf.as_mut_ptr()).unwrap(),
            8192,
        )
    }
    .unwrap();
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 8192, 1);
    // Auto sees the caller region and does not pick shm, saying why.
    let peer = me
        .connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Auto,
            None,
        )
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Tcp);
    assert!(
        peer.selection().reason.contains("not a shareable"),
        "{}",
        peer.selection().reason
    );
    // Forced shm is refused up front.
    let err = me
        .connect(&t.engine.descriptor(), t.engine.data_secret(), SHM, None)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TransportUnavailable { .. }), "{err}");
    // Tcp carries caller memory fine.
    peer.submit(Batch::write(vec![op(local.id(), 0, caller.id(), 0, 8192)]))
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(buf[..], bytes(&local)[..]);
    t.engine.deregister(caller.id()).await.unwrap();

    // A forged descriptor pointing shm at a region that is not there.
    let shared = random_region(&t.engine, 8190, 3);
    let peer = me
        .connect(&t.engine.descriptor(), t.engine.data_secret(), SHM, None)
        .await
        .unwrap();
    let mut forged = t.engine.descriptor();
    forged.regions[0].id = RegionId(777);
    peer.set_descriptor(forged);
    let err = peer
        .submit(Batch::read(vec![op(local.id(), 0, RegionId(777), 0, 10)]))
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Remote(r) if r.code == "unknown_region"),
        "{err}"
    );
    // A length beyond the real mapping is caught against the mapping itself.
    let mut lying = t.engine.descriptor();
    lying.regions[0].len = 1 << 30;
    peer.set_descriptor(lying);
    let err = peer
        .submit(Batch::read(vec![op(local.id(), 0, shared.id(), 8150, 100)]))
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBounds {
                field: "remote_offset",
                ..
            }
        ),
        "{err}"
    );
}

/// Reads one read manifest and answers it as `tweak` says: the header, the payload and the crc
/// trailer it would send, changed.
fn answer_read(mut s: std::net::TcpStream, tweak: fn(&mut Header, &mut Vec<u8>, &mut Vec<u8>)) {
    let mut head = [0u8; 32];
    if s.read_exact(&mut head).is_err() {
        return;
    }
    let h = Header::decode(&head).unwrap();
    let mut manifest = vec![0u8; h.manifest_len()];
    s.read_exact(&mut manifest).unwrap();
    let mut payload = vec![0x5au8; h.len as usize];
    let mut trailer: Vec<u8> = if h.has(FLAG_CRC) {
        // One entry per op here: the crc of each entry's bytes.
        let entries = kvfabric_engine::frame::decode_manifest(&h, &manifest).unwrap();
        let mut at = 0;
        entries
            .iter()
            .flat_map(|e| {
                let crc = crc32c::crc32c(&payload[at..at + e.len as usize]);
                at += e.len as usize;
                crc.to_le_bytes()
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut reply =
        Header::new(FrameKind::ReadData, h.tag, h.count, h.len).with_flags(h.flags & FLAG_CRC);
    tweak(&mut reply, &mut payload, &mut trailer);
    let _ = s.write_all(&reply.encode());
    let _ = s.write_all(&payload);
    let _ = s.write_all(&trailer);
    // Keep the connection until the initiator drops it.
    let _ = s.read_to_end(&mut Vec::new());
}

fn wrong_tag(s: std::net::TcpStream) {
    answer_read(s, |h, _, _| h.tag += 1);
}

fn wrong_length(s: std::net::TcpStream) {
    answer_read(s, |h, p, _| {
        h.len += 100;
        p.extend_from_slice(&[0x5a; 100]);
    });
}

fn corrupted_payload(s: std::net::TcpStream) {
    // The crc trailer is of the bytes as they should be; one of them is flipped on the way.
    answer_read(s, |_, p, _| p[1000] ^= 0xff);
}

/// A target that answers a read with the wrong tag or length, or corrupts the payload of a
/// checksummed read: a typed error naming what was wrong, nothing written outside the requested
/// range (nothing at all when the reply does not match), and a mismatched reply's connection is
/// dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_target_gets_typed_errors_and_writes_nothing_outside_the_range() {
    let cases: [(fn(std::net::TcpStream), bool); 3] = [
        (wrong_tag, false),
        (wrong_length, false),
        (corrupted_payload, true),
    ];
    for (behaviour, checksum) in cases {
        let (d, secret) = fake_target(behaviour);
        let me = Engine::new(EngineConfig {
            tcp_connections: 1,
            ..config("initiator")
        })
        .unwrap();
        let local = me.alloc(64 << 10).unwrap();
        // SAFETY: no batch in flight.
        unsafe { local.as_mut_slice() }.fill(0x11);
        let peer = me.connect(&d, &secret, TCP, None).await.unwrap();
        let batch =
            Batch::read(vec![op(local.id(), 8192, RegionId(1), 0, 4096)]).with_checksum(checksum);
        let err = peer.submit(batch).unwrap().wait().await.unwrap_err();
        let after = bytes(&local);
        assert!(
            after[..8192].iter().all(|&b| b == 0x11) && after[12288..].iter().all(|&b| b == 0x11),
            "written outside the requested range: {err}"
        );
        if checksum {
            assert!(matches!(err, Error::Checksum { op: 0, .. }), "{err}");
        } else {
            assert!(
                matches!(
                    &err,
                    Error::Frame(FrameError::TagMismatch { .. })
                        | Error::Frame(FrameError::ReplyMismatch { field: "len", .. })
                ),
                "{err}"
            );
            assert!(
                after[8192..12288].iter().all(|&b| b == 0x11),
                "{err}: payload read"
            );
            // The connection is gone: the next batch fails at once, typed.
            assert_eq!(peer.stats().connections, 0);
            let err = peer
                .submit(Batch::read(vec![op(local.id(), 0, RegionId(1), 0, 16)]))
                .unwrap()
                .wait()
                .await
                .unwrap_err();
            assert!(matches!(err, Error::PeerClosed { .. }), "{err}");
        }
    }
}
