//! The accept loop shared by the tcp and shm servers: async accept (so a shutdown future can stop
//! it), then one blocking thread per connection for the data path.
//!
//! What a caller can make us hold is bounded: at most `max_connections` connections (threads)
//! per listener, of which at most `max_unauthenticated` still in their handshake, the oldest of
//! those closed when a new caller needs the room. At the fd limit (EMFILE and friends) the loop
//! backs off instead of spinning on a listener that stays readable, and its warnings are
//! throttled.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use super::io::Socket;
use crate::handshake::refuse_busy;
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

/// One live connection, as the loop sees it.
#[derive(Debug)]
struct Live<S> {
    /// A handle to shut it down with (shutdown, or eviction).
    stream: Option<S>,
    /// Accepted and not yet through its handshake since then.
    pending: Option<Instant>,
    /// Shut down to make room; its thread is on its way out.
    evicted: bool,
}

#[derive(Debug)]
struct Table<S> {
    live: HashMap<u64, Live<S>>,
}

impl<S: Socket> Table<S> {
    fn counted(&self) -> impl Iterator<Item = &Live<S>> {
        self.live.values().filter(|l| !l.evicted)
    }

    /// Makes room for one more connection: true when there is (or was made) room.
    fn make_room(&mut self, limits: Limits) -> bool {
        let pending = self.counted().filter(|l| l.pending.is_some()).count();
        let total = self.counted().count();
        if pending < limits.unauthenticated && total < limits.connections {
            return true;
        }
        // The oldest caller still in its handshake goes; an authenticated one never does.
        let oldest = self
            .live
            .iter_mut()
            .filter(|(_, l)| !l.evicted)
            .filter_map(|(id, l)| l.pending.map(|at| (at, *id)))
            .min();
        let Some((_, id)) = oldest else {
            return false;
        };
        let l = self.live.get_mut(&id).expect("just found");
        l.evicted = true;
        if let Some(s) = &l.stream {
            let _ = s.shutdown(Shutdown::Both);
        }
        true
    }
}

/// A connection's place in its listener's table; released when dropped (the thread ends).
#[derive(Debug)]
pub(crate) struct Admission<S: Socket> {
    id: u64,
    table: Arc<Mutex<Table<S>>>,
}

impl<S: Socket> Admission<S> {
    /// The caller proved itself: it no longer counts against the handshake limit, and is never
    /// evicted to make room.
    pub(crate) fn authenticated(&self) {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = t.live.get_mut(&self.id) {
            l.pending = None;
        }
    }
}

impl<S: Socket> Drop for Admission<S> {
    fn drop(&mut self) {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .live
            .remove(&self.id);
    }
}

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
    let table: Arc<Mutex<Table<L::Stream>>> = Arc::new(Mutex::new(Table {
        live: HashMap::new(),
    }));
    let log = Throttle::new(Duration::from_secs(10));
    let mut backoff = AcceptBackoff::new("engine data port");
    let mut next = 0u64;
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
        let admitted = table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .make_room(limits);
        if !admitted {
            if let Some(held_back) = log.allow() {
                warn!(%peer, listener = name, limit = limits.connections, held_back, "connection refused: at the connection limit");
            }
            // A fresh socket: the few bytes of the refusal fit its buffer, never blocking.
            let _ = stream.set_send_timeout(Duration::from_millis(100));
            refuse_busy(&mut stream);
            continue;
        }
        next += 1;
        let id = next;
        table.lock().unwrap_or_else(|e| e.into_inner()).live.insert(
            id,
            Live {
                stream: stream.duplicate().ok(),
                pending: Some(Instant::now()),
                evicted: false,
            },
        );
        let admission = Admission {
            id,
            table: table.clone(),
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
    let t = table.lock().unwrap_or_else(|e| e.into_inner());
    for l in t.live.values() {
        if let Some(s) = &l.stream {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}
