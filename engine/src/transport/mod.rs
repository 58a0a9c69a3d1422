//! Transports move the pieces of a batch. Which one carries a peer is decided once, at connect
//! time, by locality (see [`select`]), and reported with every batch result.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use crate::batch::Job;
use crate::frame::Entry;
use crate::region::{Location, RawRange, RegionId};
use crate::segment::SegmentDescriptor;
pub use crate::transport_kind::TransportKind;
pub(crate) use planned_table::PlannedTable;

pub(crate) mod checked;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_ipc;
pub(crate) mod data_stream;
pub mod fdpass;
pub(crate) mod io;
pub(crate) mod kernel_tls;
pub(crate) mod listener;
pub(crate) mod planned_table;
#[cfg(feature = "rdma")]
pub(crate) mod rdma;
pub(crate) mod route;
pub mod select;
pub(crate) mod shm;
pub(crate) mod shm_server;
pub(crate) mod staging;
pub(crate) mod target;
pub(crate) mod tcp;
pub(crate) mod tcp_server;
pub(crate) mod tls_record;

/// One contiguous piece of a batch after coalescing and bounds checks: the local bytes and the
/// remote place they go to or come from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub local: RawRange,
    pub remote: Entry,
    /// The local region and the offset in it where `local` starts (how rdma finds the memory
    /// registration).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub local_region: RegionId,
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub local_offset: u64,
    /// Index of the caller's op this piece starts at, for error messages.
    pub op: usize,
    /// Where the local bytes live (a GPU piece's `local` holds a device address).
    pub location: Location,
}

/// The per-peer half of a transport: takes a planned batch and completes its job.
pub(crate) trait Transport: Send + Sync + fmt::Debug {
    fn kind(&self) -> TransportKind;
    fn submit(&self, pieces: Vec<Piece>, job: Arc<Job>);
    /// Like `submit`, but the caller is about to block on the job: a transport may do the work
    /// on the calling thread, giving up by `deadline`.
    fn run_here(&self, pieces: Vec<Piece>, job: Arc<Job>, deadline: std::time::Instant) {
        let _ = deadline;
        self.submit(pieces, job)
    }
    /// A block-table batch. By default expanded here, on the host, into pieces.
    fn submit_table(&self, table: PlannedTable, job: Arc<Job>) {
        self.submit(table.pieces(), job)
    }
    /// `submit_table` for a caller about to block on the job (see `run_here`).
    fn run_table_here(&self, table: PlannedTable, job: Arc<Job>, deadline: std::time::Instant) {
        self.run_here(table.pieces(), job, deadline)
    }
    /// Live data connections and bytes moved, for status output.
    fn stats(&self) -> TransportStats;
    /// The peer published a new descriptor (regions added or gone).
    fn regions_changed(&self, _descriptor: &SegmentDescriptor) {}
    /// Peer regions currently mapped into this process (shm, cuda-ipc); 0 for copying transports.
    fn mapped(&self) -> usize {
        0
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct TransportStats {
    pub connections: usize,
    pub bytes: u64,
    /// Kernels this link keeps on its GPUs between batches (cuda-ipc's doorbell while it
    /// lingers after a batch; it exits after `EngineConfig::cuda_doorbell_idle`).
    pub resident_kernels: usize,
}
