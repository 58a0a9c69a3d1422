//! Kernel TLS (`setsockopt(TCP_ULP, "tls")`): where the kernel offers it, the data port hands it
//! the traffic secrets rustls' handshake produced, and the kernel seals records as `sendmsg`
//! copies the bytes in and opens them as `recvmsg` copies them out — the work of `tls_record`
//! in the kernel's own copies. Probed once per process on a loopback pair, and opt-in
//! ([`DataTls::kernel_records`]): the dev VM's, CI's and the GPU host's kernels are built
//! without CONFIG_TLS; this path's tests ran on Debian's Linux 6.1 in QEMU (docs/agent.md).
//! The agent's log and `kvfabric status` say which layer seals.
//!
//! What the kernel leaves to us: a record other than application data (the peer's alert or
//! KeyUpdate) fails a plain read with EIO and is then taken, with its type, by `recvmsg`; a
//! KeyUpdate's next secret is set into the kernel (kernels with TLS 1.3 rekey, probed; an older
//! one refuses, and the connection ends with a typed error). A record that fails
//! authentication fails the read with EBADMSG, and the connection is broken.
//!
//! [`DataTls::kernel_records`]: crate::DataTls::kernel_records

use std::io::{self, IoSlice, IoSliceMut, Write};
use std::mem::size_of;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use rustls::ConnectionTrafficSecrets;
use zeroize::Zeroize;

use super::tls_record::{
    ALERT, APPLICATION_DATA, CLOSE_NOTIFY, HANDSHAKE, KEY_UPDATE_NOT_REQUESTED, Keys, MAX_PLAIN,
    RecordError, post_handshake,
};

/// Where the tcp data port's TLS records are sealed and opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordLayer {
    /// In the transport's own threads; the kernel has no TLS (the errno it answered).
    Userspace { kernel_errno: i32 },
    /// In the transport's own threads by configuration, though the kernel offers TLS.
    UserspaceChosen,
    /// By the kernel. `rekey`: it takes a next key at a KeyUpdate (else a KeyUpdate ends the
    /// connection with a typed error).
    Kernel { rekey: bool },
}

impl RecordLayer {
    /// What this kernel offers, probed once per process.
    pub fn probe() -> RecordLayer {
        static PROBED: OnceLock<RecordLayer> = OnceLock::new();
        *PROBED.get_or_init(|| match probe_kernel() {
            Ok(rekey) => RecordLayer::Kernel { rekey },
            Err(e) => RecordLayer::Userspace {
                kernel_errno: e.raw_os_error().unwrap_or(0),
            },
        })
    }

    /// The layer a connection gets: the kernel's where it is offered and `kernel` is wanted.
    pub fn chosen(kernel: bool) -> RecordLayer {
        match RecordLayer::probe() {
            RecordLayer::Kernel { .. } if !kernel => RecordLayer::UserspaceChosen,
            layer => layer,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            RecordLayer::Userspace { kernel_errno } => format!(
                "TLS 1.3 records sealed in userspace (kernel TLS not offered: {})",
                io::Error::from_raw_os_error(*kernel_errno)
            ),
            RecordLayer::UserspaceChosen => {
                "TLS 1.3 records sealed in userspace (kernel TLS offered, not chosen)".into()
            }
            RecordLayer::Kernel { rekey: true } => {
                "TLS 1.3 records sealed by the kernel (kernel TLS, KeyUpdate supported)".into()
            }
            RecordLayer::Kernel { rekey: false } => "TLS 1.3 records sealed by the kernel \
                 (kernel TLS without rekey: a KeyUpdate ends the connection)"
                .into(),
        }
    }
}

/// One direction's key, IV and record sequence in the kernel's terms (`linux/tls.h`); the key
/// bytes are zeroed when it is dropped.
pub(crate) enum CryptoInfo {
    Aes128(libc::tls12_crypto_info_aes_gcm_128),
    Aes256(libc::tls12_crypto_info_aes_gcm_256),
    Chacha(libc::tls12_crypto_info_chacha20_poly1305),
}

fn exact<const N: usize>(bytes: &[u8], what: &str) -> Result<[u8; N], RecordError> {
    bytes
        .try_into()
        .map_err(|_| RecordError::Suite(format!("{what}: {} bytes, not {N}", bytes.len())))
}

/// The suites the data port offers, as the kernel names them.
#[derive(Debug, Clone, Copy)]
enum Cipher {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20Poly1305,
}

