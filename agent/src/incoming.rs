//! Accept loops for the agent's gRPC servers: which connections keep a slot, how long a new one
//! may take to prove itself, and a back-off when the process is out of file descriptors.
//!
//! A listener that waits for a free slot is a listener a stranger can fill: 2000 idle
//! connections (or ones that stop after the HTTP/2 preface) once kept every peer's Handshake
//! waiting in the kernel's backlog past its deadline. So the loop never stops accepting. Each
//! connection is entered in a [`Table`] (`kvfabric_rt::admission`, the engine's data ports use
//! the same) under its [`Source`]; until it proves itself ([`Policy`]: the peer API wants an
//! authenticated request, the local API a first byte) it can be shed to make room for a newcomer
//! — its source's oldest when that source is at its quota, else the heaviest source's oldest —
//! and it is closed at its policy's deadline. A proven connection is never shed; when every slot
//! holds one the newcomer is refused. All of it is counted in
//! `kvfabric_agent_connections_shed_total{port, reason}`.
//!
//! At the fd limit `accept` fails at once, again and again; a loop that retries straight away
//! spins a core and floods the log, and one that gives up stops serving. Here it sleeps (10 ms
//! doubling to 1 s), logs once a second at most, and serves again as soon as descriptors are
//! free.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use kvfabric_rt::admission::{self, Admitted, Limits};
use kvfabric_rt::{AcceptBackoff, Throttle};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{Notify, futures::OwnedNotified, watch};
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};
use tracing::{debug, warn};

use crate::metrics::Shedding;

/// How long a new connection to the local API may stay silent before it is closed.
pub const FIRST_BYTE_DEADLINE: Duration = Duration::from_secs(10);
/// Most connections each gRPC server keeps open at once.
pub const MAX_LOCAL_CONNECTIONS: usize = 1024;
pub const MAX_PEER_CONNECTIONS: usize = 1024;
/// How long a peer API connection may go without an authenticated request (TLS handshake
/// included) before it is closed. A peer dials to make a call, so it needs a round trip or
/// four; a stranger gets no longer than this to hold a slot.
pub const PEER_AUTH_DEADLINE: Duration = Duration::from_secs(5);
/// Most peer API connections not yet authenticated, in all and from one source.
pub const MAX_PEER_UNAUTHENTICATED: usize = 256;
pub const MAX_PEER_UNAUTHENTICATED_PER_SOURCE: usize = 32;

/// Where a connection comes from, for per-source quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// An IPv4 address, or an IPv6 /64 (a host is given a whole /64 and may use any of it).
    Ip(IpAddr),
    /// A local process, by SO_PEERCRED. A process in a pid namespace the agent cannot see
    /// (another pod) has pid 0: such processes share their uid's quota.
    Process { uid: u32, pid: i32 },
    /// The kernel would not say.
    Unknown,
}

impl Source {
    pub fn ip(ip: IpAddr) -> Source {
        match ip.to_canonical() {
            IpAddr::V6(v6) => Source::Ip(IpAddr::V6(Ipv6Addr::from_bits(
                v6.to_bits() & (!0u128 << 64),
            ))),
            v4 => Source::Ip(v4),
        }
    }

    /// The process at the other end of a Unix socket.
    pub fn peer_process(s: &UnixStream) -> Source {
        match s.peer_cred() {
            Ok(c) => Source::Process {
                uid: c.uid(),
                pid: c.pid().unwrap_or(0),
            },
            Err(_) => Source::Unknown,
        }
    }
}

/// The table of one listener's connections; the handle that sheds one wakes its reader.
pub type Table = admission::Table<Source, Arc<Notify>>;
pub type Admission = admission::Admission<Source, Arc<Notify>>;

/// What one listener lets in.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// For logs: "peer API".
    pub what: &'static str,
    /// The `port` label of the shedding metric.
    pub port: &'static str,
    pub limits: Limits,
    /// An unproven connection is closed this long after it was accepted.
    pub deadline: Duration,
    /// Its first byte proves a connection (the local API: whoever may open the socket may use
    /// it). Otherwise a request must ([`authenticated`]).
    pub first_byte_proves: bool,
}

