//! The one mapping from engine error kinds to gRPC status codes, for the agent (which answers
//! with them) and for clients (which act on them: retry, fix the request, give up).

use tonic::Code;

/// Every engine error kind has a code here: a kind added to the engine does not compile until
/// it is given one.
pub fn engine_code(e: &kvfabric_engine::Error) -> Code {
    use kvfabric_engine::ErrorKind as K;
    match e.kind() {
        K::WrongKey | K::WrongSegmentKey => Code::PermissionDenied,
        K::UnknownRegion | K::UnknownSegment => Code::NotFound,
        K::OutOfBounds
        | K::ZeroLength
        | K::RangeOverflow
        | K::OverlappingDestination
        | K::EmptyBatch
        | K::InvalidPlane
        | K::PlaneOutOfBounds
        | K::DuplicateBlock
        | K::OverlappingPlanes
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
            | K::OverlappingDestination
            | K::InvalidPlane
            | K::PlaneOutOfBounds
            | K::DuplicateBlock
            | K::OverlappingPlanes,
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
        engine_code(&e)
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
