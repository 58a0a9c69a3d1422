//! The fd socket beside the local API: a worker sends each memfd here first (SCM_RIGHTS) and
//! names the token it gets back in RegisterSegment (protocol: `kvfabric_proto::fd_wire`).
//!
//! Each connection is served on a blocking thread (SCM_RIGHTS needs `recvmsg`), so connections
//! are bounded: at most [`MAX_CONNECTIONS`] at once and [`MAX_PER_PROCESS`] from one process
//! (more are closed at once, and the client sees an error it can retry), each gets
//! [`IDLE_TIMEOUT`] between requests, and the stash of handed-over fds is purged of expired
//! tokens every [`PURGE_EVERY`].

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfabric_engine::transport::fdpass::recv_fd;
use kvfabric_proto::fd_wire::{MAGIC, encode_reply};
use tokio::sync::Semaphore;
use tracing::{debug, info};

use crate::node::Node;
use kvfabric_rt::AcceptBackoff;

/// Most fd socket connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Most of them from one process (a worker needs one at a time).
pub const MAX_PER_PROCESS: usize = 8;
/// How long a connection may take to send its next request.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often expired tokens are closed.
pub const PURGE_EVERY: Duration = Duration::from_secs(5);

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::UnixListener,
    node: Arc<Node>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_process: Arc<Mutex<HashMap<i32, usize>>> = Arc::default();
    let mut backoff = AcceptBackoff::new("fd socket");
    let mut purge = tokio::time::interval(PURGE_EVERY);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => return,
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!("fd socket: too many connections; one closed");
            continue;
        };
        // The sender's pid bounds its connections and the fds it may leave waiting.
        let pid = rustix::net::sockopt::socket_peercred(&stream)
            .map(|c| c.pid.as_raw_nonzero().get())
            .unwrap_or(0);
        let Some(mine) = ProcessSlot::take(&per_process, pid) else {
            debug!(
                pid,
                "fd socket: too many connections from one process; one closed"
            );
            continue;
        };
        let std = match stream.into_std().and_then(|s| {
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(IDLE_TIMEOUT))?;
            s.set_write_timeout(Some(IDLE_TIMEOUT))?;
            Ok(s)
        }) {
            Ok(s) => s,
            Err(e) => {
                debug!(error = %e, "fd socket connection");
                continue;
            }
        };
        let node = node.clone();
        tokio::task::spawn_blocking(move || {
            serve_conn(std, &node, pid);
            drop((slot, mine));
        });
    }
}

/// One of a process's connection slots, given back on drop.
struct ProcessSlot {
    counts: Arc<Mutex<HashMap<i32, usize>>>,
    pid: i32,
}

impl ProcessSlot {
    fn take(counts: &Arc<Mutex<HashMap<i32, usize>>>, pid: i32) -> Option<ProcessSlot> {
        let mut map = counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(pid).or_default();
        if *n >= MAX_PER_PROCESS {
            return None;
        }
        *n += 1;
        Some(ProcessSlot {
            counts: counts.clone(),
            pid,
        })
    }
}

impl Drop for ProcessSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.pid) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.pid);
            }
        }
    }
}

fn serve_conn(s: UnixStream, node: &Node, pid: i32) {
    loop {
        let mut magic = [0u8; 8];
        let fd = match recv_fd(&s, &mut magic) {
            Ok(fd) => fd,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    debug!(error = %e, "fd socket read");
                }
                return;
            }
        };
        let answer = match (&magic == MAGIC, fd) {
            (false, _) => {
                // Not our protocol: say so once and hang up.
                let _ = reply(&s, Err("not a kvfabric fd request".into()));
                return;
            }
            (true, None) => Err("no file descriptor attached".to_string()),
            (true, Some(fd)) => node.fds.put(fd, pid).map_err(|e| e.to_string()),
        };
        if reply(&s, answer).is_err() {
            return;
        }
    }
}

fn reply(mut s: &UnixStream, answer: std::result::Result<u64, String>) -> std::io::Result<()> {
    s.write_all(&encode_reply(
        answer.as_ref().map(|t| *t).map_err(String::as_str),
    ))
}