/// The local API: a connection that has spoken keeps its slot.
pub const LOCAL: Policy = Policy {
    what: "local API",
    port: "local",
    limits: Limits {
        total: MAX_LOCAL_CONNECTIONS,
        unproven: MAX_LOCAL_CONNECTIONS,
        unproven_per_source: MAX_LOCAL_CONNECTIONS,
    },
    deadline: FIRST_BYTE_DEADLINE,
    first_byte_proves: true,
};

/// The peer API: a connection keeps its slot once a request on it was authenticated.
pub const PEER: Policy = Policy {
    what: "peer API",
    port: "peer",
    limits: Limits {
        total: MAX_PEER_CONNECTIONS,
        unproven: MAX_PEER_UNAUTHENTICATED,
        unproven_per_source: MAX_PEER_UNAUTHENTICATED_PER_SOURCE,
    },
    deadline: PEER_AUTH_DEADLINE,
    first_byte_proves: false,
};

/// An accepted connection, in its listener's table until it closes; cut if it is shed or does
/// not prove itself in time.
#[derive(Debug)]
pub struct Capped<T> {
    io: T,
    admission: Arc<Admission>,
    /// Until the connection is proven: its deadline, and the notice that it was shed.
    unproven: Option<Unproven>,
    first_byte_proves: bool,
    /// Why it was cut, answered to every read after.
    cut: Option<io::ErrorKind>,
    closed: watch::Sender<bool>,
}

#[derive(Debug)]
struct Unproven {
    deadline: Pin<Box<tokio::time::Sleep>>,
    shed: Pin<Box<OwnedNotified>>,
    deadlines: Counter,
}

impl<T> Drop for Capped<T> {
    fn drop(&mut self) {
        let _ = self.closed.send(true);
    }
}

/// Which connection a request came on, for what must not outlive it (segments a worker
/// registered are released when its connection closes — when the worker dies) and for marking
/// it authenticated.
#[derive(Debug, Clone)]
pub struct Connection<I> {
    /// What the transport knows of the peer (its credentials on a Unix socket).
    pub info: I,
    closed: watch::Receiver<bool>,
    /// Weak: the table entry goes when the connection closes, not when the last request's
    /// extensions are dropped.
    admission: Weak<Admission>,
}

impl<I> Connection<I> {
    /// Resolves once the connection has closed.
    pub async fn closed(mut self) {
        let _ = self.closed.wait_for(|c| *c).await;
    }

    /// The connection proved itself: never shed, no deadline. False when it was shed first.
    pub fn prove(&self) -> bool {
        self.admission.upgrade().is_some_and(|a| a.proven())
    }
}

/// Marks the peer API connection a request came on as authenticated (the request's peer token
/// checked out, or it came over mTLS).
pub fn authenticated(extensions: &tonic::Extensions) {
    // Over TLS (done by the agent, `PeerTls::accept`) only the TLS stream's info is there.
    let tls = extensions.get::<TlsConnectInfo<Connection<TcpConnectInfo>>>();
    if let Some(c) = extensions
        .get::<Connection<TcpConnectInfo>>()
        .or_else(|| tls.map(TlsConnectInfo::get_ref))
    {
        c.prove();
    }
}

/// Whether a request came over TLS from a client that presented a certificate (the peer API's
/// TLS requires one of the fabric's CA, so the handshake checked it).
pub fn client_certificate(extensions: &tonic::Extensions) -> bool {
    extensions
        .get::<TlsConnectInfo<Connection<TcpConnectInfo>>>()
        .and_then(TlsConnectInfo::peer_certs)
        .is_some_and(|certs| !certs.is_empty())
}

impl<T: AsyncRead + Unpin> AsyncRead for Capped<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(kind) = this.cut {
            return Poll::Ready(Err(kind.into()));
        }
        if let Some(u) = this.unproven.as_mut() {
            // The shed notice first: a connection shed while it proved itself is closing.
            let cut = if u.shed.as_mut().poll(cx).is_ready() {
                Some((io::ErrorKind::ConnectionAborted, "shed to make room"))
            } else if this.admission.is_proven() {
                this.unproven = None;
                None
            } else if u.deadline.as_mut().poll(cx).is_ready() {
                u.deadlines.inc();
                Some((io::ErrorKind::TimedOut, "not proven within the deadline"))
            } else {
                None
            };
            if let Some((kind, why)) = cut {
                this.cut = Some(kind);
                this.unproven = None;
                return Poll::Ready(Err(io::Error::new(kind, why)));
            }
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if this.first_byte_proves
            && this.unproven.is_some()
            && matches!(polled, Poll::Ready(Ok(())))
            && buf.filled().len() > before
            && this.admission.proven()
        {
            this.unproven = None;
        }
        polled
    }
}

