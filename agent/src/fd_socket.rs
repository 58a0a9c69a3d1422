//! The fd socket beside the local API: gRPC cannot carry file descriptors, so a worker sends each
//! memfd here first (SCM_RIGHTS) and names the token it gets back in RegisterSegment.
//!
//! Request: 8 bytes `KVFDREG1` with one fd attached. Reply: u64 LE status (0 ok), then the u64 LE
//! token when ok, else a u32 LE length and that many bytes of UTF-8 reason.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use kvfabric_engine::transport::fdpass::{recv_fd, send_fd};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::node::Node;

const MAGIC: &[u8; 8] = b"KVFDREG1";

/// Serves until `shutdown` resolves; each connection is handled on a blocking thread.
pub async fn serve(
    listener: tokio::net::UnixListener,
    node: Arc<Node>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(e) => { warn!(error = %e, "fd socket accept"); continue; }
            },
        };
        let node = node.clone();
        let std = match stream.into_std().and_then(|s| {
            s.set_nonblocking(false)?;
            Ok(s)
        }) {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "fd socket connection");
                continue;
            }
        };
        tokio::task::spawn_blocking(move || serve_conn(std, &node));
    }
}

fn serve_conn(s: UnixStream, node: &Node) {
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
            (true, Some(fd)) => node.stash_fd(fd).map_err(|e| e.to_string()),
        };
        if reply(&s, answer).is_err() {
            return;
        }
    }
}

fn reply(mut s: &UnixStream, answer: std::result::Result<u64, String>) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(16);
    match answer {
        Ok(token) => {
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(&token.to_le_bytes());
        }
        Err(reason) => {
            out.extend_from_slice(&1u64.to_le_bytes());
            out.extend_from_slice(&(reason.len() as u32).to_le_bytes());
            out.extend_from_slice(reason.as_bytes());
        }
    }
    s.write_all(&out)
}

/// Client side: hands `fd` to the agent listening at `path`, returns the token.
pub fn send(path: &Path, fd: &OwnedFd) -> Result<u64> {
    let fail = |reason: String| Error::LocalAgent {
        path: path.display().to_string(),
        reason,
    };
    let s = UnixStream::connect(path).map_err(|e| fail(format!("connect: {e}")))?;
    send_fd(&s, MAGIC, fd.as_fd()).map_err(|e| fail(format!("send memfd: {e}")))?;
    let mut head = [0u8; 8];
    read_exact(&s, &mut head).map_err(|e| fail(format!("read reply: {e}")))?;
    let mut word = [0u8; 8];
    if u64::from_le_bytes(head) == 0 {
        read_exact(&s, &mut word).map_err(|e| fail(format!("read token: {e}")))?;
        return Ok(u64::from_le_bytes(word));
    }
    let mut len = [0u8; 4];
    read_exact(&s, &mut len).map_err(|e| fail(format!("read reason: {e}")))?;
    let mut reason = vec![0u8; (u32::from_le_bytes(len) as usize).min(4096)];
    read_exact(&s, &mut reason).map_err(|e| fail(format!("read reason: {e}")))?;
    Err(fail(String::from_utf8_lossy(&reason).into_owned()))
}

fn read_exact(mut s: &UnixStream, buf: &mut [u8]) -> std::io::Result<()> {
    std::io::Read::read_exact(&mut s, buf)
}
