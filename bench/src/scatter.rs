//! A pool of cold memory read and written at random block places with vectored I/O: the raw TCP
//! ceiling streams through the same access pattern as the row, minus kvfabric's framing.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Blocks handed to one readv/writev.
const PER_CALL: usize = 64;

#[derive(Debug)]
pub struct Scatter {
    buf: Vec<u8>,
    block: usize,
    order: Vec<usize>,
    rng: SmallRng,
}

impl Scatter {
    /// `bytes` of real data (touched, never zero pages), cut into `block`-sized places.
    pub fn new(bytes: usize, block: usize, seed: u64) -> Scatter {
        let block = block.clamp(1, bytes.max(1));
        let mut buf = vec![0u8; bytes.max(block)];
        super::pattern::fill_pool(seed, block, &mut buf);
        let blocks = buf.len() / block;
        Scatter {
            buf,
            block,
            order: (0..blocks).collect(),
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// Distinct random block indices for one call.
    fn pick(&mut self) -> usize {
        let n = PER_CALL.min(self.order.len());
        for i in 0..n {
            let j = self.rng.random_range(i..self.order.len());
            self.order.swap(i, j);
        }
        n
    }

    /// Writes one batch of random blocks (as many writev calls as it takes); returns its bytes.
    pub fn write_some<W: Write>(&mut self, w: &mut W) -> io::Result<usize> {
        let n = self.pick();
        let mut bufs: Vec<IoSlice<'_>> = self.order[..n]
            .iter()
            .map(|&b| IoSlice::new(&self.buf[b * self.block..(b + 1) * self.block]))
            .collect();
        let mut left: &mut [IoSlice<'_>] = &mut bufs;
        let mut total = 0;
        while !left.is_empty() {
            match w.write_vectored(left) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(k) => {
                    total += k;
                    IoSlice::advance_slices(&mut left, k);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    /// Fills one batch of random blocks (as many readv calls as it takes, less at end of
    /// stream); returns its bytes, 0 only at end of stream.
    pub fn read_some<R: Read>(&mut self, r: &mut R) -> io::Result<usize> {
        let n = self.pick();
        let base = self.buf.as_mut_ptr();
        let mut bufs: Vec<IoSliceMut<'_>> = self.order[..n]
            .iter()
            .map(|&b| {
                // SAFETY: the indices are distinct (a partial shuffle of a permutation) and each
                // block lies inside `buf`, so the slices are disjoint and in bounds.
                let block =
                    unsafe { std::slice::from_raw_parts_mut(base.add(b * self.block), self.block) };
                IoSliceMut::new(block)
            })
            .collect();
        let mut left: &mut [IoSliceMut<'_>] = &mut bufs;
        let mut total = 0;
        while !left.is_empty() {
            match r.read_vectored(left) {
                Ok(0) => break,
                Ok(k) => {
                    total += k;
                    IoSliceMut::advance_slices(&mut left, k);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_whole_blocks_between_random_places() {
        let mut a = Scatter::new(64 * 1024, 1024, 1);
        let mut b = Scatter::new(64 * 1024, 1024, 2);
        let mut wire = Vec::new();
        let n = a.write_some(&mut wire).unwrap();
        assert_eq!(n, 64 * 1024);
        let mut src = &wire[..];
        assert_eq!(b.read_some(&mut src).unwrap(), 64 * 1024);
        // Every block of b now holds some block of a.
        let mut sorted_a: Vec<&[u8]> = a.buf.chunks(1024).collect();
        let mut sorted_b: Vec<&[u8]> = b.buf.chunks(1024).collect();
        sorted_a.sort();
        sorted_b.sort();
        assert_eq!(sorted_a, sorted_b);
    }
}
