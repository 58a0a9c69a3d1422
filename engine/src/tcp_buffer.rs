//! How large the kernel buffers of a tcp data connection are.
//!
//! Between two processes of one host the kernel copies every byte twice (sender → socket buffer
//! → receiver), and both copies run at cache speed only while the data queued between them fits
//! in the last-level cache. Linux autotunes a loopback connection's receive buffer up to
//! `tcp_rmem[2]` (32 MiB by default), so four connections can queue far more than the cache
//! holds and the receiver's copy then reads from DRAM: raw TCP on the 2-core dev VM, 4 streams,
//! random blocks of a 512 MiB pool, moved 5.0 GB/s autotuned and 6.8–7.1 GB/s with 256 KiB
//! buffers (16 KiB blocks; 1 MiB blocks 3.2–5.6 → 8.8–9.2 GB/s; docs/results.md). Across hosts
//! the NIC writes to memory anyway and a buffer must cover the path's bandwidth-delay product,
//! which only autotuning knows: so the small buffer is for connections whose ends share an
//! address, and elsewhere the kernel decides unless told otherwise.

use std::fmt;
use std::io;
use std::net::TcpStream;
use std::str::FromStr;

use rustix::net::sockopt;

/// A buffer each way on a connection between two processes of one network namespace.
pub const SAME_HOST_BYTES: u32 = 256 << 10;
/// Smallest and largest size `Bytes` takes (the kernel doubles what it is given, and clamps to
/// `net.core.{r,w}mem_max` unless the process may override it).
pub const MIN_BYTES: u32 = 4 << 10;
pub const MAX_BYTES: u32 = 64 << 20;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TcpBuffer {
    /// `SAME_HOST_BYTES` when both ends of the connection have the same address (loopback, or
    /// one host's own address), the kernel's autotuning elsewhere.
    #[default]
    Auto,
    /// The kernel's autotuning on every connection.
    Kernel,
    /// `SO_SNDBUF` and `SO_RCVBUF` of this many bytes on every connection.
    Bytes(u32),
}

impl TcpBuffer {
    /// The size this connection gets, None for autotuning.
    pub fn size_for(self, stream: &TcpStream) -> Option<u32> {
        match self {
            TcpBuffer::Kernel => None,
            TcpBuffer::Bytes(n) => Some(n),
            TcpBuffer::Auto => {
                let same = matches!(
                    (stream.local_addr(), stream.peer_addr()),
                    (Ok(l), Ok(p)) if l.ip() == p.ip()
                );
                same.then_some(SAME_HOST_BYTES)
            }
        }
    }

    /// Sets this connection's buffers (both ends of a connection call it: each owns the
    /// direction it receives and the one it sends).
    pub fn apply(self, stream: &TcpStream) -> io::Result<()> {
        if let Some(n) = self.size_for(stream) {
            sockopt::set_socket_send_buffer_size(stream, n as usize)?;
            sockopt::set_socket_recv_buffer_size(stream, n as usize)?;
        }
        Ok(())
    }

    /// Why this value cannot be used, if it cannot.
    pub fn invalid(self) -> Option<&'static str> {
        match self {
            TcpBuffer::Bytes(n) if !(MIN_BYTES..=MAX_BYTES).contains(&n) => {
                Some("must be 4 KiB to 64 MiB (or auto, or kernel)")
            }
            _ => None,
        }
    }
}

impl fmt::Display for TcpBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TcpBuffer::Auto => f.write_str("auto"),
            TcpBuffer::Kernel => f.write_str("kernel"),
            TcpBuffer::Bytes(n) => write!(f, "{n}"),
        }
    }
}

/// `auto`, `kernel`, or a byte count in bytes (units are the caller's: see
/// `kvfabric_proto::bytesize::parse_tcp_buffer`).
impl FromStr for TcpBuffer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(TcpBuffer::Auto),
            "kernel" => Ok(TcpBuffer::Kernel),
            n => n
                .parse::<u32>()
                .map(TcpBuffer::Bytes)
                .map_err(|_| format!("{s:?} is not auto, kernel or a byte count")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(bind: &str) -> (TcpStream, TcpStream) {
        let l = TcpListener::bind(bind).unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn buffers(s: &TcpStream) -> (usize, usize) {
        (
            sockopt::socket_send_buffer_size(s).unwrap(),
            sockopt::socket_recv_buffer_size(s).unwrap(),
        )
    }

    #[test]
    fn auto_gives_a_loopback_connection_the_same_host_size_on_both_ends() {
        let (c, s) = pair("127.0.0.1:0");
        let before = buffers(&c);
        for end in [&c, &s] {
            assert_eq!(TcpBuffer::Auto.size_for(end), Some(SAME_HOST_BYTES));
            TcpBuffer::Auto.apply(end).unwrap();
            // Linux doubles the value for its bookkeeping.
            let n = 2 * SAME_HOST_BYTES as usize;
            assert_eq!(buffers(end), (n, n), "before: {before:?}");
        }
    }

    #[test]
    fn kernel_leaves_the_buffers_alone() {
        let (c, _s) = pair("127.0.0.1:0");
        let before = buffers(&c);
        TcpBuffer::Kernel.apply(&c).unwrap();
        assert_eq!(buffers(&c), before);
        assert_eq!(TcpBuffer::Kernel.size_for(&c), None);
    }

    #[test]
    fn bytes_are_set_as_given() {
        let (c, _s) = pair("127.0.0.1:0");
        TcpBuffer::Bytes(128 << 10).apply(&c).unwrap();
        assert_eq!(buffers(&c), (256 << 10, 256 << 10));
    }

    #[test]
    fn parse_and_bounds() {
        assert_eq!("auto".parse(), Ok(TcpBuffer::Auto));
        assert_eq!(" kernel ".parse(), Ok(TcpBuffer::Kernel));
        assert_eq!("65536".parse(), Ok(TcpBuffer::Bytes(65536)));
        assert!("64KiB".parse::<TcpBuffer>().is_err());
        assert!("-1".parse::<TcpBuffer>().is_err());
        assert_eq!(
            TcpBuffer::Bytes(65536).to_string().parse(),
            Ok(TcpBuffer::Bytes(65536))
        );
        assert!(TcpBuffer::Bytes(MIN_BYTES - 1).invalid().is_some());
        assert!(TcpBuffer::Bytes(MAX_BYTES + 1).invalid().is_some());
        assert!(TcpBuffer::Bytes(MIN_BYTES).invalid().is_none());
        assert!(TcpBuffer::Auto.invalid().is_none());
    }
}
