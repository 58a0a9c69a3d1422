//! mTLS on the peer API and the tcp data port between agent processes in their own network namespaces, configured
//! as the operator does it (`KVFABRIC_TLS_DIR` naming a mounted kubernetes.io/tls Secret): a
//! decode worker pulls a prefill worker's blocks (every byte checked), a plain-TCP caller and
//! an agent of another CA learn nothing and pull nothing.

mod common;

use std::time::Duration;

use common::{BLOCK, etcd_on, sees, within};
use kvfabric_client::Client;
use kvfabric_e2e::worker::{first_mismatch, random_memory, scattered};
use kvfabric_e2e::{AgentProcess, Network};
use kvfabric_proto::contract::{DEFAULT_NAMESPACE, env, tls_server_name};
use kvfabric_proto::pb::HandshakeRequest;
use kvfabric_proto::pb::peer_agent_client::PeerAgentClient;
use kvfabric_testkit::TestCa;

const TOKEN: &str = "e2e-peer-token-0123456789";

/// A Secret directory of `ca` for one agent of fabric `e2e` (the one `AgentProcess` runs in).
fn secret(ca: &TestCa) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let name = tls_server_name("e2e", DEFAULT_NAMESPACE);
    ca.write_dir(dir.path(), &ca.issue(&[&name])).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_with_mtls_pull_and_strangers_are_refused() {
    let net = Network::new(3);
    let Some(etcd) = etcd_on(net.gateway).await else {
        return;
    };
    let ca = TestCa::new("e2e fabric");
    let (dir_a, dir_b) = (secret(&ca), secret(&ca));
    let flags = ["--transports", "tcp"];
    let spawn = |name, host, dir: &tempfile::TempDir| {
        let tls = dir.path().display().to_string();
        AgentProcess::spawn_env(
            name,
            host,
            &etcd.endpoint(),
            &flags,
            &[(env::PEER_TOKEN, TOKEN), (env::TLS_DIR, &tls)],
        )
    };
    let a = spawn("prefill-node", &net.hosts[0], &dir_a);
    let b = spawn("decode-node", &net.hosts[1], &dir_b);
    let prefill = Client::connect(a.socket_dir()).await.unwrap();
    let decode = Client::connect(b.socket_dir()).await.unwrap();

    let blocks = 128;
    let src = random_memory(blocks * BLOCK, 21);
    let dst = random_memory(blocks * BLOCK, 22);
    let p = prefill.register("prefill-0", &[&src], None).await.unwrap();
    let d = decode.register("decode-0", &[&dst], None).await.unwrap();
    within(Duration::from_secs(5), "decode sees prefill-0", || {
        sees(&decode, "prefill-0")
    })
    .await;
    let ops = scattered(64, BLOCK, blocks);
    let done = decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    assert_eq!(done.transport, "tcp");
    assert_eq!(done.remote_agent, "prefill-node");
    assert_eq!(done.bytes, 64 * BLOCK);
    assert_eq!(first_mismatch(&ops, &dst, &src), None);

    // A caller on plain TCP with the right token gets no answer from the peer port.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{}", a.ready.peer))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2));
    if let Ok(channel) = plain.connect().await {
        let mut request = tonic::Request::new(HandshakeRequest {
            fabric: "e2e".into(),
            agent: "stranger".into(),
        });
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        let said = PeerAgentClient::new(channel).handshake(request).await;
        let status = said.expect_err("a plain-TCP caller was answered");
        assert!(!status.message().contains("prefill-node"), "{status:?}");
    }

    // An agent whose certificate another CA signed, with the right token, pulls nothing.
    let other = TestCa::new("another fabric");
    let dir_c = secret(&other);
    let c = spawn("stranger-node", &net.hosts[2], &dir_c);
    let stranger = Client::connect(c.socket_dir()).await.unwrap();
    let mine = random_memory(blocks * BLOCK, 23);
    let m = stranger
        .register("stranger-0", &[&mine], None)
        .await
        .unwrap();
    within(
        Duration::from_secs(5),
        "the stranger sees prefill-0",
        || sees(&stranger, "prefill-0"),
    )
    .await;
    let refused = stranger
        .read(&m, "prefill-0", p.key, &ops)
        .await
        .expect_err("an agent of another CA pulled");
    assert!(refused.to_string().contains("certificate"), "{refused}");
    let untouched = random_memory(blocks * BLOCK, 23);
    // SAFETY: the batch was refused; nothing is in flight.
    let (got, want) = unsafe { (mine.as_slice(), untouched.as_slice()) };
    assert!(got == want, "bytes landed from a refused pull");
    // And the fabric's agents still serve each other.
    decode.read(&d, "prefill-0", p.key, &ops).await.unwrap();
    assert_eq!(first_mismatch(&ops, &dst, &src), None);
}
