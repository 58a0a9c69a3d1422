//! Transport selection by locality. The decision and its reason are returned so callers can show
//! them (log line, batch result, CLI output); nothing is chosen silently.

use serde::Serialize;

use super::TransportKind;
use crate::error::{Error, Result};
use crate::region::Location;
use crate::segment::SegmentDescriptor;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preference {
    /// Pick by locality.
    #[default]
    Auto,
    /// Use exactly this transport or fail: it must reach at least one of the peer's regions
    /// (the caller routes each batch to a connection that reaches its memory; a batch for a
    /// region it cannot reach gets a typed error).
    Only(TransportKind),
}

impl std::str::FromStr for Preference {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            Ok(Preference::Auto)
        } else {
            s.parse()
                .map(Preference::Only)
                .map_err(|_| Error::InvalidConfig {
                    field: "transport",
                    value: s.into(),
                    reason: "expected auto, tcp, shm, cuda-ipc or rdma",
                })
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Selection {
    pub kind: TransportKind,
    pub reason: String,
}

/// What this engine can offer, for the choice.
#[derive(Debug, Clone)]
pub struct Local<'a> {
    /// This machine's identity (`EngineConfig::node`).
    pub node: &'a str,
    /// Whether this engine can open an rdma connection now: built with the feature, a usable
    /// device, and a way to exchange the connection with the peer; else why not.
    pub rdma: std::result::Result<(), String>,
}

/// Why rdma cannot be used when no exchange was given.
pub const NO_EXCHANGE: &str = "rdma connections are set up through an exchange with the peer \
     (Engine::connect_with and an RdmaExchange, as the agent's peer API does); none was given";

/// Which of the peer's regions a transport must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coverage {
    /// Every region: the one connection `Auto` picks serves every batch.
    Every,
    /// At least one: the caller routes each batch to the connection whose memory it touches
    /// (the agent: GPU batches over cuda-ipc, host ones over shm, to one peer whose segment
    /// holds both), and a batch for a region the transport cannot reach gets a typed error.
    Some,
}

/// The first region `fits` refuses (Every), or a word when none fits (Some).
fn uncovered(
    remote: &SegmentDescriptor,
    coverage: Coverage,
    fits: impl Fn(&crate::segment::RegionDesc) -> bool,
    what: &str,
) -> Option<String> {
    match coverage {
        Coverage::Every => remote
            .regions
            .iter()
            .find(|r| !fits(r))
            .map(|r| format!("region {} ({}) is not {what}", r.id, r.location)),
        Coverage::Some => (!remote.regions.is_empty() && !remote.regions.iter().any(fits))
            .then(|| format!("no region is {what}")),
    }
}

/// Why `kind` cannot reach `remote` from `local`, or None when it can.
fn unavailable(
    kind: TransportKind,
    local: &Local<'_>,
    remote: &SegmentDescriptor,
    coverage: Coverage,
) -> Option<String> {
    let local_node = local.node;
    match kind {
        TransportKind::Tcp => remote
            .endpoints
            .tcp
            .is_none()
            .then(|| "peer publishes no tcp endpoint".into()),
        TransportKind::Shm => {
            if remote.node != local_node {
                Some(format!("peer is on another node ({})", remote.node))
            } else if remote.endpoints.shm.is_none() {
                Some("peer publishes no shm endpoint".into())
            } else {
                uncovered(
                    remote,
                    coverage,
                    |r| r.shareable && matches!(r.location, Location::Host { .. }),
                    "a shareable host region",
                )
            }
        }
        TransportKind::CudaIpc => {
            if !cfg!(feature = "cuda") {
                Some("cuda-ipc is not built into this engine (cargo feature `cuda` is off)".into())
            } else if remote.node != local_node {
                Some(format!("peer is on another node ({})", remote.node))
            } else if remote.regions.is_empty() {
                Some("peer publishes no regions".into())
            } else {
                uncovered(
                    remote,
                    coverage,
                    |r| matches!(r.location, Location::Cuda { .. }) && r.ipc.is_some(),
                    "an exported GPU region",
                )
            }
        }
        TransportKind::Rdma => rdma_unavailable(local, remote),
    }
}

