use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The `etcd` binary was not found: the one reason a test that needs etcd may skip.
    #[error("etcd not found: apt-get install etcd-server (looked for {looked})")]
    EtcdNotFound { looked: String },

    /// The `openssl` command, which makes the certificates of a TLS etcd, was not found.
    #[error("openssl not found: apt-get install openssl ({source})")]
    OpensslNotFound {
        #[source]
        source: io::Error,
    },

    /// etcd was found but did not come up: a failure, never a skip.
    #[error("etcd at {endpoint} did not start: {reason} (log: {log})")]
    EtcdStart {
        endpoint: String,
        reason: String,
        log: String,
    },

    #[error("etcd at {endpoint}: {reason}")]
    Etcd { endpoint: String, reason: String },

    #[cfg(feature = "agent")]
    #[error(transparent)]
    Agent(#[from] kvfabric_agent::Error),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
