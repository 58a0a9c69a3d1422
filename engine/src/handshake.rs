//! The first exchange on every data connection: the target's challenge, the initiator's proof,
//! then protocol version, segment and key (see [`crate::auth`]).

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use crate::auth::{self, DataSecret, Exchange};
use crate::error::{Error, ErrorKind, RemoteError, Result, truncated};
use crate::frame::{
    Challenge, FLAG_ERROR, FrameError, FrameKind, HEADER_LEN, Header, Hello, MAX_HELLO_LEN,
    PROTOCOL_VERSION, Welcome, decode_json,
};
use crate::segment::SegmentDescriptor;

use crate::transport::io::{Socket, Until, hang_up, read_body};
use kvfabric_rt::Throttle;
use tracing::{info, warn};

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

fn read_json<T: for<'de> serde::Deserialize<'de>, R: Read>(
    r: &mut R,
    h: &Header,
    peer: &str,
    what: &'static str,
) -> Result<T> {
    let body = read_body(r, h.len).map_err(|e| closed_or_io(e, peer))?;
    Ok(decode_json(what, &body)?)
}

/// What an initiator presents: the secret of the engine it dials, and whom it wants there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Credentials<'a> {
    pub secret: &'a DataSecret,
    /// The segment wanted (empty: whichever the target serves).
    pub segment: &'a str,
    /// The segment key, proved (never sent) when given.
    pub key: Option<u64>,
    /// This engine's name.
    pub from: &'a str,
}

/// What an authenticated target said about itself.
#[derive(Debug)]
pub(crate) struct Welcomed {
    /// Its descriptor with region keys, if we named its segment and presented the segment key.
    pub descriptor: Option<SegmentDescriptor>,
    /// It closes connections silent for this long (0: never).
    pub idle_timeout: Duration,
}

/// Initiator side: answer the challenge, check the target's proof.
pub(crate) fn client<S: Read + Write>(
    s: &mut S,
    peer: &str,
    creds: Credentials<'_>,
) -> Result<Welcomed> {
    let h = read_header(s, peer)?;
    if h.kind == FrameKind::Welcome && h.has(FLAG_ERROR) {
        // Refused before the challenge (the target is at its connection limit).
        let err = read_remote_error(s, &h, peer)?;
        return Err(typed_refusal(err, peer, creds.segment));
    }
    if h.kind != FrameKind::Challenge {
        return Err(FrameError::Unexpected {
            kind: h.kind,
            expected: "a Challenge frame",
        }
        .into());
    }
    let challenge: Challenge = read_json(s, &h, peer, "challenge")?;
    if challenge.protocol != PROTOCOL_VERSION {
        return Err(Error::ProtocolVersion {
            ours: PROTOCOL_VERSION,
            theirs: challenge.protocol,
        });
    }
    let nonce = auth::nonce();
    let x = Exchange {
        target: &challenge.nonce,
        initiator: &nonce,
        from: creds.from,
    };
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        segment: creds.segment.into(),
        from: creds.from.into(),
        nonce,
        proof: x.initiator_proof(creds.secret),
        key_proof: creds.key.map(|k| x.key_proof(creds.secret, k)),
    };
    let body = serde_json::to_vec(&hello).expect("hello serializes");
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
        return Err(typed_refusal(err, peer, creds.segment));
    }
    let welcome: Welcome = read_json(s, &h, peer, "welcome")?;
    if welcome.protocol != PROTOCOL_VERSION {
        return Err(Error::ProtocolVersion {
            ours: PROTOCOL_VERSION,
            theirs: welcome.protocol,
        });
    }
    if !x.check_target(creds.secret, &welcome.proof) {
        return Err(Error::AuthFailed {
            peer: peer.into(),
            reason: "its proof does not match: it does not hold the data secret we were given",
        });
    }
    Ok(Welcomed {
        descriptor: welcome.descriptor,
        idle_timeout: Duration::from_millis(welcome.idle_timeout_ms),
    })
}

