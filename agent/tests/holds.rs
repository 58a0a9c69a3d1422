//! Holds: a prefill worker grants one request's blocks to one reader for a while, and the
//! reader's agent reads those and nothing else, only while the hold lives. Two agents in one
//! process (with the fabric's peer token, as in production), real sockets, bytes verified.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvfabric_agent::AgentConfig;
use kvfabric_agent::discovery::Devices;
use kvfabric_agent::metrics::scrape;
use kvfabric_agent::peer_token::PeerToken;
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::registry::{AgentEntry, Registry};
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{
    BlockTable, Client, HoldPlane, HostMemory, Op, Plane, PlaneSide, Segment, SubmitOptions, pb,
};
use kvfabric_testkit::InProcessAgent;
use rand::{RngCore, SeedableRng};
use tonic::Code;

const TOKEN: &str = "fabric-token-0123456789";
const BS: u64 = 4096;
/// Blocks per plane in the prefill's cache.
const BLOCKS: u64 = 64;

async fn agent(name: &str, store: &MemoryStore, transports: &str) -> InProcessAgent {
    agent_with(name, store, transports, |_| {}).await
}

async fn agent_with(
    name: &str,
    store: &MemoryStore,
    transports: &str,
    adjust: impl FnOnce(&mut AgentConfig),
) -> InProcessAgent {
    let mut config = InProcessAgent::config(name);
    config.transports = transports
        .split(',')
        .map(|t| kvfabric_agent::config::parse_transport(t).unwrap())
        .collect();
    config.batch_timeout = Duration::from_secs(20);
    config.peer_token = Some(TOKEN.parse().unwrap());
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

fn bytes(m: &HostMemory) -> Vec<u8> {
    // SAFETY: callers look only after their batches completed (or were refused).
    unsafe { m.as_slice() }.to_vec()
}

/// The prefill's cache: region 0 holds K of block b at b × BS and V at (BLOCKS + b) × BS
/// (two planes); region 1 is another layer, K and V interleaved (stride 2 BS).
fn cache_planes() -> Vec<HoldPlane> {
    vec![
        HoldPlane {
            region: 0,
            base: 0,
            stride: BS,
            block_bytes: BS,
        },
        HoldPlane {
            region: 0,
            base: BLOCKS * BS,
            stride: BS,
            block_bytes: BS,
        },
        HoldPlane {
            region: 1,
            base: 0,
            stride: 2 * BS,
            block_bytes: BS,
        },
        HoldPlane {
            region: 1,
            base: BS,
            stride: 2 * BS,
            block_bytes: BS,
        },
    ]
}

/// A decode's table over the hold's planes: remote planes as granted, local ones packed.
fn table(remote: &[HoldPlane], local_blocks: &[u32], remote_blocks: &[u32]) -> BlockTable {
    BlockTable {
        planes: remote
            .iter()
            .enumerate()
            .map(|(i, p)| Plane {
                local: PlaneSide {
                    region: 0,
                    base: i as u64 * BLOCKS * BS,
                    stride: BS,
                },
                remote: PlaneSide {
                    region: p.region,
                    base: p.base,
                    stride: p.stride,
                },
                block_bytes: p.block_bytes,
            })
            .collect(),
        local_blocks: local_blocks.to_vec(),
        remote_blocks: remote_blocks.to_vec(),
    }
}

/// Every block the table names was moved, byte for byte.
fn moved(t: &BlockTable, src: &[HostMemory], dst: &HostMemory) {
    let to = bytes(dst);
    for p in &t.planes {
        let from = bytes(&src[p.remote.region as usize]);
        for (&l, &r) in t.local_blocks.iter().zip(&t.remote_blocks) {
            let lo = (p.local.base + u64::from(l) * p.local.stride) as usize;
            let ro = (p.remote.base + u64::from(r) * p.remote.stride) as usize;
            let n = p.block_bytes as usize;
            assert!(to[lo..lo + n] == from[ro..ro + n], "{p:?}: {l} ≠ {r}");
        }
    }
}

struct Pair {
    _a: InProcessAgent,
    b: InProcessAgent,
    prefill: Client,
    decode: Client,
    src: Vec<HostMemory>,
    dst: HostMemory,
    p: Segment,
    d: Segment,
}

/// Agent A serves the prefill's cache (two regions) and another segment; agent B a decode.
async fn pair(transports: &str) -> Pair {
    let store = MemoryStore::new();
    let a = agent("node-a", &store, transports).await;
    let b = agent("node-b", &store, transports).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let src = vec![random(2 * BLOCKS * BS, 1), random(2 * BLOCKS * BS, 2)];
    let dst = random(4 * BLOCKS * BS, 3);
    let p = prefill
        .register("prefill-0", &[&src[0], &src[1]], None)
        .await
        .unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    Pair {
        _a: a,
        b,
        prefill,
        decode,
        src,
        dst,
        p,
        d,
    }
}

async fn read_table(x: &Pair, key: u64, t: &BlockTable) -> kvfabric_client::Result<u64> {
    x.decode
        .submit_blocks(
            &x.d,
            "prefill-0",
            key,
            pb::Opcode::Read,
            t,
            SubmitOptions::default(),
        )
        .await
        .map(|r| r.bytes)
}

async fn reads_granted_blocks(transports: &str, expect: &str) {
    let x = pair(transports).await;
    let granted = [3u64, 7, 8, 40];
    let hold = x
        .prefill
        .create_hold(&x.p, &cache_planes(), &granted, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(hold.key != 0 && hold.key != x.p.key);
    assert!(hold.expires_in <= Duration::from_secs(60));
    // Every granted block of every plane, as a table.
    let t = table(&cache_planes(), &[0, 1, 2, 3], &[3, 7, 8, 40]);
    let done = x
        .decode
        .submit_blocks(
            &x.d,
            "prefill-0",
            hold.key,
            pb::Opcode::Read,
            &t,
            SubmitOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(done.transport, expect, "{done:?}");
    assert_eq!(done.bytes, 16 * BS);
    moved(&t, &x.src, &x.dst);
    // The V half of one block (a sub-range of a granted plane's block) as a table.
    let half = HoldPlane {
        base: BLOCKS * BS + BS / 2,
        block_bytes: BS / 2,
        ..cache_planes()[1]
    };
    let t = table(&[half], &[10], &[40]);
    read_table(&x, hold.key, &t).await.unwrap();
    moved(&t, &x.src, &x.dst);
    // As ops: a whole block of the interleaved layer, and a part of one.
    let ops = [
        Op {
            local_region: 0,
            local_offset: 200 * BS,
            remote_region: 1,
            remote_offset: (2 * 7 + 1) * BS,
            len: BS,
        },
        Op {
            local_region: 0,
            local_offset: 201 * BS,
            remote_region: 0,
            remote_offset: 8 * BS + 100,
            len: 1000,
        },
    ];
    x.decode
        .read(&x.d, "prefill-0", hold.key, &ops)
        .await
        .unwrap();
    let (to, r0, r1) = (bytes(&x.dst), bytes(&x.src[0]), bytes(&x.src[1]));
    let at = |b: u64| (b * BS) as usize;
    assert!(to[at(200)..at(201)] == r1[at(15)..at(16)]);
    assert!(to[at(201)..at(201) + 1000] == r0[at(8) + 100..at(8) + 1100]);
    // The segment key still reads everything (the owner's own use, and old readers).
    let all = table(&cache_planes(), &[0], &[9]);
    read_table(&x, x.p.key, &all).await.unwrap();
    moved(&all, &x.src, &x.dst);
    x.prefill.end_hold(&x.p, hold.key).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_key_reads_its_granted_blocks_over_tcp() {
    reads_granted_blocks("tcp", "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_key_reads_its_granted_blocks_over_shm() {
    reads_granted_blocks("shm,tcp", "shm").await;
}

/// The code of a refused call, and that neither side's memory changed.
async fn refused(
    x: &Pair,
    what: &str,
    call: impl std::future::Future<Output = kvfabric_client::Result<u64>>,
) {
    let before = [bytes(&x.dst), bytes(&x.src[0]), bytes(&x.src[1])];
    let e = call.await.expect_err(what);
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{what}: {e}");
    let after = [bytes(&x.dst), bytes(&x.src[0]), bytes(&x.src[1])];
    assert!(after == before, "{what}: bytes were written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_outside_the_grant_or_after_the_hold_are_refused_before_a_byte_moves() {
    let x = pair("tcp").await;
    let planes = cache_planes();
    let other_mem = random(2 * BLOCKS * BS, 9);
    let other = x
        .prefill
        .register("prefill-1", &[&other_mem, &other_mem], None)
        .await
        .unwrap();
    let hold = x
        .prefill
        .create_hold(&x.p, &planes, &[3, 7], Duration::from_secs(60))
        .await
        .unwrap();
    let key = hold.key;
    // A granted read first: the grant is cached at the decode's agent from here on, so every
    // refusal below is its check, not the prefill agent's.
    read_table(&x, key, &table(&planes, &[0], &[3]))
        .await
        .unwrap();
    refused(
        &x,
        "a block outside",
        read_table(&x, key, &table(&planes, &[0, 1], &[3, 4])),
    )
    .await;
    let wider = HoldPlane {
        stride: 2 * BS,
        ..planes[0]
    };
    refused(
        &x,
        "another stride",
        read_table(&x, key, &table(&[wider], &[0], &[3])),
    )
    .await;
    let shifted = HoldPlane {
        base: BS,
        ..planes[0]
    };
    refused(
        &x,
        "a plane shifted by a block (its block 3 is block 4)",
        read_table(&x, key, &table(&[shifted], &[0], &[3])),
    )
    .await;
    let op = |region, offset, len| Op {
        local_region: 0,
        local_offset: 0,
        remote_region: region,
        remote_offset: offset,
        len,
    };
    let xr = &x;
    let ops = move |v: Vec<Op>| async move {
        xr.decode
            .read(&xr.d, "prefill-0", key, &v)
            .await
            .map(|r| r.bytes)
    };
    refused(
        &x,
        "an op over two blocks",
        ops(vec![op(0, 3 * BS, 2 * BS)]),
    )
    .await;
    refused(&x, "an op of block 4", ops(vec![op(0, 4 * BS, 1)])).await;
    refused(
        &x,
        "one good op, one bad",
        ops(vec![op(0, 3 * BS, BS), op(1, 100 * BS, BS)]),
    )
    .await;
    refused(
        &x,
        "a write",
        x.decode
            .write(&x.d, "prefill-0", key, &[op(0, 3 * BS, BS)])
            .map_ok(),
    )
    .await;
    // Another segment of the same worker and agent.
    refused(
        &x,
        "another segment",
        x.decode
            .read(&x.d, "prefill-1", key, &[op(0, 3 * BS, BS)])
            .map_ok(),
    )
    .await;
    drop(other);
    // Expired: a hold of 300 ms, read within it, then not.
    let short = x
        .prefill
        .create_hold(&x.p, &planes, &[5], Duration::from_millis(300))
        .await
        .unwrap();
    read_table(&x, short.key, &table(&planes, &[0], &[5]))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    refused(
        &x,
        "an expired hold",
        read_table(&x, short.key, &table(&planes, &[0], &[5])),
    )
    .await;
    // Ended.
    x.prefill.end_hold(&x.p, key).await.unwrap();
    refused(
        &x,
        "an ended hold",
        read_table(&x, key, &table(&planes, &[0], &[3])),
    )
    .await;
    // The decode's agent counted the batches it refused under a hold key.
    let metrics = scrape(x.b.ready.metrics).await.unwrap();
    let refusals = metrics
        .iter()
        .find(|(n, _)| n == "kvfabric_agent_hold_refused_batches_total")
        .map(|(_, v)| *v);
    assert!(refusals >= Some(7.0), "{refusals:?}");
}

trait MapOk {
    fn map_ok(self) -> impl std::future::Future<Output = kvfabric_client::Result<u64>>;
}

impl<F: std::future::Future<Output = kvfabric_client::Result<pb::SubmitResponse>>> MapOk for F {
    async fn map_ok(self) -> kvfabric_client::Result<u64> {
        self.await.map(|r| r.bytes)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extending_a_hold_keeps_its_reader_reading() {
    let x = pair("tcp").await;
    let planes = cache_planes();
    let hold = x
        .prefill
        .create_hold(&x.p, &planes, &[1], Duration::from_millis(400))
        .await
        .unwrap();
    let t = table(&planes, &[0], &[1]);
    read_table(&x, hold.key, &t).await.unwrap();
    let left = x
        .prefill
        .extend_hold(&x.p, hold.key, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(left > Duration::from_secs(29), "{left:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Past the first expiry: the decode's agent asks again and gets the new one.
    read_table(&x, hold.key, &t).await.unwrap();
    moved(&t, &x.src, &x.dst);
    // Never shortened.
    let left = x
        .prefill
        .extend_hold(&x.p, hold.key, Duration::from_millis(1))
        .await
        .unwrap();
    assert!(left > Duration::from_secs(28), "{left:?}");
    x.prefill.end_hold(&x.p, hold.key).await.unwrap();
    let e = x
        .prefill
        .extend_hold(&x.p, hold.key, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    // Ending it again is no error: nothing under it can land.
    x.prefill.end_hold(&x.p, hold.key).await.unwrap();
}

/// EndHold returns only once a batch under the hold that was in flight has landed; the next
/// batch under it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_a_hold_waits_for_its_batch_in_flight() {
    let store = MemoryStore::new();
    // One data connection with 64 KiB socket buffers, so the batch is still in flight when
    // the hold is ended on a fast machine too.
    let paced = |c: &mut AgentConfig| {
        c.tcp_connections = 1;
        c.tcp_buffer = kvfabric_engine::TcpBuffer::Bytes(64 << 10);
    };
    let a = agent_with("node-a", &store, "tcp", paced).await;
    let b = agent_with("node-b", &store, "tcp", paced).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let block = 4u64 << 20;
    let blocks = 64;
    let src = random(blocks * block, 1);
    let dst = HostMemory::alloc(blocks * block).unwrap();
    let p = prefill.register("big", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let plane = HoldPlane {
        region: 0,
        base: 0,
        stride: block,
        block_bytes: block,
    };
    let ids: Vec<u64> = (0..blocks).collect();
    let hold = prefill
        .create_hold(&p, &[plane], &ids, Duration::from_secs(60))
        .await
        .unwrap();
    let ops: Vec<Op> = (0..blocks)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * block,
            remote_region: 0,
            remote_offset: i * block,
            len: block,
        })
        .collect();
    let one = &ops[..1];
    // Learn the grant (and open the connection) first, so the big batch starts moving at once.
    decode.read(&d, "big", hold.key, one).await.unwrap();
    // SAFETY: no batch is in flight. Landed bytes below are then the big batch's own.
    unsafe { dst.as_mut_slice() }.fill(0);
    let started = Instant::now();
    let reading = tokio::spawn({
        let (decode, d, ops) = (decode.clone(), d.clone(), ops.clone());
        async move { decode.read(&d, "big", hold.key, &ops).await }
    });
    // Until its first bytes land.
    while bytes_landed(&dst, block) == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        !reading.is_finished(),
        "the batch ended before the hold did: make it larger"
    );
    let ending = Instant::now();
    prefill
        .end_hold_within(&p, hold.key, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    let waited = ending.elapsed();
    // Every byte of the batch landed before EndHold answered.
    assert!(
        bytes(&dst) == bytes(&src),
        "EndHold returned after {waited:?} with the batch still landing"
    );
    let done = reading.await.unwrap().unwrap();
    assert_eq!(done.bytes, blocks * block);
    // And no batch starts under it any more.
    let e = decode.read(&d, "big", hold.key, one).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
    println!("EndHold waited {waited:?} for the batch in flight");
}

/// A batch under a hold is cut at the grant's end on the reader agent's own clock: a read
/// that would run past it fails DEADLINE_EXCEEDED, and nothing of it lands afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_under_a_hold_ends_when_the_grant_does() {
    let store = MemoryStore::new();
    // One data connection with 4 KiB socket buffers: 512 MiB then take seconds, far longer
    // than the hold, on any machine.
    let slow = |c: &mut AgentConfig| {
        c.tcp_connections = 1;
        c.tcp_buffer = kvfabric_engine::TcpBuffer::Bytes(4096);
    };
    let a = agent_with("node-a", &store, "tcp", slow).await;
    let b = agent_with("node-b", &store, "tcp", slow).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let (block, blocks) = (4u64 << 20, 128u64);
    let src = HostMemory::alloc(blocks * block).unwrap();
    let dst = HostMemory::alloc(blocks * block).unwrap();
    // SAFETY: nothing transfers into them yet (both pages are faulted in here, too).
    unsafe {
        src.as_mut_slice().fill(0xab);
        dst.as_mut_slice().fill(0);
    }
    let p = prefill.register("big", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let plane = HoldPlane {
        region: 0,
        base: 0,
        stride: block,
        block_bytes: block,
    };
    let ops: Vec<Op> = (0..blocks)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * block,
            remote_region: 0,
            remote_offset: i * block,
            len: block,
        })
        .collect();
    let one = [Op {
        len: 4096,
        ..ops[0]
    }];
    // The connection is opened first, so the hold's time goes to its batches.
    decode.read(&d, "big", p.key, &one).await.unwrap();
    let ttl = Duration::from_millis(500);
    let ids: Vec<u64> = (0..blocks).collect();
    let created = Instant::now();
    let hold = prefill.create_hold(&p, &[plane], &ids, ttl).await.unwrap();
    decode.read(&d, "big", hold.key, &one).await.unwrap();
    let e = decode.read(&d, "big", hold.key, &ops).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    let ended = created.elapsed();
    // Cut at the hold's end, with room for a loaded machine's answer.
    assert!(ended < ttl * 2, "{ended:?}, the hold {ttl:?}");
    // The hold has ended; give the chunk that was being copied when the batch was cut (the
    // rest are discarded unread) time to finish.
    tokio::time::sleep((ttl + Duration::from_millis(300)).saturating_sub(created.elapsed())).await;
    let then = bytes(&dst);
    assert!(
        then != bytes(&src),
        "every byte landed: the hold's end did not cut the batch"
    );
    let landed = then.chunks_exact(4096).filter(|c| c[4095] != 0).count();
    println!(
        "cut at {ended:?} under a hold of {ttl:?}: {landed} of {} pages landed",
        then.len() / 4096
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(bytes(&dst) == then, "bytes landed after the hold ended");
}

/// Blocks of `dst` whose last 8 bytes are no longer zero.
fn bytes_landed(dst: &HostMemory, block: u64) -> usize {
    // SAFETY: a racy read of the destination of a batch in flight: only as a hint of progress.
    let m = unsafe { dst.as_slice() };
    (0..m.len() / block as usize)
        .filter(|&i| {
            let end = (i + 1) * block as usize;
            m[end - 8..end].iter().any(|&b| b != 0)
        })
        .count()
}

/// A registry entry for an agent whose peer port accepts connections and never answers (as a
/// SIGSTOPped agent's does: the kernel completes the handshakes).
async fn hung_agent(store: &MemoryStore, name: &str) -> (tokio::net::TcpListener, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = store.registry();
    fake.register_agent(AgentEntry {
        name: name.into(),
        pool: "decode".into(),
        role: None,
        node: "hung-boot-id".into(),
        peer_addr: addr,
        devices: Devices::default(),
        started_at: 1,
        instance: 0,
    })
    .await
    .unwrap();
    std::mem::forget(fake);
    (listener, addr)
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

fn with_token<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    TOKEN.parse::<PeerToken>().unwrap().attach(&mut r);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_a_hold_granted_to_a_hung_agent_is_deadline_exceeded_with_its_time_left() {
    let store = MemoryStore::new();
    let a = agent("node-a", &store, "tcp").await;
    let (_held, _) = hung_agent(&store, "node-hung").await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let m = random(2 * BLOCKS * BS, 1);
    let p = prefill
        .register("prefill-0", &[&m, &m], None)
        .await
        .unwrap();
    let hold = prefill
        .create_hold(&p, &cache_planes(), &[2], Duration::from_secs(60))
        .await
        .unwrap();
    // The hung agent asked for the hold (before it hung) and was granted it.
    let mut peer = peer_client(&a).await;
    let ask = || pb::SegmentAccessRequest {
        fabric: "test".into(),
        agent: "node-hung".into(),
        segment: "prefill-0".into(),
        key: hold.key,
    };
    let given = peer.segment_access(with_token(ask())).await.unwrap();
    let grant = given
        .into_inner()
        .grant
        .expect("a hold key's answer carries its grant");
    assert_eq!(grant.block_ids, [2]);
    assert_eq!(grant.planes.len(), 4);
    assert!(grant.expires_in_ms <= 60_000 && grant.expires_in_ms > 50_000);
    let start = Instant::now();
    let e = prefill
        .end_hold_within(&p, hold.key, Some(Duration::from_secs(1)))
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(e.to_string().contains("node-hung"), "{e}");
    let left: u64 = e
        .to_string()
        .split("expires in ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no time left in {e}"));
    assert!((50_000..=60_000).contains(&left), "{left}");
    // Its grant is no longer handed out meanwhile.
    let e = peer.segment_access(with_token(ask())).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Asked again, it waits for that agent again.
    let e = prefill
        .end_hold_within(&p, hold.key, Some(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::DeadlineExceeded), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_learns_nothing_from_a_hold_key() {
    let store = MemoryStore::new();
    let a = agent("node-a", &store, "tcp").await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let m = random(2 * BLOCKS * BS, 1);
    let p = prefill
        .register("prefill-0", &[&m, &m], None)
        .await
        .unwrap();
    let hold = prefill
        .create_hold(&p, &cache_planes(), &[2], Duration::from_secs(60))
        .await
        .unwrap();
    let mut peer = peer_client(&a).await;
    let ask = |key| pb::SegmentAccessRequest {
        fabric: "test".into(),
        agent: "stranger".into(),
        segment: "prefill-0".into(),
        key,
    };
    // No token: refused before the request is read, saying nothing of the segment or hold.
    let e = peer.segment_access(ask(hold.key)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    for secret in ["prefill", "region", "block", "grant", "hold"] {
        assert!(!e.message().contains(secret), "{e:?}");
    }
    let revoke = pb::RevokeHoldRequest {
        fabric: "test".into(),
        agent: "stranger".into(),
        segment: "prefill-0".into(),
        hold_key: hold.key,
        wait_ms: 10,
    };
    let e = peer.revoke_hold(revoke).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    // A fabric member with a key that is no live hold's: refused, no grant, no regions.
    let e = peer
        .segment_access(with_token(ask(hold.key ^ 1)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // The stranger was never recorded: ending the hold asks no one and succeeds at once.
    prefill.end_hold(&p, hold.key).await.unwrap();
}

/// What CreateHold refuses names the field; nothing is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_holds_are_typed_errors_naming_the_field() {
    let store = MemoryStore::new();
    let a = agent("node-a", &store, "tcp").await;
    let b = agent("node-b", &store, "tcp").await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let m = random(2 * BLOCKS * BS, 1);
    let p = prefill
        .register("prefill-0", &[&m, &m], None)
        .await
        .unwrap();
    let planes = cache_planes();
    let create = |planes: Vec<HoldPlane>, ids: Vec<u64>, ttl: Duration| {
        let (prefill, p) = (prefill.clone(), p.clone());
        async move { prefill.create_hold(&p, &planes, &ids, ttl).await }
    };
    let minute = Duration::from_secs(60);
    let field_of = |e: &kvfabric_client::Error| e.to_string();
    let mut bad = planes.clone();
    bad[3].stride = u64::MAX / 2;
    let e = create(bad, vec![0, 5], minute).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(field_of(&e).contains("planes[3].stride"), "{e}");
    let mut bad = planes.clone();
    bad[2].base = u64::MAX - 10;
    let e = create(bad, vec![0], minute).await.unwrap_err();
    assert!(field_of(&e).contains("planes[2].stride"), "{e}");
    // Inside 2^64 but past the region: block 64 of the V plane.
    let e = create(planes.clone(), vec![BLOCKS], minute)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(field_of(&e).contains("planes[1]"), "{e}");
    let mut bad = planes.clone();
    bad[0].region = 2;
    let e = create(bad, vec![0], minute).await.unwrap_err();
    assert!(field_of(&e).contains("planes[0].region"), "{e}");
    let mut bad = planes.clone();
    bad[1].block_bytes = 0;
    let e = create(bad, vec![0], minute).await.unwrap_err();
    assert!(field_of(&e).contains("planes[1].block_bytes"), "{e}");
    let e = create(vec![planes[0]; 4097], vec![0], minute)
        .await
        .unwrap_err();
    assert!(field_of(&e).contains("invalid planes: 4097"), "{e}");
    let e = create(planes.clone(), vec![0; (1 << 20) + 1], minute)
        .await
        .unwrap_err();
    assert!(field_of(&e).contains("block_ids"), "{e}");
    let e = create(planes.clone(), Vec::new(), minute)
        .await
        .unwrap_err();
    assert!(field_of(&e).contains("block_ids"), "{e}");
    let e = create(planes.clone(), vec![0], Duration::from_secs(3601))
        .await
        .unwrap_err();
    assert!(field_of(&e).contains("ttl_ms"), "{e}");
    // The segment's key is needed; a hold is made where the segment is registered.
    let e = prefill
        .create_hold(
            &Segment {
                key: p.key ^ 1,
                ..p.clone()
            },
            &planes,
            &[0],
            minute,
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
    let elsewhere = Client::connect(b.socket_dir()).await.unwrap();
    let e = elsewhere
        .create_hold(&p, &planes, &[0], minute)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    assert!(e.to_string().contains("node-a"), "{e}");
    // A plane of the whole region and 2^20 ids, at the bounds: granted.
    create(
        vec![HoldPlane {
            region: 0,
            base: 0,
            stride: 0,
            block_bytes: 2 * BLOCKS * BS,
        }],
        (0..1 << 20).collect(),
        Duration::from_millis(1),
    )
    .await
    .unwrap();
    let metrics = scrape(a.ready.metrics).await.unwrap();
    let created = metrics
        .iter()
        .find(|(n, _)| n == "kvfabric_agent_holds_created_total")
        .map(|(_, v)| *v);
    assert_eq!(created, Some(1.0));
}

/// A reader served by the segment's own agent (both workers on one node, one agent): the
/// grant is checked, and ending the hold revokes it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_on_the_owner_s_agent_is_held_to_the_grant_too() {
    let store = MemoryStore::new();
    let a = agent("node-a", &store, "shm,tcp").await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(a.socket_dir()).await.unwrap();
    let src = [random(2 * BLOCKS * BS, 1), random(2 * BLOCKS * BS, 2)];
    let dst = random(4 * BLOCKS * BS, 3);
    let p = prefill
        .register("prefill-0", &[&src[0], &src[1]], None)
        .await
        .unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let planes = cache_planes();
    let hold = prefill
        .create_hold(&p, &planes, &[6], Duration::from_secs(60))
        .await
        .unwrap();
    let read = |t: BlockTable| {
        let (decode, d) = (decode.clone(), d.clone());
        async move {
            decode
                .submit_blocks(
                    &d,
                    "prefill-0",
                    hold.key,
                    pb::Opcode::Read,
                    &t,
                    SubmitOptions::default(),
                )
                .await
        }
    };
    let t = table(&planes, &[0], &[6]);
    read(t.clone()).await.unwrap();
    moved(&t, &src, &dst);
    let e = read(table(&planes, &[0], &[7])).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
    prefill.end_hold(&p, hold.key).await.unwrap();
    let e = read(t).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
    let live = scrape(a.ready.metrics)
        .await
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n.starts_with("kvfabric_agent_holds_"))
        .collect::<Vec<_>>();
    let value = |name: &str| live.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
    assert_eq!(value("kvfabric_agent_holds_live"), Some(0.0), "{live:?}");
    assert_eq!(
        value("kvfabric_agent_holds_ended_total"),
        Some(1.0),
        "{live:?}"
    );
}
