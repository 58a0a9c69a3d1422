//! mTLS on the peer API: a caller without a client certificate of the fabric's CA (none, one of
//! another CA, plain TCP) is refused in the TLS handshake, before a request is read, and learns
//! nothing; agents of one CA pull from each other; an agent of another CA is not trusted as a
//! server either.

use std::time::Duration;

use kvfabric_agent::AgentConfig;
use kvfabric_agent::peer_tls::PeerTls;
use kvfabric_agent::peer_token::PeerToken;
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, Op, pb};
use kvfabric_engine::{SegmentDescriptor, TransportKind};
use kvfabric_proto::contract::TLS_SERVER_NAME;
use kvfabric_testkit::{InProcessAgent, TestCa};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// 1 MiB blocks: a pull of 16 spans several 4 MiB chunks on every connection, so the TLS relays
/// run with full buffers both ways.
const BLOCK: u64 = 1 << 20;
const TOKEN: &str = "a-peer-token-of-the-fabric";

/// A mounted Secret of `ca` for one agent.
fn secret(ca: &TestCa) -> (tempfile::TempDir, PeerTls) {
    let dir = tempfile::tempdir().unwrap();
    ca.write_dir(dir.path(), &ca.issue(&[TLS_SERVER_NAME]))
        .unwrap();
    let tls = PeerTls::from_dir(dir.path()).unwrap();
    (dir, tls)
}

async fn agent(name: &str, store: &MemoryStore, tls: &PeerTls) -> InProcessAgent {
    let mut config: AgentConfig = InProcessAgent::config(name);
    config.transports = vec![TransportKind::Tcp];
    config.batch_timeout = Duration::from_secs(5);
    config.connect_timeout = Duration::from_secs(2);
    config.peer_token = Some(TOKEN.parse().unwrap());
    config.tls = Some(tls.clone());
    InProcessAgent::start(config, store.registry(), Telemetry::default())
        .await
        .unwrap()
}

fn request<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    TOKEN.parse::<PeerToken>().unwrap().attach(&mut r);
    r
}

fn hello() -> tonic::Request<pb::HandshakeRequest> {
    request(pb::HandshakeRequest {
        fabric: "test".into(),
        agent: "node-x".into(),
    })
}

/// Dials `a`'s peer port: TLS trusting `ca` with `identity` (or none), or plain TCP.
async fn dial(
    a: &InProcessAgent,
    tls: Option<(&str, Option<Identity>)>,
) -> Result<Channel, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{}", a.ready.peer))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2));
    if let Some((ca, identity)) = tls {
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .domain_name(TLS_SERVER_NAME);
        if let Some(identity) = identity {
            config = config.identity(identity);
        }
        endpoint = endpoint.tls_config(config).unwrap();
    }
    endpoint.connect().await.map_err(|e| format!("{e:?}"))
}

/// What a refused caller saw: the connect or the call failed, naming nothing of the agent.
async fn refused(a: &InProcessAgent, tls: Option<(&str, Option<Identity>)>, who: &str) {
    let seen = match dial(a, tls).await {
        Err(e) => e,
        Ok(channel) => {
            let mut peer = pb::peer_agent_client::PeerAgentClient::new(channel.clone());
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
            let said = peer.handshake(hello()).await;
            let status = said.expect_err(&format!("{who} was answered"));
            assert_ne!(status.code(), tonic::Code::Ok);
            let asked = health
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await;
            assert!(asked.is_err(), "{who} was told the health: {asked:?}");
            format!("{status:?}")
        }
    };
    for secret in ["node-a", "\"tcp\"", "data_secret", "SERVING"] {
        assert!(!seen.contains(secret), "{who} learned {secret:?}: {seen}");
    }
}

