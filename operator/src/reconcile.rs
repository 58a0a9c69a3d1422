//! The reconcile loop: desired children, server-side apply, pruning, status, events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    ConfigMap, Event as CoreEvent, Pod, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use kvfabric_crds::{TransferFabric, TransferFabricStatus};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::AgentSettings;
use crate::configmap::{config_hash, desired_configmap};
use crate::contract::{host_socket_dir, registry_root};
use crate::daemonset::desired_daemonset;
use crate::diagnosis::{Diagnosis, diagnose};
use crate::finalizer::{
    CleanupPolicy, EtcdAccess, EtcdCleaner, EtcdTls, FINALIZER, RegistryCleaner, clean_registry,
};
use crate::meta::{FABRIC_LABEL, MANAGER, POOL_LABEL, name_and_namespace, network_policy_name};
use crate::metrics::Metrics;
use crate::network_policy::desired_network_policy;
use crate::service::desired_service;
use crate::service_account::desired_service_account;
use crate::spec_checks;
use crate::status::{self, ConditionValue, DEGRADED};
use crate::{Error, Result};
use kvfabric_rt::KeyedBackoff;

/// Requeue of a fabric whose agents are all ready: a safety net, changes arrive by watch.
const REQUEUE_READY: Duration = Duration::from_secs(300);
/// Requeue while agents are still coming up.
const REQUEUE_PROGRESSING: Duration = Duration::from_secs(30);
/// How soon a fabric blocked by an object it does not own looks again.
const REQUEUE_NOT_OWNED: Duration = Duration::from_secs(60);

/// What every reconcile shares.
#[derive(Clone)]
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// Publishes Kubernetes events.
    pub recorder: Recorder,
    /// Operator metrics.
    pub metrics: Arc<Metrics>,
    /// Deletes registry keys on fabric deletion.
    pub cleaner: Arc<dyn RegistryCleaner>,
    /// How hard registry cleanup tries.
    pub cleanup: CleanupPolicy,
    /// Requeue delays after failures.
    pub backoff: Arc<KeyedBackoff>,
    /// Limit of one whole reconcile, so a hung API call cannot stall an object forever.
    pub reconcile_timeout: Duration,
    /// How agent pods are built (image, socket root, the API server's version).
    pub agents: AgentSettings,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("cleaner", &self.cleaner)
            .field("cleanup", &self.cleanup)
            .field("reconcile_timeout", &self.reconcile_timeout)
            .field("agents", &self.agents)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context with the production etcd cleaner and default policies.
    pub fn new(
        client: Client,
        metrics: Arc<Metrics>,
        cleanup: CleanupPolicy,
        agents: AgentSettings,
    ) -> Self {
        let reporter = Reporter {
            controller: MANAGER.to_owned(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            cleaner: Arc::new(EtcdCleaner {
                timeout: cleanup.timeout,
            }),
            cleanup,
            // A failing fabric is retried after 5 s, doubling to 5 minutes.
            backoff: Arc::new(KeyedBackoff::new(
                Duration::from_secs(5),
                Duration::from_secs(300),
            )),
            reconcile_timeout: Duration::from_secs(60),
            agents,
        }
    }
}

fn object_key(fabric: &TransferFabric) -> String {
    format!(
        "{}/{}",
        fabric.namespace().unwrap_or_default(),
        fabric.name_any()
    )
}

/// Reconciles one `TransferFabric`: the finalizer first, then apply or cleanup.
pub async fn reconcile(fabric: Arc<TransferFabric>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    let key = object_key(&fabric);
    let (_, ns) = name_and_namespace(&fabric)?;
    let api: Api<TransferFabric> = Api::namespaced(ctx.client.clone(), &ns);
    let work = finalizer(&api, FINALIZER, fabric, |event| async {
        match event {
            Finalizer::Apply(f) => apply(&f, &ctx).await,
            Finalizer::Cleanup(f) => cleanup(&f, &ctx).await,
        }
    });
    let result = match tokio::time::timeout(ctx.reconcile_timeout, work).await {
        // Our own errors come back unwrapped, so logs and metrics name the real cause; only the
        // finalizer bookkeeping itself is reported as a finalizer error.
        Ok(r) => r.map_err(|e| match e {
            kube::runtime::finalizer::Error::ApplyFailed(e)
            | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
            other => Error::Finalizer {
                finalizer: FINALIZER,
                source: Box::new(other),
            },
        }),
        Err(_) => Err(Error::Timeout {
            action: format!("reconcile TransferFabric {key}"),
            after: ctx.reconcile_timeout,
        }),
    };
    ctx.metrics
        .duration
        .observe(started.elapsed().as_secs_f64());
    if result.is_ok() {
        ctx.backoff.reset(&key);
    }
    result
}

