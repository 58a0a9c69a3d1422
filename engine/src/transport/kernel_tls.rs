//! Whether this kernel offers TLS offload (`setsockopt(TCP_ULP, "tls")`), probed once on a
//! loopback pair, so the agent can say where the data port's records are sealed. The hand-over
//! of the secrets to the kernel is not implemented: where the kernel offers it, records are
//! still sealed in userspace, and [`RecordLayer::describe`] says so.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// Where the tcp data port's TLS records are sealed and opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordLayer {
    /// In the transport's own threads; the kernel has no TLS (the errno it answered).
    Userspace { kernel_errno: i32 },
    /// In the transport's own threads, though the kernel offers TLS offload.
    UserspaceKernelOffered,
}

impl RecordLayer {
    /// Probed once per process.
    pub fn probe() -> RecordLayer {
        static PROBED: OnceLock<RecordLayer> = OnceLock::new();
        *PROBED.get_or_init(|| match ulp_tls() {
            Ok(()) => RecordLayer::UserspaceKernelOffered,
            Err(e) => RecordLayer::Userspace {
                kernel_errno: e.raw_os_error().unwrap_or(0),
            },
        })
    }

    pub fn describe(&self) -> String {
        match self {
            RecordLayer::Userspace { kernel_errno } => format!(
                "TLS 1.3 records sealed in userspace (kernel TLS not offered: {})",
                std::io::Error::from_raw_os_error(*kernel_errno)
            ),
            RecordLayer::UserspaceKernelOffered => "TLS 1.3 records sealed in userspace \
                 (kernel TLS offered; handing the secrets to it is not implemented)"
                .into(),
        }
    }
}

/// Asks for the "tls" upper layer on a connected loopback socket (it needs an established
/// connection); ENOENT where the kernel was built without CONFIG_TLS.
fn ulp_tls() -> std::io::Result<()> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let s = TcpStream::connect(l.local_addr()?)?;
    let _peer = l.accept()?;
    let name = b"tls";
    // SAFETY: a valid socket descriptor, a pointer to `name` with its length; the kernel only
    // reads it.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_ULP,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_answers_and_says_where_records_are_sealed() {
        let layer = RecordLayer::probe();
        assert_eq!(layer, RecordLayer::probe(), "probed once");
        let text = layer.describe();
        assert!(text.contains("userspace"), "{text}");
        if let RecordLayer::Userspace { kernel_errno } = layer {
            // This machine's kernels are built without CONFIG_TLS.
            assert_ne!(kernel_errno, 0, "{text}");
        }
    }
}
