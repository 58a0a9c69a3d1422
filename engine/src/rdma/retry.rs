//! What to do when a work completion fails. Any error completion moves an RC QP to the error
//! state (every WR behind it is flushed), so whatever is retried goes over a rebuilt QP. The
//! policy:
//!
//! - transient (the peer did not answer in time: retry/RNR retries exceeded, response timeout):
//!   rebuild the QP and retry the slice, a bounded number of times per slice;
//! - QP-fatal (the QP or the device misbehaved: bad response, remote operation error, fatal
//!   error...): rebuild the QP and retry; too many rebuilds in a row for one peer and RDMA to
//!   that peer is given up;
//! - op-fatal (the request itself is wrong: protection, access, length errors): retrying cannot
//!   help, the batch fails with the status named;
//! - flushed: collateral of an earlier error; retried with it, costing no budget.
//!
//! Giving RDMA up for a peer means falling back to tcp, with a reason that says why; it is
//! logged at warn level and carried in the transport selection, never silent.

use serde::Serialize;

/// `enum ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum WcStatus {
    Success,
    LocLenErr,
    LocQpOpErr,
    LocEecOpErr,
    LocProtErr,
    WrFlushErr,
    MwBindErr,
    BadRespErr,
    LocAccessErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
    LocRddViolErr,
    RemInvRdReqErr,
    RemAbortErr,
    InvEecnErr,
    InvEecStateErr,
    FatalErr,
    RespTimeoutErr,
    GeneralErr,
    TmErr,
    TmRndvIncomplete,
    Other(u32),
}

const BY_CODE: [(WcStatus, &str); 24] = [
    (WcStatus::Success, "IBV_WC_SUCCESS"),
    (WcStatus::LocLenErr, "IBV_WC_LOC_LEN_ERR"),
    (WcStatus::LocQpOpErr, "IBV_WC_LOC_QP_OP_ERR"),
    (WcStatus::LocEecOpErr, "IBV_WC_LOC_EEC_OP_ERR"),
    (WcStatus::LocProtErr, "IBV_WC_LOC_PROT_ERR"),
    (WcStatus::WrFlushErr, "IBV_WC_WR_FLUSH_ERR"),
    (WcStatus::MwBindErr, "IBV_WC_MW_BIND_ERR"),
    (WcStatus::BadRespErr, "IBV_WC_BAD_RESP_ERR"),
    (WcStatus::LocAccessErr, "IBV_WC_LOC_ACCESS_ERR"),
    (WcStatus::RemInvReqErr, "IBV_WC_REM_INV_REQ_ERR"),
    (WcStatus::RemAccessErr, "IBV_WC_REM_ACCESS_ERR"),
    (WcStatus::RemOpErr, "IBV_WC_REM_OP_ERR"),
    (WcStatus::RetryExcErr, "IBV_WC_RETRY_EXC_ERR"),
    (WcStatus::RnrRetryExcErr, "IBV_WC_RNR_RETRY_EXC_ERR"),
    (WcStatus::LocRddViolErr, "IBV_WC_LOC_RDD_VIOL_ERR"),
    (WcStatus::RemInvRdReqErr, "IBV_WC_REM_INV_RD_REQ_ERR"),
    (WcStatus::RemAbortErr, "IBV_WC_REM_ABORT_ERR"),
    (WcStatus::InvEecnErr, "IBV_WC_INV_EECN_ERR"),
    (WcStatus::InvEecStateErr, "IBV_WC_INV_EEC_STATE_ERR"),
    (WcStatus::FatalErr, "IBV_WC_FATAL_ERR"),
    (WcStatus::RespTimeoutErr, "IBV_WC_RESP_TIMEOUT_ERR"),
    (WcStatus::GeneralErr, "IBV_WC_GENERAL_ERR"),
    (WcStatus::TmErr, "IBV_WC_TM_ERR"),
    (WcStatus::TmRndvIncomplete, "IBV_WC_TM_RNDV_INCOMPLETE"),
];

impl WcStatus {
    pub fn from_code(code: u32) -> WcStatus {
        BY_CODE
            .get(code as usize)
            .map(|(s, _)| *s)
            .unwrap_or(WcStatus::Other(code))
    }

    pub fn code(self) -> u32 {
        match self {
            WcStatus::Other(c) => c,
            s => BY_CODE
                .iter()
                .position(|(x, _)| *x == s)
                .expect("every named status is in the table") as u32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WcStatus::Other(_) => "unknown status",
            s => BY_CODE[s.code() as usize].1,
        }
    }

