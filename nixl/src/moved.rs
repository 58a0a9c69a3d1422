//! Pages this process moved into memfds for NIXL's registrations. A fact of the process, not of
//! one backend: two NIXL agents share a process, neighbouring buffers share pages, and malloc
//! hands pages a registration moved (and freed) to the next allocation. So a range registered
//! is pieces: pages an earlier move put in a memfd (still mapped there) keep that memfd, the
//! rest move into new ones.

use std::sync::{Arc, Mutex};

use kvfabric_client::HostMemory;
use kvfabric_engine::{Mapping, mappings_over, page_range};

use crate::status::{Error, Result};

/// Most pieces one registration may take (each is a region of its segment).
pub const MAX_PIECES: usize = 16;

#[derive(Debug)]
pub(crate) struct Moved {
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// The memfd's inode, as /proc/self/maps names it.
    inode: u64,
    memory: Arc<HostMemory>,
}

impl Moved {
    /// Whether `m` is this memfd where it was mapped.
    pub(crate) fn maps(&self, m: &Mapping) -> bool {
        m.lo >= self.start && m.hi <= self.end && m.shares(self.inode, (m.lo - self.start) as u64)
    }
}

/// `len` bytes of a registered range, at `offset` of `memory`.
#[derive(Debug, Clone)]
pub struct Piece {
    pub len: u64,
    pub offset: u64,
    pub memory: Arc<HostMemory>,
}

pub(crate) static MOVED: Mutex<Vec<Moved>> = Mutex::new(Vec::new());

fn invalid(reason: String) -> Error {
    Error::Invalid {
        field: "registered descriptor",
        reason,
    }
}

/// glibc's thread-arena heaps: reservations of this size, at addresses aligned to it.
const ARENA_HEAP: usize = 64 << 20;

/// Whether `at` lies where malloc keeps many small objects: the brk heap, or a thread arena's
/// heap (the committed start of a 64 MiB-aligned reservation whose rest is inaccessible).
/// Moving such pages would share the neighbours' bytes with forked children (whose other fork
/// handlers may run before `crate::fork`'s and write them); an allocation of its own pages holds
/// only its bytes and malloc's chunk header.
fn malloc_heap(p: &Mapping, at: usize) -> bool {
    let arena = || {
        mappings_over(p.hi, p.hi + 1).is_ok_and(|next| {
            next.first().is_some_and(|n| {
                n.lo == p.hi
                    && n.perms.starts_with("---")
                    && n.inode == 0
                    && n.hi % ARENA_HEAP == 0
                    && n.hi - ARENA_HEAP <= at
            })
        })
    };
    p.path == "[heap]" || arena()
}

