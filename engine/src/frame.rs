//! The wire format of the tcp and shm control streams.
//!
//! Every frame starts with a fixed 32-byte little-endian header:
//!
//! ```text
//!  0..4   magic  "KVF1"
//!  4      kind   (FrameKind)
//!  5      flags  (bit 0: crc32c trailer follows, bit 1: body is an error, bit 2: a manifest
//!                 starts with a 32-byte trace context)
//!  6..8   reserved, zero
//!  8..16  tag    (chunk id, echoed in the reply)
//! 16..20  count  (manifest entries / checksums)
//! 20..24  reserved, zero
//! 24..32  len    (body bytes for control frames; payload bytes for data frames)
//! ```
//!
//! A data connection opens with the handshake (see [`crate::auth`]): the target's `Challenge`,
//! the initiator's `Hello` with its proof, the target's `Welcome` with its own; only then come
//! manifests. An idle initiator sends `KeepAlive` frames (a header alone) so the target's idle
//! timeout closes only connections whose peer is gone.
//!
//! A batch chunk travels as one manifest (all its block ops, 32 bytes each) followed by the raw
//! payload of every op back to back, so the receiver knows every destination before the first
//! payload byte arrives and reads straight into them with few syscalls. A block-table chunk
//! travels as a table manifest instead (the target's side of its planes, 40 bytes each, and its
//! block ids, 4 bytes each; see [`TableHead`]), its payload in element order. The decoder never
//! allocates from a length it has not bounded first.

use serde::{Deserialize, Serialize};

pub use crate::frame_error::{FrameError, FrameKind, MAGIC, MAX_CONTROL_LEN, MAX_ENTRIES};
use crate::region_id::{AccessKey, RegionId};
pub use crate::table_manifest::{
    TABLE_HEAD_LEN, TABLE_PLANE_LEN, TABLE_VERSION, TableHead, TableManifest, TablePlane,
    decode_table, encode_table,
};

pub const HEADER_LEN: usize = 32;
pub const ENTRY_LEN: usize = 32;
/// Wire protocol version, checked in the handshake. 2: authenticated handshake (Challenge,
/// proofs, segment keys as MACs, region keys only to the segment's key holders), KeepAlive.
/// 3: table manifests (`WriteTable`, `ReadTable`).
pub const PROTOCOL_VERSION: u32 = 3;
/// The most a target reads of a Hello, before the initiator has proved anything.
pub const MAX_HELLO_LEN: u64 = 16 << 10;

pub const FLAG_CRC: u8 = 1;
pub const FLAG_ERROR: u8 = 2;
pub const FLAG_TRACE: u8 = 4;
const KNOWN_FLAGS: u8 = FLAG_CRC | FLAG_ERROR | FLAG_TRACE;
/// Trace context block of a manifest: trace id 16, parent span id 8, W3C flags 1, zero 7.
pub const TRACE_LEN: usize = 32;

/// The W3C trace context of the batch a chunk belongs to, so the target's work joins the
/// initiator's trace. Opaque to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceContext {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.trace_id);
        out.extend_from_slice(&self.span_id);
        out.push(self.flags);
        out.extend_from_slice(&[0; 7]);
    }

    pub fn decode(b: &[u8; TRACE_LEN]) -> TraceContext {
        TraceContext {
            trace_id: b[0..16].try_into().expect("16 bytes"),
            span_id: b[16..24].try_into().expect("8 bytes"),
            flags: b[24],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub flags: u8,
    pub tag: u64,
    pub count: u32,
    pub len: u64,
}

impl Header {
    pub fn new(kind: FrameKind, tag: u64, count: u32, len: u64) -> Self {
        Header {
            kind,
            flags: 0,
            tag,
            count,
            len,
        }
    }

    pub fn with_flags(mut self, flags: u8) -> Self {
        self.flags = flags;
        self
    }

    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = self.kind as u8;
        b[5] = self.flags;
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..20].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Header, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Truncated {
                need: HEADER_LEN,
                have: b.len(),
            });
        }
        let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        let kind = FrameKind::from_u8(b[4]).ok_or(FrameError::UnknownKind { kind: b[4] })?;
        let flags = b[5];
        if flags & !KNOWN_FLAGS != 0 || (flags & FLAG_TRACE != 0 && !kind.is_manifest()) {
            return Err(FrameError::UnknownFlags { kind, flags });
        }
        if b[6..8] != [0, 0] || b[20..24] != [0, 0, 0, 0] {
            return Err(FrameError::Reserved { kind });
        }
        let tag = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let count = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(b[24..32].try_into().expect("8 bytes"));
        if count > MAX_ENTRIES {
            return Err(FrameError::TooManyEntries { kind, count });
        }
        // Error bodies of data frames are JSON too.
        if (kind.is_control() || flags & FLAG_ERROR != 0) && len > MAX_CONTROL_LEN {
            return Err(FrameError::ControlTooLong { kind, len });
        }
        Ok(Header {
            kind,
            flags,
            tag,
            count,
            len,
        })
    }

    /// Bytes of manifest that follow a manifest header.
    /// Bytes of manifest after the header: the trace block (if flagged) and the entries.
    pub fn manifest_len(&self) -> usize {
        self.count as usize * ENTRY_LEN + if self.has(FLAG_TRACE) { TRACE_LEN } else { 0 }
    }
}