impl CryptoInfo {
    pub(crate) fn new(seq: u64, secrets: &ConnectionTrafficSecrets) -> Result<Self, RecordError> {
        let (cipher, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (Cipher::Aes128Gcm, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (Cipher::Aes256Gcm, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (Cipher::Chacha20Poly1305, key, iv)
            }
            _ => return Err(RecordError::Suite("a newer AEAD".into())),
        };
        CryptoInfo::of(seq, cipher, key.as_ref(), iv.as_ref())
    }

    fn of(seq: u64, cipher: Cipher, key: &[u8], iv: &[u8]) -> Result<Self, RecordError> {
        let rec_seq = seq.to_be_bytes();
        let info = |cipher_type| libc::tls_crypto_info {
            version: libc::TLS_1_3_VERSION,
            cipher_type,
        };
        let iv: [u8; 12] = exact(iv, "iv")?;
        // TLS 1.3's 12-byte IV is the kernel's 4-byte salt and 8-byte IV for AES-GCM.
        let (salt, iv8) = iv.split_at(4);
        Ok(match cipher {
            Cipher::Aes128Gcm => CryptoInfo::Aes128(libc::tls12_crypto_info_aes_gcm_128 {
                info: info(libc::TLS_CIPHER_AES_GCM_128),
                iv: exact(iv8, "iv")?,
                key: exact(key, "AES-128-GCM key")?,
                salt: exact(salt, "salt")?,
                rec_seq,
            }),
            Cipher::Aes256Gcm => CryptoInfo::Aes256(libc::tls12_crypto_info_aes_gcm_256 {
                info: info(libc::TLS_CIPHER_AES_GCM_256),
                iv: exact(iv8, "iv")?,
                key: exact(key, "AES-256-GCM key")?,
                salt: exact(salt, "salt")?,
                rec_seq,
            }),
            Cipher::Chacha20Poly1305 => {
                CryptoInfo::Chacha(libc::tls12_crypto_info_chacha20_poly1305 {
                    info: info(libc::TLS_CIPHER_CHACHA20_POLY1305),
                    iv,
                    key: exact(key, "ChaCha20-Poly1305 key")?,
                    salt: [],
                    rec_seq,
                })
            }
        })
    }

    /// The same key from record `seq` on.
    pub(crate) fn at_seq(&mut self, seq: u64) {
        let rec_seq = seq.to_be_bytes();
        match self {
            CryptoInfo::Aes128(i) => i.rec_seq = rec_seq,
            CryptoInfo::Aes256(i) => i.rec_seq = rec_seq,
            CryptoInfo::Chacha(i) => i.rec_seq = rec_seq,
        }
    }

    /// Sets this key for `direction` (`TLS_TX` or `TLS_RX`) of `fd`.
    fn set(&self, fd: BorrowedFd<'_>, direction: libc::c_int) -> io::Result<()> {
        match self {
            CryptoInfo::Aes128(i) => setsockopt(fd, libc::SOL_TLS, direction, i),
            CryptoInfo::Aes256(i) => setsockopt(fd, libc::SOL_TLS, direction, i),
            CryptoInfo::Chacha(i) => setsockopt(fd, libc::SOL_TLS, direction, i),
        }
    }
}

impl Drop for CryptoInfo {
    fn drop(&mut self) {
        match self {
            CryptoInfo::Aes128(i) => (i.key.zeroize(), i.iv.zeroize(), i.salt.zeroize()),
            CryptoInfo::Aes256(i) => (i.key.zeroize(), i.iv.zeroize(), i.salt.zeroize()),
            CryptoInfo::Chacha(i) => (i.key.zeroize(), i.iv.zeroize(), ()),
        };
    }
}

fn setsockopt<T>(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    value: &T,
) -> io::Result<()> {
    // SAFETY: a descriptor borrowed for the call; `value` points to `size_of::<T>()` readable
    // bytes (a `linux/tls.h` struct, a byte string or an int, as the option wants), which the
    // kernel only reads.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The "tls" upper layer on a connected socket; ENOENT where the kernel was built without
/// CONFIG_TLS. A socket with it and no key set still reads and writes plain bytes.
fn ulp(fd: BorrowedFd<'_>) -> io::Result<()> {
    setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_ULP, b"tls")
}

/// Whether the kernel takes TLS 1.3 keys (AES-128-GCM, the suite the data port prefers) on a
/// connected loopback pair, and a second sending key (rekey).
fn probe_kernel() -> io::Result<bool> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let s = TcpStream::connect(l.local_addr()?)?;
    let _peer = l.accept()?;
    ulp(s.as_fd())?;
    let info =
        CryptoInfo::of(0, Cipher::Aes128Gcm, &[7; 16], &[9; 12]).map_err(io::Error::other)?;
    info.set(s.as_fd(), libc::TLS_TX)?;
    info.set(s.as_fd(), libc::TLS_RX)?;
    Ok(info.set(s.as_fd(), libc::TLS_TX).is_ok())
}

