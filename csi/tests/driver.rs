//! The driver as the kubelet uses it: over its Unix sockets, with real bind mounts (the tests run
//! as root, as CI does), an agent's socket reached through a worker's read-only volume.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use kvfabric_csi::config::Config;
use kvfabric_csi::mounts::{detach_under, is_mount_point};
use kvfabric_csi::node::Node;
use kvfabric_csi::pb::csi as pb;
use kvfabric_csi::pb::csi::identity_client::IdentityClient;
use kvfabric_csi::pb::csi::node_client::NodeClient;
use kvfabric_csi::pb::csi::volume_capability::{AccessType, BlockVolume, MountVolume};
use kvfabric_csi::pb::registration as reg;
use kvfabric_csi::pb::registration::registration_client::RegistrationClient;
use kvfabric_csi::server::{bind, serve};
use kvfabric_csi::{Error, Result};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the CSI driver's tests bind-mount directories: run them as root (CI does)"
    );
}

/// A driver serving in a temporary directory: `run/` is the socket root, `kubelet/` the
/// kubelet's. Dropping it detaches whatever a failed test left mounted there.
struct Driver {
    tmp: tempfile::TempDir,
    csi: PathBuf,
    registration: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<()>>>,
}

impl Driver {
    fn start(max_volumes: usize) -> Self {
        Self::start_in(tempfile::tempdir().expect("tmp"), max_volumes)
    }

    fn start_in(tmp: tempfile::TempDir, max_volumes: usize) -> Self {
        require_root();
        let config = Config {
            node_id: "gpu-node-1".to_owned(),
            socket_root: tmp.path().join("run"),
            kubelet_dir: tmp.path().join("kubelet"),
            max_volumes,
        };
        let csi = config.csi_socket();
        let registration = config.registration_socket();
        let node = Node::open(config).expect("opens");
        let csi_listener = bind(&csi).expect("binds csi");
        let reg_listener = bind(&registration).expect("binds registration");
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(serve(
            node,
            (csi_listener, csi.clone()),
            (reg_listener, registration.clone()),
            async move {
                let _ = stopped.await;
            },
        ));
        Driver {
            tmp,
            csi,
            registration,
            stop: Some(stop),
            task: Some(task),
        }
    }

    async fn stop(mut self) -> tempfile::TempDir {
        let _ = self.stop.take().expect("running").send(());
        self.task
            .take()
            .expect("running")
            .await
            .expect("joins")
            .expect("stops cleanly");
        let tmp = tempfile::tempdir().expect("tmp");
        std::mem::replace(&mut self.tmp, tmp)
    }

    fn root(&self) -> PathBuf {
        self.tmp.path().join("run")
    }

    fn target(&self, pod: &str) -> PathBuf {
        self.tmp.path().join(format!(
            "kubelet/pods/{pod}/volumes/kubernetes.io~csi/kvfabric/mount"
        ))
    }

    async fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(channel(&self.csi).await)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = detach_under(self.tmp.path());
    }
}

async fn channel(path: &Path) -> Channel {
    let path = path.to_path_buf();
    Endpoint::from_static("http://csi")
        .connect_with_connector(service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
        .expect("connects")
}

fn publish(
    d: &Driver,
    id: &str,
    pod: &str,
    namespace: &str,
    pool: &str,
    readonly: bool,
) -> pb::NodePublishVolumeRequest {
    pb::NodePublishVolumeRequest {
        volume_id: id.to_owned(),
        target_path: d.target(pod).display().to_string(),
        volume_capability: Some(pb::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: None,
        }),
        readonly,
        volume_context: HashMap::from([
            ("fabric".to_owned(), "tf".to_owned()),
            ("pool".to_owned(), pool.to_owned()),
            (
                "csi.storage.k8s.io/pod.namespace".to_owned(),
                namespace.to_owned(),
            ),
            ("csi.storage.k8s.io/pod.name".to_owned(), pod.to_owned()),
            ("csi.storage.k8s.io/ephemeral".to_owned(), "true".to_owned()),
        ]),
        ..pb::NodePublishVolumeRequest::default()
    }
}

fn unpublish(d: &Driver, id: &str, pod: &str) -> pb::NodeUnpublishVolumeRequest {
    pb::NodeUnpublishVolumeRequest {
        volume_id: id.to_owned(),
        target_path: d.target(pod).display().to_string(),
    }
}

