//! The process allocator's tuning. A batch of 10^5 small blocks makes several buffers of many
//! MiB (the ops, their coalesced form, the transport's pieces, the device op list); glibc hands
//! such buffers out as fresh mmaps and unmaps them on free, so every batch paid its page faults
//! again: measured here 5.5 ms to fill a fresh 6 MiB Vec against 0.6 ms for memory kept, most
//! of the host's cost per 4 KiB op. Kept below 32 MiB per allocation and never trimmed, freed
//! buffers are reused by the next batch. Programs that embed the engine want the same (this
//! call, or an allocator that keeps freed pages such as jemalloc).

/// Makes glibc serve allocations up to 32 MiB (its ceiling for this setting) from its heaps and
/// keep freed memory instead of returning it to the kernel. A no-op on other C libraries.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before other threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
