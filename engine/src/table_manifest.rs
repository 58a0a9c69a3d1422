//! The table manifest: how a block-table chunk travels on tcp. The target gets its own side of
//! each plane and its own block ids, all of them before the first payload byte, so it checks
//! every plane and id first (as it checks every entry of an op manifest).
//!
//! Body of a `WriteTable` / `ReadTable` frame, after the trace block if flagged (little endian):
//!
//! ```text
//!  0      version (TABLE_VERSION)
//!  1..4   reserved, zero
//!  4..8   planes (1..=MAX_PLANES)
//!  8..12  blocks (1..=MAX_ENTRIES)
//! 12..16  reserved, zero
//! then per plane (40 bytes): region, key, base, stride, block_bytes (u64 each)
//! then per block: the target's block id (u32)
//! ```
//!
//! The header's `count` is planes × blocks (the elements, and the checksums a crc trailer holds)
//! and its `len` the payload: block_bytes × blocks summed over the planes, element by element
//! (plane by plane, each block in order).

use crate::block_table::MAX_PLANES;
use crate::frame::{FrameError, Header, MAX_ENTRIES};
use crate::region_id::{AccessKey, RegionId};

/// The table manifest layout this engine writes and reads.
pub const TABLE_VERSION: u8 = 1;
pub const TABLE_HEAD_LEN: usize = 16;
pub const TABLE_PLANE_LEN: usize = 40;

/// The target's side of one plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TablePlane {
    pub region: RegionId,
    pub key: AccessKey,
    pub base: u64,
    pub stride: u64,
    pub block_bytes: u64,
}

impl TablePlane {
    fn encode_into(&self, out: &mut Vec<u8>) {
        for w in [
            self.region.0,
            self.key.0,
            self.base,
            self.stride,
            self.block_bytes,
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }

    fn decode(c: &[u8]) -> TablePlane {
        let word = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8"));
        TablePlane {
            region: RegionId(word(0)),
            key: AccessKey(word(1)),
            base: word(2),
            stride: word(3),
            block_bytes: word(4),
        }
    }
}

/// The fixed start of a table manifest, checked against its frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableHead {
    pub planes: u32,
    pub blocks: u32,
}

impl TableHead {
    pub fn decode(header: &Header, b: &[u8; TABLE_HEAD_LEN]) -> Result<TableHead, FrameError> {
        if b[0] != TABLE_VERSION {
            return Err(FrameError::TableVersion { version: b[0] });
        }
        if b[1..4] != [0; 3] || b[12..16] != [0; 4] {
            return Err(FrameError::Reserved { kind: header.kind });
        }
        let planes = u32::from_le_bytes(b[4..8].try_into().expect("4"));
        let blocks = u32::from_le_bytes(b[8..12].try_into().expect("4"));
        for (field, value, limit) in [
            ("planes", planes, MAX_PLANES as u32),
            ("blocks", blocks, MAX_ENTRIES),
        ] {
            if !(1..=limit).contains(&value) {
                return Err(FrameError::TableSize {
                    field,
                    value,
                    limit,
                });
            }
        }
        if u64::from(planes) * u64::from(blocks) != u64::from(header.count) {
            return Err(FrameError::TableCount {
                planes,
                blocks,
                count: header.count,
            });
        }
        Ok(TableHead { planes, blocks })
    }

    /// Bytes of planes and ids after the head (at most 4096 × 40 + 65536 × 4).
    pub fn body_len(&self) -> usize {
        self.planes as usize * TABLE_PLANE_LEN + self.blocks as usize * 4
    }
}

/// A decoded table manifest: the target's planes and block ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableManifest {
    pub planes: Vec<TablePlane>,
    pub blocks: Vec<u32>,
}

/// Decodes the planes and ids that follow `head`, and checks that they add up to the header's
/// payload length.
pub fn decode_table(
    header: &Header,
    head: &TableHead,
    body: &[u8],
) -> Result<TableManifest, FrameError> {
    let need = head.body_len();
    if body.len() < need {
        return Err(FrameError::Truncated {
            need,
            have: body.len(),
        });
    }
    let (planes, ids) = body[..need].split_at(head.planes as usize * TABLE_PLANE_LEN);
    let planes: Vec<TablePlane> = planes
        .chunks_exact(TABLE_PLANE_LEN)
        .map(TablePlane::decode)
        .collect();
    let blocks: Vec<u32> = ids
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
        .collect();
    let n = u64::from(head.blocks);
    let mut total = 0u64;
    for (i, p) in planes.iter().enumerate() {
        // Numbered by the plane's first element, as op manifests number entries.
        let overflow = FrameError::LengthOverflow {
            entry: i * head.blocks as usize,
        };
        total = p
            .block_bytes
            .checked_mul(n)
            .and_then(|b| total.checked_add(b))
            .ok_or(overflow)?;
    }
    if total != header.len {
        return Err(FrameError::LengthMismatch {
            claimed: header.len,
            actual: total,
        });
    }
    Ok(TableManifest { planes, blocks })
}

