//! Why a pool's agents are not ready, in the words of its pods and of its DaemonSet's events:
//! "0 of 3 ready" alone sends the user to `kubectl describe`; a condition that says "Pending:
//! 0/5 nodes are available: 3 Insufficient rdma/rdma_shared_device_a" or "rejected by
//! PodSecurity" does not.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ContainerStatus, Event, Pod};

/// Longest detail put in a condition message.
pub const MAX_DETAIL: usize = 600;

/// What stops a pool, most fundamental first: the first that applies is the pool's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cause {
    /// Pod Security admission refused the pods (the namespace's level is too strict).
    PodSecurityRejected,
    /// The DaemonSet controller could not create pods for another reason (quota, a missing
    /// ResourceClaimTemplate, …).
    PodCreateFailed,
    /// Pods wait for resources or nodes (e.g. an RDMA device plugin resource none has).
    Unschedulable,
    /// The image cannot be pulled.
    ImagePullFailed,
    /// A Secret, a key of it or the ConfigMap is missing.
    ContainerConfigError,
    /// The agent keeps exiting.
    CrashLoopBackOff,
    /// The runtime could not create or start the container.
    ContainerStartFailed,
    /// Running but not ready: not registered in etcd yet, or draining.
    AgentsNotReady,
}

impl Cause {
    /// The condition reason.
    pub fn reason(self) -> &'static str {
        match self {
            Cause::PodSecurityRejected => "PodSecurityRejected",
            Cause::PodCreateFailed => "PodCreateFailed",
            Cause::Unschedulable => "Unschedulable",
            Cause::ImagePullFailed => "ImagePullFailed",
            Cause::ContainerConfigError => "ContainerConfigError",
            Cause::CrashLoopBackOff => "CrashLoopBackOff",
            Cause::ContainerStartFailed => "ContainerStartFailed",
            Cause::AgentsNotReady => "AgentsNotReady",
        }
    }
}

/// A pool's main cause and what the pods or events said about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnosis {
    /// The most fundamental cause found.
    pub cause: Cause,
    /// Counts per cause and the first message of the main one, cut to [`MAX_DETAIL`].
    pub detail: String,
}

fn cut(mut s: String) -> String {
    if let Some((i, _)) = s.char_indices().nth(MAX_DETAIL) {
        s.truncate(i);
        s.push('…');
    }
    s
}

fn container_cause(cs: &ContainerStatus) -> Option<(Cause, String)> {
    let waiting = cs.state.as_ref()?.waiting.as_ref()?;
    let reason = waiting.reason.as_deref().unwrap_or_default();
    let cause = match reason {
        "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull" => {
            Cause::ImagePullFailed
        }
        "CreateContainerConfigError" => Cause::ContainerConfigError,
        "CrashLoopBackOff" => Cause::CrashLoopBackOff,
        "CreateContainerError" | "RunContainerError" | "StartError" => Cause::ContainerStartFailed,
        _ => return None,
    };
    let mut msg = format!(
        "container {}: {reason}: {}",
        cs.name,
        waiting.message.as_deref().unwrap_or_default()
    );
    if cause == Cause::CrashLoopBackOff
        && let Some(t) = cs.last_state.as_ref().and_then(|s| s.terminated.as_ref())
    {
        msg.push_str(&format!(
            " (last exit code {}{})",
            t.exit_code,
            t.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ));
    }
    Some((cause, msg))
}

fn pod_cause(pod: &Pod) -> Option<(Cause, String)> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let status = pod.status.as_ref()?;
    let unschedulable = status.conditions.iter().flatten().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    });
    if let Some(c) = unschedulable {
        return Some((
            Cause::Unschedulable,
            format!(
                "pod {name} Pending: {}",
                c.message.as_deref().unwrap_or_default()
            ),
        ));
    }
    let containers = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    let mut worst: Option<(Cause, String)> = None;
    for cs in containers {
        if let Some((cause, msg)) = container_cause(cs)
            && worst.as_ref().is_none_or(|(w, _)| cause < *w)
        {
            worst = Some((cause, format!("pod {name} {msg}")));
        }
    }
    if worst.is_some() {
        return worst;
    }
    let running = status.phase.as_deref() == Some("Running");
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    (running && !ready).then(|| {
        (
            Cause::AgentsNotReady,
            format!("pod {name} running but not ready (not registered in etcd yet, or draining; see its log)"),
        )
    })
}