crate::write_through::write_through!(Capped);

impl<T: Connected> Connected for Capped<T> {
    type ConnectInfo = Connection<T::ConnectInfo>;
    fn connect_info(&self) -> Self::ConnectInfo {
        Connection {
            info: self.io.connect_info(),
            closed: self.closed.subscribe(),
            admission: Arc::downgrade(&self.admission),
        }
    }
}

/// Something that accepts connections (a TCP or Unix listener).
pub trait Accept: Send + 'static {
    type Io: Send + 'static;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(Self::Io, Source)>>;
}

impl Accept for TcpListener {
    type Io = TcpStream;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(TcpStream, Source)>> {
        TcpListener::poll_accept(self, cx).map_ok(|(s, addr)| (s, Source::ip(addr.ip())))
    }
}

impl Accept for UnixListener {
    type Io = UnixStream;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(UnixStream, Source)>> {
        UnixListener::poll_accept(self, cx).map_ok(|(s, _)| {
            let source = Source::peer_process(&s);
            (s, source)
        })
    }
}

/// The connections a listener accepts under `policy` (see the module comment), backing off on
/// accept errors (counted in `refused`).
pub fn capped<L: Accept>(
    listener: L,
    policy: Policy,
    shedding: Shedding,
    refused: Counter,
) -> impl Stream<Item = io::Result<Capped<L::Io>>> {
    struct Loop<L> {
        listener: L,
        table: Table,
        policy: Policy,
        shedding: Shedding,
        refused: Counter,
        backoff: AcceptBackoff,
        log: Throttle,
    }
    let state = Loop {
        listener,
        table: Table::new(policy.limits),
        policy,
        shedding,
        refused,
        backoff: AcceptBackoff::new(policy.what),
        log: Throttle::new(Duration::from_secs(10)),
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            let (io, source) = match std::future::poll_fn(|cx| s.listener.poll_accept(cx)).await {
                Ok(accepted) => {
                    s.backoff.succeeded();
                    accepted
                }
                Err(e) => {
                    s.refused.inc();
                    tokio::time::sleep(s.backoff.failed(&e)).await;
                    continue;
                }
            };
            let shed = Arc::new(Notify::new());
            let admission = match s.table.admit(source, shed.clone()) {
                Ok(Admitted { admission, shed }) => {
                    if shed > 0 {
                        s.shedding.room.inc_by(shed as u64);
                        if let Some(held_back) = s.log.allow() {
                            debug!(
                                listener = s.policy.what,
                                newcomer = ?source,
                                held_back,
                                "unproven connections shed to make room"
                            );
                        }
                    }
                    admission
                }
                Err(admission::Full) => {
                    s.shedding.full.inc();
                    if let Some(held_back) = s.log.allow() {
                        warn!(
                            listener = s.policy.what,
                            ?source,
                            limit = s.policy.limits.total,
                            held_back,
                            "connection refused: every slot is held by a proven connection"
                        );
                    }
                    continue;
                }
            };
            let conn = Capped {
                io,
                admission: Arc::new(admission),
                unproven: Some(Unproven {
                    deadline: Box::pin(tokio::time::sleep(s.policy.deadline)),
                    shed: Box::pin(shed.notified_owned()),
                    deadlines: s.shedding.deadline.clone(),
                }),
                first_byte_proves: s.policy.first_byte_proves,
                cut: None,
                closed: watch::channel(false).0,
            };
            return Some((Ok(conn), s));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_is_one_source_per_64_and_mapped_ipv4_is_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::7".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Source::ip(a), Source::ip(b));
        assert_ne!(Source::ip(a), Source::ip(c));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(Source::ip(mapped), Source::Ip("10.0.0.1".parse().unwrap()));
    }
}
