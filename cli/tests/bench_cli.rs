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

fn names(parts: &serde_json::Value) -> Vec<String> {
    parts
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect()
}

/// Per limit, the best of its parts; a row's bound is the tightest of those (the others are
/// beside it), its ratio is against that, and a ratio above 100% is flagged.
fn assert_bound_is_best_part(r: &serde_json::Value) {
    let latency = r["ceiling_p50_us"].is_f64();
    let key = |p: &serde_json::Value| {
        if latency {
            -p["p50_us"].as_f64().unwrap()
        } else {
            p["gbps"].as_f64().unwrap()
        }
    };
    let parts = r["bound"].as_array().unwrap();
    let mut limits: Vec<&serde_json::Value> = ["path", "memory"]
        .iter()
        .filter_map(|limit| {
            parts
                .iter()
                .filter(|p| p["limit"] == *limit)
                .max_by(|a, b| key(a).total_cmp(&key(b)))
        })
        .collect();
    limits.sort_by(|a, b| key(a).total_cmp(&key(b)));
    assert_eq!(r["ceiling_name"], limits[0]["name"], "{r}");
    assert_eq!(
        names(&r["other_bounds"]),
        names(&serde_json::json!(limits[1..])),
        "{r}"
    );
    let ratio = if latency {
        r["ceiling_p50_us"].as_f64().unwrap() / r["p50_us"].as_f64().unwrap()
    } else {
        r["gbps"].as_f64().unwrap() / r["ceiling_gbps"].as_f64().unwrap()
    };
    assert!((r["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9, "{r}");
    assert_eq!(r["ceiling_bug"], ratio > 1.0, "{r}");
}

#[test]
fn small_run_verifies_both_pools_and_reports_bounds() {
    let pool: u64 = 8 << 20;
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
            "ceiling_bug",
            "bound",
            "other_bounds",
            "same_shape",
        ] {
            assert!(r.get(field).is_some(), "row lacks {field}: {r}");
        }
        // Every byte of the destination and of the source pool.
        assert_eq!(r["verified"], 2 * pool, "{r}");
        assert_eq!(r["block_size"], 16384);
        assert!(r["batches"].as_u64().unwrap() > 0);
        assert_eq!(
            r["bytes"].as_u64().unwrap(),
            r["batches"].as_u64().unwrap() * 32 * 16384
        );
        assert!(r["ceiling_gbps"].as_f64().unwrap() > 0.0);
        assert_bound_is_best_part(r);
    }
    let kinds: Vec<&str> = rows
        .iter()
        .map(|r| r["transport"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["tcp", "tcp", "shm", "shm"]);
    // tcp: raw streams on hot buffers, 1…4 of them (kvfabric's connections), each with the
    // kernel's buffers and three sizes (kvfabric's own 256 KiB among them, on loopback); the
    // kernel's two copies between pools in DRAM on 1, 2, 4… threads, up to a sender and a
    // receiver per stream or the cores; and the row's own shape with kvfabric's buffers beside.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let hot = [1, 2, 4].iter().flat_map(|n| {
        ["", " buf 64 KiB", " buf 256 KiB", " buf 1 MiB"]
            .map(|buf| format!("raw tcp ×{n} hot{buf}"))
    });
    let most = cores.min(8);
    let copies = (1..=most)
        .filter(|t| t.is_power_of_two() || *t == most)
        .map(|t| format!("2 copies ×{t} via cache"));
    let expected: Vec<String> = hot.chain(copies).collect();
    for r in &rows[..2] {
        assert_eq!(names(&r["bound"]), expected);
        assert_eq!(r["other_bounds"].as_array().unwrap().len(), 1, "{r}");
        assert_eq!(r["same_shape"]["name"], "raw tcp ×4 same shape buf 256 KiB");
    }
    // shm: memcpy on as many threads as the engine copies with.
    let threads = cores.clamp(1, 8);
    for r in &rows[2..] {
        assert_eq!(
            names(&r["bound"]),
            [
                format!("memcpy ×{threads} same shape"),
                format!("memcpy ×{threads} contiguous")
            ]
        );
    }
}

#[test]
fn one_small_read_is_bound_by_the_faster_raw_ping_pong() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "--json",
            "--transport",
            "tcp",
            "--op",
            "read",
            "--duration",
            "0.3",
            "--pool-bytes",
            "4MiB",
            "--block-size",
            "4KiB",
            "--blocks-per-batch",
            "1",
            "--concurrency",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&out.stdout);
    let r = &rows[0];
    assert_eq!(
        names(&r["bound"]),
        ["raw tcp ping-pong blocking", "raw tcp ping-pong busy-poll"]
    );
    assert!(r["ceiling_p50_us"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["p99_us"].as_f64().unwrap() >= r["p50_us"].as_f64().unwrap());
    assert_bound_is_best_part(r);
}

