//! The one mapping from engine error kinds to gRPC status codes, for the agent (which answers
//! with them) and for clients (which act on them: retry, fix the request, give up).

use tonic::Code;

/// Every engine error kind has a code here: a kind added to the engine does not compile until
/// it is given one. A failure the peer reported is judged by the kind it reported.
pub fn engine_code(e: &kvfabric_engine::Error) -> Code {
    match e {
        kvfabric_engine::Error::Remote(r) => remote_code(r),
        other => kind_code(other.kind()),
    }
}

fn kind_code(kind: kvfabric_engine::ErrorKind) -> Code {
    use kvfabric_engine::ErrorKind as K;
    match kind {
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
        // Only `Error::Remote` has this kind, and it is judged by its report above.
        K::Remote => Code::Aborted,
    }
}

/// A failure the peer reported: keys, bounds, a deadline and corrupt data stay what they are
/// (the caller's to fix or to know); the peer's own trouble fails this batch there (`Aborted`:
/// the next one may pass), and so does a code this build does not know (a newer peer's).
fn remote_code(r: &kvfabric_engine::RemoteError) -> Code {
    use kvfabric_engine::ErrorKind as K;
    let Some(kind) = r.kind() else {
        return Code::Aborted;
    };
    match kind {
        K::WrongKey | K::WrongSegmentKey => Code::PermissionDenied,
        K::UnknownRegion => Code::NotFound,
        K::OutOfBounds
        | K::ZeroLength
        | K::BatchTooLarge
        | K::RangeOverflow
        | K::OverlappingDestination
        | K::InvalidPlane
        | K::PlaneOutOfBounds
        | K::DuplicateBlock
        | K::OverlappingPlanes => Code::InvalidArgument,
        K::Timeout => Code::DeadlineExceeded,
        K::Checksum => Code::DataLoss,
        K::UnknownSegment
        | K::EmptyBatch
        | K::ProtocolVersion
        | K::AuthFailed
        | K::Frame
        | K::PeerClosed
        | K::Cancelled
        | K::TransportUnavailable
        | K::NotShareable
        | K::InvalidConfig
        | K::Remote
        | K::Io
        | K::ShuttingDown
        | K::NoCudaDriver
        | K::NoSuchDevice
        | K::Cuda
        | K::StagingNotConfigured
        | K::MixedDevices
        | K::InvalidIpcHandle
        | K::UnregisteredPointer
        | K::NoRdmaDevice
        | K::RdmaPort
        | K::BadHandshake
        | K::CreditOverrun
        | K::Verbs
        | K::RdmaFallback => Code::Aborted,
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