    pub fn class(self) -> Class {
        use WcStatus::*;
        match self {
            Success => Class::Success,
            WrFlushErr => Class::Flushed,
            RetryExcErr | RnrRetryExcErr | RespTimeoutErr => Class::Transient,
            LocLenErr | LocProtErr | LocAccessErr | RemInvReqErr | RemAccessErr | MwBindErr => {
                Class::OpFatal
            }
            _ => Class::QpFatal,
        }
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.code())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Class {
    Success,
    Flushed,
    Transient,
    QpFatal,
    OpFatal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RetryPolicy {
    /// Retries of one slice after transient errors. Default 3.
    pub slice_retries: u32,
    /// QP rebuilds in a row (no success between) before RDMA to the peer is given up.
    /// Default 3.
    pub rebuilds_before_fallback: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            slice_retries: 3,
            rebuilds_before_fallback: 3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Decision {
    /// The slice is done.
    Done,
    /// Rebuild the QP (it is in the error state) and post the slice again.
    Retry {
        /// Whether this attempt counts against the slice's retries (flushes do not).
        charged: bool,
    },
    /// The batch fails; the QP still has to be rebuilt before its next use.
    FailBatch { reason: String },
    /// Give RDMA up for this peer and use tcp; the reason is for logs and the selection.
    FallbackTcp { reason: String },
}

/// The failure history of RDMA to one peer.
#[derive(Debug, Clone)]
pub struct PeerHealth {
    peer: String,
    policy: RetryPolicy,
    rebuilds_in_a_row: u32,
    fallback: Option<String>,
}

impl PeerHealth {
    pub fn new(peer: impl Into<String>, policy: RetryPolicy) -> Self {
        PeerHealth {
            peer: peer.into(),
            policy,
            rebuilds_in_a_row: 0,
            fallback: None,
        }
    }

    /// Why RDMA was given up for this peer, once it has been.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    fn give_up(&mut self, why: String) -> Decision {
        let reason = format!("rdma to {} failed: {why}; falling back to tcp", self.peer);
        tracing::warn!(peer = %self.peer, %reason, "rdma fallback");
        self.fallback = Some(reason.clone());
        Decision::FallbackTcp { reason }
    }

    /// A completion for a slice that has already been retried `retries` times.
    pub fn on_completion(&mut self, status: WcStatus, vendor_err: u32, retries: u32) -> Decision {
        if let Some(r) = &self.fallback {
            return Decision::FallbackTcp { reason: r.clone() };
        }
        let what = || format!("{status}, vendor error {vendor_err:#x}");
        match status.class() {
            Class::Success => {
                self.rebuilds_in_a_row = 0;
                Decision::Done
            }
            Class::Flushed => Decision::Retry { charged: false },
            Class::OpFatal => Decision::FailBatch {
                reason: format!("{} (the request was refused; retrying cannot help)", what()),
            },
            Class::Transient if retries >= self.policy.slice_retries => self.give_up(format!(
                "a slice failed {} times, last with {}",
                retries + 1,
                what()
            )),
            Class::Transient | Class::QpFatal => {
                self.rebuilds_in_a_row += 1;
                if self.rebuilds_in_a_row > self.policy.rebuilds_before_fallback {
                    self.give_up(format!(
                        "{} QP rebuilds in a row, last after {}",
                        self.rebuilds_in_a_row - 1,
                        what()
                    ))
                } else {
                    Decision::Retry { charged: true }
                }
            }
        }
    }

    /// Setting the connection up failed (handshake, QP creation, RTR/RTS): counts as a rebuild.
    pub fn on_connect_error(&mut self, error: &str) -> Decision {
        if let Some(r) = &self.fallback {
            return Decision::FallbackTcp { reason: r.clone() };
        }
        self.rebuilds_in_a_row += 1;
        if self.rebuilds_in_a_row > self.policy.rebuilds_before_fallback {
            self.give_up(format!(
                "connecting failed {} times in a row, last: {error}",
                self.rebuilds_in_a_row
            ))
        } else {
            Decision::Retry { charged: true }
        }
    }

    /// Whether a QP in the error state should be rebuilt now (or RDMA is given up).
    pub fn may_rebuild(&self) -> bool {
        self.fallback.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_map_both_ways_with_names() {
        for code in 0..24 {
            assert_eq!(WcStatus::from_code(code).code(), code);
        }
        assert_eq!(WcStatus::from_code(12), WcStatus::RetryExcErr);
        assert_eq!(
            WcStatus::RetryExcErr.to_string(),
            "IBV_WC_RETRY_EXC_ERR (12)"
        );
        assert_eq!(WcStatus::from_code(99), WcStatus::Other(99));
        assert_eq!(WcStatus::Other(99).to_string(), "unknown status (99)");
        assert_eq!(WcStatus::from_code(10).name(), "IBV_WC_REM_ACCESS_ERR");
    }

    #[test]
    fn statuses_are_classified() {
        use WcStatus::*;
        assert_eq!(Success.class(), Class::Success);
        assert_eq!(WrFlushErr.class(), Class::Flushed);
        for s in [RetryExcErr, RnrRetryExcErr, RespTimeoutErr] {
            assert_eq!(s.class(), Class::Transient, "{s}");
        }
        for s in [
            RemAccessErr,
            LocProtErr,
            LocLenErr,
            RemInvReqErr,
            LocAccessErr,
        ] {
            assert_eq!(s.class(), Class::OpFatal, "{s}");
        }
        for s in [
            BadRespErr,
            RemOpErr,
            FatalErr,
            GeneralErr,
            LocQpOpErr,
            Other(77),
        ] {
            assert_eq!(s.class(), Class::QpFatal, "{s}");
        }
    }

    #[test]
    fn transient_errors_are_retried_within_the_slice_budget_then_fall_back() {
        let mut h = PeerHealth::new(
            "decode-0",
            RetryPolicy {
                slice_retries: 2,
                rebuilds_before_fallback: 10,
            },
        );
        assert_eq!(
            h.on_completion(WcStatus::RetryExcErr, 0, 0),
            Decision::Retry { charged: true }
        );
        assert_eq!(
            h.on_completion(WcStatus::RetryExcErr, 0, 1),
            Decision::Retry { charged: true }
        );
        let Decision::FallbackTcp { reason } = h.on_completion(WcStatus::RetryExcErr, 0x81, 2)
        else {
            panic!("expected a fallback")
        };
        assert!(
            reason.contains("decode-0") && reason.contains("3 times"),
            "{reason}"
        );
        assert!(
            reason.contains("IBV_WC_RETRY_EXC_ERR (12)") && reason.contains("0x81"),
            "{reason}"
        );
        assert!(reason.contains("tcp"), "{reason}");
        assert_eq!(h.fallback(), Some(reason.as_str()));
        assert!(!h.may_rebuild());
        // Once given up, everything answers the same.
        assert!(matches!(
            h.on_completion(WcStatus::Success, 0, 0),
            Decision::FallbackTcp { .. }
        ));
    }

    #[test]
    fn flushes_cost_nothing_and_successes_reset_the_rebuild_count() {
        let mut h = PeerHealth::new(
            "p",
            RetryPolicy {
                slice_retries: 5,
                rebuilds_before_fallback: 2,
            },
        );
        for _ in 0..10 {
            assert_eq!(
                h.on_completion(WcStatus::WrFlushErr, 0, 0),
                Decision::Retry { charged: false }
            );
        }
        assert_eq!(
            h.on_completion(WcStatus::RemOpErr, 0, 0),
            Decision::Retry { charged: true }
        );
        assert_eq!(
            h.on_completion(WcStatus::BadRespErr, 0, 0),
            Decision::Retry { charged: true }
        );
        assert_eq!(h.on_completion(WcStatus::Success, 0, 0), Decision::Done);
        assert_eq!(
            h.on_completion(WcStatus::FatalErr, 0, 0),
            Decision::Retry { charged: true }
        );
        assert_eq!(
            h.on_completion(WcStatus::FatalErr, 0, 0),
            Decision::Retry { charged: true }
        );
        let d = h.on_completion(WcStatus::FatalErr, 0, 0);
        let Decision::FallbackTcp { reason } = d else {
            panic!("{d:?}")
        };
        assert!(
            reason.contains("2 QP rebuilds in a row") && reason.contains("IBV_WC_FATAL_ERR"),
            "{reason}"
        );
    }

    #[test]
    fn refused_requests_fail_the_batch_without_falling_back() {
        let mut h = PeerHealth::new("p", RetryPolicy::default());
        let d = h.on_completion(WcStatus::RemAccessErr, 0, 0);
        let Decision::FailBatch { reason } = d else {
            panic!("{d:?}")
        };
        assert!(reason.contains("IBV_WC_REM_ACCESS_ERR (10)"), "{reason}");
        assert!(h.may_rebuild() && h.fallback().is_none());
    }

    #[test]
    fn repeated_connect_failures_fall_back_with_the_last_error() {
        let mut h = PeerHealth::new(
            "prefill-3",
            RetryPolicy {
                slice_retries: 3,
                rebuilds_before_fallback: 1,
            },
        );
        assert_eq!(
            h.on_connect_error("RTR: EINVAL"),
            Decision::Retry { charged: true }
        );
        let d = h.on_connect_error("RTR: ETIMEDOUT");
        let Decision::FallbackTcp { reason } = d else {
            panic!("{d:?}")
        };
        assert!(
            reason.contains("prefill-3")
                && reason.contains("2 times")
                && reason.contains("ETIMEDOUT"),
            "{reason}"
        );
    }
}
