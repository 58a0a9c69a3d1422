//! The operator binary's configuration: flags with environment fallbacks, and the subcommands
//! (`render`, `uninstall`) that share the agent settings with the controller.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::Toleration;

use crate::finalizer::CleanupPolicy;
use crate::{Error, Result};

/// The agent image this operator release runs unless told otherwise; `scripts/build-images.sh`
/// builds it under this name.
pub const DEFAULT_AGENT_IMAGE: &str = concat!(
    "ghcr.io/kvfabric/kvfabric-agent:",
    env!("CARGO_PKG_VERSION")
);
/// Default host directory under which every pool's agent gets its socket directory.
pub const DEFAULT_SOCKET_ROOT: &str = "/var/run/kvfabric";

/// kvfabric operator: runs kvfabric agents for TransferFabric resources.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvfabric-operator", version)]
pub struct Cli {
    /// Without a subcommand the operator runs its controller.
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub run: Config,

    #[command(flatten)]
    pub agents: AgentFlags,
}

/// What else the binary does.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print, as YAML, every object the operator would create for the TransferFabrics in a file
    /// (a dry run; nothing is sent to a cluster).
    Render(RenderArgs),
    /// Before the operator is uninstalled: delete every TransferFabric and wait for the running
    /// operator to finalize them (or orphan them), so no finalizer is left that nothing removes.
    Uninstall(UninstallArgs),
}

/// `kvfabric-operator render`.
#[derive(Debug, Clone, Args)]
pub struct RenderArgs {
    /// YAML file with one or more TransferFabric documents (other kinds are skipped).
    #[arg(long, short)]
    pub file: PathBuf,

    /// Kubernetes version of the target cluster, e.g. `1.29` (decides what DRA fields exist).
    #[arg(long, value_parser = parse_kube_version)]
    pub kube_version: Option<KubeVersion>,
}

/// What happens to the fabrics when the operator is uninstalled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FabricsOnUninstall {
    /// Delete every fabric; the operator removes its registry keys and agents.
    Delete,
    /// Keep fabrics and agents, remove the operator's finalizer (registry keys stay).
    Orphan,
}

/// `kvfabric-operator uninstall`.
#[derive(Debug, Clone, Args)]
pub struct UninstallArgs {
    /// Delete the fabrics, or leave them without the operator's finalizer.
    #[arg(long, value_enum, default_value = "delete")]
    pub fabrics: FabricsOnUninstall,

    /// How long to wait for the operator to finalize deleted fabrics before removing the
    /// finalizer here.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,

    /// Namespace of the fabrics; all namespaces when absent.
    #[arg(long, env = "KVFABRIC_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
}

/// The controller's flags.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// Address of the HTTP server for /metrics, /healthz and /readyz.
    #[arg(long, env = "KVFABRIC_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: String,

    /// Run only while holding the Lease (for more than one replica).
    #[arg(long, env = "KVFABRIC_LEADER_ELECTION", default_value_t = false)]
    pub leader_election: bool,

    /// Name of the coordination.k8s.io/v1 Lease used for leader election.
    #[arg(long, env = "KVFABRIC_LEASE_NAME", default_value = "kvfabric-operator")]
    pub lease_name: String,

    /// Namespace of the Lease; the operator's own namespace from the downward API.
    #[arg(long, env = "POD_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// Namespace to watch; all namespaces when absent.
    #[arg(long, env = "KVFABRIC_WATCH_NAMESPACE")]
    pub namespace: Option<String>,

    /// Log filter (tracing-subscriber EnvFilter syntax), e.g. `info` or `kvfabric_operator=debug`.
    #[arg(long, env = "KVFABRIC_LOG_LEVEL", default_value = "info")]
    pub log_level: String,

    /// Attempts to delete a fabric's registry keys before the finalizer is removed anyway.
    #[arg(long, env = "KVFABRIC_REGISTRY_CLEANUP_ATTEMPTS", default_value_t = 3)]
    pub registry_cleanup_attempts: u32,

    /// Limit of each registry cleanup attempt, in seconds.
    #[arg(
        long,
        env = "KVFABRIC_REGISTRY_CLEANUP_TIMEOUT_SECS",
        default_value_t = 5
    )]
    pub registry_cleanup_timeout_secs: u64,
}

