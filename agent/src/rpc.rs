//! Generated gRPC types, and how agent errors become gRPC statuses (and back, in the client).

use tonic::{Code, Status};

use crate::error::Error;

#[allow(clippy::all, missing_debug_implementations)]
pub mod pb {
    tonic::include_proto!("kvfabric.v1");
}

/// Largest message either API accepts (a batch of 65 536 ops is about 2 MiB).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let code = match &e {
            Error::NoSuchSegment { .. } | Error::UnknownAgent { .. } => Code::NotFound,
            Error::SegmentExists { .. } => Code::AlreadyExists,
            Error::WrongKey { .. } => Code::PermissionDenied,
            Error::InvalidRequest { .. } | Error::Config { .. } => Code::InvalidArgument,
            Error::PeerAgent { .. }
            | Error::Registry { .. }
            | Error::RegistryUnavailable { .. }
            | Error::LocalAgent { .. } => Code::Unavailable,
            Error::Engine(engine) => engine_code(engine),
            _ => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}

/// Every engine error kind has a code here: a kind added to the engine does not compile until
/// it is given one.
fn engine_code(e: &kvfabric_engine::Error) -> Code {
    use kvfabric_engine::ErrorKind as K;
    match e.kind() {
        K::WrongKey | K::WrongSegmentKey => Code::PermissionDenied,
        K::UnknownRegion | K::UnknownSegment => Code::NotFound,
        K::OutOfBounds
        | K::ZeroLength
        | K::RangeOverflow
        | K::OverlappingDestination
        | K::EmptyBatch
        | K::BatchTooLarge
        | K::InvalidConfig
        | K::InvalidIpcHandle
        | K::UnregisteredPointer
        | K::MixedDevices
        | K::BadHandshake => Code::InvalidArgument,
        K::Timeout => Code::DeadlineExceeded,
        K::Cancelled => Code::Cancelled,
        K::Checksum => Code::DataLoss,
        // The peer (or what answered as it) cannot be used: the link is dropped and re-dialed.
        K::PeerClosed
        | K::Io
        | K::ShuttingDown
        | K::TransportUnavailable
        | K::RdmaFallback
        | K::AuthFailed
        | K::Frame
        | K::RdmaPort
        | K::Verbs => Code::Unavailable,
        K::ProtocolVersion
        | K::NoCudaDriver
        | K::NoRdmaDevice
        | K::NoSuchDevice
        | K::NotShareable
        | K::StagingNotConfigured => Code::FailedPrecondition,
        K::Cuda | K::CreditOverrun => Code::Internal,
        K::Remote => remote_code(e),
    }
}

/// A failure the peer reported carries its own code; keys and bounds stay the caller's fault.
fn remote_code(e: &kvfabric_engine::Error) -> Code {
    use kvfabric_engine::ErrorKind as K;
    let kvfabric_engine::Error::Remote(r) = e else {
        return Code::Aborted;
    };
    match r.kind() {
        Some(K::WrongKey | K::WrongSegmentKey) => Code::PermissionDenied,
        Some(K::UnknownRegion) => Code::NotFound,
        Some(
            K::OutOfBounds
            | K::ZeroLength
            | K::BatchTooLarge
            | K::RangeOverflow
            | K::OverlappingDestination,
        ) => Code::InvalidArgument,
        Some(K::Timeout) => Code::DeadlineExceeded,
        Some(K::Checksum) => Code::DataLoss,
        _ => Code::Aborted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(e: kvfabric_engine::Error) -> Code {
        Status::from(Error::Engine(e)).code()
    }

    #[test]
    fn engine_kinds_that_fell_through_to_internal_get_their_own_codes() {
        use kvfabric_engine::Error as E;
        let checksum = E::Checksum {
            op: 0,
            expected: 1,
            computed: 2,
        };
        assert_eq!(
            code(E::ProtocolVersion { ours: 2, theirs: 1 }),
            Code::FailedPrecondition
        );
        let frame = kvfabric_engine::frame::FrameError::TagMismatch {
            expected: 1,
            found: 2,
        };
        assert_eq!(code(E::Frame(frame)), Code::Unavailable);
        assert_eq!(
            code(E::Remote(kvfabric_engine::RemoteError {
                code: "checksum".into(),
                message: String::new(),
            })),
            Code::DataLoss
        );
        assert_eq!(code(checksum), Code::DataLoss);
    }
}
