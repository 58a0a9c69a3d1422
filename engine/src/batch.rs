//! A batch: many block ops against one remote segment, submitted at once, completed once.

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::block_table::BlockTable;
use crate::error::{Error, Result};
use crate::frame::TraceContext;
use crate::op::{BlockOp, Opcode};
use crate::region::{AccessKey, Lease};
use crate::transport::TransportKind;

/// What a batch moves: explicit block ops, or a block table (planes × block-id pairs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOps {
    List(Vec<BlockOp>),
    Table(BlockTable),
}

impl BatchOps {
    /// Block ops the batch stands for (a table: planes × blocks, saturating).
    pub fn len(&self) -> usize {
        match self {
            BatchOps::List(ops) => ops.len(),
            BatchOps::Table(t) => t.elements().unwrap_or(usize::MAX),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone)]
pub struct Batch {
    pub opcode: Opcode,
    pub ops: BatchOps,
    /// Overrides the engine's default batch timeout.
    pub timeout: Option<Duration>,
    /// Send a crc32c of every op's payload and verify it on arrival.
    pub checksum: bool,
    /// The key to present for every remote region instead of the one in the peer's descriptor:
    /// an agent acting for a worker presents the key the worker was given, so the owner of the
    /// memory (not the agent) decides who may touch it.
    pub remote_key: Option<AccessKey>,
    /// The trace this batch belongs to; tcp carries it to the target with every chunk.
    pub trace: Option<TraceContext>,
    /// Kept (and dropped) with the batch's job: released only once every piece the transport
    /// was given is accounted for, which is after the batch's handle answered if it timed out
    /// or failed. What a caller needs to know for "nothing of this batch can still land" (the
    /// agent's hold grants: a revocation waits for these) rides here.
    pub keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Batch {
    pub fn new(opcode: Opcode, ops: Vec<BlockOp>) -> Self {
        Batch::of(opcode, BatchOps::List(ops))
    }
    /// A block-table batch: every plane moves every block-id pair.
    pub fn table(opcode: Opcode, table: BlockTable) -> Self {
        Batch::of(opcode, BatchOps::Table(table))
    }
    pub fn of(opcode: Opcode, ops: BatchOps) -> Self {
        Batch {
            opcode,
            ops,
            timeout: None,
            checksum: false,
            remote_key: None,
            trace: None,
            keep: None,
        }
    }
    pub fn read(ops: Vec<BlockOp>) -> Self {
        Batch::new(Opcode::Read, ops)
    }
    pub fn write(ops: Vec<BlockOp>) -> Self {
        Batch::new(Opcode::Write, ops)
    }
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    pub fn with_checksum(mut self, on: bool) -> Self {
        self.checksum = on;
        self
    }
    pub fn with_trace(mut self, trace: TraceContext) -> Self {
        self.trace = Some(trace);
        self
    }
    pub fn with_remote_key(mut self, key: AccessKey) -> Self {
        self.remote_key = Some(key);
        self
    }
    /// Keeps `value` alive until every piece of the batch is accounted for (see [`Batch::keep`]).
    pub fn keeping(mut self, value: Arc<dyn std::any::Any + Send + Sync>) -> Self {
        self.keep = Some(value);
        self
    }
}

/// What a completed batch did, including the transport that carried it.
#[derive(Debug, Clone, Serialize)]
pub struct BatchResult {
    pub id: u64,
    pub opcode: Opcode,
    pub transport: TransportKind,
    pub ops: usize,
    pub coalesced_ops: usize,
    pub bytes: u64,
    pub elapsed: Duration,
}

/// Shared state of one in-flight batch. Transports hold it (and through it the local leases)
/// until every piece they were given is accounted for, so deregistration can wait for it.
#[derive(Debug)]
pub(crate) struct Job {
    pub id: u64,
    pub opcode: Opcode,
    pub checksum: bool,
    pub trace: Option<TraceContext>,
    remaining: AtomicUsize,
    bytes: AtomicU64,
    cancelled: AtomicBool,
    /// Set with `Completion::finished`, for waiters that poll before they sleep.
    finished: AtomicBool,
    /// Threads that may sleep on `done_cv`: with none, finishing skips the wake-up syscall.
    sleepers: AtomicUsize,
    done: Mutex<Completion>,
    done_cv: Condvar,
    _leases: Vec<Lease>,
    /// The batch's [`Batch::keep`]: dropped with the job, after the leases' last use.
    _keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

/// The batch outcome, waited for either by a blocked thread (condvar) or a task (waker).
#[derive(Debug, Default)]
struct Completion {
    result: Option<Result<u64>>,
    finished: bool,
    waker: Option<Waker>,
}

impl Job {
    pub(crate) fn new(
        id: u64,
        opcode: Opcode,
        checksum: bool,
        trace: Option<TraceContext>,
        leases: Vec<Lease>,
        keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Arc<Job> {
        Arc::new(Job {
            id,
            opcode,
            checksum,
            trace,
            remaining: AtomicUsize::new(0),
            bytes: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            done: Mutex::default(),
            done_cv: Condvar::new(),
            _leases: leases,
            _keep: keep,
        })
    }

    /// Declares how many pieces the transport split the batch into.
    pub(crate) fn expect_pieces(&self, n: usize) {
        self.remaining.store(n, Ordering::Release);
    }

    /// The local regions the batch holds leases on.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn regions(&self) -> impl Iterator<Item = &std::sync::Arc<crate::region::Region>> {
        self._leases.iter().map(|l| l.region())
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    pub(crate) fn piece_done(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let total = self.bytes.load(Ordering::Acquire);
            self.finish(Ok(total));
        }
    }