/// Image pull policy of the agent containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PullPolicy {
    /// Pull on every start.
    #[value(name = "Always")]
    Always,
    /// Pull when the node lacks the image.
    #[value(name = "IfNotPresent")]
    IfNotPresent,
    /// Never pull (images loaded into the nodes, e.g. `kind load image-archive`).
    #[value(name = "Never")]
    Never,
}

impl PullPolicy {
    /// The Kubernetes spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

/// How agent pods are built, whatever the fabric says: the cluster administrator's choices.
#[derive(Debug, Clone, Args)]
pub struct AgentFlags {
    /// Image of every agent pod (it holds `kvfabric` and `kvfabric-socket-dir`).
    #[arg(long, env = "KVFABRIC_AGENT_IMAGE", default_value = DEFAULT_AGENT_IMAGE, global = true)]
    pub agent_image: String,

    /// Pull policy of the agent image.
    #[arg(
        long,
        env = "KVFABRIC_AGENT_IMAGE_PULL_POLICY",
        value_enum,
        default_value = "IfNotPresent",
        global = true
    )]
    pub agent_image_pull_policy: PullPolicy,

    /// Secrets to pull the agent image with (comma-separated); each must exist in every fabric's
    /// namespace.
    #[arg(
        long,
        env = "KVFABRIC_AGENT_IMAGE_PULL_SECRETS",
        value_delimiter = ',',
        global = true
    )]
    pub agent_image_pull_secrets: Vec<String>,

    /// Host directory under which each pool's agents get `<namespace>/<fabric>/<pool>` for their
    /// sockets; workers mount that directory.
    #[arg(long, env = "KVFABRIC_SOCKET_ROOT", default_value = DEFAULT_SOCKET_ROOT, global = true)]
    pub socket_root: String,

    /// How pods get the socket directory: a hostPath volume, or the `csi.kvfabric.io` volume
    /// (the chart's `csi.enabled`), which passes Pod Security `baseline`.
    #[arg(
        long,
        env = "KVFABRIC_SOCKET_VOLUME",
        value_enum,
        default_value = "host-path",
        global = true
    )]
    pub socket_volume: SocketVolume,

    /// Tolerations of every agent pod, added to each pool's own (JSON, a list of Kubernetes
    /// tolerations): the taints a cluster puts on its GPU nodes, once for every fabric.
    #[arg(
        long,
        env = "KVFABRIC_AGENT_TOLERATIONS",
        default_value = "[]",
        global = true
    )]
    pub agent_tolerations: String,
}

/// The volume that holds an agent's socket directory in its pods (and its workers').
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum SocketVolume {
    /// A `hostPath` of `<socketRoot>/<namespace>/<fabric>/<pool>`: the namespace must allow
    /// Pod Security `privileged`.
    #[default]
    #[value(name = "host-path")]
    HostPath,
    /// The `csi.kvfabric.io` ephemeral volume (`kvfabric-csi` on every node) showing the same
    /// directory: no hostPath, and the directory goes with the fabric's last pod on the node.
    #[value(name = "csi")]
    Csi,
}

/// A Kubernetes server version, as far as the operator cares (major and minor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KubeVersion {
    /// Major version (1).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl KubeVersion {
    /// The first version whose pod API has the GA-shaped DRA fields
    /// (`resourceClaims[].resourceClaimTemplateName`, `resources.claims[].request`).
    pub const DRA: KubeVersion = KubeVersion {
        major: 1,
        minor: 31,
    };

    /// From the API server's `version` answer: `major` and `minor` may carry a provider suffix
    /// (`"29+"`).
    pub fn from_info(major: &str, minor: &str) -> Option<Self> {
        let digits = |s: &str| -> Option<u32> {
            let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            s[..end].parse().ok()
        };
        Some(Self {
            major: digits(major)?,
            minor: digits(minor)?,
        })
    }
}

