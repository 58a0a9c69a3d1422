//! The device-side op list of the SM copy path, built on the host. Pure arithmetic, so it is
//! tested on machines without a GPU.
//!
//! Layout (little-endian u64 words, read by `kvf_copy` in copy.cu): `[next, count]` then `count`
//! triples `(src, dst, len)`. `next` is the kernel's work counter and is uploaded as 0.

use crate::error::{Error, Result};

/// Width of one vector access in the kernel.
pub const VECTOR: u64 = 16;
/// Words before the first op.
pub const HEADER_WORDS: usize = 2;
/// Words per op.
pub const OP_WORDS: usize = 3;

/// One copy as the kernel sees it: device addresses in this process and a length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceOp {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

impl DeviceOp {
    /// Whether the kernel takes its 16-byte vector path for this op.
    pub fn vectorized(&self) -> bool {
        (self.src | self.dst | self.len).is_multiple_of(VECTOR)
    }
}

/// Splits one copy into at most three: a bytewise head up to the next 16-byte boundary, an
/// aligned body, and a bytewise tail. When source and destination disagree modulo 16 no split
/// can align both, and the whole copy goes bytewise (correct, slow; KV blocks never do this).
/// A copy whose end passes 2^64 on either side is left whole (it can name no real memory, and
/// [`OpList::push`] refuses it).
pub fn split_aligned(src: u64, dst: u64, len: u64) -> [Option<DeviceOp>; 3] {
    if !(src ^ dst).is_multiple_of(VECTOR)
        || len < VECTOR
        || src.checked_add(len).is_none()
        || dst.checked_add(len).is_none()
    {
        return [Some(DeviceOp { src, dst, len }), None, None];
    }
    let head = ((VECTOR - src % VECTOR) % VECTOR).min(len);
    let body = (len - head) / VECTOR * VECTOR;
    let tail = len - head - body;
    let piece = |at: u64, n: u64| {
        (n > 0).then_some(DeviceOp {
            src: src + at,
            dst: dst + at,
            len: n,
        })
    };
    [piece(0, head), piece(head, body), piece(head + body, tail)]
}

/// A growing op list in the kernel's layout.
#[derive(Debug, Clone)]
pub struct OpList {
    words: Vec<u64>,
    /// Ops longer than this are cut, so one huge op spreads over many warps.
    max_piece: u64,
}

impl OpList {
    pub fn new(max_piece: u64) -> Self {
        OpList {
            words: vec![0; HEADER_WORDS],
            max_piece: max_piece.max(VECTOR) / VECTOR * VECTOR,
        }
    }

    pub fn clear(&mut self) {
        self.words.truncate(HEADER_WORDS);
        self.words[0] = 0;
        self.words[1] = 0;
    }

