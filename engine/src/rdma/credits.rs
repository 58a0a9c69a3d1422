//! Send-queue credits of one QP. A WR holds a slot of the send queue from the moment it is
//! posted until a completion covers it; an unsignaled WR is covered by the completion of the
//! next signaled WR after it (completions on one RC send queue arrive in order). Posting more
//! than the queue holds makes `ibv_post_send` fail with ENOMEM halfway through a chain, so the
//! poster asks here first.

use std::collections::VecDeque;

use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct SendQueue {
    name: String,
    depth: u32,
    outstanding: u32,
    /// Unsignaled WRs posted after the last signaled one: released by a later completion.
    tail: u32,
    /// Signaled WRs in flight, oldest first, with how many WRs their completion releases.
    signaled: VecDeque<(u64, u32)>,
}

impl SendQueue {
    /// A queue of `depth` slots; `name` identifies it in errors (e.g. "mlx5_0 qp 0x1a2b").
    pub fn new(name: impl Into<String>, depth: u32) -> Self {
        SendQueue {
            name: name.into(),
            depth,
            outstanding: 0,
            tail: 0,
            signaled: VecDeque::new(),
        }
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Free slots.
    pub fn available(&self) -> u32 {
        self.depth - self.outstanding
    }

    /// Slots held by posted WRs.
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }

    /// Signaled WRs awaiting their completion.
    pub fn awaiting(&self) -> usize {
        self.signaled.len()
    }

    /// Accounts a chain about to be posted: `(wr_id, signaled)` per WR, in chain order. Refused
    /// whole, changing nothing, when it would overrun the queue or leave a run of unsignaled
    /// WRs as long as the queue (no completion could ever release them).
    pub fn post(&mut self, chain: &[(u64, bool)]) -> Result<()> {
        let n = chain.len() as u64;
        if u64::from(self.outstanding) + n > u64::from(self.depth) {
            return Err(Error::CreditOverrun {
                qp: self.name.clone(),
                field: "outstanding + chain",
                value: u64::from(self.outstanding) + n,
                depth: self.depth,
            });
        }
        let trailing = chain.iter().rev().take_while(|(_, s)| !s).count() as u64;
        let new_tail = if chain.iter().any(|(_, s)| *s) {
            trailing
        } else {
            u64::from(self.tail) + n
        };
        if new_tail >= u64::from(self.depth) {
            return Err(Error::CreditOverrun {
                qp: self.name.clone(),
                field: "unsignaled run",
                value: new_tail,
                depth: self.depth,
            });
        }
        let mut run = self.tail;
        for &(wr_id, signaled) in chain {
            run += 1;
            if signaled {
                self.signaled.push_back((wr_id, run));
                run = 0;
            }
        }
        self.tail = run;
        self.outstanding += n as u32;
        Ok(())
    }

    /// The completion of signaled WR `wr_id` (success or error): releases it, every signaled
    /// WR before it, and the unsignaled WRs they cover. Returns the slots freed.
    pub fn complete(&mut self, wr_id: u64) -> Result<u32> {
        let Some(pos) = self.signaled.iter().position(|(id, _)| *id == wr_id) else {
            return Err(Error::Verbs {
                call: "ibv_poll_cq",
                device: self.name.clone(),
                reason: format!(
                    "completion for wr_id {wr_id:#x}, which is not a signaled WR in flight"
                ),
            });
        };
        let freed: u32 = self.signaled.drain(..=pos).map(|(_, n)| n).sum();
        self.outstanding -= freed;
        Ok(freed)
    }

    /// The QP went to the error state or was rebuilt: every posted WR is gone. Returns how
    /// many slots that frees.
    pub fn reset(&mut self) -> u32 {
        let freed = self.outstanding;
        self.outstanding = 0;
        self.tail = 0;
        self.signaled.clear();
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ids: std::ops::Range<u64>, every: u64) -> Vec<(u64, bool)> {
        ids.map(|i| (i, (i + 1) % every == 0)).collect()
    }

    #[test]
    fn a_signaled_completion_releases_the_unsignaled_wrs_before_it() {
        let mut q = SendQueue::new("mlx5_0 qp 7", 16);
        q.post(&chain(0..8, 4)).unwrap(); // signaled: 3, 7
        assert_eq!((q.outstanding(), q.available(), q.awaiting()), (8, 8, 2));
        assert_eq!(q.complete(3).unwrap(), 4);
        assert_eq!(q.outstanding(), 4);
        assert_eq!(q.complete(7).unwrap(), 4);
        assert_eq!((q.outstanding(), q.available()), (0, 16));
    }

