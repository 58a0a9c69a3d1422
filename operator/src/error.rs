//! Errors of the operator.

use std::time::Duration;

/// Everything that can make a reconcile, the startup checks or the binary fail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A call to the Kubernetes API failed.
    #[error("Kubernetes API call {action} failed: {source}")]
    Kube {
        /// What the operator was doing, e.g. `apply DaemonSet ns/tf-prefill-agent`.
        action: String,
        /// The client error.
        #[source]
        source: Box<kube::Error>,
    },

    /// A call to the Kubernetes API did not answer in time.
    #[error("Kubernetes API call {action} timed out after {after:?}")]
    Timeout {
        /// What the operator was doing.
        action: String,
        /// The limit that was reached.
        after: Duration,
    },

    /// The finalizer helper failed (adding/removing the finalizer or the wrapped reconcile).
    #[error("finalizer {finalizer}: {source}")]
    Finalizer {
        /// Finalizer name.
        finalizer: &'static str,
        /// What went wrong.
        #[source]
        source: Box<kube::runtime::finalizer::Error<Error>>,
    },

    /// The `TransferFabric` spec cannot be turned into agents.
    #[error("invalid TransferFabric spec: {0}")]
    InvalidSpec(#[from] kvfabric_crds::Error),

    /// The object lacks metadata the operator needs.
    #[error("TransferFabric is missing {field}")]
    MissingField {
        /// The field, e.g. `metadata.namespace`.
        field: &'static str,
    },

    /// A Secret the fabric names lacks a key the operator needs.
    #[error("Secret {secret} has no key {key:?}")]
    SecretKey {
        /// `namespace/name` of the Secret.
        secret: String,
        /// The missing key.
        key: String,
    },

    /// An object the fabric would create exists and is not the fabric's: the operator never
    /// adopts it (applying would take it over, and garbage collection would later delete it
    /// with the fabric). Another fabric's child of the same name is the same case.
    #[error(
        "{kind} {name} exists and is not this fabric's ({owner}): rename or delete it, or rename the fabric"
    )]
    NotOwned {
        /// Its kind, e.g. `ServiceAccount`.
        kind: String,
        /// `namespace/name`.
        name: String,
        /// Who owns it, e.g. `owned by TransferFabric a`, or `no owner`.
        owner: String,
    },

    /// The CRD is not installed in the cluster.
    #[error(
        "CRD {crd} is not installed; install it with: helm install kvfabric charts/kvfabric -n kvfabric --create-namespace or kubectl apply -f charts/kvfabric/crds/"
    )]
    CrdNotInstalled {
        /// Full CRD name.
        crd: &'static str,
    },

    /// Cleaning the fabric's registry keys in etcd failed.
    #[error(
        "registry cleanup of prefix {prefix:?} at etcd endpoints {endpoints:?} failed: {message}"
    )]
    Registry {
        /// The etcd endpoints tried.
        endpoints: Vec<String>,
        /// The key prefix that was to be deleted.
        prefix: String,
        /// The etcd client's error text.
        message: String,
    },

    /// A command-line or environment setting is unusable.
    #[error("invalid setting {field}: {value:?} ({reason})")]
    Config {
        /// Flag name, e.g. `--metrics-addr`.
        field: &'static str,
        /// The value given.
        value: String,
        /// Why it was rejected.
        reason: String,
    },

    /// Leader election failed.
    #[error("leader election on lease {lease}: {message}")]
    Leader {
        /// `namespace/name` of the Lease.
        lease: String,
        /// What went wrong.
        message: String,
    },

    /// A local I/O operation (binding the metrics port) failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being done.
        action: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A manifest file could not be read as YAML.
    #[error("{file}: {message}")]
    Manifest {
        /// The file.
        file: String,
        /// What is wrong with it.
        message: String,
    },

    /// An object could not be converted to JSON.
    #[error("serializing {what}: {source}")]
    Serialize {
        /// What was being serialized.
        what: &'static str,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
}

impl Error {
    /// A failed Kubernetes API call while doing `action`.
    pub fn kube(action: impl Into<String>, source: kube::Error) -> Self {
        Self::Kube {
            action: action.into(),
            source: Box::new(source),
        }
    }

    /// A short, stable label for the failures metric.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Kube { source, .. } => match source.as_ref() {
                kube::Error::Api(s) if s.is_conflict() => "conflict",
                kube::Error::Api(s) if s.is_not_found() => "not_found",
                kube::Error::Api(s) if s.code >= 500 => "api_server",
                kube::Error::Api(_) => "api_client",
                _ => "transport",
            },
            Error::Timeout { .. } => "timeout",
            Error::Finalizer { .. } => "finalizer",
            Error::InvalidSpec(_) => "invalid_spec",
            Error::MissingField { .. } => "missing_field",
            Error::SecretKey { .. } => "secret_key",
            Error::CrdNotInstalled { .. } => "crd_missing",
            Error::NotOwned { .. } => "not_owned",
            Error::Registry { .. } => "registry",
            Error::Config { .. } => "config",
            Error::Leader { .. } => "leader",
            Error::Io { .. } => "io",
            Error::Manifest { .. } => "manifest",
            Error::Serialize { .. } => "serialize",
        }
    }
}

/// Result with the operator's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
