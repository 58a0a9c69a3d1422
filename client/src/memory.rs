//! Memory a worker registers with its agent.

use kvfabric_engine::Region;

use crate::error::Result;

/// Host memory a worker allocates for its KV cache: a sealed memfd, mapped here and, once
/// registered, in the agent too — transfers land in it without a copy through the agent.
#[derive(Debug)]
pub struct HostMemory(pub(crate) Region);

impl HostMemory {
    pub fn alloc(len: u64) -> Result<HostMemory> {
        Ok(HostMemory(Region::shared_memory(len)?))
    }
    /// Moves the pages holding `[addr, addr + len)` of this process (memory torch or malloc
    /// gave, as NIXL's users register) into a memfd at the same addresses, their bytes kept,
    /// so the agent can map them; `addr` lies at the returned offset. Refused unless the pages
    /// are private anonymous memory or mappings `movable` accepts (see
    /// `kvfabric_engine::Region::share_in_place`).
    ///
    /// # Safety
    /// No thread may write those pages while they move, and they must stay mapped while
    /// transfers may touch them; after a `fork` the child shares them.
    pub unsafe fn share_in_place(
        addr: usize,
        len: u64,
        movable: &dyn Fn(&kvfabric_engine::Mapping) -> bool,
    ) -> Result<(HostMemory, u64)> {
        // SAFETY: forwarded to the caller.
        let moved = unsafe { Region::share_in_place(addr, len, movable) }?;
        Ok((HostMemory(moved.region), (addr - moved.start) as u64))
    }
    pub fn len(&self) -> u64 {
        self.0.len()
    }
    /// The memfd, to hand to an agent or engine directly.
    pub fn memfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.0.memfd()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// # Safety
    /// No transfer may write this memory while the slice is alive.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: forwarded to the caller.
        unsafe { self.0.as_slice() }
    }
    /// # Safety
    /// No transfer may touch this memory while the slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: forwarded to the caller.
        unsafe { self.0.as_mut_slice() }
    }
}

/// GPU memory a worker exports with cuIpcGetMemHandle.
#[derive(Debug, Clone)]
pub struct CudaRegion {
    /// The device's number in the worker's process (what the handle was made on).
    pub device: u32,
    /// The device's UUID (`GPU-…`): the agent opens the same physical GPU whatever numbering
    /// it sees. Empty: the agent takes `device` as its own ordinal.
    pub device_uuid: String,
    pub ipc_handle: Vec<u8>,
    pub offset: u64,
    pub len: u64,
}

/// Memory to register: host (memfd) or GPU (IPC handle).
#[derive(Debug, Clone, Copy)]
pub enum Memory<'a> {
    Host(&'a HostMemory),
    Cuda(&'a CudaRegion),
}

impl<'a> From<&'a HostMemory> for Memory<'a> {
    fn from(m: &'a HostMemory) -> Self {
        Memory::Host(m)
    }
}

impl<'a> From<&'a CudaRegion> for Memory<'a> {
    fn from(m: &'a CudaRegion) -> Self {
        Memory::Cuda(m)
    }
}
