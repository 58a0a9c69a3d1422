//! The `TransferFabric` status: per-pool agent counts from the DaemonSets, and conditions.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kvfabric_crds::{PoolStatus, TransferFabric, TransferFabricStatus};

use crate::diagnosis::Diagnosis;
use crate::meta::POOL_LABEL;

/// Condition type: every pool has all its agents ready.
pub const READY: &str = "Ready";
/// Condition type: a rollout is under way.
pub const PROGRESSING: &str = "Progressing";
/// Condition type: the operator cannot do what the spec asks.
pub const DEGRADED: &str = "Degraded";
/// kstatus's abnormal-true conditions, which Flux, Argo CD and kpt read: `Reconciling` while
/// the agents roll out (as `Progressing`), `Stalled` while the operator cannot go on without
/// a change from the user (as `Degraded`).
pub const RECONCILING: &str = "Reconciling";
pub const STALLED: &str = "Stalled";

/// Condition type of one pool.
pub fn pool_condition_type(pool: &str) -> String {
    format!("{pool}Ready")
}

/// What the operator wants a condition to say; the time is filled in by [`merge_conditions`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionValue {
    /// Condition type.
    pub type_: String,
    /// Whether the condition holds.
    pub status: bool,
    /// CamelCase reason.
    pub reason: String,
    /// Human readable detail.
    pub message: String,
}

