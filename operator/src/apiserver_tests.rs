//! Reconcile scenarios against a fake API server (tower-test mock service behind a real
//! `kube::Client`), in the style of kube-rs/controller-rs's `ApiServerVerifier`: every request is
//! answered from a small in-memory state and recorded, and each test asserts on what was sent.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Client, Resource};
use kvfabric_crds::TransferFabric;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tower_test::mock;

use crate::config::AgentSettings;
use crate::finalizer::{CleanupPolicy, EtcdAccess, EtcdTls, FINALIZER, RegistryCleaner};
use crate::fixtures::{NS, UID, full};
use crate::meta::MANAGER;
use crate::metrics::Metrics;
use crate::reconcile::{Context, check_crd_installed, error_policy, reconcile, run_controller};
use crate::{Error, Result};
use kvfabric_rt::KeyedBackoff;

/// One request as the fake API server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    path: String,
    query: Vec<(String, String)>,
    content_type: String,
    body: Value,
}

impl Seen {
    fn param(&self, k: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }

    fn is_apply(&self) -> bool {
        self.method == Method::PATCH && self.content_type == "application/apply-patch+yaml"
    }
}

/// What a request matcher decides.
#[derive(Clone)]
enum Fault {
    /// Answer with this HTTP status and a `Status` body.
    Code(u16),
    /// Never answer.
    Hang,
}

/// The fake API server's state.
#[derive(Default)]
struct State {
    fabric: Option<TransferFabric>,
    /// DaemonSets the list call returns.
    existing: Vec<DaemonSet>,
    /// `(method, path suffix, fault)`: the first match wins.
    faults: Vec<(Method, String, Fault)>,
    /// `desired/ready` reported on every applied DaemonSet.
    ds_status: (i32, i32),
    /// TransferFabric list answers 404 (CRD missing).
    crd_missing: bool,
    /// What a TransferFabric list returns; DELETE and merge PATCH act on it.
    listed: Vec<TransferFabric>,
    /// A DELETE of a listed fabric removes it at once, as a running operator's finalizer would.
    finalize_on_delete: bool,
    /// Pods a pod list returns.
    pods: Vec<Value>,
    /// Core v1 Events an event list returns (filtered by `involvedObject.name`).
    core_events: Vec<Value>,
    /// The NetworkPolicy a GET by name finds.
    network_policy: Option<Value>,
    /// The coordination.k8s.io Lease, once created.
    lease: Option<Value>,
    /// Secrets a GET by name finds.
    secrets: Vec<Value>,
    /// `(plural, object)`: what a GET by name of a ServiceAccount, ConfigMap, Service or
    /// DaemonSet finds (DaemonSets also in `existing`); anything else is 404.
    children: Vec<(&'static str, Value)>,
}

/// JSON merge patch (RFC 7386): what SSA and strategic merge amount to for a Lease's scalars.
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

struct Fake {
    seen: Arc<Mutex<Vec<Seen>>>,
    _task: JoinHandle<()>,
}

fn status_body(code: u16) -> Value {
    let reason = match code {
        404 => "NotFound",
        409 => "Conflict",
        _ => "InternalError",
    };
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("injected {code}"), "reason": reason, "code": code
    })
}

fn respond(send: mock::SendResponse<Response<Body>>, code: StatusCode, body: &Value) {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    send.send_response(
        Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(bytes))
            .expect("response builds"),
    );
}

fn apply_json_patch(fabric: &mut TransferFabric, ops: &Value) {
    for op in ops.as_array().into_iter().flatten() {
        let path = op["path"].as_str().unwrap_or_default();
        match op["op"].as_str() {
            Some("add") if path == "/metadata/finalizers" => {
                fabric.metadata.finalizers = serde_json::from_value(op["value"].clone()).ok();
            }
            Some("add") if path == "/metadata/finalizers/-" => {
                if let Some(s) = op["value"].as_str() {
                    fabric
                        .metadata
                        .finalizers
                        .get_or_insert_default()
                        .push(s.to_owned());
                }
            }
            Some("remove") if path.starts_with("/metadata/finalizers/") => {
                let i: usize = path
                    .rsplit('/')
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                if let Some(f) = fabric.metadata.finalizers.as_mut()
                    && i < f.len()
                {
                    f.remove(i);
                }
            }
            _ => {}
        }
    }
}

