//! A chaos worker: registers a source and a destination segment with its agent, publishes the
//! source on the board, and pulls every other worker's source in turn, checking every byte.
//! When its agent forgets it (a restart), it registers again under a new generation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_client::{Client, HostMemory, Op, Segment};

use super::board::{Board, Published};
use super::tally::Tally;
use crate::worker::random_memory;

/// What a worker moves per pull.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub block: u64,
    pub blocks: u64,
    /// Blocks per pull (at most `blocks`).
    pub per_pull: u64,
}

/// A pull unanswered this long after the agent's own batch deadline is hung.
pub const HUNG_AFTER: Duration = Duration::from_secs(15);
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Runs worker `slot` against the agent whose sockets are in `socket_dir`, forever (the chaos
/// runner aborts it: a worker killed mid-pull).
pub async fn run(
    slot: usize,
    socket_dir: std::path::PathBuf,
    shape: Shape,
    board: Arc<Board>,
    tally: Arc<Tally>,
    seed: u64,
) {
    let mut generation = 0u64;
    loop {
        generation += 1;
        let Some((client, dst, dst_segment)) =
            register(slot, generation, &socket_dir, shape, &board, seed).await
        else {
            tokio::time::sleep(RETRY_PAUSE).await;
            continue;
        };
        pull_until_forgotten(slot, &client, &dst, &dst_segment, shape, &board, &tally).await;
        board.withdraw(slot, generation);
    }
}

/// Connects and registers generation `generation`'s segments; None while the agent is away.
async fn register(
    slot: usize,
    generation: u64,
    socket_dir: &std::path::Path,
    shape: Shape,
    board: &Board,
    seed: u64,
) -> Option<(Client, HostMemory, Segment)> {
    let client = Client::connect(socket_dir).await.ok()?;
    let bytes = shape.block * shape.blocks;
    let src = Arc::new(random_memory(
        bytes,
        seed ^ (slot as u64) << 32 ^ generation,
    ));
    let dst = HostMemory::alloc(bytes).ok()?;
    let src_name = format!("w{slot}g{generation}s");
    let dst_name = format!("w{slot}g{generation}d");
    let src_segment = client.register(&src_name, &[&src], None).await.ok()?;
    let dst_segment = client.register(&dst_name, &[&dst], None).await.ok()?;
    board.publish(
        slot,
        Published {
            generation,
            name: src_name,
            dst_name,
            key: src_segment.key,
            src,
        },
    );
    Some((client, dst, dst_segment))
}

/// Pulls from the other workers in turn until this worker's agent no longer serves its
/// destination segment.
async fn pull_until_forgotten(
    slot: usize,
    client: &Client,
    dst: &HostMemory,
    dst_segment: &Segment,
    shape: Shape,
    board: &Board,
    tally: &Tally,
) {
    let mut round = 0u64;
    loop {
        round += 1;
        let Some((from, source)) = board.next_source(slot, round) else {
            tokio::time::sleep(RETRY_PAUSE).await;
            continue;
        };
        let ops = ops(shape, round);
        // Zero first: a block left from an earlier pull can not pass for this one.
        refill_zero(dst);
        let started = Instant::now();
        let done = tokio::time::timeout(
            HUNG_AFTER,
            client.read(dst_segment, &source.name, source.key, &ops),
        )
        .await;
        match done {
            Err(_) => tally.hung(slot, from, started.elapsed()),
            Ok(Ok(_)) => {
                let wrong = wrong_bytes(&ops, dst, &source.src);
                tally.pulled(slot, from, ops.iter().map(|o| o.len).sum(), wrong);
            }
            Ok(Err(e)) => {
                tally.failed(&e);
                if !still_served(client, &dst_segment.name).await {
                    return;
                }
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }
}

/// Whether this worker's agent still holds its segment (false: restarted, or down for good
/// as far as this generation goes).
async fn still_served(client: &Client, name: &str) -> bool {
    for _ in 0..3 {
        match client.status().await {
            Ok(s) => return s.segments.iter().any(|r| r.local && r.name == name),
            Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
        }
    }
    false
}

/// `per_pull` blocks, remote block `(i·7 + round) mod blocks` into local block `i`.
fn ops(shape: Shape, round: u64) -> Vec<Op> {
    (0..shape.per_pull)
        .map(|i| Op {
            local_region: 0,
            local_offset: i * shape.block,
            remote_region: 0,
            remote_offset: ((i * 7 + round) % shape.blocks) * shape.block,
            len: shape.block,
        })
        .collect()
}

fn refill_zero(m: &HostMemory) {
    // SAFETY: this worker's pulls are done (one at a time), nothing else writes `m`.
    unsafe { m.as_mut_slice() }.fill(0);
}

/// Bytes of the pulled blocks that differ from their sources.
fn wrong_bytes(ops: &[Op], dst: &HostMemory, src: &HostMemory) -> u64 {
    // SAFETY: the pull completed; the source is never written after its registration.
    let (d, s) = unsafe { (dst.as_slice(), src.as_slice()) };
    ops.iter()
        .map(|o| {
            let (l, r, n) = (
                o.local_offset as usize,
                o.remote_offset as usize,
                o.len as usize,
            );
            d[l..l + n]
                .iter()
                .zip(&s[r..r + n])
                .filter(|(a, b)| a != b)
                .count() as u64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_stay_inside_both_sides_and_move_every_block_in_turn() {
        let shape = Shape {
            block: 4096,
            blocks: 16,
            per_pull: 16,
        };
        let mut seen = std::collections::BTreeSet::new();
        for round in 0..16 {
            for o in ops(shape, round) {
                assert!(o.local_offset + o.len <= shape.block * shape.per_pull);
                assert!(o.remote_offset + o.len <= shape.block * shape.blocks);
                seen.insert(o.remote_offset);
            }
        }
        assert_eq!(seen.len(), 16);
    }

    #[test]
    fn wrong_bytes_counts_each_differing_byte() {
        let src = random_memory(8192, 1);
        let dst = HostMemory::alloc(8192).unwrap();
        let shape = Shape {
            block: 4096,
            blocks: 2,
            per_pull: 2,
        };
        let ops = ops(shape, 0);
        assert_eq!(wrong_bytes(&ops, &dst, &src), 8192 - zeros(&src));
        // SAFETY: nothing else uses either.
        unsafe {
            for o in &ops {
                let (l, r, n) = (o.local_offset as usize, o.remote_offset as usize, 4096);
                dst.as_mut_slice()[l..l + n].copy_from_slice(&src.as_slice()[r..r + n]);
            }
            dst.as_mut_slice()[5] ^= 1;
        }
        assert_eq!(wrong_bytes(&ops, &dst, &src), 1);
    }

    fn zeros(m: &HostMemory) -> u64 {
        // SAFETY: nothing writes it.
        unsafe { m.as_slice() }.iter().filter(|b| **b == 0).count() as u64
    }
}
