use std::io;

use serde::{Deserialize, Serialize};

use crate::frame_error::FrameError;
use crate::location::Location;
pub(crate) use crate::parse_error::{ParseError, truncated};
use crate::region_id::RegionId;
use crate::transport_kind::TransportKind;

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

    /// A block-table plane that cannot be used as given (`field` names the part of it).
    #[error("plane {plane}: {field} = {value}: {reason}")]
    InvalidPlane {
        plane: usize,
        field: &'static str,
        value: u64,
        reason: &'static str,
    },

    #[error(
        "plane {plane}: {side} block {block} at offset {offset} + len {len} > region {region} length {region_len}"
    )]
    PlaneOutOfBounds {
        plane: usize,
        side: Side,
        region: RegionId,
        block: u32,
        offset: u64,
        len: u64,
        region_len: u64,
    },

    #[error("blocks {first} and {second} of the table both write {side} block {block}")]
    DuplicateBlock {
        first: usize,
        second: usize,
        side: Side,
        block: u32,
    },

    #[error("planes {first} and {second} may write the same bytes of destination region {region}")]
    OverlappingPlanes {
        first: usize,
        second: usize,
        region: RegionId,
    },

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
    Frame(#[from] FrameError),

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

impl From<ParseError> for Error {
    fn from(e: ParseError) -> Error {
        Error::InvalidConfig {
            field: e.field,
            value: e.value,
            reason: e.expected,
        }
    }
}

/// The kind of an [`Error`], one per variant, for callers that act on kinds (a gRPC status, a
/// retry policy, a metrics label). Exhaustive on purpose: a new kind is a compile error in every
/// `match` that has not decided what to do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    UnknownRegion,
    WrongKey,
    OutOfBounds,
    ZeroLength,
    RangeOverflow,
    OverlappingDestination,
    EmptyBatch,
    InvalidPlane,
    PlaneOutOfBounds,
    DuplicateBlock,
    OverlappingPlanes,
    BatchTooLarge,
    ProtocolVersion,
    AuthFailed,
    WrongSegmentKey,
    UnknownSegment,
    Frame,
    Checksum,
    PeerClosed,
    Timeout,
    Cancelled,
    TransportUnavailable,
    NotShareable,
    InvalidConfig,
    Remote,
    Io,
    ShuttingDown,
    NoCudaDriver,
    NoSuchDevice,
    Cuda,
    StagingNotConfigured,
    MixedDevices,
    InvalidIpcHandle,
    UnregisteredPointer,
    NoRdmaDevice,
    RdmaPort,
    BadHandshake,
    CreditOverrun,
    Verbs,
    RdmaFallback,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 40] = [
        ErrorKind::UnknownRegion,
        ErrorKind::WrongKey,
        ErrorKind::OutOfBounds,
        ErrorKind::ZeroLength,
        ErrorKind::RangeOverflow,
        ErrorKind::OverlappingDestination,
        ErrorKind::EmptyBatch,
        ErrorKind::InvalidPlane,
        ErrorKind::PlaneOutOfBounds,
        ErrorKind::DuplicateBlock,
        ErrorKind::OverlappingPlanes,
        ErrorKind::BatchTooLarge,
        ErrorKind::ProtocolVersion,
        ErrorKind::AuthFailed,
        ErrorKind::WrongSegmentKey,
        ErrorKind::UnknownSegment,
        ErrorKind::Frame,
        ErrorKind::Checksum,
        ErrorKind::PeerClosed,
        ErrorKind::Timeout,
        ErrorKind::Cancelled,
        ErrorKind::TransportUnavailable,
        ErrorKind::NotShareable,
        ErrorKind::InvalidConfig,
        ErrorKind::Remote,
        ErrorKind::Io,
        ErrorKind::ShuttingDown,
        ErrorKind::NoCudaDriver,
        ErrorKind::NoSuchDevice,
        ErrorKind::Cuda,
        ErrorKind::StagingNotConfigured,
        ErrorKind::MixedDevices,
        ErrorKind::InvalidIpcHandle,
        ErrorKind::UnregisteredPointer,
        ErrorKind::NoRdmaDevice,
        ErrorKind::RdmaPort,
        ErrorKind::BadHandshake,
        ErrorKind::CreditOverrun,
        ErrorKind::Verbs,
        ErrorKind::RdmaFallback,
    ];

    /// A short, stable name (the wire code, a metrics label).
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::UnknownRegion => "unknown_region",
            ErrorKind::WrongKey => "wrong_key",
            ErrorKind::OutOfBounds => "out_of_bounds",
            ErrorKind::ZeroLength => "zero_length",
            ErrorKind::RangeOverflow => "range_overflow",
            ErrorKind::OverlappingDestination => "overlapping_destination",
            ErrorKind::EmptyBatch => "empty_batch",
            ErrorKind::InvalidPlane => "invalid_plane",
            ErrorKind::PlaneOutOfBounds => "plane_out_of_bounds",
            ErrorKind::DuplicateBlock => "duplicate_block",
            ErrorKind::OverlappingPlanes => "overlapping_planes",
            ErrorKind::BatchTooLarge => "batch_too_large",
            ErrorKind::ProtocolVersion => "protocol_version",
            ErrorKind::AuthFailed => "unauthenticated",
            ErrorKind::WrongSegmentKey => "wrong_segment_key",
            ErrorKind::UnknownSegment => "unknown_segment",
            ErrorKind::Frame => "malformed_frame",
            ErrorKind::Checksum => "checksum",
            ErrorKind::PeerClosed => "peer_closed",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::TransportUnavailable => "transport_unavailable",
            ErrorKind::NotShareable => "not_shareable",
            ErrorKind::InvalidConfig => "invalid_config",
            ErrorKind::Remote => "remote",
            ErrorKind::Io => "io",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::NoCudaDriver => "no_cuda_driver",
            ErrorKind::NoSuchDevice => "no_such_device",
            ErrorKind::Cuda => "cuda",
            ErrorKind::StagingNotConfigured => "staging_not_configured",
            ErrorKind::MixedDevices => "mixed_devices",
            ErrorKind::InvalidIpcHandle => "invalid_ipc_handle",
            ErrorKind::UnregisteredPointer => "unregistered_pointer",
            ErrorKind::NoRdmaDevice => "no_rdma_device",
            ErrorKind::RdmaPort => "rdma_port",
            ErrorKind::BadHandshake => "bad_handshake",
            ErrorKind::CreditOverrun => "credit_overrun",
            ErrorKind::Verbs => "verbs",
            ErrorKind::RdmaFallback => "rdma_fallback",
        }
    }

    /// The kind a wire code names (what a peer's refusal says it was).
    pub fn from_code(code: &str) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.code() == code)
    }
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

