//! What two ends exchange (through the agents' peer API) to connect RC QPs, its validation,
//! and the negotiation: the path MTU is the smaller of the two active MTUs, InfiniBand ports
//! route by LID (with a GRH only across subnets), RoCE always by GID.
//!
//! Everything that arrives from a peer is checked before it reaches `ibv_modify_qp`; garbage is
//! a `BadHandshake` naming the field and the value.

use serde::{Deserialize, Serialize};

use super::mtu::Mtu;
use super::sysfs::{Gid, LinkLayer};
use crate::error::{Error, Result};

/// Bumped when a field changes meaning; both ends must agree.
pub const HANDSHAKE_VERSION: u32 = 1;

/// QP numbers and PSNs are 24-bit.
const MAX_24: u32 = 0xff_ffff;
/// Unicast LIDs are 1..=0xbfff; 0 is unassigned, above is multicast/permissive.
const MAX_UNICAST_LID: u16 = 0xbfff;

/// One QP's end of a connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpInfo {
    /// The RDMA device and port the QP lives on.
    pub nic: String,
    pub port: u8,
    pub link_layer: LinkLayer,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID this end sends from (its index stays local: the peer needs only the value).
    pub gid: Gid,
    /// The port's active MTU.
    pub mtu: Mtu,
    pub qpn: u32,
    /// The first packet sequence number this end will send.
    pub psn: u32,
}

/// Everything one end sends: all of its QPs for this peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectInfo {
    pub version: u32,
    /// The initiator's link, kept over its rebuilds: an offer for a session the target already
    /// holds replaces that session's QPs. The answer repeats it.
    #[serde(default)]
    pub session: u64,
    pub qps: Vec<QpInfo>,
}

impl ConnectInfo {
    pub fn new(qps: Vec<QpInfo>) -> Self {
        ConnectInfo {
            version: HANDSHAKE_VERSION,
            session: 0,
            qps,
        }
    }

    pub fn with_session(mut self, session: u64) -> Self {
        self.session = session;
        self
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("connect info serializes")
    }

    /// Parses and validates what `peer` sent.
    pub fn from_json(peer: &str, text: &str) -> Result<Self> {
        let info: ConnectInfo = serde_json::from_str(text).map_err(|e| Error::BadHandshake {
            peer: peer.into(),
            field: "message",
            value: e.to_string(),
            reason: "not a valid rdma connect message",
        })?;
        info.validate(peer)?;
        Ok(info)
    }

    pub fn validate(&self, peer: &str) -> Result<()> {
        let bad = |field, value: String, reason| Error::BadHandshake {
            peer: peer.into(),
            field,
            value,
            reason,
        };
        if self.version != HANDSHAKE_VERSION {
            return Err(bad(
                "version",
                self.version.to_string(),
                "unsupported handshake version",
            ));
        }
        if self.qps.is_empty() {
            return Err(bad("qps", "0".into(), "at least one QP is needed"));
        }
        if self.qps.len() > 1024 {
            return Err(bad("qps", self.qps.len().to_string(), "more than 1024 QPs"));
        }
        self.qps.iter().try_for_each(|q| q.validate(peer))
    }
}

impl QpInfo {
    pub fn validate(&self, peer: &str) -> Result<()> {
        let bad = |field, value: String, reason| {
            Err(Error::BadHandshake {
                peer: peer.into(),
                field,
                value,
                reason,
            })
        };
        if self.nic.is_empty() || self.nic.len() > 64 || self.nic.chars().any(char::is_control) {
            return bad("nic", format!("{:?}", self.nic), "not a device name");
        }
        if self.port == 0 {
            return bad("port", "0".into(), "ports are numbered from 1");
        }
        if self.qpn <= 1 || self.qpn > MAX_24 {
            return bad(
                "qpn",
                self.qpn.to_string(),
                "must be 2..=0xffffff (QP0/QP1 are special)",
            );
        }
        if self.psn > MAX_24 {
            return bad("psn", self.psn.to_string(), "must fit in 24 bits");
        }
        match &self.link_layer {
            LinkLayer::InfiniBand => {
                if self.lid == 0 || self.lid > MAX_UNICAST_LID {
                    return bad("lid", format!("{:#x}", self.lid), "not a unicast LID");
                }
            }
            LinkLayer::Ethernet => {
                if self.gid.is_zero() {
                    return bad("gid", self.gid.to_string(), "RoCE needs a GID");
                }
            }
            LinkLayer::Other(l) => {
                return bad("link_layer", l.clone(), "expected InfiniBand or Ethernet");
            }
        }
        Ok(())
    }
}

