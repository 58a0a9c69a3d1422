//! Memory allocated elsewhere in this process (NIXL's users register what torch or malloc gave
//! them) moved into a memfd at the same addresses, so the node's agent can map it too.

use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags, mmap};

use crate::error::{Error, Result};
use crate::region::Region;
use crate::region_id::RegionId;

/// Pages moved into a memfd: the region (whole pages) and where it starts in this process.
#[derive(Debug)]
pub struct SharedInPlace {
    pub region: Region,
    /// The first page's address; the registered bytes start at `addr - start` in `region`.
    pub start: usize,
}

impl Region {
    /// Moves the pages holding `[addr, addr + len)` into a fresh sealed memfd mapped at the same
    /// addresses, their bytes kept. Refused (`NotShareable`) unless every page is private
    /// anonymous memory, readable and writable: shared or file-backed memory would be cut from
    /// its file or from the other process that maps it. Bytes of other objects on the first and
    /// last page move too (and stay where they were).
    ///
    /// # Safety
    /// No thread may write those pages while they move (a write in between is lost), and
    /// after a `fork` the child shares them instead of copying.
    pub unsafe fn share_in_place(addr: usize, len: u64) -> Result<SharedInPlace> {
        let refuse = |reason: String| Error::NotShareable {
            region: RegionId(0),
            reason,
        };
        let page = rustix::param::page_size();
        let end = usize::try_from(len)
            .ok()
            .filter(|&n| n > 0)
            .and_then(|n| addr.checked_add(n))
            .and_then(|e| e.checked_next_multiple_of(page))
            .ok_or_else(|| {
                refuse(format!(
                    "{len} bytes at {addr:#x}: empty or past the address space"
                ))
            })?;
        let start = addr - addr % page;
        let size = end - start;
        let maps = std::fs::read_to_string("/proc/self/maps")
            .map_err(|e| Error::io("read /proc/self/maps", e))?;
        check_private_anonymous(&maps, start, end).map_err(refuse)?;
        let region = Region::alloc(RegionId(0), size as u64)?;
        let fd = region.memfd().ok_or_else(|| refuse("no memfd".into()))?;
        // SAFETY: [start, end) is mapped readable (checked above; the caller keeps it so), the
        // region's own mapping is fresh and `size` long, and the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(start as *const u8, region.ptr.as_ptr(), size) };
        // SAFETY: replaces exactly the pages checked above (private anonymous memory of this
        // process, the caller's to give) with the memfd holding the same bytes.
        let at = unsafe {
            mmap(
                start as *mut std::ffi::c_void,
                size,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::FIXED,
                fd,
                0,
            )
        }
        .map_err(|e| {
            Error::io(
                format!("mmap the memfd over {size} bytes at {start:#x}"),
                e.into(),
            )
        })?;
        debug_assert_eq!(
            NonNull::new(at.cast::<u8>()).map(|p| p.as_ptr() as usize),
            Some(start)
        );
        Ok(SharedInPlace { region, start })
    }
}

/// Every byte of `[start, end)` lies in a private anonymous mapping readable and writable
/// (lines of `/proc/self/maps`: `lo-hi perms offset dev inode [path]`).
fn check_private_anonymous(maps: &str, start: usize, end: usize) -> Result<(), String> {
    let mut covered = start;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let (inode, path) = (fields.nth(2), fields.next().unwrap_or(""));
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            continue;
        };
        if hi <= covered || lo >= end {
            continue;
        }
        if lo > covered {
            return Err(format!("{covered:#x}..{lo:#x} is not mapped"));
        }
        let anonymous = inode == Some("0")
            && (path.is_empty() || path == "[heap]" || path.starts_with("[anon:"));
        if !perms.starts_with("rw") || !perms.ends_with('p') || !anonymous {
            return Err(format!(
                "{lo:#x}..{hi:#x} is {perms} {path:?}: only private anonymous memory (malloc, \
                 torch's CPU tensors) moves; shared or file-backed memory does not"
            ));
        }
        covered = hi;
        if covered >= end {
            return Ok(());
        }
    }
    Err(format!("{covered:#x}..{end:#x} is not mapped"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moved_pages_keep_their_bytes_and_are_the_memfd_s() {
        let page = rustix::param::page_size();
        let mut v: Vec<u8> = (0..3 * page + 100).map(|i| (i % 251) as u8).collect();
        let before = v.clone();
        let addr = v.as_ptr() as usize + 10;
        // SAFETY: no other thread touches `v`; it is not freed while the region lives.
        let moved = unsafe { Region::share_in_place(addr, 2 * page as u64) }.unwrap();
        assert_eq!(v, before, "the bytes changed when their pages moved");
        let at = addr - moved.start;
        // The process's bytes are the memfd's: a write on either side is seen on the other.
        v[10] = 0xee;
        // SAFETY: nothing else touches the region.
        let mapped = unsafe { moved.region.as_mut_slice() };
        assert_eq!(mapped[at], 0xee);
        mapped[at + 1] = 0x42;
        assert_eq!(v[11], 0x42);
    }

    #[test]
    fn only_private_anonymous_memory_moves() {
        let maps = "1000-3000 rw-p 00000000 00:00 0 \n\
                    3000-4000 rw-s 00000000 00:01 77 /memfd:x (deleted)\n\
                    5000-6000 rw-p 00000000 00:00 0 [heap]\n\
                    6000-7000 r--p 00000000 00:00 0\n";
        assert!(check_private_anonymous(maps, 0x1000, 0x3000).is_ok());
        assert!(check_private_anonymous(maps, 0x5000, 0x6000).is_ok());
        let e = check_private_anonymous(maps, 0x2000, 0x4000).unwrap_err();
        assert!(e.contains("rw-s"), "{e}");
        let e = check_private_anonymous(maps, 0x4000, 0x5000).unwrap_err();
        assert!(e.contains("not mapped"), "{e}");
        let e = check_private_anonymous(maps, 0x5000, 0x7000).unwrap_err();
        assert!(e.contains("r--p"), "{e}");
        let e = check_private_anonymous(maps, 0x6000, 0x9000).unwrap_err();
        assert!(e.contains("r--p"), "{e}");
    }

    #[test]
    fn an_empty_or_wrapping_range_is_refused() {
        // SAFETY: refused before any page is touched.
        assert!(unsafe { Region::share_in_place(4096, 0) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { Region::share_in_place(usize::MAX - 10, 100) }.is_err());
    }
}
