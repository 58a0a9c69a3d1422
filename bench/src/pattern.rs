//! Deterministic random block contents: either side can regenerate what any block must hold, so
//! the target can verify pushed data and the initiator pulled data, byte for byte, without
//! shipping a copy of the pool. Host and GPU pools hold the same pattern (the GPU fill kernel's,
//! `kvfabric_engine::cuda::pattern_word`), so a row between host and GPU memory verifies too.

use kvfabric_engine::cuda::pattern_word;
use serde::{Deserialize, Serialize};

/// Block `block` of a pool filled from `seed`: word i is `pattern_word(seed, block, i)`, little
/// endian (a short last word is that word's first bytes).
pub fn fill_block(seed: u64, block: u64, out: &mut [u8]) {
    let whole = out.len() / 8;
    let mut words = out.chunks_exact_mut(8);
    for (i, w) in (&mut words).enumerate() {
        w.copy_from_slice(&pattern_word(seed, block, i as u64).to_le_bytes());
    }
    let tail = words.into_remainder();
    let last = pattern_word(seed, block, whole as u64).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// Fills a whole pool, block by block.
pub fn fill_pool(seed: u64, block_size: usize, pool: &mut [u8]) {
    for (i, block) in pool.chunks_mut(block_size).enumerate() {
        fill_block(seed, i as u64, block);
    }
}

/// A bench pool of `bytes` at `location`, filled from `seed` with the same pattern wherever it
/// lives (by the CPU on the host, by a kernel on a GPU).
pub fn alloc_pool(
    engine: &kvfabric_engine::Engine,
    location: kvfabric_engine::Location,
    bytes: u64,
    block_size: u64,
    seed: u64,
) -> kvfabric_engine::Result<std::sync::Arc<kvfabric_engine::Region>> {
    match location {
        kvfabric_engine::Location::Cuda { device } => {
            let region = engine.alloc_cuda(device, bytes)?;
            kvfabric_engine::cuda::fill(&region, block_size, seed)?;
            Ok(region)
        }
        kvfabric_engine::Location::Host { .. } => {
            let region = engine.alloc(bytes)?;
            // SAFETY: the region is new and not yet published; nothing else can touch it.
            fill_pool(seed, block_size as usize, unsafe { region.as_mut_slice() });
            Ok(region)
        }
    }
}

/// What a destination pool must hold after a run: the source block last written into each
/// destination block, its own fill (the poison) everywhere else.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Expectation {
    pub block_size: u64,
    pub source_seed: u64,
    pub poison_seed: u64,
    /// (destination block, source block) pairs.
    pub written: Vec<(u32, u32)>,
}

/// A verdict names at most this many bad places.
const NAMED: usize = 4;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Verdict {
    /// Bytes compared with what they must hold.
    pub bytes_checked: u64,
    /// Bad blocks (host pools) or bad 8-byte words (GPU pools).
    pub mismatches: u64,
    /// The first few bad places, each naming its block.
    pub bad: Vec<String>,
}

impl Expectation {
    /// For each of `blocks` destination blocks, the source block written into it, or u32::MAX
    /// where it must still hold its own fill (the GPU verify kernel's input).
    pub fn source_of(&self, blocks: usize) -> Vec<u32> {
        let mut source = vec![u32::MAX; blocks];
        for &(d, s) in &self.written {
            if let Some(slot) = source.get_mut(d as usize) {
                *slot = s;
            }
        }
        source
    }

    /// Checks a pool wherever it lives: on the host byte by byte, on a GPU with the verify
    /// kernel (a GPU pool holds the device pattern, see `kvfabric_engine::cuda::fill`).
    pub fn verify_region(
        &self,
        region: &std::sync::Arc<kvfabric_engine::Region>,
    ) -> kvfabric_engine::Result<Verdict> {
        if region.device_ptr().is_none() {
            // SAFETY: the bench verifies only after every batch has completed.
            return Ok(self.verify(unsafe { region.as_slice() }));
        }
        // Pools are whole numbers of blocks (refused otherwise), so the blocks cover the pool.
        let blocks = (region.len() / self.block_size) as usize;
        let v = kvfabric_engine::cuda::verify(
            region,
            self.block_size,
            &self.source_of(blocks),
            self.source_seed,
            self.poison_seed,
        )?;
        let words = self.block_size / 8;
        Ok(Verdict {
            bytes_checked: blocks as u64 * self.block_size,
            mismatches: v.bad_words,
            bad: v
                .first_bad_word
                .map(|w| {
                    format!(
                        "{} bad 8-byte words; first in block {} at +{}",
                        v.bad_words,
                        w / words,
                        w % words * 8
                    )
                })
                .into_iter()
                .collect(),
        })
    }