/// How a local QP reaches its remote QP: the attributes of the RTR/RTS transitions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    pub mtu: Mtu,
    pub remote_qpn: u32,
    /// The remote's first PSN: our receive PSN (`rq_psn`).
    pub remote_psn: u32,
    /// Our first PSN (`sq_psn`).
    pub local_psn: u32,
    pub dlid: u16,
    /// The destination GID when a global route header is needed (RoCE always, InfiniBand
    /// across subnets).
    pub dgid: Option<Gid>,
}

/// The route from `local` to `remote` (one QP pair). Refuses ends that cannot talk.
pub fn negotiate(peer: &str, local: &QpInfo, remote: &QpInfo) -> Result<Route> {
    remote.validate(peer)?;
    if remote.link_layer != local.link_layer {
        return Err(Error::BadHandshake {
            peer: peer.into(),
            field: "link_layer",
            value: remote.link_layer.to_string(),
            reason: "differs from ours (InfiniBand and RoCE cannot connect)",
        });
    }
    let dgid = match local.link_layer {
        LinkLayer::Ethernet => Some(remote.gid),
        // Same subnet prefix (the GID's first 8 bytes): LID routing suffices.
        _ if remote.gid.0[..8] != local.gid.0[..8] && !remote.gid.is_zero() => Some(remote.gid),
        _ => None,
    };
    Ok(Route {
        mtu: local.mtu.min(remote.mtu),
        remote_qpn: remote.qpn,
        remote_psn: remote.psn,
        local_psn: local.psn,
        dlid: remote.lid,
        dgid,
    })
}

/// Pairs our QPs with the peer's, in order (QP i with QP i): both ends must have made as many.
pub fn pair(peer: &str, local: &[QpInfo], remote: &ConnectInfo) -> Result<Vec<Route>> {
    remote.validate(peer)?;
    if remote.qps.len() != local.len() {
        return Err(Error::BadHandshake {
            peer: peer.into(),
            field: "qps",
            value: remote.qps.len().to_string(),
            reason: "differs from the number of QPs we made for this peer",
        });
    }
    local
        .iter()
        .zip(&remote.qps)
        .map(|(l, r)| negotiate(peer, l, r))
        .collect()
}

/// A random first PSN (24 bits), so a stale packet of an old QP with the same number is not
/// taken for a new one's.
pub fn random_psn() -> u32 {
    rand::random::<u32>() & MAX_24
}

/// Timeouts and retries of the RTR/RTS transitions. Defaults suit one-sided READ/WRITE in a
/// data centre: ~67 ms ACK timeout (4.096 µs · 2^14), 7 transport retries, RNR retried without
/// limit (one-sided ops consume no receive WRs, so RNR should not occur at all), 16 RDMA READs
/// in flight each way (clamped to the device's limits when the QP is built).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QpParams {
    /// Send-queue depth in WRs.
    pub sq_depth: u32,
    /// Local ACK timeout exponent: 4.096 µs · 2^timeout (0..=31; 0 waits forever).
    pub timeout: u8,
    /// Transport retries before IBV_WC_RETRY_EXC_ERR (0..=7).
    pub retry_cnt: u8,
    /// RNR retries (0..=7; 7 = without limit).
    pub rnr_retry: u8,
    /// RNR NAK timer code the responder asks for (0..=31).
    pub min_rnr_timer: u8,
    /// RDMA READs this end keeps in flight (`max_rd_atomic`).
    pub max_rd_atomic: u8,
    /// RDMA READs this end serves at once (`max_dest_rd_atomic`).
    pub max_dest_rd_atomic: u8,
}