impl Fake {
    fn start(state: State) -> (Client, Fake) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            let mut state = state;
            let mut hung = Vec::new();
            let mut handle = handle;
            while let Some((req, send)) = handle.next_request().await {
                let (parts, body) = req.into_parts();
                let bytes = body.collect_bytes().await.unwrap_or_default();
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                let query = parts
                    .uri
                    .query()
                    .unwrap_or_default()
                    .split('&')
                    .filter(|s| !s.is_empty())
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                        (
                            k.to_owned(),
                            v.replace("%2F", "/")
                                .replace("%3D", "=")
                                .replace("%2C", ","),
                        )
                    })
                    .collect();
                let s = Seen {
                    method: parts.method.clone(),
                    path: parts.uri.path().to_owned(),
                    query,
                    content_type: parts
                        .headers
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned(),
                    body,
                };
                log.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(s.clone());

                let fault = state
                    .faults
                    .iter()
                    .find(|(m, suffix, _)| *m == s.method && s.path.ends_with(suffix.as_str()))
                    .map(|(_, _, f)| f.clone());
                match fault {
                    Some(Fault::Hang) => {
                        hung.push(send);
                        continue;
                    }
                    Some(Fault::Code(code)) => {
                        respond(
                            send,
                            StatusCode::from_u16(code).unwrap_or_default(),
                            &status_body(code),
                        );
                        continue;
                    }
                    None => {}
                }

                let p = s.path.as_str();
                if p.contains("/leases") {
                    match (&s.method, state.lease.as_mut()) {
                        (&Method::POST, _) => {
                            let mut lease = s.body.clone();
                            lease["metadata"]["resourceVersion"] = json!("1");
                            state.lease = Some(lease.clone());
                            respond(send, StatusCode::CREATED, &lease);
                        }
                        (&Method::PATCH, Some(lease)) => {
                            merge(lease, &s.body);
                            respond(send, StatusCode::OK, lease);
                        }
                        (&Method::GET, Some(lease)) => respond(send, StatusCode::OK, lease),
                        _ => respond(send, StatusCode::NOT_FOUND, &status_body(404)),
                    }
                    continue;
                }
                if p.contains("/secrets/") && s.method == Method::GET {
                    let name = p.rsplit('/').next().unwrap_or_default();
                    match state.secrets.iter().find(|x| x["metadata"]["name"] == name) {
                        Some(secret) => respond(send, StatusCode::OK, secret),
                        None => respond(send, StatusCode::NOT_FOUND, &status_body(404)),
                    }
                    continue;
                }
                if s.method == Method::GET && s.param("watch") == Some("true") {
                    // Watches stay open and quiet, like an API server with no changes.
                    hung.push(send);
                    continue;
                }
                if s.method == Method::GET {
                    let mut segs = p.rsplit('/');
                    let (name, plural) = (
                        segs.next().unwrap_or_default(),
                        segs.next().unwrap_or_default(),
                    );
                    if matches!(
                        plural,
                        "serviceaccounts" | "configmaps" | "services" | "daemonsets"
                    ) {
                        let existing_ds = state
                            .existing
                            .iter()
                            .filter(|_| plural == "daemonsets")
                            .filter_map(|d| serde_json::to_value(d).ok());
                        let found = state
                            .children
                            .iter()
                            .filter(|(k, _)| *k == plural)
                            .map(|(_, o)| o.clone())
                            .chain(existing_ds)
                            .find(|o| o["metadata"]["name"] == name);
                        match found {
                            Some(o) => respond(send, StatusCode::OK, &o),
                            None => respond(send, StatusCode::NOT_FOUND, &status_body(404)),
                        }
                        continue;
                    }
                }
                let list = |items: Vec<Value>| {
                    json!({"apiVersion": "v1", "kind": "List",
                           "metadata": {"resourceVersion": "1"}, "items": items})
                };
                if p.ends_with("/pods") && s.method == Method::GET {
                    respond(send, StatusCode::OK, &list(state.pods.clone()));
                    continue;
                }
                if p.starts_with("/api/v1/") && p.ends_with("/events") && s.method == Method::GET {
                    let wanted = s
                        .param("fieldSelector")
                        .and_then(|f| {
                            f.split(',')
                                .find_map(|kv| kv.strip_prefix("involvedObject.name="))
                        })
                        .map(str::to_owned);
                    let items = state
                        .core_events
                        .iter()
                        .filter(|e| {
                            wanted
                                .as_deref()
                                .is_none_or(|w| e["involvedObject"]["name"] == w)
                        })
                        .cloned()
                        .collect();
                    respond(send, StatusCode::OK, &list(items));
                    continue;
                }
                if p.contains("/networkpolicies/") && s.method == Method::GET {
                    match &state.network_policy {
                        Some(np) => respond(send, StatusCode::OK, np),
                        None => respond(send, StatusCode::NOT_FOUND, &status_body(404)),
                    }
                    continue;
                }
                if p.contains("/networkpolicies/") && s.method == Method::DELETE {
                    let gone = state.network_policy.take().unwrap_or(Value::Null);
                    respond(send, StatusCode::OK, &gone);
                    continue;
                }
                let fabric_name = p
                    .split_once("/transferfabrics/")
                    .map(|(_, rest)| rest.split('/').next().unwrap_or_default().to_owned());
                let listed_at = fabric_name.as_deref().and_then(|n| {
                    state
                        .listed
                        .iter()
                        .position(|f| f.metadata.name.as_deref() == Some(n))
                });
                if fabric_name.is_some() && !p.ends_with("/status") {
                    let merge_patch = s.method == Method::PATCH
                        && s.content_type == "application/merge-patch+json";
                    if s.method == Method::DELETE || merge_patch || s.method == Method::GET {
                        let Some(i) = listed_at else {
                            respond(send, StatusCode::NOT_FOUND, &status_body(404));
                            continue;
                        };
                        let f = &mut state.listed[i];
                        if s.method == Method::DELETE {
                            f.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
                        } else if merge_patch {
                            let rv = &s.body["metadata"]["resourceVersion"];
                            if !rv.is_null()
                                && rv.as_str() != f.metadata.resource_version.as_deref()
                            {
                                respond(send, StatusCode::CONFLICT, &status_body(409));
                                continue;
                            }
                            f.metadata.finalizers =
                                serde_json::from_value(s.body["metadata"]["finalizers"].clone())
                                    .ok();
                        }
                        if s.method != Method::GET {
                            let rv: u64 = f
                                .metadata
                                .resource_version
                                .as_deref()
                                .and_then(|v| v.parse().ok())
                                .unwrap_or(0);
                            f.metadata.resource_version = Some((rv + 1).to_string());
                        }
                        let body = serde_json::to_value(&*f).unwrap_or_default();
                        let finalized = f.metadata.deletion_timestamp.is_some()
                            && (state.finalize_on_delete
                                || f.metadata.finalizers.as_ref().is_none_or(Vec::is_empty));
                        if finalized {
                            state.listed.remove(i);
                        }
                        respond(send, StatusCode::OK, &body);
                        continue;
                    }
                }
                if p.ends_with("/events") && s.method == Method::POST {
                    respond(send, StatusCode::CREATED, &s.body);
                } else if p.contains("/transferfabrics") && s.method == Method::GET {
                    if state.crd_missing {
                        respond(send, StatusCode::NOT_FOUND, &status_body(404));
                    } else {
                        respond(
                            send,
                            StatusCode::OK,
                            &json!({
                                "apiVersion": "kvfabric.io/v1alpha1", "kind": "TransferFabricList",
                                "metadata": {"resourceVersion": "1"},
                                "items": state.listed.iter().collect::<Vec<_>>(),
                            }),
                        );
                    }
                } else if p.ends_with("/status") && p.contains("/transferfabrics/") {
                    let mut f = state.fabric.clone().unwrap_or_else(full);
                    f.status = serde_json::from_value(s.body["status"].clone()).ok();
                    state.fabric = Some(f.clone());
                    respond(
                        send,
                        StatusCode::OK,
                        &serde_json::to_value(&f).unwrap_or_default(),
                    );
                } else if p.contains("/transferfabrics/") && s.method == Method::PATCH {
                    let mut f = state.fabric.clone().unwrap_or_else(full);
                    apply_json_patch(&mut f, &s.body);
                    state.fabric = Some(f.clone());
                    respond(
                        send,
                        StatusCode::OK,
                        &serde_json::to_value(&f).unwrap_or_default(),
                    );
                } else if p.ends_with("/daemonsets") && s.method == Method::GET {
                    respond(
                        send,
                        StatusCode::OK,
                        &json!({
                            "apiVersion": "apps/v1", "kind": "DaemonSetList", "metadata": {},
                            "items": state.existing,
                        }),
                    );
                } else if p.contains("/daemonsets/") && s.method == Method::DELETE {
                    let name = p.rsplit('/').next().unwrap_or_default();
                    let gone = state
                        .existing
                        .iter()
                        .find(|d| d.metadata.name.as_deref() == Some(name))
                        .cloned();
                    state
                        .existing
                        .retain(|d| d.metadata.name.as_deref() != Some(name));
                    respond(
                        send,
                        StatusCode::OK,
                        &serde_json::to_value(gone).unwrap_or_default(),
                    );
                } else if s.is_apply() {
                    let mut obj = s.body.clone();
                    if p.contains("/daemonsets/") {
                        let (desired, ready) = state.ds_status;
                        obj["status"] = serde_json::to_value(DaemonSetStatus {
                            desired_number_scheduled: desired,
                            number_ready: ready,
                            updated_number_scheduled: Some(desired),
                            ..DaemonSetStatus::default()
                        })
                        .unwrap_or_default();
                    }
                    respond(send, StatusCode::OK, &obj);
                } else if s.method == Method::GET {
                    respond(
                        send,
                        StatusCode::OK,
                        &json!({"apiVersion": "v1", "kind": "List",
                                "metadata": {"resourceVersion": "1"}, "items": []}),
                    );
                } else {
                    respond(send, StatusCode::NOT_FOUND, &status_body(404));
                }
            }
        });
        (client, Fake { seen, _task: task })
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn applies(&self) -> Vec<Seen> {
        self.seen().into_iter().filter(Seen::is_apply).collect()
    }

    fn status_patches(&self) -> Vec<Seen> {
        self.applies()
            .into_iter()
            .filter(|s| s.path.ends_with("/status"))
            .collect()
    }

    fn events(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.path.ends_with("/events"))
            .collect()
    }
}

