//! Leader election between replicas, against the binary: a stand-in API server holds the
//! coordination.k8s.io Lease and plays the other replica. A standby does not take a Lease that
//! its holder keeps renewing, not even when the old renewal runs out; a leader whose Lease is
//! taken exits (code 1), so the kubelet restarts it to campaign afresh.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};

const LEASE_PATH: &str =
    "/apis/coordination.k8s.io/v1/namespaces/kvfabric/leases/kvfabric-operator";
/// `leader::LEASE_DURATION_SECS`: the binary's Lease duration.
const LEASE_SECS: i64 = 15;

/// One request as the stand-in saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    path: String,
    query: String,
    body: Value,
}

#[derive(Debug, Default)]
struct Api {
    lease: Option<Value>,
    seen: Vec<Seen>,
    version: u64,
}

type Shared = Arc<Mutex<Api>>;

/// RFC 7386 merge: what apply and strategic merge patches amount to for a Lease's scalars.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

fn reply(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn ok(body: &Value) -> Response {
    reply(StatusCode::OK, body)
}

fn not_found() -> Response {
    reply(
        StatusCode::NOT_FOUND,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
    )
}

async fn answer(State(api): State<Shared>, method: Method, uri: Uri, body: Bytes) -> Response {
    let seen = Seen {
        method: method.clone(),
        path: uri.path().to_owned(),
        query: uri.query().unwrap_or_default().to_owned(),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    };
    let watch = seen.query.split('&').any(|kv| kv == "watch=true");
    let answer = {
        let mut api = api.lock().unwrap_or_else(|e| e.into_inner());
        api.seen.push(seen.clone());
        let path = seen.path.as_str();
        if watch {
            None
        } else if path == "/version" {
            Some(ok(
                &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0",
                "gitCommit": "", "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z",
                "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"}),
            ))
        } else if path.starts_with(LEASE_PATH) || path == LEASE_PATH.rsplit_once('/').unwrap().0 {
            Some(lease(&mut api, &seen))
        } else if method == Method::GET {
            Some(ok(&json!({"apiVersion": "v1", "kind": "List",
                "metadata": {"resourceVersion": "1"}, "items": []})))
        } else {
            Some(not_found())
        }
    };
    match answer {
        Some(r) => r,
        // Watches stay open and quiet, like an API server with no changes.
        None => std::future::pending().await,
    }
}

fn lease(api: &mut Api, seen: &Seen) -> Response {
    api.version += 1;
    let version = api.version.to_string();
    match (&seen.method, api.lease.as_mut()) {
        (&Method::GET, Some(l)) => ok(l),
        (&Method::POST, None) => {
            let mut l = seen.body.clone();
            l["metadata"]["resourceVersion"] = json!(version);
            l["metadata"]["namespace"] = json!("kvfabric");
            api.lease = Some(l.clone());
            reply(StatusCode::CREATED, &l)
        }
        (&Method::PATCH, Some(l)) => {
            merge(l, &seen.body);
            l["metadata"]["resourceVersion"] = json!(version);
            ok(l)
        }
        _ => not_found(),
    }
}

struct Stand {
    api: Shared,
    _dir: tempfile::TempDir,
    kubeconfig: std::path::PathBuf,
}

impl Stand {
    async fn start(lease: Option<Value>) -> Stand {
        let api: Shared = Arc::new(Mutex::new(Api {
            lease,
            ..Api::default()
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().fallback(answer).with_state(api.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user:\n    token: t\n"
            ),
        )
        .unwrap();
        Stand {
            api,
            _dir: dir,
            kubeconfig,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.api
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .seen
            .clone()
    }

    fn holder(&self) -> Option<String> {
        let api = self.api.lock().unwrap_or_else(|e| e.into_inner());
        api.lease.as_ref()?["spec"]["holderIdentity"]
            .as_str()
            .map(str::to_owned)
    }

    /// What the other replica does: holds the Lease as `holder`, renewed `ago` in the past.
    fn hold(&self, holder: &str, ago: SignedDuration) {
        let mut api = self.api.lock().unwrap_or_else(|e| e.into_inner());
        api.version += 1;
        api.lease = Some(held_lease(holder, ago, api.version));
    }

    /// The operator as replica `identity`, with leader election on.
    fn operator(&self, identity: &str, metrics: SocketAddr) -> Child {
        Command::new(env!("CARGO_BIN_EXE_kvfabric-operator"))
            .args([
                "--leader-election",
                "--lease-namespace",
                "kvfabric",
                "--lease-name",
                "kvfabric-operator",
                "--metrics-addr",
                &metrics.to_string(),
            ])
            .env("KUBECONFIG", &self.kubeconfig)
            .env("POD_NAME", identity)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("POD_NAMESPACE")
            .env_remove("KVFABRIC_LEADER_ELECTION")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("operator runs")
    }

    /// Whether the controller ran: it lists the kinds it owns (the CRD check lists fabrics only).
    fn controller_started(&self) -> bool {
        self.seen()
            .iter()
            .any(|s| s.method == Method::GET && s.path.ends_with("/daemonsets"))
    }

    /// Writes to the Lease that name `identity` as the holder.
    fn takes_by(&self, identity: &str) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| {
                s.path.starts_with(LEASE_PATH)
                    && s.method != Method::GET
                    && s.body["spec"]["holderIdentity"] == identity
            })
            .collect()
    }
}

fn held_lease(holder: &str, ago: SignedDuration, version: u64) -> Value {
    let renewed = MicroTime(Timestamp::now() - ago);
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "kvfabric-operator", "namespace": "kvfabric",
                     "resourceVersion": version.to_string()},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": LEASE_SECS,
                 "acquireTime": renewed, "renewTime": renewed, "leaseTransitions": 1},
    })
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
}