/// One block op as the target sees it: where in its own memory, and the key that proves access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub region: RegionId,
    pub key: AccessKey,
    pub offset: u64,
    pub len: u64,
}

impl Entry {
    /// Decodes one entry from exactly `ENTRY_LEN` bytes.
    pub fn decode(c: &[u8; ENTRY_LEN]) -> Entry {
        let word = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8"));
        Entry {
            region: RegionId(word(0)),
            key: AccessKey(word(1)),
            offset: word(2),
            len: word(3),
        }
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.region.0.to_le_bytes());
        out.extend_from_slice(&self.key.0.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }
}

/// The trace context a manifest carries (its body as read after the header), if flagged.
pub fn decode_trace(header: &Header, body: &[u8]) -> Option<TraceContext> {
    if !header.has(FLAG_TRACE) || body.len() < TRACE_LEN {
        return None;
    }
    Some(TraceContext::decode(
        body[..TRACE_LEN].try_into().expect("TRACE_LEN bytes"),
    ))
}

/// Decodes `header.count` entries (after the trace block, if any) and checks that they add up to `header.len`.
pub fn decode_manifest(header: &Header, body: &[u8]) -> Result<Vec<Entry>, FrameError> {
    let need = header.manifest_len();
    if body.len() < need {
        return Err(FrameError::Truncated {
            need,
            have: body.len(),
        });
    }
    let start = need - header.count as usize * ENTRY_LEN;
    let mut total: u64 = 0;
    let mut entries = Vec::with_capacity(header.count as usize);
    for (i, c) in body[start..need].chunks_exact(ENTRY_LEN).enumerate() {
        let e = Entry::decode(c.try_into().expect("chunks_exact"));
        total = total
            .checked_add(e.len)
            .ok_or(FrameError::LengthOverflow { entry: i })?;
        entries.push(e);
    }
    if total != header.len {
        return Err(FrameError::LengthMismatch {
            claimed: header.len,
            actual: total,
        });
    }
    Ok(entries)
}

/// Decodes `count` little-endian crc32c values.
pub fn decode_crcs(count: u32, body: &[u8]) -> Result<Vec<u32>, FrameError> {
    let need = count as usize * 4;
    if body.len() < need {
        return Err(FrameError::Truncated {
            need,
            have: body.len(),
        });
    }
    Ok(body[..need]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
        .collect())
}

/// The target's first frame: its protocol and a nonce for this connection, nothing else.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    pub protocol: u32,
    #[serde(with = "hex::serde")]
    pub nonce: crate::auth::Nonce,
}

/// The initiator's answer to the challenge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    /// The segment the initiator wants to reach on this endpoint (empty: whichever it serves).
    pub segment: String,
    /// The initiator's own segment name, for logs and traces (covered by the proof).
    pub from: String,
    #[serde(with = "hex::serde")]
    pub nonce: crate::auth::Nonce,
    /// HMAC of the data secret over both nonces and `from` (see [`crate::auth`]).
    #[serde(with = "hex::serde")]
    pub proof: crate::auth::Proof,
    /// The segment key, if one is presented, as a MAC (never in the clear).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_hex")]
    pub key_proof: Option<crate::auth::Proof>,
}

/// The target's answer to an authenticated Hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub protocol: u32,
    /// The target's proof that it holds the data secret too.
    #[serde(with = "hex::serde")]
    pub proof: crate::auth::Proof,
    /// The target closes a connection silent for this long; the initiator keeps it alive.
    pub idle_timeout_ms: u64,
    /// The target's descriptor, region keys included: only for a caller that named the
    /// target's segment and presented its segment key. Others already have what they were
    /// given by the channel that gave them the secret.
    pub descriptor: Option<crate::segment::SegmentDescriptor>,
}

