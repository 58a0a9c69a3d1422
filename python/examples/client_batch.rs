//! The Rust client's side of `python/benches/binding_vs_rust.py`: the same block batch through
//! `kvfabric_client`, against the agents that script starts, every byte verified.
//!
//! `client_batch <src-socket-dir> <dst-socket-dir> <blocks> <block-bytes> <concurrency>`
//! registers its memory once, then for each line `SECONDS` on stdin runs the batch that long and
//! prints one JSON line (batches, bytes, seconds), so the caller can alternate it with its own
//! rounds; at end of input it checks every destination byte and deregisters.

use std::time::{Duration, Instant};

use kvfabric_client::{BlockTable, Client, HostMemory, Plane, PlaneSide, SubmitOptions, pb};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 6 {
        return Err("usage: client_batch SRC_DIR DST_DIR BLOCKS BLOCK_BYTES CONCURRENCY".into());
    }
    let (blocks, block): (u64, u64) = (a[3].parse()?, a[4].parse()?);
    let concurrency: usize = a[5].parse()?;
    let src_agent = Client::connect(&a[1]).await?;
    let dst_agent = Client::connect(&a[2]).await?;
    let src = HostMemory::alloc(blocks * block)?;
    // SAFETY: nothing transfers yet.
    for (i, b) in unsafe { src.as_mut_slice() }.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(0x9e37_79b9).to_le_bytes()[3];
    }
    let dsts: Vec<HostMemory> = (0..concurrency)
        .map(|_| HostMemory::alloc(blocks * block))
        .collect::<Result<_, _>>()?;
    let p = src_agent.register("rust-bench-src", &[&src], None).await?;
    let mut segs = Vec::new();
    for (i, d) in dsts.iter().enumerate() {
        segs.push(
            dst_agent
                .register(&format!("rust-bench-dst-{i}"), &[d], None)
                .await?,
        );
    }
    // The batch the binding's bench sends: one plane of whole blocks, block ids reversed (the
    // agent cannot coalesce the batch into one copy), as a block table.
    let side = PlaneSide {
        region: 0,
        base: 0,
        stride: block,
    };
    let table = BlockTable {
        planes: vec![Plane {
            local: side,
            remote: side,
            block_bytes: block,
        }],
        local_blocks: (0..blocks as u32).collect(),
        remote_blocks: (0..blocks as u32).rev().collect(),
    };
    let mut lines = std::io::stdin().lines();
    while let Some(line) = lines.next().transpose()? {
        let seconds: f64 = line.trim().parse()?;
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let start = Instant::now();
        let mut tasks = Vec::new();
        for seg in segs.clone() {
            let (agent, table, key) = (dst_agent.clone(), table.clone(), p.key);
            tasks.push(tokio::spawn(async move {
                let (mut n, mut bytes) = (0u64, 0u64);
                while Instant::now() < deadline {
                    let read = pb::Opcode::Read;
                    let options = SubmitOptions::default();
                    let done = agent
                        .submit_blocks(&seg, "rust-bench-src", key, read, &table, options)
                        .await?;
                    bytes += done.bytes;
                    n += 1;
                }
                Ok::<_, kvfabric_client::Error>((n, bytes))
            }));
        }
        let (mut batches, mut bytes) = (0, 0);
        for t in tasks {
            let (n, b) = t.await??;
            batches += n;
            bytes += b;
        }
        let elapsed = start.elapsed().as_secs_f64();
        println!("{{\"batches\": {batches}, \"bytes\": {bytes}, \"seconds\": {elapsed:.6}}}");
    }
    // SAFETY: every batch completed.
    let s = unsafe { src.as_slice() };
    for d in &dsts {
        // SAFETY: as above.
        let d = unsafe { d.as_slice() };
        for i in 0..blocks as usize {
            let (l, r) = (
                i * block as usize,
                (blocks as usize - 1 - i) * block as usize,
            );
            if d[l..l + block as usize] != s[r..r + block as usize] {
                return Err(format!("block {i} differs from its source").into());
            }
        }
    }
    for seg in &segs {
        dst_agent.deregister(seg).await?;
    }
    src_agent.deregister(&p).await?;
    Ok(())
}
