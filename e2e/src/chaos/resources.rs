//! An agent process's open fds, threads and resident memory, from /proc.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    pub fds: u64,
    pub threads: u64,
    pub rss_kib: u64,
}

impl Resources {
    /// What process `pid` holds now; None when it is gone.
    pub fn of(pid: u32) -> Option<Resources> {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        };
        Some(Resources {
            fds,
            threads: field("Threads:")?,
            rss_kib: field("VmRSS:")?,
        })
    }

    /// Whether `self` (after the run) is back within reach of `base` (before the first
    /// fault): a few fds and threads for connections being re-dialled, and RSS that did not
    /// grow with the run (allocator slack allowed).
    pub fn back_to(&self, base: &Resources) -> bool {
        self.fds <= base.fds + 8
            && self.threads <= base.threads + 4
            && self.rss_kib <= base.rss_kib * 3 / 2 + 32 * 1024
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} fds, {} threads, {:.1} MiB",
            self.fds,
            self.threads,
            self.rss_kib as f64 / 1024.0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_fds_threads_and_memory() {
        let r = Resources::of(std::process::id()).unwrap();
        assert!(r.fds >= 3 && r.threads >= 1 && r.rss_kib > 0, "{r}");
        assert!(r.back_to(&r));
        let leaked = Resources {
            fds: r.fds + 9,
            ..r
        };
        assert!(!leaked.back_to(&r));
    }
}