/// `/readyz` of the operator's HTTP server: its words, or None while it does not answer.
fn readyz(addr: SocketAddr) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /readyz HTTP/1.1\r\nHost: op\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned())
}

async fn until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

/// Waits up to `limit` for the process to exit; kills it and panics when it does not.
fn exit_within(child: &mut Child, limit: Duration) -> (Option<i32>, String) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            let _ = child
                .stderr
                .take()
                .map(|mut e| e.read_to_string(&mut stderr));
            return (status.code(), stderr);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("operator did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_does_not_take_a_lease_its_holder_renews() {
    // Renewed 13 s ago: by the standby's own reckoning the Lease runs out 2 s after it starts,
    // and it must look again then, find it renewed, and keep waiting.
    let stand = Stand::start(Some(held_lease("pod-a", SignedDuration::from_secs(13), 1))).await;
    let metrics = free_addr();
    let mut standby = stand.operator("pod-b", metrics);
    until(Duration::from_secs(20), "standby ready", || {
        readyz(metrics).is_some_and(|r| r.contains("standby"))
    })
    .await;
    // The holder renews every second, for longer than the old renewal had left.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        stand.hold("pod-a", SignedDuration::ZERO);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(stand.holder().as_deref(), Some("pod-a"));
        assert!(
            readyz(metrics).is_some_and(|r| r.contains("standby")),
            "{:?}",
            readyz(metrics)
        );
    }
    let reads = stand
        .seen()
        .iter()
        .filter(|s| s.method == Method::GET && s.path == LEASE_PATH)
        .count();
    // It looked again when the old renewal ran out (and at its start).
    assert!(reads >= 2, "the standby read the Lease {reads} times");
    assert!(
        stand.takes_by("pod-b").is_empty(),
        "{:#?}",
        stand.takes_by("pod-b")
    );
    assert!(!stand.controller_started(), "a standby ran the controller");

    // A standby stops cleanly on SIGTERM and leaves the other replica's Lease alone.
    let _ = Command::new("kill")
        .args(["-TERM", &standby.id().to_string()])
        .status();
    let (code, stderr) = exit_within(&mut standby, Duration::from_secs(10));
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stand.holder().as_deref(), Some("pod-a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_is_taken_exits() {
    let stand = Stand::start(None).await;
    let metrics = free_addr();
    let mut leader = stand.operator("pod-a", metrics);
    until(
        Duration::from_secs(20),
        "pod-a takes the free Lease",
        || stand.holder().as_deref() == Some("pod-a"),
    )
    .await;
    until(
        Duration::from_secs(10),
        "the leader's controller runs",
        || stand.controller_started(),
    )
    .await;
    assert!(readyz(metrics).is_some_and(|r| r.contains("leader")));

    // Another replica holds the Lease now (pod-a missed its renewals, say). pod-a notices when
    // it next renews, before its Lease would have run out, and exits.
    let taken = Instant::now();
    stand.hold("pod-b", SignedDuration::ZERO);
    let (code, stderr) = exit_within(&mut leader, Duration::from_secs(LEASE_SECS as u64 + 5));
    let took = taken.elapsed();
    println!("leader exited {took:?} after its Lease was taken: {code:?}");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("lost the lease"), "{stderr}");
    assert!(took <= Duration::from_secs(LEASE_SECS as u64), "{took:?}");
    // It did not take the Lease back on its way out.
    assert_eq!(stand.holder().as_deref(), Some("pod-b"));
}