impl std::fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

fn parse_kube_version(s: &str) -> std::result::Result<KubeVersion, String> {
    let (major, minor) = s
        .trim_start_matches('v')
        .split_once('.')
        .ok_or_else(|| format!("{s:?} is not a version such as 1.29"))?;
    KubeVersion::from_info(major, minor)
        .ok_or_else(|| format!("{s:?} is not a version such as 1.29"))
}

/// The agent settings after checking.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSettings {
    /// Agent image.
    pub image: String,
    /// Its pull policy.
    pub pull_policy: PullPolicy,
    /// Pull Secrets, by name, in each fabric's namespace.
    pub pull_secrets: Vec<String>,
    /// Host root of the socket directories, without a trailing slash.
    pub socket_root: String,
    /// The volume kind of the socket directory.
    pub socket_volume: SocketVolume,
    /// The API server's version, when known; `None` builds for the newest API.
    pub kube: Option<KubeVersion>,
    /// Tolerations of every agent pod, after each pool's own.
    pub tolerations: Vec<Toleration>,
}

impl Default for AgentSettings {
    fn default() -> Self {
        Self {
            image: DEFAULT_AGENT_IMAGE.to_owned(),
            pull_policy: PullPolicy::IfNotPresent,
            pull_secrets: Vec::new(),
            socket_root: DEFAULT_SOCKET_ROOT.to_owned(),
            socket_volume: SocketVolume::HostPath,
            kube: None,
            tolerations: Vec::new(),
        }
    }
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

impl AgentFlags {
    /// Checks the image reference, the pull Secret names and the socket root.
    pub fn settings(&self) -> Result<AgentSettings> {
        let image = self.agent_image.trim();
        if image.is_empty() || image.chars().any(char::is_whitespace) {
            return Err(Error::Config {
                field: "--agent-image",
                value: self.agent_image.clone(),
                reason: "must be an image reference without spaces".to_owned(),
            });
        }
        for name in &self.agent_image_pull_secrets {
            if !is_dns_subdomain(name) {
                return Err(Error::Config {
                    field: "--agent-image-pull-secrets",
                    value: name.clone(),
                    reason: "must be Secret names (DNS subdomains)".to_owned(),
                });
            }
        }
        let root = self.socket_root.trim_end_matches('/');
        let clean = root.starts_with('/')
            && root.len() > 1
            && root
                .split('/')
                .skip(1)
                .all(|c| !c.is_empty() && c != "." && c != "..");
        if !clean {
            return Err(Error::Config {
                field: "--socket-root",
                value: self.socket_root.clone(),
                reason: "must be an absolute directory other than / without '.', '..' or '//'"
                    .to_owned(),
            });
        }
        let tolerations: Vec<Toleration> =
            serde_json::from_str(&self.agent_tolerations).map_err(|e| Error::Config {
                field: "--agent-tolerations",
                value: self.agent_tolerations.chars().take(200).collect(),
                reason: format!("must be a JSON list of tolerations: {e}"),
            })?;
        Ok(AgentSettings {
            image: image.to_owned(),
            pull_policy: self.agent_image_pull_policy,
            pull_secrets: self.agent_image_pull_secrets.clone(),
            socket_root: root.to_owned(),
            socket_volume: self.socket_volume,
            kube: None,
            tolerations,
        })
    }
}

/// The controller's settings after checking, in the types the operator uses.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the HTTP server listens.
    pub metrics_addr: SocketAddr,
    /// Lease `(namespace, name)` when leader election is on.
    pub lease: Option<(String, String)>,
    /// Namespace to watch.
    pub namespace: Option<String>,
    /// Log filter.
    pub log_level: String,
    /// Registry cleanup policy.
    pub cleanup: CleanupPolicy,
    /// How agent pods are built.
    pub agents: AgentSettings,
}

