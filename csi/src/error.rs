//! One error for the driver; each kind becomes the gRPC code the CSI spec names for it.

use rustix::io::Errno;

/// What went wrong, by kind.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field the driver cannot serve; `field` names it as the CSI spec does.
    #[error("{field} {value:?}: {reason}")]
    Invalid {
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    /// The volume id is published already, at another target or from another directory.
    #[error("volume {volume_id:?} is published at {target} already")]
    Conflict { volume_id: String, target: String },
    /// The node holds as many volumes as the driver allows (`--max-volumes`).
    #[error("{published} volumes are published on this node, the most allowed (--max-volumes)")]
    Exhausted { published: usize },
    /// A file system call failed.
    #[error("{action}: {source}")]
    Io {
        action: String,
        #[source]
        source: std::io::Error,
    },
    /// A mount or unmount failed.
    #[error("{action}: {source}")]
    Mount {
        action: String,
        #[source]
        source: Errno,
    },
    /// The kubelet refused the registration.
    #[error("the kubelet did not register the driver: {0}")]
    NotRegistered(String),
    /// A setting of the command line or environment.
    #[error("{field} {value:?}: {reason}")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// A socket could not be served.
    #[error("serve {socket}: {source}")]
    Serve {
        socket: String,
        #[source]
        source: tonic::transport::Error,
    },
}

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(field: &'static str, value: &str, reason: &'static str) -> Self {
        Error::Invalid {
            field,
            // The kubelet logs it, and a pod chose most of the values: cut as every echo is.
            value: kvfabric_proto::limits::echo(value),
            reason,
        }
    }

    pub(crate) fn io(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let action = action.into();
        move |source| Error::Io { action, source }
    }

    pub(crate) fn mount(action: impl Into<String>) -> impl FnOnce(Errno) -> Error {
        let action = action.into();
        move |source| Error::Mount { action, source }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Invalid { .. } | Error::Config { .. } => tonic::Code::InvalidArgument,
            Error::Conflict { .. } => tonic::Code::AlreadyExists,
            Error::Exhausted { .. } => tonic::Code::ResourceExhausted,
            Error::Io { .. }
            | Error::Mount { .. }
            | Error::NotRegistered(_)
            | Error::Serve { .. } => tonic::Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_values_are_cut_and_codes_follow_the_kind() {
        let e = Error::invalid("volume_context[fabric]", &"x".repeat(1000), "bad");
        let shown = e.to_string();
        assert!(shown.len() < 200 && shown.contains('…'), "{shown}");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
        let s = tonic::Status::from(Error::Exhausted { published: 3 });
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
    }
}
