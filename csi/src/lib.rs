//! `kvfabric-csi`: a node-only CSI driver of ephemeral inline volumes. A pod writes
//!
//! ```yaml
//! volumes:
//!   - name: kvfabric
//!     csi: {driver: csi.kvfabric.io, readOnly: true, volumeAttributes: {fabric: llama, pool: decode}}
//! ```
//!
//! and gets the socket directory of that pool's agent on its node, bind-mounted: no hostPath, so
//! workers (and agents without RDMA or host network) pass Pod Security `baseline`. The driver
//! counts the pods of each directory and removes a directory after its last pod, so a deleted
//! fabric leaves nothing on the node.

#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod ledger;
pub mod mounts;
pub mod node;
pub mod registration;
pub mod server;
pub mod volume;

/// Generated from `proto/` by tonic-prost-build (committed; `tests/proto_fresh.rs` checks it).
pub mod pb {
    /// CSI v1: Identity and Node.
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod csi {
        include!("gen/csi.v1.rs");
    }
    /// The kubelet's plugin registration v1.
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod registration {
        include!("gen/pluginregistration.rs");
    }
}

pub use error::{Error, Result};
