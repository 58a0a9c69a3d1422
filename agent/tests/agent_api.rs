//! Two agents in one process sharing an in-memory registry: workers register memory, pull and
//! push by segment name over tcp and shm, and bad requests get typed gRPC statuses.

use std::path::PathBuf;
use std::time::Duration;

use kvfabric_agent::AgentConfig;
use kvfabric_agent::metrics::scrape;
use kvfabric_agent::peer_token::PeerToken;
use kvfabric_agent::registry::memory::{MemoryRegistry, MemoryStore};
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, Op};
use kvfabric_engine::TransportKind;
use kvfabric_proto::pb::{self, SubmitRequest};
use kvfabric_testkit::InProcessAgent;
use rand::{RngCore, SeedableRng};
use tonic::Code;

struct TestAgent(InProcessAgent);

fn transports(list: &str) -> Vec<TransportKind> {
    list.split(',')
        .map(|t| kvfabric_agent::config::parse_transport(t).unwrap())
        .collect()
}

impl TestAgent {
    async fn start(name: &str, list: &str, store: &MemoryStore) -> TestAgent {
        TestAgent::start_with(name, list, store, |_| {}).await
    }

    async fn start_with(
        name: &str,
        list: &str,
        store: &MemoryStore,
        adjust: impl FnOnce(&mut AgentConfig),
    ) -> TestAgent {
        let mut config = InProcessAgent::config(name);
        config.transports = transports(list);
        config.batch_timeout = Duration::from_secs(5);
        config.max_batch_ops = 1000;
        adjust(&mut config);
        TestAgent(
            InProcessAgent::start(config, store.registry(), Telemetry::default())
                .await
                .unwrap(),
        )
    }

    fn socket_dir(&self) -> PathBuf {
        self.0.socket_dir().to_path_buf()
    }

    async fn stop(self) {
        self.0.stop().await.unwrap();
    }
}

fn random(len: u64, seed: u64) -> HostMemory {
    let m = HostMemory::alloc(len).unwrap();
    // SAFETY: nothing transfers into it yet.
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(unsafe { m.as_mut_slice() });
    m
}

fn blocks(n: u64, block: u64, stride: u64) -> Vec<Op> {
    (0..n)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * block,
            remote_region: 0,
            remote_offset: (i * stride) % 64 * block,
            len: block,
        })
        .collect()
}

/// Every op's destination block holds its source block (after a completed pull).
fn pulled_exactly(ops: &[Op], src: &HostMemory, dst: &HostMemory) {
    // SAFETY: the caller's batch completed; nothing is in flight.
    let (from, to) = unsafe { (src.as_slice(), dst.as_slice()) };
    for o in ops {
        let (lo, ro, n) = (
            o.local_offset as usize,
            o.remote_offset as usize,
            o.len as usize,
        );
        assert!(to[lo..lo + n] == from[ro..ro + n], "block at {lo} differs");
    }
}

