//! Block-table batches over tcp and shm: random plane layouts (several regions, interleaved
//! planes, unaligned bases and strides, odd block sizes), both directions, many batches in
//! flight, with and without checksums; every byte of every region compared with host mirrors.
//! Bad tables are typed errors that write nothing, on the initiator and, for hand-made table
//! manifests, on the target, whose connection keeps serving.

mod common;

use std::io::{Read, Write};
use std::sync::Arc;

use common::{bytes, config, random_region, raw_connect, read_frame, remote_error, target};
use kvfabric_engine::frame::{FLAG_ERROR, FrameKind, HEADER_LEN, Header, TablePlane, encode_table};
use kvfabric_engine::{
    AccessKey, Batch, BlockOp, BlockPair, BlockTable, Engine, EngineConfig, Error, Opcode, Peer,
    Plane, PlaneSide, Preference, Region, RegionId, Side, TransportKind,
};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// One side's plane layout: (region index, base, stride) per plane, and the bytes each region
/// needs. Planes get areas of their own in a region, some in interleaved pairs (two planes
/// sharing a stride, side by side within it); bases and gaps are unaligned.
fn layout(
    rng: &mut SmallRng,
    lens: &[u64],
    ids: u64,
    regions: usize,
) -> (Vec<(usize, u64, u64)>, Vec<u64>) {
    let mut cursor = vec![0u64; regions];
    let mut planes = vec![(0, 0, 0); lens.len()];
    let mut p = 0;
    while p < lens.len() {
        let r = rng.random_range(0..regions);
        let at = cursor[r] + rng.random_range(0..100);
        let gap = rng.random_range(0..3) * rng.random_range(0..64);
        if p + 1 < lens.len() && rng.random_bool(0.3) {
            let inner = rng.random_range(0..8);
            let stride = lens[p] + inner + lens[p + 1] + gap;
            planes[p] = (r, at, stride);
            planes[p + 1] = (r, at + lens[p] + inner, stride);
            cursor[r] = at + ids * stride;
            p += 2;
        } else {
            let stride = lens[p] + gap;
            planes[p] = (r, at, stride);
            cursor[r] = at + ids * stride;
            p += 1;
        }
    }
    (planes, cursor.iter().map(|&c| c.max(1)).collect())
}

/// A random table and the regions it names on both sides.
struct Case {
    locals: Vec<Arc<Region>>,
    remotes: Vec<Arc<Region>>,
    table: BlockTable,
}

fn random_case(rng: &mut SmallRng, opcode: Opcode, initiator: &Engine, target: &Engine) -> Case {
    let planes = rng.random_range(1..=8usize);
    let lens: Vec<u64> = (0..planes)
        .map(|_| match rng.random_range(0..4) {
            0 => rng.random_range(1..64),
            1 => 4096,
            2 => rng.random_range(64..9000),
            // Some larger than the tests' 64 KiB tcp chunks: those go as op manifests.
            _ => rng.random_range(9000..80_000),
        })
        .collect();
    let ids = rng.random_range(1..=48u64);
    let (nl, nr) = (rng.random_range(1..=3), rng.random_range(1..=3));
    let (local, local_sizes) = layout(rng, &lens, ids, nl);
    let (remote, remote_sizes) = layout(rng, &lens, ids, nr);
    let locals: Vec<_> = local_sizes
        .iter()
        .map(|&n| random_region(initiator, n, rng.random()))
        .collect();
    let remotes: Vec<_> = remote_sizes
        .iter()
        .map(|&n| random_region(target, n, rng.random()))
        .collect();
    // Destination ids distinct, sources drawn freely (a block may be sent twice).
    let count = rng.random_range(1..=ids as usize);
    let mut dest: Vec<u32> = (0..ids as u32).collect();
    dest.shuffle(rng);
    let blocks: Vec<BlockPair> = dest[..count]
        .iter()
        .map(|&d| {
            let s = rng.random_range(0..ids as u32);
            match opcode {
                Opcode::Read => BlockPair {
                    local: d,
                    remote: s,
                },
                Opcode::Write => BlockPair {
                    local: s,
                    remote: d,
                },
            }
        })
        .collect();
    let side = |regions: &[Arc<Region>], (r, base, stride): (usize, u64, u64)| PlaneSide {
        region: regions[r].id(),
        base,
        stride,
    };
    let table = BlockTable {
        planes: (0..planes)
            .map(|p| Plane {
                local: side(&locals, local[p]),
                remote: side(&remotes, remote[p]),
                block_bytes: lens[p],
            })
            .collect(),
        blocks,
    };
    Case {
        locals,
        remotes,
        table,
    }
}

