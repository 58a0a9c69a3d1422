//! Both sides of the connection exchange, apart from the verbs calls.
//!
//! - The target keeps the QPs it accepted by (peer, session): a session is one link of the
//!   initiator, which keeps its id over rebuilds, so an offer for a known session replaces that
//!   session's QPs (the initiator reset its own), and a peer holds only a few sessions (the
//!   oldest is closed when a new one would exceed the bound).
//! - The initiator's link goes `Ready` → `Rebuilding` (one rebuild at a time) → `Ready`, or
//!   `FallenBack` once the retry policy gives RDMA to the peer up; from there it stays.
//! - The target's NIC for each offered QP: the offer's NICs in order, each mapped to one of
//!   ours round robin, preferring a NIC of the same link layer.

use std::collections::{HashMap, VecDeque};

use super::handshake::ConnectInfo;
use super::retry::{Decision, PeerHealth};
use super::sysfs::LinkLayer;

/// Sessions kept per peer name.
pub const MAX_SESSIONS_PER_PEER: usize = 8;

#[derive(Debug)]
pub struct Sessions<S> {
    per_peer: HashMap<String, VecDeque<(u64, S)>>,
    max_per_peer: usize,
}

impl<S> Default for Sessions<S> {
    fn default() -> Self {
        Sessions::with_limit(MAX_SESSIONS_PER_PEER)
    }
}

impl<S> Sessions<S> {
    pub fn with_limit(max_per_peer: usize) -> Self {
        Sessions {
            per_peer: HashMap::new(),
            max_per_peer: max_per_peer.max(1),
        }
    }

    /// Keeps `state` for (peer, session). Returns what it displaced: the session's earlier
    /// state, or the peer's oldest session when the bound is reached (drop them outside locks).
    pub fn accept(&mut self, peer: &str, session: u64, state: S) -> Vec<(u64, S)> {
        let list = self.per_peer.entry(peer.to_string()).or_default();
        let mut gone = Vec::new();
        if let Some(i) = list.iter().position(|(s, _)| *s == session) {
            gone.extend(list.remove(i));
        }
        while list.len() >= self.max_per_peer {
            gone.extend(list.pop_front());
        }
        list.push_back((session, state));
        gone
    }

    pub fn release(&mut self, peer: &str, session: u64) -> Option<S> {
        let list = self.per_peer.get_mut(peer)?;
        let i = list.iter().position(|(s, _)| *s == session)?;
        let (_, state) = list.remove(i)?;
        if list.is_empty() {
            self.per_peer.remove(peer);
        }
        Some(state)
    }

    pub fn get(&self, peer: &str, session: u64) -> Option<&S> {
        self.per_peer
            .get(peer)?
            .iter()
            .find(|(s, _)| *s == session)
            .map(|(_, st)| st)
    }

