//! The fd socket beside the local API: a worker sends each memfd here first (SCM_RIGHTS) and
//! names the token it gets back in RegisterSegment (protocol: `kvfabric_proto::fd_wire`).
//!
//! Any local process that may open the socket can connect, as often as it likes, and from as
//! many processes as it can fork; 600 idle connections once took every slot and every other
//! worker's hand-over was reset at accept. So connections are cheap and never wait in line:
//! each is a task that waits for readability (no thread until a request is there, and none
//! then: `recvmsg` on a ready socket does not block), and the accept loop never stops. A
//! connection is *idle* from accept until its first request and between two requests; idle
//! connections are the ones shed (`kvfabric_rt::admission`, the table of the other ports):
//! a process (SO_PEERCRED uid and pid) with [`MAX_IDLE_PER_PROCESS`] idle ones loses its
//! oldest to its next, and at [`MAX_CONNECTIONS`] the oldest idle one of the process with the
//! most goes — a worker's connection, which sends its request at once, is not idle long
//! enough to be the oldest. Only serving a request that has arrived in full makes a connection
//! busy, and that waits for nothing (a reply that does not fit the socket's buffer closes the
//! connection), so a process cannot keep a slot by sending half a request or reading no
//! replies. A connection whose first whole request does not come within
//! [`FIRST_REQUEST_DEADLINE`] (later: [`IDLE_TIMEOUT`] between requests) is closed, and the
//! stash of handed-over fds is purged of expired tokens every [`PURGE_EVERY`]. Shedding is
//! counted in `kvfabric_agent_connections_shed_total{port="fd"}`.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use kvfabric_engine::transport::fdpass::recv_fd_once;
use kvfabric_proto::fd_wire::{MAGIC, encode_reply};
use kvfabric_rt::admission::{self, Admitted, Limits};
use kvfabric_rt::{AcceptBackoff, Throttle};
use rustix::net::SendFlags;
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::incoming::{Admission, Source, Table};
use crate::metrics::Shedding;
use crate::node::Node;

/// Most fd socket connections held at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Most idle ones from one process (a worker needs one at a time); its next sheds its oldest.
pub const MAX_IDLE_PER_PROCESS: usize = 8;
/// How long a new connection may take to send its first request.
pub const FIRST_REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// How long a connection may take to send its next request.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often expired tokens are closed.
pub const PURGE_EVERY: Duration = Duration::from_secs(5);

const LIMITS: Limits = Limits {
    total: MAX_CONNECTIONS,
    unproven: MAX_CONNECTIONS,
    unproven_per_source: MAX_IDLE_PER_PROCESS,
};

/// Serves until `shutdown` resolves, then closes every connection.
pub async fn serve(
    listener: tokio::net::UnixListener,
    node: Arc<Node>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let table = Table::new(LIMITS);
    let shedding = node.metrics.shedding("fd");
    let log = Throttle::new(Duration::from_secs(10));
    let mut backoff = AcceptBackoff::new("fd socket");
    let mut purge = tokio::time::interval(PURGE_EVERY);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            _ = purge.tick() => {
                let closed = node.fds.purge();
                if closed > 0 {
                    info!(closed, "memfds never registered were closed");
                }
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => {
                    backoff.succeeded();
                    s
                }
                Err(e) => {
                    node.metrics.accept_errors.inc();
                    tokio::time::sleep(backoff.failed(&e)).await;
                    continue;
                }
            },
        };
        let source = Source::peer_process(&stream);
        let shed = Arc::new(Notify::new());
        let admission = match table.admit(source, shed.clone()) {
            Ok(Admitted { admission, shed }) => {
                if shed > 0 {
                    shedding.room.inc_by(shed as u64);
                    if let Some(held_back) = log.allow() {
                        debug!(
                            newcomer = ?source,
                            held_back,
                            "fd socket: idle connections shed to make room"
                        );
                    }
                }
                admission
            }
            Err(admission::Full) => {
                // Every slot is serving a request, which takes microseconds: only a burst of
                // them gets here, and its client sees the connection closed.
                shedding.full.inc();
                if let Some(held_back) = log.allow() {
                    warn!(
                        ?source,
                        held_back, "fd socket: connection refused, every slot busy"
                    );
                }
                continue;
            }
        };
        // The sender's pid bounds the fds it may leave waiting (0: another pid namespace).
        let pid = match source {
            Source::Process { pid, .. } => pid,
            _ => 0,
        };
        tokio::spawn(serve_conn(
            stream,
            node.clone(),
            pid,
            Conn {
                admission,
                shed,
                deadlines: shedding.clone(),
            },
        ));
    }
    table.shed_all();
}

/// A connection's place in the table, the notice that it was shed, and where its deadline
/// closes are counted.
struct Conn {
    admission: Admission,
    shed: Arc<Notify>,
    deadlines: Shedding,
}

async fn serve_conn(s: UnixStream, node: Arc<Node>, pid: i32, conn: Conn) {
    let mut wait = FIRST_REQUEST_DEADLINE;
    loop {
        // Idle until a whole request is in: sheddable, and closed at the deadline.
        let request = tokio::select! {
            _ = conn.shed.notified() => return,
            request = tokio::time::timeout(wait, read_request(&s)) => request,
        };
        let (magic, fd) = match request {
            Ok(Ok(Some(request))) => request,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                debug!(error = %e, "fd socket read");
                return;
            }
            Err(_) => {
                conn.deadlines.deadline.inc();
                return;
            }
        };
        // Busy until the reply is sent, which waits for nothing. False: it was shed meanwhile.
        if !conn.admission.proven() {
            return;
        }
        let not_ours = &magic != MAGIC;
        let answer = match (not_ours, fd) {
            (true, _) => Err("not a kvfabric fd request".to_string()),
            (false, None) => Err("no file descriptor attached".to_string()),
            (false, Some(fd)) => node.fds.put(fd, pid).map_err(|e| e.to_string()),
        };
        let reply = encode_reply(answer.as_ref().map(|t| *t).map_err(String::as_str));
        // A worker reads each reply before it sends its next request, so a reply always fits
        // the socket's buffer; when it does not, the peer is not reading them, and waiting for
        // it would hold the slot for nothing.
        match rustix::net::send(&s, &reply, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
            Ok(n) if n == reply.len() => {}
            Ok(_) | Err(_) => {
                debug!("fd socket: the peer does not read its replies; closed");
                return;
            }
        }
        if not_ours {
            // Not our protocol: said so once, hang up.
            return;
        }
        conn.admission.idle();
        wait = IDLE_TIMEOUT;
    }
}

/// One request: the magic and the fd that came with its first byte. None: the peer closed
/// before sending one.
async fn read_request(s: &UnixStream) -> io::Result<Option<([u8; 8], Option<OwnedFd>)>> {
    let mut magic = [0u8; 8];
    let (got, fd) = loop {
        s.readable().await?;
        match s.try_io(Interest::READABLE, || recv_fd_once(s, &mut magic)) {
            Ok(r) => break r,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    if got == 0 {
        return Ok(None);
    }
    // The descriptor came with the first bytes; the rest is plain data.
    let mut filled = got;
    while filled < magic.len() {
        s.readable().await?;
        match s.try_read(&mut magic[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(Some((magic, fd)))
}