    #[test]
    fn an_unsignaled_tail_is_released_by_the_next_chains_signal() {
        let mut q = SendQueue::new("q", 16);
        q.post(&[(0, false), (1, true), (2, false), (3, false)])
            .unwrap();
        q.post(&[(4, false), (5, true)]).unwrap();
        assert_eq!(q.outstanding(), 6);
        assert_eq!(q.complete(1).unwrap(), 2);
        assert_eq!(
            q.complete(5).unwrap(),
            4,
            "2 and 3 from the first chain, 4 and 5"
        );
        assert_eq!(q.outstanding(), 0);
    }

    #[test]
    fn a_later_completion_implies_the_earlier_ones() {
        let mut q = SendQueue::new("q", 32);
        q.post(&chain(0..12, 4)).unwrap();
        assert_eq!(q.complete(11).unwrap(), 12);
        assert_eq!(q.awaiting(), 0);
        let err = q.complete(3).unwrap_err();
        assert!(err.to_string().contains("0x3"), "{err}");
    }

    #[test]
    fn the_queue_is_never_overrun() {
        let mut q = SendQueue::new("mlx5_1 qp 9", 8);
        q.post(&chain(0..8, 4)).unwrap();
        assert_eq!(q.available(), 0);
        let err = q.post(&[(8, true)]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("mlx5_1 qp 9") && msg.contains("9") && msg.contains("depth 8"),
            "{msg}"
        );
        assert_eq!(q.outstanding(), 8, "a refused chain changes nothing");
        q.complete(3).unwrap();
        q.post(&chain(8..12, 4)).unwrap();
        assert_eq!(q.available(), 0);
    }

    #[test]
    fn an_unsignaled_run_as_long_as_the_queue_is_refused() {
        let mut q = SendQueue::new("q", 4);
        q.post(&[(0, false), (1, false)]).unwrap();
        let err = q.post(&[(2, false), (3, false)]).unwrap_err();
        assert!(err.to_string().contains("unsignaled run"), "{err}");
        q.post(&[(2, false), (3, true)]).unwrap();
        assert_eq!(q.complete(3).unwrap(), 4);
    }

    #[test]
    fn reset_frees_everything() {
        let mut q = SendQueue::new("q", 16);
        q.post(&chain(0..10, 4)).unwrap();
        assert_eq!(q.reset(), 10);
        assert_eq!((q.outstanding(), q.awaiting()), (0, 0));
        q.post(&[(0, true)]).unwrap();
        assert_eq!(q.complete(0).unwrap(), 1);
    }

    #[test]
    fn a_plan_posted_under_credits_never_deadlocks() {
        // Drive a real plan through a small queue: post what credits allow, complete the
        // oldest signaled WR, repeat; everything must get through.
        use crate::op::{BlockOp, Coalesced};
        use crate::rdma::plan::{PlanConfig, lanes, plan};
        use crate::region::RegionId;
        let ops = [Coalesced {
            op: BlockOp {
                local_region: RegionId(1),
                local_offset: 0,
                remote_region: RegionId(2),
                remote_offset: 0,
                len: 1000,
            },
            first_index: 0,
        }];
        for (depth, every, per_post) in [(8, 8, 3), (8, 3, 8), (5, 5, 1), (16, 1, 16)] {
            let cfg = PlanConfig {
                slice_bytes: 7,
                signal_every: every,
                max_wrs_per_post: per_post,
            };
            cfg.validate(depth).unwrap();
            let p = plan(&ops, &lanes(1, 1), &cfg).unwrap();
            let lp = &p.lanes[0];
            let mut q = SendQueue::new("q", depth);
            let mut next = 0;
            let mut in_flight = std::collections::VecDeque::new();
            let mut rounds = 0;
            while next < lp.wrs.len() || q.outstanding() > 0 {
                rounds += 1;
                assert!(
                    rounds < 10_000,
                    "stuck at {next} (depth {depth}, every {every})"
                );
                let r = lp.next_chain(next, q.available(), cfg.max_wrs_per_post);
                if !r.is_empty() {
                    let c: Vec<(u64, bool)> =
                        r.clone().map(|i| (i as u64, lp.wrs[i].signaled)).collect();
                    q.post(&c).unwrap();
                    in_flight.extend(c.iter().filter(|(_, s)| *s).map(|(id, _)| *id));
                    next = r.end;
                } else {
                    let id = in_flight.pop_front().expect("something to complete");
                    q.complete(id).unwrap();
                }
            }
        }
    }
}