    pub fn len(&self) -> usize {
        (self.words.len() - HEADER_WORDS) / OP_WORDS
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds one copy, aligned and cut as the kernel wants it. A copy whose end passes 2^64 on
    /// either side is refused (`RangeOverflow`), so every address computed below is exact.
    pub fn push(&mut self, src: u64, dst: u64, len: u64) -> Result<()> {
        for (field, at) in [("src", src), ("dst", dst)] {
            if at.checked_add(len).is_none() {
                return Err(Error::RangeOverflow {
                    op: self.len(),
                    field,
                    offset: at,
                    len,
                });
            }
        }
        // KV blocks are aligned and no longer than a piece: one triple, no splitting. A batch of
        // 4 KiB blocks holds ~10^5 of them, and this runs once for each.
        if (src | dst | len).is_multiple_of(VECTOR) && len <= self.max_piece && len > 0 {
            self.words.extend_from_slice(&[src, dst, len]);
            self.words[1] += 1;
            return Ok(());
        }
        for op in split_aligned(src, dst, len).into_iter().flatten() {
            let mut at = 0;
            while at < op.len {
                let n = (op.len - at).min(self.max_piece);
                self.words.extend_from_slice(&[op.src + at, op.dst + at, n]);
                at += n;
            }
        }
        self.words[1] = self.len() as u64;
        Ok(())
    }

    /// The list as the kernel reads it.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    pub fn ops(&self) -> impl Iterator<Item = DeviceOp> + '_ {
        self.words[HEADER_WORDS..]
            .chunks_exact(OP_WORDS)
            .map(|w| DeviceOp {
                src: w[0],
                dst: w[1],
                len: w[2],
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covered(parts: &[DeviceOp], src: u64, dst: u64, len: u64) {
        let mut at = 0;
        for p in parts {
            assert_eq!(p.src, src + at, "{parts:?}");
            assert_eq!(p.dst, dst + at, "{parts:?}");
            at += p.len;
        }
        assert_eq!(at, len, "{parts:?}");
    }

    #[test]
    fn aligned_copies_stay_whole_and_vectorized() {
        let parts: Vec<_> = split_aligned(0x1000, 0x2000, 4096)
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(
            parts,
            [DeviceOp {
                src: 0x1000,
                dst: 0x2000,
                len: 4096
            }]
        );
        assert!(parts[0].vectorized());
    }

    #[test]
    fn unaligned_heads_and_tails_go_bytewise_around_an_aligned_body() {
        let (src, dst, len) = (0x1003, 0x2003, 100);
        let parts: Vec<_> = split_aligned(src, dst, len).into_iter().flatten().collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0].len, 13);
        assert!(parts[1].vectorized() && parts[1].len == 80);
        assert_eq!(parts[2].len, 7);
        assert!(!parts[0].vectorized() && !parts[2].vectorized());
        covered(&parts, src, dst, len);
    }

    #[test]
    fn mutually_misaligned_or_tiny_copies_go_bytewise_whole() {
        for (src, dst, len) in [
            (0x1001, 0x2002, 4096),
            (0x1000, 0x2000, 5),
            (0x1008, 0x2008, 15),
        ] {
            let parts: Vec<_> = split_aligned(src, dst, len).into_iter().flatten().collect();
            assert_eq!(parts, [DeviceOp { src, dst, len }]);
        }
        // Too short to reach a boundary: still one bytewise piece, never a zero-length one.
        let parts: Vec<_> = split_aligned(0x100f, 0x200f, 17)
            .into_iter()
            .flatten()
            .collect();
        assert!(parts.iter().all(|p| p.len > 0));
        covered(&parts, 0x100f, 0x200f, 17);
    }

    #[test]
    fn op_list_packs_header_then_triples_and_cuts_long_ops() {
        let mut list = OpList::new(64 << 10);
        list.push(0x10_0000, 0x20_0000, 200 << 10).unwrap();
        list.push(0x30_0001, 0x40_0001, 31).unwrap();
        let w = list.words();
        assert_eq!(w[0], 0, "the work counter starts at zero");
        assert_eq!(w[1] as usize, list.len());
        // 200 KiB in 64 KiB pieces: 4; then 15 head bytes + 16 aligned.
        assert_eq!(list.len(), 4 + 2);
        assert_eq!(w.len(), HEADER_WORDS + list.len() * OP_WORDS);
        let ops: Vec<_> = list.ops().collect();
        assert_eq!(
            ops[3],
            DeviceOp {
                src: 0x10_0000 + (192 << 10),
                dst: 0x20_0000 + (192 << 10),
                len: 8 << 10
            }
        );
        assert!(ops[..4].iter().all(|o| o.vectorized()));
        assert_eq!(ops[4].len, 15);
        assert!(ops[5].vectorized());
        list.clear();
        assert!(list.is_empty());
        assert_eq!(list.words(), [0, 0]);
    }

    #[test]
    fn every_op_list_covers_its_copies_exactly_in_aligned_pieces() {
        let max = 64 << 10;
        let mut list = OpList::new(max);
        let mut want = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for i in 0..2000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Mostly KV-shaped (aligned, at most one piece), some unaligned, some long.
            let (src, dst, len) = match i % 4 {
                0 | 1 => (x % 4096 * 4096, (x >> 20) % 4096 * 4096, 4096 << (x % 5)),
                2 => (x % 100_000, (x >> 20) % 100_000, x % 70_000),
                _ => (
                    x % 4096 * 16,
                    (x >> 20) % 4096 * 16,
                    (x >> 40) % (300 << 10) / 16 * 16,
                ),
            };
            list.push(src, dst, len).unwrap();
            want.push((src, dst, len));
        }
        let ops: Vec<_> = list.ops().collect();
        assert_eq!(list.words()[1] as usize, ops.len());
        assert!(ops.iter().all(|o| o.len > 0 && o.len <= max));
        assert!(
            ops.iter()
                .all(|o| o.vectorized() || o.len < VECTOR || (o.src ^ o.dst) % VECTOR != 0)
        );
        let mut at = ops.iter().peekable();
        for (src, dst, len) in want {
            let mut done = 0;
            while done < len {
                let o = at.next().expect("an op for every byte");
                assert_eq!((o.src, o.dst), (src + done, dst + done));
                done += o.len;
            }
            assert_eq!(done, len);
        }
        assert!(at.next().is_none());
    }

    #[test]
    fn copies_ending_past_2_64_are_refused_whole() {
        let mut list = OpList::new(64 << 10);
        for (src, dst, len) in [(u64::MAX - 15, 0x1000, 32), (0x1000, u64::MAX, 1)] {
            let err = list.push(src, dst, len).unwrap_err();
            assert!(matches!(err, Error::RangeOverflow { .. }), "{err}");
            assert_eq!(
                split_aligned(src, dst, len),
                [Some(DeviceOp { src, dst, len }), None, None]
            );
        }
        assert!(list.is_empty());
        // The last copy that still fits is split and listed.
        list.push(u64::MAX - 64, 0x1000 - 64, 64).unwrap();
        assert_eq!(list.ops().map(|o| o.len).sum::<u64>(), 64);
    }
}