/// Turns the target's refusal back into the typed error it stands for.
fn typed_refusal(err: Error, peer: &str, segment: &str) -> Error {
    let Error::Remote(remote) = &err else {
        return err;
    };
    match remote.kind() {
        Some(ErrorKind::AuthFailed) => Error::AuthFailed {
            peer: peer.into(),
            reason: "it refused our proof (is the data secret the one it was given?)",
        },
        Some(ErrorKind::WrongSegmentKey) => Error::WrongSegmentKey {
            segment: segment.into(),
        },
        Some(ErrorKind::UnknownSegment) => Error::UnknownSegment {
            segment: segment.into(),
        },
        _ => err,
    }
}

/// What a target checks callers against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gate<'a> {
    pub secret: &'a DataSecret,
    /// The segment this engine serves.
    pub name: &'a str,
    pub segment_key: Option<u64>,
    pub idle_timeout: Duration,
    /// The whole handshake ends within this.
    pub handshake_timeout: Duration,
    /// Failed authentications are logged at most this often.
    pub auth_log: &'a Throttle,
}

/// A caller that passed the handshake.
#[derive(Debug)]
pub(crate) struct Admitted {
    pub hello: Hello,
    /// It named our segment and proved the segment key: it was given our region keys.
    pub key_holder: bool,
}

/// Why a handshake failed: before the caller proved anything (it is told nothing), or after
/// (it is told why).
#[derive(Debug)]
pub(crate) enum Refused {
    Unauthenticated(Error),
    Refused(Error),
}

