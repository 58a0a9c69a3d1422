//! An idle engine costs nothing: with the default settings (callers poll their own batch for
//! `spin_wait` before they sleep), 1 ms after the last batch no engine thread runs. The GPU half
//! (no doorbell kernel resident either) is in tests/cuda.rs.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{config, random_region, spinning_threads, target};
use kvfabric_engine::{Batch, BlockOp, Engine, EngineConfig, Preference, TransportKind};

/// The two tests take turns: the spinner below would hold one of a 2-core machine's cores while
/// the idle engine's threads are sampled.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The sampler sees a spinning thread (so its silence below means something).
#[test]
fn the_sampler_sees_a_thread_that_spins() {
    let _turn = ONE_AT_A_TIME.blocking_lock();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let spinner = std::thread::Builder::new()
        .name("kvf-test-spin".into())
        .spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        })
        .unwrap();
    let seen = spinning_threads("kvf-test-spin", 20, Duration::from_micros(500));
    stop.store(true, Ordering::Relaxed);
    spinner.join().unwrap();
    assert_eq!(seen.len(), 1, "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_1_ms_without_batches_no_engine_thread_runs() {
    let _turn = ONE_AT_A_TIME.lock().await;
    // The engines' own settings are the defaults (spin_wait included); only chunks are small,
    // so batches spread over every tcp connection.
    let t = target(EngineConfig {
        name: "idle-target".into(),
        ..EngineConfig::default()
    })
    .await;
    let initiator = Engine::new(EngineConfig {
        name: "idle-initiator".into(),
        chunk_bytes: config("x").chunk_bytes,
        ..EngineConfig::default()
    })
    .unwrap();
    assert_eq!(initiator.config().spin_wait, Duration::from_micros(50));
    let local = random_region(&initiator, 8 << 20, 1);
    let remote = random_region(&t.engine, 8 << 20, 2);
    for kind in [TransportKind::Tcp, TransportKind::Shm] {
        let peer = Arc::new(
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
        let (l, r) = (local.id(), remote.id());
        let op = move |i: u64, len: u64| BlockOp {
            local_region: l,
            local_offset: i * len,
            remote_region: r,
            remote_offset: i * len,
            len,
        };
        // Lone small ops waited for on the caller's thread, and large batches in flight.
        for i in 0..200 {
            let p = peer.clone();
            tokio::task::spawn_blocking(move || p.run(Batch::read(vec![op(i, 4096)])))
                .await
                .unwrap()
                .unwrap();
        }
        let big: Vec<_> = (0..4)
            .map(|i| peer.submit(Batch::write(vec![op(i, 2 << 20)])).unwrap())
            .collect();
        for h in big {
            h.wait().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        let spinning = tokio::task::spawn_blocking(|| {
            spinning_threads("kvf-", 20, Duration::from_micros(500))
        })
        .await
        .unwrap();
        assert!(
            spinning.is_empty(),
            "{kind}: threads still running: {spinning:?}"
        );
    }
}