#[derive(Debug, Default)]
struct FakeCleaner {
    fail: bool,
    calls: Mutex<Vec<(EtcdAccess, String)>>,
}

impl RegistryCleaner for FakeCleaner {
    fn delete_prefix<'a>(
        &'a self,
        access: &'a EtcdAccess,
        prefix: &'a str,
    ) -> BoxFuture<'a, Result<u64>> {
        let endpoints = &access.endpoints;
        Box::pin(async move {
            self.calls
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((access.clone(), prefix.to_owned()));
            if self.fail {
                Err(Error::Registry {
                    endpoints: endpoints.to_vec(),
                    prefix: prefix.to_owned(),
                    message: "connection refused".into(),
                })
            } else {
                Ok(3)
            }
        })
    }
}

fn context(client: Client, cleaner: Arc<FakeCleaner>) -> Arc<Context> {
    context_cleaning(client, cleaner)
}

fn context_cleaning(client: Client, cleaner: Arc<dyn RegistryCleaner>) -> Arc<Context> {
    Arc::new(Context {
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: None,
            },
        ),
        client,
        metrics: Arc::new(Metrics::default()),
        cleaner,
        cleanup: CleanupPolicy {
            attempts: 3,
            timeout: Duration::from_millis(200),
            backoff: Duration::ZERO,
        },
        backoff: Arc::new(KeyedBackoff::new(
            Duration::from_secs(5),
            Duration::from_secs(300),
        )),
        reconcile_timeout: Duration::from_millis(500),
        agents: AgentSettings::default(),
    })
}

fn finalized(mut f: TransferFabric) -> TransferFabric {
    f.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
    f
}

fn owned_ds(pool: &str, uid: &str) -> DaemonSet {
    let f = full();
    let mut pool_spec = f.spec.pools[0].clone();
    pool_spec.name = pool.to_owned();
    let mut ds =
        crate::daemonset::desired_daemonset(&f, &pool_spec, &AgentSettings::default(), "h")
            .expect("builds");
    if let Some(refs) = ds.metadata.owner_references.as_mut() {
        refs[0].uid = uid.to_owned();
    }
    ds
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

#[tokio::test]
async fn create_adds_the_finalizer_first() {
    let (client, fake) = Fake::start(State::default());
    let ctx = context(client, Arc::default());
    let action = reconcile(Arc::new(full()), ctx).await.expect("reconciles");
    assert_eq!(action, Action::await_change());
    let seen = fake.seen();
    assert_eq!(seen.len(), 1, "{seen:#?}");
    let s = &seen[0];
    assert_eq!(s.method, Method::PATCH);
    assert_eq!(
        s.path,
        format!("/apis/kvfabric.io/v1alpha1/namespaces/{NS}/transferfabrics/tf")
    );
    assert_eq!(s.content_type, "application/json-patch+json");
    assert_eq!(s.body[1]["op"], "add");
    assert_eq!(s.body[1]["value"], json!([FINALIZER]));
}

#[tokio::test]
async fn finalized_fabric_applies_children_and_status() {
    let (client, fake) = Fake::start(State {
        ds_status: (2, 2),
        ..State::default()
    });
    let ctx = context(client, Arc::default());
    let action = reconcile(Arc::new(finalized(full())), ctx.clone())
        .await
        .expect("reconciles");
    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(300)),
        "ready → slow requeue"
    );

    let applies = fake.applies();
    let paths: Vec<&str> = applies.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        paths,
        vec![
            "/api/v1/namespaces/llm/serviceaccounts/tf-agent",
            "/api/v1/namespaces/llm/configmaps/tf-config",
            "/api/v1/namespaces/llm/services/tf-agents",
            "/apis/networking.k8s.io/v1/namespaces/llm/networkpolicies/tf-agents",
            "/apis/apps/v1/namespaces/llm/daemonsets/tf-prefill-agent",
            "/apis/apps/v1/namespaces/llm/daemonsets/tf-decode-agent",
            "/apis/kvfabric.io/v1alpha1/namespaces/llm/transferfabrics/tf/status",
        ]
    );
    for s in &applies {
        assert_eq!(s.param("fieldManager"), Some(MANAGER), "{}", s.path);
        assert_eq!(s.param("force"), Some("true"), "{}", s.path);
        assert_eq!(s.content_type, "application/apply-patch+yaml");
        if !s.path.ends_with("/status") {
            let owner = &s.body["metadata"]["ownerReferences"][0];
            assert_eq!(owner["uid"], UID, "{}", s.path);
            assert_eq!(owner["controller"], true, "{}", s.path);
        }
    }
    let status = &fake.status_patches()[0].body;
    assert_eq!(status["apiVersion"], "kvfabric.io/v1alpha1");
    assert_eq!(status["kind"], "TransferFabric");
    let st = &status["status"];
    assert_eq!(st["observedGeneration"], 1);
    assert_eq!(
        st["pools"],
        json!([
            {"name":"prefill","desired":2,"ready":2,"socketDir":"/var/run/kvfabric/llm/tf/prefill"},
            {"name":"decode","desired":2,"ready":2,"socketDir":"/var/run/kvfabric/llm/tf/decode"}
        ])
    );
    assert_eq!(condition(st, "Ready")["status"], "True");
    assert_eq!(condition(st, "prefillReady")["status"], "True");
    assert_eq!(condition(st, "decodeReady")["status"], "True");
    assert_eq!(condition(st, "Progressing")["status"], "False");
    assert_eq!(condition(st, "Degraded")["status"], "False");

    let list = fake
        .seen()
        .into_iter()
        .find(|s| s.method == Method::GET && s.path.ends_with("/daemonsets"))
        .expect("listed daemonsets");
    assert_eq!(list.param("labelSelector"), Some("kvfabric.io/fabric=tf"));
    let events = fake.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].body["reason"], "Applied");
    assert_eq!(events[0].body["type"], "Normal");
}

