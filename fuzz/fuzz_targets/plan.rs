//! Arbitrary batches through the planner a `Peer` runs before anything reaches a transport
//! (limits, bounds on both sides, overlaps, coalescing), then through the rdma work-request
//! planner and the cuda-ipc op list. A typed error, or pieces that each lie inside their regions
//! and add up to the batch; never a panic.
#![no_main]

use std::sync::OnceLock;

use kvfabric_engine::cuda::oplist::OpList;
use kvfabric_engine::fuzzing::Planner;
use kvfabric_engine::rdma::plan::{PlanConfig, lanes, plan};
use kvfabric_engine::{Batch, BlockOp, Coalesced, Opcode, RegionId, TransportKind};
use libfuzzer_sys::fuzz_target;

const LOCAL: [u64; 3] = [1, 4096, 1 << 20];
/// What the peer's descriptor claims, up to 2^64 - 1 (only its own checks bound those).
const REMOTE: [u64; 4] = [1, 8192, 1 << 40, u64::MAX];
const KINDS: [TransportKind; 2] = [TransportKind::Tcp, TransportKind::Shm];

fn planner() -> &'static Planner {
    static P: OnceLock<Planner> = OnceLock::new();
    P.get_or_init(|| Planner::new(&LOCAL, &REMOTE, &KINDS).expect("planner"))
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let p = planner();
    let locals = p.local_ids();
    let ops: Vec<BlockOp> = rest
        .chunks_exact(25)
        .map(|c| {
            let word = |i: usize| u64::from_le_bytes(c[1 + i * 8..9 + i * 8].try_into().unwrap());
            let near_top = |w: u64| u64::MAX - (w % 4096);
            let local_offset = if c[0] & 1 == 0 {
                word(0) % (1 << 21)
            } else {
                near_top(word(0))
            };
            let remote_offset = if c[0] & 2 == 0 {
                word(1) % (1 << 21)
            } else {
                near_top(word(1))
            };
            BlockOp {
                // One id past the end: an unknown region.
                local_region: locals
                    .get(usize::from(c[0] >> 2) % (locals.len() + 1))
                    .copied()
                    .unwrap_or(RegionId(999)),
                local_offset,
                remote_region: RegionId(u64::from(c[0] >> 5) % (REMOTE.len() as u64 + 1) + 1),
                remote_offset,
                len: word(2) % (1 << 13),
            }
        })
        .collect();
    let opcode = if first & 1 == 0 {
        Opcode::Read
    } else {
        Opcode::Write
    };
    let batch = Batch::new(opcode, ops.clone()).with_checksum(first & 2 != 0);
    let peer = usize::from(first >> 2) % KINDS.len();
    let Ok(pieces) = p.plan(peer, batch) else {
        return;
    };
    // Accepted: every piece inside both regions, and the pieces add up to the batch.
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let mut sum = 0u64;
    for piece in &pieces {
        let local_len = LOCAL[locals
            .iter()
            .position(|&r| r == piece.local_region)
            .unwrap()];
        let remote_len = REMOTE[(piece.remote.region.0 - 1) as usize];
        assert!(piece.local_offset + piece.remote.len <= local_len);
        assert!(piece.remote.offset.checked_add(piece.remote.len).unwrap() <= remote_len);
        sum += piece.remote.len;
    }
    assert_eq!(sum, total);
    // The same pieces as rdma plans them: every byte once, over the lanes.
    let coalesced: Vec<Coalesced> = pieces
        .iter()
        .map(|piece| Coalesced {
            op: BlockOp {
                local_region: piece.local_region,
                local_offset: piece.local_offset,
                remote_region: piece.remote.region,
                remote_offset: piece.remote.offset,
                len: piece.remote.len,
            },
            first_index: piece.op,
        })
        .collect();
    let cfg = PlanConfig {
        slice_bytes: 1 + u64::from(first) * 97,
        ..PlanConfig::default()
    };
    let planned = plan(&coalesced, &lanes(2, 2), &cfg).expect("accepted pieces plan");
    assert_eq!(planned.bytes, total);
    // And as the cuda-ipc op list takes them (addresses as if both regions sat at the top of
    // the address space: the list refuses what would pass 2^64).
    let mut list = OpList::new(64 << 10);
    for piece in &pieces {
        let base = u64::MAX - (1 << 21);
        list.push(
            base + piece.local_offset,
            piece.remote.offset,
            piece.remote.len,
        )
        .expect("inside the address space");
    }
    assert_eq!(list.ops().map(|o| o.len).sum::<u64>(), total);
});