#[tokio::test]
async fn a_caller_without_a_certificate_of_the_ca_learns_nothing() {
    let (ca, other) = (TestCa::new("fabric"), TestCa::new("stranger"));
    let (_dir, tls) = secret(&ca);
    let store = MemoryStore::new();
    let a = agent("node-a", &store, &tls).await;
    let ca_pem = ca.pem();

    refused(&a, None, "a plain-TCP caller").await;
    refused(&a, Some((&ca_pem, None)), "a caller without a certificate").await;
    let theirs = other.issue(&[TLS_SERVER_NAME]);
    let foreign = Identity::from_pem(&theirs.cert_pem, &theirs.key_pem);
    refused(&a, Some((&ca_pem, Some(foreign))), "a caller of another CA").await;

    // The right certificate (and the token, which still applies) is answered.
    let ours = ca.issue(&[TLS_SERVER_NAME]);
    let channel = dial(
        &a,
        Some((
            &ca_pem,
            Some(Identity::from_pem(&ours.cert_pem, &ours.key_pem)),
        )),
    )
    .await
    .unwrap();
    let mut peer = pb::peer_agent_client::PeerAgentClient::new(channel);
    let reply = peer.handshake(hello()).await.unwrap().into_inner();
    assert_eq!(reply.agent, "node-a");
    assert!(
        SegmentDescriptor::from_json(&reply.descriptor)
            .unwrap()
            .endpoints
            .tcp
            .is_some()
    );
    // A certificate does not replace the token.
    let status = peer
        .handshake(pb::HandshakeRequest {
            fabric: "test".into(),
            agent: "node-x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    // And the agent still serves after the strangers.
    let worker = Client::connect(a.socket_dir()).await.unwrap();
    worker.status().await.unwrap();
}

fn pattern(len: u64, seed: u8) -> HostMemory {
    let m = HostMemory::alloc(len).unwrap();
    // SAFETY: nothing transfers into it yet.
    let bytes = unsafe { m.as_mut_slice() };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
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

#[tokio::test]
async fn agents_of_one_ca_pull_and_an_agent_of_another_is_not_trusted() {
    let ca = TestCa::new("fabric");
    let (_da, tls_a) = secret(&ca);
    let (_db, tls_b) = secret(&ca);
    let store = MemoryStore::new();
    let a = agent("node-a", &store, &tls_a).await;
    let b = agent("node-b", &store, &tls_b).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let src = pattern(16 * BLOCK, 7);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();
    let dst = pattern(16 * BLOCK, 0);
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    let batch = ops(16);
    decode.read(&d, "prefill-0", p.key, &batch).await.unwrap();
    // SAFETY: the batch completed.
    let (from, to) = unsafe { (src.as_slice(), dst.as_slice()) };
    for o in &batch {
        let (l, r, n) = (
            o.local_offset as usize,
            o.remote_offset as usize,
            o.len as usize,
        );
        assert_eq!(to[l..l + n], from[r..r + n], "op {o:?}");
    }

    // And a push, bulk the other way: decode's block i over prefill's block i.
    let push: Vec<Op> = (0..16)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * BLOCK,
            remote_region: 0,
            remote_offset: i * BLOCK,
            len: BLOCK,
        })
        .collect();
    decode.write(&d, "prefill-0", p.key, &push).await.unwrap();
    // SAFETY: the batch completed.
    let (from, to) = unsafe { (dst.as_slice(), src.as_slice()) };
    assert!(from == to, "the pushed blocks differ");

    // An agent whose certificate and CA are another fabric's reaches nobody of this one.
    let (_dc, tls_c) = secret(&TestCa::new("another fabric"));
    let c = agent("node-c", &store, &tls_c).await;
    let other = Client::connect(c.socket_dir()).await.unwrap();
    let dst_c = pattern(16 * BLOCK, 0);
    let dc = other.register("decode-c", &[&dst_c], None).await.unwrap();
    let e = other
        .read(&dc, "prefill-0", p.key, &batch)
        .await
        .expect_err("an agent of another CA pulled");
    assert!(e.to_string().contains("certificate"), "{e}");
    // SAFETY: the batch was refused; nothing is in flight.
    let untouched = unsafe { dst_c.as_slice() };
    assert!(
        untouched
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (i as u8).wrapping_mul(31))
    );
}

