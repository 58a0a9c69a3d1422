//! The fd socket beside the local API: a worker sends each memfd here first (SCM_RIGHTS) and
//! names the token it gets back in RegisterSegment (protocol: `kvfabric_proto::fd_wire`).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use kvfabric_engine::transport::fdpass::recv_fd;
use kvfabric_proto::fd_wire::{MAGIC, encode_reply};
use tracing::{debug, warn};

use crate::node::Node;

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
    s.write_all(&encode_reply(
        answer.as_ref().map(|t| *t).map_err(String::as_str),
    ))
}