/// Counts the failure and requeues the object after its own exponential backoff.
pub fn error_policy(fabric: Arc<TransferFabric>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.failure(error.label());
    let delay = ctx.backoff.next_delay(&object_key(&fabric));
    tracing::warn!(fabric = %object_key(&fabric), error = %error, ?delay, "reconcile failed");
    Action::requeue(delay)
}

async fn publish(
    ctx: &Context,
    fabric: &TransferFabric,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    // Events are best effort: failing to record one must not fail the reconcile.
    if let Err(e) = ctx.recorder.publish(&event, &fabric.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "publishing event failed");
    }
}

/// Applies `obj`, one of `fabric`'s children, unless an object of its name exists that the
/// fabric does not own ([`Error::NotOwned`]): applying would adopt it.
async fn ssa_owned<K>(api: &Api<K>, obj: &K, fabric: &TransferFabric) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let existing = api
        .get_opt(&name)
        .await
        .map_err(|e| Error::kube(format!("get {} {name}", K::kind(&())), e))?;
    if let Some(existing) = existing {
        let uid = fabric.metadata.uid.as_deref().unwrap_or_default();
        let refs = existing
            .meta()
            .owner_references
            .as_deref()
            .unwrap_or_default();
        if !refs.iter().any(|o| o.uid == uid) {
            let owner = refs
                .iter()
                .find(|o| o.controller == Some(true))
                .or(refs.first())
                .map_or("no owner".to_owned(), |o| {
                    format!("owned by {} {}", o.kind, o.name)
                });
            return Err(Error::NotOwned {
                kind: K::kind(&()).into_owned(),
                name: format!(
                    "{}/{name}",
                    existing.meta().namespace.as_deref().unwrap_or_default()
                ),
                owner,
            });
        }
    }
    ssa(api, obj).await
}

async fn ssa<K>(api: &Api<K>, obj: &K) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let action = format!("apply {} {name}", K::kind(&()));
    // One field manager for everything; force takes fields over from kubectl edits, which is what
    // an operator that owns these objects should do.
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
    .map_err(|e| Error::kube(action, e))
}

async fn patch_status(
    ctx: &Context,
    fabric: &TransferFabric,
    st: &TransferFabricStatus,
) -> Result<()> {
    let (name, ns) = name_and_namespace(fabric)?;
    let api: Api<TransferFabric> = Api::namespaced(ctx.client.clone(), &ns);
    let body = serde_json::json!({
        "apiVersion": TransferFabric::api_version(&()),
        "kind": TransferFabric::kind(&()),
        "status": st,
    });
    api.patch_status(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|e| Error::kube(format!("patch status of TransferFabric {ns}/{name}"), e))?;
    Ok(())
}

/// The fabrics this operator can see, for the host-port check: cluster-wide, or the fabric's
/// namespace where the operator may only read that one (`watchNamespace`).
async fn visible_fabrics(ctx: &Context, ns: &str) -> Result<Vec<TransferFabric>> {
    let params = ListParams::default();
    match Api::<TransferFabric>::all(ctx.client.clone())
        .list(&params)
        .await
    {
        Ok(list) => Ok(list.items),
        Err(kube::Error::Api(s)) if s.code == 403 => {
            Api::<TransferFabric>::namespaced(ctx.client.clone(), ns)
                .list(&params)
                .await
                .map(|l| l.items)
                .map_err(|e| Error::kube(format!("list TransferFabrics in {ns}"), e))
        }
        Err(e) => Err(Error::kube("list TransferFabrics", e)),
    }
}

