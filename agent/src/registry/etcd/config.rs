//! Where etcd is and how to reach it: endpoints, the fabric's root, the lease TTL, TLS and auth.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use super::super::check_name;
use super::{classify, timed_out};
use crate::error::{Error, Result};

/// Environment variable naming the directory with `ca.crt`, `tls.crt`, `tls.key`.
pub const TLS_DIR_ENV: &str = "KVFABRIC_ETCD_TLS_DIR";

/// TLS towards etcd: the CA that signed the server's certificate and, for client-certificate
/// authentication, this agent's certificate and key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl EtcdTls {
    /// Reads the layout of a mounted Kubernetes TLS secret: `ca.crt` (required), `tls.crt` and
    /// `tls.key` (both or neither). Only checks that the files exist; they are read at connect.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let ca = dir.join("ca.crt");
        if !ca.is_file() {
            return Err(Error::config(
                "etcd.tls.ca",
                ca.display(),
                format!("file not found (the TLS directory, {TLS_DIR_ENV}, must hold ca.crt)"),
            ));
        }
        let cert = dir.join("tls.crt");
        let key = dir.join("tls.key");
        let (cert, key) = match (cert.is_file(), key.is_file()) {
            (true, true) => (Some(cert), Some(key)),
            (false, false) => (None, None),
            (true, false) => {
                return Err(Error::config(
                    "etcd.tls.key",
                    key.display(),
                    "file not found (tls.crt is there: a client certificate needs its key)",
                ));
            }
            (false, true) => {
                return Err(Error::config(
                    "etcd.tls.cert",
                    cert.display(),
                    "file not found (tls.key is there: a client key needs its certificate)",
                ));
            }
        };
        Ok(EtcdTls { ca, cert, key })
    }

    /// Reads the files (blocking: call off the async threads).
    pub fn options(&self) -> Result<TlsOptions> {
        let read = |field: &'static str, path: &Path| {
            std::fs::read(path).map_err(|e| Error::config(field, path.display(), e.to_string()))
        };
        let mut tls =
            TlsOptions::new().ca_certificate(Certificate::from_pem(read("etcd.tls.ca", &self.ca)?));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                tls = tls.identity(Identity::from_pem(
                    read("etcd.tls.cert", cert)?,
                    read("etcd.tls.key", key)?,
                ));
            }
            (None, None) => {}
            (Some(cert), None) => {
                return Err(Error::config(
                    "etcd.tls.key",
                    "",
                    format!(
                        "missing (a client certificate, {}, needs its key)",
                        cert.display()
                    ),
                ));
            }
            (None, Some(key)) => {
                return Err(Error::config(
                    "etcd.tls.cert",
                    "",
                    format!(
                        "missing (a client key, {}, needs its certificate)",
                        key.display()
                    ),
                ));
            }
        }
        Ok(tls)
    }
}

/// Where and how to reach etcd. Build with [`EtcdConfig::new`] and adjust the fields.
#[derive(Clone)]
pub struct EtcdConfig {
    /// `http://host:port` or `https://host:port` (https with [`EtcdConfig::tls`]).
    pub endpoints: Vec<String>,
    /// Key prefix, default `/kvfabric`.
    pub prefix: String,
    /// The fabric's namespace: the second level of every key.
    pub namespace: String,
    /// Fabric name: the third level of every key.
    pub fabric: String,
    /// Lease time-to-live, default 10 s (whole seconds; etcd may raise very short ones). An
    /// agent that dies disappears from other agents' caches about one TTL later.
    pub lease_ttl: Duration,
    pub tls: Option<EtcdTls>,
    /// Username and password.
    pub auth: Option<(String, String)>,
    /// Bounds connecting and each single request, default 5 s.
    pub connect_timeout: Duration,
}

impl EtcdConfig {
    pub const DEFAULT_PREFIX: &'static str = kvfabric_proto::contract::DEFAULT_KEY_PREFIX;
    pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

