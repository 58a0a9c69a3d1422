//! RDMA through a real device: two RC QPs of one NIC connected to each other (loopback), a
//! batch planned into slices, posted in credit-limited chains with selective signalling, WRITE
//! then READ, and the bytes compared. Where libibverbs lists no device (no RDMA NIC, no
//! soft-RoCE) the test prints "skipped: no RDMA device" and passes.
#![cfg(feature = "rdma")]

mod common;

use std::path::Path;

use kvfabric_engine::rdma::handshake::{QpParams, negotiate};
use kvfabric_engine::rdma::plan::{PlanConfig, lanes, plan};
use kvfabric_engine::rdma::select::{DeviceFilter, GidChoice, usable_ports};
use kvfabric_engine::rdma::verbs::{
    self, Context, Cq, MemoryRegion, Qp, RemoteMemory, WorkRequest,
};
use kvfabric_engine::rdma::{SendQueue, WcStatus, sysfs};
use kvfabric_engine::{BlockOp, Coalesced, Engine, Opcode, Region};

/// The first active port libibverbs can open, with the GID it would use; None (after saying
/// so) when there is none.
fn device(test: &str) -> Option<(String, u8, u32, sysfs::Gid)> {
    let names = verbs::device_names();
    if names.is_empty() {
        println!("{test}: skipped: no RDMA device");
        return None;
    }
    let nics = sysfs::nics(Path::new("/")).unwrap();
    let usable = usable_ports(&nics, &DeviceFilter::default(), None, GidChoice::Auto);
    match usable.ports.into_iter().find(|p| names.contains(&p.nic)) {
        Some(p) => Some((p.nic, p.port as u8, p.gid.index, p.gid.gid)),
        None => {
            println!(
                "{test}: skipped: no RDMA device with an active port ({:?})",
                usable.skipped
            );
            None
        }
    }
}

fn fill(region: &Region, seed: u8) {
    // SAFETY: a fresh host region no transfer is using.
    let bytes = unsafe { region.as_mut_slice() };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// Moves `len` bytes from `local` to `remote` (Write) or back (Read) over `qp`, the way the
/// transport will: plan, credits, chains, completions.
fn run(
    qp: &mut Qp,
    cq: &Cq,
    opcode: Opcode,
    local: &MemoryRegion,
    remote: &MemoryRegion,
    len: u64,
) {
    let ops = [Coalesced {
        op: BlockOp {
            local_region: local.region().id(),
            local_offset: 0,
            remote_region: remote.region().id(),
            remote_offset: 0,
            len,
        },
        first_index: 0,
    }];
    let cfg = PlanConfig {
        slice_bytes: 64 << 10,
        signal_every: 4,
        max_wrs_per_post: 8,
    };
    let depth = qp.params().sq_depth.min(16);
    cfg.validate(depth).unwrap();
    let p = plan(&ops, &lanes(1, 1), &cfg).unwrap();
    let lp = &p.lanes[0];
    let mut credits = SendQueue::new(qp.name(), depth);
    let far = RemoteMemory {
        region: remote.region().id(),
        addr: remote.addr(),
        rkey: remote.rkey(),
        len: remote.len(),
    };
    let mut next = 0;
    let mut completions = Vec::new();
    let mut polls = 0u64;
    while next < lp.wrs.len() || credits.outstanding() > 0 {
        let r = lp.next_chain(next, credits.available(), cfg.max_wrs_per_post);
        if !r.is_empty() {
            let chain: Vec<WorkRequest> = r
                .clone()
                .map(|i| {
                    let w = &lp.wrs[i];
                    WorkRequest {
                        wr_id: i as u64,
                        opcode,
                        local,
                        local_offset: w.slice.local_offset,
                        remote: far,
                        remote_offset: w.slice.remote_offset,
                        len: w.slice.len as u32,
                        signaled: w.signaled,
                    }
                })
                .collect();
            let ids: Vec<(u64, bool)> = chain.iter().map(|w| (w.wr_id, w.signaled)).collect();
            credits.post(&ids).unwrap();
            qp.post(&chain).unwrap();
            next = r.end;
        }
        completions.clear();
        cq.poll(&mut completions, 32).unwrap();
        for c in &completions {
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            credits.complete(c.wr_id).unwrap();
        }
        polls += 1;
        assert!(polls < 50_000_000, "completions never came");
    }
}

#[test]
fn loopback_write_then_read_moves_every_byte() {
    let Some((name, port, gid_index, gid)) = device("loopback_write_then_read_moves_every_byte")
    else {
        return;
    };
    let engine = Engine::new(common::config("rdma-loopback")).unwrap();
    let len: u64 = 1 << 20;
    let src = engine.alloc(len).unwrap();
    let dst = engine.alloc(len).unwrap();
    let back = engine.alloc(len).unwrap();
    fill(&src, 7);

    let ctx = Context::open(&name).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let params = QpParams {
        sq_depth: 64,
        ..QpParams::default()
    };
    let mut a = Qp::create(&pd, &cq, port, &params).unwrap();
    let mut b = Qp::create(&pd, &cq, port, &params).unwrap();
    let (ia, ib) = (a.info(gid).unwrap(), b.info(gid).unwrap());
    a.connect(&negotiate("self", &ia, &ib).unwrap(), gid_index)
        .unwrap();
    b.connect(&negotiate("self", &ib, &ia).unwrap(), gid_index)
        .unwrap();

    let mr_src = pd.register(src.clone()).unwrap();
    let mr_dst = pd.register(dst.clone()).unwrap();
    let mr_back = pd.register(back.clone()).unwrap();
    assert_eq!(mr_src.key().nic, name);

    run(&mut a, &cq, Opcode::Write, &mr_src, &mr_dst, len);
    // SAFETY: every WR has completed; nothing touches the regions meanwhile.
    unsafe {
        assert!(src.as_slice() == dst.as_slice(), "WRITE: bytes differ");
    }
    run(&mut a, &cq, Opcode::Read, &mr_back, &mr_dst, len);
    // SAFETY: as above.
    unsafe {
        assert!(back.as_slice() == src.as_slice(), "READ: bytes differ");
    }
}

#[test]
fn opening_a_missing_device_is_a_typed_error() {
    let err = Context::open("no-such-rdma-device").unwrap_err();
    assert_eq!(err.code(), "no_rdma_device", "{err}");
    assert!(err.to_string().contains("no-such-rdma-device"), "{err}");
}