async fn apply(fabric: &TransferFabric, ctx: &Context) -> Result<Action> {
    let mut problems = spec_checks::problems(fabric, &ctx.agents);
    if fabric.spec.agent.host_network {
        let (_, ns) = name_and_namespace(fabric)?;
        let others = visible_fabrics(ctx, &ns).await?;
        problems.extend(spec_checks::host_port_problems(fabric, &others));
    }
    if !problems.is_empty() {
        let message = problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        tracing::warn!(fabric = %object_key(fabric), %message, "invalid spec");
        let st = status::with_condition(
            fabric,
            ConditionValue::new(DEGRADED, true, "InvalidSpec", &message),
            Timestamp::now(),
        );
        patch_status(ctx, fabric, &st).await?;
        publish(ctx, fabric, EventType::Warning, "InvalidSpec", message).await;
        // Nothing will change until the user edits the spec; retrying would only spin.
        return Ok(Action::await_change());
    }

    match apply_children(fabric, ctx).await {
        Ok(action) => Ok(action),
        Err(e @ Error::NotOwned { .. }) => {
            // Not transient: the user renames or deletes one of the two. Children are watched
            // only when owned, so look again now and then rather than wait for an event.
            let message = e.to_string();
            tracing::warn!(fabric = %object_key(fabric), %message, "not adopting");
            let st = status::with_condition(
                fabric,
                ConditionValue::new(DEGRADED, true, "NotOwned", &message),
                Timestamp::now(),
            );
            patch_status(ctx, fabric, &st).await?;
            publish(ctx, fabric, EventType::Warning, "NotOwned", message).await;
            Ok(Action::requeue(REQUEUE_NOT_OWNED))
        }
        Err(e) => {
            publish(
                ctx,
                fabric,
                EventType::Warning,
                "ApplyFailed",
                e.to_string(),
            )
            .await;
            Err(e)
        }
    }
}

async fn apply_children(fabric: &TransferFabric, ctx: &Context) -> Result<Action> {
    let (name, ns) = name_and_namespace(fabric)?;
    let client = &ctx.client;

    ssa_owned(
        &Api::<ServiceAccount>::namespaced(client.clone(), &ns),
        &desired_service_account(fabric)?,
        fabric,
    )
    .await?;
    let configmap = desired_configmap(fabric)?;
    let hash = config_hash(&configmap);
    ssa_owned(
        &Api::<ConfigMap>::namespaced(client.clone(), &ns),
        &configmap,
        fabric,
    )
    .await?;
    ssa_owned(
        &Api::<Service>::namespaced(client.clone(), &ns),
        &desired_service(fabric)?,
        fabric,
    )
    .await?;
    let np_api = Api::<NetworkPolicy>::namespaced(client.clone(), &ns);
    match desired_network_policy(fabric)? {
        Some(np) => drop(ssa_owned(&np_api, &np, fabric).await?),
        None => delete_owned_network_policy(fabric, &np_api, &name).await?,
    }

    let ds_api = Api::<DaemonSet>::namespaced(client.clone(), &ns);
    let mut daemonsets = Vec::with_capacity(fabric.spec.pools.len());
    for pool in &fabric.spec.pools {
        daemonsets.push(
            ssa_owned(
                &ds_api,
                &desired_daemonset(fabric, pool, &ctx.agents, &hash)?,
                fabric,
            )
            .await?,
        );
    }

    let removed = prune_daemonsets(fabric, &ds_api, &name).await?;
    for ds in &removed {
        publish(
            ctx,
            fabric,
            EventType::Normal,
            "PoolRemoved",
            format!("deleted DaemonSet {ds}: its pool is no longer in the spec"),
        )
        .await;
    }

    let diagnoses = diagnose_pools(ctx, &ns, &name, &daemonsets).await;
    let socket_dirs: BTreeMap<String, String> = fabric
        .spec
        .pools
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                host_socket_dir(&ctx.agents.socket_root, &ns, &name, &p.name),
            )
        })
        .collect();
    let st = status::desired_status(
        fabric,
        &daemonsets,
        &diagnoses,
        &socket_dirs,
        Timestamp::now(),
    );
    let ready = status::find(&st, status::READY).is_some_and(|c| c.status == "True");
    let first_for_generation =
        fabric.status.as_ref().and_then(|s| s.observed_generation) != fabric.metadata.generation;
    patch_status(ctx, fabric, &st).await?;
    if first_for_generation {
        publish(
            ctx,
            fabric,
            EventType::Normal,
            "Applied",
            format!(
                "applied ServiceAccount, ConfigMap, Service, NetworkPolicy and {} agent DaemonSet(s) for generation {}",
                daemonsets.len(),
                fabric.metadata.generation.unwrap_or_default()
            ),
        )
        .await;
    }
    Ok(Action::requeue(if ready {
        REQUEUE_READY
    } else {
        REQUEUE_PROGRESSING
    }))
}

/// Most `FailedCreate` events read per DaemonSet: the newest few say enough.
const MAX_EVENTS: u32 = 20;

