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

/// Reads exactly `need` bytes into `buf`, growing it only as bytes arrive (to at most twice what
/// has arrived, or 64 KiB): a header that promises much makes us hold little until the peer has
/// sent it. `buf` keeps its capacity for the next frame.
pub(crate) fn read_to_len<R: Read>(r: &mut R, buf: &mut Vec<u8>, need: usize) -> io::Result<()> {
    buf.clear();
    extend_to_len(r, buf, need)
}

/// [`read_to_len`] after what `buf` holds already: reads until it holds `need` bytes.
pub(crate) fn extend_to_len<R: Read>(r: &mut R, buf: &mut Vec<u8>, need: usize) -> io::Result<()> {
    const AHEAD: usize = 64 << 10;
    while buf.len() < need {
        let have = buf.len();
        let next = have + (need - have).min(have.max(AHEAD));
        buf.resize(next, 0);
        r.read_exact(&mut buf[have..])?;
    }
    Ok(())
}

/// Reads a control body of a length the header decoder has already bounded.
pub(crate) fn read_body<R: Read>(r: &mut R, len: u64) -> io::Result<Vec<u8>> {
    let need = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    let mut body = Vec::new();
    read_to_len(r, &mut body, need)?;
    Ok(body)
}

/// Polls `fd` for bytes to read without sleeping, for at most `window` (and never past
/// `deadline`, if any): true as soon as it is readable (or hung up), false when the window ends
/// first. A reply due within microseconds then costs no sleep and wake-up of the waiting thread.
pub(crate) fn spin_until_readable(
    fd: impl std::os::fd::AsFd,
    window: Duration,
    deadline: Option<Instant>,
) -> io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    if window.is_zero() {
        return Ok(false);
    }
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // Past a second a reply is not due within microseconds: polling longer only burns the core.
    let end = Instant::now() + window.min(Duration::from_secs(1));
    let until = deadline.map_or(end, |d| d.min(end));
    while Instant::now() < until {
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        match poll(&mut fds, Some(&zero)) {
            // Yield, not just spin: a peer spinning on the same core must get to answer.
            Ok(0) | Err(rustix::io::Errno::INTR) => std::thread::yield_now(),
            Ok(_) => return Ok(true),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(false)
}

/// The blocking stream sockets the data plane serves (tcp and Unix).
pub(crate) trait Socket: Read + Write + Sized + Send + 'static {
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    /// Read timeout (None: block for ever).
    fn set_timeout(&self, t: Duration) -> io::Result<()>;
    fn set_send_timeout(&self, t: Duration) -> io::Result<()>;
    fn duplicate(&self) -> io::Result<Self>;
}

macro_rules! socket {
    ($t:ty) => {
        impl Socket for $t {
            fn shutdown(&self, how: Shutdown) -> io::Result<()> {
                <$t>::shutdown(self, how)
            }
            fn set_timeout(&self, t: Duration) -> io::Result<()> {
                self.set_read_timeout(Some(t))
            }
            fn set_send_timeout(&self, t: Duration) -> io::Result<()> {
                <$t>::set_write_timeout(self, Some(t))
            }
            fn duplicate(&self) -> io::Result<Self> {
                self.try_clone()
            }
        }
    };
}
socket!(TcpStream);
socket!(UnixStream);

/// A socket whose reads and writes all end by `deadline`, however the peer paces its bytes
/// (each call gets the time left, not a fresh timeout).
pub(crate) struct Until<'a, S: Socket> {
    pub s: &'a mut S,
    pub deadline: Instant,
}

impl<S: Socket> Until<'_, S> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

impl<S: Socket> Read for Until<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_timeout(left)?;
        self.s.read(buf)
    }
}

impl<S: Socket> Write for Until<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_send_timeout(left)?;
        self.s.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.s.flush()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out `n` bytes and then reports the end.
    struct Trickle(usize);

    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.min(buf.len());
            buf[..n].fill(7);
            self.0 -= n;
            Ok(n)
        }
    }

    #[test]
    fn buffers_grow_with_the_bytes_that_arrived_not_with_the_promise() {
        let mut buf = Vec::new();
        // 2 MiB promised, 100 bytes sent: the buffer never passed the first 64 KiB step.
        let err = read_to_len(&mut Trickle(100), &mut buf, 2 << 20).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(buf.capacity() <= 64 << 10, "{}", buf.capacity());
        // 1 MiB promised, 300 KiB sent: at most twice what arrived.
        let mut buf = Vec::new();
        read_to_len(&mut Trickle(300 << 10), &mut buf, 1 << 20).unwrap_err();
        assert!(
            buf.capacity() <= 2 * (300 << 10) + (64 << 10),
            "{}",
            buf.capacity()
        );
        // Everything sent: exactly the length, every byte.
        let mut buf = Vec::new();
        read_to_len(&mut Trickle(1 << 20), &mut buf, 1 << 20).unwrap();
        assert_eq!(buf.len(), 1 << 20);
        assert!(buf.iter().all(|&b| b == 7));
        assert_eq!(read_body(&mut Trickle(5), 5).unwrap(), [7; 5]);
    }

    #[test]
    fn a_spin_window_sees_bytes_and_hang_ups_without_taking_them() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let ms = Duration::from_millis;
        // Nothing to read: false once the window is over, or at the deadline if that comes first.
        let start = Instant::now();
        assert!(!spin_until_readable(&a, ms(20), None).unwrap());
        assert!(start.elapsed() >= ms(20));
        let start = Instant::now();
        assert!(!spin_until_readable(&a, Duration::MAX, Some(start + ms(20))).unwrap());
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(!spin_until_readable(&a, Duration::ZERO, None).unwrap());
        // A waiting byte is seen and stays for the read that follows.
        b.write_all(b"x").unwrap();
        assert!(spin_until_readable(&a, Duration::MAX, None).unwrap());
        let mut got = [0u8; 1];
        a.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x");
        // A hang-up ends the window too (the read then sees the end).
        drop(b);
        assert!(spin_until_readable(&a, Duration::MAX, None).unwrap());
        assert_eq!(a.read(&mut got).unwrap(), 0);
    }
}
