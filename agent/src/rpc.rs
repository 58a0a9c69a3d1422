//! How agent errors become gRPC statuses.

use tonic::{Code, Status};

use crate::error::Error;

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let code = match &e {
            Error::NoSuchSegment { .. }
            | Error::UnknownAgent { .. }
            | Error::SegmentElsewhere { .. }
            | Error::NoSuchHold { .. } => Code::NotFound,
            Error::SegmentExists { .. } => Code::AlreadyExists,
            Error::Exhausted { .. } => Code::ResourceExhausted,
            Error::WrongKey { .. } | Error::HoldEnded { .. } | Error::OutsideHold { .. } => {
                Code::PermissionDenied
            }
            Error::InvalidRequest { .. } | Error::Config { .. } => Code::InvalidArgument,
            Error::PeerAgent { .. }
            | Error::Registry { .. }
            | Error::RegistryCompacted { .. }
            | Error::RegistryUnavailable { .. } => Code::Unavailable,
            Error::Deadline { .. } | Error::HoldUnconfirmed { .. } => Code::DeadlineExceeded,
            Error::Engine(engine) => kvfabric_proto::code::engine_code(engine),
            _ => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
