//! TLS on tcp data connections without changing how the transport uses its socket. The
//! initiator splits each connection into a writer thread and a reader thread on two descriptors
//! of one socket and polls the descriptor for replies; one TLS session (one record sequence per
//! direction, plaintext buffered out of the descriptor's sight) cannot be shared that way. So
//! the session lives in a relay thread that owns it and the network socket, and the transport
//! gets the other end of a loopback connection: every byte it reads was decrypted and
//! authenticated, every byte it writes is encrypted, and its timeouts, polls and shutdowns work
//! on a plain socket as before. The TLS handshake (both certificates checked against the CA)
//! finishes before the transport sees the stream, within the caller's deadline; the data
//! secret's challenge–response then runs inside.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustls::{ClientConnection, Connection, ServerConnection};
use tracing::debug;

use super::io::Until;
use crate::data_tls::DataTls;

/// Plaintext held between the two sockets, each way.
const CHUNK: usize = 64 << 10;
/// After our side closed, how long the peer's last bytes are still read, so that closing does
/// not reset the connection before the peer read what we sent (see `io::hang_up`).
const LINGER: Duration = Duration::from_secs(1);

/// The initiator's side: TLS over `raw`, verifying the target's certificate.
pub(crate) fn client(raw: TcpStream, tls: &DataTls, deadline: Instant) -> io::Result<TcpStream> {
    let now = tls.current();
    let conn = ClientConnection::new(now.client.clone(), now.server_name.clone())
        .map_err(io::Error::other)?;
    relay(raw, conn.into(), deadline)
}

/// The target's side: TLS over `raw`, requiring a client certificate of the CA.
pub(crate) fn server(raw: TcpStream, tls: &DataTls, deadline: Instant) -> io::Result<TcpStream> {
    let conn = ServerConnection::new(tls.current().server.clone()).map_err(io::Error::other)?;
    relay(raw, conn.into(), deadline)
}

fn relay(mut raw: TcpStream, mut conn: Connection, deadline: Instant) -> io::Result<TcpStream> {
    {
        let mut until = Until {
            s: &mut raw,
            deadline,
        };
        while conn.is_handshaking() {
            conn.complete_io(&mut until)?;
        }
        while conn.wants_write() {
            conn.write_tls(&mut until)?;
        }
    }
    let (inner, outer) = loopback_pair(deadline)?;
    raw.set_read_timeout(None)?;
    raw.set_write_timeout(None)?;
    raw.set_nonblocking(true)?;
    outer.set_nonblocking(true)?;
    thread::Builder::new()
        .name("kvf-tls-relay".into())
        .spawn(move || {
            if let Err(e) = pump(conn, &raw, &outer) {
                debug!(error = %e, "tls data connection ended");
            }
            let _ = raw.shutdown(Shutdown::Both);
            let _ = outer.shutdown(Shutdown::Both);
        })?;
    Ok(inner)
}

