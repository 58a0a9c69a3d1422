//! Arbitrary bytes through the frame decoder: it must return a typed error or a frame that
//! re-encodes to the same header, and never panic or allocate from an unchecked length. Then the
//! same bytes as a caller's side of the handshake: never admitted (the target's nonce is fresh,
//! so no input can carry its proof), and answered with nothing but the challenge and the one
//! generic refusal.
#![no_main]

use kvfabric_engine::RemoteError;
use kvfabric_engine::frame::{
    Challenge, ENTRY_LEN, Entry, FLAG_ERROR, FrameKind, HEADER_LEN, Header, Hello, Welcome,
    decode_crcs, decode_json, decode_manifest,
};
use kvfabric_engine::fuzzing::serve_handshake;
use libfuzzer_sys::fuzz_target;

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
