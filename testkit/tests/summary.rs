//! `scripts/test-summary.sh`, which counts what the skip lines of this kit report, on cargo
//! output of the shapes it meets: results of passing and failing binaries, a binary that died
//! without a result, skips interleaved with other lines.

use std::io::Write;
use std::process::{Command, Stdio};

/// Runs the script on `log` with `CI` set to `ci`: its exit success and its stdout.
fn summary(log: &str, ci: &str) -> (bool, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/test-summary.sh");
    let mut child = Command::new("bash")
        .arg(script)
        .env("CI", ci)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(log.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

const PASSING: &str = "\
running 3 tests
test a ... ignored
test b ... KVFABRIC-SKIP: b: no GPU (no CUDA driver)
ok
test c ... ok

test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.1s

running 2 tests
test d ... ok
test e ... ok

test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.1s
";

#[test]
fn counts_passed_failed_skipped_and_ignored() {
    let (ok, out) = summary(PASSING, "true");
    assert!(ok, "{out}");
    assert!(out.contains("skipped: b: no GPU (no CUDA driver)"), "{out}");
    assert!(
        out.ends_with("tests: 4 passed, 0 failed, 1 skipped, 1 ignored\n"),
        "{out}"
    );
}

#[test]
fn a_failure_or_a_crashed_binary_fails_the_run() {
    let failing = format!(
        "{PASSING}\ntest result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured\n\
         error: test failed, to rerun pass `--test f`\n\
         running 1 test\nerror: test failed, to rerun pass `--test g`\n\n\
         Caused by:\n  process didn't exit successfully: `g` (signal: 6, SIGABRT)\n"
    );
    let (ok, out) = summary(&failing, "false");
    assert!(!ok, "{out}");
    assert!(
        out.ends_with("tests: 5 passed, 3 failed, 1 skipped, 1 ignored\n"),
        "{out}"
    );
    let (ok, out) = summary("Compiling kvfabric\n", "false");
    assert!(!ok, "no result at all: {out}");
}

#[test]
fn in_ci_only_a_missing_device_may_skip() {
    let log = format!("{PASSING}KVFABRIC-SKIP: e2e::x: no etcd binary (looked on PATH)\n");
    let (ok, out) = summary(&log, "false");
    assert!(ok, "{out}");
    assert!(out.contains("2 skipped"), "{out}");
    let (ok, out) = summary(&log, "true");
    assert!(!ok, "{out}");
}
