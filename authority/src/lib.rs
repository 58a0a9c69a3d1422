//! The local API accepts the `:authority` a stock grpcio client sends. gRPC C-core (grpcio, what
//! a Python worker uses) on `unix:///run/kvfabric/agent.sock` sends the socket path,
//! percent-encoded (`run%2Fkvfabric%2Fagent.sock`), as `:authority`; the `h2` crate under tonic
//! parses it with `http::uri::Authority`, which refuses '%' outside userinfo, and resets the
//! stream (PROTOCOL_ERROR) before any hook of ours runs. There is no h2 setting for it, so the
//! local API's connections go through this layer on the client-to-server bytes: every frame but
//! a header block is copied through unchanged; each header block (HEADERS + CONTINUATION) is
//! decoded with an HPACK decoder that follows the client's dynamic table, an `:authority` that
//! `http::uri::Authority` refuses becomes `localhost` (the authority gRPC means for a Unix
//! socket), and the block is encoded again without the dynamic table (the server's table is
//! set to size 0 once, so its state never has to mirror the client's).
//!
//! Only the Unix socket gets this: who can open it is already trusted with the local API, and
//! the socket path is no authority anyone routes on. The peer API's TCP port keeps h2's check.
//!
//! This crate is the byte-stream rewriter alone, without I/O (the agent wraps its connections
//! in it), so the `authority` fuzz target links nothing else.

#![forbid(unsafe_code)]

use std::fmt;

use bytes::{Buf, BytesMut};
use loona_hpack::decoder::DecoderError;
use loona_hpack::{Decoder, Encoder};

/// What an `:authority` that h2 refuses is replaced with.
pub const LOCAL_AUTHORITY: &[u8] = b"localhost";

/// The largest frame a client may send: the HTTP/2 default SETTINGS_MAX_FRAME_SIZE, which the
/// agent's servers keep (`grpc_server` sets no `max_frame_size`).
pub const MAX_FRAME_SIZE: usize = 16_384;

/// The largest header block (all its fragments, encoded) taken in; hyper's own limit on the
/// decoded list is 16 KiB, so a block past this is refused by the server anyway.
pub const MAX_HEADER_BLOCK: usize = 64 * 1024;

/// The largest decoded header list (RFC 9113 counting: name + value + 32 per field). A few
/// bytes of indexed references can name a 4 KiB table entry each, so the decoded size is
/// bounded separately from the encoded one.
pub const MAX_HEADER_LIST: usize = 64 * 1024;

/// The client's HPACK table may grow to the SETTINGS_HEADER_TABLE_SIZE the server advertises:
/// h2's default, which the agent keeps.
const CLIENT_TABLE_SIZE: usize = 4096;

/// HTTP/2's connection preface (RFC 9113 §3.4), the first bytes a client sends.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Bytes of a frame header.
pub const FRAME_HEADER: usize = 9;
/// Frame types and flags this layer reads (RFC 9113 §6).
pub const HEADERS: u8 = 0x1;
pub const PUSH_PROMISE: u8 = 0x5;
pub const CONTINUATION: u8 = 0x9;
pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const PADDED: u8 = 0x8;
pub const PRIORITY: u8 = 0x20;
/// Bytes of a HEADERS frame's priority fields.
pub const PRIORITY_FIELDS: usize = 5;

/// Why a local client's HTTP/2 byte stream was refused (the connection is closed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Http2Fault {
    /// The first 24 bytes are not the HTTP/2 connection preface.
    Preface,
    /// A frame longer than [`MAX_FRAME_SIZE`].
    FrameTooLarge { len: usize },
    /// A header block over [`MAX_HEADER_BLOCK`] encoded bytes.
    HeaderBlockTooLarge { len: usize },
    /// A header list over [`MAX_HEADER_LIST`] decoded bytes.
    HeaderListTooLarge,
    /// A PADDED or PRIORITY header frame too short for its pad length or priority fields.
    Padding { len: usize, pad: usize },
    /// A frame other than CONTINUATION (of the same stream) while a header block is open.
    ExpectedContinuation { kind: u8, stream: u32 },
    /// A CONTINUATION with no header block open on its stream.
    UnexpectedContinuation { stream: u32 },
    /// PUSH_PROMISE, which only a server sends.
    PushPromise,
    /// The header block does not decode.
    Hpack(DecoderError),
}