#[tokio::test]
async fn agents_not_ready_requeue_sooner() {
    let (client, fake) = Fake::start(State {
        ds_status: (2, 1),
        ..State::default()
    });
    let action = reconcile(Arc::new(finalized(full())), context(client, Arc::default()))
        .await
        .expect("ok");
    assert_eq!(action, Action::requeue(Duration::from_secs(30)));
    let st = &fake.status_patches()[0].body["status"];
    assert_eq!(condition(st, "Ready")["status"], "False");
    assert_eq!(condition(st, "Progressing")["status"], "True");
}

#[tokio::test]
async fn spec_change_reapplies_the_daemonset() {
    let (client, fake) = Fake::start(State::default());
    let ctx = context(client, Arc::default());
    let mut f = finalized(full());
    reconcile(Arc::new(f.clone()), ctx.clone())
        .await
        .expect("first");
    f.spec.agent.priority_class_name = Some("kvfabric-agents".into());
    f.metadata.generation = Some(2);
    reconcile(Arc::new(f), ctx).await.expect("second");
    let ds: Vec<Seen> = fake
        .applies()
        .into_iter()
        .filter(|s| s.path.ends_with("/daemonsets/tf-prefill-agent"))
        .collect();
    assert_eq!(ds.len(), 2);
    let class = |s: &Seen| s.body["spec"]["template"]["spec"]["priorityClassName"].clone();
    assert_eq!(class(&ds[0]), "system-node-critical");
    assert_eq!(class(&ds[1]), "kvfabric-agents");
    let last_status = fake.status_patches().pop().expect("status");
    assert_eq!(last_status.body["status"]["observedGeneration"], 2);
}

#[tokio::test]
async fn removed_pool_deletes_its_daemonset_only() {
    let state = State {
        existing: vec![
            owned_ds("prefill", UID),
            owned_ds("decode", UID),
            owned_ds("old", UID),
            owned_ds("foreign", "another-uid"),
        ],
        ..State::default()
    };
    let (client, fake) = Fake::start(state);
    reconcile(Arc::new(finalized(full())), context(client, Arc::default()))
        .await
        .expect("ok");
    let deletes: Vec<String> = fake
        .seen()
        .into_iter()
        .filter(|s| s.method == Method::DELETE)
        .map(|s| s.path)
        .collect();
    assert_eq!(
        deletes,
        vec!["/apis/apps/v1/namespaces/llm/daemonsets/tf-old-agent".to_owned()]
    );
    assert!(fake.events().iter().any(|e| {
        e.body["reason"] == "PoolRemoved"
            && e.body["note"]
                .as_str()
                .is_some_and(|n| n.contains("tf-old-agent"))
    }));
}

/// The Secrets `full()` names: TLS material and a username/password (base64 in `data`).
fn etcd_secrets() -> Vec<Value> {
    vec![
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "etcd-tls", "namespace": "llm"},
               "data": {"ca.crt": "Q0E=", "tls.crt": "Q0VSVA==", "tls.key": "S0VZ"}}),
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "etcd-auth", "namespace": "llm"},
               "data": {"username": "a3Zm", "password": "czNjcjN0"}}),
    ]
}

#[tokio::test]
async fn delete_runs_the_cleaner_and_removes_the_finalizer() {
    let cleaner = Arc::new(FakeCleaner::default());
    let mut f = finalized(full());
    f.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    let ns = f.metadata.namespace.clone().expect("namespaced");
    let (client, fake) = Fake::start(State {
        fabric: Some(f.clone()),
        secrets: etcd_secrets(),
        ..State::default()
    });
    let action = reconcile(Arc::new(f), context(client, cleaner.clone()))
        .await
        .expect("ok");
    assert_eq!(action, Action::await_change());
    let calls = cleaner.calls.lock().expect("lock").clone();
    assert_eq!(
        calls,
        vec![(
            EtcdAccess {
                endpoints: vec![
                    "http://etcd-0:2379".to_owned(),
                    "http://etcd-1:2379".to_owned()
                ],
                tls: Some(EtcdTls {
                    ca: Some(b"CA".to_vec()),
                    identity: Some((b"CERT".to_vec(), b"KEY".to_vec())),
                }),
                auth: Some(("kvf".to_owned(), "s3cr3t".to_owned())),
            },
            "/kvfabric/llm/tf/".to_owned()
        )]
    );
    let secret_reads: Vec<String> = fake
        .seen()
        .into_iter()
        .filter(|s| s.path.contains("/secrets/"))
        .map(|s| s.path)
        .collect();
    assert_eq!(
        secret_reads,
        [
            format!("/api/v1/namespaces/{ns}/secrets/etcd-tls"),
            format!("/api/v1/namespaces/{ns}/secrets/etcd-auth"),
        ]
    );
    let patches: Vec<Seen> = fake
        .seen()
        .into_iter()
        .filter(|s| s.content_type == "application/json-patch+json")
        .collect();
    assert_eq!(patches.len(), 1);
    assert_eq!(
        patches[0].body[1],
        json!({"op": "remove", "path": "/metadata/finalizers/0"})
    );
    assert!(fake.applies().is_empty(), "nothing applied while deleting");
    assert!(
        fake.events()
            .iter()
            .any(|e| e.body["reason"] == "RegistryCleaned")
    );
}

#[tokio::test]
async fn unreachable_etcd_is_retried_boundedly_then_the_finalizer_goes_anyway() {
    let cleaner = Arc::new(FakeCleaner {
        fail: true,
        ..FakeCleaner::default()
    });
    let mut f = finalized(full());
    f.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    let (client, fake) = Fake::start(State {
        fabric: Some(f.clone()),
        secrets: etcd_secrets(),
        ..State::default()
    });
    let action = reconcile(Arc::new(f), context(client, cleaner.clone()))
        .await
        .expect("ok");
    assert_eq!(action, Action::await_change());
    assert_eq!(
        cleaner.calls.lock().expect("lock").len(),
        3,
        "bounded attempts"
    );
    let st = &fake.status_patches()[0].body["status"];
    let degraded = condition(st, "Degraded");
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "RegistryCleanupFailed");
    let msg = degraded["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("http://etcd-0:2379,http://etcd-1:2379"),
        "{msg}"
    );
    assert!(msg.contains("/kvfabric/llm/tf/"), "{msg}");
    assert!(
        fake.events()
            .iter()
            .any(|e| e.body["reason"] == "RegistryCleanupFailed" && e.body["type"] == "Warning")
    );
    let removal = fake
        .seen()
        .into_iter()
        .find(|s| s.content_type == "application/json-patch+json")
        .expect("finalizer removed");
    assert_eq!(removal.body[1]["op"], "remove");
}

