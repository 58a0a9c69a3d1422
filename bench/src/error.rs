use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {field}: {value:?} ({reason})")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },

    #[error("bench control channel with {peer}: {reason}")]
    Control { peer: String, reason: String },

    /// A pool held something else than what it must after the row: a wrong byte where the
    /// row wrote, or a stray write where it did not.
    #[error("verification failed for {row}: {pool}: {mismatches} bad: {bad}")]
    Verify {
        row: String,
        pool: String,
        /// Bad blocks (host pools) or 8-byte words (GPU pools).
        mismatches: u64,
        /// The first few bad places, each naming its block.
        bad: String,
    },

    /// The registry bench saw something else than it put.
    #[error("registry bench against {endpoint}: {what}: {reason}")]
    Registry {
        what: String,
        endpoint: String,
        reason: String,
    },

    #[error(transparent)]
    Engine(#[from] kvfabric_engine::Error),

    #[error(transparent)]
    Agent(#[from] kvfabric_agent::Error),

    #[error(transparent)]
    Client(#[from] kvfabric_client::Error),

    #[error(transparent)]
    Testkit(#[from] kvfabric_testkit::Error),

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

    pub fn config(field: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        Error::Config {
            field,
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// Bad flags exit 64 (EX_USAGE); everything else is a failure of the run.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Config { .. } | Error::Engine(kvfabric_engine::Error::InvalidConfig { .. }) => {
                64
            }
            Error::Agent(e) => e.exit_code(),
            _ => 1,
        }
    }
}