/// Why the pools that are short of ready agents are so, from their pods and their DaemonSets'
/// `FailedCreate` events. Read only for such pools, and best effort: the status still shows the
/// counts when these reads fail.
async fn diagnose_pools(
    ctx: &Context,
    ns: &str,
    fabric: &str,
    daemonsets: &[DaemonSet],
) -> BTreeMap<String, Diagnosis> {
    let short: Vec<&DaemonSet> = daemonsets
        .iter()
        .filter(|ds| {
            ds.status
                .as_ref()
                .is_some_and(|s| s.number_ready < s.desired_number_scheduled)
        })
        .collect();
    let mut out = BTreeMap::new();
    if short.is_empty() {
        return out;
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let selector = format!("{FABRIC_LABEL}={fabric}");
    let pods = match pods.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => list.items,
        Err(e) => {
            tracing::warn!(error = %e, %selector, "listing agent pods failed");
            Vec::new()
        }
    };
    let events: Api<CoreEvent> = Api::namespaced(ctx.client.clone(), ns);
    for ds in short {
        let ds_name = ds.name_any();
        let pool = ds.labels().get(POOL_LABEL).cloned().unwrap_or_default();
        let fields = format!(
            "involvedObject.kind=DaemonSet,involvedObject.name={ds_name},reason=FailedCreate"
        );
        let evs = match events
            .list(&ListParams::default().fields(&fields).limit(MAX_EVENTS))
            .await
        {
            Ok(list) => list.items,
            Err(e) => {
                tracing::warn!(error = %e, %fields, "listing DaemonSet events failed");
                Vec::new()
            }
        };
        let pool_pods: Vec<Pod> = pods
            .iter()
            .filter(|p| p.labels().get(POOL_LABEL) == Some(&pool))
            .cloned()
            .collect();
        if let Some(d) = diagnose(ds, &pool_pods, &evs) {
            out.insert(pool, d);
        }
    }
    out
}

/// Deletes `<fabric>-agents` when the spec no longer wants it, if this fabric controls it.
async fn delete_owned_network_policy(
    fabric: &TransferFabric,
    api: &Api<NetworkPolicy>,
    name: &str,
) -> Result<()> {
    let np_name = network_policy_name(name);
    let existing = api
        .get_opt(&np_name)
        .await
        .map_err(|e| Error::kube(format!("get NetworkPolicy {np_name}"), e))?;
    let uid = fabric.metadata.uid.as_deref();
    let owned = existing.is_some_and(|np| {
        np.owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == uid)
    });
    if owned {
        api.delete(&np_name, &DeleteParams::background())
            .await
            .map_err(|e| Error::kube(format!("delete NetworkPolicy {np_name}"), e))?;
    }
    Ok(())
}

/// Deletes this fabric's DaemonSets whose pool left the spec; returns their names.
async fn prune_daemonsets(
    fabric: &TransferFabric,
    api: &Api<DaemonSet>,
    name: &str,
) -> Result<Vec<String>> {
    let selector = format!("{FABRIC_LABEL}={name}");
    let existing = api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|e| Error::kube(format!("list DaemonSets with {selector}"), e))?;
    let uid = fabric.metadata.uid.as_deref();
    let mut removed = Vec::new();
    for ds in existing {
        let pool = ds.labels().get(POOL_LABEL).cloned().unwrap_or_default();
        // Only delete what this fabric controls: a same-named fabric recreated later, or a
        // hand-made DaemonSet with our labels, is left alone.
        let owned = ds
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == uid);
        if !owned || fabric.spec.pools.iter().any(|p| p.name == pool) {
            continue;
        }
        let ds_name = ds.name_any();
        api.delete(&ds_name, &DeleteParams::background())
            .await
            .map_err(|e| Error::kube(format!("delete DaemonSet {ds_name}"), e))?;
        removed.push(ds_name);
    }
    Ok(removed)
}

/// The fabric's etcd endpoints with the credentials its Secrets hold.
async fn etcd_access(fabric: &TransferFabric, ctx: &Context, ns: &str) -> Result<EtcdAccess> {
    let etcd = &fabric.spec.etcd;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let read = |name: &str| {
        let secrets = secrets.clone();
        let name = name.to_owned();
        async move {
            let secret = secrets
                .get(&name)
                .await
                .map_err(|e| Error::kube(format!("get etcd Secret {ns}/{name}"), e))?;
            Ok::<_, Error>(SecretData {
                name: format!("{ns}/{name}"),
                data: secret.data.unwrap_or_default(),
            })
        }
    };
    let tls = match &etcd.tls_secret {
        Some(name) => {
            let s = read(name).await?;
            Some(EtcdTls {
                ca: s.optional("ca.crt"),
                identity: s.optional("tls.crt").zip(s.optional("tls.key")),
            })
        }
        None => None,
    };
    let auth = match &etcd.auth_secret {
        Some(name) => {
            let s = read(name).await?;
            let text = |k| {
                s.required(k)
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
            };
            Some((text("username")?, text("password")?))
        }
        None => None,
    };
    Ok(EtcdAccess {
        endpoints: etcd.endpoints.clone(),
        tls,
        auth,
    })
}

