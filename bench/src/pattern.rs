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
/// destination block, poison everywhere else.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Expectation {
    pub block_size: u64,
    pub source_seed: u64,
    pub poison_seed: u64,
    /// (destination block, source block) pairs.
    pub written: Vec<(u32, u32)>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Verdict {
    pub blocks_checked: u64,
    pub mismatches: u64,
    pub first: Option<String>,
}

impl Expectation {
    /// For each of `blocks` destination blocks, the source block written into it, or u32::MAX
    /// where it must still hold poison (the GPU verify kernel's input).
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
            blocks_checked: blocks as u64,
            mismatches: v.bad_words,
            first: v.first_bad_word.map(|w| {
                format!(
                    "{} bad 8-byte words; first in destination block {} at +{}",
                    v.bad_words,
                    w / words,
                    w % words * 8
                )
            }),
        })
    }

    /// Compares every byte of `pool` (including blocks that must still hold poison).
    pub fn verify(&self, pool: &[u8]) -> Verdict {
        let bs = self.block_size as usize;
        let blocks = pool.len() / bs;
        let mut source: Vec<u32> = vec![u32::MAX; blocks];
        for &(d, s) in &self.written {
            if let Some(slot) = source.get_mut(d as usize) {
                *slot = s;
            }
        }
        let mut expected = vec![0u8; bs];
        let mut verdict = Verdict {
            blocks_checked: 0,
            mismatches: 0,
            first: None,
        };
        for (i, got) in pool.chunks_exact(bs).enumerate() {
            let (seed, block, what) = match source[i] {
                u32::MAX => (self.poison_seed, i as u64, "poison (never written)"),
                s => (self.source_seed, s as u64, "source block"),
            };
            fill_block(seed, block, &mut expected);
            verdict.blocks_checked += 1;
            if got != expected.as_slice() {
                verdict.mismatches += 1;
                if verdict.first.is_none() {
                    let at = got
                        .iter()
                        .zip(&expected)
                        .position(|(a, b)| a != b)
                        .unwrap_or(0);
                    verdict.first = Some(format!(
                        "destination block {i} should hold {what} {block}; first bad byte at +{at}"
                    ));
                }
            }
        }
        verdict
    }
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
        assert_eq!(exp.verify(&dst).mismatches, 0);
        let mut flipped = dst.clone();
        flipped[3 * bs + 7] ^= 1;
        let v = exp.verify(&flipped);
        assert_eq!(v.mismatches, 1);
        assert!(v.first.unwrap().contains("+7"));
        let mut stray = dst.clone();
        stray[0] ^= 0xff;
        assert_eq!(exp.verify(&stray).mismatches, 1);
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