#[tokio::test]
async fn missing_etcd_secret_is_named_and_does_not_block_deletion() {
    let cleaner = Arc::new(FakeCleaner::default());
    let mut f = finalized(full());
    f.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    let mut secrets = etcd_secrets();
    // The auth Secret lacks its password.
    secrets[1]["data"] = json!({"username": "a3Zm"});
    for (present, expect) in [(vec![], "etcd-tls"), (secrets, "has no key \"password\"")] {
        let (client, fake) = Fake::start(State {
            fabric: Some(f.clone()),
            secrets: present,
            ..State::default()
        });
        let action = reconcile(Arc::new(f.clone()), context(client, cleaner.clone()))
            .await
            .expect("ok");
        assert_eq!(action, Action::await_change());
        let st = &fake.status_patches()[0].body["status"];
        let degraded = condition(st, "Degraded");
        assert_eq!(degraded["reason"], "RegistryCleanupFailed");
        let msg = degraded["message"].as_str().unwrap_or_default();
        assert!(msg.contains(expect), "{msg}");
        assert!(
            fake.seen()
                .iter()
                .any(|s| s.content_type == "application/json-patch+json"),
            "finalizer removed"
        );
    }
    assert!(cleaner.calls.lock().expect("lock").is_empty());
}

/// A Secret as the API server returns it (`data` base64-encoded by its serializer).
fn secret(name: &str, data: &[(&str, Vec<u8>)]) -> Value {
    let secret = k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            ..Default::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), k8s_openapi::ByteString(v.clone())))
                .collect(),
        ),
        ..Default::default()
    };
    let mut v = serde_json::to_value(secret).expect("serializes");
    v["apiVersion"] = json!("v1");
    v["kind"] = json!("Secret");
    v
}

/// Every key in `etcd`, sorted (as root).
async fn all_keys(etcd: &kvfabric_testkit::EtcdServer) -> Vec<String> {
    etcd.keys("/").await.expect("get")
}

#[tokio::test]
async fn delete_cleans_only_its_prefix_in_a_real_etcd_with_tls_and_auth() {
    use kvfabric_testkit::EtcdServer;
    let Some(mut etcd) = EtcdServer::or_skip(EtcdServer::start_tls().await) else {
        return;
    };
    let ours = [
        "/kvfabric/llm/tf/agents/node-1",
        "/kvfabric/llm/tf/segments/w0",
    ];
    // Its namesake in another namespace, a fabric whose name starts with its name, a key that
    // is the root without its slash, and a key outside the registry.
    let mut theirs = vec![
        "/elsewhere/llm/tf/x",
        "/kvfabric/llm/tf",
        "/kvfabric/llm/tf2/agents/node-1",
        "/kvfabric/other/tf/segments/w0",
    ];
    let mut root = etcd.client().await.expect("client");
    for key in ours.iter().chain(&theirs) {
        root.put(*key, "{}", None).await.expect("put");
    }
    // The fabric's account may touch the whole registry, so only the operator's prefix keeps
    // the neighbours safe.
    etcd.enable_auth("kvf", "s3cr3t", "/kvfabric/")
        .await
        .expect("auth on");
    let dir = etcd.client_tls_dir();
    let pem = |name: &str| std::fs::read(dir.join(name)).expect("certificate");
    let secrets = |password: &str| {
        vec![
            secret(
                "etcd-tls",
                &[
                    ("ca.crt", pem("ca.crt")),
                    ("tls.crt", pem("tls.crt")),
                    ("tls.key", pem("tls.key")),
                ],
            ),
            secret(
                "etcd-auth",
                &[
                    ("username", b"kvf".to_vec()),
                    ("password", password.as_bytes().to_vec()),
                ],
            ),
        ]
    };
    let mut all: Vec<&str> = ours.iter().chain(&theirs).copied().collect();
    all.sort();
    theirs.sort();
    // A wrong password is refused by etcd: nothing goes, the fabric says why, deletion goes on.
    // The right one deletes the fabric's keys and nothing else.
    for (password, left) in [("wrong", all), ("s3cr3t", theirs)] {
        let mut f = finalized(full());
        f.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        f.spec.etcd.endpoints = vec![etcd.endpoint()];
        let (client, fake) = Fake::start(State {
            fabric: Some(f.clone()),
            secrets: secrets(password),
            ..State::default()
        });
        let cleaner = Arc::new(crate::finalizer::EtcdCleaner {
            timeout: Duration::from_secs(5),
        });
        let mut ctx = context_cleaning(client, cleaner);
        // A real etcd with TLS and bcrypt-checked passwords: on a loaded 2-core machine one
        // attempt has taken past the unit tests' half second.
        let c = Arc::get_mut(&mut ctx).expect("unshared");
        c.cleanup.timeout = Duration::from_secs(5);
        c.reconcile_timeout = Duration::from_secs(60);
        let action = reconcile(Arc::new(f), ctx).await.expect("ok");
        assert_eq!(action, Action::await_change());
        assert_eq!(all_keys(&etcd).await, left, "password {password:?}");
        let events = fake.events();
        if password == "wrong" {
            let degraded = condition(&fake.status_patches()[0].body["status"], "Degraded").clone();
            assert_eq!(degraded["reason"], "RegistryCleanupFailed");
            let msg = degraded["message"].as_str().unwrap_or_default();
            assert!(
                msg.contains("/kvfabric/llm/tf/") && msg.contains(&etcd.endpoint()),
                "{msg}"
            );
        } else {
            assert!(
                events.iter().any(|e| e.body["reason"] == "RegistryCleaned"
                    && e.body["note"].as_str().is_some_and(
                        |n| n.contains("deleted 2 registry keys under /kvfabric/llm/tf/")
                    )),
                "{events:#?}"
            );
        }
        assert!(
            fake.seen()
                .iter()
                .any(|s| s.content_type == "application/json-patch+json"),
            "finalizer removed"
        );
    }
}

async fn failing_apply(fault: Fault) -> (Error, Arc<Context>, Fake) {
    let state = State {
        faults: vec![(Method::PATCH, "/daemonsets/tf-prefill-agent".into(), fault)],
        ..State::default()
    };
    let (client, fake) = Fake::start(state);
    let ctx = context(client, Arc::default());
    let err = reconcile(Arc::new(finalized(full())), ctx.clone())
        .await
        .expect_err("must fail");
    (err, ctx, fake)
}