/// What every region must hold after the case ran: its bytes before, with each element copied.
fn expected(op: Opcode, case: &Case, before: &[Vec<u8>], after: &mut [Vec<u8>]) {
    let index =
        |id: RegionId, regions: &[Arc<Region>]| regions.iter().position(|r| r.id() == id).unwrap();
    let nl = case.locals.len();
    for p in &case.table.planes {
        let (l, r) = (
            index(p.local.region, &case.locals),
            nl + index(p.remote.region, &case.remotes),
        );
        for b in &case.table.blocks {
            let lo = (p.local.base + u64::from(b.local) * p.local.stride) as usize;
            let ro = (p.remote.base + u64::from(b.remote) * p.remote.stride) as usize;
            let n = p.block_bytes as usize;
            match op {
                Opcode::Read => after[l][lo..lo + n].copy_from_slice(&before[r][ro..ro + n]),
                Opcode::Write => after[r][ro..ro + n].copy_from_slice(&before[l][lo..lo + n]),
            }
        }
    }
}

async fn connect(initiator: &Engine, target: &Engine, kind: TransportKind) -> Arc<Peer> {
    let peer = initiator
        .connect(
            &target.descriptor(),
            target.data_secret(),
            Preference::Only(kind),
            None,
        )
        .await
        .unwrap();
    assert_eq!(peer.transport(), kind);
    Arc::new(peer)
}

