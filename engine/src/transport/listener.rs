//! The accept loop shared by the tcp and shm servers: async accept (so a shutdown future can stop
//! it), then one blocking thread per connection for the data path.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use tracing::warn;

use super::io::Socket;

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

/// Serves connections until `shutdown` resolves, then shuts every open one down so their
/// threads end.
pub(crate) async fn serve<L, F>(
    listener: L,
    shutdown: impl Future<Output = ()>,
    name: &str,
    serve: F,
) where
    L: Listener,
    F: Fn(L::Stream, String) + Send + Sync + 'static,
{
    let serve = Arc::new(serve);
    let live: Arc<Mutex<HashMap<u64, L::Stream>>> = Arc::default();
    let mut next = 0u64;
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.next() => match accepted {
                Ok(a) => a,
                Err(e) => { warn!(error = %e, listener = name, "accept failed"); continue; }
            },
        };
        next += 1;
        let id = next;
        if let Ok(clone) = stream.duplicate() {
            live.lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, clone);
        }
        let (serve, live) = (serve.clone(), live.clone());
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                serve(stream, peer);
                live.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            });
        if let Err(e) = spawned {
            warn!(error = %e, listener = name, "cannot start connection thread");
        }
    }
    for (_, s) in live.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        let _ = s.shutdown(Shutdown::Both);
    }
}