#[tokio::test]
async fn conflict_409_requeues_with_backoff() {
    let (err, ctx, fake) = failing_apply(Fault::Code(409)).await;
    assert_eq!(err.label(), "conflict");
    assert!(err.to_string().contains("tf-prefill-agent"), "{err}");
    let f = Arc::new(full());
    assert_eq!(
        error_policy(f.clone(), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
    assert_eq!(
        error_policy(f.clone(), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(10))
    );
    assert_eq!(
        error_policy(f, &err, ctx.clone()),
        Action::requeue(Duration::from_secs(20))
    );
    assert!(
        ctx.metrics
            .encode()
            .contains("kvfabric_operator_reconcile_failures_total{kind=\"conflict\"} 3")
    );
    assert!(
        fake.events()
            .iter()
            .any(|e| e.body["reason"] == "ApplyFailed")
    );
    assert!(fake.status_patches().is_empty());
}

#[tokio::test]
async fn server_error_500_requeues_with_backoff() {
    let (err, ctx, _fake) = failing_apply(Fault::Code(500)).await;
    assert_eq!(err.label(), "api_server");
    assert_eq!(
        error_policy(Arc::new(full()), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
    assert!(ctx.metrics.encode().contains("kind=\"api_server\""));
}

#[tokio::test]
async fn hung_api_server_times_out() {
    let (err, ctx, _fake) = failing_apply(Fault::Hang).await;
    assert_eq!(err.label(), "timeout");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert_eq!(
        error_policy(Arc::new(full()), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
}

#[tokio::test]
async fn success_resets_the_backoff() {
    let (client, _fake) = Fake::start(State::default());
    let ctx = context(client, Arc::default());
    let f = Arc::new(finalized(full()));
    let err = Error::MissingField {
        field: "metadata.name",
    };
    error_policy(f.clone(), &err, ctx.clone());
    error_policy(f.clone(), &err, ctx.clone());
    reconcile(f.clone(), ctx.clone()).await.expect("ok");
    assert_eq!(
        error_policy(f, &err, ctx),
        Action::requeue(Duration::from_secs(5))
    );
}

#[tokio::test]
async fn missing_crd_gives_a_clear_error() {
    let (client, _fake) = Fake::start(State {
        crd_missing: true,
        ..State::default()
    });
    let err = check_crd_installed(&client, None).await.expect_err("404");
    assert!(matches!(err, Error::CrdNotInstalled { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("CRD transferfabrics.kvfabric.io is not installed"),
        "{msg}"
    );
    assert!(msg.contains("helm install"), "{msg}");
    assert!(
        msg.contains("kubectl apply -f charts/kvfabric/crds/"),
        "{msg}"
    );
}

#[tokio::test]
async fn installed_crd_passes_the_check() {
    let (client, fake) = Fake::start(State::default());
    check_crd_installed(&client, Some("llm"))
        .await
        .expect("installed");
    let s = &fake.seen()[0];
    assert_eq!(
        s.path,
        "/apis/kvfabric.io/v1alpha1/namespaces/llm/transferfabrics"
    );
    assert_eq!(s.param("limit"), Some("1"));
}

#[tokio::test]
async fn invalid_spec_is_reported_as_degraded_without_applying() {
    let mut f = finalized(full());
    f.spec.pools[1].name = "prefill".into();
    f.spec.agent.rdma.as_mut().expect("rdma").resources[0].count = 0;
    let (client, fake) = Fake::start(State {
        fabric: Some(f.clone()),
        ..State::default()
    });
    let action = reconcile(Arc::new(f), context(client, Arc::default()))
        .await
        .expect("no error");
    assert_eq!(action, Action::await_change(), "no hot loop");
    let applies = fake.applies();
    assert_eq!(applies.len(), 1, "only the status: {applies:#?}");
    let st = &applies[0].body["status"];
    let degraded = condition(st, "Degraded");
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "InvalidSpec");
    let msg = degraded["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("spec.pools[1].name") && msg.contains("\"prefill\""),
        "{msg}"
    );
    assert!(
        msg.contains("spec.agent.rdma.resources[0].count") && msg.contains("\"0\""),
        "{msg}"
    );
    assert_eq!(condition(st, "Ready")["status"], "False");
    assert!(
        fake.events()
            .iter()
            .any(|e| e.body["reason"] == "InvalidSpec" && e.body["type"] == "Warning")
    );
}

#[tokio::test]
async fn reserved_env_and_unknown_transport_are_named() {
    let mut f = finalized(full());
    f.spec.agent.env.push(k8s_openapi::api::core::v1::EnvVar {
        name: "KVFABRIC_ETCD_KEY_PREFIX".into(),
        value: Some("/kvfabric/other-namespace".into()),
        ..Default::default()
    });
    f.spec.transports = vec![kvfabric_crds::Transport::from("ucx".to_owned())];
    let (client, fake) = Fake::start(State::default());
    reconcile(Arc::new(f), context(client, Arc::default()))
        .await
        .expect("no error");
    let st = &fake.status_patches()[0].body["status"];
    let msg = condition(st, "Degraded")["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        msg.contains("spec.agent.env[1].name") && msg.contains("KVFABRIC_ETCD_KEY_PREFIX"),
        "{msg}"
    );
    assert!(
        msg.contains("spec.transports[0]") && msg.contains("ucx"),
        "{msg}"
    );
}

#[test]
fn owner_reference_blocks_owner_deletion() {
    let f = full();
    let meta = crate::meta::child_meta(&f, "x".into(), Default::default()).expect("meta");
    let r = &meta.owner_references.expect("owner")[0];
    assert_eq!(r.kind, "TransferFabric");
    assert_eq!(r.uid, f.meta().uid.clone().unwrap_or_default());
    assert_eq!(r.controller, Some(true));
    assert_eq!(r.block_owner_deletion, Some(true));
}

#[tokio::test]
async fn controller_reconciles_a_listed_fabric_and_shuts_down_gracefully() {
    let state = State {
        listed: vec![finalized(full())],
        ds_status: (1, 1),
        ..State::default()
    };
    let (client, fake) = Fake::start(state);
    let ctx = context(client, Arc::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let controller = tokio::spawn(run_controller(ctx, None, async move {
        let _ = stop_rx.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while fake.status_patches().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no reconcile: {:#?}",
            fake.seen()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), controller)
        .await
        .expect("controller stops on the shutdown signal")
        .expect("controller task");

    let seen = fake.seen();
    // The fabric and every owned kind are watched, children through our managed-by label.
    for path in [
        "/apis/kvfabric.io/v1alpha1/transferfabrics",
        "/apis/apps/v1/daemonsets",
        "/api/v1/configmaps",
        "/api/v1/services",
        "/api/v1/serviceaccounts",
        "/apis/networking.k8s.io/v1/networkpolicies",
    ] {
        let list = seen
            .iter()
            .find(|s| s.path == path && s.method == Method::GET)
            .unwrap_or_else(|| panic!("{path} not listed"));
        if !path.contains("transferfabrics") {
            assert_eq!(
                list.param("labelSelector"),
                Some("app.kubernetes.io/managed-by=kvfabric-operator"),
                "{path}"
            );
        }
    }
    assert!(
        fake.applies()
            .iter()
            .any(|s| s.path.ends_with("/daemonsets/tf-decode-agent"))
    );
}

#[tokio::test]
async fn leader_election_takes_and_releases_the_lease() {
    let (client, fake) = Fake::start(State::default());
    let mut leadership = crate::leader::campaign(client, "kvfabric", "kvfabric-operator", "pod-a")
        .await
        .expect("campaign starts");
    tokio::time::timeout(Duration::from_secs(10), leadership.acquired())
        .await
        .expect("acquired in time")
        .expect("acquired");
    let seen = fake.seen();
    let take = seen
        .iter()
        .find(|s| s.is_apply() && s.path.ends_with("/leases/kvfabric-operator"))
        .expect("lease taken with server-side apply");
    assert_eq!(
        take.path,
        "/apis/coordination.k8s.io/v1/namespaces/kvfabric/leases/kvfabric-operator"
    );
    assert_eq!(take.param("fieldManager"), Some(MANAGER));
    assert_eq!(take.body["spec"]["holderIdentity"], "pod-a");
    assert_eq!(
        take.body["spec"]["leaseDurationSeconds"],
        crate::leader::LEASE_DURATION_SECS
    );

    leadership.release().await;
    // Releasing clears the holder explicitly (a null in the patch), so a standby need not wait
    // for the lease to expire.
    let released = fake.seen().into_iter().any(|s| {
        s.method == Method::PATCH
            && s.path.contains("/leases/")
            && s.body["spec"]
                .as_object()
                .is_some_and(|spec| spec.get("holderIdentity") == Some(&Value::Null))
    });
    assert!(released, "no release patch: {:#?}", fake.seen());
}

fn pending_pod(pool: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("tf-{pool}-agent-x1"), "namespace": NS,
                     "labels": {"kvfabric.io/fabric": "tf", "kvfabric.io/pool": pool}},
        "status": {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message
        }]}
    })
}

fn failed_create(ds: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": format!("{ds}.1"), "namespace": NS},
        "involvedObject": {"kind": "DaemonSet", "name": ds, "namespace": NS},
        "reason": "FailedCreate", "type": "Warning", "message": message
    })
}

#[tokio::test]
async fn unready_pools_say_why_from_pods_and_events() {
    let (client, fake) = Fake::start(State {
        ds_status: (2, 0),
        pods: vec![pending_pod(
            "prefill",
            "0/5 nodes are available: 3 Insufficient nvidia.com/sriov_rdma_rail0.",
        )],
        core_events: vec![failed_create(
            "tf-decode-agent",
            "Error creating: pods \"tf-decode-agent-z\" is forbidden: violates PodSecurity \"baseline:latest\": hostPath volumes",
        )],
        ..State::default()
    });
    let action = reconcile(Arc::new(finalized(full())), context(client, Arc::default()))
        .await
        .expect("reconciles");
    assert_eq!(action, Action::requeue(Duration::from_secs(30)));
    let st = &fake.status_patches()[0].body["status"];
    let prefill = condition(st, "prefillReady");
    assert_eq!(prefill["reason"], "Unschedulable");
    let msg = prefill["message"].as_str().unwrap_or_default();
    assert!(msg.starts_with("0 of 2 agents ready: "), "{msg}");
    assert!(
        msg.contains("Insufficient nvidia.com/sriov_rdma_rail0"),
        "{msg}"
    );
    let decode = condition(st, "decodeReady");
    assert_eq!(decode["reason"], "PodSecurityRejected");
    assert!(
        decode["message"]
            .as_str()
            .unwrap_or_default()
            .contains("violates PodSecurity"),
        "{decode}"
    );
    assert_eq!(
        condition(st, "Ready")["message"],
        "pools not ready: prefill (Unschedulable), decode (PodSecurityRejected)"
    );
    let seen = fake.seen();
    let pods = seen
        .iter()
        .find(|s| s.path.ends_with("/pods"))
        .expect("pods listed");
    assert_eq!(pods.param("labelSelector"), Some("kvfabric.io/fabric=tf"));
    let events: Vec<_> = seen
        .iter()
        .filter(|s| s.path == "/api/v1/namespaces/llm/events")
        .collect();
    assert_eq!(events.len(), 2, "one bounded list per unready DaemonSet");
    assert_eq!(
        events[1].param("fieldSelector"),
        Some(
            "involvedObject.kind=DaemonSet,involvedObject.name=tf-decode-agent,reason=FailedCreate"
        )
    );
    assert_eq!(events[1].param("limit"), Some("20"));
}

#[tokio::test]
async fn ready_pools_read_no_pods_or_events() {
    let (client, fake) = Fake::start(State {
        ds_status: (2, 2),
        ..State::default()
    });
    reconcile(Arc::new(finalized(full())), context(client, Arc::default()))
        .await
        .expect("reconciles");
    assert!(
        !fake
            .seen()
            .iter()
            .any(|s| s.path.ends_with("/pods") || s.path == "/api/v1/namespaces/llm/events")
    );
}

fn network_policy(owner_uid: &str) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "tf-agents", "namespace": NS, "ownerReferences": [{
            "apiVersion": "kvfabric.io/v1alpha1", "kind": "TransferFabric", "name": "tf",
            "uid": owner_uid, "controller": true
        }]},
        "spec": {"podSelector": {}}
    })
}