mod opt_hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<[u8; 32]>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_str(&hex::encode(b)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<[u8; 32]>, D::Error> {
        let Some(text) = Option::<String>::deserialize(d)? else {
            return Ok(None);
        };
        let mut b = [0u8; 32];
        hex::decode_to_slice(&text, &mut b).map_err(serde::de::Error::custom)?;
        Ok(Some(b))
    }
}

pub fn decode_json<T: for<'de> Deserialize<'de>>(
    what: &'static str,
    body: &[u8],
) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Body {
        what,
        // serde quotes what it refused: a peer's bytes, echoed back no longer than this.
        reason: crate::parse_error::truncated(&e.to_string(), 200),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header::new(FrameKind::WriteManifest, 42, 3, 1 << 40).with_flags(FLAG_CRC);
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn a_traced_manifest_carries_its_context_before_the_entries() {
        let e = Entry {
            region: RegionId(3),
            key: AccessKey(5),
            offset: 64,
            len: 4096,
        };
        let h = Header::new(FrameKind::ReadManifest, 1, 1, 4096).with_flags(FLAG_TRACE);
        let trace = TraceContext {
            trace_id: [1; 16],
            span_id: [2; 8],
            flags: 1,
        };
        let mut body = Vec::new();
        trace.encode_into(&mut body);
        e.encode_into(&mut body);
        assert_eq!(h.manifest_len(), body.len());
        assert_eq!(decode_trace(&h, &body), Some(trace));
        assert_eq!(decode_manifest(&h, &body).unwrap(), vec![e]);
        assert!(matches!(
            decode_manifest(&h, &body[..40]),
            Err(FrameError::Truncated { .. })
        ));
        // Only manifests may carry a trace block.
        let ack = Header::new(FrameKind::Ack, 1, 0, 0).with_flags(FLAG_TRACE);
        assert!(matches!(
            Header::decode(&ack.encode()),
            Err(FrameError::UnknownFlags { .. })
        ));
    }

    #[test]
    fn garbage_headers_are_typed_errors() {
        let good = Header::new(FrameKind::Ack, 1, 0, 0).encode();
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            Header::decode(&b),
            Err(FrameError::BadMagic { .. })
        ));
        let mut b = good;
        b[4] = 200;
        assert_eq!(
            Header::decode(&b),
            Err(FrameError::UnknownKind { kind: 200 })
        );
        let mut b = good;
        b[5] = 0x80;
        assert!(matches!(
            Header::decode(&b),
            Err(FrameError::UnknownFlags { .. })
        ));
        let mut b = good;
        b[7] = 1;
        assert!(matches!(
            Header::decode(&b),
            Err(FrameError::Reserved { .. })
        ));
        let b = Header::new(FrameKind::ReadManifest, 1, MAX_ENTRIES + 1, 0).encode();
        assert!(matches!(
            Header::decode(&b),
            Err(FrameError::TooManyEntries { .. })
        ));
        let b = Header::new(FrameKind::Hello, 1, 0, MAX_CONTROL_LEN + 1).encode();
        assert!(matches!(
            Header::decode(&b),
            Err(FrameError::ControlTooLong { .. })
        ));
        assert_eq!(
            Header::decode(&good[..10]),
            Err(FrameError::Truncated { need: 32, have: 10 })
        );
    }

    #[test]
    fn manifest_checks_length_and_truncation() {
        let entries = [
            Entry {
                region: RegionId(1),
                key: AccessKey(9),
                offset: 0,
                len: 10,
            },
            Entry {
                region: RegionId(2),
                key: AccessKey(9),
                offset: 5,
                len: u64::MAX,
            },
        ];
        let mut body = Vec::new();
        entries.iter().for_each(|e| e.encode_into(&mut body));
        let h = Header::new(FrameKind::WriteManifest, 0, 1, 10);
        assert_eq!(decode_manifest(&h, &body[..32]).unwrap(), entries[..1]);
        // Lengths that overflow when added are refused, even if the header claims 2^64 - 1
        // (found by the fuzzer: saturating at the claimed value once passed as a match).
        for claimed in [9, u64::MAX] {
            let h = Header::new(FrameKind::WriteManifest, 0, 2, claimed);
            assert_eq!(
                decode_manifest(&h, &body),
                Err(FrameError::LengthOverflow { entry: 1 })
            );
        }
        let h = Header::new(FrameKind::WriteManifest, 0, 1, 11);
        assert!(matches!(
            decode_manifest(&h, &body[..32]),
            Err(FrameError::LengthMismatch {
                claimed: 11,
                actual: 10
            })
        ));
        let h = Header::new(FrameKind::WriteManifest, 0, 2, 20);
        assert!(matches!(
            decode_manifest(&h, &body[..40]),
            Err(FrameError::Truncated { need: 64, have: 40 })
        ));
    }
}
