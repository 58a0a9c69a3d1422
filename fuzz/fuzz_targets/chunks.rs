//! How the tcp link cuts a planned batch into chunks (op manifests, or block-table slices),
//! for batches of any shape that passed the planner: every byte of every piece goes exactly once,
//! in order, in chunks no larger than the chunk size and no longer than a manifest may be, each
//! of one place (host, or one GPU); a table it cannot carry is handed back exactly when a block
//! is larger than a chunk or its planes live in different places; never a panic.
#![no_main]

use kvfabric_engine::fuzzing::{MAX_CHUNK_ENTRIES, PlannedChunk, tcp_chunks, tcp_table_chunks};
use libfuzzer_sys::fuzz_target;

fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..b.len().min(8)].copy_from_slice(&b[..b.len().min(8)]);
    u64::from_le_bytes(w)
}

fn device(b: u8) -> Option<u32> {
    match b % 4 {
        0 | 1 => None,
        d => Some(u32::from(d)),
    }
}

fn check_chunk(c: &PlannedChunk, chunk_bytes: u64) {
    assert!(!c.pieces.is_empty(), "an empty chunk");
    assert!(c.bytes <= chunk_bytes.max(1), "{} > {chunk_bytes}", c.bytes);
    assert!(c.pieces.len() <= MAX_CHUNK_ENTRIES);
    assert_eq!(c.pieces.iter().map(|p| p.2).sum::<u64>(), c.bytes);
    for (p, d) in c.pieces.iter().zip(&c.devices) {
        assert_eq!(p.2, p.3, "local and remote lengths differ");
        assert_eq!(*d, c.device, "a chunk of two places");
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let chunk_bytes = word(&data[..3]) % (1 << 22) + 1;
    let rest = &data[4..];
    if data[3] & 1 == 0 {
        // Op manifests: pieces of 1 byte to 1 MiB (at most 16 chunks each, so a run stays
        // quick), at any remote offset that fits.
        let longest = (1u64 << 20).min(16 * chunk_bytes);
        let pieces: Vec<(u64, u64, Option<u32>)> = rest
            .chunks_exact(8)
            .take(256)
            .map(|c| {
                let len = word(&c[..3]) % longest + 1;
                let offset = word(&c[3..7]) % (1 << 40);
                (offset, len, device(c[7]))
            })
            .collect();
        let chunks = tcp_chunks(chunk_bytes, &pieces);
        let mut flat = Vec::new();
        for c in &chunks {
            check_chunk(c, chunk_bytes);
            assert!(c.table.is_none());
            flat.extend(c.pieces.iter().copied());
        }
        // Every piece, in order, cut into consecutive parts and nothing else.
        let mut parts = flat.iter().peekable();
        for (op, &(offset, len, _)) in pieces.iter().enumerate() {
            let mut at = offset;
            while at < offset + len {
                let p = parts.next().expect("a piece's bytes went missing");
                assert_eq!((p.0, p.1), (op, at), "out of order or overlapping");
                at += p.2;
            }
            assert_eq!(at, offset + len, "a part runs past its piece");
        }
        assert!(parts.next().is_none(), "parts of no piece");
    } else {
        let Some((&n, rest)) = rest.split_first() else {
            return;
        };
        let planes_n = usize::from(n % 16) + 1;
        if rest.len() < planes_n * 4 + 2 {
            return;
        }
        let planes: Vec<(u64, Option<u32>)> = rest[..planes_n * 4]
            .chunks_exact(4)
            .map(|c| (word(&c[..3]) % (1 << 20) + 1, device(c[3])))
            .collect();
        let blocks = u32::from(u16::from_le_bytes([
            rest[planes_n * 4],
            rest[planes_n * 4 + 1],
        ])) % 2048
            + 1;
        let carried = tcp_table_chunks(chunk_bytes, &planes, blocks);
        let one_place = planes.iter().all(|p| p.1 == planes[0].1);
        let fits = planes.iter().all(|p| p.0 <= chunk_bytes);
        let Some(chunks) = carried else {
            assert!(
                !(one_place && fits),
                "a table it could carry was handed back"
            );
            return;
        };
        assert!(one_place && fits, "a table it cannot carry was cut");
        let mut seen = vec![0u8; planes_n * blocks as usize];
        for c in &chunks {
            check_chunk(c, chunk_bytes);
            let (ps, bs) = c.table.clone().expect("a table chunk");
            assert_eq!(c.pieces.len(), ps.len() * bs.len());
            let mut ops = c.pieces.iter().map(|p| p.0);
            for p in ps {
                for b in bs.clone() {
                    let op = ops.next().expect("element");
                    assert_eq!(op, p * blocks as usize + b, "element order");
                    seen[op] += 1;
                }
            }
        }
        assert!(
            seen.iter().all(|&n| n == 1),
            "an element missed or sent twice"
        );
    }
});