/// A connected loopback pair. The listener lives only until its one connection is accepted,
/// and a connection from anyone but `inner` is dropped: nothing else can take the place.
fn loopback_pair(deadline: Instant) -> io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    listener.set_nonblocking(true)?;
    let inner = TcpStream::connect(listener.local_addr()?)?;
    let me = inner.local_addr()?;
    loop {
        match listener.accept() {
            Ok((outer, from)) if from == me => {
                inner.set_nodelay(true)?;
                outer.set_nodelay(true)?;
                return Ok((inner, outer));
            }
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if !wait(&mut [PollFd::new(&listener, PollFlags::IN)], Some(deadline))? {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Polls until an event or `until`; false at `until`.
fn wait(fds: &mut [PollFd<'_>], until: Option<Instant>) -> io::Result<bool> {
    loop {
        let timeout = until.map(|u| {
            let left = u.saturating_duration_since(Instant::now());
            Timespec {
                tv_sec: left.as_secs() as _,
                tv_nsec: left.subsec_nanos() as _,
            }
        });
        match poll(fds, timeout.as_ref()) {
            Ok(0) if until.is_some_and(|u| Instant::now() >= u) => return Ok(false),
            Ok(0) => continue,
            Ok(_) => return Ok(true),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

/// Moves bytes between the TLS session on `raw` and the transport's plaintext end `plain`
/// until both directions are closed (or, once the transport closed, the linger ends).
fn pump(mut conn: Connection, mut raw: &TcpStream, mut plain: &TcpStream) -> io::Result<()> {
    // Bounded here instead: plaintext is read only once the session sent what it had.
    conn.set_buffer_limit(None);
    let mut buf = vec![0u8; CHUNK];
    // Decrypted bytes not yet taken by the transport.
    let mut out: Vec<u8> = Vec::new();
    let (mut peer_done, mut local_done) = (false, false);
    let mut plain_shut = false;
    let mut linger_until = None;
    loop {
        while conn.wants_write() {
            match conn.write_tls(&mut raw) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        while !out.is_empty() {
            match plain.write(&out) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    out.drain(..n);
                }
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(e),
            }
        }
        if peer_done && out.is_empty() && !plain_shut {
            let _ = plain.shutdown(Shutdown::Write);
            plain_shut = true;
        }
        if local_done && !conn.wants_write() {
            if peer_done {
                return Ok(());
            }
            let _ = raw.shutdown(Shutdown::Write);
            linger_until.get_or_insert_with(|| Instant::now() + LINGER);
        }

        let mut raw_events = PollFlags::empty();
        if !peer_done && out.len() < CHUNK {
            raw_events |= PollFlags::IN;
        }
        if conn.wants_write() {
            raw_events |= PollFlags::OUT;
        }
        let mut plain_events = PollFlags::empty();
        // Read more plaintext only once the last was sent: the session buffers no more than
        // one chunk, and a peer that stops reading stops the transport's writes.
        if !local_done && !conn.wants_write() {
            plain_events |= PollFlags::IN;
        }
        if !out.is_empty() {
            plain_events |= PollFlags::OUT;
        }
        // Only sockets with something to wait for are polled (a closed one reports HUP for
        // ever, which would spin).
        let mut fds = Vec::with_capacity(2);
        if !raw_events.is_empty() {
            fds.push(PollFd::new(&raw, raw_events));
        }
        if !plain_events.is_empty() {
            fds.push(PollFd::new(&plain, plain_events));
        }
        if fds.is_empty() {
            return Ok(());
        }
        if !wait(&mut fds, linger_until)? {
            return Ok(());
        }
        let mut ready = fds.iter().map(|f| f.revents());
        let raw_ready = if raw_events.is_empty() {
            PollFlags::empty()
        } else {
            ready.next().unwrap_or(PollFlags::empty())
        };
        let plain_ready = ready.next().unwrap_or(PollFlags::empty());
        let any = PollFlags::IN | PollFlags::OUT | PollFlags::HUP | PollFlags::ERR;

        if raw_ready.intersects(any) && raw_events.contains(PollFlags::IN) {
            match conn.read_tls(&mut raw) {
                Ok(0) => peer_done = true,
                Ok(_) => {
                    if let Err(e) = conn.process_new_packets() {
                        // Tell the peer why (the alert), then end.
                        let _ = conn.write_tls(&mut raw);
                        return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                    }
                    loop {
                        match conn.reader().read(&mut buf) {
                            Ok(0) => {
                                peer_done = true;
                                break;
                            }
                            Ok(n) => out.extend_from_slice(&buf[..n]),
                            Err(e) if would_block(&e) => break,
                            Err(e) => return Err(e),
                        }
                    }
                }
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(e),
            }
        }
        if plain_ready.intersects(any) && plain_events.contains(PollFlags::IN) {
            match plain.read(&mut buf) {
                Ok(0) => {
                    conn.send_close_notify();
                    local_done = true;
                }
                Ok(n) => conn.writer().write_all(&buf[..n])?,
                Err(e) if would_block(&e) => {}
                Err(e) => return Err(e),
            }
        }
        if raw_ready.contains(PollFlags::ERR) || plain_ready.contains(PollFlags::ERR) {
            return Err(io::Error::other("socket error"));
        }
    }
}