    pub fn new<E: Into<String>>(
        endpoints: impl IntoIterator<Item = E>,
        fabric: impl Into<String>,
    ) -> Self {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: Self::DEFAULT_PREFIX.into(),
            namespace: kvfabric_proto::contract::DEFAULT_NAMESPACE.into(),
            fabric: fabric.into(),
            lease_ttl: Self::DEFAULT_LEASE_TTL,
            tls: None,
            auth: None,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// `<prefix>/<namespace>/<fabric>/` (`kvfabric_proto::contract::registry_root`).
    pub fn root(&self) -> String {
        kvfabric_proto::contract::registry_root(&self.prefix, &self.namespace, &self.fabric) + "/"
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::config("etcd.endpoints", "", "at least one endpoint"));
        }
        for ep in &self.endpoints {
            if self.tls.is_some() && ep.starts_with("http://") {
                return Err(Error::config(
                    "etcd.endpoints",
                    ep,
                    "TLS is configured: use an https:// endpoint",
                ));
            }
        }
        check_name("etcd.fabric", &self.fabric)?;
        check_name("etcd.namespace", &self.namespace)?;
        for (field, value) in [
            ("etcd.fabric", &self.fabric),
            ("etcd.namespace", &self.namespace),
        ] {
            if value.contains('/') {
                return Err(Error::config(field, value, "must not contain '/'"));
            }
        }
        if !self.prefix.starts_with('/') {
            return Err(Error::config(
                "etcd.prefix",
                &self.prefix,
                "must start with '/'",
            ));
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return Err(Error::config(
                "etcd.lease_ttl",
                format!("{:?}", self.lease_ttl),
                "at least 1 s",
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::config(
                "etcd.connect_timeout",
                "0s",
                "must be positive",
            ));
        }
        Ok(())
    }

    pub(super) fn ttl_secs(&self) -> i64 {
        i64::try_from(self.lease_ttl.as_secs_f64().ceil() as u64).unwrap_or(i64::MAX)
    }

    /// Builds the etcd client (reads TLS files off the async threads). Only connects when
    /// credentials are given (to authenticate); otherwise the first request connects.
    pub async fn client(&self) -> Result<Client> {
        self.validate()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            // etcd's --grpc-keepalive-min-time is 5 s: never ping more often than that.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            // A member that lost its leader (cut off from the others, or the cluster lost its
            // quorum) refuses requests at once and cancels the watch streams it serves, instead
            // of answering from a store that no longer changes: the watcher then resumes on a
            // member that has a leader, and a write fails fast rather than at its timeout.
            .with_require_leader(true);
        if let Some(tls) = self.tls.clone() {
            let tls = tokio::task::spawn_blocking(move || tls.options())
                .await
                .map_err(|e| Error::config("etcd.tls", "", e.to_string()))??;
            options = options.with_tls(tls);
        }
        if let Some((user, password)) = &self.auth {
            options = options
                .with_user(user, password)
                .with_auto_token_refresh(true);
        }
        let endpoints = self.endpoints.join(",");
        let connect = Client::connect(&self.endpoints, Some(options));
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(client)) => Ok(client),
            // With credentials, connecting is authenticating: etcd saying no is about them.
            Ok(Err(e)) => Err(match (&self.auth, classify("connect", &endpoints, e)) {
                (
                    Some((user, _)),
                    Error::Registry { reason, .. } | Error::RegistryAuth { reason, .. },
                ) => Error::RegistryAuth {
                    user: user.clone(),
                    endpoints,
                    reason,
                },
                (_, e) => e,
            }),
            Err(_) => Err(timed_out("connect", &endpoints, self.connect_timeout)),
        }
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("namespace", &self.namespace)
            .field("fabric", &self.fabric)
            .field("lease_ttl", &self.lease_ttl)
            .field("tls", &self.tls)
            .field(
                "auth",
                &self.auth.as_ref().map(|(user, _)| (user, "<redacted>")),
            )
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}
