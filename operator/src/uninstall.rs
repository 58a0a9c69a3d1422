//! `kvfabric-operator uninstall`, the chart's uninstall hook. Helm keeps CRDs and the fabrics
//! in them; a fabric left with the `kvfabric.io/registry-cleanup` finalizer and no operator
//! hangs the deletion of its namespace for ever. So before the operator goes, every fabric is
//! deleted and the still-running operator finalizes it (registry keys, agents); whatever is left
//! after the deadline loses the finalizer here. In `orphan` mode (run after the operator is
//! gone) fabrics and agents stay and only the finalizer goes.

use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use kvfabric_crds::TransferFabric;

use crate::config::{FabricsOnUninstall, UninstallArgs};
use crate::finalizer::FINALIZER;
use crate::{Error, Result};

/// How often the fabrics are listed while waiting.
const POLL: Duration = Duration::from_secs(2);

/// What the run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Fabrics found.
    pub found: usize,
    /// Fabrics whose deletion this run requested.
    pub deleted: usize,
    /// Fabrics whose finalizer this run removed (orphaned, or not finalized in time).
    pub unfinalized: usize,
}

fn api(client: &Client, namespace: Option<&str>) -> Api<TransferFabric> {
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

async fn list(client: &Client, namespace: Option<&str>) -> Result<Vec<TransferFabric>> {
    api(client, namespace)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|e| Error::kube("list TransferFabrics", e))
}

/// Attempts at removing a finalizer while others change the object.
const FINALIZER_ATTEMPTS: usize = 3;

/// Removes our finalizer from `fabric`, if it still has it. The merge patch carries the
/// object's resourceVersion, so a concurrent change of the list fails it (409) instead of
/// dropping someone else's finalizer; then the object is read again.
async fn remove_finalizer(client: &Client, fabric: &TransferFabric) -> Result<bool> {
    let (name, ns) = (fabric.name_any(), fabric.namespace().unwrap_or_default());
    let api = Api::<TransferFabric>::namespaced(client.clone(), &ns);
    let action = || format!("remove finalizer {FINALIZER} from TransferFabric {ns}/{name}");
    let mut current = fabric.clone();
    let mut attempt = 0;
    loop {
        attempt += 1;
        if !current.finalizers().iter().any(|f| f == FINALIZER) {
            return Ok(false);
        }
        let remaining: Vec<&String> = current
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .collect();
        let patch = serde_json::json!({
            "metadata": {"finalizers": remaining, "resourceVersion": current.resource_version()},
        });
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(false),
            Err(kube::Error::Api(s)) if s.is_conflict() && attempt < FINALIZER_ATTEMPTS => {
                match api
                    .get_opt(&name)
                    .await
                    .map_err(|e| Error::kube(action(), e))?
                {
                    Some(fresh) => current = fresh,
                    None => return Ok(false),
                }
            }
            Err(e) => return Err(Error::kube(action(), e)),
        }
    }
}

/// Runs the uninstall step.
pub async fn uninstall(client: &Client, args: &UninstallArgs) -> Result<Report> {
    let ns = args.namespace.as_deref().filter(|n| !n.is_empty());
    let fabrics = list(client, ns).await?;
    let mut report = Report {
        found: fabrics.len(),
        ..Report::default()
    };
    if args.fabrics == FabricsOnUninstall::Delete {
        for f in &fabrics {
            let (name, fns) = (f.name_any(), f.namespace().unwrap_or_default());
            match Api::<TransferFabric>::namespaced(client.clone(), &fns)
                .delete(&name, &DeleteParams::background())
                .await
            {
                Ok(_) => report.deleted += 1,
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => {
                    return Err(Error::kube(
                        format!("delete TransferFabric {fns}/{name}"),
                        e,
                    ));
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
        loop {
            let left = list(client, ns).await?;
            if left.is_empty() {
                return Ok(report);
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    left = left.len(),
                    "the operator did not finalize every fabric in time; removing the finalizer"
                );
                for f in &left {
                    if remove_finalizer(client, f).await? {
                        report.unfinalized += 1;
                    }
                }
                return Ok(report);
            }
            tokio::time::sleep(POLL.min(deadline.saturating_duration_since(Instant::now()))).await;
        }
    }
    for f in &fabrics {
        if remove_finalizer(client, f).await? {
            report.unfinalized += 1;
        }
    }
    Ok(report)
}
