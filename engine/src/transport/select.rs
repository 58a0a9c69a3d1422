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
    /// Use exactly this transport or fail.
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

/// Why `kind` cannot reach `remote` from `local_node`, or None when it can.
fn unavailable(
    kind: TransportKind,
    local_node: &str,
    remote: &SegmentDescriptor,
) -> Option<String> {
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
                remote
                    .regions
                    .iter()
                    .find(|r| !r.shareable || !matches!(r.location, Location::Host { .. }))
                    .map(|r| {
                        format!(
                            "region {} ({}) is not a shareable host region",
                            r.id, r.location
                        )
                    })
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
                remote
                    .regions
                    .iter()
                    .find(|r| !matches!(r.location, Location::Cuda { .. }) || r.ipc.is_none())
                    .map(|r| {
                        format!(
                            "region {} ({}) is not an exported GPU region",
                            r.id, r.location
                        )
                    })
            }
        }
        TransportKind::Rdma => Some("rdma is not built into this engine yet".into()),
    }
}

pub fn select(
    local_node: &str,
    remote: &SegmentDescriptor,
    preference: Preference,
) -> Result<Selection> {
    match preference {
        Preference::Only(kind) => match unavailable(kind, local_node, remote) {
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
            let no_ipc = match unavailable(TransportKind::CudaIpc, local_node, remote) {
                None => {
                    return Ok(Selection {
                        kind: TransportKind::CudaIpc,
                        reason: "same node, GPU regions: peer memory is mapped with CUDA IPC"
                            .into(),
                    });
                }
                Some(r) => r,
            };
            match unavailable(TransportKind::Shm, local_node, remote) {
                None => Ok(Selection {
                    kind: TransportKind::Shm,
                    reason: format!(
                        "same node: peer memory is mapped directly (cuda-ipc not possible: {no_ipc})"
                    ),
                }),
                Some(no_shm) => match unavailable(TransportKind::Tcp, local_node, remote) {
                    None => Ok(Selection {
                        kind: TransportKind::Tcp,
                        reason: format!(
                            "shm not possible: {no_shm}; cuda-ipc not possible: {no_ipc}"
                        ),
                    }),
                    Some(no_tcp) => Err(Error::TransportUnavailable {
                        transport: TransportKind::Tcp,
                        segment: remote.name.clone(),
                        reason: format!("{no_tcp}; shm not possible: {no_shm}"),
                    }),
                },
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
        assert!(err.to_string().contains("not built"), "{err}");
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
            err.to_string().contains("not an exported GPU region") || !cfg!(feature = "cuda"),
            "{err}"
        );
        // Host regions on the same node stay on shm, and say why not cuda-ipc.
        let s = select("n1", &desc("n1", true, true), Preference::Auto).unwrap();
        assert_eq!(s.kind, TransportKind::Shm);
        assert!(s.reason.contains("cuda-ipc not possible"), "{}", s.reason);
    }
}
