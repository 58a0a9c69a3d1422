//! A pool of cold memory read and written at random block places with vectored I/O: the raw TCP
//! ceiling streams through the same access pattern as the row, minus kvfabric's framing.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Blocks handed to one readv/writev.
const PER_CALL: usize = 64;

/// Writes every buffer (as many writev calls as it takes); returns their bytes.
fn write_all<W: Write>(w: &mut W, bufs: &mut [IoSlice<'_>]) -> io::Result<usize> {
    let mut left = bufs;
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
        write_all(w, &mut bufs)
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

/// One cache-resident buffer streamed through with calls of `repeat` times its size (every
/// iovec of a call names the whole buffer): the kernel's TCP path with no cold memory on either
/// end and as few syscalls as a large vectored call allows.
#[derive(Debug)]
pub struct Hot {
    buf: Vec<u8>,
    repeat: usize,
}

impl Hot {
    pub fn new(bytes: usize, repeat: usize, seed: u64) -> Hot {
        let mut buf = vec![0u8; bytes.max(1)];
        super::pattern::fill_pool(seed, buf.len(), &mut buf);
        Hot {
            buf,
            repeat: repeat.clamp(1, 1024),
        }
    }

    fn call_bytes(&self) -> usize {
        self.buf.len() * self.repeat
    }

    pub fn write_some(&mut self, w: &mut TcpStream) -> io::Result<usize> {
        let mut bufs = vec![IoSlice::new(&self.buf); self.repeat];
        write_all(w, &mut bufs)
    }

    /// Reads up to one call's bytes, every iovec into the same buffer (less at end of stream);
    /// 0 only at end of stream. readv(2) itself, since Rust's `IoSliceMut`s may not alias.
    pub fn read_some(&mut self, r: &mut TcpStream) -> io::Result<usize> {
        let (len, want) = (self.buf.len(), self.call_bytes());
        let mut got = 0;
        while got < want {
            let skip = got % len;
            let iov: Vec<libc::iovec> = (0..(want - got).div_ceil(len).min(self.repeat))
                .map(|i| {
                    let from = if i == 0 { skip } else { 0 };
                    libc::iovec {
                        // SAFETY: in bounds of `buf` (from < len).
                        iov_base: unsafe { self.buf.as_mut_ptr().add(from) }.cast(),
                        iov_len: len - from,
                    }
                })
                .collect();
            // SAFETY: every iovec lies inside `buf`, which outlives the call; the kernel writes
            // them one after another, so names of the same bytes are harmless.
            let n = unsafe { libc::readv(r.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
            match n {
                0 => break,
                n if n > 0 => got += n as usize,
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(got)
    }
}

/// What one end of a raw ceiling stream reads and writes.
#[derive(Debug)]
pub enum RawPool {
    Scatter(Scatter),
    Hot(Hot),
}

impl RawPool {
    /// A `Hot` buffer when `repeat` > 1, else a `Scatter` pool of `bytes` in `block` places.
    pub fn new(bytes: usize, block: usize, repeat: usize, seed: u64) -> RawPool {
        if repeat > 1 {
            RawPool::Hot(Hot::new(bytes, repeat, seed))
        } else {
            RawPool::Scatter(Scatter::new(bytes, block, seed))
        }
    }

    pub fn write_some(&mut self, w: &mut TcpStream) -> io::Result<usize> {
        match self {
            RawPool::Scatter(s) => s.write_some(w),
            RawPool::Hot(h) => h.write_some(w),
        }
    }

    pub fn read_some(&mut self, r: &mut TcpStream) -> io::Result<usize> {
        match self {
            RawPool::Scatter(s) => s.read_some(r),
            RawPool::Hot(h) => h.read_some(r),
        }
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

    #[test]
    fn a_hot_stream_moves_whole_calls_through_one_buffer() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let mut tx = Hot::new(4096, 8, 3);
        let mut rx = Hot::new(4096, 8, 4);
        let sent = std::thread::spawn(move || {
            let n = tx.write_some(&mut a).unwrap();
            drop(a);
            (n, tx.buf)
        });
        let mut got = 0;
        loop {
            match rx.read_some(&mut b).unwrap() {
                0 => break,
                n => got += n,
            }
        }
        let (n, buf) = sent.join().unwrap();
        assert_eq!((n, got), (8 * 4096, 8 * 4096));
        assert_eq!(
            rx.buf, buf,
            "the last copy of the buffer is what the reader holds"
        );
    }
}
