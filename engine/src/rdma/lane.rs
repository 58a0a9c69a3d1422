//! The bookkeeping of one QP of a link (a lane), apart from the verbs calls: work waiting for
//! send-queue credits, work in flight in post order, which WRs ask for a completion, and what a
//! completion means: a success releases every WR up to it; an error puts the QP in the error
//! state, so everything in flight comes back to be posted again once the QP is rebuilt, unless
//! the retry policy (`retry::PeerHealth`) fails the batch or gives RDMA to the peer up.
//!
//! WR ids carry the QP's epoch (bumped at every rebuild) in their top 16 bits: completions of a
//! QP's earlier life (flushes the provider delivers after the reset) are recognised and
//! ignored.

use std::collections::VecDeque;

use super::credits::SendQueue;
use super::retry::{Decision, PeerHealth, WcStatus};

const SEQ_BITS: u32 = 48;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// What a lane carries: one WR's worth of work.
pub trait LaneItem {
    /// The batch it belongs to has already failed or was cancelled: do not post it.
    fn cancelled(&self) -> bool;
}

#[derive(Debug)]
pub struct Queued<T> {
    pub item: T,
    /// Charged retries so far.
    pub retries: u32,
}

/// What a completion asks of the caller.
#[derive(Debug)]
pub struct Outcome<T> {
    /// Work that is done.
    pub done: Vec<T>,
    /// Work whose batch fails, with why.
    pub failed: Vec<(T, Failure)>,
    /// The QP is in the error state: rebuild it (its work waits in the backlog).
    pub rebuild: bool,
}

impl<T> Default for Outcome<T> {
    fn default() -> Self {
        Outcome {
            done: Vec::new(),
            failed: Vec::new(),
            rebuild: false,
        }
    }
}

/// Why work failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The request itself was refused (protection, access, length): retrying cannot help.
    Refused(String),
    /// RDMA to the peer was given up: use tcp.
    Fallback(String),
}

#[derive(Debug)]
pub struct LaneState<T> {
    credits: SendQueue,
    signal_every: u32,
    max_per_post: u32,
    epoch: u16,
    seq: u64,
    backlog: VecDeque<Queued<T>>,
    inflight: VecDeque<(u64, bool, Queued<T>)>,
    /// In the error state (or being rebuilt): nothing is posted, completions are ignored.
    broken: bool,
}

impl<T: LaneItem> LaneState<T> {
    /// `name` names the QP in errors; `depth` is its send queue as granted by the device.
    pub fn new(name: impl Into<String>, depth: u32, signal_every: u32, max_per_post: u32) -> Self {
        LaneState {
            credits: SendQueue::new(name, depth),
            signal_every: signal_every.clamp(1, depth.max(1)),
            max_per_post: max_per_post.clamp(1, depth.max(1)),
            epoch: 0,
            seq: 0,
            backlog: VecDeque::new(),
            inflight: VecDeque::new(),
            broken: false,
        }
    }

    pub fn epoch(&self) -> u16 {
        self.epoch
    }

    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Work waiting to be posted.
    pub fn backlog(&self) -> usize {
        self.backlog.len()
    }