    pub fn len(&self) -> usize {
        self.per_peer.values().map(VecDeque::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// For each offered QP, the index (into `ours`) of the NIC that answers it.
pub fn answer_nics(offer: &ConnectInfo, ours: &[LinkLayer]) -> Vec<usize> {
    if ours.is_empty() {
        return Vec::new();
    }
    let mut next_of: HashMap<String, usize> = HashMap::new();
    let mut chosen: HashMap<&str, usize> = HashMap::new();
    offer
        .qps
        .iter()
        .map(|q| {
            if let Some(&i) = chosen.get(q.nic.as_str()) {
                return i;
            }
            // Round robin among our NICs of the same link layer (all of ours if none match).
            let same: Vec<usize> = (0..ours.len())
                .filter(|&i| ours[i] == q.link_layer)
                .collect();
            let pool: Vec<usize> = if same.is_empty() {
                (0..ours.len()).collect()
            } else {
                same
            };
            let k = next_of.entry(q.link_layer.to_string()).or_insert(0);
            let i = pool[*k % pool.len()];
            *k += 1;
            chosen.insert(&q.nic, i);
            i
        })
        .collect()
}

/// Where the initiator's link stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    Ready,
    Rebuilding,
    FallenBack(String),
}

#[derive(Debug)]
pub struct LinkPhase {
    phase: Phase,
    health: PeerHealth,
}

/// What to do after a rebuild attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// Try again (after a pause).
    Retry,
    /// RDMA to the peer is given up: fail the work with this reason.
    Fallback(String),
}

impl LinkPhase {
    pub fn new(health: PeerHealth) -> Self {
        LinkPhase {
            phase: Phase::Ready,
            health,
        }
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    pub fn health(&mut self) -> &mut PeerHealth {
        &mut self.health
    }

    /// Why RDMA was given up, once it has been.
    pub fn fallback(&self) -> Option<&str> {
        match &self.phase {
            Phase::FallenBack(r) => Some(r),
            _ => self.health.fallback(),
        }
    }

    /// A QP needs rebuilding: true when the caller should start the rebuild (none is running,
    /// RDMA is not given up).
    pub fn begin_rebuild(&mut self) -> bool {
        if self.phase != Phase::Ready {
            return false;
        }
        if let Some(r) = self.health.fallback() {
            self.phase = Phase::FallenBack(r.to_string());
            return false;
        }
        self.phase = Phase::Rebuilding;
        true
    }

    /// The rebuild attempt failed with `error` (exchange, QP reset, RTR/RTS).
    pub fn rebuild_failed(&mut self, error: &str) -> AfterFailure {
        match self.health.on_connect_error(error) {
            Decision::FallbackTcp { reason } => {
                self.phase = Phase::FallenBack(reason.clone());
                AfterFailure::Fallback(reason)
            }
            _ => AfterFailure::Retry,
        }
    }

    pub fn rebuilt(&mut self) {
        if self.phase == Phase::Rebuilding {
            self.phase = Phase::Ready;
        }
    }

    /// The completion path gave RDMA up (`PeerHealth` decided so).
    pub fn fall_back(&mut self, reason: String) {
        self.phase = Phase::FallenBack(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::handshake::QpInfo;
    use crate::rdma::mtu::Mtu;
    use crate::rdma::retry::RetryPolicy;

    #[test]
    fn sessions_replace_their_own_and_bound_each_peer() {
        let mut s: Sessions<&str> = Sessions::with_limit(2);
        assert!(s.accept("a", 1, "a1").is_empty());
        assert_eq!(s.accept("a", 1, "a1'"), [(1, "a1")], "a rebuild replaces");
        assert!(s.accept("a", 2, "a2").is_empty());
        assert!(s.accept("b", 1, "b1").is_empty(), "peers are separate");
        assert_eq!(s.accept("a", 3, "a3"), [(1, "a1'")], "the oldest goes");
        assert_eq!(s.len(), 3);
        assert_eq!(s.get("a", 2), Some(&"a2"));
        assert_eq!(s.release("a", 2), Some("a2"));
        assert_eq!(s.release("a", 2), None);
        assert_eq!(s.release("a", 3), Some("a3"));
        assert_eq!(s.release("zz", 1), None);
        assert_eq!(s.len(), 1);
    }

    fn qp(nic: &str, link_layer: LinkLayer) -> QpInfo {
        QpInfo {
            nic: nic.into(),
            port: 1,
            link_layer,
            lid: 1,
            gid: "::ffff:10.0.0.1".parse().unwrap(),
            mtu: Mtu::M4096,
            qpn: 10,
            psn: 1,
        }
    }

    #[test]
    fn offered_nics_map_round_robin_onto_ours_by_link_layer() {
        use LinkLayer::{Ethernet as E, InfiniBand as I};
        let offer = ConnectInfo::new(vec![
            qp("a0", E),
            qp("a1", E),
            qp("a0", E),
            qp("a1", E),
            qp("a2", E),
        ]);
        assert_eq!(answer_nics(&offer, &[E, E]), [0, 1, 0, 1, 0]);
        assert_eq!(answer_nics(&offer, &[E]), [0, 0, 0, 0, 0]);
        assert_eq!(answer_nics(&offer, &[I, E, I, E]), [1, 3, 1, 3, 1]);
        // No NIC of the same link layer: any NIC (negotiation then names the mismatch).
        assert_eq!(answer_nics(&offer, &[I]), [0, 0, 0, 0, 0]);
        assert!(answer_nics(&offer, &[]).is_empty());
    }

    #[test]
    fn one_rebuild_at_a_time_then_fallback_after_repeated_failures() {
        let mut p = LinkPhase::new(PeerHealth::new(
            "decode-1",
            RetryPolicy {
                slice_retries: 3,
                rebuilds_before_fallback: 1,
            },
        ));
        assert!(p.begin_rebuild());
        assert!(!p.begin_rebuild(), "already rebuilding");
        assert_eq!(
            p.rebuild_failed("exchange: unavailable"),
            AfterFailure::Retry
        );
        let AfterFailure::Fallback(reason) = p.rebuild_failed("RTR: ETIMEDOUT") else {
            panic!("expected a fallback")
        };
        assert!(
            reason.contains("decode-1") && reason.contains("ETIMEDOUT"),
            "{reason}"
        );
        assert_eq!(p.fallback(), Some(reason.as_str()));
        assert!(!p.begin_rebuild(), "given up: no more rebuilds");
        p.rebuilt();
        assert!(matches!(p.phase(), Phase::FallenBack(_)));
    }

    #[test]
    fn a_rebuild_that_works_returns_to_ready() {
        let mut p = LinkPhase::new(PeerHealth::new("p", RetryPolicy::default()));
        assert!(p.begin_rebuild());
        p.rebuilt();
        assert_eq!(p.phase(), &Phase::Ready);
        assert!(p.begin_rebuild());
        p.fall_back("rdma to p failed: x; falling back to tcp".into());
        assert!(!p.begin_rebuild());
        assert!(p.fallback().unwrap().contains("falling back"));
    }
}
