//! The operator binary's configuration: flags with environment fallbacks.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::finalizer::CleanupPolicy;
use crate::{Error, Result};

/// kvfabric operator: runs kvfabric agents for TransferFabric resources.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvfabric-operator", version)]
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

/// The settings after checking, in the types the operator uses.
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
}

impl Config {
    /// Checks the values clap cannot: the address, the lease namespace, the bounds.
    pub fn settings(&self) -> Result<Settings> {
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Config {
        Config::try_parse_from(std::iter::once("kvfabric-operator").chain(args.iter().copied()))
            .expect("parses")
    }

    #[test]
    fn defaults() {
        let s = parse(&[]).settings().expect("valid");
        assert_eq!(s.metrics_addr.to_string(), "0.0.0.0:8080");
        assert!(s.lease.is_none());
        assert_eq!(s.cleanup.attempts, 3);
        assert_eq!(s.cleanup.timeout, Duration::from_secs(5));
    }

    #[test]
    fn leader_election_needs_a_namespace() {
        let e = parse(&["--leader-election", "--lease-namespace", ""])
            .settings()
            .expect_err("needs namespace");
        assert!(e.to_string().contains("--lease-namespace"), "{e}");
        let s = parse(&[
            "--leader-election",
            "--lease-namespace",
            "kvfabric",
            "--lease-name",
            "l",
        ])
        .settings()
        .expect("valid");
        assert_eq!(s.lease, Some(("kvfabric".into(), "l".into())));
    }

    #[test]
    fn bad_values_name_the_flag() {
        let e = parse(&["--metrics-addr", "nope"])
            .settings()
            .expect_err("bad");
        assert!(
            e.to_string().contains("--metrics-addr") && e.to_string().contains("nope"),
            "{e}"
        );
        let e = parse(&["--registry-cleanup-attempts", "0"])
            .settings()
            .expect_err("bad");
        assert!(e.to_string().contains("--registry-cleanup-attempts"), "{e}");
        let e = parse(&["--log-level", "info,[[["])
            .settings()
            .expect_err("bad");
        assert!(e.to_string().contains("--log-level"), "{e}");
    }

    #[test]
    fn namespace_filter() {
        let s = parse(&["--namespace", "llm"]).settings().expect("valid");
        assert_eq!(s.namespace.as_deref(), Some("llm"));
    }
}