impl Default for QpParams {
    fn default() -> Self {
        QpParams {
            sq_depth: 256,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
        }
    }
}

impl QpParams {
    pub fn validate(&self) -> Result<()> {
        let check = |ok: bool, field: &'static str, value: u32, reason: &'static str| {
            if ok {
                Ok(())
            } else {
                Err(Error::InvalidConfig {
                    field,
                    value: value.to_string(),
                    reason,
                })
            }
        };
        check(
            (1..=32768).contains(&self.sq_depth),
            "rdma_sq_depth",
            self.sq_depth,
            "must be from 1 to 32768",
        )?;
        check(
            self.timeout <= 31,
            "rdma_timeout",
            self.timeout.into(),
            "must be 0..=31",
        )?;
        check(
            self.retry_cnt <= 7,
            "rdma_retry_cnt",
            self.retry_cnt.into(),
            "must be 0..=7",
        )?;
        check(
            self.rnr_retry <= 7,
            "rdma_rnr_retry",
            self.rnr_retry.into(),
            "must be 0..=7",
        )?;
        check(
            self.min_rnr_timer <= 31,
            "rdma_min_rnr_timer",
            self.min_rnr_timer.into(),
            "must be 0..=31",
        )?;
        check(
            self.max_rd_atomic >= 1,
            "rdma_max_rd_atomic",
            self.max_rd_atomic.into(),
            "must be at least 1",
        )?;
        check(
            self.max_dest_rd_atomic >= 1,
            "rdma_max_dest_rd_atomic",
            self.max_dest_rd_atomic.into(),
            "must be at least 1",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roce(qpn: u32, mtu: Mtu) -> QpInfo {
        QpInfo {
            nic: "mlx5_0".into(),
            port: 1,
            link_layer: LinkLayer::Ethernet,
            lid: 0,
            gid: "::ffff:10.0.0.1".parse().unwrap(),
            mtu,
            qpn,
            psn: 0x12345,
        }
    }

    fn ib(qpn: u32, lid: u16, prefix: &str) -> QpInfo {
        QpInfo {
            link_layer: LinkLayer::InfiniBand,
            lid,
            gid: format!("{prefix}:0c42:a103:65:1a2b").parse().unwrap(),
            ..roce(qpn, Mtu::M4096)
        }
    }

    #[test]
    fn mtu_is_the_smaller_of_both_ends() {
        let r = negotiate("peer", &roce(10, Mtu::M4096), &roce(20, Mtu::M1024)).unwrap();
        assert_eq!(r.mtu, Mtu::M1024);
        let r = negotiate("peer", &roce(10, Mtu::M2048), &roce(20, Mtu::M4096)).unwrap();
        assert_eq!(r.mtu, Mtu::M2048);
        assert_eq!(
            (r.remote_qpn, r.remote_psn, r.local_psn),
            (20, 0x12345, 0x12345)
        );
    }

    #[test]
    fn roce_routes_by_gid_and_ib_by_lid_unless_subnets_differ() {
        let r = negotiate("peer", &roce(10, Mtu::M4096), &roce(20, Mtu::M4096)).unwrap();
        assert!(r.dgid.is_some());
        let r = negotiate("peer", &ib(10, 1, "fe80:0:0:0"), &ib(20, 2, "fe80:0:0:0")).unwrap();
        assert_eq!((r.dlid, r.dgid), (2, None));
        let r = negotiate("peer", &ib(10, 1, "fe80:0:0:0"), &ib(20, 2, "fec0:0:0:1")).unwrap();
        assert!(r.dgid.is_some(), "another subnet needs a GRH");
    }

    #[test]
    fn ib_and_roce_cannot_connect() {
        let err =
            negotiate("decode-1", &roce(10, Mtu::M4096), &ib(20, 2, "fe80:0:0:0")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("decode-1") && msg.contains("link_layer") && msg.contains("InfiniBand"),
            "{msg}"
        );
    }

    #[test]
    fn garbage_fields_are_named_with_their_values() {
        let cases: Vec<(QpInfo, &str, &str)> = vec![
            (
                QpInfo {
                    qpn: 0,
                    ..roce(1, Mtu::M4096)
                },
                "qpn",
                "= 0",
            ),
            (
                QpInfo {
                    qpn: 1,
                    ..roce(1, Mtu::M4096)
                },
                "qpn",
                "= 1",
            ),
            (roce(0x100_0000, Mtu::M4096), "qpn", "16777216"),
            (
                QpInfo {
                    psn: 0x100_0000,
                    ..roce(5, Mtu::M4096)
                },
                "psn",
                "16777216",
            ),
            (
                QpInfo {
                    port: 0,
                    ..roce(5, Mtu::M4096)
                },
                "port",
                "= 0",
            ),
            (
                QpInfo {
                    nic: String::new(),
                    ..roce(5, Mtu::M4096)
                },
                "nic",
                "\"\"",
            ),
            (
                QpInfo {
                    gid: Gid::default(),
                    ..roce(5, Mtu::M4096)
                },
                "gid",
                "0000:",
            ),
            (ib(5, 0, "fe80:0:0:0"), "lid", "0x0"),
            (ib(5, 0xc000, "fe80:0:0:0"), "lid", "0xc000"),
            (
                QpInfo {
                    link_layer: LinkLayer::Other("OPA".into()),
                    ..roce(5, Mtu::M4096)
                },
                "link_layer",
                "OPA",
            ),
        ];
        for (q, field, value) in cases {
            let msg = q.validate("p").unwrap_err().to_string();
            assert!(msg.contains(field) && msg.contains(value), "{field}: {msg}");
        }
    }

    #[test]
    fn messages_round_trip_and_bad_json_is_refused() {
        let info = ConnectInfo::new(vec![roce(10, Mtu::M4096), roce(11, Mtu::M4096)]);
        let text = info.to_json();
        assert!(
            text.contains("\"mtu\":4096") && text.contains("\"link_layer\":\"Ethernet\""),
            "{text}"
        );
        assert_eq!(ConnectInfo::from_json("p", &text).unwrap(), info);
        for (bad, field) in [
            ("{nope".to_string(), "message"),
            (text.replace("\"mtu\":4096", "\"mtu\":1500"), "message"),
            (text.replace("\"version\":1", "\"version\":7"), "version"),
            (text.replace("\"qpn\":10", "\"qpn\":-3"), "message"),
            (text.replace("ffff:0a00", "zzzz:0a00"), "message"),
            (ConnectInfo::new(vec![]).to_json(), "qps"),
        ] {
            let err = ConnectInfo::from_json("p", &bad).unwrap_err();
            assert_eq!(err.code(), "bad_handshake");
            assert!(err.to_string().contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn pairing_needs_equal_qp_counts() {
        let local = vec![roce(10, Mtu::M4096), roce(11, Mtu::M2048)];
        let remote = ConnectInfo::new(vec![roce(20, Mtu::M4096), roce(21, Mtu::M4096)]);
        let routes = pair("p", &local, &remote).unwrap();
        assert_eq!(
            routes.iter().map(|r| r.remote_qpn).collect::<Vec<_>>(),
            [20, 21]
        );
        assert_eq!(routes[1].mtu, Mtu::M2048);
        let short = ConnectInfo::new(vec![roce(20, Mtu::M4096)]);
        let err = pair("p", &local, &short).unwrap_err();
        assert!(err.to_string().contains("qps = 1"), "{err}");
    }

    #[test]
    fn psns_are_24_bit_and_params_are_checked() {
        for _ in 0..100 {
            assert!(random_psn() <= MAX_24);
        }
        QpParams::default().validate().unwrap();
        let err = QpParams {
            retry_cnt: 8,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("rdma_retry_cnt") && err.to_string().contains('8'));
        let err = QpParams {
            sq_depth: 0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("rdma_sq_depth"));
        assert!(
            QpParams {
                timeout: 32,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            QpParams {
                max_rd_atomic: 0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }
}