/// Gives the kernel the sending key. Where it refuses, the socket is as it was: the records
/// can still be sealed in userspace.
pub(crate) fn hand_over_tx(sock: &TcpStream, tx: &CryptoInfo) -> io::Result<()> {
    ulp(sock.as_fd())?;
    tx.set(sock.as_fd(), libc::TLS_TX)
}

/// Gives the kernel the receiving key (after [`hand_over_tx`], with the socket at a record
/// boundary). A refusal now ends the connection: the sending key cannot be taken back.
pub(crate) fn hand_over_rx(sock: &TcpStream, rx: &CryptoInfo) -> io::Result<()> {
    // Not TLS_RX_EXPECT_NO_PAD: with it the kernel decrypts straight into the reader's
    // buffer, and a record that then fails authentication leaves its bytes there (seen on
    // Linux 6.1); without it a tampered record lands no byte, as in userspace.
    rx.set(sock.as_fd(), libc::TLS_RX)
}

/// The kernel's word on a record it refused, as the userspace layer would say it.
fn kernel_error(e: io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(libc::EBADMSG) => RecordError::KernelAuthentication.into(),
        Some(errno @ (libc::EMSGSIZE | libc::EINVAL | libc::EPROTO | libc::ENOMSG)) => {
            RecordError::KernelRecord { errno }.into()
        }
        _ => e,
    }
}

/// The receiving direction when the kernel opens the records.
pub(crate) struct KernelRx {
    keys: Arc<Keys>,
    /// Plaintext opened in userspace before the kernel took over (what came right behind the
    /// handshake), handed out first.
    held: Vec<u8>,
    at: usize,
    /// Key updates so far.
    pub(crate) updates: u64,
    closed: bool,
    broken: bool,
}

impl KernelRx {
    pub(crate) fn new(keys: Arc<Keys>, held: Vec<u8>) -> KernelRx {
        KernelRx {
            keys,
            held,
            at: 0,
            updates: 0,
            closed: false,
            broken: false,
        }
    }

    /// Plaintext (or the peer's close) can be handed out without reading the socket.
    pub(crate) fn ready(&self) -> bool {
        self.at < self.held.len() || self.closed
    }