#[tokio::test]
async fn an_agents_socket_reaches_its_workers_and_no_other_namespace() {
    let d = Driver::start(16);
    let mut node = d.node().await;
    node.node_publish_volume(publish(&d, "csi-agent", "agent", "llm", "prefill", false))
        .await
        .expect("agent's volume");
    node.node_publish_volume(publish(&d, "csi-worker", "worker", "llm", "prefill", true))
        .await
        .expect("worker's volume");
    node.node_publish_volume(publish(&d, "csi-other", "other", "other", "prefill", true))
        .await
        .expect("another namespace's volume");
    // The kubelet retries a publish it did not see answered: the same again is fine.
    node.node_publish_volume(publish(&d, "csi-worker", "worker", "llm", "prefill", true))
        .await
        .expect("idempotent");
    let mut moved = publish(&d, "csi-worker", "elsewhere", "llm", "prefill", true);
    moved.readonly = true;
    let e = node
        .node_publish_volume(moved)
        .await
        .expect_err("one target per id");
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    // Another volume onto a target in use: refused, and no socket directory made for it.
    let e = node
        .node_publish_volume(publish(
            &d,
            "csi-late",
            "worker",
            "elsewhere",
            "prefill",
            true,
        ))
        .await
        .expect_err("the target is mounted");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(
        !d.root().join("elsewhere").exists(),
        "a refused target left a directory"
    );

    // The agent binds its socket in its own volume; the worker dials it through its own.
    let socket = d.target("agent").join("local.sock");
    let listener = UnixListener::bind(&socket).expect("agent binds");
    assert!(d.root().join("llm/tf/prefill/local.sock").exists());
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accepts");
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).expect("reads");
        s.write_all(&buf).expect("echoes");
    });
    let mut c = UnixStream::connect(d.target("worker").join("local.sock")).expect("worker dials");
    c.write_all(b"hello").expect("writes");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("reads");
    assert_eq!(&back, b"hello");
    server.join().expect("server");
    // Read-only for the worker, and another namespace's pod sees an empty directory of its own.
    let e = std::fs::write(d.target("worker").join("x"), b"x").expect_err("read-only");
    assert_eq!(
        e.raw_os_error(),
        Some(rustix::io::Errno::ROFS.raw_os_error()),
        "{e}"
    );
    assert!(!d.target("other").join("local.sock").exists());
    assert!(is_mount_point(&d.target("other")).expect("mountinfo"));

    // The directory stays while one pod still uses it, and goes with the last.
    node.node_unpublish_volume(unpublish(&d, "csi-agent", "agent"))
        .await
        .expect("agent's unpublish");
    assert!(!d.target("agent").exists(), "target removed");
    assert!(
        d.root().join("llm/tf/prefill/local.sock").exists(),
        "worker still uses it"
    );
    node.node_unpublish_volume(unpublish(&d, "csi-worker", "worker"))
        .await
        .expect("worker's unpublish");
    assert!(
        !d.root().join("llm").exists(),
        "namespace directory removed with the last pool"
    );
    assert!(d.root().join("other/tf/prefill").is_dir());
    node.node_unpublish_volume(unpublish(&d, "csi-other", "other"))
        .await
        .expect("other's unpublish");
    assert!(!d.root().join("other").exists());
    // Twice, or never published: done already.
    node.node_unpublish_volume(unpublish(&d, "csi-other", "other"))
        .await
        .expect("again");
    node.node_unpublish_volume(unpublish(&d, "csi-never", "never"))
        .await
        .expect("unknown");
    d.stop().await;
}

