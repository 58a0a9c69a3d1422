//! What `fork` does to moved pages. They are shared memfd mappings now, and a child shares
//! shared mappings with its parent instead of getting a copy: heap pages around a small
//! registration (other objects, malloc's own data) would then be written by both processes —
//! a Python child that runs code before `exec` (a `preexec_fn`, `multiprocessing`'s fork)
//! corrupted its parent's heap and aborted. So the child, before anything else runs in it,
//! replaces each moved mapping with a private copy of its bytes, as `fork` would have made.
//! (`vfork`, which `subprocess` uses where it can, runs no fork handlers and copies nothing.)

use std::cell::RefCell;
use std::sync::{MutexGuard, Once};

use kvfabric_engine::mappings_over;
use rustix::mm::{MapFlags, MremapFlags, ProtFlags, mmap_anonymous, mremap_fixed};

use crate::moved::{MOVED, Moved};

thread_local! {
    /// The table, locked by the forking thread from just before `fork` until just after, so
    /// the child finds it whole.
    static HELD: RefCell<Option<MutexGuard<'static, Vec<Moved>>>> = const { RefCell::new(None) };
}

/// Installs the fork handlers, once per process.
pub fn guard() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are plain functions that live as long as the process.
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        if rc != 0 {
            eprintln!("kvfabric-nixl: pthread_atfork failed ({rc}): a forked child would share moved pages");
        }
    });
}

extern "C" fn prepare() {
    let table = MOVED.lock().unwrap_or_else(|e| e.into_inner());
    HELD.with(|h| *h.borrow_mut() = Some(table));
}

extern "C" fn parent() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

extern "C" fn child() {
    HELD.with(|h| {
        if let Some(table) = h.borrow_mut().take() {
            for m in table.iter() {
                privatize(m);
            }
        }
    });
}

/// The pages of `m` that are still its memfd become private copies of themselves.
fn privatize(m: &Moved) {
    let Ok(maps) = mappings_over(m.start, m.end) else {
        return;
    };
    for p in maps.iter().filter(|p| m.maps(p)) {
        let len = p.hi - p.lo;
        // SAFETY: a fresh private mapping; [p.lo, p.hi) is mapped readable and writable (the
        // memfd this process put there), nothing else runs in the child yet, and the copy then
        // takes the old mapping's place at the same addresses.
        let done = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
            .and_then(|copy| {
                std::ptr::copy_nonoverlapping(p.lo as *const u8, copy.cast::<u8>(), len);
                mremap_fixed(copy, len, len, MremapFlags::MAYMOVE, p.lo as *mut _)
            })
        };
        if let Err(e) = done {
            eprintln!(
                "kvfabric-nixl: fork: {:#x}..{:#x} stays shared with the parent: {e}",
                p.lo, p.hi
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::moved::pieces_for;

    #[test]
    fn a_forked_child_writes_its_own_copy_of_moved_pages() {
        let page = rustix::param::page_size();
        let v = crate::moved::tests::own_pages(6 * page);
        v.fill(7);
        let base = (v.as_ptr() as usize).next_multiple_of(page);
        // SAFETY: nothing else touches `v`, which outlives the moved memory.
        let pieces = unsafe { pieces_for(base as u64, 2 * page as u64) }.unwrap();
        let at = base - v.as_ptr() as usize;
        // SAFETY: fork in a test process; the child only writes memory and exits.
        match unsafe { libc::fork() } {
            0 => {
                v[at + 5] = 9;
                // SAFETY: the piece's memfd is mapped in the child too.
                let memfd = unsafe { pieces[0].memory.as_slice() }[5];
                // The child's write stayed in its copy, not in the memfd the parent shares.
                // SAFETY: leaving the child without running the parent's destructors.
                unsafe { libc::_exit(if memfd == 7 { 0 } else { 1 }) }
            }
            pid if pid > 0 => {
                let mut status = 0;
                // SAFETY: waiting for our own child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                assert!(libc::WIFEXITED(status), "child died: {status:#x}");
                assert_eq!(
                    libc::WEXITSTATUS(status),
                    0,
                    "the child wrote the shared memfd"
                );
                assert_eq!(v[at + 5], 7, "the child's write reached the parent");
                // The parent's pages are still the memfd.
                v[at + 6] = 3;
                // SAFETY: nothing transfers into it.
                assert_eq!(unsafe { pieces[0].memory.as_slice() }[6], 3);
            }
            _ => panic!("fork failed"),
        }
    }
}
