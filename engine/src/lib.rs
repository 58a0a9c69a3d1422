//! kvfabric's transfer engine: registered memory regions, segment descriptors, batches of block
//! ops, and the transports that carry them (tcp between nodes, shared memory within one).
//!
//! The engine knows nothing of Kubernetes, etcd or gRPC; an inference process can embed it alone.

pub mod auth;
mod batch;
mod block_table;
pub mod cuda;
mod data_tls;
mod engine;
mod engine_config;
mod error;
pub mod frame;
mod frame_error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod handshake;
mod location;
mod op;
mod opcode;
mod parse_error;
mod prefault;
pub mod rdma;
mod region;
mod region_id;
mod region_table;
mod segment;
mod share_in_place;
mod table_manifest;
pub mod tcp_buffer;
pub mod transport;
mod transport_kind;

pub use auth::DataSecret;
pub use batch::{Batch, BatchHandle, BatchOps, BatchResult, Canceller};
pub use block_table::{BlockPair, BlockTable, MAX_PLANES, Plane, PlaneSide, TableShape, plane_end};
pub use cuda::{CudaExport, CudaPath, IpcHandle};
pub use data_tls::{DataTls, NamedClientVerifier};
pub use engine::{Engine, EngineConfig, Peer, ServeObserver, ServedChunk};
pub use error::{Error, ErrorKind, RemoteError, Result, Side};
pub use frame::TraceContext;
pub use op::{BlockOp, Coalesced, Opcode, coalesce, validate};
pub use parse_error::ParseError;
pub use rdma::{ConnectInfo, RdmaConfig, RdmaExchange, RdmaNicInfo};
pub use region::{AccessKey, Location, RawRange, Region, RegionId};
pub use segment::{
    DESCRIPTOR_VERSION, Endpoints, RdmaKey, RegionDesc, SegmentDescriptor, local_node_id,
};
pub use share_in_place::{Mapping, SharedInPlace, mappings_over, page_range};
pub use tcp_buffer::TcpBuffer;
pub use transport::kernel_tls::RecordLayer;
pub use transport::select::{Preference, Selection};
pub use transport::tls_record::{RecordError, seal_gbps};
pub use transport::{TransportKind, TransportStats};