#[tokio::test]
async fn a_network_policy_no_longer_wanted_is_deleted_only_when_ours() {
    for (owner, deleted) in [(UID, true), ("someone-else", false)] {
        let (client, fake) = Fake::start(State {
            network_policy: Some(network_policy(owner)),
            ..State::default()
        });
        let mut f = finalized(full());
        f.spec.network_policy.enabled = false;
        reconcile(Arc::new(f), context(client, Arc::default()))
            .await
            .expect("reconciles");
        let seen = fake.seen();
        assert!(
            !fake
                .applies()
                .iter()
                .any(|s| s.path.contains("/networkpolicies/")),
            "not applied when disabled"
        );
        assert_eq!(
            seen.iter()
                .any(|s| s.method == Method::DELETE
                    && s.path.ends_with("/networkpolicies/tf-agents")),
            deleted,
            "owner {owner}"
        );
    }
}

fn listed_fabric(name: &str, ns: &str) -> TransferFabric {
    let mut f = finalized(full());
    f.metadata.name = Some(name.into());
    f.metadata.namespace = Some(ns.into());
    f.metadata.resource_version = Some("7".into());
    f
}

fn uninstall_args(
    fabrics: crate::config::FabricsOnUninstall,
    timeout_secs: u64,
) -> crate::config::UninstallArgs {
    crate::config::UninstallArgs {
        fabrics,
        timeout_secs,
        namespace: None,
    }
}

