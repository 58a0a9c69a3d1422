//! The Pod Security Standards (`baseline` and `restricted`, as the API server's admission
//! enforces them in Kubernetes 1.29–1.35), checked on a pod spec: the levels docs/operator.md
//! gives every pod are tested against the pods the operator and the chart render.

use k8s_openapi::api::core::v1::{Container, PodSpec, SecurityContext};

/// A Pod Security level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Baseline,
    Restricted,
}

/// Capabilities `baseline` lets a container add (the container runtime's defaults).
const BASELINE_CAPABILITIES: [&str; 13] = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// Sysctls `baseline` allows (namespaced, safe).
const SAFE_SYSCTLS: [&str; 8] = [
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
];

/// Volume kinds `restricted` allows.
fn restricted_volume(v: &k8s_openapi::api::core::v1::Volume) -> bool {
    v.config_map.is_some()
        || v.csi.is_some()
        || v.downward_api.is_some()
        || v.empty_dir.is_some()
        || v.ephemeral.is_some()
        || v.persistent_volume_claim.is_some()
        || v.projected.is_some()
        || v.secret.is_some()
}

fn containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers
        .iter()
        .flatten()
        .chain(pod.containers.iter())
}

/// What in `pod` the level forbids, one line each; empty when the pod passes.
pub fn violations(level: Level, pod: &PodSpec) -> Vec<String> {
    let mut out = Vec::new();
    for (set, what) in [
        (pod.host_network, "hostNetwork"),
        (pod.host_pid, "hostPID"),
        (pod.host_ipc, "hostIPC"),
    ] {
        if set == Some(true) {
            out.push(format!("{what}: true"));
        }
    }
    for v in pod.volumes.iter().flatten() {
        if v.host_path.is_some() {
            out.push(format!("hostPath volume {:?}", v.name));
        } else if level == Level::Restricted && !restricted_volume(v) {
            out.push(format!("volume {:?} of a kind restricted forbids", v.name));
        }
    }
    let pod_ctx = pod.security_context.as_ref();
    for s in pod_ctx
        .and_then(|c| c.sysctls.as_ref())
        .into_iter()
        .flatten()
    {
        if !SAFE_SYSCTLS.contains(&s.name.as_str()) {
            out.push(format!("sysctl {}", s.name));
        }
    }
    let pod_seccomp = pod_ctx
        .and_then(|c| c.seccomp_profile.as_ref())
        .map(|p| p.type_.as_str());
    let pod_non_root = pod_ctx.and_then(|c| c.run_as_non_root);
    if pod_ctx.and_then(|c| c.run_as_user) == Some(0) && level == Level::Restricted {
        out.push("pod runAsUser: 0".to_owned());
    }
    if pod_seccomp == Some("Unconfined") {
        out.push("pod seccompProfile Unconfined".to_owned());
    }
    for c in containers(pod) {
        let ctx = c.security_context.as_ref();
        container_violations(level, c, ctx, &mut out);
        if level == Level::Restricted {
            let seccomp = ctx
                .and_then(|x| x.seccomp_profile.as_ref())
                .map(|p| p.type_.as_str())
                .or(pod_seccomp);
            if !matches!(seccomp, Some("RuntimeDefault" | "Localhost")) {
                out.push(format!(
                    "container {:?}: seccompProfile not RuntimeDefault",
                    c.name
                ));
            }
            if ctx.and_then(|x| x.run_as_non_root).or(pod_non_root) != Some(true) {
                out.push(format!("container {:?}: runAsNonRoot not true", c.name));
            }
        }
    }
    out
}

