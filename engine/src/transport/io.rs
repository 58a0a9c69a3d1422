//! Blocking vectored I/O that finishes what it starts (std leaves partial reads/writes to us).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

pub(crate) fn write_all_vectored<W: Write>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn read_exact_vectored<R: Read>(
    r: &mut R,
    mut bufs: &mut [IoSliceMut<'_>],
) -> io::Result<()> {
    IoSliceMut::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match r.read_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and throws away `len` bytes, to stay in step with a stream whose payload was refused.
pub(crate) fn discard<R: Read>(r: &mut R, mut len: u64, scratch: &mut Vec<u8>) -> io::Result<()> {
    scratch.resize(1 << 16, 0);
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        r.read_exact(&mut scratch[..n])?;
        len -= n as u64;
    }
    Ok(())
}

/// Reads a control body of a length the header decoder has already bounded.
pub(crate) fn read_body<R: Read>(r: &mut R, len: u64) -> io::Result<Vec<u8>> {
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// The blocking stream sockets the data plane serves (tcp and Unix).
pub(crate) trait Socket: Read + Write + Sized + Send + 'static {
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    fn set_timeout(&self, t: Duration) -> io::Result<()>;
    fn duplicate(&self) -> io::Result<Self>;
}

impl Socket for TcpStream {
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))
    }
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }
}

impl Socket for UnixStream {
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))
    }
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }
}

/// Closes after an error so that the error frame is not lost: closing with unread input makes
/// the kernel send a reset, which discards what we just wrote. Bounded in bytes and in time
/// (in all, not per read: a peer trickling bytes cannot keep us here).
pub(crate) fn hang_up<S: Socket>(s: &mut S) {
    const LINGER: Duration = Duration::from_millis(500);
    let _ = s.shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut scratch = [0u8; 16 << 10];
    let mut left: usize = 16 << 20;
    while left > 0 {
        let now = Instant::now();
        if now >= deadline || s.set_timeout(deadline - now).is_err() {
            break;
        }
        match s.read(&mut scratch) {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}
