//! The local API's connections through the `:authority` rewriter of [`kvfabric_authority`]
//! (why: that crate's documentation): reads go through a [`HeaderRewriter`], writes pass.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use kvfabric_authority::FRAME_HEADER;
pub use kvfabric_authority::{
    HeaderRewriter, Http2Fault, LOCAL_AUTHORITY, MAX_FRAME_SIZE, MAX_HEADER_BLOCK, MAX_HEADER_LIST,
};
use tokio::io::{AsyncRead, ReadBuf};
use tonic::transport::server::Connected;

use crate::Error;

/// A refused stream, as the reader's error: the agent's own error inside, so it is logged as one.
fn refused(fault: Http2Fault) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, Error::Http2(fault))
}

/// A local API connection whose header blocks go through a [`HeaderRewriter`]; writes (the
/// server's frames) pass untouched.
#[derive(Debug)]
pub struct AuthorityRewrite<T> {
    io: T,
    rewriter: HeaderRewriter,
    /// Bytes read but not yet handed on: a header-block frame still arriving.
    input: BytesMut,
    /// Rewritten bytes the reader has not taken yet.
    output: BytesMut,
}

impl<T> AuthorityRewrite<T> {
    pub fn new(io: T) -> Self {
        AuthorityRewrite {
            io,
            rewriter: HeaderRewriter::default(),
            input: BytesMut::new(),
            output: BytesMut::new(),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for AuthorityRewrite<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.input.is_empty() {
                // Straight into the reader's buffer; only a header-block frame is held back.
                let start = buf.filled().len();
                ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
                let read = &buf.filled()[start..];
                if read.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                let pass = this.rewriter.pass_len(read).map_err(refused)?;
                if pass < read.len() {
                    this.input.extend_from_slice(&read[pass..]);
                    buf.set_filled(start + pass);
                }
                if pass > 0 {
                    return Poll::Ready(Ok(()));
                }
            }
            this.rewriter
                .feed(&mut this.input, &mut this.output)
                .map_err(refused)?;
            if !this.output.is_empty() || this.input.is_empty() {
                continue;
            }
            // Part of a frame is here, the rest is not.
            let held = this.input.len();
            this.input.resize(held + MAX_FRAME_SIZE + FRAME_HEADER, 0);
            let mut more = ReadBuf::new(&mut this.input[held..]);
            let polled = Pin::new(&mut this.io).poll_read(cx, &mut more);
            let got = more.filled().len();
            this.input.truncate(held + got);
            ready!(polled)?;
            if got == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside an HTTP/2 frame",
                )));
            }
        }
    }
}

crate::write_through::write_through!(AuthorityRewrite);

impl<T: Connected> Connected for AuthorityRewrite<T> {
    type ConnectInfo = T::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfabric_authority::{
        CONTINUATION, END_HEADERS, END_STREAM, FrameHeader, HEADERS, PADDED, PREFACE, PRIORITY,
        PRIORITY_FIELDS, PUSH_PROMISE,
    };
    use loona_hpack::decoder::DecoderError;
    use loona_hpack::{Decoder, Encoder};
    use rand::{Rng, SeedableRng};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const GRPCIO_AUTHORITY: &[u8] = b"tmp%2Fgsock%2Fagent.sock";
    const SETTINGS: u8 = 0x4;
    const DATA: u8 = 0x0;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        FrameHeader::write(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out.to_vec()
    }

