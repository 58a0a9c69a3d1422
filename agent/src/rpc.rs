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
            Error::Engine(engine) => match engine.code() {
                "wrong_key" | "wrong_segment_key" => Code::PermissionDenied,
                "unknown_region" | "unknown_segment" => Code::NotFound,
                "out_of_bounds"
                | "zero_length"
                | "overlapping_destination"
                | "empty_batch"
                | "batch_too_large"
                | "invalid_config"
                | "invalid_ipc_handle"
                | "unregistered_pointer"
                | "mixed_devices"
                | "bad_handshake" => Code::InvalidArgument,
                "timeout" => Code::DeadlineExceeded,
                "cancelled" => Code::Cancelled,
                "peer_closed"
                | "io"
                | "shutting_down"
                | "transport_unavailable"
                | "rdma_fallback" => Code::Unavailable,
                "no_cuda_driver"
                | "no_rdma_device"
                | "no_such_device"
                | "not_shareable"
                | "staging_not_configured" => Code::FailedPrecondition,
                "remote" => remote_code(engine),
                _ => Code::Internal,
            },
            _ => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}

/// A failure the peer reported carries its own code; keys and bounds stay the caller's fault.
fn remote_code(e: &kvfabric_engine::Error) -> Code {
    match e {
        kvfabric_engine::Error::Remote(r) => match r.code.as_str() {
            "wrong_key" | "wrong_segment_key" => Code::PermissionDenied,
            "unknown_region" => Code::NotFound,
            "out_of_bounds" | "zero_length" | "batch_too_large" => Code::InvalidArgument,
            "timeout" => Code::DeadlineExceeded,
            _ => Code::Aborted,
        },
        _ => Code::Aborted,
    }
}