/// What the data port sends a caller that dialled it with `config` (None: plain TCP) and sent
/// 64 bytes that are no Hello: the plaintext it read, or the TLS error that ended it.
fn data_port_says(
    addr: std::net::SocketAddr,
    config: Option<rustls::ClientConfig>,
) -> Result<Vec<u8>, String> {
    use std::io::{Read, Write};
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let not_a_hello = [0x5au8; 64];
    let mut got = Vec::new();
    let Some(config) = config else {
        tcp.write_all(&not_a_hello).unwrap();
        let _ = tcp.read_to_end(&mut got);
        return Ok(got);
    };
    let name = TLS_SERVER_NAME.try_into().unwrap();
    let conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    tls.write_all(&not_a_hello).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 4096];
    loop {
        match tls.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if got.is_empty() => return Err(e.to_string()),
            Err(_) => return Ok(got),
        }
    }
}

fn client_config(
    ca: &TestCa,
    identity: Option<&kvfabric_testkit::TestCert>,
) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
        .unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    match identity {
        None => builder.with_no_client_auth(),
        Some(c) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(c.cert_pem.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).unwrap(),
            )
            .unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_port_admits_only_tls_with_a_certificate_of_the_ca() {
    let (ca, other) = (TestCa::new("fabric"), TestCa::new("stranger"));
    let (_dir, tls) = secret(&ca);
    let store = MemoryStore::new();
    let a = agent("node-a", &store, &tls).await;
    let data = a.ready.data;
    let foreign = other.issue(&[TLS_SERVER_NAME]);
    let ours = ca.issue(&[TLS_SERVER_NAME]);
    let said = tokio::task::spawn_blocking(move || {
        (
            data_port_says(data, None),
            data_port_says(data, Some(client_config(&ca, None))),
            data_port_says(data, Some(client_config(&ca, Some(&foreign)))),
            data_port_says(data, Some(client_config(&ca, Some(&ours)))),
        )
    })
    .await
    .unwrap();
    // Plain TCP: at most a TLS alert record (type 21), nothing of the engine's.
    let plain = said.0.unwrap();
    assert!(
        plain.is_empty() || plain[0] == 21,
        "plain TCP got {plain:?}"
    );
    for (what, r) in [("no certificate", said.1), ("another CA's", said.2)] {
        let e = r.expect_err(&format!("{what} was let through"));
        assert!(e.contains("alert"), "{what}: {e}");
    }
    // Through TLS with the right certificate, the data secret's challenge–response still
    // applies: a Hello that does not prove it gets the one generic refusal, nothing else.
    let answer = said.3.expect("the right certificate passes TLS");
    assert!(
        !answer.is_empty(),
        "the engine answered nothing through TLS"
    );
    let text = String::from_utf8_lossy(&answer);
    assert!(
        !text.contains("node-a") && !text.contains("\"tcp\""),
        "{text}"
    );
}

/// With mTLS the certificate is what authenticates a connection to the peer port's accept loop:
/// a fabric agent's connection outlives the deadline strangers get even when its call's token
/// is wrong (the call itself is still refused).
#[tokio::test]
async fn a_connection_with_a_certificate_of_the_ca_is_never_cut_as_a_strangers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let ca = TestCa::new("fabric");
    let (_dir, tls) = secret(&ca);
    let store = MemoryStore::new();
    let a = agent("node-a", &store, &tls).await;
    let ours = ca.issue(&[TLS_SERVER_NAME]);
    let dials = Arc::new(AtomicUsize::new(0));
    let to = a.ready.peer;
    let channel = Endpoint::from_shared(format!("https://{to}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca.pem()))
                .domain_name(TLS_SERVER_NAME)
                .identity(Identity::from_pem(&ours.cert_pem, &ours.key_pem)),
        )
        .unwrap()
        .connect_with_connector(tower::service_fn({
            let dials = dials.clone();
            move |_: http::Uri| {
                dials.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::net::TcpStream::connect(to)
                        .await
                        .map(hyper_util::rt::TokioIo::new)
                }
            }
        }))
        .await
        .unwrap();
    let mut peer = pb::peer_agent_client::PeerAgentClient::new(channel);
    let no_token = || pb::HandshakeRequest {
        fabric: "test".into(),
        agent: "node-x".into(),
    };
    let status = peer.handshake(no_token()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    tokio::time::sleep(kvfabric_agent::incoming::PEER_AUTH_DEADLINE + Duration::from_secs(1)).await;
    let status = peer.handshake(no_token()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    peer.handshake(hello()).await.unwrap();
    assert_eq!(dials.load(Ordering::SeqCst), 1, "the connection was cut");
}
