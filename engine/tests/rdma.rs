//! RDMA through a real device.
//!
//! - Two engines of this process over the loopback of one NIC, through the whole transport:
//!   rkeys published in the descriptor, the connection exchanged (offer, accept, answer),
//!   batches striped over the QPs, pulled and pushed, every byte compared; a region
//!   deregistered while connected; `Preference::Auto` choosing rdma.
//! - Two RC QPs of one NIC driven by hand: a plan, credit-limited chains, selective
//!   signalling, WRITE then READ.
//! - Without a device, every entry point answers a typed error.
//!
//! Where libibverbs lists no device (no RDMA NIC, no soft-RoCE) the hardware tests print
//! "skipped: no RDMA device" and pass.
#![cfg(feature = "rdma")]

mod common;

use std::path::Path;
use std::sync::Arc;

use kvfabric_engine::rdma::handshake::{QpParams, negotiate};
use kvfabric_engine::rdma::plan::{PlanConfig, lanes, plan};
use kvfabric_engine::rdma::select::{DeviceFilter, GidChoice, usable_ports};
use kvfabric_engine::rdma::verbs::{
    self, Context, Cq, MemoryRegion, Qp, RemoteMemory, WorkRequest,
};
use kvfabric_engine::rdma::{SendQueue, WcStatus, sysfs};
use kvfabric_engine::{
    Batch, BlockOp, Coalesced, ConnectInfo, Engine, Opcode, Preference, RdmaExchange, Region,
    TransportKind,
};

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

/// The exchange of two engines in one process: the offer goes straight to the target engine.
#[derive(Debug)]
struct Direct {
    target: Engine,
    me: String,
}

impl RdmaExchange for Direct {
    fn exchange(&self, offer: &ConnectInfo) -> kvfabric_engine::Result<ConnectInfo> {
        self.target.rdma_accept(&self.me, offer)
    }
}

fn exchange(target: &Engine, me: &str) -> Option<Arc<dyn RdmaExchange>> {
    Some(Arc::new(Direct {
        target: target.clone(),
        me: me.into(),
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_pull_and_push_through_the_rdma_transport() {
    let test = "two_engines_pull_and_push_through_the_rdma_transport";
    let a = Engine::new(common::config("rdma-a")).unwrap();
    let b = Engine::new(common::config("rdma-b")).unwrap();
    let nics = match a.rdma_devices() {
        Ok(n) => n,
        Err(e) => {
            println!("{test}: skipped: no RDMA device ({e})");
            return;
        }
    };
    println!("{test}: using {nics:?}");
    let block: u64 = 64 << 10;
    let blocks: u64 = 64;
    let src = common::random_region(&b, blocks * block, 11);
    let dst = common::random_region(&a, blocks * block, 12);
    let d = b.descriptor();
    let keys = &d.region(src.id()).unwrap().rdma;
    assert_eq!(keys.len(), nics.len(), "one rkey per NIC: {keys:?}");

    let peer = a
        .connect_with(
            &d,
            b.data_secret(),
            Preference::Only(TransportKind::Rdma),
            None,
            exchange(&b, "rdma-a"),
        )
        .await
        .unwrap();
    assert_eq!(peer.transport(), TransportKind::Rdma);
    assert!(peer.stats().connections >= 1);

    // Pull every other block, scattered: many WRs over every QP.
    let ops: Vec<BlockOp> = (0..blocks / 2)
        .map(|i| BlockOp {
            local_region: dst.id(),
            local_offset: i * 2 * block,
            remote_region: src.id(),
            remote_offset: (blocks - 1 - i) * block,
            len: block,
        })
        .collect();
    let done = peer
        .submit(Batch::read(ops.clone()))
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert_eq!(done.transport, TransportKind::Rdma);
    assert_eq!(done.bytes, blocks / 2 * block);
    let (s, t) = (common::bytes(&src), common::bytes(&dst));
    for o in &ops {
        let (l, r, n) = (
            o.local_offset as usize,
            o.remote_offset as usize,
            o.len as usize,
        );
        assert!(t[l..l + n] == s[r..r + n], "READ: block at {l} differs");
    }

    // Push one large op back (sliced and striped), then compare.
    let push = vec![BlockOp {
        local_region: dst.id(),
        local_offset: 0,
        remote_region: src.id(),
        remote_offset: 0,
        len: blocks * block,
    }];
    peer.submit(Batch::write(push))
        .unwrap()
        .wait()
        .await
        .unwrap();
    assert!(
        common::bytes(&src) == common::bytes(&dst),
        "WRITE: bytes differ"
    );
    assert!(peer.stats().bytes >= 3 * blocks / 2 * block);

    // Auto picks rdma for a peer without shm or cuda-ipc, and says why.
    let auto = a
        .connect_with(
            &d,
            b.data_secret(),
            Preference::Auto,
            None,
            exchange(&b, "rdma-a"),
        )
        .await
        .unwrap();
    assert_eq!(
        auto.transport(),
        TransportKind::Rdma,
        "{}",
        auto.selection().reason
    );

    // A region deregistered on the target: its memory goes, a stale rkey is refused.
    drop(auto);
    b.deregister(src.id()).await.unwrap();
    drop(src);
    let err = peer
        .submit(Batch::read(ops))
        .unwrap()
        .wait()
        .await
        .unwrap_err();
    println!("{test}: after deregistration: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_device_every_entry_point_is_a_typed_error() {
    let a = Engine::new(common::config("no-rdma-a")).unwrap();
    if a.rdma_devices().is_ok() {
        println!(
            "without_a_device_every_entry_point_is_a_typed_error: skipped: this machine has an RDMA device"
        );
        return;
    }
    let b = Engine::new(common::config("no-rdma-b")).unwrap();
    let err = a.rdma_devices().unwrap_err();
    assert_eq!(err.code(), "no_rdma_device", "{err}");
    println!("{err}");
    let offer = ConnectInfo::new(vec![]);
    let err = b.rdma_accept("no-rdma-a", &offer).unwrap_err();
    assert_eq!(err.code(), "no_rdma_device", "{err}");
    assert!(!b.rdma_release("no-rdma-a", 1));
    // No rkeys are published without a device.
    let src = common::random_region(&b, 4096, 1);
    let d = b.descriptor();
    assert!(d.region(src.id()).unwrap().rdma.is_empty());
    let err = a
        .connect_with(
            &d,
            b.data_secret(),
            Preference::Only(TransportKind::Rdma),
            None,
            exchange(&b, "no-rdma-a"),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), "transport_unavailable", "{err}");
    assert!(err.to_string().contains("no usable RDMA device"), "{err}");
    // Without an exchange, rdma is refused for that reason first.
    let err = a
        .connect(
            &d,
            b.data_secret(),
            Preference::Only(TransportKind::Rdma),
            None,
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("RdmaExchange"), "{err}");
}