fn container_violations(
    level: Level,
    c: &Container,
    ctx: Option<&SecurityContext>,
    out: &mut Vec<String>,
) {
    let name = &c.name;
    for p in c.ports.iter().flatten() {
        if p.host_port.is_some_and(|h| h != 0) {
            out.push(format!("container {name:?}: hostPort {}", p.container_port));
        }
    }
    let Some(ctx) = ctx else {
        if level == Level::Restricted {
            out.push(format!("container {name:?}: no securityContext"));
        }
        return;
    };
    if ctx.privileged == Some(true) {
        out.push(format!("container {name:?}: privileged"));
    }
    if ctx.proc_mount.as_deref().is_some_and(|m| m != "Default") {
        out.push(format!("container {name:?}: procMount"));
    }
    if ctx
        .seccomp_profile
        .as_ref()
        .is_some_and(|p| p.type_ == "Unconfined")
    {
        out.push(format!("container {name:?}: seccompProfile Unconfined"));
    }
    if ctx
        .windows_options
        .as_ref()
        .and_then(|w| w.host_process)
        .unwrap_or(false)
    {
        out.push(format!("container {name:?}: hostProcess"));
    }
    let caps = ctx.capabilities.as_ref();
    for cap in caps.and_then(|c| c.add.as_ref()).into_iter().flatten() {
        let allowed = match level {
            Level::Baseline => BASELINE_CAPABILITIES.contains(&cap.as_str()),
            Level::Restricted => cap == "NET_BIND_SERVICE",
        };
        if !allowed {
            out.push(format!("container {name:?}: adds capability {cap}"));
        }
    }
    if level == Level::Restricted {
        if ctx.allow_privilege_escalation != Some(false) {
            out.push(format!(
                "container {name:?}: allowPrivilegeEscalation not false"
            ));
        }
        if ctx.run_as_user == Some(0) {
            out.push(format!("container {name:?}: runAsUser 0"));
        }
        let drops_all = caps
            .and_then(|c| c.drop.as_ref())
            .is_some_and(|d| d.iter().any(|x| x == "ALL"));
        if !drops_all {
            out.push(format!(
                "container {name:?}: does not drop ALL capabilities"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Capabilities, HostPathVolumeSource, PodSecurityContext, SeccompProfile, Volume,
    };

    fn restricted_pod() -> PodSpec {
        PodSpec {
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            containers: vec![Container {
                name: "c".to_owned(),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    capabilities: Some(Capabilities {
                        drop: Some(vec!["ALL".to_owned()]),
                        add: None,
                    }),
                    ..SecurityContext::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }
    }

    #[test]
    fn each_rule_is_seen() {
        let ok = restricted_pod();
        assert!(violations(Level::Restricted, &ok).is_empty());
        let mut p = ok.clone();
        p.volumes = Some(vec![Volume {
            name: "h".to_owned(),
            host_path: Some(HostPathVolumeSource {
                path: "/x".to_owned(),
                type_: None,
            }),
            ..Volume::default()
        }]);
        assert_eq!(violations(Level::Baseline, &p), ["hostPath volume \"h\""]);
        let mut p = ok.clone();
        p.host_network = Some(true);
        assert_eq!(violations(Level::Baseline, &p), ["hostNetwork: true"]);
        let mut p = ok.clone();
        let ctx = p.containers[0].security_context.as_mut().expect("ctx");
        ctx.capabilities.as_mut().expect("caps").add = Some(vec!["CHOWN".to_owned()]);
        assert!(violations(Level::Baseline, &p).is_empty());
        assert_eq!(violations(Level::Restricted, &p).len(), 1);
        let ctx = p.containers[0].security_context.as_mut().expect("ctx");
        ctx.capabilities.as_mut().expect("caps").add = Some(vec!["IPC_LOCK".to_owned()]);
        assert_eq!(violations(Level::Baseline, &p).len(), 1);
        let mut p = ok.clone();
        p.containers[0]
            .security_context
            .as_mut()
            .expect("ctx")
            .privileged = Some(true);
        assert_eq!(violations(Level::Baseline, &p).len(), 1);
        let mut p = ok;
        p.security_context = None;
        assert!(violations(Level::Baseline, &p).is_empty());
        assert_eq!(
            violations(Level::Restricted, &p).len(),
            2,
            "seccomp and non-root"
        );
    }
}
