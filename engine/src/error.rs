use std::io;

use serde::{Deserialize, Serialize};

use crate::region::{Location, RegionId};
use crate::transport::TransportKind;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every way a transfer can fail. Each variant names the field and the value that was refused so
/// that a worker reading a failed batch knows which op to fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unknown region {region} ({side})")]
    UnknownRegion { region: RegionId, side: Side },

    #[error("wrong access key for region {region} ({side})")]
    WrongKey { region: RegionId, side: Side },

    #[error(
        "op {op}: {field} out of bounds: offset {offset} + len {len} > region {region} length {region_len}"
    )]
    OutOfBounds {
        op: usize,
        field: &'static str,
        region: RegionId,
        offset: u64,
        len: u64,
        region_len: u64,
    },

    #[error("op {op}: len is 0")]
    ZeroLength { op: usize },

    #[error("op {op}: {field} {offset} + len {len} passes 2^64")]
    RangeOverflow {
        op: usize,
        field: &'static str,
        offset: u64,
        len: u64,
    },

    #[error("ops {first} and {second} overlap in destination region {region} at offset {offset}")]
    OverlappingDestination {
        first: usize,
        second: usize,
        region: RegionId,
        offset: u64,
    },

    #[error("batch is empty")]
    EmptyBatch,

    #[error("batch too large: {field} = {value}, limit {limit}")]
    BatchTooLarge {
        field: &'static str,
        value: u64,
        limit: u64,
    },

    #[error("protocol version mismatch: ours {ours}, peer {theirs}")]
    ProtocolVersion { ours: u32, theirs: u32 },

    /// A data connection's handshake proof did not check out, on either side.
    #[error("{peer} failed authentication: {reason}")]
    AuthFailed { peer: String, reason: &'static str },

    #[error("wrong segment key for segment {segment:?}")]
    WrongSegmentKey { segment: String },

    #[error("unknown segment {segment:?}")]
    UnknownSegment { segment: String },

    #[error("malformed frame: {0}")]
    Frame(#[from] crate::frame::FrameError),

    #[error("checksum mismatch on op {op}: expected {expected:#010x}, computed {computed:#010x}")]
    Checksum {
        op: usize,
        expected: u32,
        computed: u32,
    },

    #[error("peer {peer} closed the connection mid-batch")]
    PeerClosed { peer: String },

    #[error("batch {batch} timed out after {millis} ms")]
    Timeout { batch: u64, millis: u64 },

    #[error("batch {batch} cancelled")]
    Cancelled { batch: u64 },

    #[error("transport {transport} unavailable for segment {segment:?}: {reason}")]
    TransportUnavailable {
        transport: TransportKind,
        segment: String,
        reason: String,
    },

    #[error("region {region} is not shareable over shm: {reason}")]
    NotShareable { region: RegionId, reason: String },

    #[error("invalid {field}: {value:?} ({reason})")]
    InvalidConfig {
        field: &'static str,
        value: String,
        reason: &'static str,
    },

    #[error("peer refused: {0}")]
    Remote(RemoteError),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },

    #[error("engine is shutting down")]
    ShuttingDown,

    #[error("no CUDA driver: {reason}")]
    NoCudaDriver { reason: String },

    #[error("no CUDA device {device}: this machine has {count}")]
    NoSuchDevice { device: u32, count: u32 },

    #[error("{call} failed: {code}")]
    Cuda { call: &'static str, code: String },

    #[error(
        "op {op}: region {region} is {location} memory, which transport {transport} can only reach \
         through pinned host staging buffers, and none are configured"
    )]
    StagingNotConfigured {
        op: usize,
        region: RegionId,
        location: Location,
        transport: TransportKind,
    },

    #[error("op {op}: local region {region} is on {location}, but this batch started on {first}")]
    MixedDevices {
        op: usize,
        region: RegionId,
        location: Location,
        first: Location,
    },

    #[error("invalid CUDA IPC handle for region {region}: {reason}")]
    InvalidIpcHandle { region: RegionId, reason: String },

    #[error("no registered region holds {location} pointer {ptr:#x} + len {len}")]
    UnregisteredPointer {
        location: Location,
        ptr: u64,
        len: u64,
    },

    #[error("no usable RDMA device: {reason}")]
    NoRdmaDevice { reason: String },

    #[error("rdma device {device} port {port}: {reason}")]
    RdmaPort {
        device: String,
        port: u32,
        reason: String,
    },

    #[error("invalid rdma handshake from {peer}: {field} = {value} ({reason})")]
    BadHandshake {
        peer: String,
        field: &'static str,
        value: String,
        reason: &'static str,
    },

    #[error("send queue of {qp}: {field} = {value} would exceed depth {depth}")]
    CreditOverrun {
        qp: String,
        field: &'static str,
        value: u64,
        depth: u32,
    },

    #[error("{call} failed on {device}: {reason}")]
    Verbs {
        call: &'static str,
        device: String,
        reason: String,
    },

    /// RDMA to `peer` was given up (too many failed retries or QP rebuilds); the reason says
    /// why and that tcp is to be used instead.
    #[error("{reason}")]
    RdmaFallback { peer: String, reason: String },
}

