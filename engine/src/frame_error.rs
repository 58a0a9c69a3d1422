//! The kinds of frame and what can be wrong with one: below the error type (which wraps
//! `FrameError`), so the wire format's limits are named here.

pub const MAGIC: [u8; 4] = *b"KVF1";
/// At most this many block ops in one manifest (a chunk of a batch, not the batch).
pub const MAX_ENTRIES: u32 = 1 << 16;
/// Control bodies (handshake JSON, error messages) are small; anything larger is garbage.
pub const MAX_CONTROL_LEN: u64 = 1 << 20;
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Hello = 1,
    Welcome = 2,
    WriteManifest = 3,
    Ack = 4,
    ReadManifest = 5,
    ReadData = 6,
    MapRegion = 7,
    MapReply = 8,
    Challenge = 9,
    KeepAlive = 10,
    /// A write chunk given as a block table (see [`crate::frame`]'s table manifest).
    WriteTable = 11,
    ReadTable = 12,
}

impl FrameKind {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => FrameKind::Hello,
            2 => FrameKind::Welcome,
            3 => FrameKind::WriteManifest,
            4 => FrameKind::Ack,
            5 => FrameKind::ReadManifest,
            6 => FrameKind::ReadData,
            7 => FrameKind::MapRegion,
            8 => FrameKind::MapReply,
            9 => FrameKind::Challenge,
            10 => FrameKind::KeepAlive,
            11 => FrameKind::WriteTable,
            12 => FrameKind::ReadTable,
            _ => return None,
        })
    }

    /// Kinds whose `len` counts a JSON body rather than bulk payload.
    pub(crate) fn is_control(self) -> bool {
        !matches!(
            self,
            FrameKind::WriteManifest
                | FrameKind::ReadManifest
                | FrameKind::WriteTable
                | FrameKind::ReadTable
                | FrameKind::ReadData
        )
    }

    /// Kinds that open a chunk (and may carry a trace context).
    pub(crate) fn is_manifest(self) -> bool {
        matches!(
            self,
            FrameKind::WriteManifest
                | FrameKind::ReadManifest
                | FrameKind::WriteTable
                | FrameKind::ReadTable
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {found:02x?}, expected {MAGIC:02x?}")]
    BadMagic { found: [u8; 4] },
    #[error("unknown frame kind {kind}")]
    UnknownKind { kind: u8 },
    #[error("unknown flags {flags:#04x} in {kind:?} frame")]
    UnknownFlags { kind: FrameKind, flags: u8 },
    #[error("reserved bytes are not zero in {kind:?} frame")]
    Reserved { kind: FrameKind },
    #[error("count {count} exceeds the limit of {MAX_ENTRIES} in {kind:?} frame")]
    TooManyEntries { kind: FrameKind, count: u32 },
    #[error("len {len} exceeds the limit of {MAX_CONTROL_LEN} for a {kind:?} frame")]
    ControlTooLong { kind: FrameKind, len: u64 },
    #[error("truncated frame: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    #[error("manifest says {claimed} payload bytes but its entries add up to {actual}")]
    LengthMismatch { claimed: u64, actual: u64 },
    #[error("manifest entry {entry}: lengths add up to more than 2^64 bytes")]
    LengthOverflow { entry: usize },
    #[error("unexpected {kind:?} frame: {expected}")]
    Unexpected {
        kind: FrameKind,
        expected: &'static str,
    },
    #[error("reply tag {found} does not match request tag {expected}")]
    TagMismatch { expected: u64, found: u64 },
    #[error("reply {field} {claimed} does not match the request's {expected}")]
    ReplyMismatch {
        field: &'static str,
        claimed: u64,
        expected: u64,
    },
    #[error("invalid {what} body: {reason}")]
    Body { what: &'static str, reason: String },
    #[error("table manifest version {version} is not one this engine reads")]
    TableVersion { version: u8 },
    #[error("table manifest {field} = {value}, must be 1..={limit}")]
    TableSize {
        field: &'static str,
        value: u32,
        limit: u32,
    },
    #[error("table manifest of {planes} planes × {blocks} blocks, but the header counts {count}")]
    TableCount {
        planes: u32,
        blocks: u32,
        count: u32,
    },
}
