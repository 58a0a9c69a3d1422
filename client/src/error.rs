use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The agent's socket could not be reached.
    #[error("local agent at {path}: {reason}")]
    Connect { path: String, reason: String },

    /// The agent answered a call with an error status: `code` says what kind (retry on
    /// `Unavailable`, fix the request on `InvalidArgument`, …), `message` the agent's words.
    /// `Unavailable` too when the agent could not be reached or its connection broke mid-call
    /// (it died or restarts): the same `Client` dials it again on the next call.
    #[error("{call} at the local agent {path}: {code:?}: {message}")]
    Rpc {
        call: &'static str,
        path: String,
        code: tonic::Code,
        message: String,
    },

    /// The agent's fd socket refused a memfd, or could not be used.
    #[error("fd socket {path}: {reason}")]
    FdSocket { path: String, reason: String },

    /// A document the agent sent could not be read.
    #[error("{what} from the local agent: {reason}")]
    Document { what: &'static str, reason: String },

    #[error("invalid {field}: {value} ({reason})")]
    Invalid {
        field: &'static str,
        value: String,
        reason: String,
    },

    #[error(transparent)]
    Engine(#[from] kvfabric_engine::Error),

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

    /// The gRPC code the agent answered with, if this error is its answer.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }
}
