//! The process allocator's tuning. A batch of 10^5 small blocks makes several buffers of many
//! MiB (the ops, their coalesced form, the transport's pieces, the device op list); glibc hands
//! such buffers out as fresh mmaps and unmaps them on free, so every batch paid its page faults
//! again: measured here 5.5 ms to fill a fresh 6 MiB Vec against 0.6 ms for memory kept, most
//! of the host's cost per 4 KiB op. Kept below 32 MiB per allocation and not trimmed on free,
//! freed buffers are reused by the next batch.
//!
//! Kept, but bounded: after a peak (many connections' buffers, one huge batch) the freed memory
//! would otherwise stay resident for good. A trimmer thread looks once a second at how much
//! resident anonymous memory is not in use by the heap, and past `RETAINED_MAX` hands the free
//! pages back (`malloc_trim`). The small-block cache (tens of MiB) stays under it and is never
//! touched. Programs that embed the engine want the same (this call, or an allocator that keeps
//! a bounded cache of freed pages such as jemalloc).

use std::time::Duration;

/// Free resident memory the heaps may keep for reuse before it is handed back.
pub const RETAINED_MAX: u64 = 256 << 20;

/// A heap whose free top grows past this gives it back on the spot (glibc trims each arena's
/// top at free; its per-thread heaps are at most 64 MiB, so a larger threshold never fires there).
/// A batch of 10^5 4 KiB ops frees ~20 MiB of buffers: kept.
const TRIM_THRESHOLD: i32 = 32 << 20;

/// How often the trimmer looks.
const EVERY: Duration = Duration::from_secs(1);

/// Makes glibc serve allocations up to 32 MiB (its ceiling for this setting) from its heaps and
/// keep freed memory instead of returning it to the kernel at once, and starts the trimmer that
/// bounds what is kept. A no-op on other C libraries.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static STARTED: std::sync::Once = std::sync::Once::new();
        STARTED.call_once(|| {
            // SAFETY: mallopt only changes allocator parameters; called before other threads
            // start.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
            }
            let spawned = std::thread::Builder::new()
                .name("kvf-trim".into())
                .spawn(|| {
                    // What trimming could not give back (arena tops under the threshold) is
                    // the floor: only growth past it by RETAINED_MAX trims again, so a heap
                    // that stays large in steady state is not trimmed every second.
                    let mut floor = 0;
                    loop {
                        std::thread::sleep(EVERY);
                        if let Some(left) = trim_if_over(floor + RETAINED_MAX) {
                            floor = left;
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no allocator trimmer: freed memory is kept");
            }
        });
    }
}

/// Resident anonymous memory the heaps hold but do not use (an estimate from above: thread
/// stacks and other anonymous mappings count as free here).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn free_resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let info = unsafe { libc::mallinfo2() };
    let in_use = (info.uordblks + info.hblkhd) as u64;
    Some((kib << 10).saturating_sub(in_use))
}

/// Hands free pages back (those in every arena's free lists, and the main heap's top) when more
/// than `limit` bytes of them are resident; what is left resident then, if it trimmed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_if_over(limit: u64) -> Option<u64> {
    if free_resident().is_none_or(|free| free <= limit) {
        return None;
    }
    // SAFETY: malloc_trim releases free memory only; no live allocation is touched.
    unsafe { libc::malloc_trim(0) };
    free_resident()
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use std::io::BufRead;

    fn resident_anon() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .unwrap()
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .unwrap();
        kib << 10
    }

    /// The child: a peak of 512 MiB in 2 MiB buffers on 16 threads (as 256 connections' manifest
    /// buffers once were), freed in an order that leaves holes, then what stays resident a few
    /// trimmer rounds later.
    #[test]
    #[ignore = "the child half of memory_goes_back_after_a_peak: run by it in a process of its own"]
    fn peak_child() {
        assert!(
            std::env::var_os("KVF_PEAK_CHILD").is_some(),
            "run by its parent test only"
        );
        keep_freed_memory();
        let before = resident_anon();
        let (held, freed) = (
            std::sync::Arc::new(std::sync::Barrier::new(17)),
            std::sync::Arc::new(std::sync::Barrier::new(17)),
        );
        let workers: Vec<_> = (0..16)
            .map(|t| {
                let (held, freed) = (held.clone(), freed.clone());
                std::thread::spawn(move || {
                    let mut bufs: Vec<Option<Vec<u8>>> = (0..16)
                        .map(|i| Some(vec![(t + i) as u8 | 1; 2 << 20]))
                        .collect();
                    held.wait();
                    // Every other buffer first (holes), a small one kept between, then the rest.
                    let keep: Vec<u8> = vec![1; 4096];
                    for i in (0..16).step_by(2).chain((1..16).step_by(2)) {
                        bufs[i] = None;
                    }
                    freed.wait();
                    keep[0]
                })
            })
            .collect();
        held.wait();
        let peak = resident_anon();
        freed.wait();
        for w in workers {
            w.join().unwrap();
        }
        std::thread::sleep(EVERY * 3);
        println!(
            "KVF peak {} after {}",
            peak.saturating_sub(before),
            resident_anon().saturating_sub(before)
        );
    }

    #[test]
    fn memory_goes_back_after_a_peak() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "allocator::tests::peak_child",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("KVF_PEAK_CHILD", "1")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = out
            .stdout
            .lines()
            .map(|l| l.unwrap())
            .find_map(|l| l.split_once("KVF peak ").map(|(_, r)| r.to_string()))
            .expect("the child reports");
        let (peak, after) = line.split_once(" after ").unwrap();
        let (peak, after): (u64, u64) = (peak.parse().unwrap(), after.trim().parse().unwrap());
        // The peak was real, and what stays is within the bound (never-trim kept all of it).
        assert!(peak > 400 << 20, "peak only {} MiB", peak >> 20);
        assert!(
            after < RETAINED_MAX,
            "{} MiB still resident after a {} MiB peak",
            after >> 20,
            peak >> 20
        );
    }

    #[test]
    fn a_heap_under_the_bound_is_left_alone() {
        // This process holds far less than the bound free: nothing is trimmed.
        assert_eq!(trim_if_over(u64::MAX), None);
        assert!(free_resident().is_some());
    }
}
