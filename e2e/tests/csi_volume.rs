//! The socket directory as the CSI driver hands it out: an agent serving in its read-write
//! volume, two workers of its pool registering and moving random KV blocks through their
//! read-only volumes (memfds passed over the socket, as on a node), a pod of another namespace
//! that finds no agent, and the directory gone with the last pod. Real bind mounts: root, as CI.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use kvfabric_agent::registry::memory::MemoryStore;
use kvfabric_agent::telemetry::Telemetry;
use kvfabric_client::Client;
use kvfabric_csi::config::Config;
use kvfabric_csi::mounts::detach_under;
use kvfabric_csi::node::Node;
use kvfabric_csi::pb::csi as pb;
use kvfabric_csi::pb::csi::volume_capability::{AccessType, MountVolume};
use kvfabric_e2e::worker::{first_mismatch, random_memory, scattered};
use kvfabric_engine::TransportKind;
use kvfabric_testkit::InProcessAgent;

const BLOCK: u64 = 64 * 1024;

struct Pods {
    tmp: tempfile::TempDir,
    node: Node,
}

impl Pods {
    fn target(&self, pod: &str) -> PathBuf {
        self.tmp.path().join(format!(
            "kubelet/pods/{pod}/volumes/kubernetes.io~csi/kvfabric/mount"
        ))
    }

    fn publish(&self, pod: &str, namespace: &str, readonly: bool) -> PathBuf {
        let req = pb::NodePublishVolumeRequest {
            volume_id: format!("csi-{pod}"),
            target_path: self.target(pod).display().to_string(),
            volume_capability: Some(pb::VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: None,
            }),
            readonly,
            volume_context: HashMap::from([
                ("fabric".to_owned(), "llama".to_owned()),
                ("pool".to_owned(), "decode".to_owned()),
                (
                    "csi.storage.k8s.io/pod.namespace".to_owned(),
                    namespace.to_owned(),
                ),
                ("csi.storage.k8s.io/ephemeral".to_owned(), "true".to_owned()),
            ]),
            ..pb::NodePublishVolumeRequest::default()
        };
        self.node.publish(&req).expect("publishes").target
    }

    fn unpublish(&self, pod: &str) {
        self.node
            .unpublish(&pb::NodeUnpublishVolumeRequest {
                volume_id: format!("csi-{pod}"),
                target_path: self.target(pod).display().to_string(),
            })
            .expect("unpublishes");
    }

    fn host_dir(&self, namespace: &str) -> PathBuf {
        self.tmp
            .path()
            .join("run")
            .join(namespace)
            .join("llama/decode")
    }
}

impl Drop for Pods {
    fn drop(&mut self) {
        // A failed assertion must not leave mounts behind in /tmp.
        let _ = detach_under(self.tmp.path());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_move_kv_through_their_agents_csi_volume() {
    assert!(
        rustix::process::geteuid().is_root(),
        "bind mounts need root (CI runs as root)"
    );
    let tmp = tempfile::tempdir().expect("tmp");
    let node = Node::open(Config {
        node_id: "gpu-1".to_owned(),
        socket_root: tmp.path().join("run"),
        kubelet_dir: tmp.path().join("kubelet"),
        max_volumes: 16,
    })
    .expect("driver state");
    let pods = Pods { tmp, node };
    let agent_dir = pods.publish("agent", "llm", false);
    let prefill_dir = pods.publish("prefill-w", "llm", true);
    let decode_dir = pods.publish("decode-w", "llm", true);
    let stranger_dir = pods.publish("stranger", "other", true);

    let store = MemoryStore::new();
    let mut config = InProcessAgent::config("node-agent");
    config.socket_dir = agent_dir;
    config.transports = vec![TransportKind::Shm, TransportKind::Tcp];
    config.batch_timeout = Duration::from_secs(10);
    let agent = InProcessAgent::start_in_place(config, store.registry(), Telemetry::default())
        .await
        .expect("agent serves in its volume");
    assert!(
        std::fs::read_dir(pods.host_dir("llm"))
            .expect("host dir")
            .count()
            >= 2,
        "the agent's sockets are in the pool's host directory"
    );

    let prefill = Client::connect(&prefill_dir)
        .await
        .expect("prefill worker dials");
    let decode = Client::connect(&decode_dir)
        .await
        .expect("decode worker dials");
    let blocks = 64;
    let src = random_memory(blocks * BLOCK, 21);
    let dst = random_memory(blocks * BLOCK, 22);
    let p = prefill
        .register("prefill-0", &[&src], None)
        .await
        .expect("register src");
    let d = decode
        .register("decode-0", &[&dst], None)
        .await
        .expect("register dst");
    let ops = scattered(48, BLOCK, blocks);
    let done = decode
        .read(&d, "prefill-0", p.key, &ops)
        .await
        .expect("pull");
    assert_eq!(done.bytes, 48 * BLOCK);
    assert_eq!(first_mismatch(&ops, &dst, &src), None, "every byte as sent");
    println!(
        "pulled {} bytes over {} through the CSI volumes",
        done.bytes, done.transport
    );

    // Another namespace's pod of a fabric of the same name gets its own, empty directory.
    assert!(
        Client::connect(&stranger_dir).await.is_err(),
        "no agent of namespace llm reachable from namespace other"
    );
    assert!(pods.host_dir("other").is_dir());

    drop((prefill, decode));
    agent.stop().await.expect("agent drains");
    for pod in ["agent", "prefill-w"] {
        pods.unpublish(pod);
    }
    assert!(pods.host_dir("llm").is_dir(), "one worker still uses it");
    pods.unpublish("decode-w");
    assert!(
        !pods.tmp.path().join("run/llm").exists(),
        "the fabric's directories go with its last pod on the node"
    );
    pods.unpublish("stranger");
    assert!(!pods.tmp.path().join("run/other").exists());
}
