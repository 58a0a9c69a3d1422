//! A manifest header alone must not make the target allocate what it promises: buffers grow with
//! the bytes that arrive. One test in its own binary: it measures the process's resident memory.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::{config, random_region, raw_connect, target};
use kvfabric_engine::frame::{FrameKind, Header, MAX_ENTRIES};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split(' ').nth(1).unwrap().parse().unwrap();
    pages * rustix::param::page_size() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_header_alone_costs_the_target_little_memory() {
    let t = target(config("target")).await;
    random_region(&t.engine, 4096, 1);
    let d = t.engine.descriptor();
    let before = resident_bytes();
    // 64 authenticated connections, each promising a manifest of 65536 entries (2 MiB) and
    // sending none of it.
    let conns: Vec<TcpStream> = (0..64)
        .map(|_| {
            let mut s = raw_connect(&d, t.engine.data_secret());
            let h = Header::new(
                FrameKind::WriteManifest,
                1,
                MAX_ENTRIES,
                u64::from(MAX_ENTRIES),
            );
            s.write_all(&h.encode()).unwrap();
            s
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = resident_bytes().saturating_sub(before);
    // Before: 64 × 2 MiB (+128 MiB). Now at most one 64 KiB step each, and the threads.
    assert!(
        grown < 24 << 20,
        "{} MiB more resident memory for 64 empty manifests",
        grown >> 20
    );
    drop(conns);
}