impl Config {
    /// Checks the values clap cannot: the address, the lease namespace, the bounds.
    pub fn settings(&self, agents: &AgentFlags) -> Result<Settings> {
        let agents = agents.settings()?;
        let metrics_addr = self
            .metrics_addr
            .parse()
            .map_err(|e: std::net::AddrParseError| Error::Config {
                field: "--metrics-addr",
                value: self.metrics_addr.clone(),
                reason: e.to_string(),
            })?;
        let lease = if self.leader_election {
            let ns = self
                .lease_namespace
                .clone()
                .filter(|ns| !ns.is_empty())
                .ok_or_else(|| Error::Config {
                    field: "--lease-namespace",
                    value: String::new(),
                    reason: "required with --leader-election (or set POD_NAMESPACE)".to_owned(),
                })?;
            if self.lease_name.is_empty() {
                return Err(Error::Config {
                    field: "--lease-name",
                    value: String::new(),
                    reason: "must not be empty".to_owned(),
                });
            }
            Some((ns, self.lease_name.clone()))
        } else {
            None
        };
        if self.registry_cleanup_attempts == 0 {
            return Err(Error::Config {
                field: "--registry-cleanup-attempts",
                value: "0".to_owned(),
                reason: "must be at least 1".to_owned(),
            });
        }
        if self.registry_cleanup_timeout_secs == 0 {
            return Err(Error::Config {
                field: "--registry-cleanup-timeout-secs",
                value: "0".to_owned(),
                reason: "must be at least 1".to_owned(),
            });
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log_level).is_err() {
            return Err(Error::Config {
                field: "--log-level",
                value: self.log_level.clone(),
                reason: "not a valid tracing filter".to_owned(),
            });
        }
        Ok(Settings {
            metrics_addr,
            lease,
            namespace: self.namespace.clone().filter(|ns| !ns.is_empty()),
            log_level: self.log_level.clone(),
            cleanup: CleanupPolicy {
                attempts: self.registry_cleanup_attempts,
                timeout: Duration::from_secs(self.registry_cleanup_timeout_secs),
                ..CleanupPolicy::default()
            },
            agents,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("kvfabric-operator").chain(args.iter().copied()))
            .expect("parses")
    }

    fn parse(args: &[&str]) -> Config {
        cli(args).run
    }

    fn agents(args: &[&str]) -> Result<AgentSettings> {
        cli(args).agents.settings()
    }

    #[test]
    fn agent_defaults_match_the_built_image() {
        let a = agents(&[]).expect("valid");
        assert_eq!(
            a.image,
            format!(
                "ghcr.io/kvfabric/kvfabric-agent:{}",
                env!("CARGO_PKG_VERSION")
            )
        );
        assert_eq!(a.pull_policy, PullPolicy::IfNotPresent);
        assert_eq!(a.socket_root, "/var/run/kvfabric");
        assert_eq!(a.socket_volume, SocketVolume::HostPath);
    }

    #[test]
    fn agent_settings_are_checked() {
        let a = agents(&[
            "--agent-image",
            "registry.local:5000/kvfabric-agent:dev",
            "--agent-image-pull-policy",
            "Never",
            "--agent-image-pull-secrets",
            "regcred,other",
            "--socket-root",
            "/run/kvfabric/",
            "--socket-volume",
            "csi",
        ])
        .expect("valid");
        assert_eq!(a.socket_volume, SocketVolume::Csi);
        assert_eq!(a.pull_policy.as_str(), "Never");
        assert_eq!(a.pull_secrets, vec!["regcred", "other"]);
        assert_eq!(a.socket_root, "/run/kvfabric");
        let gpu = agents(&[
            "--agent-tolerations",
            r#"[{"key":"nvidia.com/gpu","operator":"Exists","effect":"NoSchedule"}]"#,
        ])
        .expect("valid");
        assert_eq!(gpu.tolerations[0].key.as_deref(), Some("nvidia.com/gpu"));
        for (flag, value) in [
            ("--socket-root", "relative/dir"),
            ("--socket-root", "/"),
            ("--socket-root", "/var/run/../etc"),
            ("--socket-root", "/var//run"),
            ("--agent-image", "two words"),
            ("--agent-image-pull-secrets", "Bad_Name"),
            ("--agent-tolerations", "{\"key\": \"not a list\"}"),
            ("--agent-tolerations", "[{\"effect\": 7}]"),
        ] {
            let e = agents(&[flag, value]).expect_err(value);
            assert!(e.to_string().contains(flag), "{e}");
        }
    }

    #[test]
    fn subcommands_parse() {
        let c = cli(&[
            "render",
            "--file",
            "f.yaml",
            "--kube-version",
            "1.29",
            "--agent-image",
            "x:1",
        ]);
        match c.command {
            Some(Command::Render(r)) => {
                assert_eq!(
                    r.kube_version,
                    Some(KubeVersion {
                        major: 1,
                        minor: 29
                    })
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.agents.agent_image, "x:1");
        let c = cli(&["uninstall", "--fabrics", "orphan"]);
        assert!(matches!(
            c.command,
            Some(Command::Uninstall(UninstallArgs {
                fabrics: FabricsOnUninstall::Orphan,
                ..
            }))
        ));
    }

    #[test]
    fn server_versions_with_provider_suffixes() {
        assert_eq!(
            KubeVersion::from_info("1", "29+"),
            Some(KubeVersion {
                major: 1,
                minor: 29
            })
        );
        assert!(KubeVersion::from_info("1", "35") >= Some(KubeVersion::DRA));
        assert_eq!(KubeVersion::from_info("", "29"), None);
    }

    #[test]
    fn defaults() {
        let s = parse(&[]).settings(&cli(&[]).agents).expect("valid");
        assert_eq!(s.metrics_addr.to_string(), "0.0.0.0:8080");
        assert!(s.lease.is_none());
        assert_eq!(s.cleanup.attempts, 3);
        assert_eq!(s.cleanup.timeout, Duration::from_secs(5));
    }

    #[test]
    fn leader_election_needs_a_namespace() {
        let e = parse(&["--leader-election", "--lease-namespace", ""])
            .settings(&cli(&[]).agents)
            .expect_err("needs namespace");
        assert!(e.to_string().contains("--lease-namespace"), "{e}");
        let s = parse(&[
            "--leader-election",
            "--lease-namespace",
            "kvfabric",
            "--lease-name",
            "l",
        ])
        .settings(&cli(&[]).agents)
        .expect("valid");
        assert_eq!(s.lease, Some(("kvfabric".into(), "l".into())));
    }

    #[test]
    fn bad_values_name_the_flag() {
        let e = parse(&["--metrics-addr", "nope"])
            .settings(&cli(&[]).agents)
            .expect_err("bad");
        assert!(
            e.to_string().contains("--metrics-addr") && e.to_string().contains("nope"),
            "{e}"
        );
        let e = parse(&["--registry-cleanup-attempts", "0"])
            .settings(&cli(&[]).agents)
            .expect_err("bad");
        assert!(e.to_string().contains("--registry-cleanup-attempts"), "{e}");
        let e = parse(&["--log-level", "info,[[["])
            .settings(&cli(&[]).agents)
            .expect_err("bad");
        assert!(e.to_string().contains("--log-level"), "{e}");
    }

    #[test]
    fn namespace_filter() {
        let s = parse(&["--namespace", "llm"])
            .settings(&cli(&[]).agents)
            .expect("valid");
        assert_eq!(s.namespace.as_deref(), Some("llm"));
    }
}
