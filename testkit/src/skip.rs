//! Skipped checks, made countable: a test that cannot run what it claims calls [`skip`], which
//! writes one line `KVFABRIC-SKIP: <test>: <reason>` straight to the process's stderr (past the
//! test harness's output capture, so it shows in `cargo test`'s output even when the test
//! passes) for `scripts/test-summary.sh` to count.
//!
//! In CI (`CI=true`) only a missing device may skip: any other reason — no etcd, no openssl, no
//! root for network namespaces — panics, so the test fails instead of passing unseen.

use std::fmt::Display;
use std::io::Write;

/// Starts every skip line.
pub const MARKER: &str = "KVFABRIC-SKIP:";

/// Why a check did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why<'a> {
    /// No GPU (CUDA device) on this machine: allowed in CI.
    NoGpu,
    /// No RDMA device with an active port: allowed in CI.
    NoRdmaDevice,
    /// Something the test needs is missing (named here): a failure in CI.
    Missing(&'a str),
}

impl Why<'_> {
    /// The reason as the skip line spells it; the first two are the ones CI accepts.
    pub fn reason(&self) -> &str {
        match self {
            Why::NoGpu => "no GPU",
            Why::NoRdmaDevice => "no RDMA device",
            Why::Missing(what) => what,
        }
    }

    fn allowed_in_ci(&self) -> bool {
        !matches!(self, Why::Missing(_))
    }
}

/// Whether this run is CI's (`CI=true`, as GitHub Actions, GitLab and most others set it).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Records that the calling test skips its check for `why` (`detail` says more); the caller
/// then returns. Panics in CI unless `why` is a missing device.
#[track_caller]
pub fn skip(why: Why<'_>, detail: impl Display) {
    let test = current_test();
    let line = format!("{MARKER} {test}: {} ({detail})", why.reason());
    if in_ci() && !why.allowed_in_ci() {
        panic!("{line}: only a missing GPU or RDMA device may skip a test in CI (CI=true)");
    }
    // One write of a whole line, so parallel tests' lines do not interleave.
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// The test harness names each test's thread after the test.
fn current_test() -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" => name.to_owned(),
        _ => std::env::args()
            .next()
            .unwrap_or_else(|| "unknown test".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_missing_devices_are_allowed_in_ci() {
        assert!(Why::NoGpu.allowed_in_ci());
        assert!(Why::NoRdmaDevice.allowed_in_ci());
        assert!(!Why::Missing("etcd").allowed_in_ci());
        assert_eq!(Why::Missing("no etcd binary").reason(), "no etcd binary");
    }

    #[test]
    fn the_line_names_the_test() {
        assert!(current_test().ends_with("the_line_names_the_test"));
    }
}