/// `s` cut to at most `max` bytes (on a character boundary), marked when cut: values a peer
/// sent are echoed in errors and logs no longer than this.
pub(crate) fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Which side of a block op a region belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    Local,
    Remote,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// An error as it travels on the wire: a stable code plus the human message of the peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// A short, stable name for the kind of error (wire code, metrics label).
    pub fn code(&self) -> &'static str {
        match self {
            Error::UnknownRegion { .. } => "unknown_region",
            Error::WrongKey { .. } => "wrong_key",
            Error::OutOfBounds { .. } => "out_of_bounds",
            Error::ZeroLength { .. } => "zero_length",
            Error::RangeOverflow { .. } => "range_overflow",
            Error::OverlappingDestination { .. } => "overlapping_destination",
            Error::EmptyBatch => "empty_batch",
            Error::BatchTooLarge { .. } => "batch_too_large",
            Error::ProtocolVersion { .. } => "protocol_version",
            Error::AuthFailed { .. } => crate::handshake::UNAUTHENTICATED,
            Error::WrongSegmentKey { .. } => "wrong_segment_key",
            Error::UnknownSegment { .. } => "unknown_segment",
            Error::Frame(_) => "malformed_frame",
            Error::Checksum { .. } => "checksum",
            Error::PeerClosed { .. } => "peer_closed",
            Error::Timeout { .. } => "timeout",
            Error::Cancelled { .. } => "cancelled",
            Error::TransportUnavailable { .. } => "transport_unavailable",
            Error::NotShareable { .. } => "not_shareable",
            Error::InvalidConfig { .. } => "invalid_config",
            Error::Remote(_) => "remote",
            Error::Io { .. } => "io",
            Error::ShuttingDown => "shutting_down",
            Error::NoCudaDriver { .. } => "no_cuda_driver",
            Error::NoSuchDevice { .. } => "no_such_device",
            Error::Cuda { .. } => "cuda",
            Error::StagingNotConfigured { .. } => "staging_not_configured",
            Error::MixedDevices { .. } => "mixed_devices",
            Error::InvalidIpcHandle { .. } => "invalid_ipc_handle",
            Error::UnregisteredPointer { .. } => "unregistered_pointer",
            Error::NoRdmaDevice { .. } => "no_rdma_device",
            Error::RdmaPort { .. } => "rdma_port",
            Error::BadHandshake { .. } => "bad_handshake",
            Error::CreditOverrun { .. } => "credit_overrun",
            Error::Verbs { .. } => "verbs",
            Error::RdmaFallback { .. } => "rdma_fallback",
        }
    }

    pub(crate) fn to_remote(&self) -> RemoteError {
        match self {
            Error::Remote(r) => r.clone(),
            other => RemoteError {
                code: other.code().to_string(),
                message: other.to_string(),
            },
        }
    }

    /// An I/O wait that ran out (a socket timeout).
    pub(crate) fn timed_out(&self) -> bool {
        matches!(self, Error::Io { source, .. }
            if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }

    /// A copy for fanning one failure out to several waiters (io::Error is not Clone).
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::PeerClosed { peer } => Error::PeerClosed { peer: peer.clone() },
            Error::Timeout { batch, millis } => Error::Timeout {
                batch: *batch,
                millis: *millis,
            },
            Error::Cancelled { batch } => Error::Cancelled { batch: *batch },
            Error::ShuttingDown => Error::ShuttingDown,
            Error::RdmaFallback { peer, reason } => Error::RdmaFallback {
                peer: peer.clone(),
                reason: reason.clone(),
            },
            Error::NoRdmaDevice { reason } => Error::NoRdmaDevice {
                reason: reason.clone(),
            },
            Error::Frame(e) => Error::Frame(e.clone()),
            Error::Checksum {
                op,
                expected,
                computed,
            } => Error::Checksum {
                op: *op,
                expected: *expected,
                computed: *computed,
            },
            other => Error::Remote(other.to_remote()),
        }
    }
}
