//! Data integrity of each transport: random block sizes, unaligned offsets, both directions,
//! many batches in flight, with and without checksums. Every destination byte is compared, and
//! bytes outside the destination ranges must keep their poison.

mod common;

use std::sync::Arc;

use common::{bytes, config, random_region, target};
use kvfabric_engine::{Batch, BlockOp, Engine, Opcode, Peer, Preference, Region, TransportKind};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const POOL: u64 = 8 << 20;

/// Disjoint random ranges (unaligned offsets, sizes 1 B .. 300 KiB) on both sides.
fn random_ops(rng: &mut SmallRng, local: &Region, remote: &Region, count: usize) -> Vec<BlockOp> {
    // Walk both pools with random gaps so destination ranges never overlap.
    let (mut lo, mut ro) = (rng.random_range(0..4096u64), rng.random_range(0..4096u64));
    let mut ops = Vec::new();
    for _ in 0..count {
        let len = match rng.random_range(0..4) {
            0 => rng.random_range(1..64),
            1 => rng.random_range(64..8192),
            2 => rng.random_range(8192..65536),
            _ => rng.random_range(65536..300_000),
        };
        if lo + len > local.len() || ro + len > remote.len() {
            break;
        }
        ops.push(BlockOp {
            local_region: local.id(),
            local_offset: lo,
            remote_region: remote.id(),
            remote_offset: ro,
            len,
        });
        lo += len + rng.random_range(0..3) * rng.random_range(1..5000);
        ro += len + rng.random_range(0..3) * rng.random_range(1..5000);
    }
    // Submission order need not follow memory order.
    let n = ops.len();
    for i in 0..n {
        ops.swap(i, rng.random_range(i..n));
    }
    ops
}

fn expected_after(op: Opcode, ops: &[BlockOp], local: &[u8], remote: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let (mut l, mut r) = (local.to_vec(), remote.to_vec());
    for o in ops {
        let (lo, ro, n) = (
            o.local_offset as usize,
            o.remote_offset as usize,
            o.len as usize,
        );
        match op {
            Opcode::Read => l[lo..lo + n].copy_from_slice(&remote[ro..ro + n]),
            Opcode::Write => r[ro..ro + n].copy_from_slice(&local[lo..lo + n]),
        }
    }
    (l, r)
}