impl fmt::Display for Http2Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Http2Fault::Preface => write!(f, "the connection preface is not HTTP/2's"),
            Http2Fault::FrameTooLarge { len } => {
                write!(f, "frame length {len} exceeds {MAX_FRAME_SIZE}")
            }
            Http2Fault::HeaderBlockTooLarge { len } => {
                write!(f, "header block of {len} bytes exceeds {MAX_HEADER_BLOCK}")
            }
            Http2Fault::HeaderListTooLarge => {
                write!(f, "decoded header list exceeds {MAX_HEADER_LIST} bytes")
            }
            Http2Fault::Padding { len, pad } => {
                write!(f, "header frame of {len} bytes cannot hold padding {pad}")
            }
            Http2Fault::ExpectedContinuation { kind, stream } => write!(
                f,
                "frame type {kind} on stream {stream} inside an open header block"
            ),
            Http2Fault::UnexpectedContinuation { stream } => {
                write!(
                    f,
                    "CONTINUATION on stream {stream} with no open header block"
                )
            }
            Http2Fault::PushPromise => write!(f, "PUSH_PROMISE from a client"),
            Http2Fault::Hpack(e) => write!(f, "header block: {e}"),
        }
    }
}

impl std::error::Error for Http2Fault {}

type Fault<T = ()> = std::result::Result<T, Http2Fault>;

/// A frame header, read or to be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub len: usize,
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
}

impl FrameHeader {
    /// The header at the start of `b` (at least [`FRAME_HEADER`] bytes); a frame longer than
    /// [`MAX_FRAME_SIZE`] is refused.
    pub fn parse(b: &[u8]) -> Result<Self, Http2Fault> {
        let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
        if len > MAX_FRAME_SIZE {
            return Err(Http2Fault::FrameTooLarge { len });
        }
        Ok(FrameHeader {
            len,
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        })
    }

    /// Appends a frame header for a payload of `len` bytes.
    pub fn write(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream: u32) {
        // 24 bits: callers cut frames to MAX_FRAME_SIZE.
        out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8]);
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
    }
}

/// A header block whose END_HEADERS has not come yet.
struct OpenBlock {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; PRIORITY_FIELDS]>,
    fragments: Vec<u8>,
}

/// The client-to-server HTTP/2 byte stream, parsed just enough to rewrite header blocks.
pub struct HeaderRewriter {
    preface_left: usize,
    payload_left: usize,
    open: Option<OpenBlock>,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    /// The server's table is set to size 0 at the head of the first block written.
    table_dropped: bool,
    /// The re-encoded block, its allocation kept from one block to the next.
    block: Vec<u8>,
}

impl fmt::Debug for HeaderRewriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeaderRewriter")
            .field("preface_left", &self.preface_left)
            .field("payload_left", &self.payload_left)
            .field("open_stream", &self.open.as_ref().map(|b| b.stream))
            .finish_non_exhaustive()
    }
}

impl Default for HeaderRewriter {
    fn default() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(CLIENT_TABLE_SIZE);
        let mut encoder = Encoder::new();
        // Nothing is ever referenced from the server's table: each block stands alone.
        encoder.set_max_table_size(0);
        HeaderRewriter {
            preface_left: PREFACE.len(),
            payload_left: 0,
            open: None,
            decoder,
            encoder,
            table_dropped: false,
            block: Vec::new(),
        }
    }
}

