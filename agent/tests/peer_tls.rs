//! mTLS on the peer API: a caller without a client certificate of the fabric's CA (none, one of
//! another CA, plain TCP) is refused in the TLS handshake, before a request is read, and learns
//! nothing; agents of one CA pull from each other; an agent of another CA is not trusted as a
//! server either.

use std::time::Duration;

use kvfabric_agent::AgentConfig;
use kvfabric_agent::peer_tls::{PeerTls, Reload};
use kvfabric_agent::peer_token::PeerToken;
use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::{Client, HostMemory, Op, pb};
use kvfabric_engine::{SegmentDescriptor, TransportKind};
use kvfabric_testkit::{InProcessAgent, TestCa};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// 1 MiB blocks: a pull of 16 spans several 4 MiB chunks on every connection, so the TLS relays
/// run with full buffers both ways.
const BLOCK: u64 = 1 << 20;
const TOKEN: &str = "a-peer-token-of-the-fabric";

/// The TLS name of the agents `agent` starts (fabric `test` in namespace `default`).
const NAME: &str = "test.default.kvfabric";
/// Another fabric's, under the same CA.
const OTHER: &str = "other.default.kvfabric";

/// A mounted Secret of `ca` for one agent.
fn secret(ca: &TestCa) -> (tempfile::TempDir, PeerTls) {
    let dir = tempfile::tempdir().unwrap();
    ca.write_dir(dir.path(), &ca.issue(&[NAME])).unwrap();
    let tls = PeerTls::from_dir(dir.path(), NAME).unwrap();
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
            .domain_name(NAME);
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
    let theirs = other.issue(&[NAME]);
    let foreign = Identity::from_pem(&theirs.cert_pem, &theirs.key_pem);
    refused(&a, Some((&ca_pem, Some(foreign))), "a caller of another CA").await;

    // The right certificate (and the token, which still applies) is answered.
    let ours = ca.issue(&[NAME]);
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
    // And the agent still serves after the strangers, and says how its data port seals.
    let worker = Client::connect(a.socket_dir()).await.unwrap();
    let doc = worker.status().await.unwrap();
    let data_tls = doc.data_tls.expect("TLS on the data port is reported");
    // In userspace unless kernel TLS is asked for (and offered).
    assert_eq!(
        data_tls,
        kvfabric_engine::RecordLayer::chosen(false).describe(),
        "{data_tls}"
    );
    assert!(data_tls.starts_with("TLS 1.3 records sealed"), "{data_tls}");
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
    let name = NAME.try_into().unwrap();
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
    let foreign = other.issue(&[NAME]);
    let ours = ca.issue(&[NAME]);
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
    let ours = ca.issue(&[NAME]);
    let dials = Arc::new(AtomicUsize::new(0));
    let to = a.ready.peer;
    let channel = Endpoint::from_shared(format!("https://{to}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca.pem()))
                .domain_name(NAME)
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

/// A Secret volume as the kubelet mounts it: the files are links through `..data`, a link to
/// the current version's directory, which an update replaces in one rename.
struct Mounted {
    dir: tempfile::TempDir,
    versions: std::cell::Cell<u32>,
}

impl Mounted {
    fn new(ca: &TestCa, cert: &kvfabric_testkit::TestCert) -> Mounted {
        let m = Mounted {
            dir: tempfile::tempdir().unwrap(),
            versions: std::cell::Cell::new(0),
        };
        m.publish(ca, cert);
        for file in ["tls.crt", "tls.key", "ca.crt"] {
            std::os::unix::fs::symlink(format!("..data/{file}"), m.dir.path().join(file)).unwrap();
        }
        m
    }

    /// Replaces the Secret's contents at once.
    fn publish(&self, ca: &TestCa, cert: &kvfabric_testkit::TestCert) {
        let n = self.versions.get() + 1;
        self.versions.set(n);
        let version = format!("..v{n}");
        ca.write_dir(&self.dir.path().join(&version), cert).unwrap();
        let tmp = self.dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("..data")).unwrap();
    }

    /// The agent's view of it, looked at every 100 ms.
    fn tls(&self, name: &str) -> PeerTls {
        let mut tls = PeerTls::from_dir(self.dir.path(), name).unwrap();
        tls.reload_every = Duration::from_millis(100);
        tls
    }
}

fn der(pem: &str) -> rustls::pki_types::CertificateDer<'static> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// The certificate `addr` (the peer or data port) presents to a new TLS client of `ca` that
/// presents `identity` and verifies the server for `name`; an error when either side refuses
/// the other.
async fn presented(
    addr: std::net::SocketAddr,
    ca: &TestCa,
    identity: &kvfabric_testkit::TestCert,
    name: &str,
) -> Result<rustls::pki_types::CertificateDer<'static>, String> {
    use tokio::io::AsyncReadExt;
    let config = client_config(ca, Some(identity));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let server_name = rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(server_name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    // TLS 1.3: the server checks the client's certificate after the client finished, so a
    // refusal is the alert read next. An accepted connection waits (the data port for a
    // Hello) or speaks (the peer port's HTTP/2 settings).
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(1), tls.read(&mut buf)).await {
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(0)) => Err("closed by the server".into()),
        _ => Ok(leaf.into_owned()),
    }
}