impl RemoteError {
    /// The kind the peer reported, if its code names one this engine knows.
    pub fn kind(&self) -> Option<ErrorKind> {
        ErrorKind::from_code(&self.code)
    }
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

    /// The kind of error: every variant is one.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::UnknownRegion { .. } => ErrorKind::UnknownRegion,
            Error::WrongKey { .. } => ErrorKind::WrongKey,
            Error::OutOfBounds { .. } => ErrorKind::OutOfBounds,
            Error::ZeroLength { .. } => ErrorKind::ZeroLength,
            Error::RangeOverflow { .. } => ErrorKind::RangeOverflow,
            Error::OverlappingDestination { .. } => ErrorKind::OverlappingDestination,
            Error::EmptyBatch => ErrorKind::EmptyBatch,
            Error::InvalidPlane { .. } => ErrorKind::InvalidPlane,
            Error::PlaneOutOfBounds { .. } => ErrorKind::PlaneOutOfBounds,
            Error::DuplicateBlock { .. } => ErrorKind::DuplicateBlock,
            Error::OverlappingPlanes { .. } => ErrorKind::OverlappingPlanes,
            Error::BatchTooLarge { .. } => ErrorKind::BatchTooLarge,
            Error::ProtocolVersion { .. } => ErrorKind::ProtocolVersion,
            Error::AuthFailed { .. } => ErrorKind::AuthFailed,
            Error::WrongSegmentKey { .. } => ErrorKind::WrongSegmentKey,
            Error::UnknownSegment { .. } => ErrorKind::UnknownSegment,
            Error::Frame(_) => ErrorKind::Frame,
            Error::Checksum { .. } => ErrorKind::Checksum,
            Error::PeerClosed { .. } => ErrorKind::PeerClosed,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Cancelled { .. } => ErrorKind::Cancelled,
            Error::TransportUnavailable { .. } => ErrorKind::TransportUnavailable,
            Error::NotShareable { .. } => ErrorKind::NotShareable,
            Error::InvalidConfig { .. } => ErrorKind::InvalidConfig,
            Error::Remote(_) => ErrorKind::Remote,
            Error::Io { .. } => ErrorKind::Io,
            Error::ShuttingDown => ErrorKind::ShuttingDown,
            Error::NoCudaDriver { .. } => ErrorKind::NoCudaDriver,
            Error::NoSuchDevice { .. } => ErrorKind::NoSuchDevice,
            Error::Cuda { .. } => ErrorKind::Cuda,
            Error::StagingNotConfigured { .. } => ErrorKind::StagingNotConfigured,
            Error::MixedDevices { .. } => ErrorKind::MixedDevices,
            Error::InvalidIpcHandle { .. } => ErrorKind::InvalidIpcHandle,
            Error::UnregisteredPointer { .. } => ErrorKind::UnregisteredPointer,
            Error::NoRdmaDevice { .. } => ErrorKind::NoRdmaDevice,
            Error::RdmaPort { .. } => ErrorKind::RdmaPort,
            Error::BadHandshake { .. } => ErrorKind::BadHandshake,
            Error::CreditOverrun { .. } => ErrorKind::CreditOverrun,
            Error::Verbs { .. } => ErrorKind::Verbs,
            Error::RdmaFallback { .. } => ErrorKind::RdmaFallback,
        }
    }

    /// A short, stable name for the kind of error (wire code, metrics label).
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }

    /// Whether the connection that carried the batch can no longer be trusted with the next
    /// one: the peer went, the socket failed or timed out, a frame did not parse, or the engine
    /// is stopping.
    pub fn breaks_connection(&self) -> bool {
        matches!(
            self.kind(),
            ErrorKind::PeerClosed
                | ErrorKind::Timeout
                | ErrorKind::Io
                | ErrorKind::Frame
                | ErrorKind::ShuttingDown
        )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_peer_or_socket_breaks_the_connection_a_refusal_does_not() {
        let lost = [
            Error::PeerClosed { peer: "p".into() },
            Error::Timeout {
                batch: 1,
                millis: 5,
            },
            Error::ShuttingDown,
            Error::Io {
                context: "read".into(),
                source: io::Error::from(io::ErrorKind::ConnectionReset),
            },
        ];
        for e in &lost {
            assert!(e.breaks_connection(), "{e}");
        }
        // The peer answered: the connection carried its refusal and carries the next batch.
        let refusal = Error::Remote(RemoteError {
            code: "io".into(),
            message: "the peer's disk".into(),
        });
        assert!(!refusal.breaks_connection());
        assert!(!Error::EmptyBatch.breaks_connection());
        assert!(
            !Error::RdmaFallback {
                peer: "p".into(),
                reason: "no route".into()
            }
            .breaks_connection()
        );
    }

    #[test]
    fn every_kind_has_its_own_code_and_codes_name_their_kinds() {
        let mut codes: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.code()).collect();
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_code(k.code()), Some(k));
        }
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), ErrorKind::ALL.len());
        assert_eq!(ErrorKind::from_code("no_such_code"), None);
        let e = Error::Checksum {
            op: 1,
            expected: 2,
            computed: 3,
        };
        assert_eq!((e.kind(), e.code()), (ErrorKind::Checksum, "checksum"));
        assert_eq!(e.to_remote().kind(), Some(ErrorKind::Checksum));
        assert_eq!(
            Error::from(ParseError {
                field: "op",
                value: "x".into(),
                expected: "expected read or write",
            })
            .kind(),
            ErrorKind::InvalidConfig
        );
    }

    /// The leaf nouns and the error type import only leaves: no module above them is reachable
    /// from below, so there is no import circle through the error type.
    #[test]
    fn the_error_type_and_the_leaf_nouns_import_only_leaves() {
        let leaves = [
            ("location", include_str!("location.rs")),
            ("region_id", include_str!("region_id.rs")),
            ("transport_kind", include_str!("transport_kind.rs")),
            ("opcode", include_str!("opcode.rs")),
            ("parse_error", include_str!("parse_error.rs")),
            ("frame_error", include_str!("frame_error.rs")),
        ];
        let names: Vec<&str> = leaves.iter().map(|l| l.0).collect();
        for (name, src) in leaves
            .iter()
            .copied()
            .chain([("error", include_str!("error.rs"))])
        {
            for line in src.lines().map(str::trim_start) {
                let Some(path) = line
                    .strip_prefix("use crate::")
                    .or_else(|| line.strip_prefix("pub use crate::"))
                    .or_else(|| line.strip_prefix("pub(crate) use crate::"))
                else {
                    continue;
                };
                let module = path.split([':', ';']).next().unwrap();
                assert!(names.contains(&module), "{name}.rs imports {line}");
            }
            // Paths written out in code, not only in `use` lines.
            for above in ["handshake", "engine", "transport::", "region::", "frame::"] {
                let path = format!("crate::{above}");
                let code = src.split("#[cfg(test)]").next().unwrap();
                assert!(!code.contains(&path), "{name}.rs names {path}");
            }
        }
    }
}