async fn pull_and_push(transports: &str, expect: &str) {
    let store = MemoryStore::new();
    let a = TestAgent::start("node-a", transports, &store).await;
    let b = TestAgent::start("node-b", transports, &store).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();

    let block = 32 << 10;
    let src = random(64 * block, 1);
    let dst = random(64 * block, 2);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode
        .register("decode-0", &[&dst], Some(77))
        .await
        .unwrap();
    assert_eq!(d.key, 77);

    let ops = blocks(32, block, 7);
    let done = decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    assert_eq!(done.bytes, 32 * block);
    assert_eq!(done.transport, expect, "{done:?}");
    assert_eq!(done.remote_agent, "node-a");
    pulled_exactly(&ops, &src, &dst);
    // SAFETY: the batch completed; nothing is in flight.
    let t = unsafe { dst.as_slice() };
    // Untouched blocks keep their bytes.
    let untouched = random(64 * block, 2);
    // SAFETY: as above.
    let u = unsafe { untouched.as_slice() };
    assert!(t[32 * block as usize..] == u[32 * block as usize..]);

    // Push back the other way: decode's first block into prefill's last.
    let push = [Op {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 63 * block,
        len: block,
    }];
    decode.write(&d, "prefill-0", p.key, &push).await.unwrap();
    // SAFETY: as above.
    let s = unsafe { src.as_slice() };
    assert!(s[63 * block as usize..] == t[..block as usize]);

    let status = decode.status().await.unwrap();
    assert_eq!(status.data_tls, None, "plaintext agents");
    assert_eq!(status.agents.len(), 2, "{status:?}");
    assert_eq!(status.segments.len(), 2);
    assert_eq!(status.connections.len(), 1);
    assert_eq!(status.connections[0].transport, expect);
    assert!(status.connections[0].bytes >= 33 * block);

    // The decode agent's metrics: scraped over HTTP and parsed.
    let metrics = scrape(b.0.ready.metrics).await.unwrap();
    let peer = format!("{{transport=\"{expect}\",peer=\"node-a\"}}");
    let value = |name: &str| -> f64 {
        metrics
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{name} missing in {metrics:?}"))
    };
    assert!(value(&format!("kvfabric_agent_bytes_total{peer}")) >= (33 * block) as f64);
    assert_eq!(value(&format!("kvfabric_agent_batches_total{peer}")), 2.0);
    assert_eq!(value("kvfabric_agent_registry_agents"), 2.0);
    assert_eq!(value("kvfabric_agent_registry_segments"), 2.0);
    assert_eq!(value("kvfabric_agent_open_connections"), 1.0);
    assert_eq!(value("kvfabric_agent_local_segments"), 1.0);
    let histogram =
        format!("kvfabric_agent_batch_duration_seconds_count{{transport=\"{expect}\"}}");
    assert_eq!(value(&histogram), 2.0);
    if expect == "tcp" {
        // The prefill agent served those bytes.
        let served = scrape(a.0.ready.metrics).await.unwrap();
        assert!(
            served.iter().any(|(n, v)| n
                .starts_with("kvfabric_agent_served_bytes_total{op=\"read\"}")
                && *v >= (32 * block) as f64),
            "{served:?}"
        );
    }

    decode.deregister(&d).await.unwrap();
    assert!(prefill.status().await.unwrap().segments.len() == 1);
    b.stop().await;
    a.stop().await;
    assert!(store_is_empty(&store));
}

