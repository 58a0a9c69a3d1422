//! One device's copy machinery: a pool of slots (stream, completion event, op-list buffers) and a
//! completion thread. A batch takes a slot, becomes ONE piece of GPU work (a kernel launch over a
//! device-side op list or block table, or one batched copy-engine call), and is completed by the
//! thread that waits on the slot's event, so the submitting thread never waits. A caller about to
//! block anyway (`run_here`) polls its own batch for a short window first (and small batches go
//! through the doorbell kernel, no launch at all); only past the window is the batch handed to
//! the completion thread, which sleeps in the driver. So a lone small op completes in a few µs,
//! and an idle lane holds no core (the window ends with its batch) and no SM (the doorbell kernel
//! exits after its idle time).

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use tracing::warn;

use super::CudaPath;
use super::batch_copy::{Place, batch_copy};
use super::doorbell::{Doorbell, Ticket};
use super::driver::{self, Device, DeviceMem, Event, Pinned, Stream, check};
use super::oplist::OpList;
use super::table_list::{DevicePlane, TableList};
use crate::block_table::BlockPair;
use crate::error::{Error, Result};

/// The SM path cuts ops to this size so the warps of the persistent grid stay evenly busy.
const MAX_PIECE: u64 = 64 << 10;
/// Batches of at most this many (split) ops go as kernel parameters (`KVF_INLINE_OPS`).
pub(crate) const INLINE_OPS: usize = 16;
/// A spinning completion thread goes back to sleeping after this long without work.
const SPIN_IDLE: Duration = Duration::from_millis(20);

/// How a lane waits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneOptions {
    /// The completion thread polls (one busy core while batches keep coming; `cuda_spin`).
    pub spin: bool,
    /// How long a `run_here` caller polls its batch before handing it to the completion thread
    /// (`spin_wait`; 0: never, the completion thread sleeps in the driver and wakes it).
    pub poll: Duration,
    /// The doorbell kernel lingers this long after its last batch (`cuda_doorbell_idle`; 0: no
    /// doorbell, every batch is launched).
    pub doorbell_idle: Duration,
}

/// What one piece of GPU work copies.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Work<'a> {
    /// Explicit copies, by a kernel over an op list (`Sm`) or the copy engines (`Ce`), with the
    /// (source, destination) devices as location hints for the latter.
    Copies {
        path: CudaPath,
        copies: &'a [DeviceCopy],
        hints: (u32, u32),
    },
    /// A block table, by `kvf_copy_table`; `pull`: remote → local.
    Table {
        planes: &'a [DevicePlane],
        blocks: &'a [BlockPair],
        pull: bool,
    },
}

/// `KvfInline` of copy.cu.
#[repr(C)]
struct InlineOps {
    count: u64,
    ops: [[u64; 3]; INLINE_OPS],
}

/// One copy: device addresses valid in this process, on `src_device` and `dst_device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceCopy {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

pub(crate) type Done = Box<dyn FnOnce(Result<()>) + Send>;

struct Slot {
    stream: Stream,
    event: Event,
    host: Pinned,
    dev: DeviceMem,
    list: OpList,
    table: TableList,
}

/// What a batch in flight is waited on by.
enum Wait {
    Event(Slot),
    Doorbell(Ticket),
}

struct Pending {
    wait: Wait,
    done: Done,
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
}

pub(crate) struct Lane {
    device: &'static Device,
    free: Arc<Mutex<Vec<Slot>>>,
    tx: Mutex<Sender<Pending>>,
    options: LaneOptions,
    /// Small batches of `run_here` without a launch.
    doorbell: Option<Arc<Doorbell>>,
    /// Cleared once the driver refuses cuMemcpyBatchAsync; the CE path then issues one async copy
    /// per op on the slot's stream.
    ce_batch: AtomicBool,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lane({:?})", self.device)
    }
}

impl Lane {
    pub(crate) fn new(device: &'static Device, options: LaneOptions) -> Result<Arc<Lane>> {
        device.kernels()?;
        let spin = options.spin;
        let (tx, rx) = channel::<Pending>();
        let free: Arc<Mutex<Vec<Slot>>> = Arc::default();
        let back = free.clone();
        let doorbell = if options.doorbell_idle.is_zero() {
            None
        } else {
            Some(Arc::new(Doorbell::new(device, options.doorbell_idle)?))
        };
        let bell = doorbell.clone();
        std::thread::Builder::new()
            .name(format!("kvf-cuda{}-done", device.ordinal))
            .spawn(move || {
                let bound = device.bind();
                while let Some(p) = next(&rx, spin) {
                    let Pending { wait, done, _keep } = p;
                    let r = bound
                        .as_ref()
                        .map_err(|e| e.duplicate())
                        .and_then(|_| match &wait {
                            Wait::Event(slot) if spin => slot.event.spin(),
                            Wait::Event(slot) => slot.event.synchronize(),
                            Wait::Doorbell(ticket) => {
                                let bell = bell
                                    .as_ref()
                                    .expect("tickets come from this lane's doorbell");
                                while !bell.finished(*ticket) {
                                    std::thread::sleep(Duration::from_micros(20));
                                }
                                Ok(())
                            }
                        });
                    // The slot's buffers are free again only once the GPU is past them.
                    if let (Ok(()), Wait::Event(slot)) = (&r, wait) {
                        back.lock().unwrap_or_else(|e| e.into_inner()).push(slot);
                    }
                    drop(_keep);
                    done(r);
                }
            })
            .map_err(|e| Error::io("spawn cuda completion thread", e))?;
        Ok(Arc::new(Lane {
            device,
            free,
            tx: Mutex::new(tx),
            options,
            doorbell,
            ce_batch: AtomicBool::new(true),
        }))
    }