    /// WRs posted and not yet known to be done.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    pub fn credits(&self) -> &SendQueue {
        &self.credits
    }

    /// The work waiting to be posted, to update it in place (the peer's keys changed).
    pub fn backlog_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.backlog.iter_mut().map(|q| &mut q.item)
    }

    pub fn push(&mut self, items: impl IntoIterator<Item = T>) {
        self.backlog
            .extend(items.into_iter().map(|item| Queued { item, retries: 0 }));
    }

    fn wr_id(&self, seq: u64) -> u64 {
        (u64::from(self.epoch) << SEQ_BITS) | (seq & SEQ_MASK)
    }

    /// The epoch a WR id was posted in.
    pub fn epoch_of(wr_id: u64) -> u16 {
        (wr_id >> SEQ_BITS) as u16
    }

    /// Moves the next chain from the backlog into flight and accounts its credits: at most
    /// `max_per_post` WRs and what the send queue has room for; every `signal_every`-th WR and
    /// the chain's last ask for a completion (so no unsignaled WR is ever left without a later
    /// signaled one). Cancelled work is dropped on the way. Returns the chain's length; its WRs
    /// are [`LaneState::posted`]. Empty while broken.
    pub fn take_chain(&mut self) -> usize {
        if self.broken {
            return 0;
        }
        let room = self.credits.available().min(self.max_per_post) as usize;
        let mut taken = Vec::with_capacity(room.min(self.backlog.len()));
        while taken.len() < room {
            let Some(q) = self.backlog.pop_front() else {
                break;
            };
            if q.item.cancelled() {
                continue;
            }
            taken.push(q);
        }
        let n = taken.len();
        let mut chain: Vec<(u64, bool)> = Vec::with_capacity(n);
        for (i, q) in taken.into_iter().enumerate() {
            self.seq += 1;
            let signaled = (i as u32 + 1).is_multiple_of(self.signal_every) || i + 1 == n;
            let id = self.wr_id(self.seq);
            chain.push((id, signaled));
            self.inflight.push_back((id, signaled, q));
        }
        if n > 0 {
            self.credits
                .post(&chain)
                .expect("a chain sized by the credits, ending signaled, always fits");
        }
        n
    }

    /// The last `n` WRs moved into flight (what `take_chain` just returned): id, whether it is
    /// signaled, and the work.
    pub fn posted(&self, n: usize) -> impl Iterator<Item = (u64, bool, &T)> {
        let start = self.inflight.len() - n;
        self.inflight
            .range(start..)
            .map(|(id, signaled, q)| (*id, *signaled, &q.item))
    }

    /// Posting the chain failed (`ibv_post_send` refused it, maybe halfway): the QP's state is
    /// unknown, so it is treated as broken and everything in flight goes back to the backlog,
    /// uncharged.
    pub fn post_failed(&mut self) {
        self.break_and_requeue();
    }

    fn break_and_requeue(&mut self) {
        self.broken = true;
        self.credits.reset();
        while let Some((_, _, q)) = self.inflight.pop_back() {
            self.backlog.push_front(q);
        }
    }

    /// The link is being rebuilt (this QP failed, or another one did): stop posting, ignore
    /// completions, and keep everything in flight to post again.
    pub fn begin_rebuild(&mut self) {
        self.break_and_requeue();
    }

    /// The QP was reset and connected again: a new epoch, full credits, backlog first.
    pub fn rebuilt(&mut self) {
        self.break_and_requeue();
        self.epoch = self.epoch.wrapping_add(1);
        self.broken = false;
    }

    /// Everything on the lane, for failing it (RDMA given up, link closed).
    pub fn drain(&mut self) -> Vec<T> {
        self.break_and_requeue();
        self.backlog.drain(..).map(|q| q.item).collect()
    }

    /// A completion of this QP.
    pub fn on_completion(
        &mut self,
        wr_id: u64,
        status: WcStatus,
        vendor_err: u32,
        health: &mut PeerHealth,
    ) -> Outcome<T> {
        let mut out = Outcome::default();
        if self.broken || Self::epoch_of(wr_id) != self.epoch {
            return out;
        }
        if status == WcStatus::Success {
            if self.credits.complete(wr_id).is_err() {
                // Not a signaled WR in flight: a provider bug or a stale id; nothing to release.
                tracing::warn!(wr_id = format!("{wr_id:#x}"), "unexpected rdma completion");
                return out;
            }
            health.on_completion(status, 0, 0);
            while let Some((id, _, _)) = self.inflight.front() {
                if *id > wr_id {
                    break;
                }
                let (_, _, q) = self.inflight.pop_front().expect("front exists");
                out.done.push(q.item);
            }
            return out;
        }
        // The QP is in the error state: every WR in flight is lost with it.
        let at = self.inflight.iter().position(|(id, _, _)| *id == wr_id);
        let retries = at.map_or(0, |i| self.inflight[i].2.retries);
        let decision = health.on_completion(status, vendor_err, retries);
        self.break_and_requeue();
        out.rebuild = true;
        // The requeued WRs are the backlog's first `requeued` entries, the failed one at `at`.
        match decision {
            Decision::Done => {}
            Decision::Retry { charged } => {
                if let (Some(i), true) = (at, charged) {
                    self.backlog[i].retries += 1;
                }
            }
            Decision::FailBatch { reason } => {
                if let Some(i) = at {
                    let q = self.backlog.remove(i).expect("requeued above");
                    out.failed.push((q.item, Failure::Refused(reason)));
                }
            }
            Decision::FallbackTcp { reason } => {
                out.rebuild = false;
                out.failed = self
                    .backlog
                    .drain(..)
                    .map(|q| (q.item, Failure::Fallback(reason.clone())))
                    .collect();
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;
    use crate::rdma::retry::RetryPolicy;

    #[derive(Debug, Clone)]
    struct Item(u32, Rc<Cell<bool>>);

    impl LaneItem for Item {
        fn cancelled(&self) -> bool {
            self.1.get()
        }
    }

    fn items(range: std::ops::Range<u32>) -> (Vec<Item>, Rc<Cell<bool>>) {
        let flag = Rc::new(Cell::new(false));
        (range.map(|i| Item(i, flag.clone())).collect(), flag)
    }

    fn ids<T>(v: &[T], f: impl Fn(&T) -> u32) -> Vec<u32> {
        v.iter().map(f).collect()
    }

    /// Posts what credits allow; returns (wr_id, signaled, item number) per WR.
    fn post(l: &mut LaneState<Item>) -> Vec<(u64, bool, u32)> {
        let n = l.take_chain();
        l.posted(n).map(|(id, s, it)| (id, s, it.0)).collect()
    }

    fn health(slice_retries: u32, rebuilds: u32) -> PeerHealth {
        PeerHealth::new(
            "decode-0",
            RetryPolicy {
                slice_retries,
                rebuilds_before_fallback: rebuilds,
            },
        )
    }

    #[test]
    fn chains_are_cut_by_credits_and_post_size_and_end_signaled() {
        let mut l = LaneState::new("mlx5_0 qp 0x10", 8, 3, 5);
        let (v, _) = items(0..20);
        l.push(v);
        let c = post(&mut l);
        assert_eq!(ids(&c, |w| w.2), [0, 1, 2, 3, 4]);
        let flags: Vec<bool> = c.iter().map(|w| w.1).collect();
        assert_eq!(flags, [false, false, true, false, true]);
        // 3 credits left: a chain of 3, its last signaled.
        let c2 = post(&mut l);
        assert_eq!(ids(&c2, |w| w.2), [5, 6, 7]);
        assert!(c2[2].1);
        assert_eq!(post(&mut l).len(), 0, "no credits left");
        assert_eq!(l.in_flight(), 8);
        // Completing the first signaled WR frees 3 slots and finishes items 0..=2.
        let out = l.on_completion(c[2].0, WcStatus::Success, 0, &mut health(3, 3));
        assert_eq!(ids(&out.done, |i| i.0), [0, 1, 2]);
        assert!(!out.rebuild && out.failed.is_empty());
        assert_eq!(l.credits().available(), 3);
        // A later completion implies the earlier ones.
        let out = l.on_completion(c2[2].0, WcStatus::Success, 0, &mut health(3, 3));
        assert_eq!(ids(&out.done, |i| i.0), [3, 4, 5, 6, 7]);
        assert_eq!((l.in_flight(), l.credits().available()), (0, 8));
    }

    #[test]
    fn everything_gets_through_a_small_queue() {
        for (depth, every, per_post) in [(4, 4, 4), (4, 1, 2), (16, 16, 3), (1, 1, 1)] {
            let mut l = LaneState::new("q", depth, every, per_post);
            let (v, _) = items(0..100);
            l.push(v);
            let mut done = Vec::new();
            let mut signaled = std::collections::VecDeque::new();
            let mut h = health(0, 0);
            for _ in 0..10_000 {
                for (id, s, _) in post(&mut l) {
                    if s {
                        signaled.push_back(id);
                    }
                }
                let Some(id) = signaled.pop_front() else {
                    break;
                };
                done.extend(l.on_completion(id, WcStatus::Success, 0, &mut h).done);
            }
            assert_eq!(ids(&done, |i| i.0), (0..100).collect::<Vec<_>>());
            assert_eq!(l.backlog() + l.in_flight(), 0);
        }
    }

    #[test]
    fn cancelled_work_is_not_posted() {
        let mut l = LaneState::new("q", 16, 4, 16);
        let (a, cancel_a) = items(0..3);
        let (b, _) = items(10..12);
        l.push(a);
        l.push(b);
        cancel_a.set(true);
        let c = post(&mut l);
        assert_eq!(ids(&c, |w| w.2), [10, 11]);
    }

    #[test]
    fn an_error_requeues_the_flight_and_charges_only_the_failed_wr() {
        let mut l = LaneState::new("q", 16, 2, 16);
        let (v, _) = items(0..6);
        l.push(v);
        let c = post(&mut l);
        let mut h = health(1, 10);
        // WR 3 (unsignaled ones report errors too) times out.
        let out = l.on_completion(c[3].0, WcStatus::RetryExcErr, 0x81, &mut h);
        assert!(out.rebuild && out.done.is_empty() && out.failed.is_empty());
        assert!(l.is_broken());
        assert_eq!((l.backlog(), l.in_flight()), (6, 0));
        assert_eq!(l.credits().outstanding(), 0);
        // Flushes of the same epoch, and anything while broken, are ignored.
        let out = l.on_completion(c[4].0, WcStatus::WrFlushErr, 0, &mut h);
        assert!(!out.rebuild);
        assert_eq!(post(&mut l).len(), 0, "nothing is posted while broken");
        l.rebuilt();
        assert_eq!(l.epoch(), 1);
        let c2 = post(&mut l);
        assert_eq!(
            ids(&c2, |w| w.2),
            [0, 1, 2, 3, 4, 5],
            "same order after the rebuild"
        );
        assert!(c2.iter().all(|w| LaneState::<Item>::epoch_of(w.0) == 1));
        // A stale completion of epoch 0 changes nothing.
        let out = l.on_completion(c[5].0, WcStatus::Success, 0, &mut h);
        assert!(out.done.is_empty());
        // The same WR failing again exhausts its one retry: RDMA is given up, and every piece
        // of work on the lane fails with the reason.
        let out = l.on_completion(c2[3].0, WcStatus::RetryExcErr, 0x81, &mut h);
        assert!(!out.rebuild);
        assert_eq!(out.failed.len(), 6);
        let Failure::Fallback(reason) = &out.failed[0].1 else {
            panic!("{:?}", out.failed[0].1)
        };
        assert!(
            reason.contains("decode-0") && reason.contains("tcp"),
            "{reason}"
        );
        assert!(h.fallback().is_some());
    }

    #[test]
    fn a_refused_request_fails_its_work_and_the_rest_waits_for_the_rebuild() {
        let mut l = LaneState::new("q", 16, 16, 16);
        let (v, _) = items(0..4);
        l.push(v);
        let c = post(&mut l);
        let mut h = health(3, 3);
        let out = l.on_completion(c[1].0, WcStatus::RemAccessErr, 0, &mut h);
        assert!(out.rebuild);
        assert_eq!(out.failed.len(), 1);
        assert_eq!(out.failed[0].0.0, 1);
        assert!(
            matches!(&out.failed[0].1, Failure::Refused(r) if r.contains("IBV_WC_REM_ACCESS_ERR"))
        );
        assert_eq!(l.backlog(), 3);
        l.rebuilt();
        assert_eq!(ids(&post(&mut l), |w| w.2), [0, 2, 3]);
    }

    #[test]
    fn a_failed_post_keeps_the_work_and_asks_for_a_rebuild() {
        let mut l = LaneState::new("q", 8, 4, 8);
        let (v, _) = items(0..5);
        l.push(v);
        assert_eq!(l.take_chain(), 5);
        l.post_failed();
        assert!(l.is_broken());
        assert_eq!((l.backlog(), l.credits().outstanding()), (5, 0));
        l.rebuilt();
        assert_eq!(ids(&post(&mut l), |w| w.2), [0, 1, 2, 3, 4]);
        assert_eq!(l.drain().len(), 5);
        assert_eq!(l.backlog() + l.in_flight(), 0);
    }
}
