//! Where a selected transport connects, carried in the type: what selection checked (a tcp or
//! shm endpoint in the descriptor, an rdma exchange handed in) cannot go missing between the
//! choice and the dial.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use super::TransportKind;
use crate::error::{Error, Result};
use crate::rdma::RdmaExchange;
use crate::segment::SegmentDescriptor;

pub(crate) enum Route {
    Tcp(SocketAddr),
    Shm(PathBuf),
    #[cfg(feature = "cuda")]
    CudaIpc,
    #[cfg(feature = "rdma")]
    Rdma(Arc<dyn RdmaExchange>),
}

impl Route {
    /// The route of `kind` to `remote`; a typed error names what is missing.
    pub(crate) fn new(
        kind: TransportKind,
        remote: &SegmentDescriptor,
        rdma: Option<Arc<dyn RdmaExchange>>,
    ) -> Result<Route> {
        let missing = |what: &str| Error::TransportUnavailable {
            transport: kind,
            segment: remote.name.clone(),
            reason: format!("no {what}"),
        };
        #[cfg(not(feature = "rdma"))]
        let _ = rdma;
        match kind {
            TransportKind::Tcp => remote
                .endpoints
                .tcp
                .map(Route::Tcp)
                .ok_or_else(|| missing("tcp endpoint in the descriptor")),
            TransportKind::Shm => remote
                .endpoints
                .shm
                .clone()
                .map(Route::Shm)
                .ok_or_else(|| missing("shm endpoint in the descriptor")),
            #[cfg(feature = "cuda")]
            TransportKind::CudaIpc => Ok(Route::CudaIpc),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma => rdma
                .map(Route::Rdma)
                .ok_or_else(|| missing("rdma exchange to reach the peer with")),
            // Reached in builds without `cuda` or `rdma`; selection refuses those first.
            #[allow(unreachable_patterns)]
            other => Err(Error::TransportUnavailable {
                transport: other,
                segment: remote.name.clone(),
                reason: "not built into this engine".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{DESCRIPTOR_VERSION, Endpoints};

    #[test]
    fn a_missing_endpoint_is_a_typed_error_not_a_panic() {
        let remote = SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "p".into(),
            node: "n".into(),
            regions: Vec::new(),
            endpoints: Endpoints::default(),
        };
        for kind in [TransportKind::Tcp, TransportKind::Shm] {
            match Route::new(kind, &remote, None) {
                Err(Error::TransportUnavailable {
                    transport, reason, ..
                }) => {
                    assert_eq!(transport, kind);
                    assert!(reason.contains("endpoint"), "{reason}");
                }
                other => panic!("{kind}: {:?}", other.err()),
            }
        }
    }
}
