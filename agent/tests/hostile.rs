//! An agent under a hostile local worker or a stranger on the network: each case once broke an
//! agent (a lockout, memory it was made to hold, a crash of everyone's transfers) and must not
//! again. Every test ends by showing the agent still serves a well-behaved worker.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvfabric_agent::AgentConfig;
use kvfabric_agent::fd_socket::FIRST_REQUEST_DEADLINE as FD_FIRST_REQUEST_DEADLINE;
use kvfabric_agent::incoming::PEER_AUTH_DEADLINE;
use kvfabric_agent::peer_token::PeerToken;
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, pb};
use kvfabric_proto::contract::socket;
use kvfabric_testkit::InProcessAgent;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

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
            fabric_access: false,
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

// ---- Floods that once cut an agent out of the fabric (issue 26, items 1 and 2) ----

/// Lets this process hold `n` descriptors (the soft limit raised toward the hard one); a flood
/// test that cannot is a failure, never a skip.
fn allow_fds(n: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    if now.current.is_none_or(|c| c >= n) {
        return;
    }
    let raised = now.maximum.map_or(n, |max| max.min(n));
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(raised),
            maximum: now.maximum,
        },
    )
    .unwrap();
    assert!(
        raised >= n,
        "this test needs {n} descriptors, the hard limit is {:?}",
        now.maximum
    );
}

/// A TCP connection to `to` from the loopback address `from` (all of 127/8 is this host's: a
/// stranger with an address of its own).
async fn connect_from(from: [u8; 4], to: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind((from, 0).into())?;
    s.connect(to).await
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// `n` connections from `from` that never present a token: every other one sends the HTTP/2
/// preface and nothing more, the rest nothing at all.
async fn flood(from: [u8; 4], to: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let Ok(Ok(mut s)) =
            tokio::time::timeout(Duration::from_secs(5), connect_from(from, to)).await
        else {
            continue;
        };
        if i % 2 == 0 {
            let _ = s.write_all(H2_PREFACE).await;
        }
        held.push(s);
    }
    held
}