/// `--busy-poll-us`: the initiator polls for each reply and the target for each next request
/// before sleeping; the frames stay in step (every byte of both pools verified), both ways.
#[test]
fn busy_polling_on_both_ends_keeps_every_byte_right() {
    for op in ["read", "write"] {
        let out = Command::new(BIN)
            .args([
                "bench",
                "--json",
                "--transport",
                "tcp",
                "--op",
                op,
                "--duration",
                "0.3",
                "--pool-bytes",
                "4MiB",
                "--block-size",
                "4KiB",
                "--blocks-per-batch",
                "1",
                "--concurrency",
                "1",
                "--checksum",
                "--busy-poll-us",
                "100",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r = &rows(&out.stdout)[0];
        assert_eq!(r["verified"], 2 * (4 << 20), "{r}");
        assert!(r["batches"].as_u64().unwrap() > 0, "{r}");
    }
}

/// Runs a bench whose test hook breaks a pool after the timed phase: it must fail (exit 1) with
/// the verifier naming every block the hook changed, in the pool it changed.
fn fails_naming_the_blocks_changed(args: &[&str], hook: &str, pool: &str, bad: usize) {
    let out = Command::new(BIN)
        .args(args)
        .args(["--test-corrupt", hook])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "no rows for a failed run");
    let changed: Vec<(String, u64, String)> = err
        .lines()
        .filter_map(|l| l.strip_prefix("test hook (--test-corrupt): changed byte +"))
        .map(|l| {
            let (at, rest) = l.split_once(" of ").unwrap();
            let (block, _) = rest.split_once(" (").unwrap_or((rest, ""));
            let block = block.rsplit(' ').next().unwrap().parse().unwrap();
            (rest.to_string(), block, at.to_string())
        })
        .collect();
    assert_eq!(changed.len(), bad, "{err}");
    let failure = err
        .lines()
        .find(|l| l.contains("verification failed for"))
        .unwrap_or_else(|| panic!("no verification failure: {err}"));
    assert!(
        failure.contains(&format!("{pool}: {bad} bad: ")),
        "{failure}"
    );
    for (what, block, at) in changed {
        assert!(
            failure.contains(&format!("block {block} should hold"))
                && failure.contains(&format!("first bad byte at +{at}")),
            "{what}: {failure}"
        );
    }
}

/// Small tcp rows whose pool keeps blocks no batch wrote (the hook writes into one of those).
const SMALL_TCP: [&str; 14] = [
    "bench",
    "--transport",
    "tcp",
    "--duration",
    "0.3",
    "--pool-bytes",
    "64MiB",
    "--block-size",
    "4KiB",
    "--blocks-per-batch",
    "8",
    "--concurrency",
    "2",
    "--json",
];

#[test]
fn a_corrupted_destination_fails_naming_the_written_and_the_untouched_block() {
    // Pulls land in the local pool, pushes in the target's (changed through its control port).
    for (op, pool) in [
        ("read", "local pool (destination)"),
        ("write", "target's pool (destination)"),
    ] {
        let args = [&SMALL_TCP[..], &["--op", op]].concat();
        fails_naming_the_blocks_changed(&args, "destination", pool, 2);
    }
}

#[test]
fn a_stray_write_into_a_source_pool_fails_naming_the_block() {
    for (op, pool) in [
        ("read", "target's pool (source)"),
        ("write", "local pool (source)"),
    ] {
        let args = [&SMALL_TCP[..], &["--op", op]].concat();
        fails_naming_the_blocks_changed(&args, "source", pool, 1);
    }
}

#[test]
fn through_the_agents_counts_verified_bytes_and_reports_real_mismatches() {
    let args = [
        "bench",
        "--through-agent",
        "--json",
        "--duration",
        "0.3",
        "--pool-bytes",
        "4MiB",
        "--block-size",
        "64KiB",
        "--blocks-per-batch",
        "16",
    ];
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // 3 rounds × 2 phases × the 1 MiB destination, then the 4 MiB source.
    assert_eq!(report["verified"], 6 * (1 << 20) + (4 << 20), "{report}");
    fails_naming_the_blocks_changed(
        &args,
        "destination",
        "destination after the agents, round 1",
        1,
    );
    fails_naming_the_blocks_changed(&args, "source", "source pool", 1);
}

#[test]
fn a_pool_that_is_not_a_whole_number_of_blocks_is_refused() {
    for extra in [&[][..], &["--through-agent"][..]] {
        let out = Command::new(BIN)
            .args([
                "bench",
                "--pool-bytes",
                "1000000",
                "--block-size",
                "64KiB",
                "--blocks-per-batch",
                "4",
            ])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{err}");
        assert!(
            err.contains("pool-bytes") && err.contains("1000000") && err.contains("whole number"),
            "{err}"
        );
    }
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
        // Both 8 MiB pools, every byte: the destination against what was written to it, the
        // source against stray writes.
        assert_eq!(r["verified"], 2 * (8 << 20), "{r}");
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
            assert_eq!(rows(&out.stdout)[0]["verified"], 2 * (4 << 20));
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