#[tokio::test]
async fn bad_requests_name_their_field_and_mount_nothing() {
    let d = Driver::start(16);
    let mut node = d.node().await;
    let mut cases: Vec<(pb::NodePublishVolumeRequest, &str)> = Vec::new();
    let mut r = publish(&d, "csi-a", "a", "llm", "prefill", true);
    r.volume_context
        .insert("fabric".to_owned(), "../../etc".to_owned());
    cases.push((r, "volume_context[fabric]"));
    let mut r = publish(&d, "csi-a", "a", "llm", "prefill", true);
    r.volume_context.remove("csi.storage.k8s.io/pod.namespace");
    cases.push((r, "podInfoOnMount"));
    let mut r = publish(&d, "csi-a", "a", "llm", "prefill", true);
    r.target_path = "/etc".to_owned();
    cases.push((r, "target_path"));
    let mut r = publish(&d, "csi-a", "a", "llm", "prefill", true);
    r.volume_id = "../x".to_owned();
    cases.push((r, "volume_id"));
    let mut r = publish(&d, "csi-a", "a", "llm", "prefill", true);
    r.volume_capability = Some(pb::VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: None,
    });
    cases.push((r, "volume_capability"));
    let mut r = publish(&d, "csi-a", "a", "llm", "prefill", true);
    r.volume_context.remove("csi.storage.k8s.io/ephemeral");
    cases.push((r, "ephemeral"));
    for (req, field) in cases {
        let e = node.node_publish_volume(req).await.expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains(field), "{field}: {}", e.message());
    }
    let e = node
        .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: "csi-a".to_owned(),
            target_path: "/proc".to_owned(),
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let tmp = d.tmp.path().display().to_string();
    assert!(!info.contains(&tmp), "nothing mounted under {tmp}");
    assert!(
        !d.root().join("llm").exists(),
        "no directory made for a refused request"
    );
    d.stop().await;
}

#[tokio::test]
async fn the_limit_holds_and_state_survives_a_restart() {
    let d = Driver::start(2);
    let mut node = d.node().await;
    for (id, pod) in [("csi-1", "p1"), ("csi-2", "p2")] {
        node.node_publish_volume(publish(&d, id, pod, "llm", "decode", true))
            .await
            .expect("within the limit");
    }
    let e = node
        .node_publish_volume(publish(&d, "csi-3", "p3", "llm", "decode", true))
        .await
        .expect_err("over the limit");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(!d.target("p3").exists() || !is_mount_point(&d.target("p3")).expect("mountinfo"));
    drop(node);
    let tmp = d.stop().await;
    // A restarted driver knows both volumes: the directory goes only with the second.
    let d = Driver::start_in(tmp, 2);
    let mut node = d.node().await;
    node.node_unpublish_volume(unpublish(&d, "csi-1", "p1"))
        .await
        .expect("first");
    assert!(d.root().join("llm/tf/decode").is_dir());
    node.node_unpublish_volume(unpublish(&d, "csi-2", "p2"))
        .await
        .expect("second");
    assert!(!d.root().join("llm").exists());
    d.stop().await;
}

#[tokio::test]
async fn identity_and_registration_answer_as_the_kubelet_expects() {
    let d = Driver::start(16);
    let mut id = IdentityClient::new(channel(&d.csi).await);
    let info = id
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.name, "csi.kvfabric.io");
    assert!(!info.vendor_version.is_empty());
    let probe = id
        .probe(pb::ProbeRequest {})
        .await
        .expect("probe")
        .into_inner();
    assert_eq!(probe.ready, Some(true));
    let caps = id
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .expect("caps")
        .into_inner();
    assert!(caps.capabilities.is_empty(), "node only");
    let mut node = d.node().await;
    let info = node
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .expect("node info")
        .into_inner();
    assert_eq!(info.node_id, "gpu-node-1");
    let caps = node
        .node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .expect("node caps")
        .into_inner();
    assert!(caps.capabilities.is_empty(), "no staging");

    let mut r = RegistrationClient::new(channel(&d.registration).await);
    let plugin = r
        .get_info(reg::InfoRequest {})
        .await
        .expect("info")
        .into_inner();
    assert_eq!(plugin.r#type, "CSIPlugin");
    assert_eq!(plugin.name, "csi.kvfabric.io");
    assert_eq!(Path::new(&plugin.endpoint), d.csi);
    assert_eq!(plugin.supported_versions, ["1.0.0"]);
    r.notify_registration_status(reg::RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .expect("notified");
    // A refusal ends the driver with the kubelet's reason.
    r.notify_registration_status(reg::RegistrationStatus {
        plugin_registered: false,
        error: "driver name conflicts".to_owned(),
    })
    .await
    .expect("notified");
    let mut d = d;
    let ended = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        d.task.take().expect("running"),
    )
    .await
    .expect("ends within 10 s")
    .expect("joins");
    match ended {
        Err(Error::NotRegistered(reason)) => assert_eq!(reason, "driver name conflicts"),
        other => panic!("expected NotRegistered, got {other:?}"),
    }
}
