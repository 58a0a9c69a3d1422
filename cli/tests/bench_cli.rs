//! `kvfabric bench` end to end: two processes, real sockets, verification of every byte.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvfabric");

fn rows(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("every stdout line is a JSON row"))
        .collect()
}

#[test]
fn small_run_verifies_every_row_and_reports_ceilings() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--json",
            "--duration",
            "0.3",
            "--pool-bytes",
            "8MiB",
            "--block-size",
            "16KiB",
            "--blocks-per-batch",
            "32",
            "--concurrency",
            "2",
            "--checksum",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&out.stdout);
    // tcp and shm, write and read.
    assert_eq!(rows.len(), 4);
    for r in &rows {
        for field in [
            "transport",
            "op",
            "block_size",
            "blocks_per_batch",
            "batches",
            "bytes",
            "seconds",
            "gbps",
            "p50_us",
            "p99_us",
            "verified",
            "ceiling_name",
            "ceiling_gbps",
            "ratio",
        ] {
            assert!(r.get(field).is_some(), "row lacks {field}: {r}");
        }
        assert_eq!(r["verified"], true);
        assert_eq!(r["block_size"], 16384);
        assert!(r["batches"].as_u64().unwrap() > 0);
        assert_eq!(
            r["bytes"].as_u64().unwrap(),
            r["batches"].as_u64().unwrap() * 32 * 16384
        );
        assert!(r["ceiling_gbps"].as_f64().unwrap() > 0.0);
    }
    let kinds: Vec<&str> = rows
        .iter()
        .map(|r| r["transport"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["tcp", "tcp", "shm", "shm"]);
    assert_eq!(rows[0]["ceiling_name"], "raw tcp ×4");
    assert_eq!(rows[2]["ceiling_name"], "memcpy 1 thread");
}

/// `--layout planes:N` moves block tables (N planes of a pool each, id pairs shared by all)
/// over tcp and shm, verifies every byte, and says so in each row with its ops per second;
/// with the default shape it adds rows at the TP-sharded block size.
#[test]
fn block_table_rows_verify_every_byte_and_report_ops_per_second() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--json",
            "--layout",
            "planes:8",
            "--duration",
            "0.3",
            "--pool-bytes",
            "8MiB",
            "--block-size",
            "4KiB",
            "--blocks-per-batch",
            "64",
            "--concurrency",
            "3",
            "--checksum",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table_rows = rows(&out.stdout);
    assert_eq!(table_rows.len(), 4);
    for r in &table_rows {
        assert_eq!(r["layout"], "planes:8", "{r}");
        assert_eq!(r["verified"], true);
        assert_eq!(r["blocks_per_batch"], 64);
        let (batches, secs) = (
            r["batches"].as_f64().unwrap(),
            r["seconds"].as_f64().unwrap(),
        );
        assert!(batches > 0.0);
        let ops = r["ops_per_sec"].as_f64().unwrap();
        assert!((ops - batches * 64.0 / secs).abs() <= 1e-6 * ops, "{r}");
        assert_eq!(r["bytes"].as_f64().unwrap(), batches * 64.0 * 4096.0);
    }
    // The default shape: the model's 32 KiB blocks and one KV head per rank's 4 KiB, 64
    // planes (Llama-3-8B's layers × K/V), 2048 ops a batch (no latency row over shm).
    let out = Command::new(BIN)
        .args([
            "bench",
            "--json",
            "--layout",
            "planes",
            "--transport",
            "shm",
            "--op",
            "read",
            "--duration",
            "0.2",
            "--pool-bytes",
            "256MiB",
            "--concurrency",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let default_rows = rows(&out.stdout);
    let shapes: Vec<(u64, &str)> = default_rows
        .iter()
        .map(|r| {
            (
                r["block_size"].as_u64().unwrap(),
                r["layout"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(shapes, [(32768, "planes:64"), (4096, "planes:64")]);
    // A batch that is no multiple of the planes is refused, naming the flag.
    let out = Command::new(BIN)
        .args([
            "bench",
            "--layout",
            "planes:8",
            "--block-size",
            "4KiB",
            "--blocks-per-batch",
            "12",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("blocks-per-batch"));
}

#[test]
fn auto_transport_says_what_it_picked() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--json",
            "--transport",
            "auto",
            "--op",
            "read",
            "--duration",
            "0.2",
            "--pool-bytes",
            "4MiB",
            "--block-size",
            "64KiB",
            "--blocks-per-batch",
            "8",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&out.stdout);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["transport"], "auto→shm");
    assert!(rows[0]["selection"].as_str().unwrap().contains("same node"));
}

#[test]
fn bad_configuration_exits_64_naming_the_field() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--pool-bytes",
            "64KiB",
            "--block-size",
            "32KiB",
            "--blocks-per-batch",
            "8",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pool-bytes") && err.contains("65536"), "{err}");

    let out = Command::new(BIN)
        .args(["bench", "--block-size", "lots"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let out = Command::new(BIN)
        .args(["bench", "--concurrency", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    // A weak peer token from the environment stops the agent before it binds anything, and
    // the message does not echo it.
    let out = Command::new(BIN)
        .args(["agent", "--fabric", "x"])
        .env("KVFABRIC_PEER_TOKEN", "hunter2")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("peer-token") && err.contains("16"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn target_serves_initiators_in_turn_and_at_once_then_stops_on_sigterm() {
    let mut target = Command::new(BIN)
        .args(["bench", "--serve", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(target.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let addr = v["control"].as_str().unwrap().to_string();
    let initiator = |op: &str| {
        Command::new(BIN)
            .args([
                "bench",
                "--connect",
                &addr,
                "--transport",
                "tcp",
                "--op",
                op,
                "--json",
                "--duration",
                "0.3",
                "--pool-bytes",
                "4MiB",
                "--block-size",
                "32KiB",
                "--blocks-per-batch",
                "16",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // One after another, then two at once.
    for batch in [vec!["write"], vec!["read"], vec!["write", "read"]] {
        let children: Vec<_> = batch.iter().map(|op| initiator(op)).collect();
        for c in children {
            let out = c.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(rows(&out.stdout)[0]["verified"], true);
        }
    }
    let pid = rustix::process::Pid::from_raw(target.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = target.try_wait().unwrap() {
            assert!(status.success(), "target exited with {status}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "target ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn connecting_to_nothing_is_a_clear_error() {
    let out = Command::new(BIN)
        .args(["bench", "--connect", "127.0.0.1:1", "--duration", "0.1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("127.0.0.1:1"));
}

/// `kvfabric bench --transport rdma` on a machine without an RDMA device (or a build without
/// rdma): a typed error saying so, a runtime-failure exit code, and no target left behind.
#[test]
fn rdma_without_a_device_fails_with_a_clear_error() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--transport",
            "rdma",
            "--duration",
            "0.2",
            "--pool-bytes",
            "4MiB",
            "--block-size",
            "64KiB",
            "--blocks-per-batch",
            "8",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // A machine with RDMA: the run itself is the test.
        println!("this machine has an RDMA device: {stderr}");
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("kvfabric: no usable RDMA device: "),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "no rows: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
