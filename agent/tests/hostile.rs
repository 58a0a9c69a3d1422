//! An agent under a hostile local worker or a stranger on the network: each case once broke an
//! agent (a lockout, memory it was made to hold, a crash of everyone's transfers) and must not
//! again. Every test ends by showing the agent still serves a well-behaved worker.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvfabric_agent::AgentConfig;
use kvfabric_agent::peer_token::PeerToken;
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, pb};
use kvfabric_proto::contract::socket;
use kvfabric_testkit::InProcessAgent;
use tonic::Code;

const TOKEN: &str = "fabric-token-0123456789";

async fn agent(name: &str, adjust: impl FnOnce(&mut AgentConfig)) -> InProcessAgent {
    let mut config = InProcessAgent::config(name);
    config.batch_timeout = Duration::from_secs(5);
    adjust(&mut config);
    InProcessAgent::start(config, MemoryStore::new().registry(), Telemetry::default())
        .await
        .unwrap()
}

/// A well-behaved worker can still register and is answered promptly.
async fn still_serves(agent: &InProcessAgent, name: &str) {
    let start = Instant::now();
    let client = Client::connect(agent.socket_dir()).await.unwrap();
    let m = HostMemory::alloc(1 << 20).unwrap();
    client.register(name, &[&m], None).await.unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "a well-behaved registration took {:?}",
        start.elapsed()
    );
}

