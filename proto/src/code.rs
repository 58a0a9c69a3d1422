//! The one mapping from engine error kinds to gRPC status codes, for the agent (which answers
//! with them) and for clients (which act on them: retry, fix the request, give up).

use tonic::Code;

/// The gRPC code of an engine error.
pub fn engine_code(e: &kvfabric_engine::Error) -> Code {
    match e.code() {
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
        "peer_closed" | "io" | "shutting_down" | "transport_unavailable" | "rdma_fallback" => {
            Code::Unavailable
        }
        "no_cuda_driver"
        | "no_rdma_device"
        | "no_such_device"
        | "not_shareable"
        | "staging_not_configured" => Code::FailedPrecondition,
        "remote" => remote_code(e),
        _ => Code::Internal,
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