/// Target side: challenge, check the proof, then the rest; `descriptor` is asked for only when
/// the caller is entitled to it.
///
/// `authenticated` runs once the caller's proof checked out, before anything is said to it. A
/// caller refused as `Unauthenticated` has not been answered yet: send it [`refuse_stranger`]
/// (on a socket whose deadline has not passed).
pub(crate) fn server<S: Read + Write>(
    s: &mut S,
    peer: &str,
    gate: Gate<'_>,
    authenticated: impl FnOnce(),
    descriptor: impl FnOnce() -> Option<SegmentDescriptor>,
) -> std::result::Result<Admitted, Refused> {
    let nonce = auth::nonce();
    let challenge = Challenge {
        protocol: PROTOCOL_VERSION,
        nonce,
    };
    let body = serde_json::to_vec(&challenge).expect("challenge serializes");
    send_control(s, FrameKind::Challenge, 0, 0, &body)
        .map_err(|e| Refused::Unauthenticated(closed_or_io(e, peer)))?;
    let hello = authenticate(s, peer, &gate, &nonce).map_err(Refused::Unauthenticated)?;
    authenticated();
    let x = Exchange {
        target: &nonce,
        initiator: &hello.nonce,
        from: &hello.from,
    };
    let refuse = |s: &mut S, err: Error| {
        send_error(s, FrameKind::Welcome, 0, &err);
        Err(Refused::Refused(err))
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
    if !hello.segment.is_empty() && hello.segment != gate.name {
        return refuse(
            s,
            Error::UnknownSegment {
                segment: truncated(&hello.segment, 128),
            },
        );
    }
    let key_holder = match (gate.segment_key, hello.key_proof) {
        (None, _) => false,
        (Some(key), Some(proof)) if x.check_key(gate.secret, key, &proof) => true,
        (Some(_), _) => {
            return refuse(
                s,
                Error::WrongSegmentKey {
                    segment: gate.name.into(),
                },
            );
        }
    };
    let key_holder = key_holder && hello.segment == gate.name;
    let welcome = Welcome {
        protocol: PROTOCOL_VERSION,
        proof: x.target_proof(gate.secret),
        idle_timeout_ms: u64::try_from(gate.idle_timeout.as_millis()).unwrap_or(u64::MAX),
        descriptor: key_holder.then(descriptor).flatten(),
    };
    let body = serde_json::to_vec(&welcome).expect("welcome serializes");
    send_control(s, FrameKind::Welcome, 0, 0, &body)
        .map_err(|e| Refused::Refused(closed_or_io(e, peer)))?;
    Ok(Admitted { hello, key_holder })
}

/// Reads the Hello and checks its proof. Every error here is answered the same way.
fn authenticate<S: Read>(
    s: &mut S,
    peer: &str,
    gate: &Gate<'_>,
    nonce: &auth::Nonce,
) -> Result<Hello> {
    let h = read_header(s, peer)?;
    if h.kind != FrameKind::Hello {
        return Err(FrameError::Unexpected {
            kind: h.kind,
            expected: "a Hello frame",
        }
        .into());
    }
    // Bounded before it is read: a stranger makes us hold no more than this.
    if h.len > MAX_HELLO_LEN {
        return Err(FrameError::ControlTooLong {
            kind: h.kind,
            len: h.len,
        }
        .into());
    }
    let hello: Hello = read_json(s, &h, peer, "hello")?;
    let x = Exchange {
        target: nonce,
        initiator: &hello.nonce,
        from: &hello.from,
    };
    if !x.check_initiator(gate.secret, &hello.proof) {
        return Err(Error::AuthFailed {
            peer: peer.into(),
            reason: "its proof does not match our data secret",
        });
    }
    Ok(hello)
}

/// The one answer a caller gets that has not proved itself: no descriptor, no key, no detail.
pub(crate) fn refuse_stranger<W: Write>(w: &mut W) {
    let body = serde_json::to_vec(&RemoteError {
        code: ErrorKind::AuthFailed.code().into(),
        message: "authentication failed".into(),
    })
    .expect("error serializes");
    let _ = send_control(w, FrameKind::Welcome, 0, FLAG_ERROR, &body);
}

/// Tells a caller we will not serve it now (the connection limit), before the challenge.
pub(crate) fn refuse_busy<W: Write>(w: &mut W) {
    let body = serde_json::to_vec(&RemoteError {
        code: "busy".into(),
        message: "too many connections".into(),
    })
    .expect("error serializes");
    let _ = send_control(w, FrameKind::Welcome, 0, FLAG_ERROR, &body);
}

/// The target side of a fresh data connection: on success returns the admitted caller (and logs
/// it); on refusal logs why (failed authentication at most once per `auth_log` interval) and
/// hangs up so the refusal reaches the peer.
///
/// The whole handshake ends within the gate's timeout, however the caller paces its bytes;
/// after it, reads and writes time out after the gate's idle timeout.
pub(crate) fn accept<S: Socket>(
    s: &mut S,
    peer: &str,
    transport: &str,
    gate: Gate<'_>,
    descriptor: impl FnOnce() -> Option<SegmentDescriptor>,
    authenticated: impl FnOnce(),
) -> Option<Admitted> {
    let deadline = Instant::now() + gate.handshake_timeout;
    let outcome = server(
        &mut Until { s, deadline },
        peer,
        gate,
        authenticated,
        descriptor,
    );
    if outcome.is_ok()
        && (s.set_timeout(gate.idle_timeout).is_err()
            || s.set_send_timeout(gate.idle_timeout).is_err())
    {
        return None;
    }
    match outcome {
        Ok(admitted) => {
            info!(
                %peer,
                from = %truncated(&admitted.hello.from, 64),
                transport,
                key_holder = admitted.key_holder,
                "data connection accepted"
            );
            Some(admitted)
        }
        Err(Refused::Unauthenticated(e)) => {
            // Past the handshake's deadline, perhaps: a short one of its own.
            let _ = s.set_send_timeout(Duration::from_millis(200));
            refuse_stranger(s);
            if let Some(held_back) = gate.auth_log.allow() {
                warn!(%peer, error = %e, transport, held_back, "data connection failed authentication");
            }
            hang_up(s);
            None
        }
        Err(Refused::Refused(e)) => {
            info!(%peer, error = %e, transport, "handshake refused");
            hang_up(s);
            None
        }
    }
}