impl ConditionValue {
    /// A condition value.
    pub fn new(
        type_: impl Into<String>,
        status: bool,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_: type_.into(),
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// Per-pool desired/ready agents, in the order of `pools`; a pool whose DaemonSet is not yet
/// known counts as zero of zero.
pub fn pool_statuses(pools: &[String], daemonsets: &[DaemonSet]) -> Vec<PoolStatus> {
    pools
        .iter()
        .map(|pool| {
            let status = daemonsets
                .iter()
                .find(|ds| ds.labels().get(POOL_LABEL) == Some(pool))
                .and_then(|ds| ds.status.as_ref());
            PoolStatus {
                name: pool.clone(),
                desired: status.map_or(0, |s| s.desired_number_scheduled),
                ready: status.map_or(0, |s| s.number_ready),
                socket_dir: None,
            }
        })
        .collect()
}

/// Whether every DaemonSet has caught up with its latest spec (else a rollout is running).
fn rolled_out(daemonsets: &[DaemonSet]) -> bool {
    daemonsets.iter().all(|ds| {
        let generation = ds.metadata.generation;
        match &ds.status {
            Some(s) => {
                (generation.is_none() || s.observed_generation >= generation)
                    && s.updated_number_scheduled
                        .unwrap_or(s.desired_number_scheduled)
                        >= s.desired_number_scheduled
            }
            None => false,
        }
    })
}

/// The conditions of a healthy reconcile: one `<pool>Ready` per pool, `Ready`, `Progressing`, and
/// `Degraded=False`. A pool that is short of ready agents takes its reason and detail from
/// `diagnoses` (pod events and states), so the condition says why.
pub fn observed_conditions(
    pools: &[PoolStatus],
    daemonsets: &[DaemonSet],
    diagnoses: &BTreeMap<String, Diagnosis>,
) -> Vec<ConditionValue> {
    let mut out = Vec::with_capacity(pools.len() + 3);
    let mut not_ready = Vec::new();
    for p in pools {
        let counts = format!("{} of {} agents ready", p.ready, p.desired);
        let diagnosis = diagnoses.get(&p.name);
        let (ok, reason, message) = if p.desired > 0 && p.ready >= p.desired {
            (true, "AgentsReady", counts)
        } else if let Some(d) = diagnosis {
            (false, d.cause.reason(), format!("{counts}: {}", d.detail))
        } else if p.desired == 0 {
            (
                false,
                "NoMatchingNodes",
                format!(
                    "{counts}: no node matches the pool's nodeSelector, affinity and tolerations"
                ),
            )
        } else {
            (false, "AgentsNotReady", counts)
        };
        if !ok {
            not_ready.push(format!("{} ({reason})", p.name));
        }
        out.push(ConditionValue::new(
            pool_condition_type(&p.name),
            ok,
            reason,
            message,
        ));
    }
    out.push(if not_ready.is_empty() {
        ConditionValue::new(READY, true, "AllPoolsReady", "all agents are ready")
    } else {
        ConditionValue::new(
            READY,
            false,
            "PoolsNotReady",
            format!("pools not ready: {}", not_ready.join(", ")),
        )
    });
    let progressing = !rolled_out(daemonsets) || !not_ready.is_empty();
    for type_ in [PROGRESSING, RECONCILING] {
        out.push(if progressing {
            ConditionValue::new(
                type_,
                true,
                "RollingOut",
                "agent DaemonSets are rolling out",
            )
        } else {
            ConditionValue::new(
                type_,
                false,
                "RolloutComplete",
                "agent DaemonSets are up to date",
            )
        });
    }
    for type_ in [DEGRADED, STALLED] {
        out.push(ConditionValue::new(
            type_,
            false,
            "AsExpected",
            "the spec is applied",
        ));
    }
    out
}

/// Conditions for `new`, keeping each old condition's `lastTransitionTime` unless its status
/// changed, so watchers see real transitions only. Old conditions not in `new` are dropped (a
/// removed pool's condition goes with it).
pub fn merge_conditions(
    old: &[Condition],
    new: Vec<ConditionValue>,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    new.into_iter()
        .map(|c| {
            let status = if c.status { "True" } else { "False" }.to_owned();
            let last_transition_time = old
                .iter()
                .find(|o| o.type_ == c.type_ && o.status == status)
                .map_or(Time(now), |o| o.last_transition_time.clone());
            Condition {
                last_transition_time,
                message: c.message,
                observed_generation: generation,
                reason: c.reason,
                status,
                type_: c.type_,
            }
        })
        .collect()
}

/// Replaces (or adds) one condition in an existing list, keeping every other condition as it is:
/// used when only `Degraded` changes (invalid spec, failed registry cleanup).
pub fn with_condition(
    fabric: &TransferFabric,
    value: ConditionValue,
    now: Timestamp,
) -> TransferFabricStatus {
    let old = fabric.status.clone().unwrap_or_default();
    let generation = fabric.metadata.generation;
    let mut values: Vec<ConditionValue> = old
        .conditions
        .iter()
        .filter(|c| c.type_ != value.type_)
        .map(|c| ConditionValue::new(&c.type_, c.status == "True", &c.reason, &c.message))
        .collect();
    let degraded = value.type_ == DEGRADED && value.status;
    if value.type_ == DEGRADED {
        values.retain(|c| c.type_ != STALLED);
        values.push(ConditionValue::new(
            STALLED,
            value.status,
            &value.reason,
            &value.message,
        ));
    }
    values.push(value);
    if degraded {
        // A degraded fabric is not ready, whatever its agents say.
        if let Some(ready) = values.iter_mut().find(|c| c.type_ == READY) {
            ready.status = false;
            ready.reason = "Degraded".to_owned();
            ready.message = "see the Degraded condition".to_owned();
        } else {
            values.push(ConditionValue::new(
                READY,
                false,
                "Degraded",
                "see the Degraded condition",
            ));
        }
    }
    // Every condition is restamped with this generation: the status as a whole is this
    // generation's evaluation.
    TransferFabricStatus {
        observed_generation: generation,
        conditions: merge_conditions(&old.conditions, values, generation, now),
        ..old
    }
}

/// The status after a successful apply; `socket_dirs` maps pools to their host socket directory.
pub fn desired_status(
    fabric: &TransferFabric,
    daemonsets: &[DaemonSet],
    diagnoses: &BTreeMap<String, Diagnosis>,
    socket_dirs: &BTreeMap<String, String>,
    now: Timestamp,
) -> TransferFabricStatus {
    let names: Vec<String> = fabric.spec.pools.iter().map(|p| p.name.clone()).collect();
    let mut pools = pool_statuses(&names, daemonsets);
    for p in &mut pools {
        p.socket_dir = socket_dirs.get(&p.name).cloned();
    }
    let values = observed_conditions(&pools, daemonsets, diagnoses);
    let old = fabric
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    TransferFabricStatus {
        observed_generation: fabric.metadata.generation,
        conditions: merge_conditions(old, values, fabric.metadata.generation, now),
        agents_ready: pools.iter().map(|p| p.ready).sum(),
        agents_desired: pools.iter().map(|p| p.desired).sum(),
        pools,
    }
}

/// Looks up a condition by type.
pub fn find<'a>(status: &'a TransferFabricStatus, type_: &str) -> Option<&'a Condition> {
    status.conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diagnosis::Cause;
    use crate::fixtures::full;
    use k8s_openapi::api::apps::v1::DaemonSetStatus;
    use kube::api::ObjectMeta;
    use std::collections::BTreeMap;