    /// Reads plaintext into `dst`; Ok(0) once the peer sent close_notify or closed.
    pub(crate) fn read(
        &mut self,
        fd: BorrowedFd<'_>,
        dst: &mut [IoSliceMut<'_>],
        flags: rustix::net::RecvFlags,
    ) -> io::Result<usize> {
        if dst.iter().all(|d| d.is_empty()) {
            return Ok(0);
        }
        loop {
            if self.broken {
                return Err(RecordError::Broken.into());
            }
            if self.at < self.held.len() {
                let mut n = 0;
                for d in dst.iter_mut() {
                    let k = d.len().min(self.held.len() - self.at);
                    d[..k].copy_from_slice(&self.held[self.at..self.at + k]);
                    self.at += k;
                    n += k;
                }
                if self.at == self.held.len() {
                    self.held = Vec::new();
                    self.at = 0;
                }
                return Ok(n);
            }
            if self.closed {
                return Ok(0);
            }
            let mut control = rustix::net::RecvAncillaryBuffer::default();
            match rustix::net::recvmsg(fd, dst, &mut control, flags) {
                Ok(r) => return Ok(r.bytes),
                Err(rustix::io::Errno::IO) => {
                    if let Err(e) = self.control(fd) {
                        self.broken = true;
                        return Err(e);
                    }
                }
                Err(e) => {
                    let e = kernel_error(e.into());
                    if e.kind() == io::ErrorKind::InvalidData {
                        self.broken = true;
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Takes the record that is not application data at the head of the socket.
    fn control(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        let mut body = vec![0u8; MAX_PLAIN];
        let (n, content_type) = recv_record(fd, &mut body).map_err(kernel_error)?;
        let body = &body[..n];
        match content_type {
            APPLICATION_DATA => self.held = body.to_vec(),
            ALERT => match body {
                [_, CLOSE_NOTIFY] => self.closed = true,
                [_, description] => {
                    return Err(RecordError::Alert {
                        description: *description,
                    }
                    .into());
                }
                _ => {
                    return Err(RecordError::ContentType {
                        seq: 0,
                        found: ALERT,
                    }
                    .into());
                }
            },
            HANDSHAKE => post_handshake(body, |requested| {
                let next = self.keys.next_secrets(false)?;
                let info = CryptoInfo::new(next.0, &next.1)?;
                info.set(fd, libc::TLS_RX).map_err(|e| {
                    RecordError::KeyUpdate(format!("the kernel refused the next key: {e}"))
                })?;
                self.updates += 1;
                if requested {
                    self.keys.peer_asked.store(true, Ordering::Release);
                }
                Ok(())
            })?,
            found => return Err(RecordError::ContentType { seq: 0, found }.into()),
        }
        Ok(())
    }
}

impl std::fmt::Debug for KernelTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelTx")
            .field("records", &self.records)
            .field("updates", &self.updates)
            .finish_non_exhaustive()
    }
}

/// The sending direction when the kernel seals the records: it counts them, and updates the
/// key when this one has sealed its share or the peer asked.
pub(crate) struct KernelTx {
    keys: Arc<Keys>,
    /// Records sealed under this key at most (every write counted as whole records).
    records: u64,
    pub(crate) update_after: u64,
    /// Key updates so far.
    pub(crate) updates: u64,
    broken: bool,
}

impl KernelTx {
    pub(crate) fn new(keys: Arc<Keys>) -> KernelTx {
        let update_after = keys.update_after();
        KernelTx {
            keys,
            records: 0,
            update_after,
            updates: 0,
            broken: false,
        }
    }

    /// Before `len` bytes are written: updates the key first when it is due.
    fn before_write(&mut self, fd: BorrowedFd<'_>, len: usize) -> io::Result<()> {
        if self.broken {
            return Err(RecordError::Broken.into());
        }
        if self.records >= self.update_after || self.keys.peer_asked.swap(false, Ordering::AcqRel) {
            self.update(fd).inspect_err(|_| self.broken = true)?;
        }
        self.records = self.records.saturating_add(len.div_ceil(MAX_PLAIN) as u64);
        Ok(())
    }

    /// KeyUpdate(update_not_requested) under the old key, then the next key into the kernel.
    fn update(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        send_record(fd, HANDSHAKE, &KEY_UPDATE_NOT_REQUESTED, false)?;
        let next = self.keys.next_secrets(true)?;
        let info = CryptoInfo::new(next.0, &next.1)?;
        info.set(fd, libc::TLS_TX)
            .map_err(|e| RecordError::KeyUpdate(format!("the kernel refused the next key: {e}")))?;
        self.records = 0;
        self.updates += 1;
        Ok(())
    }

    /// Writes `bufs` for the kernel to seal; a failure leaves the direction unusable.
    pub(crate) fn write_vectored(
        &mut self,
        sock: &TcpStream,
        bufs: &[IoSlice<'_>],
    ) -> io::Result<usize> {
        let len = bufs.iter().map(|b| b.len()).sum();
        self.before_write(sock.as_fd(), len)?;
        let mut s = sock;
        s.write_vectored(bufs).inspect_err(|_| self.broken = true)
    }

    /// Writes all of `bytes` for the kernel to seal; a failure leaves the direction unusable.
    pub(crate) fn write_all(&mut self, sock: &TcpStream, bytes: &[u8]) -> io::Result<()> {
        self.before_write(sock.as_fd(), bytes.len())?;
        let mut s = sock;
        s.write_all(bytes).inspect_err(|_| self.broken = true)
    }

    /// Says close_notify without waiting (best effort).
    pub(crate) fn close_notify(&mut self, fd: BorrowedFd<'_>) {
        if !self.broken {
            let _ = send_record(fd, ALERT, &[1, CLOSE_NOTIFY], true);
        }
        self.broken = true;
    }
}

/// Room for one control message carrying one byte (the record type).
const CMSG_ROOM: usize = 64;

/// One record of `content_type` through the kernel's sealer (`TLS_SET_RECORD_TYPE`).
fn send_record(
    fd: BorrowedFd<'_>,
    content_type: u8,
    body: &[u8],
    dontwait: bool,
) -> io::Result<()> {
    let mut control = [0u64; CMSG_ROOM / 8];
    let mut iov = libc::iovec {
        iov_base: body.as_ptr() as *mut libc::c_void,
        iov_len: body.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(1) } as _;
    // SAFETY: `msg` points at `control`, CMSG_ROOM bytes aligned for cmsghdr, room for the one
    // header and byte CMSG_SPACE(1) counts; CMSG_FIRSTHDR is then non-null.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_TLS;
        (*c).cmsg_type = libc::TLS_SET_RECORD_TYPE;
        (*c).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(c) = content_type;
    }
    let flags = libc::MSG_NOSIGNAL | if dontwait { libc::MSG_DONTWAIT } else { 0 };
    // SAFETY: `msg` and what it points at (`iov` over `body`, `control`) live through the call;
    // the kernel only reads them.
    let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, flags) };
    match usize::try_from(n) {
        Ok(n) if n == body.len() => Ok(()),
        Ok(_) => Err(io::ErrorKind::WriteZero.into()),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

/// The record at the head of the socket with its type (`TLS_GET_RECORD_TYPE`).
fn recv_record(fd: BorrowedFd<'_>, body: &mut [u8]) -> io::Result<(usize, u8)> {
    let mut control = [0u64; CMSG_ROOM / 8];
    let mut iov = libc::iovec {
        iov_base: body.as_mut_ptr().cast(),
        iov_len: body.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM as _;
    // SAFETY: `msg` and what it points at (`iov` over `body`, `control`) live through the call;
    // the kernel writes at most their lengths.
    let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, 0) };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: the kernel filled `msg.msg_control` and set its length; the CMSG macros walk
    // within it, and a header's data is read only where its length covers a byte.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_TLS
                && (*c).cmsg_type == libc::TLS_GET_RECORD_TYPE
                && (*c).cmsg_len as usize >= libc::CMSG_LEN(1) as usize
            {
                return Ok((n, *libc::CMSG_DATA(c)));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "kernel TLS: a record without its type",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_answers_and_says_where_records_are_sealed() {
        let layer = RecordLayer::probe();
        assert_eq!(layer, RecordLayer::probe(), "probed once");
        let text = layer.describe();
        match layer {
            RecordLayer::Userspace { kernel_errno } => {
                assert_ne!(kernel_errno, 0, "{text}");
                assert!(text.contains("userspace"), "{text}");
                assert_eq!(RecordLayer::chosen(true), layer);
            }
            RecordLayer::Kernel { .. } => {
                assert!(text.contains("by the kernel"), "{text}");
                assert_eq!(RecordLayer::chosen(false), RecordLayer::UserspaceChosen);
                assert_eq!(RecordLayer::chosen(true), layer);
            }
            RecordLayer::UserspaceChosen => panic!("the probe never chooses"),
        }
    }

    #[test]
    fn crypto_info_splits_the_iv_as_the_kernel_wants() {
        let iv: Vec<u8> = (1..=12).collect();
        let CryptoInfo::Aes128(i) =
            CryptoInfo::of(0x0102, Cipher::Aes128Gcm, &[3; 16], &iv).expect("valid")
        else {
            panic!("AES-128-GCM")
        };
        assert_eq!(i.info.version, 0x0304);
        assert_eq!(i.info.cipher_type, 51);
        assert_eq!(i.salt, [1, 2, 3, 4]);
        assert_eq!(i.iv, [5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(i.key, [3; 16]);
        assert_eq!(i.rec_seq, [0, 0, 0, 0, 0, 0, 1, 2]);
        let CryptoInfo::Chacha(c) =
            CryptoInfo::of(7, Cipher::Chacha20Poly1305, &[4; 32], &iv).expect("valid")
        else {
            panic!("ChaCha20-Poly1305")
        };
        assert_eq!(c.iv.as_slice(), iv.as_slice());
        assert_eq!(c.info.cipher_type, 54);
        assert!(matches!(
            CryptoInfo::of(0, Cipher::Aes256Gcm, &[3; 16], &iv),
            Err(RecordError::Suite(m)) if m.contains("AES-256-GCM key")
        ));
    }
}
