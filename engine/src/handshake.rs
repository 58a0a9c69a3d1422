//! The first exchange on every data connection: protocol version, segment and key.

use std::io::{Read, Write};

use crate::error::{Error, RemoteError, Result};
use crate::frame::{
    FLAG_ERROR, FrameError, FrameKind, HEADER_LEN, Header, Hello, PROTOCOL_VERSION, Welcome,
    decode_json,
};
use crate::segment::SegmentDescriptor;
use tracing::info;

use crate::transport::io::{Socket, hang_up, read_body};

pub(crate) fn read_header<R: Read>(r: &mut R, peer: &str) -> Result<Header> {
    let mut b = [0u8; HEADER_LEN];
    r.read_exact(&mut b).map_err(|e| closed_or_io(e, peer))?;
    Ok(Header::decode(&b)?)
}

pub(crate) fn closed_or_io(e: std::io::Error, peer: &str) -> Error {
    use std::io::ErrorKind::*;
    match e.kind() {
        UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted | NotConnected => {
            Error::PeerClosed { peer: peer.into() }
        }
        _ => Error::io(format!("connection to {peer}"), e),
    }
}

pub(crate) fn send_control<W: Write>(
    w: &mut W,
    kind: FrameKind,
    tag: u64,
    flags: u8,
    body: &[u8],
) -> std::io::Result<()> {
    let h = Header::new(kind, tag, 0, body.len() as u64).with_flags(flags);
    let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
    buf.extend_from_slice(&h.encode());
    buf.extend_from_slice(body);
    w.write_all(&buf)
}

pub(crate) fn send_error<W: Write>(w: &mut W, kind: FrameKind, tag: u64, err: &Error) {
    let body = serde_json::to_vec(&err.to_remote()).expect("error serializes");
    // The peer may already be gone; there is nobody left to tell.
    let _ = send_control(w, kind, tag, FLAG_ERROR, &body);
}

pub(crate) fn read_remote_error<R: Read>(r: &mut R, h: &Header, peer: &str) -> Result<Error> {
    let body = read_body(r, h.len).map_err(|e| closed_or_io(e, peer))?;
    let remote: RemoteError = decode_json("error", &body)?;
    Ok(Error::Remote(remote))
}

/// Initiator side: announce ourselves, get the target's descriptor.
pub(crate) fn client<S: Read + Write>(
    s: &mut S,
    peer: &str,
    hello: &Hello,
) -> Result<SegmentDescriptor> {
    let body = serde_json::to_vec(hello).expect("hello serializes");
    send_control(s, FrameKind::Hello, 0, 0, &body).map_err(|e| closed_or_io(e, peer))?;
    let h = read_header(s, peer)?;
    if h.kind != FrameKind::Welcome {
        return Err(FrameError::Unexpected {
            kind: h.kind,
            expected: "a Welcome frame",
        }
        .into());
    }
    if h.has(FLAG_ERROR) {
        let err = read_remote_error(s, &h, peer)?;
        return Err(typed_refusal(err, hello));
    }
    let body = read_body(s, h.len).map_err(|e| closed_or_io(e, peer))?;
    let welcome: Welcome = decode_json("welcome", &body)?;
    if welcome.protocol != PROTOCOL_VERSION {
        return Err(Error::ProtocolVersion {
            ours: PROTOCOL_VERSION,
            theirs: welcome.protocol,
        });
    }
    Ok(welcome.descriptor)
}

/// Turns the target's refusal back into the typed error it stands for.
fn typed_refusal(err: Error, hello: &Hello) -> Error {
    let Error::Remote(remote) = &err else {
        return err;
    };
    match remote.code.as_str() {
        "wrong_segment_key" => Error::WrongSegmentKey {
            segment: hello.segment.clone(),
        },
        "unknown_segment" => Error::UnknownSegment {
            segment: hello.segment.clone(),
        },
        _ => err,
    }
}

/// Target side: check the initiator's Hello; on refusal tell it why and return the error.
pub(crate) fn server<S: Read + Write>(
    s: &mut S,
    peer: &str,
    descriptor: &SegmentDescriptor,
    segment_key: Option<u64>,
) -> Result<Hello> {
    let h = match read_header(s, peer) {
        Ok(h) => h,
        Err(e) => {
            if matches!(e, Error::Frame(_)) {
                send_error(s, FrameKind::Welcome, 0, &e);
            }
            return Err(e);
        }
    };
    if h.kind != FrameKind::Hello {
        let err: Error = FrameError::Unexpected {
            kind: h.kind,
            expected: "a Hello frame",
        }
        .into();
        send_error(s, FrameKind::Welcome, h.tag, &err);
        return Err(err);
    }
    let body = read_body(s, h.len).map_err(|e| closed_or_io(e, peer))?;
    let refuse = |s: &mut S, err: Error| {
        send_error(s, FrameKind::Welcome, 0, &err);
        Err(err)
    };
    let hello: Hello = match decode_json("hello", &body) {
        Ok(hello) => hello,
        Err(e) => return refuse(s, e.into()),
    };
    if hello.protocol != PROTOCOL_VERSION {
        return refuse(
            s,
            Error::ProtocolVersion {
                ours: PROTOCOL_VERSION,
                theirs: hello.protocol,
            },
        );
    }
    if !hello.segment.is_empty() && hello.segment != descriptor.name {
        return refuse(
            s,
            Error::UnknownSegment {
                segment: hello.segment.clone(),
            },
        );
    }
    if segment_key.is_some() && hello.key != segment_key {
        return refuse(
            s,
            Error::WrongSegmentKey {
                segment: descriptor.name.clone(),
            },
        );
    }
    let welcome = Welcome {
        protocol: PROTOCOL_VERSION,
        descriptor: descriptor.clone(),
    };
    let body = serde_json::to_vec(&welcome).expect("welcome serializes");
    send_control(s, FrameKind::Welcome, 0, 0, &body).map_err(|e| closed_or_io(e, peer))?;
    Ok(hello)
}

/// The target side of a fresh data connection: on success returns the initiator's Hello (and
/// logs it); on refusal logs why and hangs up so the refusal reaches the peer.
pub(crate) fn accept<S: Socket>(
    s: &mut S,
    peer: &str,
    transport: &str,
    descriptor: &SegmentDescriptor,
    segment_key: Option<u64>,
) -> Option<Hello> {
    match server(s, peer, descriptor, segment_key) {
        Ok(hello) => {
            info!(%peer, from = %hello.from, transport, "data connection accepted");
            Some(hello)
        }
        Err(e) => {
            info!(%peer, error = %e, transport, "handshake refused");
            hang_up(s);
            None
        }
    }
}
