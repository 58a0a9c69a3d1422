//! Shared memory, target side: after the handshake, answers `MapRegion` requests with the
//! region's memfd, passed over the Unix socket (SCM_RIGHTS). The key is checked first.

use std::io::Read;

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use tracing::{debug, info};

use super::fdpass::send_fd;
use super::io::hang_up;
use super::listener::Admission;
use super::target::Target;
use crate::error::{Error, Result, Side};
use crate::frame::{ENTRY_LEN, Entry, FrameError, FrameKind, Header};
use crate::handshake::{self, closed_or_io, read_header, send_error};

pub(crate) fn serve_conn(
    target: Arc<Target>,
    mut stream: UnixStream,
    peer: String,
    admission: Admission<UnixStream>,
) {
    if handshake::accept(
        &mut stream,
        &peer,
        "shm",
        target.gate(),
        || target.descriptor(),
        || {
            admission.proven();
        },
    )
    .is_none()
    {
        return;
    }
    loop {
        match serve_one(&target, &mut stream, &peer) {
            Ok(()) => {}
            Err(Error::PeerClosed { .. }) => break,
            Err(e) if e.timed_out() => {
                // Silent past the idle timeout: the initiator dials again when it needs us.
                debug!(%peer, "closing idle shm connection");
                break;
            }
            Err(e) => {
                info!(%peer, error = %e, "closing shm connection");
                send_error(&mut stream, FrameKind::MapReply, 0, &e);
                hang_up(&mut stream);
                break;
            }
        }
    }
}

fn serve_one(target: &Target, s: &mut UnixStream, peer: &str) -> Result<()> {
    let h = read_header(s, peer)?;
    if h.kind != FrameKind::MapRegion || h.count != 1 || h.len != ENTRY_LEN as u64 {
        return Err(FrameError::Unexpected {
            kind: h.kind,
            expected: "a MapRegion frame with one entry",
        }
        .into());
    }
    let mut body = [0u8; ENTRY_LEN];
    s.read_exact(&mut body).map_err(|e| closed_or_io(e, peer))?;
    let entry = Entry::decode(&body);
    let lease = match target
        .regions
        .lease_checked(entry.region, entry.key, Side::Remote)
    {
        Ok(l) => l,
        Err(e) => {
            send_error(s, FrameKind::MapReply, h.tag, &e);
            return Ok(());
        }
    };
    let Some(fd) = lease.region().memfd() else {
        let e = Error::NotShareable {
            region: entry.region,
            reason: "registered from caller memory, not a memfd".into(),
        };
        send_error(s, FrameKind::MapReply, h.tag, &e);
        return Ok(());
    };
    send_fd(
        s,
        &Header::new(FrameKind::MapReply, h.tag, 1, 0).encode(),
        fd,
    )
    .map_err(|e| closed_or_io(e, peer))
}
