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
    /// addresses, their bytes kept. Refused (`NotShareable`) unless every page is readable and
    /// writable private anonymous memory, or a mapping `movable` accepts (pages an earlier move
    /// put in a memfd that no registration uses any more, say): shared or file-backed memory
    /// would be cut from its file or from the other process that maps it. Bytes of other
    /// objects on the first and last page move too (and stay where they were).
    ///
    /// # Safety
    /// No thread may write those pages while they move (a write in between is lost), and
    /// after a `fork` the child shares them instead of copying.
    pub unsafe fn share_in_place(
        addr: usize,
        len: u64,
        movable: &dyn Fn(&Mapping) -> bool,
    ) -> Result<SharedInPlace> {
        let refuse = |reason: String| Error::NotShareable {
            region: RegionId(0),
            reason,
        };
        let (start, end) = page_range(addr, len).map_err(refuse)?;
        let size = end - start;
        for m in mappings_over(start, end).map_err(refuse)? {
            if !m.perms.starts_with("rw") || !(m.private_anonymous() || movable(&m)) {
                return Err(refuse(format!(
                    "{:#x}..{:#x} is {} {:?}: only private anonymous memory (malloc, torch's \
                     CPU tensors) moves; shared or file-backed memory does not",
                    m.lo, m.hi, m.perms, m.path
                )));
            }
        }
        let region = Region::alloc(RegionId(0), size as u64)?;
        let fd = region.memfd().ok_or_else(|| refuse("no memfd".into()))?;
        // SAFETY: [start, end) is mapped readable (checked above; the caller keeps it so), the
        // region's own mapping is fresh and `size` long, and the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(start as *const u8, region.ptr.as_ptr(), size) };
        // SAFETY: replaces exactly the pages checked above (memory of this process the caller
        // gives) with the memfd holding the same bytes.
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

/// The whole pages holding `[addr, addr + len)`.
pub fn page_range(addr: usize, len: u64) -> Result<(usize, usize), String> {
    let page = rustix::param::page_size();
    let end = usize::try_from(len)
        .ok()
        .filter(|&n| n > 0)
        .and_then(|n| addr.checked_add(n))
        .and_then(|e| e.checked_next_multiple_of(page))
        .ok_or_else(|| format!("{len} bytes at {addr:#x}: empty or past the address space"))?;
    Ok((addr - addr % page, end))
}

/// One line of `/proc/self/maps`: `lo-hi perms offset dev inode [path]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub lo: usize,
    pub hi: usize,
    pub perms: String,
    pub offset: u64,
    pub inode: u64,
    pub path: String,
}

impl Mapping {
    pub fn private_anonymous(&self) -> bool {
        self.perms.ends_with('p')
            && self.inode == 0
            && (self.path.is_empty() || self.path == "[heap]" || self.path.starts_with("[anon:"))
    }

    /// Shared, readable and writable, of file `inode` (a memfd's), at `offset` in it for `lo`.
    pub fn shares(&self, inode: u64, offset: u64) -> bool {
        self.perms == "rw-s" && self.inode == inode && self.offset == offset
    }
}

/// The mappings of this process over `[start, end)`, in order; an error names the first gap.
pub fn mappings_over(start: usize, end: usize) -> Result<Vec<Mapping>, String> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| format!("read /proc/self/maps: {e}"))?;
    parse_maps(&maps, start, end)
}

fn parse_maps(maps: &str, start: usize, end: usize) -> Result<Vec<Mapping>, String> {
    let mut covered = start;
    let mut out = Vec::new();
    for line in maps.lines() {
        let Some(m) = parse_line(line) else {
            continue;
        };
        if m.hi <= covered || m.lo >= end {
            continue;
        }
        if m.lo > covered {
            return Err(format!("{covered:#x}..{:#x} is not mapped", m.lo));
        }
        covered = m.hi;
        out.push(m);
        if covered >= end {
            return Ok(out);
        }
    }
    Err(format!("{covered:#x}..{end:#x} is not mapped"))
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut f = line.split_whitespace();
    let (range, perms, offset) = (f.next()?, f.next()?, f.next()?);
    let inode = f.nth(1)?;
    let path = f.collect::<Vec<_>>().join(" ");
    let (lo, hi) = range.split_once('-')?;
    Some(Mapping {
        lo: usize::from_str_radix(lo, 16).ok()?,
        hi: usize::from_str_radix(hi, 16).ok()?,
        perms: perms.into(),
        offset: u64::from_str_radix(offset, 16).ok()?,
        inode: inode.parse().ok()?,
        path,
    })
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
        let moved = unsafe { Region::share_in_place(addr, 2 * page as u64, &|_| false) }.unwrap();
        assert_eq!(v, before, "the bytes changed when their pages moved");
        let at = addr - moved.start;
        // The process's bytes are the memfd's: a write on either side is seen on the other.
        v[10] = 0xee;
        // SAFETY: nothing else touches the region.
        let mapped = unsafe { moved.region.as_mut_slice() };
        assert_eq!(mapped[at], 0xee);
        mapped[at + 1] = 0x42;
        assert_eq!(v[11], 0x42);
        // Moved pages move again only where the caller says so.
        let inode = rustix::fs::fstat(moved.region.memfd().unwrap())
            .unwrap()
            .st_ino;
        let (lo, hi) = page_range(addr, 2 * page as u64).unwrap();
        let over = mappings_over(lo, hi).unwrap();
        assert!(
            over.iter().all(|m| m.inode == inode && m.perms == "rw-s"),
            "{over:?}"
        );
        assert!(over[0].shares(inode, 0));
        // SAFETY: as above.
        assert!(unsafe { Region::share_in_place(addr, 16, &|_| false) }.is_err());
        // SAFETY: as above.
        let again = unsafe { Region::share_in_place(addr, 16, &|m| m.inode == inode) }.unwrap();
        v[10] = 0x17;
        // SAFETY: nothing else touches the region.
        assert_eq!(unsafe { again.region.as_slice() }[addr - again.start], 0x17);
    }

    #[test]
    fn mappings_name_their_gaps_and_kinds() {
        let maps = "1000-3000 rw-p 00000000 00:00 0 \n\
                    3000-4000 rw-s 00002000 00:01 77 /memfd:x (deleted)\n\
                    5000-6000 rw-p 00000000 00:00 0 [heap]\n\
                    6000-7000 r--p 00000000 00:00 0\n";
        let m = parse_maps(maps, 0x1000, 0x4000).unwrap();
        assert_eq!(m.len(), 2);
        assert!(m[0].private_anonymous());
        assert!(!m[1].private_anonymous());
        assert!(m[1].shares(77, 0x2000));
        assert_eq!(m[1].path, "/memfd:x (deleted)");
        assert!(parse_maps(maps, 0x5000, 0x6000).unwrap()[0].private_anonymous());
        let e = parse_maps(maps, 0x4000, 0x5000).unwrap_err();
        assert!(e.contains("not mapped"), "{e}");
        let e = parse_maps(maps, 0x6000, 0x9000).unwrap_err();
        assert!(e.contains("0x7000..0x9000"), "{e}");
    }

    #[test]
    fn an_empty_or_wrapping_range_is_refused() {
        // SAFETY: refused before any page is touched.
        assert!(unsafe { Region::share_in_place(4096, 0, &|_| false) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { Region::share_in_place(usize::MAX - 10, 100, &|_| false) }.is_err());
    }
}