/// A sample of an agent's `/metrics` (0 when absent).
async fn sample(a: &InProcessAgent, name: &str) -> f64 {
    kvfabric_agent::metrics::scrape(a.ready.metrics)
        .await
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .map_or(0.0, |(_, v)| v)
}

const RELOADS: &str = "kvfabric_agent_tls_reloads_total";
const REFUSALS: &str = "kvfabric_agent_tls_reload_refusals_total";

/// Waits up to 10 s for `metric` of `a` to reach `want`.
async fn until_metric(a: &InProcessAgent, metric: &str, want: f64) {
    for _ in 0..100 {
        if sample(a, metric).await >= want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{metric} never reached {want}: {}", sample(a, metric).await);
}

/// `reader` pulls 16 blocks of `writer`'s worker `from` (registered by `writer_client`) and
/// checks every byte.
async fn pull_checked(
    reader: &InProcessAgent,
    who: &str,
    from: &str,
    key: u64,
    src: &HostMemory,
) -> Result<(), String> {
    let client = Client::connect(reader.socket_dir()).await.unwrap();
    let dst = pattern(16 * BLOCK, 0);
    let d = client.register(who, &[&dst], None).await.unwrap();
    let batch = ops(16);
    client
        .read(&d, from, key, &batch)
        .await
        .map_err(|e| e.to_string())?;
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
    Ok(())
}

/// `secs` from now, in whole seconds (a certificate's times have no fraction).
fn whole_seconds_from_now(secs: u64) -> std::time::SystemTime {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    std::time::UNIX_EPOCH + Duration::from_secs(now.as_secs() + secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_used_for_new_connections_without_a_restart() {
    assert_eq!(
        PeerTls::name_of("test", kvfabric_proto::contract::DEFAULT_NAMESPACE),
        NAME
    );
    let ca = TestCa::new("fabric");
    // A's first certificate expires soon after the renewal, so that peers accept nothing but
    // the renewed one from A's dials too.
    let expires = whole_seconds_from_now(8);
    let (first, caller) = (ca.issue_until(&[NAME], expires), ca.issue(&[NAME]));
    let (sa, sb) = (
        Mounted::new(&ca, &first),
        Mounted::new(&ca, &ca.issue(&[NAME])),
    );
    let store = MemoryStore::new();
    let a = agent("node-a", &store, &sa.tls(NAME)).await;
    let b = agent("node-b", &store, &sb.tls(NAME)).await;
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let src = pattern(16 * BLOCK, 7);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    pull_checked(&b, "decode-0", "prefill-0", p.key, &src)
        .await
        .unwrap();
    assert_eq!(
        presented(a.ready.peer, &ca, &caller, NAME).await.unwrap(),
        der(&first.cert_pem)
    );

    let renewed = ca.issue(&[NAME]);
    sa.publish(&ca, &renewed);
    until_metric(&a, RELOADS, 1.0).await;
    assert_eq!(sample(&a, REFUSALS).await, 0.0);
    // New connections to both ports get the renewed certificate.
    for (port, addr) in [("peer", a.ready.peer), ("data", a.ready.data)] {
        let got = presented(addr, &ca, &caller, NAME).await.unwrap();
        assert_eq!(got, der(&renewed.cert_pem), "the {port} port");
    }
    // Once the first certificate has expired, transfers go on: from the agent that was
    // connected, from one that dials anew, and to A (whose client certificate, on its peer API
    // dial and its data connections, must be the renewed one).
    let left = expires
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(left + Duration::from_secs(1)).await;
    pull_checked(&b, "decode-1", "prefill-0", p.key, &src)
        .await
        .unwrap();
    let (_dc, tls_c) = secret(&ca);
    let c = agent("node-c", &store, &tls_c).await;
    pull_checked(&c, "decode-2", "prefill-0", p.key, &src)
        .await
        .unwrap();
    let worker_c = Client::connect(c.socket_dir()).await.unwrap();
    let src_c = pattern(16 * BLOCK, 9);
    let pc = worker_c
        .register("prefill-c", &[&src_c], None)
        .await
        .unwrap();
    pull_checked(&a, "decode-3", "prefill-c", pc.key, &src_c)
        .await
        .unwrap();
    // Nothing changed since: no further reload.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sample(&a, RELOADS).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_renewal_is_refused_once_and_the_certificate_in_use_stays() {
    let ca = TestCa::new("fabric");
    let (first, caller) = (ca.issue(&[NAME]), ca.issue(&[NAME]));
    let sa = Mounted::new(&ca, &first);
    let tls_a = sa.tls(NAME);
    let store = MemoryStore::new();
    let a = agent("node-a", &store, &tls_a).await;
    let (_db, tls_b) = secret(&ca);
    let b = agent("node-b", &store, &tls_b).await;

    // The key of another certificate.
    let mut mismatched = ca.issue(&[NAME]);
    mismatched.key_pem = ca.issue(&[NAME]).key_pem;
    sa.publish(&ca, &mismatched);
    until_metric(&a, REFUSALS, 1.0).await;
    // Looked at by hand, it is the set refused already; loaded anew, the error names the key.
    assert!(matches!(tls_a.reload(), Ok(Reload::StillRefused)));
    let e = PeerTls::from_dir(sa.dir.path(), NAME).unwrap_err();
    assert!(e.to_string().contains("tls-key"), "{e}");
    // Looked at again and again, it is refused (and counted) once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sample(&a, REFUSALS).await, 1.0);
    assert_eq!(sample(&a, RELOADS).await, 0.0);
    for addr in [a.ready.peer, a.ready.data] {
        let got = presented(addr, &ca, &caller, NAME).await.unwrap();
        assert_eq!(got, der(&first.cert_pem));
    }
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let src = pattern(16 * BLOCK, 3);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    pull_checked(&b, "decode-0", "prefill-0", p.key, &src)
        .await
        .unwrap();

    // Another fabric's certificate is no renewal either.
    sa.publish(&ca, &ca.issue(&[OTHER]));
    until_metric(&a, REFUSALS, 2.0).await;
    // A good one after is taken.
    let good = ca.issue(&[NAME]);
    sa.publish(&ca, &good);
    until_metric(&a, RELOADS, 1.0).await;
    let got = presented(a.ready.peer, &ca, &caller, NAME).await.unwrap();
    assert_eq!(got, der(&good.cert_pem));
}

/// The readiness service's status, asked over the local API's socket.
async fn readiness(a: &InProcessAgent) -> i32 {
    let path = a.socket_dir().join(kvfabric_proto::contract::socket::LOCAL);
    let channel = Endpoint::from_static("http://agent")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
        .unwrap();
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: kvfabric_proto::contract::READY_SERVICE.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

async fn healthz(a: &InProcessAgent) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(a.ready.metrics)
        .await
        .unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    raw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_makes_the_agent_not_ready_until_a_renewal() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let serving = ServingStatus::Serving as i32;
    let ca = TestCa::new("fabric");
    let soon = whole_seconds_from_now(4);
    let sa = Mounted::new(&ca, &ca.issue_until(&[NAME], soon));
    let store = MemoryStore::new();
    let a = agent("node-a", &store, &sa.tls(NAME)).await;
    assert_eq!(readiness(&a).await, serving);

    let mut status = serving;
    for _ in 0..100 {
        status = readiness(&a).await;
        if status != serving {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, ServingStatus::NotServing as i32);
    assert!(
        std::time::SystemTime::now() > soon,
        "not ready before the certificate expired"
    );
    let said = healthz(&a).await;
    assert!(said.starts_with("HTTP/1.1 503"), "{said}");
    assert!(said.contains("expired"), "{said}");

    // A renewal brings it back.
    sa.publish(&ca, &ca.issue(&[NAME]));
    until_metric(&a, RELOADS, 1.0).await;
    let mut status = ServingStatus::NotServing as i32;
    for _ in 0..50 {
        status = readiness(&a).await;
        if status == serving {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, serving);
    let said = healthz(&a).await;
    assert!(said.starts_with("HTTP/1.1 200"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_of_another_fabric_under_the_same_ca_is_refused_both_ways() {
    let ca = TestCa::new("one issuer for every fabric");
    let (_da, tls_a) = secret(&ca);
    let (_db, tls_b) = secret(&ca);
    let dc = tempfile::tempdir().unwrap();
    let theirs = ca.issue(&[OTHER]);
    ca.write_dir(dc.path(), &theirs).unwrap();
    let tls_c = PeerTls::from_dir(dc.path(), OTHER).unwrap();
    // Their certificate is no certificate of this fabric.
    let e = PeerTls::from_dir(dc.path(), NAME).unwrap_err();
    assert!(e.to_string().contains(NAME), "{e}");

    let store = MemoryStore::new();
    let a = agent("node-a", &store, &tls_a).await;
    let b = agent("node-b", &store, &tls_b).await;
    let c = agent("node-c", &store, &tls_c).await;
    let worker_a = Client::connect(a.socket_dir()).await.unwrap();
    let src_a = pattern(16 * BLOCK, 5);
    let pa = worker_a
        .register("prefill-a", &[&src_a], None)
        .await
        .unwrap();
    let worker_c = Client::connect(c.socket_dir()).await.unwrap();
    let src_c = pattern(16 * BLOCK, 6);
    let pc = worker_c
        .register("prefill-c", &[&src_c], None)
        .await
        .unwrap();

    pull_checked(&b, "decode-b", "prefill-a", pa.key, &src_a)
        .await
        .unwrap();
    let e = pull_checked(&c, "decode-c", "prefill-a", pa.key, &src_a)
        .await
        .expect_err("another fabric's agent pulled");
    assert!(e.contains("certificate"), "{e}");
    let e = pull_checked(&a, "decode-a", "prefill-c", pc.key, &src_c)
        .await
        .expect_err("pulled from another fabric's agent");
    assert!(e.contains("certificate"), "{e}");

    // The servers check the client's name themselves: a caller that verifies A's name
    // correctly but presents their certificate is refused on both ports...
    for addr in [a.ready.peer, a.ready.data] {
        let e = presented(addr, &ca, &theirs, NAME)
            .await
            .expect_err("a client certificate of another fabric was accepted");
        assert!(e.contains("alert"), "{e}");
    }
    let foreign = Identity::from_pem(&theirs.cert_pem, &theirs.key_pem);
    refused(
        &a,
        Some((&ca.pem(), Some(foreign))),
        "a caller of another fabric",
    )
    .await;
    // ...and a client of this fabric does not take C for one of its servers.
    let ours = ca.issue(&[NAME]);
    let e = presented(c.ready.peer, &ca, &ours, NAME)
        .await
        .expect_err("another fabric's server was trusted");
    assert!(e.contains("certificate"), "{e}");
}