/// The diagnosis of one pool from its DaemonSet, its pods and the DaemonSet's `FailedCreate`
/// events; `None` when nothing explains a shortfall (or there is none).
pub fn diagnose(ds: &DaemonSet, pods: &[Pod], events: &[Event]) -> Option<Diagnosis> {
    let mut found: Vec<(Cause, String)> = Vec::new();
    let missing_pods = ds
        .status
        .as_ref()
        .is_some_and(|s| s.current_number_scheduled < s.desired_number_scheduled);
    // An old FailedCreate says nothing once every pod exists.
    if missing_pods {
        let uid = ds.metadata.uid.as_deref();
        for ev in events.iter().filter(|e| {
            e.reason.as_deref() == Some("FailedCreate")
                && (uid.is_none() || e.involved_object.uid.as_deref() == uid)
        }) {
            let msg = ev.message.clone().unwrap_or_default();
            let cause = if msg.contains("violates PodSecurity") {
                Cause::PodSecurityRejected
            } else {
                Cause::PodCreateFailed
            };
            found.push((cause, msg));
        }
    }
    found.extend(pods.iter().filter_map(pod_cause));
    let main = found.iter().map(|(c, _)| *c).min()?;
    let first = found
        .iter()
        .find(|(c, _)| *c == main)
        .map(|(_, m)| m.clone())
        .unwrap_or_default();
    let mut counts: Vec<(Cause, usize)> = Vec::new();
    for (c, _) in &found {
        match counts.iter_mut().find(|(k, _)| k == c) {
            Some((_, n)) => *n += 1,
            None => counts.push((*c, 1)),
        }
    }
    counts.sort();
    let summary = counts
        .iter()
        .map(|(c, n)| format!("{n}× {}", c.reason()))
        .collect::<Vec<_>>()
        .join(", ");
    Some(Diagnosis {
        cause: main,
        detail: cut(format!("{summary}; {first}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::DaemonSetStatus;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStateWaiting, ObjectReference,
        PodCondition, PodStatus,
    };
    use kube::api::ObjectMeta;

    fn ds(desired: i32, current: i32) -> DaemonSet {
        DaemonSet {
            metadata: ObjectMeta {
                name: Some("tf-prefill-agent".into()),
                uid: Some("ds-uid".into()),
                ..ObjectMeta::default()
            },
            status: Some(DaemonSetStatus {
                desired_number_scheduled: desired,
                current_number_scheduled: current,
                ..DaemonSetStatus::default()
            }),
            ..DaemonSet::default()
        }
    }

    fn event(msg: &str) -> Event {
        Event {
            reason: Some("FailedCreate".into()),
            message: Some(msg.into()),
            involved_object: ObjectReference {
                kind: Some("DaemonSet".into()),
                name: Some("tf-prefill-agent".into()),
                uid: Some("ds-uid".into()),
                ..ObjectReference::default()
            },
            ..Event::default()
        }
    }

    fn pod(name: &str, status: PodStatus) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            status: Some(status),
            ..Pod::default()
        }
    }

    fn waiting(container: &str, reason: &str, message: &str) -> ContainerStatus {
        ContainerStatus {
            name: container.into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.into()),
                    message: Some(message.into()),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }
    }

    fn unschedulable(msg: &str) -> PodStatus {
        PodStatus {
            phase: Some("Pending".into()),
            conditions: Some(vec![PodCondition {
                type_: "PodScheduled".into(),
                status: "False".into(),
                reason: Some("Unschedulable".into()),
                message: Some(msg.into()),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }
    }

    #[test]
    fn pod_security_rejection_is_named() {
        let d = diagnose(
            &ds(2, 0),
            &[],
            &[event(
                "Error creating: pods \"tf-prefill-agent-x\" is forbidden: violates PodSecurity \"baseline:latest\": hostPath volumes (volume \"socket-dir\")",
            )],
        )
        .expect("diagnosis");
        assert_eq!(d.cause, Cause::PodSecurityRejected);
        assert!(d.detail.contains("hostPath volumes"), "{}", d.detail);
    }

    #[test]
    fn stale_create_failures_are_ignored_once_all_pods_exist() {
        assert_eq!(
            diagnose(&ds(2, 2), &[], &[event("violates PodSecurity")]),
            None
        );
    }

    #[test]
    fn pending_on_a_resource() {
        let d = diagnose(
            &ds(2, 2),
            &[pod(
                "a",
                unschedulable("0/5 nodes are available: 3 Insufficient rdma/rdma_shared_device_a."),
            )],
            &[],
        )
        .expect("diagnosis");
        assert_eq!(d.cause, Cause::Unschedulable);
        assert!(
            d.detail.contains("Insufficient rdma/rdma_shared_device_a"),
            "{}",
            d.detail
        );
    }

    #[test]
    fn image_pull_and_config_errors_with_counts() {
        let pull = PodStatus {
            phase: Some("Pending".into()),
            init_container_statuses: Some(vec![waiting(
                "socket-dir",
                "ImagePullBackOff",
                "Back-off pulling image \"ghcr.io/kvfabric/kvfabric-agent:0.1.0\"",
            )]),
            ..PodStatus::default()
        };
        let config = PodStatus {
            phase: Some("Pending".into()),
            container_statuses: Some(vec![waiting(
                "agent",
                "CreateContainerConfigError",
                "secret \"llama-peer-token\" not found",
            )]),
            ..PodStatus::default()
        };
        let d = diagnose(
            &ds(3, 3),
            &[pod("a", pull.clone()), pod("b", pull), pod("c", config)],
            &[],
        )
        .expect("diagnosis");
        assert_eq!(d.cause, Cause::ImagePullFailed);
        assert!(
            d.detail
                .starts_with("2× ImagePullFailed, 1× ContainerConfigError"),
            "{}",
            d.detail
        );
        assert!(
            d.detail
                .contains("pod a container socket-dir: ImagePullBackOff"),
            "{}",
            d.detail
        );
    }

    #[test]
    fn crash_loop_shows_the_exit() {
        let mut cs = waiting(
            "agent",
            "CrashLoopBackOff",
            "back-off 5m0s restarting failed container",
        );
        cs.last_state = Some(ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: 64,
                message: Some("invalid setting --etcd-endpoints".into()),
                ..ContainerStateTerminated::default()
            }),
            ..ContainerState::default()
        });
        let d = diagnose(
            &ds(1, 1),
            &[pod(
                "a",
                PodStatus {
                    phase: Some("Running".into()),
                    container_statuses: Some(vec![cs]),
                    ..PodStatus::default()
                },
            )],
            &[],
        )
        .expect("diagnosis");
        assert_eq!(d.cause, Cause::CrashLoopBackOff);
        assert!(
            d.detail.contains("last exit code 64: invalid setting"),
            "{}",
            d.detail
        );
    }

    #[test]
    fn running_but_unready_and_healthy_pods() {
        let running = |ready: &str| PodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: ready.into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        };
        let d = diagnose(&ds(1, 1), &[pod("a", running("False"))], &[]).expect("diagnosis");
        assert_eq!(d.cause, Cause::AgentsNotReady);
        assert_eq!(diagnose(&ds(1, 1), &[pod("a", running("True"))], &[]), None);
    }

    #[test]
    fn details_are_cut() {
        let long = "x".repeat(10 * MAX_DETAIL);
        let d = diagnose(&ds(1, 0), &[], &[event(&long)]).expect("diagnosis");
        assert!(d.detail.chars().count() <= MAX_DETAIL + 1);
    }
}
