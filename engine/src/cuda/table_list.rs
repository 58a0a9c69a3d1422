//! The device-side block table of the SM copy path, built on the host: the planes (device
//! addresses of block 0 on each side, strides, block bytes) and the block-id pairs as the batch
//! gave them, so a batch of 2048 block ops over 64 planes uploads 32 id pairs and 64 planes,
//! not 2048 op triples. `kvf_copy_table` in copy.cu computes every address itself. Pure
//! arithmetic, so it is tested on machines without a GPU.
//!
//! Layout (little-endian u64 words): a header of [`HEADER_WORDS`] words `[next, items, planes,
//! blocks, pull, piece, 0, 0]`, then per plane [`PLANE_WORDS`] words `[local, local_stride,
//! remote, remote_stride, len, pieces, first, 0]`, then the pairs, one word each (local id in
//! the low half, remote id in the high half: a [`BlockPair`] as it lies in memory). `next` is
//! the kernel's work counter, uploaded as 0. Work item `i` is piece `(i - first) % pieces` of
//! block `(i - first) / pieces` of the plane whose `first` is the last one not above `i`.

use crate::block_table::BlockPair;
use crate::error::{Error, Result};

pub const HEADER_WORDS: usize = 8;
pub const PLANE_WORDS: usize = 8;

/// One plane as the kernel sees it: device addresses valid in the executing process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePlane {
    pub local: u64,
    pub local_stride: u64,
    pub remote: u64,
    pub remote_stride: u64,
    pub len: u64,
}

/// One copy of the table, as `kvf_copy_table` makes it (for tests and host mirrors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableCopy {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// A device table in the kernel's layout.
#[derive(Debug, Clone, Default)]
pub struct TableList {
    words: Vec<u64>,
}

impl TableList {
    /// Lays out `planes` × `blocks`, each block cut into pieces of at most `piece` bytes (a
    /// multiple of 16). `pull`: copies go remote → local. A plane whose largest block ends
    /// past 2^64 on either side is refused (`RangeOverflow`, naming its first element), so
    /// every address the kernel computes is exact.
    pub fn build(
        &mut self,
        planes: &[DevicePlane],
        blocks: &[BlockPair],
        pull: bool,
        piece: u64,
    ) -> Result<()> {
        let piece = piece.max(16) / 16 * 16;
        let (max_local, max_remote) = blocks
            .iter()
            .fold((0u32, 0u32), |(l, r), b| (l.max(b.local), r.max(b.remote)));
        self.words.clear();
        self.words
            .reserve(HEADER_WORDS + planes.len() * PLANE_WORDS + blocks.len());
        self.words.extend_from_slice(&[
            0,
            0,
            planes.len() as u64,
            blocks.len() as u64,
            u64::from(pull),
            piece,
            0,
            0,
        ]);
        let mut items = 0u64;
        for (i, p) in planes.iter().enumerate() {
            for (field, base, stride, max) in [
                ("local", p.local, p.local_stride, max_local),
                ("remote", p.remote, p.remote_stride, max_remote),
            ] {
                if crate::block_table::plane_end(base, stride, max, p.len).is_none() {
                    return Err(Error::RangeOverflow {
                        op: i * blocks.len(),
                        field,
                        offset: base,
                        len: p.len,
                    });
                }
            }
            let pieces = p.len.div_ceil(piece).max(1);
            let count = pieces
                .checked_mul(blocks.len() as u64)
                .and_then(|n| items.checked_add(n))
                .ok_or(Error::BatchTooLarge {
                    field: "pieces",
                    value: u64::MAX,
                    limit: u64::MAX,
                })?;
            self.words.extend_from_slice(&[
                p.local,
                p.local_stride,
                p.remote,
                p.remote_stride,
                p.len,
                pieces,
                items,
                0,
            ]);
            items = count;
        }
        self.words[1] = items;
        self.words.extend(
            blocks
                .iter()
                .map(|b| u64::from(b.local) | (u64::from(b.remote) << 32)),
        );
        Ok(())
    }

    /// The table as the kernel reads it.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Work items: what the launch grid is sized by.
    pub fn items(&self) -> u64 {
        self.words.get(1).copied().unwrap_or(0)
    }

