//! How agent errors become gRPC statuses.

use tonic::{Code, Status};

use crate::error::Error;

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        // Every variant named: a new one does not compile until it has a code.
        let code = match &e {
            Error::UnknownSegment { .. }
            | Error::UnknownAgent { .. }
            | Error::SegmentElsewhere { .. }
            | Error::NoSuchHold { .. } => Code::NotFound,
            Error::SegmentExists { .. } => Code::AlreadyExists,
            Error::Exhausted { .. } => Code::ResourceExhausted,
            Error::WrongKey { .. } | Error::HoldEnded { .. } | Error::OutsideHold { .. } => {
                Code::PermissionDenied
            }
            Error::InvalidRequest { .. } | Error::Config { .. } | Error::Http2(_) => {
                Code::InvalidArgument
            }
            Error::PeerAgent { .. }
            | Error::Registry { .. }
            | Error::RegistryCompacted { .. }
            | Error::RegistryUnavailable { .. } => Code::Unavailable,
            // etcd refuses this agent's credentials: nothing a caller's retry changes.
            Error::RegistryAuth { .. } => Code::FailedPrecondition,
            Error::Deadline { .. } | Error::HoldUnconfirmed { .. } => Code::DeadlineExceeded,
            Error::Engine(engine) => kvfabric_proto::code::engine_code(engine),
            Error::Io { .. } => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(e: Error) -> Code {
        Status::from(e).code()
    }

    #[test]
    fn errors_that_fell_through_to_internal_have_their_own_codes() {
        // Deleting a segment this agent never put is the caller's NotFound, as a lookup is.
        assert_eq!(
            code(Error::UnknownSegment { name: "s".into() }),
            Code::NotFound
        );
        assert_eq!(
            code(Error::RegistryAuth {
                user: "u".into(),
                endpoints: "e".into(),
                reason: "r".into()
            }),
            Code::FailedPrecondition
        );
        assert_eq!(
            code(Error::io("read", std::io::Error::other("x"))),
            Code::Internal
        );
    }
}
