//! Arbitrary block ops through `validate` and `coalesce`: a typed error or a verdict that a
//! naive check agrees with, and coalesced ops that cover exactly the ops they came from. Never a
//! panic, a wrapped sum or an allocation sized from an unchecked offset.
#![no_main]

use kvfabric_engine::{BlockOp, Error, Opcode, RegionId, coalesce, validate};
use libfuzzer_sys::fuzz_target;

/// Five words per op; region ids from few values so ops share regions.
fn ops(data: &[u8]) -> Vec<BlockOp> {
    data.chunks_exact(33)
        .map(|c| {
            let word = |i: usize| u64::from_le_bytes(c[1 + i * 8..9 + i * 8].try_into().unwrap());
            // Offsets mostly small and block-shaped, sometimes anything (near 2^64 included).
            let shape = |w: u64, sel: u8| match sel % 4 {
                0 => w,
                1 => u64::MAX - (w % 64),
                _ => (w % 256) * 16,
            };
            let len = match c[0] >> 6 {
                0 => word(3),
                1 => u64::MAX - (word(3) % 4),
                _ => 16,
            };
            BlockOp {
                local_region: RegionId(u64::from(c[0] & 3)),
                local_offset: shape(word(0), c[0] >> 2),
                remote_region: RegionId(u64::from((c[0] >> 4) & 1)),
                remote_offset: shape(word(1), c[0] >> 3),
                len,
            }
        })
        .collect()
}

fn dest(o: &BlockOp, opcode: Opcode) -> (RegionId, u64, u64) {
    match opcode {
        Opcode::Read => (o.local_region, o.local_offset, o.len),
        Opcode::Write => (o.remote_region, o.remote_offset, o.len),
    }
}

fn overlap(a: (RegionId, u64, u64), b: (RegionId, u64, u64)) -> bool {
    let end = |(_, o, l): (RegionId, u64, u64)| u128::from(o) + u128::from(l);
    a.0 == b.0 && u128::from(a.1) < end(b) && u128::from(b.1) < end(a)
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let opcode = if first & 1 == 0 {
        Opcode::Read
    } else {
        Opcode::Write
    };
    let ops = ops(rest);
    match validate(&ops, opcode) {
        Ok(()) => {
            // Every pair is disjoint and every end fits.
            for (i, a) in ops.iter().enumerate() {
                assert!(a.len > 0);
                assert!(a.local_offset.checked_add(a.len).is_some());
                assert!(a.remote_offset.checked_add(a.len).is_some());
                for b in &ops[..i] {
                    assert!(!overlap(dest(a, opcode), dest(b, opcode)), "{a:?} {b:?}");
                }
            }
        }
        Err(Error::OverlappingDestination { first, second, .. }) => {
            assert!(first < second);
            assert!(overlap(
                dest(&ops[first], opcode),
                dest(&ops[second], opcode)
            ));
        }
        Err(Error::EmptyBatch) => assert!(ops.is_empty()),
        Err(Error::ZeroLength { op }) => assert_eq!(ops[op].len, 0),
        Err(Error::RangeOverflow {
            op, offset, len, ..
        }) => {
            assert_eq!(ops[op].len, len);
            assert!(offset.checked_add(len).is_none());
        }
        Err(other) => panic!("unexpected error {other}"),
    }
    // Coalescing (on any ops, checked or not) partitions them into runs in order, each run
    // adjacent on both sides and its lengths summed exactly.
    let groups: Vec<_> = coalesce(&ops).collect();
    for (k, c) in groups.iter().enumerate() {
        let end = groups.get(k + 1).map_or(ops.len(), |g| g.first_index);
        assert!(c.first_index < end);
        let run = &ops[c.first_index..end];
        let mut len = 0u64;
        for o in run {
            assert_eq!(o.local_region, c.op.local_region);
            assert_eq!(o.remote_region, c.op.remote_region);
            assert_eq!(Some(o.local_offset), c.op.local_offset.checked_add(len));
            assert_eq!(Some(o.remote_offset), c.op.remote_offset.checked_add(len));
            len = len.checked_add(o.len).expect("coalesced lengths fit");
        }
        assert_eq!(len, c.op.len);
    }
    assert_eq!(groups.first().map_or(0, |g| g.first_index), 0);
    assert_eq!(groups.is_empty(), ops.is_empty());
});
