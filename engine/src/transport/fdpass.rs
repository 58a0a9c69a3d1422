//! File descriptors over Unix sockets (SCM_RIGHTS): how memfd-backed memory changes hands between
//! processes on one node (the shm transport, and workers registering memory with their agent).

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};

/// Sends `bytes` with `fd` attached to the first of them.
pub fn send_fd(s: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    cmsg.push(SendAncillaryMessage::ScmRights(&fds));
    let n = sendmsg(s, &[IoSlice::new(bytes)], &mut cmsg, SendFlags::NOSIGNAL)?;
    if n < bytes.len() {
        // The descriptor went with the first byte; the rest is plain data.
        (&*s).write_all(&bytes[n..])?;
    }
    Ok(())
}

/// Fills `buf` exactly and returns the descriptor that came with its first bytes, if any.
/// `Ok(None)` with nothing read means the peer closed the socket (`UnexpectedEof`).
pub fn recv_fd(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<Option<OwnedFd>> {
    let (got, fd) = recv_fd_once(s, buf)?;
    if got == 0 && !buf.is_empty() {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    (&*s).read_exact(&mut buf[got..])?;
    Ok(fd)
}

/// One `recvmsg` into `buf`: the bytes read (0: the peer closed) and the descriptor that came
/// with them, if any. For a socket whose reader waits for readiness itself (a non-blocking one
/// answers `WouldBlock`); the rest of `buf` then comes by plain reads.
pub fn recv_fd_once(s: impl AsFd, buf: &mut [u8]) -> std::io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        s,
        &mut [IoSliceMut::new(buf)],
        &mut cmsg,
        RecvFlags::CMSG_CLOEXEC,
    )?
    .bytes;
    let mut fd = None;
    for msg in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            // More than one descriptor is a confused peer; keep the first, close the rest.
            fd = fd.or(fds.into_iter().next());
        }
    }
    Ok((got, fd))
}