    /// Compares every byte of `pool`, a short last block too: each block must hold the source
    /// block last written into it, or its own fill where nothing was.
    pub fn verify(&self, pool: &[u8]) -> Verdict {
        let bs = self.block_size as usize;
        let source = self.source_of(pool.len().div_ceil(bs));
        let mut expected = vec![0u8; bs];
        let mut verdict = Verdict {
            bytes_checked: 0,
            mismatches: 0,
            bad: Vec::new(),
        };
        for (i, got) in pool.chunks(bs).enumerate() {
            let want = &mut expected[..got.len()];
            let (seed, block) = match source[i] {
                u32::MAX => (self.poison_seed, i as u64),
                s => (self.source_seed, s as u64),
            };
            fill_block(seed, block, want);
            verdict.bytes_checked += got.len() as u64;
            if got != &*want {
                verdict.mismatches += 1;
                if verdict.bad.len() < NAMED {
                    let at = got.iter().zip(&*want).position(|(a, b)| a != b);
                    let what = match source[i] {
                        u32::MAX => "its own fill (never written)".to_string(),
                        s => format!("source block {s}"),
                    };
                    verdict.bad.push(format!(
                        "block {i} should hold {what}, first bad byte at +{}",
                        at.unwrap_or(0)
                    ));
                }
            }
        }
        verdict
    }
}

/// Test hook: XORs one byte of a host pool after the timed phase, as a stray write would.
pub fn poke(region: &kvfabric_engine::Region, offset: u64, xor: u8) -> crate::Result<()> {
    if region.device_ptr().is_some() {
        return Err(crate::Error::config(
            "test-corrupt",
            region.location(),
            "the test hook changes host pools only",
        ));
    }
    if offset >= region.len() {
        return Err(crate::Error::config(
            "test-corrupt",
            offset,
            format!("outside the pool of {} bytes", region.len()),
        ));
    }
    // SAFETY: called between rows (no transfer in flight); the byte is inside the region.
    unsafe { region.as_mut_slice()[offset as usize] ^= xor };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_catches_a_single_flipped_byte_and_a_stray_write() {
        let bs = 64;
        let mut src = vec![0u8; bs * 8];
        fill_pool(1, bs, &mut src);
        let mut dst = vec![0u8; bs * 8];
        fill_pool(2, bs, &mut dst);
        dst[3 * bs..4 * bs].copy_from_slice(&src[5 * bs..6 * bs]);
        let exp = Expectation {
            block_size: bs as u64,
            source_seed: 1,
            poison_seed: 2,
            written: vec![(3, 5)],
        };
        let clean = exp.verify(&dst);
        assert_eq!(clean.mismatches, 0);
        assert_eq!(clean.bytes_checked, dst.len() as u64);
        let mut flipped = dst.clone();
        flipped[3 * bs + 7] ^= 1;
        let v = exp.verify(&flipped);
        assert_eq!(v.mismatches, 1);
        assert_eq!(
            v.bad,
            ["block 3 should hold source block 5, first bad byte at +7"]
        );
        let mut stray = dst.clone();
        stray[6 * bs + 2] ^= 0xff;
        stray[3 * bs] ^= 0xff;
        let v = exp.verify(&stray);
        assert_eq!(v.mismatches, 2);
        assert_eq!(
            v.bad,
            [
                "block 3 should hold source block 5, first bad byte at +0",
                "block 6 should hold its own fill (never written), first bad byte at +2",
            ]
        );
    }

    #[test]
    fn a_short_last_block_is_checked_too() {
        let (bs, len) = (64, 64 * 3 + 10);
        let mut pool = vec![0u8; len];
        fill_pool(4, bs, &mut pool);
        let exp = Expectation {
            block_size: bs as u64,
            source_seed: 1,
            poison_seed: 4,
            written: vec![],
        };
        assert_eq!(exp.verify(&pool).bytes_checked, len as u64);
        assert_eq!(exp.verify(&pool).mismatches, 0);
        pool[len - 1] ^= 1;
        let v = exp.verify(&pool);
        assert_eq!(v.mismatches, 1);
        assert_eq!(
            v.bad,
            ["block 3 should hold its own fill (never written), first bad byte at +9"]
        );
    }

    #[test]
    fn host_blocks_hold_the_gpu_fill_kernels_pattern_and_short_tails_its_first_bytes() {
        let mut block = vec![0u8; 8 * 5 + 3];
        fill_block(99, 7, &mut block);
        for i in 0..5 {
            let word = u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().unwrap());
            assert_eq!(word, pattern_word(99, 7, i as u64));
        }
        assert_eq!(block[40..], pattern_word(99, 7, 5).to_le_bytes()[..3]);
        let mut other = block.clone();
        fill_block(99, 8, &mut other);
        assert_ne!(block, other, "blocks differ");
    }
}