#[tokio::test]
async fn uninstall_deletes_fabrics_and_waits_for_the_operator() {
    let (client, fake) = Fake::start(State {
        listed: vec![listed_fabric("a", "team-a"), listed_fabric("a", "team-b")],
        finalize_on_delete: true,
        ..State::default()
    });
    let report = crate::uninstall::uninstall(
        &client,
        &uninstall_args(crate::config::FabricsOnUninstall::Delete, 30),
    )
    .await
    .expect("uninstalls");
    assert_eq!(
        report,
        crate::uninstall::Report {
            found: 2,
            deleted: 2,
            unfinalized: 0
        }
    );
    let deletes: Vec<String> = fake
        .seen()
        .into_iter()
        .filter(|s| s.method == Method::DELETE)
        .map(|s| s.path)
        .collect();
    assert_eq!(
        deletes,
        vec![
            "/apis/kvfabric.io/v1alpha1/namespaces/team-a/transferfabrics/a",
            "/apis/kvfabric.io/v1alpha1/namespaces/team-b/transferfabrics/a",
        ]
    );
    assert!(
        !fake.seen().iter().any(|s| s.method == Method::PATCH),
        "the operator finalized them"
    );
}

#[tokio::test]
async fn uninstall_without_an_operator_removes_the_finalizer_after_the_deadline() {
    let (client, fake) = Fake::start(State {
        listed: vec![listed_fabric("a", "team-a")],
        finalize_on_delete: false,
        ..State::default()
    });
    let report = tokio::time::timeout(
        Duration::from_secs(10),
        crate::uninstall::uninstall(
            &client,
            &uninstall_args(crate::config::FabricsOnUninstall::Delete, 0),
        ),
    )
    .await
    .expect("bounded by its deadline")
    .expect("uninstalls");
    assert_eq!((report.deleted, report.unfinalized), (1, 1));
    let patch = fake
        .seen()
        .into_iter()
        .find(|s| s.method == Method::PATCH)
        .expect("finalizer patch");
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert_eq!(patch.body["metadata"]["finalizers"], json!([]));
    // The resourceVersion after the DELETE: a precondition, not a blind overwrite.
    assert_eq!(patch.body["metadata"]["resourceVersion"], "8");
    let left = fake
        .seen()
        .into_iter()
        .filter(|s| s.method == Method::GET && s.path.ends_with("/transferfabrics"))
        .count();
    assert!(left >= 2, "listed before and after the wait");
}

#[tokio::test]
async fn uninstall_orphan_keeps_fabrics_and_drops_only_our_finalizer() {
    let mut f = listed_fabric("a", "team-a");
    f.metadata.finalizers = Some(vec!["example.com/other".into(), FINALIZER.into()]);
    let (client, fake) = Fake::start(State {
        listed: vec![f],
        ..State::default()
    });
    let report = crate::uninstall::uninstall(
        &client,
        &uninstall_args(crate::config::FabricsOnUninstall::Orphan, 30),
    )
    .await
    .expect("uninstalls");
    assert_eq!((report.deleted, report.unfinalized), (0, 1));
    assert!(!fake.seen().iter().any(|s| s.method == Method::DELETE));
    let patch = fake
        .seen()
        .into_iter()
        .find(|s| s.method == Method::PATCH)
        .expect("patch");
    assert_eq!(
        patch.body["metadata"]["finalizers"],
        json!(["example.com/other"])
    );
    assert_eq!(patch.body["metadata"]["resourceVersion"], "7");
}

/// A fabric never adopts an object of a child's name that is not its own: applying would take
/// it over and garbage collection would delete it with the fabric.
async fn blocked_by(plural: &'static str, existing: Value) -> (Action, Fake) {
    let (client, fake) = Fake::start(State {
        children: vec![(plural, existing)],
        ds_status: (2, 2),
        ..State::default()
    });
    let action = reconcile(Arc::new(finalized(full())), context(client, Arc::default()))
        .await
        .expect("a refusal, not an error to retry fast");
    (action, fake)
}

#[tokio::test]
async fn an_existing_service_account_it_does_not_own_is_left_alone_and_named() {
    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": "tf-agent", "namespace": NS}});
    let (action, fake) = blocked_by("serviceaccounts", sa).await;
    assert_eq!(action, Action::requeue(Duration::from_secs(60)));
    let applied: Vec<String> = fake.applies().into_iter().map(|s| s.path).collect();
    assert_eq!(
        applied,
        vec!["/apis/kvfabric.io/v1alpha1/namespaces/llm/transferfabrics/tf/status"],
        "nothing but the status"
    );
    let st = &fake.status_patches()[0].body["status"];
    let degraded = condition(st, "Degraded");
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "NotOwned");
    let msg = degraded["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("ServiceAccount llm/tf-agent") && msg.contains("no owner"),
        "{msg}"
    );
    let events = fake.events();
    assert!(
        events
            .iter()
            .any(|e| e.body["reason"] == "NotOwned" && e.body["type"] == "Warning"),
        "{events:#?}"
    );
}

#[tokio::test]
async fn another_fabrics_daemonset_of_the_same_name_is_not_taken_over() {
    // `a` with pool `b-c` and `a-b` with pool `c` both derive `a-b-c-agent`; here the
    // DaemonSet `tf-decode-agent` belongs to another fabric.
    let mut other =
        serde_json::to_value(owned_ds("decode", "uid-of-another-fabric")).expect("json");
    other["metadata"]["ownerReferences"][0]["name"] = json!("tf-decode-twin");
    let (_, fake) = blocked_by("daemonsets", other).await;
    let applied: Vec<String> = fake.applies().into_iter().map(|s| s.path).collect();
    assert!(
        applied
            .iter()
            .any(|p| p.ends_with("/daemonsets/tf-prefill-agent")),
        "its own pools are applied before: {applied:?}"
    );
    assert!(
        !applied
            .iter()
            .any(|p| p.ends_with("/daemonsets/tf-decode-agent")),
        "{applied:?}"
    );
    let st = &fake.status_patches()[0].body["status"];
    let msg = condition(st, "Degraded")["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        msg.contains("DaemonSet llm/tf-decode-agent")
            && msg.contains("owned by TransferFabric tf-decode-twin"),
        "{msg}"
    );
}

#[tokio::test]
async fn host_network_fabrics_on_shared_nodes_and_ports_are_refused() {
    let mut mine = finalized(full());
    mine.spec.agent.host_network = true;
    mine.spec.pools[1]
        .node_selector
        .insert("kvfabric.io/role".into(), "decode".into());
    let mut other = mine.clone();
    other.metadata.name = Some("tf-b".into());
    other.metadata.uid = Some("uid-b".into());
    let (client, fake) = Fake::start(State {
        listed: vec![mine.clone(), other],
        ..State::default()
    });
    let action = reconcile(Arc::new(mine), context(client, Arc::default()))
        .await
        .expect("a refusal");
    assert_eq!(action, Action::await_change());
    let applied: Vec<String> = fake.applies().into_iter().map(|s| s.path).collect();
    assert_eq!(applied.len(), 1, "only the status: {applied:?}");
    let st = &fake.status_patches()[0].body["status"];
    let degraded = condition(st, "Degraded");
    assert_eq!(degraded["reason"], "InvalidSpec");
    let msg = degraded["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("spec.agent.ports.grpc") && msg.contains("llm/tf-b"),
        "{msg}"
    );
}
