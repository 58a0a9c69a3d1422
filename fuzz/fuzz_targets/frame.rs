//! Arbitrary bytes through the frame decoder: it must return a typed error or a frame that
//! re-encodes to the same header, and never panic or allocate from an unchecked length.
#![no_main]

use kvfabric_engine::frame::{
    FrameKind, HEADER_LEN, Header, Hello, decode_crcs, decode_json, decode_manifest,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(h) = Header::decode(data) else {
        return;
    };
    assert_eq!(Header::decode(&h.encode()), Ok(h));
    let body = &data[HEADER_LEN..];
    match h.kind {
        FrameKind::WriteManifest | FrameKind::ReadManifest => {
            if let Ok(entries) = decode_manifest(&h, body) {
                assert_eq!(entries.len(), h.count as usize);
                assert_eq!(entries.iter().map(|e| e.len).sum::<u64>(), h.len);
            }
        }
        FrameKind::ReadData => {
            let _ = decode_crcs(h.count, body);
        }
        _ => {
            let _ = decode_json::<Hello>("hello", body);
        }
    }
});