    /// Every copy the kernel makes, item by item, computed as `kvf_copy_table` computes it.
    pub fn copies(&self) -> impl Iterator<Item = TableCopy> + '_ {
        let w = &self.words;
        let (planes, blocks) = (w[2] as usize, w[3] as usize);
        let (pull, piece) = (w[4] != 0, w[5]);
        let plane = move |p: usize| &w[HEADER_WORDS + p * PLANE_WORDS..][..PLANE_WORDS];
        let ids = &w[HEADER_WORDS + planes * PLANE_WORDS..][..blocks];
        let mut p = 0;
        (0..self.items()).map(move |i| {
            // Items only grow, so the plane index only moves forward (as in each warp).
            while p + 1 < planes && i >= plane(p + 1)[6] {
                p += 1;
            }
            let pl = plane(p);
            let k = i - pl[6];
            let (b, at) = ((k / pl[5]) as usize, k % pl[5] * piece);
            let (local_id, remote_id) = (ids[b] & 0xffff_ffff, ids[b] >> 32);
            let local = pl[0] + local_id * pl[1] + at;
            let remote = pl[2] + remote_id * pl[3] + at;
            let len = piece.min(pl[4] - at);
            let (src, dst) = if pull {
                (remote, local)
            } else {
                (local, remote)
            };
            TableCopy { src, dst, len }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(local: u32, remote: u32) -> BlockPair {
        BlockPair { local, remote }
    }

    #[test]
    fn pairs_lie_in_words_as_a_block_pair_lies_in_memory() {
        let pairs = [pair(7, 9), pair(u32::MAX, 1)];
        let mut t = TableList::default();
        t.build(
            &[DevicePlane {
                local: 0,
                local_stride: 1,
                remote: 0,
                remote_stride: 1,
                len: 1,
            }],
            &pairs,
            true,
            64 << 10,
        )
        .unwrap();
        let ids = &t.words()[HEADER_WORDS + PLANE_WORDS..];
        // SAFETY: BlockPair is repr(C) of two u32, 8 bytes, as a u64 word read on little endian.
        let as_words: &[u64] = unsafe { std::slice::from_raw_parts(pairs.as_ptr().cast(), 2) };
        assert_eq!(ids, as_words);
    }

    /// Every byte of every (plane, block) is copied once, from the right place to the right
    /// place, in pieces no longer than asked; with odd lengths, unaligned bases and strides.
    #[test]
    fn the_items_cover_every_block_of_every_plane_exactly() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(3);
        let mut t = TableList::default();
        for round in 0..200 {
            let planes: Vec<DevicePlane> = (0..rng.random_range(1..70))
                .map(|_| DevicePlane {
                    local: rng.random_range(0..1 << 40),
                    local_stride: rng.random_range(0..1 << 20),
                    remote: rng.random_range(0..1 << 40),
                    remote_stride: rng.random_range(0..1 << 20),
                    len: match rng.random_range(0..3) {
                        0 => 4096,
                        1 => rng.random_range(1..100),
                        _ => rng.random_range(1..300_000),
                    },
                })
                .collect();
            let blocks: Vec<BlockPair> = (0..rng.random_range(1..40))
                .map(|_| pair(rng.random_range(0..5000), rng.random_range(0..5000)))
                .collect();
            let pull = round % 2 == 0;
            let piece = 64 << 10;
            t.build(&planes, &blocks, pull, piece).unwrap();
            let mut copies = t.copies();
            for p in &planes {
                for b in &blocks {
                    let local = p.local + u64::from(b.local) * p.local_stride;
                    let remote = p.remote + u64::from(b.remote) * p.remote_stride;
                    let (src, dst) = if pull {
                        (remote, local)
                    } else {
                        (local, remote)
                    };
                    let mut at = 0;
                    while at < p.len {
                        let c = copies.next().expect("a copy for every byte");
                        assert_eq!((c.src, c.dst), (src + at, dst + at), "round {round}");
                        assert!(c.len > 0 && c.len <= piece);
                        at += c.len;
                    }
                    assert_eq!(at, p.len);
                }
            }
            assert!(copies.next().is_none());
            assert_eq!(
                t.words().len(),
                HEADER_WORDS + planes.len() * PLANE_WORDS + blocks.len()
            );
        }
    }

    #[test]
    fn planes_ending_past_2_64_are_refused() {
        let mut t = TableList::default();
        let p = DevicePlane {
            local: 0,
            local_stride: 4096,
            remote: u64::MAX - 8000,
            remote_stride: 4096,
            len: 4096,
        };
        let e = t
            .build(&[p, p], &[pair(0, 0), pair(1, 1)], false, 64 << 10)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::RangeOverflow {
                    op: 0,
                    field: "remote",
                    ..
                }
            ),
            "{e}"
        );
    }
}