/// The data of one Secret, with its name for error messages.
struct SecretData {
    name: String,
    data: std::collections::BTreeMap<String, k8s_openapi::ByteString>,
}

impl SecretData {
    fn optional(&self, key: &str) -> Option<Vec<u8>> {
        self.data.get(key).map(|b| b.0.clone())
    }

    fn required(&self, key: &str) -> Result<Vec<u8>> {
        self.optional(key).ok_or_else(|| Error::SecretKey {
            secret: self.name.clone(),
            key: key.to_owned(),
        })
    }
}

async fn cleanup(fabric: &TransferFabric, ctx: &Context) -> Result<Action> {
    let (name, ns) = name_and_namespace(fabric)?;
    let endpoints = &fabric.spec.etcd.endpoints;
    // Every key of the fabric, and no other fabric's: the trailing slash keeps `a` from `ab`.
    let prefix = registry_root(&fabric.spec.etcd.key_prefix, &ns, &name) + "/";
    if endpoints.is_empty() {
        tracing::info!(fabric = %object_key(fabric), "no etcd endpoints; nothing to clean");
        return Ok(Action::await_change());
    }
    let cleaned = match etcd_access(fabric, ctx, &ns).await {
        Ok(access) => clean_registry(ctx.cleaner.as_ref(), &ctx.cleanup, &access, &prefix).await,
        Err(e) => Err(e),
    };
    match cleaned {
        Ok(n) => {
            publish(
                ctx,
                fabric,
                EventType::Normal,
                "RegistryCleaned",
                format!("deleted {n} registry keys under {prefix}"),
            )
            .await;
        }
        Err(e) => {
            let message = format!(
                "could not delete registry keys under {prefix} at etcd endpoints {} after {} attempts ({e}); \
                 the finalizer is removed anyway so deletion is not blocked, stale keys may remain",
                endpoints.join(","),
                ctx.cleanup.attempts.max(1),
            );
            let st = status::with_condition(
                fabric,
                ConditionValue::new(DEGRADED, true, "RegistryCleanupFailed", &message),
                Timestamp::now(),
            );
            // The object is going away: a failed status write must not keep it alive.
            if let Err(e) = patch_status(ctx, fabric, &st).await {
                tracing::warn!(error = %e, "could not record RegistryCleanupFailed");
            }
            publish(
                ctx,
                fabric,
                EventType::Warning,
                "RegistryCleanupFailed",
                message,
            )
            .await;
        }
    }
    Ok(Action::await_change())
}

/// Fails with [`Error::CrdNotInstalled`] when the API server does not know `TransferFabric`.
pub async fn check_crd_installed(client: &Client, namespace: Option<&str>) -> Result<()> {
    let api: Api<TransferFabric> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Err(Error::CrdNotInstalled {
            crd: "transferfabrics.kvfabric.io",
        }),
        Err(e) => Err(Error::kube("list TransferFabrics", e)),
    }
}

/// Runs the controller until `shutdown` resolves, then lets running reconciles finish.
pub async fn run_controller(
    ctx: Arc<Context>,
    namespace: Option<String>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let fabrics: Api<TransferFabric> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // Children are watched through our managed-by label only, to keep the caches small.
    let children =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGER}"));
    fn api<K: Resource<Scope = k8s_openapi::NamespaceResourceScope>>(
        client: &Client,
        ns: &Option<String>,
    ) -> Api<K>
    where
        K::DynamicType: Default,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    Controller::new(fabrics, watcher::Config::default().any_semantic())
        .owns(api::<DaemonSet>(&client, &namespace), children.clone())
        .owns(api::<ConfigMap>(&client, &namespace), children.clone())
        .owns(api::<Service>(&client, &namespace), children.clone())
        .owns(api::<NetworkPolicy>(&client, &namespace), children.clone())
        .owns(api::<ServiceAccount>(&client, &namespace), children)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, action)) => tracing::debug!(%obj, ?action, "reconciled"),
                Err(e) => tracing::warn!(error = %e, "controller error"),
            }
        })
        .await;
}