impl HeaderRewriter {
    /// How many leading bytes of `bytes` go through unchanged (the preface, frames other than
    /// header blocks); stops at a header-block frame or a frame header not yet complete.
    pub fn pass_len(&mut self, bytes: &[u8]) -> Fault<usize> {
        let mut at = 0;
        loop {
            let rest = &bytes[at..];
            if self.preface_left > 0 {
                let n = self.preface_left.min(rest.len());
                let from = PREFACE.len() - self.preface_left;
                if rest[..n] != PREFACE[from..from + n] {
                    return Err(Http2Fault::Preface);
                }
                self.preface_left -= n;
                at += n;
            } else if self.payload_left > 0 {
                let n = self.payload_left.min(rest.len());
                self.payload_left -= n;
                at += n;
            } else {
                if rest.len() < FRAME_HEADER {
                    return Ok(at);
                }
                let h = FrameHeader::parse(rest)?;
                if matches!(h.kind, HEADERS | CONTINUATION | PUSH_PROMISE) {
                    return Ok(at);
                }
                if self.open.is_some() {
                    return Err(Http2Fault::ExpectedContinuation {
                        kind: h.kind,
                        stream: h.stream,
                    });
                }
                self.payload_left = h.len;
                at += FRAME_HEADER;
            }
            if at == bytes.len() {
                return Ok(at);
            }
        }
    }

