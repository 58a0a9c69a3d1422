use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Engine(#[from] kvfabric_engine::Error),

    #[error("invalid {field}: {value:?} ({reason})")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },

    #[error("bench control channel with {peer}: {reason}")]
    Control { peer: String, reason: String },

    #[error("verification failed for {row}: {mismatches} bad blocks, first: {first}")]
    Verify {
        row: String,
        mismatches: u64,
        first: String,
    },

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

    /// Bad configuration exits 64 (EX_USAGE); everything else is a runtime failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config { .. } | Error::Engine(kvfabric_engine::Error::InvalidConfig { .. }) => {
                64
            }
            _ => 1,
        }
    }
}
