//! Accept loops for the agent's gRPC servers: a cap on open connections, a deadline for a new
//! connection's first byte (one that never speaks gives its slot back), and a back-off when the
//! process is out of file descriptors. At the fd limit `accept` fails at once, again and
//! again; a loop that retries straight away spins a core and floods the log, and one that
//! gives up stops serving. Here it sleeps (10 ms doubling to 1 s), logs once a second at most,
//! and serves again as soon as descriptors are free.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use kvfabric_rt::AcceptBackoff;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tonic::transport::server::Connected;

/// How long a new connection may stay silent before it is closed.
pub const FIRST_BYTE_DEADLINE: Duration = Duration::from_secs(10);

/// An accepted connection that holds one of its listener's connection slots until it closes,
/// and is cut if its first byte does not come in time.
#[derive(Debug)]
pub struct Capped<T> {
    io: T,
    _slot: OwnedSemaphorePermit,
    first_byte: Option<Pin<Box<tokio::time::Sleep>>>,
    closed: watch::Sender<bool>,
}

impl<T> Drop for Capped<T> {
    fn drop(&mut self) {
        let _ = self.closed.send(true);
    }
}

/// Which connection a request came on, for what must not outlive it (segments a worker
/// registered are released when its connection closes — when the worker dies).
#[derive(Debug, Clone)]
pub struct Connection<I> {
    /// What the transport knows of the peer (its credentials on a Unix socket).
    pub info: I,
    closed: watch::Receiver<bool>,
}

impl<I> Connection<I> {
    /// Resolves once the connection has closed.
    pub async fn closed(mut self) {
        let _ = self.closed.wait_for(|c| *c).await;
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Capped<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let Some(deadline) = self.first_byte.as_mut() else {
            return polled;
        };
        match polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => self.first_byte = None,
            Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no byte within the first-byte deadline",
                )));
            }
            _ => {}
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
        }
    }
}

/// Something that accepts connections (a TCP or Unix listener).
pub trait Accept: Send + 'static {
    type Io: Send + 'static;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Io>>;
}

impl Accept for TcpListener {
    type Io = TcpStream;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<TcpStream>> {
        TcpListener::poll_accept(self, cx).map_ok(|(s, _)| s)
    }
}

impl Accept for UnixListener {
    type Io = UnixStream;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<UnixStream>> {
        UnixListener::poll_accept(self, cx).map_ok(|(s, _)| s)
    }
}

/// The connections a listener accepts, at most `cap` open at once (the next one is accepted
/// when one closes; until then the kernel's backlog holds it), backing off on accept errors.
pub fn capped<L: Accept>(
    listener: L,
    what: &'static str,
    cap: usize,
    refused: Counter,
) -> impl Stream<Item = io::Result<Capped<L::Io>>> {
    let slots = Arc::new(Semaphore::new(cap));
    futures::stream::unfold(
        (listener, slots, AcceptBackoff::new(what), refused),
        |(listener, slots, mut backoff, refused)| async move {
            let slot = slots.clone().acquire_owned().await.ok()?;
            loop {
                match std::future::poll_fn(|cx| listener.poll_accept(cx)).await {
                    Ok(io) => {
                        backoff.succeeded();
                        let conn = Capped {
                            io,
                            _slot: slot,
                            first_byte: Some(Box::pin(tokio::time::sleep(FIRST_BYTE_DEADLINE))),
                            closed: watch::channel(false).0,
                        };
                        return Some((Ok(conn), (listener, slots, backoff, refused)));
                    }
                    Err(e) => {
                        refused.inc();
                        tokio::time::sleep(backoff.failed(&e)).await;
                    }
                }
            }
        },
    )
}
