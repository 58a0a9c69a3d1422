//! Handing a memfd to the agent on its fd socket (see `kvfabric_proto::fd_wire`).

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use kvfabric_engine::transport::fdpass::send_fd;
use kvfabric_proto::fd_wire::{MAGIC, read_reply};

use crate::error::{Error, Result};

/// How long the agent may take to answer one hand-over.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Hands `fd` to the agent listening at `path` and returns the token to name in
/// `RegisterSegment`. Blocks: call from a blocking thread.
pub fn send(path: &Path, fd: &OwnedFd) -> Result<u64> {
    let fail = |reason: String| Error::FdSocket {
        path: path.display().to_string(),
        reason,
    };
    let s = UnixStream::connect(path).map_err(|e| fail(format!("connect: {e}")))?;
    s.set_read_timeout(Some(REPLY_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(REPLY_TIMEOUT)))
        .map_err(|e| fail(format!("set timeouts: {e}")))?;
    send_fd(&s, MAGIC, fd.as_fd()).map_err(|e| fail(format!("send memfd: {e}")))?;
    read_reply(&mut &s)
        .map_err(|e| fail(format!("read reply: {e}")))?
        .map_err(fail)
}
