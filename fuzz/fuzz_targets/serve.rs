//! What a tcp target checks of a peer's manifest or block table before a byte moves (regions and
//! keys, bounds, staging, destinations apart for writes), driven with anything a peer could send:
//! a typed refusal, or ranges that each lie inside the region they name at the offset the peer
//! asked and, for writes, never overlap one another; never a panic.
#![no_main]

use std::sync::OnceLock;

use kvfabric_engine::frame::{Entry, TableManifest, TablePlane};
use kvfabric_engine::fuzzing::{Passed, Served};
use kvfabric_engine::{AccessKey, RegionId};
use libfuzzer_sys::fuzz_target;

const LENS: [u64; 3] = [1, 4096, 1 << 20];

fn served() -> &'static Served {
    static S: OnceLock<Served> = OnceLock::new();
    S.get_or_init(|| Served::new(&LENS).expect("regions"))
}

fn word(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

/// Small numbers mostly, numbers near 2^64 when the bit says so (a peer may send anything).
fn number(w: u64, top: bool) -> u64 {
    if top {
        u64::MAX - (w % 4096)
    } else {
        w % (1 << 21)
    }
}

/// A served region with its key, the same region with a wrong key, or an unknown id.
fn region(selector: u8) -> (RegionId, AccessKey) {
    let regions = served().regions();
    match regions.get(usize::from(selector & 0x3f) % (regions.len() + 1)) {
        Some(&(id, key, _)) if selector & 0x80 == 0 => (id, key),
        Some(&(id, key, _)) => (id, AccessKey(key.0 ^ 1)),
        None => (RegionId(999), AccessKey(0)),
    }
}

fn assert_apart(passed: &[Passed]) {
    let mut sorted = passed.to_vec();
    sorted.sort_by_key(|p| (p.region.0, p.offset));
    for w in sorted.windows(2) {
        assert!(
            w[0].region != w[1].region || w[0].offset + w[0].len <= w[1].offset,
            "write destinations overlap: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let writes = mode & 1 == 1;
    let staging = if mode & 2 == 0 { 0 } else { 1 << 20 };
    if mode & 4 == 0 {
        let entries: Vec<Entry> = rest
            .chunks_exact(17)
            .map(|c| {
                let (id, key) = region(c[0]);
                Entry {
                    region: id,
                    key,
                    offset: number(word(&c[1..], 0), c[0] & 0x40 != 0),
                    len: word(&c[1..], 1) % (1 << 13),
                }
            })
            .collect();
        if let Ok(passed) = served().entries(&entries, writes, staging) {
            assert_eq!(passed.len(), entries.len());
            for (p, e) in passed.iter().zip(&entries) {
                assert_eq!((p.region, p.offset, p.len), (e.region, e.offset, e.len));
            }
            if writes {
                assert_apart(&passed);
            }
        }
    } else {
        let Some((&planes, rest)) = rest.split_first() else {
            return;
        };
        let planes = usize::from(planes % 4) + 1;
        if rest.len() < planes * 25 {
            return;
        }
        let (head, ids) = rest.split_at(planes * 25);
        let table = TableManifest {
            planes: head
                .chunks_exact(25)
                .map(|c| {
                    let (id, key) = region(c[0]);
                    TablePlane {
                        region: id,
                        key,
                        base: number(word(&c[1..], 0), c[0] & 0x40 != 0),
                        stride: word(&c[1..], 1) % (1 << 16),
                        block_bytes: word(&c[1..], 2) % (1 << 13),
                    }
                })
                .collect(),
            blocks: ids
                .chunks_exact(2)
                .take(64)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        };
        if let Ok(passed) = served().table(&table, writes, staging) {
            let blocks = table.blocks.len();
            assert_eq!(passed.len(), table.planes.len() * blocks);
            for (i, p) in passed.iter().enumerate() {
                let plane = &table.planes[i / blocks];
                let id = u64::from(table.blocks[i % blocks]);
                assert_eq!(p.region, plane.region);
                assert_eq!(p.offset, plane.base + id * plane.stride);
                assert_eq!(p.len, plane.block_bytes);
            }
            if writes {
                assert_apart(&passed);
            }
        }
    }
});