/// Waits up to `within` for the agent to close `s`: true when it did.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// A channel that counts its dials: a connection the agent shed would be dialled again.
async fn counted_channel(to: std::net::SocketAddr, dials: Arc<AtomicUsize>) -> Channel {
    Endpoint::from_shared(format!("http://{to}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            dials.fetch_add(1, Ordering::SeqCst);
            async move {
                TcpStream::connect(to)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
        .unwrap()
}

async fn handshake(
    channel: Channel,
    token: Option<&str>,
) -> Result<pb::HandshakeResponse, tonic::Status> {
    let mut call = tonic::Request::new(pb::HandshakeRequest {
        fabric: "test".into(),
        agent: "peer".into(),
    });
    if let Some(t) = token {
        t.parse::<PeerToken>().unwrap().attach(&mut call);
    }
    pb::peer_agent_client::PeerAgentClient::new(channel)
        .handshake(call)
        .await
        .map(tonic::Response::into_inner)
}

/// A sample of an agent's `/metrics` (0 when absent).
async fn sample(agent: &InProcessAgent, name: &str) -> f64 {
    kvfabric_agent::metrics::scrape(agent.ready.metrics)
        .await
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .map_or(0.0, |(_, v)| v)
}

const PEER_SHED: &str = r#"kvfabric_agent_connections_shed_total{port="peer",reason="room"}"#;

// The flood is 4000 descriptors on each end, in this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_flooding_the_peer_port_does_not_delay_a_peer_with_the_token() {
    allow_fds(16_384);
    let a = agent("peerflood", |c| c.peer_token = Some(TOKEN.parse().unwrap())).await;
    let peer = a.ready.peer;
    // A peer that authenticated before the flood keeps its connection through it.
    let dials = Arc::new(AtomicUsize::new(0));
    let old = counted_channel(peer, dials.clone()).await;
    handshake(old.clone(), Some(TOKEN)).await.unwrap();

    // 2000 connections without a token: half idle, half stopping after the HTTP/2 preface.
    let held = flood([127, 0, 0, 2], peer, 2000).await;
    assert!(held.len() > 1900, "only {} flood connections", held.len());
    // And a stranger that keeps coming while the peer dials.
    let stop = Arc::new(AtomicBool::new(false));
    let again = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut rolling = std::collections::VecDeque::new();
            while !stop.load(Ordering::Relaxed) {
                rolling.extend(flood([127, 0, 0, 3], peer, 50).await);
                while rolling.len() > 1000 {
                    rolling.pop_front();
                }
                tokio::task::yield_now().await;
            }
        }
    });

    let start = Instant::now();
    let fresh = tokio::time::timeout(Duration::from_secs(5), async {
        let channel = Endpoint::from_shared(format!("http://{peer}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("{e:?}")))?;
        handshake(channel, Some(TOKEN)).await
    })
    .await;
    let took = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    let answer = fresh.unwrap_or_else(|_| panic!("no answer to a peer's Handshake in {took:?}"));
    assert_eq!(answer.unwrap().agent, "peerflood");
    assert!(
        took < Duration::from_secs(1),
        "a peer's Handshake took {took:?} under the flood"
    );
    again.abort();

    // The early peer's connection outlives the deadline strangers get, and was never shed.
    tokio::time::sleep(PEER_AUTH_DEADLINE + Duration::from_secs(1)).await;
    handshake(old, Some(TOKEN)).await.unwrap();
    assert_eq!(
        dials.load(Ordering::SeqCst),
        1,
        "the authenticated peer had to dial again"
    );
    // Every stranger's connection is gone: shed, or closed at the deadline.
    for mut s in held {
        assert!(closed_within(&mut s, Duration::from_secs(2)).await);
    }
    let shed = sample(&a, PEER_SHED).await;
    assert!(shed >= 1000.0, "{PEER_SHED} = {shed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_connection_that_never_presents_the_token_is_closed_at_the_deadline() {
    let a = agent("peerdeadline", |c| {
        c.peer_token = Some(TOKEN.parse().unwrap())
    })
    .await;
    let peer = a.ready.peer;
    // Silent, preface only, and calls without the token (refused, and the health service,
    // which needs none): none of these is an authenticated request.
    let mut silent = connect_from([127, 0, 0, 4], peer).await.unwrap();
    let mut preface = connect_from([127, 0, 0, 4], peer).await.unwrap();
    preface.write_all(H2_PREFACE).await.unwrap();
    let dials = Arc::new(AtomicUsize::new(0));
    let stranger = counted_channel(peer, dials.clone()).await;
    let e = handshake(stranger.clone(), None).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    tonic_health::pb::health_client::HealthClient::new(stranger.clone())
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap();
    let start = Instant::now();
    let bound = PEER_AUTH_DEADLINE + Duration::from_secs(3);
    assert!(
        closed_within(&mut silent, bound).await,
        "silent: open after {bound:?}"
    );
    assert!(
        closed_within(&mut preface, bound).await,
        "preface: open after {bound:?}"
    );
    // The stranger's channel lost its connection: its next call dials again.
    tokio::time::sleep(bound.saturating_sub(start.elapsed())).await;
    let e = handshake(stranger, None).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert_eq!(dials.load(Ordering::SeqCst), 2);
    let deadline = r#"kvfabric_agent_connections_shed_total{port="peer",reason="deadline"}"#;
    assert!(sample(&a, deadline).await >= 3.0);
}

/// What a child process of this test binary does (set in its environment): `flood` holds
/// connections to the fd socket at `KVFABRIC_HOSTILE_FD` and dials again any the agent closes;
/// `handover` hands one memfd over and prints the token.
const ROLE: &str = "KVFABRIC_HOSTILE_ROLE";
const FD_PATH: &str = "KVFABRIC_HOSTILE_FD";

/// Runs only as a child (see [`ROLE`]); in the suite it returns at once.
#[test]
fn fd_socket_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let path = std::env::var(FD_PATH).unwrap();
    match role.as_str() {
        "flood" => {
            let mut held: Vec<UnixStream> = (0..60)
                .filter_map(|_| UnixStream::connect(&path).ok())
                .collect();
            println!("connected {}", held.len());
            // Until killed: whatever the agent closed is dialled again.
            loop {
                for s in &mut held {
                    s.set_nonblocking(true).unwrap();
                    let mut b = [0u8; 1];
                    let closed = match (&*s).read(&mut b) {
                        Ok(_) => true,
                        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                    };
                    if closed && let Ok(fresh) = UnixStream::connect(&path) {
                        *s = fresh;
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        "handover" => {
            use rustix::fs::{MemfdFlags, memfd_create};
            let fd =
                memfd_create("handover", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
            rustix::fs::ftruncate(&fd, 4096).unwrap();
            let s = UnixStream::connect(&path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            kvfabric_engine::transport::fdpass::send_fd(
                &s,
                kvfabric_proto::fd_wire::MAGIC,
                fd.as_fd(),
            )
            .unwrap();
            let token = kvfabric_proto::fd_wire::read_reply(&mut &s)
                .unwrap()
                .unwrap();
            println!("token {token}");
        }
        other => panic!("unknown role {other}"),
    }
}

/// This test binary again, running [`fd_socket_child`] as `role`.
fn child(role: &str, fd: &std::path::Path) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        "fd_socket_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE, role)
    .env(FD_PATH, fd)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

/// What `child` printed from `prefix` to the end of that line (the harness may have printed
/// the test's name before it on the same line).
fn line_of(child: &mut std::process::Child, prefix: &str) -> Option<String> {
    use std::io::BufRead;
    std::io::BufReader::new(child.stdout.as_mut()?)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.find(prefix).map(|at| l[at..].to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fd_socket_flood_from_many_processes_does_not_block_another_workers_handover() {
    let a = agent("fdflood", |_| {}).await;
    let path = a.socket_dir().join(socket::FD);
    // 600 connections that never send anything, from ten processes that dial again whatever
    // the agent closes.
    let mut flooders: Vec<KillOnDrop> = (0..10)
        .map(|_| KillOnDrop(child("flood", &path).spawn().unwrap()))
        .collect();
    for f in &mut flooders {
        let line = line_of(&mut f.0, "connected ").expect("a flooder connected");
        assert_eq!(line, "connected 60");
    }
    // Another worker hands a memfd over.
    let start = Instant::now();
    let out = tokio::task::spawn_blocking({
        let path = path.clone();
        move || child("handover", &path).output().unwrap()
    })
    .await
    .unwrap();
    let took = start.elapsed();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("token "),
        "the hand-over failed under the flood after {took:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shed = r#"kvfabric_agent_connections_shed_total{port="fd",reason="room"}"#;
    assert!(sample(&a, shed).await > 0.0, "{shed}");
    drop(flooders);

    // A connection that sends nothing is closed at the first-request deadline.
    let idle = tokio::task::spawn_blocking(move || {
        let idle = UnixStream::connect(&path).unwrap();
        idle.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let start = Instant::now();
        let n = (&idle).read(&mut [0u8; 1]).unwrap_or(0);
        (n, start.elapsed())
    })
    .await
    .unwrap();
    assert_eq!(idle.0, 0);
    assert!(
        idle.1 < FD_FIRST_REQUEST_DEADLINE + Duration::from_secs(1),
        "an idle connection stayed {:?}",
        idle.1
    );
    still_serves(&a, "after-fd-flood").await;
}
