//! How a batch becomes work requests: each (coalesced) op is cut into slices of at most
//! `slice_bytes`, slices are striped over lanes (one lane = one RC QP on one NIC) so every lane
//! carries about the same number of bytes, and each lane's slices form a chain of WRs in which
//! only every `signal_every`-th WR (and the lane's last) asks for a completion. Chains are
//! posted `max_wrs_per_post` at a time, never more than the send queue has credits for.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::op::Coalesced;
use crate::region::RegionId;

/// The largest message one RDMA READ or WRITE may carry (2^31 bytes, the IB limit).
pub const MAX_MESSAGE: u64 = 1 << 31;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanConfig {
    /// Bytes per slice (per WR). Smaller slices spread a large op over more lanes; larger ones
    /// cost fewer WRs. Default 256 KiB.
    pub slice_bytes: u64,
    /// Request a completion every this many WRs per QP. Default 16.
    pub signal_every: u32,
    /// WRs chained into one `ibv_post_send`. Default 32.
    pub max_wrs_per_post: u32,
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            slice_bytes: 256 << 10,
            signal_every: 16,
            max_wrs_per_post: 32,
        }
    }
}

impl PlanConfig {
    /// Checks the settings against a send queue of `sq_depth` WRs. `signal_every` above the
    /// depth could fill the queue with WRs no completion ever releases.
    pub fn validate(&self, sq_depth: u32) -> Result<()> {
        let bad = |field: &'static str, value: u64, reason: &'static str| {
            Err(Error::InvalidConfig {
                field,
                value: value.to_string(),
                reason,
            })
        };
        if self.slice_bytes == 0 || self.slice_bytes > MAX_MESSAGE {
            return bad(
                "rdma_slice_bytes",
                self.slice_bytes,
                "must be from 1 to 2^31 (the largest RDMA message)",
            );
        }
        if self.signal_every == 0 || self.signal_every > sq_depth {
            return bad(
                "rdma_signal_every",
                self.signal_every.into(),
                "must be from 1 to the send queue depth",
            );
        }
        if self.max_wrs_per_post == 0 || self.max_wrs_per_post > sq_depth {
            return bad(
                "rdma_max_wrs_per_post",
                self.max_wrs_per_post.into(),
                "must be from 1 to the send queue depth",
            );
        }
        Ok(())
    }
}

/// One QP on one NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Lane {
    pub nic: usize,
    pub qp: usize,
}

/// The lanes of `nics` NICs with `qps_per_nic` QPs each, NICs interleaved (nic0/qp0,
/// nic1/qp0, nic0/qp1, ...) so consecutive slices land on different NICs.
pub fn lanes(nics: usize, qps_per_nic: usize) -> Vec<Lane> {
    (0..qps_per_nic)
        .flat_map(|qp| (0..nics).map(move |nic| Lane { nic, qp }))
        .collect()
}

/// A piece of one op that one WR moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Slice {
    /// Index of the op in the batch as submitted (the coalesced op's first index).
    pub op: usize,
    pub local_region: RegionId,
    pub local_offset: u64,
    pub remote_region: RegionId,
    pub remote_offset: u64,
    pub len: u64,
}

/// Cuts `ops` into slices of at most `slice_bytes`, in order. Every op's ends must fit in 64
/// bits (as bounds-checked ops do; [`plan`] checks it).
fn slices(ops: &[Coalesced], slice_bytes: u64) -> impl Iterator<Item = Slice> + '_ {
    let step = slice_bytes.max(1);
    ops.iter().flat_map(move |c| {
        let o = c.op;
        (0..o.len.div_ceil(step)).map(move |k| {
            // k * step < len, and offset + len fits (checked by `plan`).
            let at = k * step;
            Slice {
                op: c.first_index,
                local_region: o.local_region,
                local_offset: o.local_offset + at,
                remote_region: o.remote_region,
                remote_offset: o.remote_offset + at,
                len: step.min(o.len - at),
            }
        })
    })
}

