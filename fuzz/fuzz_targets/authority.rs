//! The local API's HTTP/2 `:authority` rewriter on any byte stream a local client could send
//! (after the connection preface), fed in pieces of any size: a typed fault, or frames no longer
//! than the limit whose header blocks decode and carry only authorities `http` accepts, with at
//! most one frame held back between reads; never a panic.
#![no_main]

use bytes::BytesMut;
use kvfabric_authority::{
    CONTINUATION, END_HEADERS, FRAME_HEADER, FrameHeader, HEADERS, HeaderRewriter, MAX_FRAME_SIZE,
    PADDED, PREFACE, PRIORITY, PRIORITY_FIELDS,
};
use libfuzzer_sys::fuzz_target;
use loona_hpack::Decoder;

fuzz_target!(|data: &[u8]| {
    let Some((&piece, stream)) = data.split_first() else {
        return;
    };
    let piece = usize::from(piece).max(1);
    let mut bytes = PREFACE.to_vec();
    bytes.extend_from_slice(stream);
    let mut rewriter = HeaderRewriter::default();
    let (mut input, mut out) = (BytesMut::new(), BytesMut::new());
    for part in bytes.chunks(piece) {
        input.extend_from_slice(part);
        if rewriter.feed(&mut input, &mut out).is_err() {
            return;
        }
        assert!(
            input.len() < FRAME_HEADER + MAX_FRAME_SIZE,
            "more than one frame held back: {}",
            input.len()
        );
    }
    // What the server reads: the preface, then whole frames; header blocks decode on a fresh
    // server table.
    assert!(out.starts_with(PREFACE));
    let mut rest = &out[PREFACE.len()..];
    let mut server = Decoder::new();
    let mut block: Option<Vec<u8>> = None;
    while rest.len() >= FRAME_HEADER {
        let h = FrameHeader::parse(rest).expect("a frame the rewriter wrote parses");
        assert!(h.len <= MAX_FRAME_SIZE);
        if rest.len() < FRAME_HEADER + h.len {
            break; // a frame passed through as its bytes came, the rest still to come
        }
        let payload = &rest[FRAME_HEADER..FRAME_HEADER + h.len];
        match h.kind {
            HEADERS => {
                assert_eq!(h.flags & PADDED, 0, "rewritten blocks carry no padding");
                let skip = if h.flags & PRIORITY != 0 {
                    PRIORITY_FIELDS
                } else {
                    0
                };
                block = Some(payload[skip..].to_vec());
            }
            CONTINUATION => block
                .as_mut()
                .expect("a CONTINUATION follows a HEADERS")
                .extend_from_slice(payload),
            _ => {}
        }
        if matches!(h.kind, HEADERS | CONTINUATION) && h.flags & END_HEADERS != 0 {
            let fields = server
                .decode(&block.take().expect("an open block"))
                .expect("a rewritten block decodes");
            for (name, value) in fields {
                if name == b":authority" {
                    assert!(
                        http::uri::Authority::try_from(&value[..]).is_ok(),
                        "an authority h2 refuses went through"
                    );
                }
            }
        }
        rest = &rest[FRAME_HEADER + h.len..];
    }
});