/// A child process that is killed (and reaped) however the test ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn resident_shmem_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test]
async fn the_peer_token_is_checked_before_the_request_body_is_read() {
    let a = agent("tok", |c| c.peer_token = Some(TOKEN.parse().unwrap())).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", a.ready.peer))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut peer =
        pb::peer_agent_client::PeerAgentClient::new(channel).max_encoding_message_size(64 << 20);
    let huge = pb::HandshakeRequest {
        fabric: "x".repeat(16 << 20),
        agent: "stranger".into(),
    };
    // No token, 16 MiB: refused as unauthenticated, so the size was never looked at.
    let e = peer.handshake(huge.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    // With the token, the method's limit refuses it.
    let token: PeerToken = TOKEN.parse().unwrap();
    let mut call = tonic::Request::new(huge);
    token.attach(&mut call);
    let e = peer.handshake(call).await.unwrap_err();
    assert!(
        matches!(e.code(), Code::ResourceExhausted | Code::OutOfRange),
        "{e:?}"
    );
    assert!(e.message().len() < 512, "{}", e.message().len());
    still_serves(&a, "after-huge").await;
}

#[tokio::test]
async fn refused_registrations_give_their_memfds_back() {
    let a = agent("lockout", |_| {}).await;
    let client = Client::connect(a.socket_dir()).await.unwrap();
    let m = HostMemory::alloc(4096).unwrap();
    client.register("taken", &[&m], None).await.unwrap();
    // A retry loop on a taken name: every attempt hands over a memfd and is refused. Were the
    // memfds kept until their tokens expire, this process would hit its quota of pending fds
    // (512), then the node's (4096), and no registration on the node could succeed for a
    // minute.
    for _ in 0..kvfabric_agent::fd_stash::MAX_PENDING_FDS + 100 {
        let again = HostMemory::alloc(4096).unwrap();
        let e = client.register("taken", &[&again], None).await.unwrap_err();
        assert_eq!(e.code(), Some(Code::AlreadyExists), "{e}");
    }
    still_serves(&a, "free").await;
}

// Blocking socket calls below: the agent needs threads of its own.
#[tokio::test(flavor = "multi_thread")]
async fn an_fd_socket_flood_from_another_process_does_not_block_handovers() {
    let a = agent("flood", |_| {}).await;
    let path = a.socket_dir().join(socket::FD);
    // 600 connections that never send anything, from another process.
    let mut flood = KillOnDrop(
        Command::new("python3")
            .args([
                "-c",
                "import socket, sys, time\n\
             s = []\n\
             for _ in range(600):\n\
             \x20   c = socket.socket(socket.AF_UNIX)\n\
             \x20   c.connect(sys.argv[1])\n\
             \x20   s.append(c)\n\
             print('connected', flush=True)\n\
             time.sleep(60)\n",
                path.to_str().unwrap(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs"),
    );
    let mut line = [0u8; 9];
    flood
        .0
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut line)
        .unwrap();
    assert_eq!(&line, b"connected");
    still_serves(&a, "during-flood").await;
    // A connection that stays silent is closed after the idle timeout.
    let idle = UnixStream::connect(&path).unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 1];
    let n = (&idle).read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0);
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn registering_an_untouched_pool_commits_none_of_it() {
    let a = agent("lazy", |_| {}).await;
    let client = Client::connect(a.socket_dir()).await.unwrap();
    let pool = HostMemory::alloc(1 << 30).unwrap();
    let before = resident_shmem_kib();
    let start = Instant::now();
    client.register("big", &[&pool], None).await.unwrap();
    let grown = resident_shmem_kib().saturating_sub(before);
    assert!(grown < 64 << 10, "registration made {grown} KiB resident");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

// Blocking socket calls below: the agent needs threads of its own.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_sealed_memfd_is_a_failed_precondition_naming_the_seal() {
    use rustix::fs::{MemfdFlags, SealFlags};
    let a = agent("sealed", |_| {}).await;
    let fd = rustix::fs::memfd_create("sealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::WRITE).unwrap();
    let s = UnixStream::connect(a.socket_dir().join(socket::FD)).unwrap();
    kvfabric_engine::transport::fdpass::send_fd(&s, kvfabric_proto::fd_wire::MAGIC, fd.as_fd())
        .unwrap();
    let token = kvfabric_proto::fd_wire::read_reply(&mut &s)
        .unwrap()
        .unwrap();
    let client = Client::connect(a.socket_dir()).await.unwrap();
    let e = client
        .grpc()
        .register_segment(pb::RegisterSegmentRequest {
            name: "sealed".into(),
            regions: vec![pb::RegionSpec {
                memory: Some(pb::region_spec::Memory::Host(pb::HostMemory {
                    fd_token: token,
                })),
            }],
            key: 0,
            detached: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("F_SEAL_WRITE"), "{}", e.message());
    still_serves(&a, "unsealed").await;
}

#[tokio::test]
async fn errors_quote_untrusted_values_cut_short() {
    let a = agent("echo", |_| {}).await;
    let client = Client::connect(a.socket_dir()).await.unwrap();
    let m = HostMemory::alloc(4096).unwrap();
    let mine = client.register("mine", &[&m], None).await.unwrap();
    let long = "n".repeat(64 << 10);
    let e = client
        .grpc()
        .submit(pb::SubmitRequest {
            local_segment: mine.name.clone(),
            local_key: mine.key,
            remote_segment: long.clone(),
            remote_key: 1,
            opcode: pb::Opcode::Read as i32,
            ops: vec![pb::BlockOp {
                len: 1,
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().len() < 512, "{} bytes", e.message().len());
    assert!(e.message().contains("(65536 bytes)"), "{}", e.message());
    // A long name at registration, likewise.
    let e = client.register(&long, &[&m], None).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().len() < 1024, "{}", e.to_string().len());
}

#[tokio::test]
async fn sockets_admit_their_group_and_a_live_agent_is_never_replaced() {
    let gid = rustix::process::getgid().as_raw();
    let a = agent("modes", |c| {
        c.socket_group = Some(gid);
        c.socket_mode = 0o660;
    })
    .await;
    for name in [socket::LOCAL, socket::FD, socket::SHM] {
        let meta = std::fs::metadata(a.socket_dir().join(name)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o660, "{name}");
        assert_eq!(std::os::unix::fs::MetadataExt::gid(&meta), gid, "{name}");
    }
    // A second agent configured with the same directory refuses to start.
    let mut second = AgentConfig::local("second", a.socket_dir());
    second.fabric = "other".into();
    let e = kvfabric_agent::Listeners::bind(&second).await.unwrap_err();
    assert!(e.to_string().contains("another agent serves"), "{e}");
    assert_eq!(e.exit_code(), 64);
    still_serves(&a, "first-still-serves").await;
}