/// The memfds holding `[addr, addr + len)`, in order.
///
/// # Safety
/// As `HostMemory::share_in_place`.
pub unsafe fn pieces_for(addr: u64, len: u64) -> Result<Vec<Piece>> {
    let first = usize::try_from(addr).map_err(|_| invalid(format!("{addr:#x} is no address")))?;
    let (start, end) = page_range(first, len).map_err(invalid)?;
    let maps = mappings_over(start, end).map_err(invalid)?;
    crate::fork::guard();
    let mut table = MOVED.lock().unwrap_or_else(|e| e.into_inner());
    // Entries whose pages here are no longer theirs, and that no registration holds, go.
    table.retain(|m| {
        Arc::strong_count(&m.memory) > 1
            || !(m.start < end && start < m.end)
            || maps.iter().any(|p| m.maps(p))
    });
    // Runs of pages, [lo, hi) each: Some(entry) already moved, None to move now.
    let mut runs: Vec<(usize, usize, Option<usize>)> = Vec::new();
    for p in &maps {
        let (lo, hi) = (p.lo.max(start), p.hi.min(end));
        let owner = table.iter().position(|m| m.maps(p));
        if owner.is_none() && !(p.private_anonymous() && p.perms.starts_with("rw")) {
            return Err(invalid(format!(
                "{:#x}..{:#x} is {} {:?}: only private anonymous memory (malloc, torch's CPU \
                 tensors) is registered; shared or file-backed memory is not",
                p.lo, p.hi, p.perms, p.path
            )));
        }
        if owner.is_none() && malloc_heap(p, lo) {
            return Err(invalid(format!(
                "{first:#x}+{len} lies in malloc's heap ({:#x}..{:#x}), among other objects that \
                 would become memory shared with every forked child: register memory of its \
                 own pages (mmap, or an allocation above malloc's mmap threshold, as KV caches \
                 are)",
                p.lo, p.hi
            )));
        }
        match runs.last_mut() {
            Some(last) if last.1 == lo && last.2.is_none() && owner.is_none() => last.1 = hi,
            _ => runs.push((lo, hi, owner)),
        }
    }
    let mut pieces = Vec::new();
    for (lo, hi, owner) in runs {
        let entry = match owner {
            Some(i) => i,
            None => {
                // SAFETY: forwarded to the caller; the run is private anonymous pages.
                let (memory, _) =
                    unsafe { HostMemory::share_in_place(lo, (hi - lo) as u64, &|_| false) }
                        .map_err(Error::Agent)?;
                let inode = memory
                    .memfd()
                    .and_then(|fd| rustix::fs::fstat(fd).ok())
                    .map(|st| st.st_ino)
                    .ok_or_else(|| invalid("the moved pages' memfd has no inode".into()))?;
                table.push(Moved {
                    start: lo,
                    end: hi,
                    inode,
                    memory: Arc::new(memory),
                });
                table.len() - 1
            }
        };
        let m = &table[entry];
        // The part of the registered range in [lo, hi).
        let (from, to) = (lo.max(first), hi.min(first + (len as usize)));
        pieces.push(Piece {
            len: (to - from) as u64,
            offset: (from - m.start) as u64,
            memory: m.memory.clone(),
        });
    }
    if pieces.len() > MAX_PIECES {
        return Err(invalid(format!(
            "{addr:#x}+{len} lies over {} pieces of memory registered before (at most \
             {MAX_PIECES}); register it before its neighbours",
            pieces.len()
        )));
    }
    Ok(pieces)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `len` bytes of pages of their own (what malloc gives large allocations), never freed.
    pub(crate) fn own_pages(len: usize) -> &'static mut [u8] {
        // SAFETY: a fresh private anonymous mapping, leaked for the test's life.
        unsafe {
            let p = rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
            .unwrap();
            std::slice::from_raw_parts_mut(p.cast::<u8>(), len)
        }
    }

    #[test]
    fn heap_memory_is_refused() {
        let v = vec![1u8; 3000];
        // SAFETY: refused before any page moves.
        let e = unsafe { pieces_for(v.as_ptr() as u64, 3000) }.unwrap_err();
        assert!(e.to_string().contains("malloc's heap"), "{e}");
    }

    #[test]
    fn neighbours_share_the_pages_they_share_and_move_the_rest() {
        let page = rustix::param::page_size();
        let v = own_pages(8 * page);
        for (i, b) in v.iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        let before = v.to_vec();
        let base = (v.as_ptr() as usize).next_multiple_of(page);
        let b = base as u64;
        // SAFETY: nothing else touches `v`, which outlives the moved memory.
        let a = unsafe { pieces_for(b + 10, 2 * page as u64) }.unwrap();
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].offset, 10);
        // Its neighbour starts on a's last page: that page stays a's memfd, the rest moves.
        // SAFETY: as above.
        let n = unsafe { pieces_for(b + 2 * page as u64 + 100, 2 * page as u64) }.unwrap();
        assert_eq!(n.len(), 2, "{n:?}");
        assert!(Arc::ptr_eq(&n[0].memory, &a[0].memory));
        assert_eq!(
            (n[0].offset, n[0].len),
            (2 * page as u64 + 100, page as u64 - 100)
        );
        assert_eq!(n[1].offset, 0);
        assert_eq!(n[0].len + n[1].len, 2 * page as u64);
        assert_eq!(*v, *before, "bytes changed when their pages moved");
        // Every piece is the process's memory: a write here is seen in the memfd.
        let lead = base - v.as_ptr() as usize;
        v[2 * page + 200 + lead] = 0xab;
        // SAFETY: nothing transfers into it.
        let seen = unsafe { n[0].memory.as_slice() }[(n[0].offset + 100) as usize];
        assert_eq!(seen, 0xab);
        // Registered again: the same pieces, nothing moves.
        // SAFETY: as above.
        let again = unsafe { pieces_for(b + 2 * page as u64 + 100, 2 * page as u64) }.unwrap();
        assert!(Arc::ptr_eq(&again[1].memory, &n[1].memory));
    }

    #[test]
    fn file_backed_memory_is_refused() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(8192).unwrap();
        // SAFETY: a fresh shared mapping of our own file.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                8192,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &f,
                0,
            )
        }
        .unwrap();
        // SAFETY: refused before any page moves.
        let e = unsafe { pieces_for(p as u64, 8192) }.unwrap_err();
        assert!(e.to_string().contains("file-backed"), "{e}");
    }
}
