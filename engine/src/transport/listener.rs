//! The accept loop shared by the tcp and shm servers: async accept (so a shutdown future can stop
//! it), then one blocking thread per connection for the data path.
//!
//! What a caller can make us hold is bounded: at most `max_connections` connections (threads)
//! per listener, of which at most `max_unauthenticated` still in their handshake, the oldest of
//! those closed when a new caller needs the room (`kvfabric_rt::admission`, the table the
//! agent's ports use too). At the fd limit (EMFILE and friends) the loop backs off instead of
//! spinning on a listener that stays readable, and its warnings are throttled.

use std::future::Future;
use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use super::io::Socket;
use crate::handshake::refuse_busy;
use kvfabric_rt::admission::{self, Admitted, Table};
use kvfabric_rt::{AcceptBackoff, Throttle};

/// A listener whose connections are handed over as blocking sockets.
pub(crate) trait Listener {
    type Stream: Socket;
    /// Accepts one connection; returns it with a name for logs.
    fn next(&self) -> impl Future<Output = io::Result<(Self::Stream, String)>> + Send;
}

impl Listener for tokio::net::TcpListener {
    type Stream = TcpStream;
    async fn next(&self) -> io::Result<(TcpStream, String)> {
        let (stream, peer) = self.accept().await?;
        let stream = stream.into_std()?;
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        Ok((stream, peer.to_string()))
    }
}

impl Listener for tokio::net::UnixListener {
    type Stream = UnixStream;
    async fn next(&self) -> io::Result<(UnixStream, String)> {
        let (stream, _) = self.accept().await?;
        let stream = stream.into_std()?;
        stream.set_nonblocking(false)?;
        let peer = rustix::net::sockopt::socket_peercred(&stream)
            .map(|c| format!("pid {}", c.pid.as_raw_nonzero()))
            .unwrap_or_else(|_| "unix peer".into());
        Ok((stream, peer))
    }
}

/// How many connections a listener serves at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub connections: usize,
    pub unauthenticated: usize,
}

/// A connection's place in its listener's table; released when dropped (the thread ends).
/// Every caller of a data port is one source: the oldest handshake goes first, whoever it is.
/// The handle kept to shed it with is a duplicate of its socket (None when duplicating failed:
/// it then runs into its handshake deadline).
pub(crate) type Admission<S> = admission::Admission<(), Option<S>>;

/// Serves connections until `shutdown` resolves, then shuts every open one down so their
/// threads end.
pub(crate) async fn serve<L, F>(
    listener: L,
    shutdown: impl Future<Output = ()>,
    name: &str,
    limits: Limits,
    serve: F,
) where
    L: Listener,
    F: Fn(L::Stream, String, Admission<L::Stream>) + Send + Sync + 'static,
{
    let serve = Arc::new(serve);
    let table: Table<(), Option<L::Stream>> = Table::new(admission::Limits {
        total: limits.connections,
        unproven: limits.unauthenticated,
        unproven_per_source: limits.unauthenticated,
    });
    let log = Throttle::new(Duration::from_secs(10));
    let mut backoff = AcceptBackoff::new("engine data port");
    tokio::pin!(shutdown);
    loop {
        let (mut stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.next() => match accepted {
                Ok(a) => {
                    backoff.succeeded();
                    a
                }
                Err(e) => {
                    // Out of fds the pending connection stays queued and the listener
                    // readable: wait for others to close theirs.
                    let wait = backoff.failed(&e);
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    continue;
                }
            },
        };
        let admission = match table.admit((), stream.duplicate().ok()) {
            Ok(Admitted { admission, .. }) => admission,
            Err(admission::Full) => {
                if let Some(held_back) = log.allow() {
                    warn!(%peer, listener = name, limit = limits.connections, held_back, "connection refused: at the connection limit");
                }
                // A fresh socket: the few bytes of the refusal fit its buffer, never blocking.
                let _ = stream.set_send_timeout(Duration::from_millis(100));
                refuse_busy(&mut stream);
                continue;
            }
        };
        let serve = serve.clone();
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || serve(stream, peer, admission));
        if let Err(e) = spawned {
            // The closure (and with it the admission and the stream) is dropped.
            if let Some(held_back) = log.allow() {
                warn!(error = %e, listener = name, held_back, "cannot start connection thread");
            }
        }
    }
    table.shed_all();
}
