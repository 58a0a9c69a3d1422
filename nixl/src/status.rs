//! NIXL's status codes, and what each of this crate's errors is to NIXL.

use tonic::Code;

/// `nixl_status_t`.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    InProgress = 1,
    Success = 0,
    NotPosted = -1,
    InvalidParam = -2,
    Backend = -3,
    NotFound = -4,
    Mismatch = -5,
    NotAllowed = -6,
    RepostActive = -7,
    Unknown = -8,
    NotSupported = -9,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },

    #[error("descriptor {index}: {reason}")]
    Mismatch { index: usize, reason: String },

    #[error("{what} is not supported by the KVFABRIC backend yet")]
    NotSupported { what: String },

    #[error("no connection info of NIXL agent {agent:?} was loaded (its metadata first)")]
    UnknownPeer { agent: String },

    #[error("the transfer is still running")]
    Running,

    /// The agent's answer (its message names the call).
    #[error(transparent)]
    Agent(#[from] kvfabric_client::Error),

    #[error("{context}: no answer from the agent within {seconds} s")]
    Late { context: &'static str, seconds: u64 },

    /// GPU memory this process could not export (no driver, not device memory, ...).
    #[error("GPU memory: {0}")]
    Cuda(kvfabric_engine::Error),
}

impl Error {
    pub fn status(&self) -> Status {
        match self {
            Error::Invalid { .. } => Status::InvalidParam,
            Error::Mismatch { .. } => Status::Mismatch,
            Error::NotSupported { .. } => Status::NotSupported,
            Error::UnknownPeer { .. } => Status::NotFound,
            Error::Running => Status::RepostActive,
            Error::Late { .. } => Status::Backend,
            Error::Cuda(e) => match e.kind() {
                kvfabric_engine::ErrorKind::InvalidConfig => Status::InvalidParam,
                _ => Status::Backend,
            },
            Error::Agent(source) => match source.code() {
                Some(Code::NotFound) => Status::NotFound,
                Some(Code::PermissionDenied | Code::Unauthenticated) => Status::NotAllowed,
                Some(Code::InvalidArgument | Code::OutOfRange) => Status::InvalidParam,
                _ => Status::Backend,
            },
        }
    }
}