async fn run(kind: TransportKind, checksum: bool, seed: u64) {
    let t = target(config("target")).await;
    let initiator = Engine::new(config("initiator")).unwrap();
    let peer = connect(&initiator, &t.engine, kind).await;
    let mut rng = SmallRng::seed_from_u64(seed);
    for round in 0..4 {
        for op in [Opcode::Write, Opcode::Read] {
            let cases: Vec<Case> = (0..6)
                .map(|_| random_case(&mut rng, op, &initiator, &t.engine))
                .collect();
            peer.set_descriptor(t.engine.descriptor());
            let before: Vec<Vec<Vec<u8>>> = cases
                .iter()
                .map(|c| {
                    c.locals
                        .iter()
                        .chain(&c.remotes)
                        .map(|r| bytes(r))
                        .collect()
                })
                .collect();
            // All in flight at once; half submitted, half run on a thread of their own.
            let mut waits = Vec::new();
            let mut threads = Vec::new();
            for (i, c) in cases.iter().enumerate() {
                let batch = Batch::table(op, c.table.clone()).with_checksum(checksum);
                if i % 2 == 0 {
                    waits.push(peer.submit(batch).unwrap());
                } else {
                    let peer = peer.clone();
                    threads.push(tokio::task::spawn_blocking(move || peer.run(batch)));
                }
            }
            let mut results = Vec::new();
            for h in waits {
                results.push(h.wait().await.unwrap());
            }
            for t in threads {
                results.push(t.await.unwrap().unwrap());
            }
            for r in &results {
                assert_eq!(r.transport, kind);
            }
            for (c, before) in cases.iter().zip(&before) {
                let mut want = before.clone();
                expected(op, c, before, &mut want);
                let now: Vec<Vec<u8>> = c
                    .locals
                    .iter()
                    .chain(&c.remotes)
                    .map(|r| bytes(r))
                    .collect();
                for (i, (w, n)) in want.iter().zip(&now).enumerate() {
                    assert!(
                        w == n,
                        "{kind} {op} round {round}: region {i} differs ({} planes, {} blocks)",
                        c.table.planes.len(),
                        c.table.blocks.len()
                    );
                }
            }
            let moved: u64 = results.iter().map(|r| r.bytes).sum();
            let want: u64 = cases.iter().map(|c| c.table.bytes().unwrap()).sum();
            assert_eq!(moved, want);
            for c in cases {
                for r in &c.locals {
                    initiator.deregister(r.id()).await.unwrap();
                }
                for r in &c.remotes {
                    t.engine.deregister(r.id()).await.unwrap();
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_moves_random_block_tables_exactly() {
    run(TransportKind::Tcp, false, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_with_checksums_moves_random_block_tables_exactly() {
    run(TransportKind::Tcp, true, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_moves_random_block_tables_exactly() {
    run(TransportKind::Shm, false, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_with_checksums_moves_random_block_tables_exactly() {
    run(TransportKind::Shm, true, 4).await;
}

/// A table and the op list it stands for move the same bytes to the same places: the table's
/// elements are its planes × blocks, numbered plane by plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_moves_what_its_op_list_moves() {
    let t = target(config("target")).await;
    let initiator = Engine::new(config("initiator")).unwrap();
    let mut rng = SmallRng::seed_from_u64(5);
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let case = random_case(&mut rng, Opcode::Read, &initiator, &t.engine);
        let peer = connect(&initiator, &t.engine, kind).await;
        let ops: Vec<BlockOp> = case
            .table
            .planes
            .iter()
            .flat_map(|p| {
                case.table.blocks.iter().map(|b| BlockOp {
                    local_region: p.local.region,
                    local_offset: p.local.base + u64::from(b.local) * p.local.stride,
                    remote_region: p.remote.region,
                    remote_offset: p.remote.base + u64::from(b.remote) * p.remote.stride,
                    len: p.block_bytes,
                })
            })
            .collect();
        let poison: Vec<Vec<u8>> = case.locals.iter().map(|r| bytes(r)).collect();
        let by_table = peer
            .submit(Batch::table(Opcode::Read, case.table.clone()))
            .unwrap()
            .wait()
            .await
            .unwrap();
        let after_table: Vec<Vec<u8>> = case.locals.iter().map(|r| bytes(r)).collect();
        for (r, p) in case.locals.iter().zip(&poison) {
            // SAFETY: no batch in flight.
            unsafe { r.as_mut_slice() }.copy_from_slice(p);
        }
        let by_ops = peer
            .submit(Batch::read(ops.clone()))
            .unwrap()
            .wait()
            .await
            .unwrap();
        let after_ops: Vec<Vec<u8>> = case.locals.iter().map(|r| bytes(r)).collect();
        assert!(after_table == after_ops, "{kind}: table and op list differ");
        assert_eq!(by_table.bytes, by_ops.bytes);
        assert_eq!(by_table.ops, ops.len());
    }
}

fn plane(local: (RegionId, u64, u64), remote: (RegionId, u64, u64), block_bytes: u64) -> Plane {
    let side = |(region, base, stride)| PlaneSide {
        region,
        base,
        stride,
    };
    Plane {
        local: side(local),
        remote: side(remote),
        block_bytes,
    }
}

fn pairs(ids: &[(u32, u32)]) -> Vec<BlockPair> {
    ids.iter()
        .map(|&(local, remote)| BlockPair { local, remote })
        .collect()
}

/// Bad tables, refused by the initiator before anything moves: each a typed error naming the
/// plane, block or field, and no byte of either side changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tables_are_typed_errors_and_write_nothing() {
    let t = target(EngineConfig {
        max_batch_ops: 64,
        ..config("target")
    })
    .await;
    let initiator = Engine::new(EngineConfig {
        max_batch_ops: 64,
        ..config("initiator")
    })
    .unwrap();
    let local = random_region(&initiator, 64 << 10, 1);
    let remote = random_region(&t.engine, 64 << 10, 2);
    let (l, r) = (local.id(), remote.id());
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let peer = connect(&initiator, &t.engine, kind).await;
        let good = BlockTable {
            planes: vec![
                plane((l, 0, 4096), (r, 0, 4096), 4096),
                plane((l, 8 << 10, 4096), (r, 8 << 10, 4096), 4096),
            ],
            blocks: pairs(&[(0, 1), (1, 0)]),
        };
        let before = (bytes(&local), bytes(&remote));
        let refuse = |table: BlockTable, op: Opcode| {
            let e = peer.submit(Batch::table(op, table)).unwrap_err();
            assert!(
                before == (bytes(&local), bytes(&remote)),
                "{kind}: {e} wrote"
            );
            e
        };
        // The last block of plane 1 ends one byte past the local region.
        let mut t1 = good.clone();
        t1.planes[1].local.base = (64 << 10) - 2 * 4096 + 1;
        let e = refuse(t1, Opcode::Read);
        assert!(
            matches!(
                e,
                Error::PlaneOutOfBounds {
                    plane: 1,
                    side: Side::Local,
                    block: 1,
                    ..
                }
            ),
            "{e}"
        );
        // … or past the remote one, as the peer's descriptor says.
        let mut t2 = good.clone();
        t2.blocks[0].remote = 15;
        let e = refuse(t2, Opcode::Read);
        assert!(
            matches!(
                e,
                Error::PlaneOutOfBounds {
                    plane: 1,
                    side: Side::Remote,
                    block: 15,
                    ..
                }
            ),
            "{e}"
        );
        let mut t3 = good.clone();
        t3.blocks.push(BlockPair {
            local: 0,
            remote: 2,
        });
        let e = refuse(t3, Opcode::Read);
        assert!(
            matches!(
                e,
                Error::DuplicateBlock {
                    first: 0,
                    second: 2,
                    side: Side::Local,
                    block: 0
                }
            ),
            "{e}"
        );
        let mut t4 = good.clone();
        t4.planes[1].remote.base = 4096;
        let e = refuse(t4, Opcode::Write);
        assert!(
            matches!(
                e,
                Error::OverlappingPlanes {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{e}"
        );
        let mut t5 = good.clone();
        t5.planes[0].local.stride = 4095;
        let e = refuse(t5, Opcode::Read);
        assert!(
            matches!(
                e,
                Error::InvalidPlane {
                    plane: 0,
                    field: "local.stride",
                    ..
                }
            ),
            "{e}"
        );
        let mut t6 = good.clone();
        t6.planes[0].remote.region = RegionId(999);
        let e = refuse(t6, Opcode::Read);
        assert!(
            matches!(
                e,
                Error::UnknownRegion {
                    region: RegionId(999),
                    side: Side::Remote
                }
            ),
            "{e}"
        );
        // 33 blocks × 2 planes pass the limit of 64 block ops.
        let mut t7 = good.clone();
        t7.blocks = (0..33)
            .map(|i| BlockPair {
                local: i,
                remote: 0,
            })
            .collect();
        t7.planes[0].local.stride = 1;
        let e = refuse(t7, Opcode::Write);
        assert!(
            matches!(
                e,
                Error::BatchTooLarge {
                    field: "blocks × planes",
                    value: 66,
                    limit: 64
                }
            ),
            "{e}"
        );
        // The good table still moves.
        peer.submit(Batch::table(Opcode::Read, good))
            .unwrap()
            .wait()
            .await
            .unwrap();
    }
}

/// Sends one hand-made table manifest (and, for a write, `payload`) and returns the reply.
fn send_table(
    s: &mut std::net::TcpStream,
    kind: FrameKind,
    tag: u64,
    planes: &[TablePlane],
    ids: &[u32],
    payload: &[u8],
) -> (Header, Vec<u8>) {
    let len = planes.iter().map(|p| p.block_bytes).sum::<u64>() * ids.len() as u64;
    let h = Header::new(kind, tag, (planes.len() * ids.len()) as u32, len);
    let mut frame = h.encode().to_vec();
    encode_table(planes, ids.iter().copied(), &mut frame);
    frame.extend_from_slice(payload);
    s.write_all(&frame).unwrap();
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let reply = Header::decode(&head).unwrap();
    let body_len = if reply.has(FLAG_ERROR) || reply.kind == FrameKind::ReadData {
        reply.len as usize
    } else {
        0
    };
    let mut body = vec![0u8; body_len];
    s.read_exact(&mut body).unwrap();
    (reply, body)
}

/// A peer that sends table manifests by hand: the target checks every plane and id before the
/// first byte lands, refuses bad ones with a typed code (draining their payload), writes
/// nothing, and serves the next chunk on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_target_checks_every_plane_and_id_of_a_table_manifest() {
    let t = target(config("target")).await;
    let region = random_region(&t.engine, 64 << 10, 3);
    let d = t.engine.descriptor();
    let mut s = tokio::task::block_in_place(|| raw_connect(&d, t.engine.data_secret()));
    let good = |base: u64| TablePlane {
        region: region.id(),
        key: region.key(),
        base,
        stride: 4096,
        block_bytes: 1000,
    };
    let before = bytes(&region);
    let cases: Vec<(Vec<TablePlane>, Vec<u32>, &str)> = vec![
        (
            vec![TablePlane {
                key: AccessKey(region.key().0 ^ 1),
                ..good(0)
            }],
            vec![0],
            "wrong_key",
        ),
        (
            vec![TablePlane {
                region: RegionId(999),
                ..good(0)
            }],
            vec![0],
            "unknown_region",
        ),
        (vec![good(0)], vec![16], "plane_out_of_bounds"),
        (vec![good(0), good(500)], vec![0, 1], "overlapping_planes"),
        (vec![good(0)], vec![3, 3], "duplicate_block"),
        (
            vec![TablePlane {
                stride: 999,
                ..good(0)
            }],
            vec![0, 1],
            "invalid_plane",
        ),
        (
            vec![TablePlane {
                stride: u64::MAX / 2,
                ..good(0)
            }],
            vec![0, 7],
            "invalid_plane",
        ),
    ];
    for (tag, (planes, ids, code)) in cases.iter().enumerate() {
        let payload = vec![0xAB; planes.len() * ids.len() * 1000];
        let (h, body) = tokio::task::block_in_place(|| {
            send_table(
                &mut s,
                FrameKind::WriteTable,
                tag as u64,
                planes,
                ids,
                &payload,
            )
        });
        assert!(h.has(FLAG_ERROR), "{code}: accepted");
        assert_eq!(h.tag, tag as u64);
        assert_eq!(remote_error(&body).code, *code);
        assert!(bytes(&region) == before, "{code}: the refused chunk wrote");
    }
    // Reads are refused too (a read may name a block twice), and the connection still works.
    let (h, body) = tokio::task::block_in_place(|| {
        send_table(&mut s, FrameKind::ReadTable, 50, &[good(0)], &[99], &[])
    });
    assert!(h.has(FLAG_ERROR));
    assert_eq!(remote_error(&body).code, "plane_out_of_bounds");
    let (h, body) = tokio::task::block_in_place(|| {
        send_table(
            &mut s,
            FrameKind::ReadTable,
            51,
            &[good(0), good(1)],
            &[2, 2],
            &[],
        )
    });
    assert_eq!(
        (h.kind, h.tag, h.count, h.len),
        (FrameKind::ReadData, 51, 4, 4000)
    );
    assert_eq!(body[..1000], before[2 * 4096..2 * 4096 + 1000]);
    assert_eq!(body[3000..], before[2 * 4096 + 1..2 * 4096 + 1001]);
    let payload: Vec<u8> = (0..2000u32).map(|i| i as u8).collect();
    let (h, _) = tokio::task::block_in_place(|| {
        send_table(
            &mut s,
            FrameKind::WriteTable,
            52,
            &[good(8)],
            &[1, 5],
            &payload,
        )
    });
    assert!(!h.has(FLAG_ERROR) && h.kind == FrameKind::Ack && h.tag == 52);
    let after = bytes(&region);
    assert_eq!(after[4096 + 8..4096 + 1008], payload[..1000]);
    assert_eq!(after[5 * 4096 + 8..5 * 4096 + 1008], payload[1000..]);
    // A table manifest of a version this target does not read closes the connection.
    let mut frame = Header::new(FrameKind::WriteTable, 53, 1, 1000)
        .encode()
        .to_vec();
    encode_table(&[good(0)], [0u32].into_iter(), &mut frame);
    frame[HEADER_LEN] = 9;
    tokio::task::block_in_place(|| {
        s.write_all(&frame).unwrap();
        let (h, body) = read_frame(&mut s);
        assert!(h.has(FLAG_ERROR));
        assert_eq!(remote_error(&body).code, "malformed_frame");
    });
}