fn rdma_unavailable(local: &Local<'_>, remote: &SegmentDescriptor) -> Option<String> {
    if !cfg!(feature = "rdma") {
        return Some("rdma is not built into this engine (cargo feature `rdma` is off)".into());
    }
    if let Err(reason) = &local.rdma {
        return Some(reason.clone());
    }
    if remote.regions.is_empty() {
        return Some("peer publishes no regions".into());
    }
    if remote.regions.iter().all(|r| r.rdma.is_empty()) {
        return Some(
            "peer publishes no rdma keys (it has no usable RDMA device, or RDMA is off there)"
                .into(),
        );
    }
    remote.regions.iter().find(|r| r.rdma.is_empty()).map(|r| {
        format!(
            "peer region {} ({}) publishes no rdma key (it could not be registered there)",
            r.id, r.location
        )
    })
}

/// [`select_for`] for an engine that offers no rdma (no exchange given).
pub fn select(
    local_node: &str,
    remote: &SegmentDescriptor,
    preference: Preference,
) -> Result<Selection> {
    let local = Local {
        node: local_node,
        rdma: Err(NO_EXCHANGE.into()),
    };
    select_for(&local, remote, preference)
}

/// The transport for `remote`: `preference`, or by locality — cuda-ipc (same node, GPU regions),
/// shm (same node, host regions), rdma (devices on both ends), tcp — with the reason. `Auto`
/// picks a transport that reaches every region of the peer's.
pub fn select_for(
    local: &Local<'_>,
    remote: &SegmentDescriptor,
    preference: Preference,
) -> Result<Selection> {
    match preference {
        Preference::Only(kind) => match unavailable(kind, local, remote, Coverage::Some) {
            None => Ok(Selection {
                kind,
                reason: "requested explicitly".into(),
            }),
            Some(reason) => Err(Error::TransportUnavailable {
                transport: kind,
                segment: remote.name.clone(),
                reason,
            }),
        },
        Preference::Auto => {
            let no_ipc = match unavailable(TransportKind::CudaIpc, local, remote, Coverage::Every) {
                None => {
                    return Ok(Selection {
                        kind: TransportKind::CudaIpc,
                        reason: "same node, GPU regions: peer memory is mapped with CUDA IPC"
                            .into(),
                    });
                }
                Some(r) => r,
            };
            let no_shm = match unavailable(TransportKind::Shm, local, remote, Coverage::Every) {
                None => {
                    return Ok(Selection {
                        kind: TransportKind::Shm,
                        reason: format!(
                            "same node: peer memory is mapped directly (cuda-ipc not possible: {no_ipc})"
                        ),
                    });
                }
                Some(r) => r,
            };
            let no_rdma = match unavailable(TransportKind::Rdma, local, remote, Coverage::Every) {
                None => {
                    return Ok(Selection {
                        kind: TransportKind::Rdma,
                        reason: format!(
                            "RDMA devices on both ends: one-sided READ/WRITE (shm not possible: \
                             {no_shm}; cuda-ipc not possible: {no_ipc})"
                        ),
                    });
                }
                Some(r) => r,
            };
            match unavailable(TransportKind::Tcp, local, remote, Coverage::Every) {
                None => Ok(Selection {
                    kind: TransportKind::Tcp,
                    reason: format!(
                        "shm not possible: {no_shm}; cuda-ipc not possible: {no_ipc}; rdma not \
                         possible: {no_rdma}"
                    ),
                }),
                Some(no_tcp) => Err(Error::TransportUnavailable {
                    transport: TransportKind::Tcp,
                    segment: remote.name.clone(),
                    reason: format!(
                        "{no_tcp}; shm not possible: {no_shm}; rdma not possible: {no_rdma}"
                    ),
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{AccessKey, RegionId};
    use crate::segment::{DESCRIPTOR_VERSION, Endpoints, RegionDesc};

    fn desc(node: &str, shm: bool, shareable: bool) -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "decode-0".into(),
            node: node.into(),
            regions: vec![RegionDesc {
                id: RegionId(1),
                len: 10,
                location: Location::Host { numa: None },
                key: AccessKey(1),
                shareable,
                ipc: None,
                rdma: Vec::new(),
            }],
            endpoints: Endpoints {
                tcp: Some("127.0.0.1:1".parse().unwrap()),
                shm: shm.then(|| "/tmp/s".into()),
            },
        }
    }

    #[test]
    fn auto_prefers_shm_on_the_same_node_and_says_why_not_otherwise() {
        let s = select("n1", &desc("n1", true, true), Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Shm);
        let s = select("n1", &desc("n2", true, true), Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Tcp);
        assert!(s.reason.contains("another node"), "{}", s.reason);
        let s = select("n1", &desc("n1", true, false), Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Tcp);
        assert!(s.reason.contains("not a shareable"), "{}", s.reason);
    }

    #[test]
    fn explicit_choice_is_honoured_or_refused_with_reason() {
        let s = select("n1", &desc("n1", true, true), "tcp".parse().unwrap()).unwrap();
        assert_eq!(s.kind, TransportKind::Tcp);
        let err = select("n1", &desc("n2", true, true), "shm".parse().unwrap()).unwrap_err();
        assert!(err.to_string().contains("another node"), "{err}");
        let err = select("n1", &desc("n1", true, true), "rdma".parse().unwrap()).unwrap_err();
        if cfg!(feature = "rdma") {
            assert!(err.to_string().contains("exchange"), "{err}");
        } else {
            assert!(err.to_string().contains("not built"), "{err}");
        }
        assert!("carrier-pigeon".parse::<Preference>().is_err());
    }

    fn gpu_desc(node: &str, exported: bool) -> SegmentDescriptor {
        let mut d = desc(node, true, false);
        d.regions[0].location = Location::Cuda { device: 1 };
        d.regions[0].ipc = exported.then_some(crate::cuda::CudaExport {
            handle: crate::cuda::IpcHandle([1; 64]),
            offset: 0,
        });
        d
    }

    #[test]
    fn gpu_regions_on_the_same_node_select_cuda_ipc_with_a_visible_reason() {
        let s = select("n1", &gpu_desc("n1", true), Preference::Auto).unwrap();
        if cfg!(feature = "cuda") {
            assert_eq!(s.kind, TransportKind::CudaIpc);
            assert!(s.reason.contains("CUDA IPC"), "{}", s.reason);
        } else {
            assert_eq!(s.kind, TransportKind::Tcp);
            assert!(s.reason.contains("feature `cuda` is off"), "{}", s.reason);
        }
        // Another node: tcp (through staging), and the reason names both refusals.
        let s = select("n1", &gpu_desc("n2", true), Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Tcp);
        assert!(s.reason.contains("cuda-ipc not possible"), "{}", s.reason);
        // A GPU region without an IPC export cannot go over cuda-ipc.
        let err = select("n1", &gpu_desc("n1", false), "cuda-ipc".parse().unwrap()).unwrap_err();
        assert!(
            err.to_string()
                .contains("no region is an exported GPU region")
                || !cfg!(feature = "cuda"),
            "{err}"
        );
        // Host regions on the same node stay on shm, and say why not cuda-ipc.
        let s = select("n1", &desc("n1", true, true), Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Shm);
        assert!(s.reason.contains("cuda-ipc not possible"), "{}", s.reason);
    }

    /// A segment with GPU and host regions (a worker's KV cache and its mailbox, under one
    /// agent): `Auto` needs one transport for every region (tcp); a caller that routes by
    /// memory gets cuda-ipc and shm, each for the regions it reaches.
    #[test]
    fn a_segment_of_gpu_and_host_regions_has_a_transport_for_each() {
        let mut mixed = gpu_desc("n1", true);
        let host = desc("n1", true, true).regions.remove(0);
        mixed.regions.push(RegionDesc {
            id: RegionId(2),
            ..host
        });
        let s = select("n1", &mixed, Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Tcp);
        assert!(
            s.reason.contains("is not a shareable host region"),
            "{}",
            s.reason
        );
        let shm = select("n1", &mixed, Preference::Only(TransportKind::Shm)).unwrap();
        assert_eq!(shm.kind, TransportKind::Shm);
        let ipc = select("n1", &mixed, Preference::Only(TransportKind::CudaIpc));
        if cfg!(feature = "cuda") {
            assert_eq!(ipc.unwrap().kind, TransportKind::CudaIpc);
        } else {
            assert!(
                ipc.unwrap_err()
                    .to_string()
                    .contains("feature `cuda` is off")
            );
        }
        // Neither reaches a segment of only the other kind's memory.
        let err = select(
            "n1",
            &gpu_desc("n1", true),
            Preference::Only(TransportKind::Shm),
        );
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("no region is a shareable host region")
        );
    }
}

#[cfg(test)]
mod rdma_tests {
    use super::*;
    use crate::region::{AccessKey, RegionId};
    use crate::segment::{DESCRIPTOR_VERSION, Endpoints, RdmaKey, RegionDesc};

    fn desc(keys: &[bool]) -> SegmentDescriptor {
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "decode-0".into(),
            node: "n2".into(),
            regions: keys
                .iter()
                .enumerate()
                .map(|(i, &k)| RegionDesc {
                    id: RegionId(i as u64 + 1),
                    len: 10,
                    location: Location::Host { numa: None },
                    key: AccessKey(1),
                    shareable: false,
                    ipc: None,
                    rdma: if k {
                        vec![RdmaKey {
                            nic: "mlx5_0".into(),
                            addr: 0x1000,
                            rkey: 7,
                        }]
                    } else {
                        Vec::new()
                    },
                })
                .collect(),
            endpoints: Endpoints {
                tcp: Some("127.0.0.1:1".parse().unwrap()),
                shm: None,
            },
        }
    }

    fn local(rdma: std::result::Result<(), &str>) -> Local<'static> {
        Local {
            node: "n1",
            rdma: rdma.map_err(str::to_string),
        }
    }

    #[test]
    fn auto_picks_rdma_before_tcp_when_both_ends_have_it() {
        let s = select_for(&local(Ok(())), &desc(&[true, true]), Preference::Auto).unwrap();
        if cfg!(feature = "rdma") {
            assert_eq!(s.kind, TransportKind::Rdma);
            assert!(
                s.reason.contains("RDMA devices on both ends"),
                "{}",
                s.reason
            );
            assert!(s.reason.contains("another node"), "{}", s.reason);
        } else {
            assert_eq!(s.kind, TransportKind::Tcp);
            assert!(s.reason.contains("feature `rdma` is off"), "{}", s.reason);
        }
    }

    #[test]
    fn every_reason_against_rdma_is_named() {
        let only = Preference::Only(TransportKind::Rdma);
        let why = |l: Local<'_>, d: &SegmentDescriptor| -> String {
            select_for(&l, d, only).unwrap_err().to_string()
        };
        if !cfg!(feature = "rdma") {
            let msg = why(local(Ok(())), &desc(&[true]));
            assert!(msg.contains("feature `rdma` is off"), "{msg}");
            return;
        }
        let msg = why(
            local(Err("no usable RDMA device here: none")),
            &desc(&[true]),
        );
        assert!(msg.contains("no usable RDMA device here"), "{msg}");
        let msg = why(local(Ok(())), &desc(&[]));
        assert!(msg.contains("no regions"), "{msg}");
        let msg = why(local(Ok(())), &desc(&[false, false]));
        assert!(msg.contains("no rdma keys"), "{msg}");
        let msg = why(local(Ok(())), &desc(&[true, false]));
        assert!(
            msg.contains("region 2") && msg.contains("no rdma key"),
            "{msg}"
        );
        // Auto falls to tcp and says why not rdma.
        let s = select_for(&local(Ok(())), &desc(&[false]), Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Tcp);
        assert!(
            s.reason
                .contains("rdma not possible: peer publishes no rdma keys"),
            "{}",
            s.reason
        );
        let s = select("n1", &desc(&[true]), Preference::Auto).unwrap();
        assert!(s.reason.contains("RdmaExchange"), "{}", s.reason);
    }
}
