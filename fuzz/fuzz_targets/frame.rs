//! Arbitrary bytes through the frame decoder: it must return a typed error or a frame that
//! re-encodes to the same header (and a table manifest to the same body), and never panic or
//! allocate from an unchecked length. Then the
//! same bytes as a caller's side of the handshake: never admitted (the target's nonce is fresh,
//! so no input can carry its proof), and answered with nothing but the challenge and the one
//! generic refusal.
#![no_main]

use kvfabric_engine::RemoteError;
use kvfabric_engine::frame::{
    Challenge, ENTRY_LEN, Entry, FLAG_ERROR, FLAG_TRACE, FrameKind, HEADER_LEN, Header, Hello,
    TABLE_HEAD_LEN, TRACE_LEN, TableHead, Welcome, decode_crcs, decode_json, decode_manifest,
    decode_table, encode_table,
};
use kvfabric_engine::fuzzing::serve_handshake;
use libfuzzer_sys::fuzz_target;

/// A table manifest decodes to a typed error, or to planes and ids consistent with the header
/// that re-encode to the same bytes.
fn table(h: &Header, body: &[u8]) {
    let at = if h.has(FLAG_TRACE) { TRACE_LEN } else { 0 };
    let Some(head) = body.get(at..at + TABLE_HEAD_LEN) else {
        return;
    };
    let Ok(head) = TableHead::decode(h, head.try_into().unwrap()) else {
        return;
    };
    if let Ok(t) = decode_table(h, &head, &body[at + TABLE_HEAD_LEN..]) {
        assert_eq!(t.planes.len() * t.blocks.len(), h.count as usize);
        let row: u64 = t.planes.iter().map(|p| p.block_bytes).sum();
        assert_eq!(row * t.blocks.len() as u64, h.len);
        let mut again = Vec::new();
        encode_table(&t.planes, t.blocks.iter().copied(), &mut again);
        assert_eq!(again, body[at..at + again.len()]);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let body = &data[HEADER_LEN..];
        match h.kind {
            _ if h.has(FLAG_ERROR) => {
                let _ = decode_json::<RemoteError>("error", body);
            }
            FrameKind::WriteManifest | FrameKind::ReadManifest => {
                if let Ok(entries) = decode_manifest(&h, body) {
                    assert_eq!(entries.len(), h.count as usize);
                    assert_eq!(entries.iter().map(|e| e.len).sum::<u64>(), h.len);
                }
            }
            FrameKind::WriteTable | FrameKind::ReadTable => table(&h, body),
            FrameKind::ReadData => {
                let _ = decode_crcs(h.count, body);
            }
            FrameKind::Challenge => {
                let _ = decode_json::<Challenge>("challenge", body);
            }
            FrameKind::Hello => {
                let _ = decode_json::<Hello>("hello", body);
            }
            FrameKind::Welcome => {
                let _ = decode_json::<Welcome>("welcome", body);
            }
            FrameKind::MapRegion if body.len() >= ENTRY_LEN => {
                let _ = Entry::decode(body[..ENTRY_LEN].try_into().unwrap());
            }
            _ => {}
        }
    }
    for key in [None, Some(42)] {
        let (admitted, out) = serve_handshake(data, key);
        assert!(!admitted, "admitted without the secret");
        let h = Header::decode(&out).expect("a challenge first");
        assert_eq!(h.kind, FrameKind::Challenge);
        let rest = &out[HEADER_LEN + h.len as usize..];
        if !rest.is_empty() {
            let r = Header::decode(rest).expect("then a refusal");
            assert!(r.kind == FrameKind::Welcome && r.has(FLAG_ERROR));
            let e: RemoteError = decode_json("error", &rest[HEADER_LEN..]).unwrap();
            assert_eq!(
                (e.code.as_str(), e.message.as_str()),
                ("unauthenticated", "authentication failed")
            );
            assert_eq!(rest.len(), HEADER_LEN + r.len as usize);
        }
    }
});