fn store_is_empty(store: &MemoryStore) -> bool {
    let r = MemoryRegistry::new(store);
    use kvfabric_agent::registry::Registry;
    r.segments().is_empty() && r.agents().is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_pull_and_push_by_segment_name_over_tcp() {
    pull_and_push("tcp", "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_on_one_node_use_shared_memory() {
    pull_and_push("shm,tcp", "shm").await;
}

/// A block table through two agents (worker → agent → peer agent → worker memory): K and V
/// planes of 8 layers, each side its own layout (layers in separate regions locally, K and V
/// interleaved in one region remotely), pulled and then pushed, every block exactly where the
/// table says.
async fn tables_through_agents(transports: &str, expect: &str) {
    use kvfabric_client::{BlockTable, Plane, PlaneSide, SubmitOptions};
    let store = MemoryStore::new();
    let a = TestAgent::start("node-a", transports, &store).await;
    let b = TestAgent::start("node-b", transports, &store).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let (bs, blocks, layers) = (4096u64, 64u64, 8u32);
    // Remote: one region, block b of layer l's K at (b × layers + l) × 2 bs, its V right after.
    let src = random(blocks * u64::from(layers) * 2 * bs, 1);
    // Local: one region per layer, K in its first half, V in its second.
    let dst: Vec<HostMemory> = (0..layers)
        .map(|l| random(2 * blocks * bs, 10 + u64::from(l)))
        .collect();
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode
        .register("decode-0", &dst.iter().collect::<Vec<_>>(), None)
        .await
        .unwrap();
    let planes: Vec<Plane> = (0..layers)
        .flat_map(|l| {
            (0..2u64).map(move |kv| Plane {
                local: PlaneSide {
                    region: l,
                    base: kv * blocks * bs,
                    stride: bs,
                },
                remote: PlaneSide {
                    region: 0,
                    base: (u64::from(l) * 2 + kv) * bs,
                    stride: u64::from(layers) * 2 * bs,
                },
                block_bytes: bs,
            })
        })
        .collect();
    let table = BlockTable {
        planes: planes.clone(),
        local_blocks: vec![5, 0, 63, 17, 18, 19],
        remote_blocks: vec![1, 2, 3, 40, 41, 0],
    };
    let done = decode
        .submit_blocks(
            &d,
            "prefill-0",
            p.key,
            pb::Opcode::Read,
            &table,
            SubmitOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(done.transport, expect, "{done:?}");
    assert_eq!(done.ops as usize, planes.len() * 6);
    assert_eq!(done.bytes, planes.len() as u64 * 6 * bs);
    let moved = |src: &[u8], dst: &[HostMemory], planes: &[Plane], t: &BlockTable| {
        for p in planes {
            // SAFETY: the batch completed; nothing is in flight.
            let to = unsafe { dst[p.local.region as usize].as_slice() };
            for (&l, &r) in t.local_blocks.iter().zip(&t.remote_blocks) {
                let lo = (p.local.base + u64::from(l) * p.local.stride) as usize;
                let ro = (p.remote.base + u64::from(r) * p.remote.stride) as usize;
                assert!(
                    to[lo..lo + bs as usize] == src[ro..ro + bs as usize],
                    "plane {p:?}: local block {l} ≠ remote block {r}"
                );
            }
        }
    };
    // SAFETY: the batch completed; nothing is in flight.
    moved(unsafe { src.as_slice() }, &dst, &planes, &table);
    // Push other blocks back into the remote region, and check them there.
    let back = BlockTable {
        planes: planes.clone(),
        local_blocks: vec![1, 2, 3],
        remote_blocks: vec![60, 61, 62],
    };
    decode
        .submit_blocks(
            &d,
            "prefill-0",
            p.key,
            pb::Opcode::Write,
            &back,
            SubmitOptions {
                checksum: true,
                ..SubmitOptions::default()
            },
        )
        .await
        .unwrap();
    for p in &planes {
        // SAFETY: the batch completed; nothing is in flight.
        let (from, to) = unsafe { (dst[p.local.region as usize].as_slice(), src.as_slice()) };
        for (&l, &r) in back.local_blocks.iter().zip(&back.remote_blocks) {
            let lo = (p.local.base + u64::from(l) * p.local.stride) as usize;
            let ro = (p.remote.base + u64::from(r) * p.remote.stride) as usize;
            assert!(to[ro..ro + bs as usize] == from[lo..lo + bs as usize]);
        }
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_tables_move_through_agents_over_tcp() {
    tables_through_agents("tcp", "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_tables_move_through_agents_over_shm() {
    tables_through_agents("shm,tcp", "shm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_typed_statuses_and_the_agent_keeps_serving() {
    let store = MemoryStore::new();
    let a = TestAgent::start("node-a", "tcp", &store).await;
    let b = TestAgent::start("node-b", "tcp", &store).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let src = random(1 << 20, 1);
    let dst = random(1 << 20, 2);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let op = pb::BlockOp {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: 0,
        len: 4096,
    };
    let good = SubmitRequest {
        local_segment: d.name.clone(),
        local_key: d.key,
        remote_segment: p.name.clone(),
        remote_key: p.key,
        opcode: pb::Opcode::Read as i32,
        ops: vec![op],
        timeout_ms: 0,
        checksum: false,
        table: None,
    };
    // One plane of 4 KiB blocks on each side's region 0, blocks 0 and 1.
    let side = |region, base| pb::PlaneSide {
        region,
        base,
        stride: 4096,
    };
    let table = |planes: Vec<pb::Plane>, local: Vec<u32>, remote: Vec<u32>| SubmitRequest {
        ops: vec![],
        table: Some(pb::BlockTable {
            planes,
            local_blocks: local,
            remote_blocks: remote,
        }),
        ..good.clone()
    };
    let plane = |local, remote| pb::Plane {
        local: Some(local),
        remote: Some(remote),
        block_bytes: 4096,
    };
    let cases: Vec<(&str, SubmitRequest, Code, &str)> = vec![
        (
            "unknown remote segment",
            SubmitRequest {
                remote_segment: "nope".into(),
                ..good.clone()
            },
            Code::NotFound,
            "nope",
        ),
        (
            "unknown local segment",
            SubmitRequest {
                local_segment: "mine?".into(),
                ..good.clone()
            },
            Code::NotFound,
            "mine?",
        ),
        (
            "wrong remote key",
            SubmitRequest {
                remote_key: p.key ^ 1,
                ..good.clone()
            },
            Code::PermissionDenied,
            "prefill-0",
        ),
        (
            "wrong local key",
            SubmitRequest {
                local_key: d.key ^ 1,
                ..good.clone()
            },
            Code::PermissionDenied,
            "decode-0",
        ),
        (
            "oversized batch",
            SubmitRequest {
                ops: vec![op; 1001],
                ..good.clone()
            },
            Code::InvalidArgument,
            "1001",
        ),
        (
            "empty batch",
            SubmitRequest {
                ops: vec![],
                ..good.clone()
            },
            Code::InvalidArgument,
            "at least one op",
        ),
        (
            "region index out of range",
            SubmitRequest {
                ops: vec![pb::BlockOp {
                    remote_region: 3,
                    ..op
                }],
                ..good.clone()
            },
            Code::InvalidArgument,
            "remote_region",
        ),
        (
            "remote offset out of bounds",
            SubmitRequest {
                ops: vec![pb::BlockOp {
                    remote_offset: (1 << 20) - 100,
                    ..op
                }],
                ..good.clone()
            },
            Code::InvalidArgument,
            "remote_offset",
        ),
        (
            "bad opcode",
            SubmitRequest {
                opcode: 9,
                ..good.clone()
            },
            Code::InvalidArgument,
            "opcode",
        ),
        (
            "ops and a table",
            SubmitRequest {
                ops: vec![op],
                ..table(vec![plane(side(0, 0), side(0, 0))], vec![0], vec![0])
            },
            Code::InvalidArgument,
            "not both",
        ),
        (
            "table ids unpaired",
            table(vec![plane(side(0, 0), side(0, 0))], vec![0, 1], vec![0]),
            Code::InvalidArgument,
            "table.remote_blocks",
        ),
        (
            "table plane side unset",
            table(
                vec![pb::Plane {
                    remote: None,
                    ..plane(side(0, 0), side(0, 0))
                }],
                vec![0],
                vec![0],
            ),
            Code::InvalidArgument,
            "table.planes[0].remote",
        ),
        (
            "table region index out of range",
            table(
                vec![
                    plane(side(0, 0), side(0, 0)),
                    plane(side(0, 1 << 19), side(2, 0)),
                ],
                vec![0],
                vec![0],
            ),
            Code::InvalidArgument,
            "table.planes[1].remote_region",
        ),
        (
            "table past the remote region",
            table(vec![plane(side(0, 0), side(0, 0))], vec![0], vec![256]),
            Code::InvalidArgument,
            "plane 0: remote block 256",
        ),
        (
            "table writing one block twice",
            table(vec![plane(side(0, 0), side(0, 0))], vec![3, 3], vec![0, 1]),
            Code::InvalidArgument,
            "both write local block 3",
        ),
        (
            // 2 planes × 501 blocks pass the limit of 1000 block ops.
            "oversized table",
            table(
                vec![plane(side(0, 0), side(0, 0)), plane(side(0, 1), side(0, 0))],
                (0..501).collect(),
                vec![0; 501],
            ),
            Code::InvalidArgument,
            "1002",
        ),
        (
            "empty table",
            table(vec![], vec![0], vec![0]),
            Code::InvalidArgument,
            "at least one op",
        ),
    ];
    for (what, req, code, needle) in cases {
        let s = decode.submit_raw(req).await.unwrap_err();
        assert_eq!(s.code(), code, "{what}: {s:?}");
        assert!(s.message().contains(needle), "{what}: {}", s.message());
    }
    let untouched = random(1 << 20, 2);
    let same = {
        // SAFETY: every bad batch was refused before any I/O; nothing is in flight.
        unsafe { dst.as_slice() == untouched.as_slice() }
    };
    assert!(same, "a refused batch wrote");

    // Registration mistakes.
    let mut grpc = decode.grpc();
    let malformed = pb::RegisterSegmentRequest {
        name: "gpu-0".into(),
        regions: vec![pb::RegionSpec {
            memory: Some(pb::region_spec::Memory::Cuda(pb::CudaMemory {
                device: 0,
                device_uuid: String::new(),
                ipc_handle: vec![1, 2, 3],
                offset: 0,
                len: 4096,
            })),
        }],
        key: 0,
        detached: false,
        fabric_access: false,
    };
    let s = grpc.register_segment(malformed).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("64 bytes"), "{}", s.message());
    let not_a_uuid = pb::RegisterSegmentRequest {
        name: "gpu-0".into(),
        regions: vec![pb::RegionSpec {
            memory: Some(pb::region_spec::Memory::Cuda(pb::CudaMemory {
                device: 0,
                ipc_handle: vec![0; 64],
                offset: 0,
                len: 4096,
                device_uuid: "GPU-not-a-uuid".into(),
            })),
        }],
        key: 0,
        detached: false,
        fabric_access: false,
    };
    let s = grpc.register_segment(not_a_uuid).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(
        s.message().contains("regions[0].device_uuid") && s.message().contains("not a GPU UUID"),
        "{}",
        s.message()
    );
    let bogus_token = pb::RegisterSegmentRequest {
        name: "host-0".into(),
        regions: vec![pb::RegionSpec {
            memory: Some(pb::region_spec::Memory::Host(pb::HostMemory {
                fd_token: 42,
            })),
        }],
        key: 0,
        detached: false,
        fabric_access: false,
    };
    let s = grpc.register_segment(bogus_token).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("fd_token"), "{}", s.message());
    let other = random(4096, 3);
    let err = decode
        .register("prefill-0", &[&other], None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("AlreadyExists"), "{err}");
    let err = decode
        .register("bad/name", &[&other], None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("InvalidArgument"), "{err}");

    // Still serving.
    decode.submit_raw(good).await.unwrap();
    b.stop().await;
    a.stop().await;
}

/// `--transports rdma,tcp` where rdma cannot work (no device here, none in the peer's registry
/// entry, or a build without rdma): the link falls back to tcp, and the batch result says why
/// rdma was not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_rdma_devices_the_link_falls_back_to_tcp_and_says_why() {
    let store = MemoryStore::new();
    let a = TestAgent::start("node-a", "rdma,tcp", &store).await;
    let b = TestAgent::start("node-b", "rdma,tcp", &store).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let block = 16 << 10;
    let src = random(64 * block, 1);
    let dst = random(64 * block, 2);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let ops = blocks(8, block, 3);
    let done = decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    assert_eq!(done.transport, "tcp", "{done:?}");
    let reason = &done.transport_reason;
    assert!(reason.starts_with("rdma not possible: "), "{reason}");
    // This machine has no RDMA device: the reason names it (or the build without rdma), and
    // the peer agent's empty device list.
    assert!(
        reason.contains("no usable RDMA device") || reason.contains("not built"),
        "{reason}"
    );
    assert!(
        reason.contains("peer agent node-a lists no RDMA devices"),
        "{reason}"
    );
    pulled_exactly(&ops, &src, &dst);
    let status = decode.status().await.unwrap();
    assert_eq!(status.connections.len(), 1);
    assert_eq!(status.connections[0].transport, "tcp");
    b.stop().await;
    a.stop().await;
}

/// The peer API's RdmaConnect: other fabrics are refused, garbage is a named bad argument, and
/// an agent without a usable RDMA device answers FAILED_PRECONDITION saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_connect_refuses_with_typed_statuses() {
    use kvfabric_engine::ConnectInfo;
    use kvfabric_engine::rdma::{LinkLayer, Mtu, QpInfo};
    use kvfabric_proto::pb::RdmaConnectRequest;
    use kvfabric_proto::pb::peer_agent_client::PeerAgentClient;

    let store = MemoryStore::new();
    let a = TestAgent::start("node-a", "rdma,tcp", &store).await;
    let mut client = PeerAgentClient::connect(format!("http://{}", a.0.ready.peer))
        .await
        .unwrap();
    let offer = ConnectInfo::new(vec![QpInfo {
        nic: "mlx5_0".into(),
        port: 1,
        link_layer: LinkLayer::Ethernet,
        lid: 0,
        gid: "::ffff:10.0.0.9".parse().unwrap(),
        mtu: Mtu::M4096,
        qpn: 0x1234,
        psn: 7,
    }])
    .with_session(42);
    let call = |fabric: &str, json: String| RdmaConnectRequest {
        fabric: fabric.into(),
        agent: "node-b".into(),
        connect_info_json: json,
    };
    let err = client
        .rdma_connect(call("other", offer.to_json()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = client
        .rdma_connect(call(
            "test",
            offer.to_json().replace("\"qpn\":4660", "\"qpn\":1"),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("qpn"), "{}", err.message());
    let err = client
        .rdma_connect(call("test", offer.to_json()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("no usable RDMA device"),
        "{}",
        err.message()
    );
    a.stop().await;
}

/// With a peer token set, the peer API (which hands out region keys) admits only callers that
/// present it: agents sharing the token move data, an agent with another token is refused with
/// a reason and the refusing agent keeps serving, and a bare gRPC caller learns nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_api_admits_only_callers_with_the_fabric_token() {
    use kvfabric_proto::pb::HandshakeRequest;
    use kvfabric_proto::pb::peer_agent_client::PeerAgentClient;

    const TOKEN: &str = "fabric-token-0123456789";
    let store = MemoryStore::new();
    let token = |t: &str| {
        let t: PeerToken = t.parse().unwrap();
        move |c: &mut AgentConfig| c.peer_token = Some(t)
    };
    let a = TestAgent::start_with("node-a", "tcp", &store, token(TOKEN)).await;
    let b = TestAgent::start_with("node-b", "tcp", &store, token(TOKEN)).await;
    let c = TestAgent::start_with("node-c", "tcp", &store, token("some-other-token-987")).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let block = 4096;
    let src = random(64 * block, 3);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let ops = blocks(8, block, 5);

    let stranger = Client::connect(c.socket_dir()).await.unwrap();
    let theirs = random(64 * block, 4);
    let s = stranger
        .register("decode-c", &[&theirs], None)
        .await
        .unwrap();
    let err = stranger
        .read(&s, "prefill-0", p.key, &ops)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("peer token that is not this fabric's"),
        "{err}"
    );
    let before = random(64 * block, 4);
    // SAFETY: the refused batch left nothing in flight.
    assert!(unsafe { theirs.as_slice() == before.as_slice() });

    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let dst = random(64 * block, 5);
    let d = decode.register("decode-b", &[&dst], None).await.unwrap();
    let done = decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    assert_eq!(done.bytes, 8 * block);
    pulled_exactly(&ops, &src, &dst);

    let mut raw = PeerAgentClient::connect(format!("http://{}", a.0.ready.peer))
        .await
        .unwrap();
    let call = |fabric: &str, token: Option<&str>| {
        let mut r = tonic::Request::new(HandshakeRequest {
            fabric: fabric.into(),
            agent: "intruder".into(),
        });
        if let Some(t) = token {
            r.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        r
    };
    for (fabric, token, code) in [
        ("test", None, Code::Unauthenticated),
        (
            "test",
            Some("fabric-token-012345678"),
            Code::Unauthenticated,
        ),
        (
            "test",
            Some("fabric-token-01234567890"),
            Code::Unauthenticated,
        ),
        // The token is checked first: a caller without it does not learn the fabric is wrong.
        ("other", None, Code::Unauthenticated),
        ("other", Some(TOKEN), Code::PermissionDenied),
    ] {
        let err = raw.handshake(call(fabric, token)).await.unwrap_err();
        assert_eq!(err.code(), code, "{fabric} {token:?}: {err:?}");
        assert!(!err.message().contains("prefill"), "{}", err.message());
    }
    let reply = raw.handshake(call("test", Some(TOKEN))).await.unwrap();
    assert_eq!(reply.get_ref().agent, "node-a");
    // Its engine's data secret, which data connections to it must prove.
    assert_eq!(reply.get_ref().data_secret.len(), 32);
    c.stop().await;
    b.stop().await;
    a.stop().await;
}

/// A segment registered after the data connection opened: the link learns its regions with one
/// more handshake (keeping the connection), and still checks its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_registered_after_the_link_opened_are_learned_and_key_checked() {
    let store = MemoryStore::new();
    let a = TestAgent::start("node-a", "tcp", &store).await;
    let b = TestAgent::start("node-b", "tcp", &store).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let block = 4096;
    let first = random(64 * block, 6);
    let p0 = prefill
        .register("prefill-0", &[&first], None)
        .await
        .unwrap();
    let dst = random(64 * block, 7);
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let ops = blocks(4, block, 3);
    decode.read(&d, "prefill-0", p0.key, &ops).await.unwrap();
    pulled_exactly(&ops, &first, &dst);

    let later = random(64 * block, 8);
    let p1 = prefill
        .register("prefill-1", &[&later], None)
        .await
        .unwrap();
    let wrong = decode
        .read(&d, "prefill-1", p1.key ^ 1, &ops)
        .await
        .unwrap_err();
    assert!(
        wrong.to_string().contains("prefill-1") && wrong.to_string().contains("key"),
        "{wrong}"
    );
    let done = decode.read(&d, "prefill-1", p1.key, &ops).await.unwrap();
    assert_eq!(done.bytes, 4 * block);
    pulled_exactly(&ops, &later, &dst);
    let status = decode.status().await.unwrap();
    assert_eq!(status.connections.len(), 1, "{status:?}");
    b.stop().await;
    a.stop().await;
}