/// Refuses what `slices` and the lane sums cannot carry: an op whose end passes 2^64, or ops
/// whose lengths add up past it.
fn check_sums(ops: &[Coalesced]) -> Result<u64> {
    let mut total = 0u64;
    for c in ops {
        let o = &c.op;
        for (field, offset) in [
            ("local_offset", o.local_offset),
            ("remote_offset", o.remote_offset),
        ] {
            if offset.checked_add(o.len).is_none() {
                return Err(Error::RangeOverflow {
                    op: c.first_index,
                    field,
                    offset,
                    len: o.len,
                });
            }
        }
        total = total.checked_add(o.len).ok_or(Error::BatchTooLarge {
            field: "bytes",
            value: u64::MAX,
            limit: u64::MAX,
        })?;
    }
    Ok(total)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Wr {
    pub slice: Slice,
    pub signaled: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LanePlan {
    pub lane: Lane,
    pub wrs: Vec<Wr>,
    pub bytes: u64,
}

impl LanePlan {
    /// The next chain to post from WR `next` on, given `credits` free send-queue slots: at most
    /// `max_per_post` WRs, never more than the credits. Empty when nothing can be posted.
    pub fn next_chain(&self, next: usize, credits: u32, max_per_post: u32) -> Range<usize> {
        let n = (credits.min(max_per_post) as usize).min(self.wrs.len().saturating_sub(next));
        next..next + n
    }

    pub fn signaled(&self) -> usize {
        self.wrs.iter().filter(|w| w.signaled).count()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// One entry per lane that got work, in lane order.
    pub lanes: Vec<LanePlan>,
    pub bytes: u64,
    pub wrs: usize,
}

/// Slices `ops` and stripes them over `lanes`: each slice goes to the lane with the fewest
/// bytes so far (lane order breaks ties), so equal slices go round robin and a short last
/// slice evens the load out.
pub fn plan(ops: &[Coalesced], lanes: &[Lane], cfg: &PlanConfig) -> Result<Plan> {
    if lanes.is_empty() {
        return Err(Error::InvalidConfig {
            field: "rdma lanes",
            value: "0".into(),
            reason: "a plan needs at least one QP",
        });
    }
    if ops.is_empty() {
        return Err(Error::EmptyBatch);
    }
    if let Some(c) = ops.iter().find(|c| c.op.len == 0) {
        return Err(Error::ZeroLength { op: c.first_index });
    }
    // Every sum below (lane loads, bytes) is at most this total.
    check_sums(ops)?;
    let mut per_lane: Vec<LanePlan> = lanes
        .iter()
        .map(|&lane| LanePlan {
            lane,
            wrs: Vec::new(),
            bytes: 0,
        })
        .collect();
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> =
        (0..lanes.len()).map(|i| Reverse((0, i))).collect();
    let mut bytes = 0;
    let mut wrs = 0;
    for s in slices(ops, cfg.slice_bytes) {
        let Reverse((load, i)) = heap.pop().expect("one entry per lane");
        let lp = &mut per_lane[i];
        lp.wrs.push(Wr {
            slice: s,
            signaled: false,
        });
        lp.bytes += s.len;
        bytes += s.len;
        wrs += 1;
        heap.push(Reverse((load + s.len, i)));
    }
    let every = cfg.signal_every.max(1) as usize;
    for lp in &mut per_lane {
        let n = lp.wrs.len();
        for (k, w) in lp.wrs.iter_mut().enumerate() {
            w.signaled = (k + 1) % every == 0 || k + 1 == n;
        }
    }
    per_lane.retain(|lp| !lp.wrs.is_empty());
    Ok(Plan {
        lanes: per_lane,
        bytes,
        wrs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::BlockOp;

    fn op(first_index: usize, local: u64, remote: u64, len: u64) -> Coalesced {
        Coalesced {
            op: BlockOp {
                local_region: RegionId(1),
                local_offset: local,
                remote_region: RegionId(2),
                remote_offset: remote,
                len,
            },
            first_index,
        }
    }

    fn cfg(slice: u64, every: u32) -> PlanConfig {
        PlanConfig {
            slice_bytes: slice,
            signal_every: every,
            max_wrs_per_post: 32,
        }
    }

    #[test]
    fn slices_cover_each_op_exactly_with_a_short_tail() {
        let ops = [op(0, 100, 5000, 10), op(3, 0, 0, 4)];
        let s: Vec<Slice> = slices(&ops, 4).collect();
        let parts: Vec<(usize, u64, u64, u64)> = s
            .iter()
            .map(|s| (s.op, s.local_offset, s.remote_offset, s.len))
            .collect();
        assert_eq!(
            parts,
            [
                (0, 100, 5000, 4),
                (0, 104, 5004, 4),
                (0, 108, 5008, 2),
                (3, 0, 0, 4)
            ]
        );
        assert_eq!(slices(&ops, 1 << 20).count(), 2);
    }

    #[test]
    fn ops_ending_past_2_64_or_summing_past_it_are_refused() {
        let l = lanes(1, 2);
        let err = plan(&[op(4, u64::MAX - 2, 0, 8)], &l, &cfg(4, 1)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RangeOverflow {
                    op: 4,
                    field: "local_offset",
                    ..
                }
            ),
            "{err}"
        );
        let err = plan(&[op(0, 0, u64::MAX, 1)], &l, &cfg(4, 1)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RangeOverflow {
                    field: "remote_offset",
                    ..
                }
            ),
            "{err}"
        );
        let half = u64::MAX / 2 + 1;
        let err = plan(
            &[op(0, 0, 0, half), op(1, 0, 0, half)],
            &l,
            &cfg(MAX_MESSAGE, 1),
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::BatchTooLarge { field: "bytes", .. }),
            "{err}"
        );
    }

    #[test]
    fn lanes_interleave_nics() {
        let l = lanes(2, 2);
        let pairs: Vec<(usize, usize)> = l.iter().map(|l| (l.nic, l.qp)).collect();
        assert_eq!(pairs, [(0, 0), (1, 0), (0, 1), (1, 1)]);
        assert!(lanes(0, 4).is_empty());
    }

    #[test]
    fn stripes_balance_bytes_over_lanes_and_nics() {
        // 10 MiB in 1 MiB slices over 2 NICs x 2 QPs.
        let ops = [op(0, 0, 0, 10 << 20)];
        let l = lanes(2, 2);
        let p = plan(&ops, &l, &cfg(1 << 20, 2)).unwrap();
        assert_eq!(p.wrs, 10);
        assert_eq!(p.bytes, 10 << 20);
        let per: Vec<usize> = p.lanes.iter().map(|lp| lp.wrs.len()).collect();
        assert_eq!(per, [3, 3, 2, 2]);
        // Consecutive slices go to different NICs.
        assert_eq!(p.lanes[0].wrs[0].slice.local_offset, 0);
        assert_eq!(p.lanes[1].wrs[0].slice.local_offset, 1 << 20);
        assert_eq!(p.lanes[1].lane.nic, 1);
        let nic_bytes = |nic| -> u64 {
            p.lanes
                .iter()
                .filter(|lp| lp.lane.nic == nic)
                .map(|lp| lp.bytes)
                .sum()
        };
        assert_eq!(nic_bytes(0), 5 << 20);
        assert_eq!(nic_bytes(1), 5 << 20);
        // Every byte is planned exactly once.
        let mut covered: Vec<(u64, u64)> = p
            .lanes
            .iter()
            .flat_map(|lp| lp.wrs.iter().map(|w| (w.slice.local_offset, w.slice.len)))
            .collect();
        covered.sort();
        let mut at = 0;
        for (off, len) in covered {
            assert_eq!(off, at);
            at += len;
        }
        assert_eq!(at, 10 << 20);
    }

    #[test]
    fn uneven_ops_are_balanced_by_bytes_not_count() {
        let ops = [
            op(0, 0, 0, 8),
            op(1, 100, 100, 1),
            op(2, 200, 200, 1),
            op(3, 300, 300, 1),
        ];
        let p = plan(&ops, &lanes(1, 2), &cfg(8, 4)).unwrap();
        assert_eq!(p.lanes[0].bytes, 8);
        assert_eq!(p.lanes[1].bytes, 3, "the small ops all go to the idle lane");
    }

    #[test]
    fn every_nth_and_the_last_wr_of_each_lane_are_signaled() {
        let ops = [op(0, 0, 0, 10)];
        let p = plan(&ops, &lanes(1, 1), &cfg(1, 4)).unwrap();
        let flags: Vec<bool> = p.lanes[0].wrs.iter().map(|w| w.signaled).collect();
        assert_eq!(
            flags,
            [
                false, false, false, true, false, false, false, true, false, true
            ]
        );
        assert_eq!(p.lanes[0].signaled(), 3);
        // signal_every 1: every WR.
        let p = plan(&ops, &lanes(1, 1), &cfg(1, 1)).unwrap();
        assert!(p.lanes[0].wrs.iter().all(|w| w.signaled));
        // Lanes that got nothing are left out; a single WR is signaled.
        let p = plan(&[op(0, 0, 0, 1)], &lanes(2, 2), &cfg(8, 16)).unwrap();
        assert_eq!(p.lanes.len(), 1);
        assert!(p.lanes[0].wrs[0].signaled);
    }

    #[test]
    fn chains_respect_credits_and_the_post_limit() {
        let p = plan(&[op(0, 0, 0, 100)], &lanes(1, 1), &cfg(1, 16)).unwrap();
        let lp = &p.lanes[0];
        assert_eq!(lp.next_chain(0, 64, 32), 0..32);
        assert_eq!(lp.next_chain(32, 5, 32), 32..37);
        assert_eq!(lp.next_chain(90, 64, 32), 90..100);
        assert_eq!(lp.next_chain(100, 64, 32), 100..100);
        assert_eq!(lp.next_chain(10, 0, 32), 10..10);
    }

    #[test]
    fn bad_settings_and_inputs_are_typed_errors() {
        let ok = PlanConfig::default();
        ok.validate(128).unwrap();
        let err = PlanConfig {
            slice_bytes: 0,
            ..ok
        }
        .validate(128)
        .unwrap_err();
        assert!(err.to_string().contains("rdma_slice_bytes"), "{err}");
        let err = PlanConfig {
            slice_bytes: MAX_MESSAGE + 1,
            ..ok
        }
        .validate(128)
        .unwrap_err();
        assert!(err.to_string().contains("2147483649"), "{err}");
        let err = PlanConfig {
            signal_every: 256,
            ..ok
        }
        .validate(128)
        .unwrap_err();
        assert!(err.to_string().contains("rdma_signal_every"), "{err}");
        let err = PlanConfig {
            max_wrs_per_post: 0,
            ..ok
        }
        .validate(128)
        .unwrap_err();
        assert!(err.to_string().contains("rdma_max_wrs_per_post"), "{err}");
        assert!(matches!(
            plan(&[], &lanes(1, 1), &ok),
            Err(Error::EmptyBatch)
        ));
        assert!(plan(&[op(0, 0, 0, 1)], &[], &ok).is_err());
        assert!(matches!(
            plan(&[op(7, 0, 0, 0)], &lanes(1, 1), &ok),
            Err(Error::ZeroLength { op: 7 })
        ));
    }
}
