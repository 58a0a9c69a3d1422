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

const BLOCK: u64 = 4096;
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