async fn run(kind: TransportKind, checksum: bool, seed: u64) {
    let t = target(config("target")).await;
    let initiator = Engine::new(config("initiator")).unwrap();
    let mut rng = SmallRng::seed_from_u64(seed);
    for op in [Opcode::Write, Opcode::Read] {
        // Several batches in flight at once, each on its own pair of regions.
        let mut cases = Vec::new();
        for i in 0..6 {
            let local = random_region(&initiator, POOL - i * 4099, rng.random());
            let remote = random_region(&t.engine, POOL + i * 4097, rng.random());
            let ops = random_ops(&mut rng, &local, &remote, 200);
            assert!(!ops.is_empty());
            cases.push((local, remote, ops));
        }
        let peer: Arc<Peer> = Arc::new(
            initiator
                .connect(
                    &t.engine.descriptor(),
                    t.engine.data_secret(),
                    Preference::Only(kind),
                    None,
                )
                .await
                .unwrap(),
        );
        assert_eq!(peer.transport(), kind);
        let before: Vec<_> = cases.iter().map(|(l, r, _)| (bytes(l), bytes(r))).collect();
        let handles: Vec<_> = cases
            .iter()
            .map(|(_, _, ops)| {
                peer.submit(Batch::new(op, ops.clone()).with_checksum(checksum))
                    .unwrap()
            })
            .collect();
        for (h, (_, _, ops)) in handles.into_iter().zip(&cases) {
            let res = h.wait().await.unwrap();
            assert_eq!(res.transport, kind);
            assert_eq!(res.bytes, ops.iter().map(|o| o.len).sum::<u64>());
            assert!(res.coalesced_ops <= ops.len());
        }
        for ((local, remote, ops), (lb, rb)) in cases.iter().zip(before) {
            let (le, re) = expected_after(op, ops, &lb, &rb);
            assert!(bytes(local) == le, "{kind} {op}: local pool differs");
            assert!(bytes(remote) == re, "{kind} {op}: remote pool differs");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_moves_random_blocks_exactly() {
    run(TransportKind::Tcp, false, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_with_checksums_moves_random_blocks_exactly() {
    run(TransportKind::Tcp, true, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_moves_random_blocks_exactly() {
    run(TransportKind::Shm, false, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_with_checksums_moves_random_blocks_exactly() {
    run(TransportKind::Shm, true, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adjacent_ops_are_coalesced_and_land_correctly() {
    let t = target(config("target")).await;
    let initiator = Engine::new(config("initiator")).unwrap();
    let local = random_region(&initiator, 1 << 20, 9);
    let remote = random_region(&t.engine, 1 << 20, 10);
    let ops: Vec<BlockOp> = (0..64)
        .map(|i| BlockOp {
            local_region: local.id(),
            local_offset: 1000 + i * 4096,
            remote_region: remote.id(),
            remote_offset: 77 + i * 4096,
            len: 4096,
        })
        .collect();
    let (lb, rb) = (bytes(&local), bytes(&remote));
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let peer = initiator
            .connect(
                &t.engine.descriptor(),
                t.engine.data_secret(),
                Preference::Only(kind),
                None,
            )
            .await
            .unwrap();
        let res = peer
            .submit(Batch::read(ops.clone()))
            .unwrap()
            .wait()
            .await
            .unwrap();
        assert_eq!(res.coalesced_ops, 1);
        assert_eq!(res.bytes, 64 * 4096);
    }
    let (le, _) = expected_after(Opcode::Read, &ops, &lb, &rb);
    assert!(bytes(&local) == le);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_selection_picks_shm_on_one_node_and_tcp_across_nodes() {
    let t = target(config("target")).await;
    let near = Engine::new(config("near")).unwrap();
    let peer = near
        .connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Auto,
            None,
        )
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Shm);
    assert!(peer.selection().reason.contains("same node"));

    let far = Engine::new(kvfabric_engine::EngineConfig {
        node: "another-machine".into(),
        ..config("far")
    })
    .unwrap();
    let peer = far
        .connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Auto,
            None,
        )
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Tcp);
    assert!(peer.selection().reason.contains("another node"));
}

/// Callers that carry their own small batches (`Peer::run`) and batches completed by the reader
/// thread share one connection: replies must reach the right batch whoever reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_runs_and_async_batches_share_a_connection() {
    let t = target(config("target")).await;
    let me = Engine::new(kvfabric_engine::EngineConfig {
        tcp_connections: 1,
        ..config("initiator")
    })
    .unwrap();
    let remote = random_region(&t.engine, 4 << 20, 21);
    let peer = Arc::new(
        me.connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Only(TransportKind::Tcp),
            None,
        )
        .await
        .unwrap(),
    );
    let rb = Arc::new(bytes(&remote));
    // Each worker pulls into its own local region, small batches, many times.
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let local = random_region(&me, 1 << 20, 30 + w);
            let (peer, remote_id, rb) = (peer.clone(), remote.id(), rb.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(w);
                for _ in 0..300 {
                    let len = rng.random_range(1..9000u64);
                    let lo = rng.random_range(0..(1 << 20) - len);
                    let ro = rng.random_range(0..(4 << 20) - len);
                    let ops = vec![BlockOp {
                        local_region: local.id(),
                        local_offset: lo,
                        remote_region: remote_id,
                        remote_offset: ro,
                        len,
                    }];
                    let res = peer.run(Batch::read(ops)).unwrap();
                    assert_eq!(res.bytes, len);
                    let got = bytes(&local);
                    assert!(
                        got[lo as usize..(lo + len) as usize]
                            == rb[ro as usize..(ro + len) as usize]
                    );
                }
            })
        })
        .collect();
    // Meanwhile, large batches through the reader thread.
    let local = random_region(&me, 4 << 20, 40);
    for _ in 0..20 {
        let ops = vec![BlockOp {
            local_region: local.id(),
            local_offset: 0,
            remote_region: remote.id(),
            remote_offset: 0,
            len: 4 << 20,
        }];
        peer.submit(Batch::read(ops)).unwrap().wait().await.unwrap();
    }
    for w in workers {
        w.join().unwrap();
    }
    assert!(bytes(&local) == *rb);
}

/// A peer's region that disappears from its descriptor is unmapped here (its memory can go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_drops_mappings_of_regions_the_peer_no_longer_publishes() {
    let t = target(config("target")).await;
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 1 << 20, 1);
    let a = random_region(&t.engine, 1 << 20, 2);
    let b = random_region(&t.engine, 1 << 20, 3);
    let peer = me
        .connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Only(TransportKind::Shm),
            None,
        )
        .await
        .unwrap();
    for r in [&a, &b] {
        let op = BlockOp {
            local_region: local.id(),
            local_offset: 0,
            remote_region: r.id(),
            remote_offset: 0,
            len: 4096,
        };
        peer.run(Batch::read(vec![op])).unwrap();
    }
    assert_eq!(peer.mapped_regions(), 2);
    t.engine.deregister(a.id()).await.unwrap();
    peer.set_descriptor(t.engine.descriptor());
    assert_eq!(peer.mapped_regions(), 1);
    // The region still published keeps working.
    let op = BlockOp {
        local_region: local.id(),
        local_offset: 0,
        remote_region: b.id(),
        remote_offset: 4096,
        len: 4096,
    };
    peer.run(Batch::read(vec![op])).unwrap();
}
