//! Blocking vectored I/O that finishes what it starts (std leaves partial reads/writes to us).

use std::io::{self, BufRead, BufReader, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::kernel_tls::KernelRx;
use super::tls_record::Opener;

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

/// A blocking socket whose reads can be made non-blocking (MSG_DONTWAIT) while it stays
/// blocking for everyone else: a reader spinning for its next message fills its read-ahead buffer
/// with the very call that finds the bytes, where polling first costs a second syscall per
/// message (`spin_fill`).
pub(crate) struct SpinReader<S> {
    socket: S,
    dontwait: bool,
    records: Records,
}

/// Who opens the TLS records on the way from the socket to the reader's buffers.
enum Records {
    Plain,
    User(Box<Opener>),
    Kernel(Box<KernelRx>),
}

impl<S> std::fmt::Debug for SpinReader<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinReader")
            .field("tls", &!matches!(self.records, Records::Plain))
            .finish_non_exhaustive()
    }
}

impl<S> SpinReader<S> {
    pub(crate) fn new(socket: S) -> Self {
        SpinReader {
            socket,
            dontwait: false,
            records: Records::Plain,
        }
    }

    pub(crate) fn with_opener(socket: S, opener: Opener) -> Self {
        SpinReader {
            socket,
            dontwait: false,
            records: Records::User(Box::new(opener)),
        }
    }

    pub(crate) fn with_kernel(socket: S, rx: KernelRx) -> Self {
        SpinReader {
            socket,
            dontwait: false,
            records: Records::Kernel(Box::new(rx)),
        }
    }

    pub(crate) fn socket(&self) -> &S {
        &self.socket
    }

    /// Bytes (or the end) are held here already: a poll of the socket would not see them.
    pub(crate) fn ready(&self) -> bool {
        match &self.records {
            Records::Plain => false,
            Records::User(o) => o.ready(),
            Records::Kernel(k) => k.ready(),
        }
    }
}

impl<S: Read + AsFd> Read for SpinReader<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_vectored(&mut [IoSliceMut::new(buf)])
    }

    // Large payload reads go past the read-ahead buffer straight into their destinations.
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let flags = if self.dontwait {
            rustix::net::RecvFlags::DONTWAIT
        } else {
            rustix::net::RecvFlags::empty()
        };
        match &mut self.records {
            Records::Plain => {}
            Records::User(opener) => {
                let socket = &self.socket;
                return opener.read(bufs, |b| Ok(rustix::net::recv(socket, b, flags)?.0));
            }
            Records::Kernel(rx) => return rx.read(self.socket.as_fd(), bufs, flags),
        }
        if self.dontwait {
            let first = bufs.iter_mut().find(|b| !b.is_empty());
            return first.map_or(Ok(0), |b| {
                Ok(rustix::net::recv(&self.socket, &mut b[..], flags)?.0)
            });
        }
        self.socket.read_vectored(bufs)
    }
}

/// Reads ahead into `reader` without sleeping, for at most `window` (and never past `deadline`,
/// if any): true as soon as it holds bytes (or the peer hung up, or the socket failed: the read
/// that follows then sees the end), false when the window ends first. A message due within
/// microseconds then costs no sleep and wake-up of the waiting thread, and no poll(2) besides
/// the read.
pub(crate) fn spin_fill<S: Read + AsFd>(
    reader: &mut BufReader<SpinReader<S>>,
    window: Duration,
    deadline: Option<Instant>,
) -> bool {
    let held = |r: &BufReader<SpinReader<S>>| !r.buffer().is_empty() || r.get_ref().ready();
    if window.is_zero() || held(reader) {
        return held(reader);
    }
    // Past a second a message is not due within microseconds: polling longer only burns the core.
    let start = Instant::now();
    let end = start + window.min(Duration::from_secs(1));
    let until = deadline.map_or(end, |d| d.min(end));
    reader.get_mut().dontwait = true;
    let found = loop {
        match reader.fill_buf() {
            Ok(_) => break true,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break true,
        }
        let now = Instant::now();
        if now >= until {
            break false;
        }
        // Spin, then yield: a peer spinning on the same core must get to answer.
        if now - start < SPIN_PURE {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    };
    reader.get_mut().dontwait = false;
    found
}

/// How long `spin_fill` spins before it yields its core between reads.
const SPIN_PURE: Duration = Duration::from_micros(20);

/// The blocking stream sockets the data plane serves (tcp and Unix).
/// `Shed`: a duplicate shut down from the accept loop wakes the thread serving the original.
pub(crate) trait Socket:
    Read + Write + kvfabric_rt::admission::Shed + Sized + Send + 'static
{
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
    fn a_spin_window_reads_ahead_what_comes_and_leaves_the_socket_blocking() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let mut r = BufReader::with_capacity(64, SpinReader::new(a));
        let ms = Duration::from_millis;
        // Nothing to read: false once the window is over, or at the deadline if that comes first.
        let start = Instant::now();
        assert!(!spin_fill(&mut r, ms(20), None));
        assert!(start.elapsed() >= ms(20));
        let start = Instant::now();
        assert!(!spin_fill(&mut r, Duration::MAX, Some(start + ms(20))));
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(!spin_fill(&mut r, Duration::ZERO, None));
        // What arrives is read ahead by the spin itself and kept for the read that follows.
        b.write_all(b"xy").unwrap();
        assert!(spin_fill(&mut r, Duration::MAX, None));
        assert_eq!(r.buffer(), b"xy");
        assert!(
            spin_fill(&mut r, Duration::ZERO, None),
            "bytes already read ahead count"
        );
        let mut got = [0u8; 2];
        r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"xy");
        // Blocking again after the window: a read waits for the byte written later.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(ms(30));
            b.write_all(b"z").unwrap();
            b
        });
        let mut one = [0u8; 1];
        r.read_exact(&mut one).unwrap();
        assert_eq!(&one, b"z");
        let b = writer.join().unwrap();
        // A hang-up ends the window too (the read then sees the end).
        drop(b);
        assert!(spin_fill(&mut r, Duration::MAX, None));
        assert_eq!(r.read(&mut one).unwrap(), 0);
    }

    #[test]
    fn large_reads_still_go_straight_into_their_buffers() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let mut r = BufReader::with_capacity(16, SpinReader::new(a));
        b.write_all(&[5u8; 4096]).unwrap();
        let (mut x, mut y) = (vec![0u8; 1024], vec![0u8; 3072]);
        let mut bufs = [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)];
        read_exact_vectored(&mut r, &mut bufs).unwrap();
        assert!(x.iter().chain(&y).all(|&v| v == 5));
        assert!(r.buffer().is_empty());
    }
}
