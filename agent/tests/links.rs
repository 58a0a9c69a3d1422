//! How an agent reaches its peers: what the peer API reveals (endpoints to any fabric member,
//! a segment's regions only for its key), a hung peer that stalls nothing else, a restarted
//! peer that is reached again, and a worker whose death releases its memory.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvfabric_agent::AgentConfig;
use kvfabric_agent::discovery::Devices;
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::registry::{AgentEntry, Registry, SegmentEntry, SegmentRegion};
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, Op, pb};
use kvfabric_engine::{Location, RegionId, SegmentDescriptor, TransportKind};
use kvfabric_testkit::InProcessAgent;
use rand::{RngCore, SeedableRng};
use tonic::Code;

const BLOCK: u64 = 4096;

async fn agent(
    name: &str,
    store: &MemoryStore,
    adjust: impl FnOnce(&mut AgentConfig),
) -> InProcessAgent {
    let mut config = InProcessAgent::config(name);
    config.transports = vec![TransportKind::Tcp];
    config.batch_timeout = Duration::from_secs(5);
    adjust(&mut config);
    InProcessAgent::start(config, store.registry(), Telemetry::default())
        .await
        .unwrap()
}

fn random(len: u64, seed: u64) -> HostMemory {
    let m = HostMemory::alloc(len).unwrap();
    // SAFETY: nothing transfers into it yet.
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(unsafe { m.as_mut_slice() });
    m
}

fn ops(n: u64) -> Vec<Op> {
    (0..n)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * BLOCK,
            remote_region: 0,
            remote_offset: (n - 1 - i) * BLOCK,
            len: BLOCK,
        })
        .collect()
}

fn pulled(ops: &[Op], src: &HostMemory, dst: &HostMemory) -> bool {
    // SAFETY: the batch completed; nothing is in flight.
    let (from, to) = unsafe { (src.as_slice(), dst.as_slice()) };
    ops.iter().all(|o| {
        let (l, r, n) = (
            o.local_offset as usize,
            o.remote_offset as usize,
            o.len as usize,
        );
        to[l..l + n] == from[r..r + n]
    })
}

async fn peer_client(
    a: &InProcessAgent,
) -> pb::peer_agent_client::PeerAgentClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", a.ready.peer))
        .unwrap()
        .connect()
        .await
        .unwrap();
    pb::peer_agent_client::PeerAgentClient::new(channel)
}