    pub(crate) fn ds(pool: &str, desired: i32, ready: i32) -> DaemonSet {
        DaemonSet {
            metadata: ObjectMeta {
                name: Some(format!("tf-{pool}-agent")),
                labels: Some(BTreeMap::from([(POOL_LABEL.to_owned(), pool.to_owned())])),
                generation: Some(1),
                ..ObjectMeta::default()
            },
            status: Some(DaemonSetStatus {
                desired_number_scheduled: desired,
                number_ready: ready,
                updated_number_scheduled: Some(desired),
                observed_generation: Some(1),
                ..DaemonSetStatus::default()
            }),
            ..DaemonSet::default()
        }
    }

    fn desired_status(
        f: &TransferFabric,
        daemonsets: &[DaemonSet],
        now: Timestamp,
    ) -> TransferFabricStatus {
        super::desired_status(f, daemonsets, &BTreeMap::new(), &BTreeMap::new(), now)
    }

    fn cond<'a>(s: &'a TransferFabricStatus, t: &str) -> &'a Condition {
        find(s, t).unwrap_or_else(|| panic!("no {t} condition"))
    }

    #[test]
    fn all_ready() {
        let f = full();
        let s = desired_status(
            &f,
            &[ds("prefill", 2, 2), ds("decode", 3, 3)],
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(s.observed_generation, Some(1));
        assert_eq!(
            s.pools,
            vec![
                PoolStatus {
                    name: "prefill".into(),
                    desired: 2,
                    ready: 2,
                    socket_dir: None,
                },
                PoolStatus {
                    name: "decode".into(),
                    desired: 3,
                    ready: 3,
                    socket_dir: None,
                },
            ]
        );
        assert_eq!(cond(&s, "prefillReady").status, "True");
        assert_eq!(cond(&s, "decodeReady").status, "True");
        assert_eq!(cond(&s, READY).status, "True");
        assert_eq!(cond(&s, PROGRESSING).status, "False");
        assert_eq!(cond(&s, DEGRADED).status, "False");
        // kstatus: Current when neither abnormal-true condition is True.
        assert_eq!(cond(&s, RECONCILING).status, "False");
        assert_eq!(cond(&s, STALLED).status, "False");
        assert_eq!((s.agents_ready, s.agents_desired), (5, 5));
        assert!(
            s.conditions
                .iter()
                .all(|c| c.observed_generation == Some(1))
        );
    }

    #[test]
    fn one_pool_not_ready() {
        let f = full();
        let s = desired_status(
            &f,
            &[ds("prefill", 2, 1), ds("decode", 3, 3)],
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(cond(&s, "prefillReady").status, "False");
        assert_eq!(cond(&s, "prefillReady").message, "1 of 2 agents ready");
        assert_eq!(cond(&s, RECONCILING).status, "True", "kstatus: InProgress");
        assert_eq!((s.agents_ready, s.agents_desired), (4, 5));
        assert_eq!(cond(&s, READY).status, "False");
        assert_eq!(
            cond(&s, READY).message,
            "pools not ready: prefill (AgentsNotReady)"
        );
        assert_eq!(cond(&s, PROGRESSING).status, "True");
    }

    #[test]
    fn missing_daemonset_counts_zero() {
        let f = full();
        let s = desired_status(&f, &[ds("prefill", 1, 1)], Timestamp::UNIX_EPOCH);
        assert_eq!(
            s.pools[1],
            PoolStatus {
                name: "decode".into(),
                desired: 0,
                ready: 0,
                socket_dir: None,
            }
        );
        assert_eq!(cond(&s, "decodeReady").reason, "NoMatchingNodes");
        assert!(cond(&s, "decodeReady").message.contains("nodeSelector"));
    }

    #[test]
    fn not_ready_pools_say_why() {
        let f = full();
        let diagnoses = BTreeMap::from([(
            "prefill".to_owned(),
            Diagnosis {
                cause: Cause::Unschedulable,
                detail: "1× Unschedulable; pod a Pending: 0/5 nodes are available: 3 Insufficient nvidia.com/sriov_rdma_rail0".into(),
            },
        )]);
        let dirs = BTreeMap::from([(
            "prefill".to_owned(),
            "/var/run/kvfabric/llm/tf/prefill".to_owned(),
        )]);
        let s = super::desired_status(
            &f,
            &[ds("prefill", 2, 0), ds("decode", 1, 1)],
            &diagnoses,
            &dirs,
            Timestamp::UNIX_EPOCH,
        );
        let c = cond(&s, "prefillReady");
        assert_eq!(c.reason, "Unschedulable");
        assert!(
            c.message.starts_with("0 of 2 agents ready: "),
            "{}",
            c.message
        );
        assert!(
            c.message
                .contains("Insufficient nvidia.com/sriov_rdma_rail0"),
            "{}",
            c.message
        );
        assert_eq!(
            cond(&s, READY).message,
            "pools not ready: prefill (Unschedulable)"
        );
        assert_eq!(
            s.pools[0].socket_dir.as_deref(),
            Some("/var/run/kvfabric/llm/tf/prefill")
        );
        // A ready pool ignores a stale diagnosis.
        let s = super::desired_status(
            &f,
            &[ds("prefill", 2, 2), ds("decode", 1, 1)],
            &diagnoses,
            &dirs,
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(cond(&s, "prefillReady").reason, "AgentsReady");
    }

    #[test]
    fn transition_time_kept_unless_status_changes() {
        let mut f = full();
        let t0 = Timestamp::UNIX_EPOCH;
        let t1 = Timestamp::from_second(1_000).expect("ts");
        let s0 = desired_status(&f, &[ds("prefill", 2, 1), ds("decode", 1, 1)], t0);
        f.status = Some(s0);
        let s1 = desired_status(&f, &[ds("prefill", 2, 2), ds("decode", 1, 1)], t1);
        assert_eq!(
            cond(&s1, "decodeReady").last_transition_time,
            Time(t0),
            "unchanged"
        );
        assert_eq!(
            cond(&s1, DEGRADED).last_transition_time,
            Time(t0),
            "unchanged"
        );
        assert_eq!(
            cond(&s1, "prefillReady").last_transition_time,
            Time(t1),
            "flipped"
        );
        assert_eq!(cond(&s1, READY).last_transition_time, Time(t1), "flipped");
    }

    #[test]
    fn removed_pool_condition_dropped() {
        let mut f = full();
        f.status = Some(desired_status(
            &f,
            &[ds("prefill", 1, 1), ds("decode", 1, 1)],
            Timestamp::UNIX_EPOCH,
        ));
        f.spec.pools.truncate(1);
        let s = desired_status(&f, &[ds("prefill", 1, 1)], Timestamp::UNIX_EPOCH);
        assert!(find(&s, "decodeReady").is_none());
        assert_eq!(s.pools.len(), 1);
    }

    #[test]
    fn with_condition_degrades_and_keeps_the_rest() {
        let mut f = full();
        f.status = Some(desired_status(
            &f,
            &[ds("prefill", 1, 1), ds("decode", 1, 1)],
            Timestamp::UNIX_EPOCH,
        ));
        let s = with_condition(
            &f,
            ConditionValue::new(DEGRADED, true, "InvalidSpec", "bad"),
            Timestamp::from_second(5).expect("ts"),
        );
        assert_eq!(cond(&s, DEGRADED).status, "True");
        assert_eq!(cond(&s, DEGRADED).reason, "InvalidSpec");
        assert_eq!(cond(&s, STALLED).status, "True", "kstatus: Failed");
        assert_eq!(cond(&s, STALLED).reason, "InvalidSpec");
        assert_eq!(s.agents_ready, 2, "the counts stay");
        assert_eq!(cond(&s, READY).status, "False");
        assert_eq!(cond(&s, "prefillReady").status, "True");
        assert_eq!(s.pools.len(), 2);
        // Type keys stay unique: the list is a map keyed on type.
        let mut types: Vec<_> = s.conditions.iter().map(|c| c.type_.clone()).collect();
        types.sort();
        types.dedup();
        assert_eq!(types.len(), s.conditions.len());
    }
}