/// Appends a table manifest's body (head, planes, ids) to `out`.
pub fn encode_table(
    planes: &[TablePlane],
    blocks: impl ExactSizeIterator<Item = u32>,
    out: &mut Vec<u8>,
) {
    out.reserve(TABLE_HEAD_LEN + planes.len() * TABLE_PLANE_LEN + blocks.len() * 4);
    out.push(TABLE_VERSION);
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&(planes.len() as u32).to_le_bytes());
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    for p in planes {
        p.encode_into(out);
    }
    for b in blocks {
        out.extend_from_slice(&b.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{FLAG_TRACE, FrameKind, HEADER_LEN};
    use rand::rngs::SmallRng;
    use rand::{Rng, RngCore, SeedableRng};

    fn plane(region: u64, block_bytes: u64) -> TablePlane {
        TablePlane {
            region: RegionId(region),
            key: AccessKey(0x5eed),
            base: region * 1000,
            stride: 4096,
            block_bytes,
        }
    }

    /// A whole frame: header, head, planes, ids.
    fn frame(planes: &[TablePlane], ids: &[u32]) -> (Header, Vec<u8>) {
        // Wrapping: some tests send what does not add up.
        let len = planes
            .iter()
            .fold(0u64, |s, p| s.wrapping_add(p.block_bytes))
            .wrapping_mul(ids.len() as u64);
        let h = Header::new(
            FrameKind::WriteTable,
            9,
            (planes.len() * ids.len()) as u32,
            len,
        );
        let mut body = Vec::new();
        encode_table(planes, ids.iter().copied(), &mut body);
        (h, body)
    }

    fn decode(h: &Header, body: &[u8]) -> Result<TableManifest, FrameError> {
        let head = TableHead::decode(h, body[..TABLE_HEAD_LEN].try_into().unwrap())?;
        decode_table(h, &head, &body[TABLE_HEAD_LEN..])
    }

    #[test]
    fn tables_round_trip() {
        let planes = [plane(1, 4096), plane(2, 100)];
        let ids = [7, 0, u32::MAX];
        let (h, body) = frame(&planes, &ids);
        assert_eq!(
            body.len(),
            TABLE_HEAD_LEN + 2 * TABLE_PLANE_LEN + 3 * 4,
            "40 bytes per plane and 4 per block"
        );
        let t = decode(&h, &body).unwrap();
        assert_eq!(t.planes, planes);
        assert_eq!(t.blocks, ids);
        // The header round-trips with the table kinds (which may carry a trace block).
        let traced = h.with_flags(FLAG_TRACE);
        assert_eq!(Header::decode(&traced.encode()).unwrap(), traced);
    }

    #[test]
    fn heads_that_disagree_with_their_header_are_typed_errors() {
        let (h, body) = frame(&[plane(1, 64)], &[1, 2]);
        let head = |b: &[u8]| TableHead::decode(&h, b[..TABLE_HEAD_LEN].try_into().unwrap());
        let mut b = body.clone();
        b[0] = 2;
        assert_eq!(head(&b), Err(FrameError::TableVersion { version: 2 }));
        let mut b = body.clone();
        b[13] = 1;
        assert!(matches!(head(&b), Err(FrameError::Reserved { .. })));
        let mut b = body.clone();
        b[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            head(&b),
            Err(FrameError::TableSize {
                field: "planes",
                ..
            })
        ));
        let mut b = body.clone();
        b[4..8].copy_from_slice(&(MAX_PLANES as u32 + 1).to_le_bytes());
        assert!(matches!(head(&b), Err(FrameError::TableSize { .. })));
        let mut b = body.clone();
        b[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(
            head(&b),
            Err(FrameError::TableCount {
                planes: 1,
                blocks: 3,
                count: 2
            })
        );
        // Payload lengths: the header's must match, and the sum must not wrap.
        let wrong = Header { len: 129, ..h };
        assert!(matches!(
            decode(&wrong, &body),
            Err(FrameError::LengthMismatch { .. })
        ));
        let (h, body) = frame(&[plane(1, u64::MAX / 2), plane(2, 1)], &[1, 2]);
        let h = Header { len: 0, ..h };
        // Plane 1 passes 2^64: named by its first element.
        assert_eq!(
            decode(&h, &body),
            Err(FrameError::LengthOverflow { entry: 2 })
        );
        let (h, body) = frame(&[plane(1, 64)], &[1, 2]);
        assert!(matches!(
            decode(&h, &body[..body.len() - 1]),
            Err(FrameError::Truncated { .. })
        ));
    }

    /// The decoder on mutated and random input: a typed error or a table that re-encodes to
    /// the same bytes and matches its header; never a panic.
    #[test]
    fn mutated_tables_decode_to_typed_errors_or_consistent_tables() {
        let mut rng = SmallRng::seed_from_u64(11);
        let (h, body) = frame(&[plane(1, 64), plane(3, 4096), plane(4, 1)], &[5, 9, 2, 0]);
        let mut whole = h.encode().to_vec();
        whole.extend_from_slice(&body);
        let mut decoded = 0;
        for round in 0..20_000 {
            let mut b = whole.clone();
            if round % 10 == 0 {
                b.truncate(rng.random_range(0..b.len()));
                let from = HEADER_LEN.min(b.len());
                rng.fill_bytes(&mut b[from..]);
            }
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..b.len().max(1));
                if let Some(x) = b.get_mut(at) {
                    *x ^= 1 << rng.random_range(0..8);
                }
            }
            let Ok(h) = Header::decode(&b) else { continue };
            let rest = &b[HEADER_LEN..];
            if rest.len() < TABLE_HEAD_LEN || !matches!(h.kind, FrameKind::WriteTable) {
                continue;
            }
            let Ok(head) = TableHead::decode(&h, rest[..TABLE_HEAD_LEN].try_into().unwrap()) else {
                continue;
            };
            if let Ok(t) = decode_table(&h, &head, &rest[TABLE_HEAD_LEN..]) {
                decoded += 1;
                assert_eq!(t.planes.len() * t.blocks.len(), h.count as usize);
                let sum: u64 = t.planes.iter().map(|p| p.block_bytes).sum::<u64>();
                assert_eq!(sum * t.blocks.len() as u64, h.len);
                let mut again = Vec::new();
                encode_table(&t.planes, t.blocks.iter().copied(), &mut again);
                assert_eq!(again, rest[..again.len()]);
            }
        }
        assert!(
            decoded > 100,
            "only {decoded} decoded: mutations too coarse"
        );
    }
}
