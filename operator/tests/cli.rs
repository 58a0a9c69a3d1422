//! The binary's exit codes: 64 for bad configuration, 1 with a clear message when the CRD is
//! missing (checked against a local stand-in API server that answers 404).

use std::io::Write;
use std::process::Command;

fn operator() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvfabric-operator"));
    c.env_remove("POD_NAMESPACE")
        .env_remove("KVFABRIC_LEADER_ELECTION")
        .env("KVFABRIC_METRICS_ADDR", "127.0.0.1:0");
    c
}

#[test]
fn bad_config_exits_64() {
    for args in [
        vec!["--metrics-addr", "not-an-address"],
        vec!["--leader-election"],
        vec!["--no-such-flag"],
        vec!["--registry-cleanup-attempts", "0"],
    ] {
        let out = operator().args(&args).output().expect("runs");
        assert_eq!(
            out.status.code(),
            Some(64),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn help_exits_0() {
    let out = operator().arg("--help").output().expect("runs");
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--metrics-addr",
        "--leader-election",
        "--lease-name",
        "--lease-namespace",
        "--namespace",
        "--log-level",
        "--agent-image",
        "--agent-image-pull-policy",
        "--socket-root",
        "render",
        "uninstall",
    ] {
        assert!(text.contains(flag), "{flag} missing from --help");
    }
}

#[test]
fn bad_agent_settings_exit_64() {
    for args in [
        vec!["--socket-root", "relative"],
        vec!["--agent-image-pull-policy", "Sometimes"],
        vec!["render", "--file", "x.yaml", "--socket-root", "/"],
    ] {
        let out = operator().args(&args).output().expect("runs");
        assert_eq!(
            out.status.code(),
            Some(64),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn workspace() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn render_prints_the_example_fabrics_objects() {
    let example = workspace().join("charts/kvfabric/examples/prefill-decode.yaml");
    let out = operator()
        .args([
            "render",
            "--kube-version",
            "1.29",
            "--agent-image",
            "local/agent:dev",
            "--file",
        ])
        .arg(&example)
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "kind: DaemonSet",
        "name: llama-prefill-agent",
        "name: llama-decode-agent",
        "kind: ConfigMap",
        "image: local/agent:dev",
        "KVFABRIC_ETCD_KEY_PREFIX: /kvfabric\n",
        "KVFABRIC_NAMESPACE: llm",
    ] {
        assert!(stdout.contains(needle), "{needle} missing from:\n{stdout}");
    }
}

#[test]
fn render_refuses_an_invalid_fabric_with_exit_1() {
    let dir = std::env::temp_dir().join(format!("kvfabric-render-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let file = dir.join("bad.yaml");
    std::fs::write(
        &file,
        "apiVersion: kvfabric.io/v1alpha1\nkind: TransferFabric\nmetadata: {name: tf, namespace: llm}\nspec:\n  pools: [{name: p}]\n  etcd: {endpoints: [\"http://e:2379\"], keyPrefix: /kvfabric/other-ns}\n",
    )
    .expect("write");
    let out = operator()
        .args(["render", "--file"])
        .arg(&file)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("spec.etcd.keyPrefix"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn socket_dir_helper() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvfabric-socket-dir"))
}

#[test]
fn socket_dir_helper_exit_codes() {
    let dir = std::env::temp_dir().join(format!("kvfabric-sockdir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // uid/gid of the test process own what it creates, so this needs no privilege.
    std::fs::create_dir_all(&dir).expect("tmp");
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(&dir).expect("stat");
    let target = dir.join("llm/tf/prefill");
    let out = socket_dir_helper()
        .arg("--dir")
        .arg(&target)
        .args([
            "--uid",
            &m.uid().to_string(),
            "--gid",
            &m.gid().to_string(),
            "--mode",
            "2750",
        ])
        .output()
        .expect("runs");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::metadata(&target).expect("stat").mode() & 0o7777,
        0o2750
    );
    for mode in ["4750", "777", "not-octal"] {
        let out = socket_dir_helper()
            .arg("--dir")
            .arg(&target)
            .args(["--uid", "0", "--gid", "0", "--mode", mode])
            .output()
            .expect("runs");
        let code = out.status.code();
        assert!(code == Some(1) || code == Some(64), "{mode}: {code:?}");
        assert_ne!(code, Some(0), "{mode}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A one-shot HTTP server answering every request with 404, like an API server without the CRD.
fn not_found_server() -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let handle = std::thread::spawn(move || {
        // Serve a few connections (the client may retry or open more than one).
        for stream in listener.incoming().take(4) {
            let Ok(mut stream) = stream else { break };
            let mut buf = [0u8; 8192];
            let _ = std::io::Read::read(&mut stream, &mut buf);
            let body = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"the server could not find the requested resource","reason":"NotFound","code":404}"#;
            let _ = write!(
                stream,
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (addr, handle)
}

#[test]
fn missing_crd_exits_1_with_install_hint() {
    let (addr, _server) = not_found_server();
    let dir = std::env::temp_dir().join(format!("kvfabric-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user:\n    token: t\n"
        ),
    )
    .expect("kubeconfig");
    let out = operator()
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("CRD transferfabrics.kvfabric.io is not installed"),
        "{stderr}"
    );
    assert!(
        stderr.contains("kubectl apply -f charts/kvfabric/crds/"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