    pub(crate) fn piece_failed(&self, err: Error) {
        self.fail(err);
        self.remaining.fetch_sub(1, Ordering::AcqRel);
    }

    /// Completes the batch with an error now; pieces still on the wire are drained and dropped.
    pub(crate) fn fail(&self, err: Error) {
        self.cancelled.store(true, Ordering::Release);
        self.finish(Err(err));
    }

    /// The first outcome wins; later ones (pieces draining after a failure) are dropped.
    fn finish(&self, result: Result<u64>) {
        let waker = {
            let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
            if done.finished {
                return;
            }
            done.finished = true;
            done.result = Some(result);
            self.finished.store(true, Ordering::Release);
            done.waker.take()
        };
        // A sleeper counts itself before it takes the lock we just released, so it either saw
        // `finished` or is counted here.
        if self.sleepers.load(Ordering::Acquire) > 0 {
            self.done_cv.notify_all();
        }
        if let Some(w) = waker {
            w.wake();
        }
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).finished
    }

    fn take_result(&self) -> Option<Result<u64>> {
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .result
            .take()
    }
}

/// Waiters poll only batches up to this size. A lone small op is what polling speeds up (a
/// wake-up costs it tens of µs); a large batch runs far longer than any window, and many of
/// them in flight would keep as many cores polling while the host has ops to prepare.
pub(crate) const POLLED_BYTES: u64 = 4 << 20;

/// How long a waiter polls a batch of `bytes` before it sleeps, given the configured `window`
/// (`EngineConfig::spin_wait`): the window up to [`POLLED_BYTES`], nothing above.
pub(crate) fn poll_window(bytes: u64, window: Duration) -> Duration {
    if bytes <= POLLED_BYTES {
        window
    } else {
        Duration::ZERO
    }
}

/// The caller's side of a submitted batch.
#[derive(Debug)]
pub struct BatchHandle {
    pub(crate) job: Arc<Job>,
    pub(crate) timeout: Duration,
    pub(crate) started: Instant,
    pub(crate) transport: TransportKind,
    pub(crate) ops: usize,
    pub(crate) coalesced_ops: usize,
    /// How long `wait_blocking` polls before it sleeps ([`poll_window`]).
    pub(crate) spin: Duration,
}

/// Cancels a batch from anywhere (another task, a signal handler).
#[derive(Debug, Clone)]
pub struct Canceller(Arc<Job>);

impl Canceller {
    pub fn cancel(&self) {
        self.0.fail(Error::Cancelled { batch: self.0.id });
    }
}

/// `start + timeout`, or a century on when a caller's timeout is too large to add.
pub(crate) fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 86_400);
    start
        .checked_add(timeout)
        .unwrap_or_else(|| start + CENTURY)
}

impl BatchHandle {
    /// When the batch times out.
    pub(crate) fn deadline(&self) -> Instant {
        deadline_after(self.started, self.timeout)
    }

    pub fn id(&self) -> u64 {
        self.job.id
    }

    pub fn transport(&self) -> TransportKind {
        self.transport
    }

    pub fn canceller(&self) -> Canceller {
        Canceller(self.job.clone())
    }

    pub fn cancel(&self) {
        self.canceller().cancel();
    }

    /// Waits for completion, failing with `Timeout` (and cancelling the batch) after the batch's
    /// timeout.
    pub async fn wait(self) -> Result<BatchResult> {
        let job = self.job.clone();
        let done = poll_fn(|cx| {
            let mut done = job.done.lock().unwrap_or_else(|e| e.into_inner());
            if done.finished {
                Poll::Ready(())
            } else {
                done.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        });
        let timed_out = tokio::time::timeout(self.timeout, done).await.is_err();
        self.conclude(timed_out)
    }

    /// Blocks the calling thread until completion (for callers outside an async runtime, and for
    /// the lowest latency: the completing thread wakes this one directly).
    pub fn wait_blocking(self) -> Result<BatchResult> {
        if !self.spin.is_zero() {
            // A sleeping thread takes microseconds to wake; a short poll catches small batches.
            let until = deadline_after(Instant::now(), self.spin);
            while !self.job.finished.load(Ordering::Acquire) && Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        let deadline = deadline_after(Instant::now(), self.timeout);
        self.job.sleepers.fetch_add(1, Ordering::AcqRel);
        let mut done = self.job.done.lock().unwrap_or_else(|e| e.into_inner());
        let mut timed_out = false;
        while !done.finished {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                timed_out = true;
                break;
            }
            done = self
                .job
                .done_cv
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(done);
        self.job.sleepers.fetch_sub(1, Ordering::AcqRel);
        self.conclude(timed_out)
    }

    fn conclude(self, timed_out: bool) -> Result<BatchResult> {
        if timed_out {
            // A no-op when the batch completed at the last moment: its own result stands.
            self.job.fail(Error::Timeout {
                batch: self.job.id,
                millis: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            });
        }
        let bytes = self.job.take_result().unwrap_or(Err(Error::ShuttingDown))?;
        Ok(BatchResult {
            id: self.job.id,
            opcode: self.job.opcode,
            transport: self.transport,
            ops: self.ops,
            coalesced_ops: self.coalesced_ops,
            bytes,
            elapsed: self.started.elapsed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_batches_up_to_4_mib_are_polled() {
        let w = Duration::from_micros(50);
        assert_eq!(poll_window(4096, w), w);
        assert_eq!(poll_window(POLLED_BYTES, w), w);
        assert_eq!(poll_window(POLLED_BYTES + 1, w), Duration::ZERO);
        assert_eq!(poll_window(u64::MAX, w), Duration::ZERO);
        assert_eq!(poll_window(4096, Duration::ZERO), Duration::ZERO);
    }
}