    /// Moves from `input` to `out` everything that is complete: frames copied through, and
    /// each header block once its END_HEADERS frame is in. What is left in `input` waits for
    /// more bytes.
    pub fn feed(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Fault {
        loop {
            let n = self.pass_len(input)?;
            if n > 0 {
                out.extend_from_slice(&input[..n]);
                input.advance(n);
                continue;
            }
            if input.len() < FRAME_HEADER || self.preface_left > 0 {
                return Ok(());
            }
            let h = FrameHeader::parse(input)?;
            if input.len() < FRAME_HEADER + h.len {
                return Ok(());
            }
            let frame = input.split_to(FRAME_HEADER + h.len);
            self.header_frame(&h, &frame[FRAME_HEADER..], out)?;
        }
    }

    fn header_frame(&mut self, h: &FrameHeader, payload: &[u8], out: &mut BytesMut) -> Fault {
        let (mut block, fragment) = match (h.kind, self.open.take()) {
            (PUSH_PROMISE, _) => return Err(Http2Fault::PushPromise),
            (HEADERS, None) => {
                let (priority, fragment) = headers_payload(h, payload)?;
                let block = OpenBlock {
                    stream: h.stream,
                    end_stream: h.flags & END_STREAM != 0,
                    priority,
                    fragments: Vec::new(),
                };
                (block, fragment)
            }
            (CONTINUATION, Some(open)) if open.stream == h.stream => (open, payload),
            (CONTINUATION, _) => {
                return Err(Http2Fault::UnexpectedContinuation { stream: h.stream });
            }
            (kind, _) => {
                return Err(Http2Fault::ExpectedContinuation {
                    kind,
                    stream: h.stream,
                });
            }
        };
        let len = block.fragments.len() + fragment.len();
        if len > MAX_HEADER_BLOCK {
            return Err(Http2Fault::HeaderBlockTooLarge { len });
        }
        block.fragments.extend_from_slice(fragment);
        if h.flags & END_HEADERS != 0 {
            self.rewrite(&block, out)
        } else {
            self.open = Some(block);
            Ok(())
        }
    }

    /// Decodes one whole header block and writes it again as HEADERS (+ CONTINUATION) frames.
    fn rewrite(&mut self, block: &OpenBlock, out: &mut BytesMut) -> Fault {
        let encoded = &mut self.block;
        encoded.clear();
        let dropping = !self.table_dropped;
        if dropping {
            // A dynamic table size update to 0 (RFC 7541 6.3: 001 and a 5-bit integer) at the
            // head of the first block.
            encoded.push(0x20);
            self.table_dropped = true;
        }
        let encoder = &mut self.encoder;
        let mut list = 0usize;
        self.decoder
            .decode_with_cb(&block.fragments, |name, value| {
                list = list.saturating_add(name.len() + value.len() + 32);
                if list > MAX_HEADER_LIST {
                    return;
                }
                let value: &[u8] = if &*name == b":authority"
                    && http::uri::Authority::try_from(&*value).is_err()
                {
                    LOCAL_AUTHORITY
                } else {
                    &value
                };
                encoder
                    .encode_header_into((&*name, value), &mut *encoded)
                    .expect("writing to a Vec cannot fail");
            })
            .map_err(Http2Fault::Hpack)?;
        if list > MAX_HEADER_LIST {
            return Err(Http2Fault::HeaderListTooLarge);
        }
        if dropping && encoded.len() == 1 {
            // No field at all: a block that is only a size update is one strict decoders refuse
            // (the update must precede a field), so it waits for the next block.
            encoded.clear();
            self.table_dropped = false;
        }
        let priority = block.priority.as_ref().map_or(&[][..], |p| &p[..]);
        let first = encoded.len().min(MAX_FRAME_SIZE - priority.len());
        let mut flags = if block.end_stream { END_STREAM } else { 0 };
        if !priority.is_empty() {
            flags |= PRIORITY;
        }
        if first == encoded.len() {
            flags |= END_HEADERS;
        }
        FrameHeader::write(out, priority.len() + first, HEADERS, flags, block.stream);
        out.extend_from_slice(priority);
        out.extend_from_slice(&encoded[..first]);
        let mut chunks = encoded[first..].chunks(MAX_FRAME_SIZE).peekable();
        while let Some(chunk) = chunks.next() {
            let flags = if chunks.peek().is_none() {
                END_HEADERS
            } else {
                0
            };
            FrameHeader::write(out, chunk.len(), CONTINUATION, flags, block.stream);
            out.extend_from_slice(chunk);
        }
        Ok(())
    }
}

/// A HEADERS payload without its padding, and its priority fields if any.
fn headers_payload<'p>(
    h: &FrameHeader,
    payload: &'p [u8],
) -> Fault<(Option<[u8; PRIORITY_FIELDS]>, &'p [u8])> {
    let mut body = payload;
    let mut pad = 0;
    if h.flags & PADDED != 0 {
        let (&p, rest) = body.split_first().ok_or(Http2Fault::Padding {
            len: payload.len(),
            pad: 0,
        })?;
        pad = usize::from(p);
        body = rest;
    }
    let priority_len = if h.flags & PRIORITY != 0 {
        PRIORITY_FIELDS
    } else {
        0
    };
    if body.len() < pad + priority_len {
        return Err(Http2Fault::Padding {
            len: payload.len(),
            pad,
        });
    }
    let body = &body[..body.len() - pad];
    let (priority, fragment) = body.split_at(priority_len);
    Ok((priority.try_into().ok(), fragment))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(stream: u32, fragment: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        FrameHeader::write(&mut out, fragment.len(), HEADERS, END_HEADERS, stream);
        out.extend_from_slice(fragment);
        out.to_vec()
    }

    /// Found by the `authority` fuzz target: an empty first header block came out as a lone
    /// table size update, which strict HPACK decoders refuse.
    #[test]
    fn the_table_size_update_waits_for_a_block_with_fields() {
        let mut client = Encoder::new();
        let fields = client.encode([(&b":authority"[..], &b"a%2Fb.sock"[..])]);
        let mut input = BytesMut::from(PREFACE);
        input.extend_from_slice(&block(1, &[]));
        input.extend_from_slice(&block(3, &fields));
        let (mut rewriter, mut out) = (HeaderRewriter::default(), BytesMut::new());
        rewriter.feed(&mut input, &mut out).expect("rewrites");
        let mut rest = &out[PREFACE.len()..];
        let mut server = Decoder::new();
        let mut decoded = Vec::new();
        while !rest.is_empty() {
            let h = FrameHeader::parse(rest).expect("frame");
            let payload = &rest[FRAME_HEADER..FRAME_HEADER + h.len];
            decoded.push(server.decode(payload).expect("every block decodes"));
            rest = &rest[FRAME_HEADER + h.len..];
        }
        assert_eq!(decoded.len(), 2);
        assert!(decoded[0].is_empty());
        assert_eq!(
            decoded[1],
            vec![(b":authority".to_vec(), LOCAL_AUTHORITY.to_vec())]
        );
    }
}