#[tokio::test]
async fn the_handshake_names_no_region_and_a_segment_s_regions_need_its_key() {
    let store = MemoryStore::new();
    let a = agent("node-a", &store, |_| {}).await;
    let worker = Client::connect(a.socket_dir()).await.unwrap();
    let m = random(16 * BLOCK, 1);
    let seg = worker
        .register("prefill-0", &[&m], Some(0x5eed))
        .await
        .unwrap();
    let mut peer = peer_client(&a).await;
    let hello = peer
        .handshake(pb::HandshakeRequest {
            fabric: "test".into(),
            agent: "node-x".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let d = SegmentDescriptor::from_json(&hello.descriptor).unwrap();
    assert!(
        d.regions.is_empty(),
        "the handshake gave regions: {:?}",
        d.regions
    );
    assert!(d.endpoints.tcp.is_some());
    let ask = |key: u64, segment: &str| pb::SegmentAccessRequest {
        fabric: "test".into(),
        agent: "node-x".into(),
        segment: segment.into(),
        key,
    };
    let e = peer
        .segment_access(ask(0x5eee, "prefill-0"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = peer
        .segment_access(ask(0x5eed, "nobody"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let given = peer
        .segment_access(ask(seg.key, "prefill-0"))
        .await
        .unwrap()
        .into_inner();
    let regions: Vec<kvfabric_engine::RegionDesc> =
        serde_json::from_str(&given.regions_json).unwrap();
    assert_eq!(regions.len(), 1);
    assert_eq!(regions[0].key.0, 0x5eed);
    assert_eq!(regions[0].len, 16 * BLOCK);
}

/// A registry entry for an agent whose peer port accepts connections and never answers.
async fn hung_peer(store: &MemoryStore) -> (tokio::net::TcpListener, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = store.registry();
    fake.register_agent(AgentEntry {
        name: "node-hung".into(),
        pool: "prefill".into(),
        role: None,
        node: "hung-boot-id".into(),
        peer_addr: addr,
        devices: Devices::default(),
        started_at: 1,
        instance: 0,
    })
    .await
    .unwrap();
    fake.put_segment(SegmentEntry {
        name: "hung-0".into(),
        agent: "node-hung".into(),
        regions: vec![SegmentRegion {
            id: RegionId(1),
            len: 1 << 20,
            location: Location::Host { numa: None },
        }],
    })
    .await
    .unwrap();
    std::mem::forget(fake);
    (listener, addr)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_that_never_answers_stalls_no_other_transfer() {
    let store = MemoryStore::new();
    // The batch's deadline (30 s) well past the dial's (the handshake's 4 s, three of them at
    // most): what ends the hung peer's batches is the dial, every time.
    let slow = |c: &mut AgentConfig| {
        c.connect_timeout = Duration::from_secs(4);
        c.batch_timeout = Duration::from_secs(30);
    };
    let a = agent("node-a", &store, slow).await;
    let b = agent("node-b", &store, slow).await;
    let (_held, _) = hung_peer(&store).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let src = random(16 * BLOCK, 2);
    let dst = random(16 * BLOCK, 3);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    // Two batches for the hung peer, waiting on its dial.
    let hung = (0..2)
        .map(|_| {
            let (decode, d) = (decode.clone(), d.clone());
            tokio::spawn(async move {
                let start = Instant::now();
                let r = decode.read(&d, "hung-0", 1, &ops(1)).await;
                (r, start.elapsed())
            })
        })
        .collect::<Vec<_>>();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Meanwhile a transfer with a live peer goes through at once.
    let start = Instant::now();
    let batch = ops(16);
    decode.read(&d, "prefill-0", p.key, &batch).await.unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "a live peer's transfer waited {:?} behind the hung one",
        start.elapsed()
    );
    assert!(pulled(&batch, &src, &dst));
    // The hung peer's batches fail by the dial deadline with a code that says "retry".
    for h in hung {
        let (r, took) = h.await.unwrap();
        let e = r.unwrap_err();
        assert_eq!(e.code(), Some(Code::Unavailable), "{e}");
        assert!(took < Duration::from_secs(15), "{took:?}");
    }
}

#[tokio::test]
async fn a_restarted_peer_agent_is_reached_again() {
    let store = MemoryStore::new();
    let a = agent("node-a", &store, |_| {}).await;
    let b = agent("node-b", &store, |_| {}).await;
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let dst = random(16 * BLOCK, 4);
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let batch = ops(8);
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let src = random(16 * BLOCK, 10);
    let p = prefill
        .register("prefill-0", &[&src], Some(0xabc))
        .await
        .unwrap();
    decode.read(&d, "prefill-0", p.key, &batch).await.unwrap();
    assert!(pulled(&batch, &src, &dst));
    // The prefill agent restarts under the same name: new regions, new data secret.
    drop(prefill);
    a.stop().await.unwrap();
    let a = agent("node-a", &store, |_| {}).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let src = random(16 * BLOCK, 11);
    let p = prefill
        .register("prefill-0", &[&src], Some(0xabc))
        .await
        .unwrap();
    decode.read(&d, "prefill-0", p.key, &batch).await.unwrap();
    assert!(pulled(&batch, &src, &dst), "after the restart");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_that_goes_away_leaves_no_segment_behind() {
    use std::os::fd::AsFd;
    let store = MemoryStore::new();
    let a = agent("node-a", &store, |_| {}).await;
    let observer = Client::connect(a.socket_dir()).await.unwrap();
    let worker = Client::connect(a.socket_dir()).await.unwrap();
    let m = random(16 * BLOCK, 5);
    worker.register("short-lived", &[&m], None).await.unwrap();
    // A tool registers memory detached from its connection, then goes away too.
    let tool = Client::connect(a.socket_dir()).await.unwrap();
    let kept = random(BLOCK, 6);
    let fd_sock = std::os::unix::net::UnixStream::connect(
        a.socket_dir().join(kvfabric_proto::contract::socket::FD),
    )
    .unwrap();
    kvfabric_engine::transport::fdpass::send_fd(
        &fd_sock,
        kvfabric_proto::fd_wire::MAGIC,
        kept.memfd().unwrap().as_fd(),
    )
    .unwrap();
    let token = kvfabric_proto::fd_wire::read_reply(&mut &fd_sock)
        .unwrap()
        .unwrap();
    tool.grpc()
        .register_segment(pb::RegisterSegmentRequest {
            name: "kept".into(),
            regions: vec![pb::RegionSpec {
                memory: Some(pb::region_spec::Memory::Host(pb::HostMemory {
                    fd_token: token,
                })),
            }],
            key: 0,
            detached: true,
            fabric_access: false,
        })
        .await
        .unwrap();
    let names = |doc: kvfabric_proto::status::StatusDoc| -> Vec<String> {
        doc.segments.into_iter().map(|s| s.name).collect()
    };
    assert!(names(observer.status().await.unwrap()).contains(&"short-lived".to_string()));
    // Both go away: their connections close.
    drop(worker);
    drop(tool);
    let start = Instant::now();
    loop {
        let now = names(observer.status().await.unwrap());
        if !now.contains(&"short-lived".to_string()) {
            assert!(now.contains(&"kept".to_string()), "{now:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "still registered: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A segment registered with `fabric_access` is read and written by workers of other nodes
/// presenting `FABRIC_KEY`, their agent proving membership with the fabric's token: no key
/// travels. A segment without it refuses that key, an agent of another token is refused, and
/// an agent that authenticates no peer refuses to register one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fabric_segment_is_reached_by_membership_and_never_by_a_key_handed_out() {
    use kvfabric_agent::peer_token::PeerToken;
    use kvfabric_client::{FABRIC_KEY, Memory, Registration};

    let open = MemoryStore::new();
    let lone = agent("node-open", &open, |_| {}).await;
    let m = random(4 * BLOCK, 9);
    let e = Client::connect(lone.socket_dir())
        .await
        .unwrap()
        .register_with(
            "nixl-open",
            &[Memory::Host(&m)],
            Registration {
                fabric_access: true,
                ..Registration::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("fabric_access"), "{e}");

    let store = MemoryStore::new();
    let token = |t: &'static str| {
        move |c: &mut AgentConfig| c.peer_token = Some(t.parse::<PeerToken>().unwrap())
    };
    let a = agent("node-a", &store, token("fabric-token-0123456789")).await;
    let b = agent("node-b", &store, token("fabric-token-0123456789")).await;
    let c = agent("node-c", &store, token("another-token-98765432")).await;
    let owner = Client::connect(a.socket_dir()).await.unwrap();
    let src = random(16 * BLOCK, 10);
    let fabric = Registration {
        fabric_access: true,
        ..Registration::default()
    };
    let shared = owner
        .register_with("nixl-a", &[Memory::Host(&src)], fabric)
        .await
        .unwrap();
    assert_ne!(shared.key, FABRIC_KEY);
    let plain_src = random(16 * BLOCK, 11);
    owner
        .register("plain-a", &[&plain_src], None)
        .await
        .unwrap();

    let reader = Client::connect(b.socket_dir()).await.unwrap();
    let dst = random(16 * BLOCK, 12);
    let mine = reader.register("decode-b", &[&dst], None).await.unwrap();
    let ops = ops(8);
    reader
        .read(&mine, "nixl-a", FABRIC_KEY, &ops)
        .await
        .unwrap();
    assert!(
        pulled(&ops, &src, &dst),
        "the fabric read landed other bytes"
    );
    // A write the other way: block i of decode-b into block n-1-i of nixl-a.
    let back = random(16 * BLOCK, 13);
    let theirs = reader.register("decode-b2", &[&back], None).await.unwrap();
    reader
        .write(&theirs, "nixl-a", FABRIC_KEY, &ops)
        .await
        .unwrap();
    // SAFETY: the batch completed; nothing is in flight.
    let (from, to) = unsafe { (back.as_slice(), src.as_slice()) };
    let pushed = ops.iter().all(|o| {
        to[o.remote_offset as usize..][..BLOCK as usize]
            == from[o.local_offset as usize..][..BLOCK as usize]
    });
    assert!(pushed, "the fabric write landed other bytes");

    let e = reader
        .read(&mine, "plain-a", FABRIC_KEY, &ops)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");

    let stranger = Client::connect(c.socket_dir()).await.unwrap();
    let theirs = random(16 * BLOCK, 14);
    let s = stranger
        .register("decode-c", &[&theirs], None)
        .await
        .unwrap();
    let before = random(16 * BLOCK, 14);
    let e = stranger
        .read(&s, "nixl-a", FABRIC_KEY, &ops)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("peer token"), "{e}");
    // SAFETY: the refused batch left nothing in flight.
    assert!(unsafe { theirs.as_slice() == before.as_slice() });
}

/// Notifications (NIXL's): a worker anywhere in the fabric sends a message to a segment's
/// registrant through the agent that serves it, the receiver never having heard of the
/// sender; the key rule is the data's, sizes are bounded, and another fabric's agent is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_reaches_the_registrant_of_a_segment_on_another_node() {
    use kvfabric_agent::peer_token::PeerToken;
    use kvfabric_client::{FABRIC_KEY, Memory, Notification, Registration};

    let store = MemoryStore::new();
    let token = |t: &'static str| {
        move |c: &mut AgentConfig| c.peer_token = Some(t.parse::<PeerToken>().unwrap())
    };
    let a = agent("node-a", &store, token("fabric-token-0123456789")).await;
    let b = agent("node-b", &store, token("fabric-token-0123456789")).await;
    let c = agent("node-c", &store, token("another-token-98765432")).await;
    let receiver = Client::connect(a.socket_dir()).await.unwrap();
    let m = random(BLOCK, 20);
    let inbox = receiver
        .register_with(
            "nixl-a.inbox",
            &[Memory::Host(&m)],
            Registration {
                fabric_access: true,
                ..Registration::default()
            },
        )
        .await
        .unwrap();
    let closed = receiver.register("closed-a", &[&m], None).await.unwrap();

    let sender = Client::connect(b.socket_dir()).await.unwrap();
    let waiting = tokio::spawn({
        let (receiver, inbox) = (receiver.clone(), inbox.clone());
        async move {
            receiver
                .take_notifications(&inbox, 0, Duration::from_secs(5))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    sender
        .notify("nixl-a.inbox", FABRIC_KEY, "nixl-b", b"req-1:done")
        .await
        .unwrap();
    let got = waiting.await.unwrap().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the waiting taker slept on"
    );
    assert_eq!(
        got,
        vec![Notification {
            sender: "nixl-b".into(),
            message: b"req-1:done".to_vec()
        }]
    );
    for i in 0..3u8 {
        sender
            .notify("closed-a", closed.key, "nixl-b", &[i])
            .await
            .unwrap();
    }
    let got = receiver
        .take_notifications(&closed, 2, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(got.iter().map(|n| n.message[0]).collect::<Vec<_>>(), [0, 1]);

    let e = sender
        .notify("closed-a", FABRIC_KEY, "nixl-b", b"x")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
    let e = sender
        .notify("nobody", FABRIC_KEY, "nixl-b", b"x")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    let big = vec![0u8; kvfabric_proto::limits::MAX_NOTIFICATION_BYTES + 1];
    let e = sender
        .notify("nixl-a.inbox", FABRIC_KEY, "nixl-b", &big)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("message"), "{e}");
    let e = receiver
        .take_notifications(&inbox, 0, Duration::from_secs(11))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("wait_ms"), "{e}");

    let stranger = Client::connect(c.socket_dir()).await.unwrap();
    let e = stranger
        .notify("nixl-a.inbox", FABRIC_KEY, "nixl-c", b"x")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("peer token"), "{e}");
    let left = receiver
        .take_notifications(&inbox, 0, Duration::ZERO)
        .await
        .unwrap();
    assert!(left.is_empty(), "a stranger's message arrived: {left:?}");

    receiver.deregister(&inbox).await.unwrap();
    let e = sender
        .notify("nixl-a.inbox", FABRIC_KEY, "nixl-b", b"late")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
}
