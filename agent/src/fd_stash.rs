//! Memfds a worker handed over on the fd socket, held until its `RegisterSegment` names their
//! tokens. Everything here is bounded: a token expires after [`FD_TOKEN_TTL`] (purged by
//! [`FdStash::purge`], which the fd socket runs on a timer, so expired fds are closed even when
//! nothing else arrives), one process holds at most [`MAX_PENDING_PER_PROCESS`] and the node at
//! most [`MAX_PENDING_FDS`].

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Host memory handed over on the fd socket but never registered is closed after this long.
pub const FD_TOKEN_TTL: Duration = Duration::from_secs(60);
/// Most memfds waiting for their RegisterSegment at once, on the node.
pub const MAX_PENDING_FDS: usize = 4096;
/// Most of them from one process: one worker's retry loop cannot lock the others out.
pub const MAX_PENDING_PER_PROCESS: usize = 512;

#[derive(Debug)]
struct Pending {
    fd: OwnedFd,
    at: Instant,
    pid: i32,
}

#[derive(Debug, Default)]
pub struct FdStash {
    fds: Mutex<HashMap<u64, Pending>>,
}

impl FdStash {
    /// Keeps `fd` (sent by process `pid`) and returns the token that names it.
    pub fn put(&self, fd: OwnedFd, pid: i32) -> Result<u64> {
        let mut fds = self.fds.lock().unwrap_or_else(|e| e.into_inner());
        fds.retain(|_, p| p.at.elapsed() < FD_TOKEN_TTL);
        if fds.len() >= MAX_PENDING_FDS {
            return Err(Error::Exhausted {
                resource: "memfds waiting for RegisterSegment on this node",
                limit: MAX_PENDING_FDS,
            });
        }
        if fds.values().filter(|p| p.pid == pid).count() >= MAX_PENDING_PER_PROCESS {
            return Err(Error::Exhausted {
                resource: "memfds waiting for RegisterSegment from this process",
                limit: MAX_PENDING_PER_PROCESS,
            });
        }
        let token = loop {
            let t: u64 = rand::random();
            if t != 0 && !fds.contains_key(&t) {
                break t;
            }
        };
        fds.insert(
            token,
            Pending {
                fd,
                at: Instant::now(),
                pid,
            },
        );
        Ok(token)
    }

    /// The fd a token names; the token is used up either way.
    pub fn take(&self, token: u64, field: &str) -> Result<OwnedFd> {
        self.fds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&token)
            .filter(|p| p.at.elapsed() < FD_TOKEN_TTL)
            .map(|p| p.fd)
            .ok_or_else(|| {
                Error::invalid(
                    field,
                    format!("{token:#x}"),
                    "unknown or expired: send the memfd on the fd socket first",
                )
            })
    }

    /// Closes the fds of expired tokens; returns how many.
    pub fn purge(&self) -> usize {
        let mut fds = self.fds.lock().unwrap_or_else(|e| e.into_inner());
        let before = fds.len();
        fds.retain(|_, p| p.at.elapsed() < FD_TOKEN_TTL);
        before - fds.len()
    }

    pub fn len(&self) -> usize {
        self.fds.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("kvf-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
    }

    #[test]
    fn one_process_cannot_fill_the_node() {
        let stash = FdStash::default();
        for _ in 0..MAX_PENDING_PER_PROCESS {
            stash.put(memfd(), 7).unwrap();
        }
        let e = stash.put(memfd(), 7).unwrap_err();
        assert!(matches!(e, Error::Exhausted { .. }), "{e}");
        // Another process still gets in.
        let t = stash.put(memfd(), 8).unwrap();
        stash.take(t, "fd_token").unwrap();
        // Tokens are single use.
        assert!(stash.take(t, "fd_token").is_err());
    }
}
