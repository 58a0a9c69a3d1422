//! Two agent processes, each in its own network namespace, registered in a real etcd: a prefill
//! worker registers random KV blocks, a decode worker pulls them by segment name.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{BLOCK, etcd_on, fabric_keys, keys_of, prefill_and_decode, sees, within};
use kvfabric_client::{Client, Op};
use kvfabric_e2e::worker::{first_mismatch, random_memory, scattered};
use kvfabric_e2e::{AgentProcess, Network, kvfabric_bin};
use kvfabric_proto::pb::HandshakeRequest;
use kvfabric_proto::pb::peer_agent_client::PeerAgentClient;
use tonic::Code;

/// A lease long enough that only a deletion removes keys within [`KEYS_GONE_WITHIN`].
const TTL_SECS: u64 = 10;
const KEYS_GONE_WITHIN: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_pulls_prefill_blocks_across_namespaces_through_etcd() {
    let net = Network::new(2);
    let Some(etcd) = etcd_on(net.gateway).await else {
        return;
    };
    let ttl = TTL_SECS.to_string();
    let flags = ["--transports", "tcp", "--lease-ttl-secs", &ttl];
    // The fabric's peer token comes from the environment, as the operator sets it.
    let token = [("KVFABRIC_PEER_TOKEN", "e2e-peer-token-0123456789")];
    let spawn = |name, host| AgentProcess::spawn_env(name, host, &etcd.endpoint(), &flags, &token);
    let mut a = spawn("prefill-node", &net.hosts[0]);
    let mut b = spawn("decode-node", &net.hosts[1]);
    assert_eq!(a.ready.registry, "etcd");
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();

    let blocks = 256;
    let src = random_memory(blocks * BLOCK, 11);
    let dst = random_memory(blocks * BLOCK, 12);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    within(
        Duration::from_secs(5),
        "decode agent sees prefill-0",
        || sees(&decode, "prefill-0"),
    )
    .await;

    let ops = scattered(128, BLOCK, blocks);
    let done = decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    assert_eq!(done.transport, "tcp");
    assert_eq!(done.remote_agent, "prefill-node");
    assert_eq!(done.bytes, 128 * BLOCK);
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
    // Blocks never written still hold the decode worker's own data.
    let original = random_memory(blocks * BLOCK, 12);
    // SAFETY: no transfer in flight.
    let (got, want) = unsafe { (dst.as_slice(), original.as_slice()) };
    assert!(got[(128 * BLOCK) as usize..] == want[(128 * BLOCK) as usize..]);

    // Push: decode's block 0 into prefill's last block.
    let push = [Op {
        local_region: 0,
        local_offset: 0,
        remote_region: 0,
        remote_offset: (blocks - 1) * BLOCK,
        len: BLOCK,
    }];
    decode.write(&d, "prefill-0", p.key, &push).await.unwrap();
    // SAFETY: as above.
    let (s, t) = unsafe { (src.as_slice(), dst.as_slice()) };
    assert!(s[((blocks - 1) * BLOCK) as usize..] == t[..BLOCK as usize]);

    // `kvfabric status` against the decode agent: both agents, both segments, the tcp link.
    let out = Command::new(kvfabric_bin())
        .args(["status", "--socket-dir"])
        .arg(b.socket_dir())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "prefill-node",
        "decode-node",
        "prefill-0",
        "decode-0",
        "tcp",
        "etcd",
    ] {
        assert!(text.contains(needle), "status lacks {needle}:\n{text}");
    }

    // Graceful stop deletes each agent's keys at once: well under the lease TTL, which is
    // long here so that expiry cannot pass for deletion.
    for (agent, names) in [
        (&mut b, ["decode-node", "decode-0"]),
        (&mut a, ["prefill-node", "prefill-0"]),
    ] {
        let term = Instant::now();
        agent.sigterm();
        within(KEYS_GONE_WITHIN, "keys deleted on SIGTERM", || async {
            keys_of(&etcd, &names).await.is_empty()
        })
        .await;
        let took = term.elapsed();
        println!(
            "{} keys gone {took:?} after SIGTERM (TTL {TTL_SECS} s)",
            agent.name
        );
        assert!(took < KEYS_GONE_WITHIN, "{took:?}");
        assert_eq!(
            agent.wait_exit(Duration::from_secs(20)),
            Some(0),
            "{}",
            agent.log()
        );
    }
    let left = fabric_keys(&etcd).await;
    assert!(left.is_empty(), "keys left after graceful stop: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_api_refuses_strangers_and_garbage_and_keeps_serving() {
    let net = Network::new(2);
    let Some(etcd) = etcd_on(net.gateway).await else {
        return;
    };
    let (a, _b, prefill, decode) =
        prefill_and_decode(&net, &etcd, &["--transports", "tcp"], &[]).await;
    let peer = a.ready.peer;
    let mut grpc = PeerAgentClient::connect(format!("http://{peer}"))
        .await
        .unwrap();
    let s = grpc
        .handshake(HandshakeRequest {
            fabric: "another-fabric".into(),
            agent: "x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    assert!(s.message().contains("another-fabric"), "{}", s.message());

    // Garbage and truncated HTTP/2 on the peer port, and on the data port.
    for addr in [peer, a.ready.data] {
        use std::io::Write;
        let mut raw = std::net::TcpStream::connect(addr).unwrap();
        let _ = raw.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x09garbage!garbage");
        drop(raw);
        let mut raw = std::net::TcpStream::connect(addr).unwrap();
        let _ = raw.write_all(&[0xff; 4096]);
    }
    // Garbage on the fd socket and on the local API's socket.
    for socket in ["agent.fd.sock", "agent.sock"] {
        use std::io::Write;
        let mut s = std::os::unix::net::UnixStream::connect(a.socket_dir().join(socket)).unwrap();
        let _ = s.write_all(b"not a memfd request, not HTTP/2 either");
    }
    let ok = grpc
        .handshake(HandshakeRequest {
            fabric: "e2e".into(),
            agent: "x".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.agent, "prefill-node");

    // Real work afterwards, through every port the garbage hit: a registration (fd socket and
    // local API), the decode agent's handshake (peer port) and the pull (data port).
    let blocks = 64;
    let src = random_memory(blocks * BLOCK, 21);
    let dst = random_memory(blocks * BLOCK, 22);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    within(
        Duration::from_secs(5),
        "decode agent sees prefill-0",
        || sees(&decode, "prefill-0"),
    )
    .await;
    let ops = scattered(blocks, BLOCK, blocks);
    let done = decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    assert_eq!(done.remote_agent, "prefill-node");
    assert_eq!(done.bytes, blocks * BLOCK);
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
}
