//! The skip rule as a test run sees it: the marker line reaches cargo's output although the
//! harness captures the test's own output, and with `CI=true` a skip for anything but a
//! missing device fails the test. An etcd binary that is missing skips; one that is there and
//! does not start fails.

use std::process::Command;

use kvfabric_testkit::EtcdServer;
use kvfabric_testkit::etcd::ETCD_BIN_ENV;
use kvfabric_testkit::skip::{MARKER, Why, skip};

/// Set in the child runs: which skip to take.
const CHILD: &str = "KVFABRIC_SKIP_TEST_CHILD";

/// Runs `test` again in a child process, as the skipping test `which`.
fn child(test: &str, which: &str, env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test])
        .env(CHILD, which)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_skip_is_counted_and_only_a_missing_device_may_skip_in_ci() {
    match std::env::var(CHILD).as_deref() {
        Ok("tool") => return skip(Why::Missing("no frobnicator binary"), "looked on PATH"),
        Ok("gpu") => return skip(Why::NoGpu, "no CUDA driver"),
        Ok("rdma") => return skip(Why::NoRdmaDevice, "no active port"),
        _ => {}
    }
    let test = "a_skip_is_counted_and_only_a_missing_device_may_skip_in_ci";
    for (which, ci, passes, reason) in [
        (
            "tool",
            "false",
            true,
            "no frobnicator binary (looked on PATH)",
        ),
        (
            "tool",
            "true",
            false,
            "no frobnicator binary (looked on PATH)",
        ),
        ("gpu", "true", true, "no GPU (no CUDA driver)"),
        ("rdma", "true", true, "no RDMA device (no active port)"),
    ] {
        let (ok, text) = child(test, which, &[("CI", ci)]);
        assert_eq!(ok, passes, "{which} with CI={ci}:\n{text}");
        let line = format!("{MARKER} {test}: {reason}");
        if passes {
            // The harness captured nothing of a passing test, yet the line is there.
            assert!(
                text.lines().any(|l| l == line),
                "{which}: no {line:?} in:\n{text}"
            );
        } else {
            assert!(text.contains("only a missing GPU or RDMA device"), "{text}");
        }
    }
}

#[tokio::test]
async fn only_a_missing_etcd_binary_skips() {
    let test = "only_a_missing_etcd_binary_skips";
    if std::env::var(CHILD).is_ok() {
        let _ = EtcdServer::or_skip(EtcdServer::start().await);
        return;
    }
    let (ok, text) = child(
        test,
        "etcd",
        &[(ETCD_BIN_ENV, "/nonexistent/etcd"), ("CI", "false")],
    );
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("{MARKER} {test}: no etcd binary")),
        "{text}"
    );
    // A binary that is there but exits at once: the test fails, it does not skip.
    let (ok, text) = child(
        test,
        "etcd",
        &[(ETCD_BIN_ENV, "/bin/false"), ("CI", "false")],
    );
    assert!(!ok, "{text}");
    assert!(text.contains("etcd did not start"), "{text}");
    assert!(!text.contains(MARKER), "{text}");
}