    fn request(path: &str, authority: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        [
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"x-worker", b"prefill-0"),
        ]
        .iter()
        .map(|(n, v)| (n.to_vec(), v.to_vec()))
        .collect()
    }

    fn encode(client: &mut Encoder<'static>, headers: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        client.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])))
    }

    struct Frame {
        kind: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    }

    fn frames(mut bytes: &[u8]) -> Vec<Frame> {
        assert!(bytes.starts_with(PREFACE), "the preface goes through first");
        bytes = &bytes[PREFACE.len()..];
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let h = FrameHeader::parse(bytes).unwrap();
            assert!(h.len <= MAX_FRAME_SIZE);
            out.push(Frame {
                kind: h.kind,
                flags: h.flags,
                stream: h.stream,
                payload: bytes[FRAME_HEADER..FRAME_HEADER + h.len].to_vec(),
            });
            bytes = &bytes[FRAME_HEADER + h.len..];
        }
        out
    }

    /// What the server's HPACK decoder makes of each header block (HEADERS + CONTINUATION).
    fn server_blocks(
        frames: &[Frame],
        server: &mut Decoder<'static>,
    ) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        for f in frames {
            match f.kind {
                HEADERS => {
                    assert_eq!(f.flags & PADDED, 0, "padding is dropped");
                    let skip = if f.flags & PRIORITY != 0 {
                        PRIORITY_FIELDS
                    } else {
                        0
                    };
                    block = f.payload[skip..].to_vec();
                }
                CONTINUATION => block.extend_from_slice(&f.payload),
                _ => continue,
            }
            if f.flags & END_HEADERS != 0 {
                blocks.push(server.decode(&block).unwrap());
            }
        }
        blocks
    }

    fn rewrite_all(input: &[u8]) -> Result<Vec<u8>, Http2Fault> {
        let mut r = HeaderRewriter::default();
        let mut input = BytesMut::from(input);
        let mut out = BytesMut::new();
        r.feed(&mut input, &mut out)?;
        assert!(input.is_empty(), "everything complete was taken");
        Ok(out.to_vec())
    }

    fn with_preface(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut v = PREFACE.to_vec();
        for f in frames {
            v.extend_from_slice(f);
        }
        v
    }

    fn with_authority(headers: &[(Vec<u8>, Vec<u8>)], authority: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut h = headers.to_vec();
        for (n, v) in &mut h {
            if n == b":authority" {
                *v = authority.to_vec();
            }
        }
        h
    }

    #[test]
    fn a_refused_authority_becomes_localhost_and_other_frames_pass_unchanged() {
        let headers = request("/kvfabric.local.v1.LocalAgent/Submit", GRPCIO_AUTHORITY);
        assert!(http::uri::Authority::try_from(GRPCIO_AUTHORITY).is_err());
        let settings = frame(SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 100]);
        let data = frame(DATA, END_STREAM, 1, b"\0\0\0\0\x05hello");
        let block = encode(&mut Encoder::new(), &headers);
        let input = with_preface(&[
            settings.clone(),
            frame(HEADERS, END_HEADERS, 1, &block),
            data.clone(),
        ]);

        let out = rewrite_all(&input).unwrap();
        let f = frames(&out);
        assert_eq!(f.len(), 3);
        assert_eq!(
            frame(f[0].kind, f[0].flags, f[0].stream, &f[0].payload),
            settings
        );
        assert_eq!(
            (f[1].kind, f[1].flags, f[1].stream),
            (HEADERS, END_HEADERS, 1)
        );
        assert_eq!(
            frame(f[2].kind, f[2].flags, f[2].stream, &f[2].payload),
            data
        );
        let blocks = server_blocks(&f, &mut Decoder::new());
        assert_eq!(blocks, vec![with_authority(&headers, LOCAL_AUTHORITY)]);
    }

    #[test]
    fn an_accepted_authority_is_kept() {
        for authority in [&b"localhost"[..], b"127.0.0.1:50051", b"agent.kvfabric"] {
            let headers = request("/grpc.health.v1.Health/Check", authority);
            let block = encode(&mut Encoder::new(), &headers);
            let out =
                rewrite_all(&with_preface(&[frame(HEADERS, END_HEADERS, 1, &block)])).unwrap();
            assert_eq!(
                server_blocks(&frames(&out), &mut Decoder::new()),
                vec![headers]
            );
        }
    }

    /// A literal field with incremental indexing whose name is static-table entry `name`.
    fn indexed_literal(name: usize, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        loona_hpack::encoder::encode_integer_into(name, 6, 0x40, &mut out).unwrap();
        loona_hpack::encoder::encode_integer_into(value.len(), 7, 0, &mut out).unwrap();
        out.extend_from_slice(value);
        out
    }

    fn fields(list: &[(&str, &[u8])]) -> Vec<(Vec<u8>, Vec<u8>)> {
        list.iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.to_vec()))
            .collect()
    }

    #[test]
    fn dynamic_table_references_across_blocks_decode_to_the_clients_headers() {
        // As grpcio sends them: the first request puts :path, :authority and content-type in
        // its table; later ones refer to them with one byte each.
        let first = [
            vec![0x83, 0x86],
            indexed_literal(4, b"/a/Submit"),
            indexed_literal(1, GRPCIO_AUTHORITY),
            indexed_literal(31, b"application/grpc"),
        ]
        .concat();
        // Table now: 62 content-type, 63 :authority, 64 :path /a/Submit.
        let second = vec![0x83, 0x86, 0x80 | 64, 0x80 | 63, 0x80 | 62];
        let third = [
            vec![0x83, 0x86],
            indexed_literal(4, b"/a/Wait"),
            vec![0x80 | 64, 0x80 | 63],
        ]
        .concat();
        // Table now: 62 :path /a/Wait, 63 content-type, 64 :authority, 65 :path /a/Submit.
        let fourth = vec![0x83, 0x86, 0x80 | 65, 0x80 | 64, 0x80 | 63];
        let input = with_preface(&[
            frame(HEADERS, END_HEADERS, 1, &first),
            frame(HEADERS, END_HEADERS | END_STREAM, 3, &second),
            frame(HEADERS, END_HEADERS, 5, &third),
            frame(HEADERS, END_HEADERS, 7, &fourth),
        ]);
        let out = rewrite_all(&input).unwrap();
        let f = frames(&out);
        assert_eq!(
            f.iter().map(|f| f.flags & END_STREAM).collect::<Vec<_>>(),
            [0, 1, 0, 0]
        );
        // The first block drops the server's table; nothing after it refers to one.
        assert_eq!(f[0].payload[0], 0x20);
        let request = |path: &[u8]| {
            fields(&[
                (":method", b"POST"),
                (":scheme", b"http"),
                (":path", path),
                (":authority", LOCAL_AUTHORITY),
                ("content-type", b"application/grpc"),
            ])
        };
        assert_eq!(
            server_blocks(&f, &mut Decoder::new()),
            [
                request(b"/a/Submit"),
                request(b"/a/Submit"),
                request(b"/a/Wait"),
                request(b"/a/Submit")
            ]
        );
    }

    #[test]
    fn continuation_frames_are_joined_and_a_large_block_is_cut_again() {
        let mut headers = request("/a/Submit", GRPCIO_AUTHORITY);
        headers.push((b"x-big".to_vec(), vec![b'v'; 20_000]));
        let block = encode(&mut Encoder::new(), &headers);
        let (a, rest) = block.split_at(10);
        let (b, c) = rest.split_at(MAX_FRAME_SIZE);
        let input = with_preface(&[
            frame(HEADERS, END_STREAM, 3, a),
            frame(CONTINUATION, 0, 3, b),
            frame(CONTINUATION, END_HEADERS, 3, c),
        ]);
        let out = rewrite_all(&input).unwrap();
        let f = frames(&out);
        assert_eq!(f.len(), 2, "20 KB of fields need one CONTINUATION");
        assert_eq!(
            (f[0].kind, f[0].flags, f[0].stream),
            (HEADERS, END_STREAM, 3)
        );
        assert_eq!(
            (f[1].kind, f[1].flags, f[1].stream),
            (CONTINUATION, END_HEADERS, 3)
        );
        assert_eq!(
            server_blocks(&f, &mut Decoder::new()),
            vec![with_authority(&headers, LOCAL_AUTHORITY)]
        );
    }

    #[test]
    fn padding_is_dropped_and_priority_kept() {
        let headers = request("/a/Submit", GRPCIO_AUTHORITY);
        let block = encode(&mut Encoder::new(), &headers);
        let priority = [0x80, 0, 0, 0, 0x10];
        let mut payload = vec![7];
        payload.extend_from_slice(&priority);
        payload.extend_from_slice(&block);
        payload.extend_from_slice(&[0; 7]);
        let input = with_preface(&[frame(HEADERS, END_HEADERS | PADDED | PRIORITY, 5, &payload)]);
        let out = rewrite_all(&input).unwrap();
        let f = frames(&out);
        assert_eq!((f[0].kind, f[0].flags), (HEADERS, END_HEADERS | PRIORITY));
        assert_eq!(f[0].payload[..PRIORITY_FIELDS], priority);
        assert_eq!(
            server_blocks(&f, &mut Decoder::new()),
            vec![with_authority(&headers, LOCAL_AUTHORITY)]
        );
    }

    #[test]
    fn bytes_arriving_one_at_a_time_give_the_same_stream() {
        let mut client = Encoder::new();
        let b1 = encode(&mut client, &request("/a/Submit", GRPCIO_AUTHORITY));
        let b2 = encode(&mut client, &request("/a/Submit", GRPCIO_AUTHORITY));
        let input = with_preface(&[
            frame(SETTINGS, 0, 0, &[]),
            frame(HEADERS, END_HEADERS, 1, &b1),
            frame(DATA, END_STREAM, 1, &[0; 300]),
            frame(HEADERS, 0, 3, &b2[..3]),
            frame(CONTINUATION, END_HEADERS, 3, &b2[3..]),
        ]);
        let whole = rewrite_all(&input).unwrap();
        let mut r = HeaderRewriter::default();
        let (mut pending, mut out) = (BytesMut::new(), BytesMut::new());
        for b in &input {
            pending.extend_from_slice(&[*b]);
            r.feed(&mut pending, &mut out).unwrap();
        }
        assert!(pending.is_empty());
        assert_eq!(out.to_vec(), whole);
    }

    #[tokio::test]
    async fn a_connection_reads_the_rewritten_stream_whatever_the_chunks() {
        let mut client = Encoder::new();
        let mut frames_in = vec![frame(SETTINGS, 0, 0, &[])];
        for stream in [1u32, 3, 5] {
            let b = encode(&mut client, &request("/a/Submit", GRPCIO_AUTHORITY));
            frames_in.push(frame(HEADERS, END_HEADERS, stream, &b));
            frames_in.push(frame(DATA, END_STREAM, stream, &vec![stream as u8; 5000]));
        }
        let input = with_preface(&frames_in);
        let expect = rewrite_all(&input).unwrap();
        let (mut tx, rx) = tokio::io::duplex(64);
        let mut conn = AuthorityRewrite::new(rx);
        let writer = tokio::spawn(async move {
            for chunk in input.chunks(7) {
                tx.write_all(chunk).await.unwrap();
            }
        });
        let mut got = Vec::new();
        conn.read_to_end(&mut got).await.unwrap();
        writer.await.unwrap();
        assert_eq!(got, expect);
    }

    fn fault(input: &[u8]) -> Http2Fault {
        rewrite_all(input).unwrap_err()
    }

    #[test]
    fn malformed_streams_are_refused_with_what_is_wrong() {
        let block = encode(&mut Encoder::new(), &request("/a/Submit", GRPCIO_AUTHORITY));
        assert_eq!(
            fault(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            Http2Fault::Preface
        );
        assert_eq!(
            fault(&with_preface(&[frame(
                DATA,
                0,
                1,
                &vec![0; MAX_FRAME_SIZE + 1]
            )])),
            Http2Fault::FrameTooLarge {
                len: MAX_FRAME_SIZE + 1
            }
        );
        assert_eq!(
            fault(&with_preface(&[
                frame(HEADERS, 0, 1, &block[..4]),
                frame(DATA, 0, 1, b"x")
            ])),
            Http2Fault::ExpectedContinuation {
                kind: DATA,
                stream: 1
            }
        );
        assert_eq!(
            fault(&with_preface(&[
                frame(HEADERS, 0, 1, &block[..4]),
                frame(CONTINUATION, END_HEADERS, 3, &block[4..])
            ])),
            Http2Fault::UnexpectedContinuation { stream: 3 }
        );
        assert_eq!(
            fault(&with_preface(&[
                frame(HEADERS, 0, 1, &block[..4]),
                frame(HEADERS, END_HEADERS, 3, &block)
            ])),
            Http2Fault::ExpectedContinuation {
                kind: HEADERS,
                stream: 3
            }
        );
        assert_eq!(
            fault(&with_preface(&[frame(
                CONTINUATION,
                END_HEADERS,
                1,
                &block
            )])),
            Http2Fault::UnexpectedContinuation { stream: 1 }
        );
        assert_eq!(
            fault(&with_preface(&[frame(
                PUSH_PROMISE,
                END_HEADERS,
                1,
                &[0, 0, 0, 2]
            )])),
            Http2Fault::PushPromise
        );
        let mut padded = vec![200];
        padded.extend_from_slice(&block);
        assert_eq!(
            fault(&with_preface(&[frame(
                HEADERS,
                END_HEADERS | PADDED,
                1,
                &padded
            )])),
            Http2Fault::Padding {
                len: padded.len(),
                pad: 200
            }
        );
        assert_eq!(
            fault(&with_preface(&[frame(
                HEADERS,
                END_HEADERS | PRIORITY,
                1,
                &[0, 0, 0]
            )])),
            Http2Fault::Padding { len: 3, pad: 0 }
        );
        // Index 200 names nothing in the static or an empty dynamic table.
        assert!(matches!(
            fault(&with_preface(&[frame(
                HEADERS,
                END_HEADERS,
                1,
                &[0x80 | 0x7f, 200 - 127]
            )])),
            Http2Fault::Hpack(DecoderError::HeaderIndexOutOfBounds)
        ));
        // A table size past the 4096 the server advertises: 001 11111 + 8192 - 31.
        let mut grow = vec![0x3f, 0xe1, 0x3f];
        grow.extend_from_slice(&block);
        assert!(matches!(
            fault(&with_preface(&[frame(HEADERS, END_HEADERS, 1, &grow)])),
            Http2Fault::Hpack(DecoderError::InvalidMaxDynamicSize)
        ));
    }

    #[test]
    fn header_blocks_are_bounded_encoded_and_decoded() {
        // Encoded: continuations that never end.
        let mut input = with_preface(&[frame(HEADERS, 0, 1, &[0x82])]);
        let piece = frame(CONTINUATION, 0, 1, &vec![0x82; MAX_FRAME_SIZE]);
        for _ in 0..=MAX_HEADER_BLOCK / MAX_FRAME_SIZE {
            input.extend_from_slice(&piece);
        }
        assert!(matches!(
            fault(&input),
            Http2Fault::HeaderBlockTooLarge { .. }
        ));
        // Decoded: one 4000-byte table entry, then a one-byte reference to it, many times.
        let mut client = Encoder::new();
        let mut block = encode(&mut client, &[(b"x-big".to_vec(), vec![b'v'; 4000])]);
        block.extend(std::iter::repeat_n(0x80 | 62, 20));
        assert_eq!(
            fault(&with_preface(&[frame(HEADERS, END_HEADERS, 1, &block)])),
            Http2Fault::HeaderListTooLarge
        );
    }

    #[test]
    fn random_bytes_after_the_preface_never_panic() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(12);
        for _ in 0..2000 {
            let len = rng.random_range(0..200);
            let mut input = PREFACE.to_vec();
            // Mostly header frames with random payloads, so the HPACK decoder sees garbage.
            let payload: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            let kind = if rng.random_bool(0.8) {
                HEADERS
            } else {
                rng.random_range(0..12)
            };
            input.extend_from_slice(&frame(kind, rng.random(), rng.random_range(0..4), &payload));
            let mut r = HeaderRewriter::default();
            let (mut input, mut out) = (BytesMut::from(&input[..]), BytesMut::new());
            let _ = r.feed(&mut input, &mut out);
        }
    }
}
