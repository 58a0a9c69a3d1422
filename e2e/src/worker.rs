//! Emulated prefill and decode workers: random KV blocks in registered host memory, and checks of
//! what arrived.

use kvfabric_client::{HostMemory, Op};
use rand::{RngCore, SeedableRng};

/// `len` bytes of seeded random data in memory an agent can adopt.
pub fn random_memory(len: u64, seed: u64) -> HostMemory {
    let m = HostMemory::alloc(len).expect("memfd");
    refill(&m, seed);
    m
}

/// Overwrites all of `m` with fresh seeded random bytes, so a later check cannot pass on what
/// an earlier transfer left there. No batch may use `m` meanwhile.
pub fn refill(m: &HostMemory, seed: u64) {
    // SAFETY: callers refill only while no batch reads or writes `m`.
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(unsafe { m.as_mut_slice() });
}

/// `n` block pulls: local block i ← remote block (i·7 mod blocks), a scattered pattern.
pub fn scattered(n: u64, block: u64, remote_blocks: u64) -> Vec<Op> {
    (0..n)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * block,
            remote_region: 0,
            remote_offset: (i * 7 % remote_blocks) * block,
            len: block,
        })
        .collect()
}

/// Every op's destination holds its source; returns the first op that does not.
pub fn first_mismatch(ops: &[Op], dst: &HostMemory, src: &HostMemory) -> Option<usize> {
    // SAFETY: callers check after every batch has completed.
    let (d, s) = unsafe { (dst.as_slice(), src.as_slice()) };
    ops.iter().position(|o| {
        let (l, r, n) = (
            o.local_offset as usize,
            o.remote_offset as usize,
            o.len as usize,
        );
        d[l..l + n] != s[r..r + n]
    })
}
