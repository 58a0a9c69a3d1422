//! The target tells its observer about every chunk it served, with the initiator's trace context,
//! so an embedding agent can trace the work it does for peers.

mod common;

use std::sync::{Arc, Mutex};

use common::{config, random_region, target};
use kvfabric_engine::{
    Batch, BlockOp, Engine, EngineConfig, Opcode, Preference, ServeObserver, ServedChunk,
    TraceContext, TransportKind,
};

/// What the observer was told about one chunk: op, bytes, trace context, error.
type Chunk = (Opcode, u64, Option<TraceContext>, Option<String>);

#[derive(Debug, Default)]
struct Seen(Mutex<Vec<Chunk>>);

impl ServeObserver for Seen {
    fn served(&self, c: &ServedChunk<'_>) {
        self.0
            .lock()
            .unwrap()
            .push((c.opcode, c.bytes, c.trace, c.error.clone()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_chunks_carry_the_initiators_trace_context() {
    let seen = Arc::new(Seen::default());
    let t = target(EngineConfig {
        observer: Some(seen.clone()),
        ..config("target")
    })
    .await;
    let me = Engine::new(config("initiator")).unwrap();
    let local = random_region(&me, 1 << 20, 1);
    let remote = random_region(&t.engine, 1 << 20, 2);
    let peer = me
        .connect(
            &t.engine.descriptor(),
            t.engine.data_secret(),
            Preference::Only(TransportKind::Tcp),
            None,
        )
        .await
        .unwrap();
    let trace = TraceContext {
        trace_id: [7; 16],
        span_id: [9; 8],
        flags: 1,
    };
    let ops = |n: u64| -> Vec<BlockOp> {
        (0..n)
            .map(|i| BlockOp {
                local_region: local.id(),
                local_offset: i * 4096,
                remote_region: remote.id(),
                remote_offset: i * 8192,
                len: 4096,
            })
            .collect()
    };
    peer.submit(Batch::read(ops(64)).with_trace(trace))
        .unwrap()
        .wait()
        .await
        .unwrap();
    peer.submit(Batch::write(ops(8)))
        .unwrap()
        .wait()
        .await
        .unwrap();
    // A refused chunk is observed with its reason.
    let bad = vec![BlockOp {
        remote_offset: 0,
        ..ops(1)[0]
    }];
    let mut wrong = Batch::read(bad).with_trace(trace);
    wrong.remote_key = Some(kvfabric_engine::AccessKey(1));
    assert!(peer.submit(wrong).unwrap().wait().await.is_err());

    // The target tells its observer after it answers: the last chunks may still be on their way.
    let observed = |s: &Vec<Chunk>| {
        let bytes = |op| {
            s.iter()
                .filter(|c| c.0 == op && c.3.is_none())
                .map(|c| c.1)
                .sum::<u64>()
        };
        bytes(Opcode::Read) == 64 * 4096
            && bytes(Opcode::Write) == 8 * 4096
            && s.iter().any(|c| c.3.is_some())
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !observed(&seen.0.lock().unwrap()) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let seen = seen.0.lock().unwrap();
    let traced: Vec<_> = seen.iter().filter(|s| s.2 == Some(trace)).collect();
    assert!(
        traced
            .iter()
            .filter(|s| s.3.is_none())
            .map(|s| s.1)
            .sum::<u64>()
            == 64 * 4096,
        "{seen:?}"
    );
    assert!(traced.iter().all(|s| s.0 == Opcode::Read));
    assert!(
        seen.iter()
            .any(|s| s.0 == Opcode::Write && s.2.is_none() && s.1 == 8 * 4096)
    );
    assert!(
        seen.iter()
            .any(|s| s.3.as_deref().is_some_and(|e| e.contains("key"))),
        "{seen:?}"
    );
}