    /// Kernels of this lane on its GPU while no batch runs: the doorbell, while it lingers (or
    /// is launched and not yet running).
    pub(crate) fn resident_kernels(&self) -> usize {
        self.doorbell
            .as_ref()
            .map_or(0, |b| usize::from(b.resident()))
    }

    fn slot(&self) -> Result<Slot> {
        if let Some(s) = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok(s);
        }
        let cap = 64 << 10;
        Ok(Slot {
            stream: Stream::new(self.device)?,
            event: Event::new(self.device, !self.options.spin, false)?,
            host: Pinned::alloc(self.device, cap)?,
            dev: DeviceMem::alloc(self.device, cap as u64)?,
            list: OpList::new(MAX_PIECE),
            table: TableList::default(),
        })
    }

    /// Queues `work` as one piece of GPU work; `done` runs on the completion thread once it
    /// has finished (or failed). `keep` lives until then (mappings the copies go through).
    pub(crate) fn submit(
        &self,
        work: Work<'_>,
        done: Done,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<()> {
        let slot = self.enqueue(work)?;
        self.hand_over(Wait::Event(slot), done, keep)
    }

    /// Like `submit`, for a caller that blocks on the batch right after: this thread polls the
    /// GPU itself for the lane's poll window (small batches going through the doorbell), so a
    /// short batch needs no other thread to wake it. Past the window, or `deadline`, the wait
    /// goes to the completion thread. A spinning lane polls until `deadline`; a lane with no
    /// window for a batch of `bytes` (`batch::poll_window`) is `submit`.
    pub(crate) fn run_here(
        &self,
        work: Work<'_>,
        bytes: u64,
        done: Done,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
        deadline: Instant,
    ) -> Result<()> {
        let until = if self.options.spin {
            deadline
        } else {
            let window = crate::batch::poll_window(bytes, self.options.poll);
            if window.is_zero() {
                return self.submit(work, done, keep);
            }
            deadline.min(crate::batch::deadline_after(Instant::now(), window))
        };
        if let (
            Work::Copies {
                path: CudaPath::Sm,
                copies,
                ..
            },
            Some(bell),
        ) = (work, &self.doorbell)
            && let Some(ops) = Doorbell::fits(copies)
            && let Some(ticket) = bell.ring(&ops)?
        {
            while !bell.finished(ticket) {
                if Instant::now() >= until {
                    return self.hand_over(Wait::Doorbell(ticket), done, keep);
                }
                std::hint::spin_loop();
            }
            drop(keep);
            done(Ok(()));
            return Ok(());
        }
        let slot = self.enqueue(work)?;
        let r = loop {
            match slot.event.query() {
                Ok(false) if Instant::now() >= until => {
                    return self.hand_over(Wait::Event(slot), done, keep);
                }
                Ok(false) => std::hint::spin_loop(),
                Ok(true) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        if r.is_ok() {
            self.free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(slot);
        }
        drop(keep);
        done(r);
        Ok(())
    }

    /// Takes a slot and queues the work and its completion event on its stream.
    fn enqueue(&self, work: Work<'_>) -> Result<Slot> {
        self.device.bind()?;
        let mut slot = self.slot()?;
        match work {
            // The link resolves `Auto` per batch; should one arrive here, a kernel is always right.
            Work::Copies {
                path: CudaPath::Sm | CudaPath::Auto,
                copies,
                ..
            } => self.enqueue_kernel(&mut slot, copies)?,
            Work::Copies {
                path: CudaPath::Ce,
                copies,
                hints,
            } => self.enqueue_copy_engine(&slot, copies, hints)?,
            Work::Table {
                planes,
                blocks,
                pull,
            } => self.enqueue_table(&mut slot, planes, blocks, pull)?,
        }
        slot.event.record(&slot.stream)?;
        Ok(slot)
    }

    fn hand_over(
        &self,
        wait: Wait,
        done: Done,
        keep: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<()> {
        let pending = Pending {
            wait,
            done,
            _keep: keep,
        };
        self.tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(pending)
            .map_err(|_| Error::ShuttingDown)
    }

    fn enqueue_kernel(&self, slot: &mut Slot, copies: &[DeviceCopy]) -> Result<()> {
        slot.list.clear();
        for c in copies {
            slot.list.push(c.src, c.dst, c.len)?;
        }
        let k = self.device.kernels()?;
        let n = slot.list.len();
        if n <= INLINE_OPS {
            let mut inline = InlineOps {
                count: n as u64,
                ops: [[0; 3]; INLINE_OPS],
            };
            for (o, op) in inline.ops.iter_mut().zip(slot.list.ops()) {
                *o = [op.src, op.dst, op.len];
            }
            let mut params = [(&mut inline as *mut InlineOps).cast::<c_void>()];
            // One CTA per op. SAFETY: kvf_copy_inline takes one KvfInline by value (InlineOps);
            // the addresses in it are bounds-checked and kept alive until completion.
            return unsafe { driver::launch(k.copy_inline, n as u32, slot.stream.0, &mut params) };
        }
        let grid = self.grid(slot.list.len() as u64);
        let mut list = self.upload(slot, Words::List)?;
        let mut params = [&mut list as *mut u64 as *mut c_void];
        // SAFETY: kvf_copy takes one pointer (the op list, uploaded above on the same stream);
        // every address in the list was bounds-checked against a live region or mapping, which
        // the caller keeps alive until completion.
        unsafe { driver::launch(k.copy, grid, slot.stream.0, &mut params) }
    }

    /// One launch of `kvf_copy_table` over the planes and ids, which it expands itself.
    fn enqueue_table(
        &self,
        slot: &mut Slot,
        planes: &[DevicePlane],
        blocks: &[BlockPair],
        pull: bool,
    ) -> Result<()> {
        slot.table.build(planes, blocks, pull, MAX_PIECE)?;
        let k = self.device.kernels()?;
        let grid = self.grid(slot.table.items());
        let mut table = self.upload(slot, Words::Table)?;
        let mut params = [&mut table as *mut u64 as *mut c_void];
        // SAFETY: kvf_copy_table takes one pointer (the table, uploaded above on the same
        // stream); every plane's largest block was bounds-checked on both sides against a live
        // region or mapping, which the caller keeps alive until completion.
        unsafe { driver::launch(k.copy_table, grid, slot.stream.0, &mut params) }
    }

    /// One CTA per SM at most: enough loads in flight to fill the link, and room on every SM
    /// for the kernels of other batches in flight (a pull and a push run side by side).
    fn grid(&self, items: u64) -> u32 {
        let warps_per_cta = u64::from(driver::THREADS / 32);
        items
            .div_ceil(warps_per_cta)
            .clamp(1, u64::from(self.device.sm_count)) as u32
    }

    /// Copies the slot's op list or table to its device buffer (growing both buffers first if
    /// needed), on the slot's stream; returns the device address.
    fn upload(&self, slot: &mut Slot, which: Words) -> Result<u64> {
        let bytes = match which {
            Words::List => std::mem::size_of_val(slot.list.words()),
            Words::Table => std::mem::size_of_val(slot.table.words()),
        };
        if bytes > slot.host.len {
            let cap = bytes.next_power_of_two();
            slot.host = Pinned::alloc(self.device, cap)?;
            slot.dev = DeviceMem::alloc(self.device, cap as u64)?;
        }
        let words = match which {
            Words::List => slot.list.words(),
            Words::Table => slot.table.words(),
        };
        // SAFETY: the pinned buffer holds at least `bytes`, and the GPU is not reading it: a slot
        // is only handed out after its previous work completed.
        unsafe { std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), slot.host.ptr, bytes) };
        // SAFETY: both buffers hold `bytes`; the pinned source stays untouched until the event.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(slot.dev.ptr, slot.host.ptr.cast(), bytes, slot.stream.0)
        })?;
        Ok(slot.dev.ptr)
    }

    fn enqueue_copy_engine(
        &self,
        slot: &Slot,
        copies: &[DeviceCopy],
        hints: (u32, u32),
    ) -> Result<()> {
        if self.ce_batch.load(Ordering::Relaxed) {
            let (src, dst) = hints;
            let all = copies.iter().map(|c| (c.dst, c.src, c.len as usize));
            // SAFETY: bounds-checked device addresses kept alive by the caller until completion.
            let queued =
                unsafe { batch_copy(slot.stream.0, all, Place::Device(src), Place::Device(dst)) };
            match queued {
                Ok(()) => return Ok(()),
                Err(e) => {
                    warn!(error = %e, "cuMemcpyBatchAsync refused; copy engine path falls back to one async copy per op");
                    self.ce_batch.store(false, Ordering::Relaxed);
                }
            }
        }
        for c in copies {
            // SAFETY: bounds-checked addresses kept alive by the caller until completion.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(c.dst, c.src, c.len as usize, slot.stream.0)
            })?;
        }
        Ok(())
    }
}

/// Which of a slot's host-built lists to upload.
#[derive(Debug, Clone, Copy)]
enum Words {
    List,
    Table,
}

/// The next finished-or-not batch to wait for: blocking on the channel, or (spin mode) polling
/// it while work keeps coming. None once the lane is gone.
fn next(rx: &Receiver<Pending>, spin: bool) -> Option<Pending> {
    if spin {
        let idle = Instant::now();
        while idle.elapsed() < SPIN_IDLE {
            match rx.try_recv() {
                Ok(p) => return Some(p),
                Err(TryRecvError::Empty) => std::hint::spin_loop(),
                Err(TryRecvError::Disconnected) => return None,
            }
        }
    }
    rx.recv().ok()
}
