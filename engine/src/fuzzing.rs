//! What the cargo-fuzz targets drive (cargo feature `fuzzing`, never in a release build): the
//! batch planner of [`Peer`] without a connection, against real local regions and a remote
//! descriptor whose lengths the caller picks (a peer's descriptor may claim anything); the tcp
//! target's checks of what a peer sends ([`Served`]); the handshake's target side.

use std::sync::{Arc, RwLock};

use crate::batch::{Batch, Job};
use crate::engine::{self, Engine, EngineConfig, Known, Peer};
use crate::error::{Error, Result};
use crate::frame::Entry;
use crate::region::{AccessKey, Location, Region, RegionId};
use crate::segment::{DESCRIPTOR_VERSION, Endpoints, RegionDesc, SegmentDescriptor};
use crate::transport::select::Selection;
use crate::transport::{Piece, Transport, TransportKind, TransportStats};

/// A link that carries nothing: planning stops before a transport is involved.
#[derive(Debug)]
struct Unconnected(TransportKind);

impl Transport for Unconnected {
    fn kind(&self) -> TransportKind {
        self.0
    }
    fn submit(&self, _pieces: Vec<Piece>, job: Arc<Job>) {
        job.expect_pieces(1);
        job.piece_failed(Error::ShuttingDown);
    }
    fn stats(&self) -> TransportStats {
        TransportStats::default()
    }
}

/// An engine with one shm thread: the fuzz targets plan and check, they move nothing.
fn small_engine(name: &str) -> Result<Engine> {
    Engine::new(EngineConfig {
        name: name.into(),
        shm_threads: 1,
        ..EngineConfig::default()
    })
}

/// One planned piece, as plain numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub local_region: RegionId,
    pub local_offset: u64,
    pub remote: Entry,
    /// The caller's op the piece starts at.
    pub op: usize,
}

/// Local regions of the given lengths and a peer whose descriptor claims the given lengths.
#[derive(Debug)]
pub struct Planner {
    _engine: Engine,
    locals: Vec<Arc<Region>>,
    peers: Vec<Peer>,
}

impl Planner {
    /// Remote region `i` gets id `i + 1`; one peer per transport kind in `kinds`.
    pub fn new(local_lens: &[u64], remote_lens: &[u64], kinds: &[TransportKind]) -> Result<Self> {
        let engine = small_engine("fuzz")?;
        let locals = local_lens
            .iter()
            .map(|&len| engine.alloc(len))
            .collect::<Result<Vec<_>>>()?;
        let descriptor = SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "fuzz-peer".into(),
            node: "elsewhere".into(),
            regions: remote_lens
                .iter()
                .enumerate()
                .map(|(i, &len)| RegionDesc {
                    id: RegionId(i as u64 + 1),
                    len,
                    location: Location::Host { numa: None },
                    key: AccessKey(7),
                    shareable: true,
                    ipc: None,
                    rdma: Vec::new(),
                })
                .collect(),
            endpoints: Endpoints::default(),
        };
        let peers = kinds
            .iter()
            .map(|&kind| Peer {
                inner: engine.inner.clone(),
                known: RwLock::new(Known::new(descriptor.clone())),
                selection: Selection {
                    kind,
                    reason: "fuzzing".into(),
                },
                link: Box::new(Unconnected(kind)),
            })
            .collect();
        Ok(Planner {
            _engine: engine,
            locals,
            peers,
        })
    }

    /// The ids of the local regions, in the order their lengths were given.
    pub fn local_ids(&self) -> Vec<RegionId> {
        self.locals.iter().map(|r| r.id()).collect()
    }

    /// Plans `batch` on peer `peer` (the index into `kinds`) and returns its pieces, each
    /// checked against the region it names.
    pub fn plan(&self, peer: usize, batch: Batch) -> Result<Vec<Planned>> {
        let (planned, _handle) = self.peers[peer].plan(batch)?;
        let pieces = match planned {
            engine::Planned::Pieces(p) => p,
            engine::Planned::Table(t) => t.pieces(),
        };
        Ok(pieces
            .iter()
            .map(|p| {
                let region = self
                    .locals
                    .iter()
                    .find(|r| r.id() == p.local_region)
                    .expect("a piece names a local region");
                let base = region.range(0, "base", 0, 0).expect("empty range").ptr;
                assert_eq!(
                    p.local.ptr as usize - base as usize,
                    p.local_offset as usize,
                    "piece pointer and offset disagree"
                );
                assert_eq!(p.local.len as u64, p.remote.len);
                Planned {
                    local_region: p.local_region,
                    local_offset: p.local_offset,
                    remote: p.remote,
                    op: p.op,
                }
            })
            .collect())
    }
}

/// One tcp chunk as plain numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedChunk {
    /// (caller's op, remote offset, remote length, local length) of each piece, in order.
    pub pieces: Vec<(usize, u64, u64, u64)>,
    pub bytes: u64,
    /// The GPU the chunk is staged through, or None for host memory.
    pub device: Option<u32>,
    /// Where each piece's local bytes live.
    pub devices: Vec<Option<u32>>,
    /// (planes, blocks) of the table slice, for a chunk sent as a table manifest.
    pub table: Option<(std::ops::Range<usize>, std::ops::Range<usize>)>,
}

/// Most entries in one tcp manifest.
pub const MAX_CHUNK_ENTRIES: usize = crate::frame::MAX_ENTRIES as usize;

/// The tcp link's cut of pieces into chunks of about `chunk_bytes`: piece `i` is
/// `(remote offset, length, GPU or host)`.
pub fn tcp_chunks(chunk_bytes: u64, pieces: &[(u64, u64, Option<u32>)]) -> Vec<PlannedChunk> {
    crate::transport::tcp::fuzzing::chunks(chunk_bytes, pieces)
}

/// The tcp link's cut of a block table (plane `i`: `(block bytes, GPU or host)`) into
/// table chunks; `None` when it goes as op manifests instead.
pub fn tcp_table_chunks(
    chunk_bytes: u64,
    planes: &[(u64, Option<u32>)],
    blocks: u32,
) -> Option<Vec<PlannedChunk>> {
    crate::transport::tcp::fuzzing::table_chunks(chunk_bytes, planes, blocks)
}

/// One range a target's checks passed, as plain numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passed {
    pub region: RegionId,
    pub offset: u64,
    pub len: u64,
}

/// Regions of the given lengths, served as the tcp target serves them: what its checks pass
/// of the manifests and block tables a peer sends.
#[derive(Debug)]
pub struct Served {
    engine: Engine,
    regions: Vec<Arc<Region>>,
}

impl Served {
    pub fn new(lens: &[u64]) -> Result<Self> {
        let engine = small_engine("fuzz-target")?;
        let regions = lens
            .iter()
            .map(|&len| engine.alloc(len))
            .collect::<Result<Vec<_>>>()?;
        Ok(Served { engine, regions })
    }

    /// Id, key and length of each region, in the order their lengths were given.
    pub fn regions(&self) -> Vec<(RegionId, AccessKey, u64)> {
        self.regions
            .iter()
            .map(|r| (r.id(), r.key(), r.len()))
            .collect()
    }

    /// Where a passed range lies: it must be inside the region it was checked against.
    fn passed(&self, range: &crate::region::RawRange, region: RegionId) -> Passed {
        let r = self
            .regions
            .iter()
            .find(|r| r.id() == region)
            .expect("a passed range names a served region");
        let base = r.range(0, "base", 0, 0).expect("empty range").ptr as usize;
        let offset = (range.ptr as usize)
            .checked_sub(base)
            .expect("a passed range starts before its region") as u64;
        let len = range.len as u64;
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= r.len()),
            "a passed range ends past its region"
        );
        Passed {
            region,
            offset,
            len,
        }
    }

    /// A manifest's entries as the target checks them, with `staging_bytes` of staging.
    pub fn entries(
        &self,
        entries: &[Entry],
        writes: bool,
        staging_bytes: u64,
    ) -> Result<Vec<Passed>> {
        let checked = crate::transport::checked::Checked::entries(
            &self.engine.inner.regions,
            staging_bytes,
            entries,
            writes,
        )?;
        Ok(checked
            .ranges
            .iter()
            .zip(entries)
            .map(|(range, e)| self.passed(range, e.region))
            .collect())
    }

    /// A block table as the target checks it: plane by plane, block by block.
    pub fn table(
        &self,
        table: &crate::frame::TableManifest,
        writes: bool,
        staging_bytes: u64,
    ) -> Result<Vec<Passed>> {
        let checked = crate::transport::checked::Checked::table(
            &self.engine.inner.regions,
            staging_bytes,
            table,
            writes,
        )?;
        let blocks = table.blocks.len().max(1);
        Ok(checked
            .ranges
            .iter()
            .enumerate()
            .map(|(i, range)| self.passed(range, table.planes[i / blocks].region))
            .collect())
    }
}

/// An in-memory stream: reads come from `input`, writes are kept.
#[derive(Debug)]
struct Scripted<'a> {
    input: &'a [u8],
    output: Vec<u8>,
}

impl std::io::Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::io::Read::read(&mut self.input, buf)
    }
}

impl std::io::Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs the target side of the handshake against `input` (what a caller sends) with a fresh
/// secret, as the tcp and shm servers do. Returns whether the caller was admitted and what the
/// target wrote back.
pub fn serve_handshake(input: &[u8], segment_key: Option<u64>) -> (bool, Vec<u8>) {
    let secret = crate::auth::DataSecret::random();
    let gate = crate::handshake::Gate {
        secret: &secret,
        name: "fuzz-target",
        segment_key,
        idle_timeout: std::time::Duration::from_secs(1),
        handshake_timeout: std::time::Duration::from_secs(1),
        auth_log: &kvfabric_rt::Throttle::new(std::time::Duration::from_secs(1)),
    };
    let mut s = Scripted {
        input,
        output: Vec::new(),
    };
    let descriptor = || {
        Some(SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "fuzz-target".into(),
            node: "fuzz-node".into(),
            regions: Vec::new(),
            endpoints: Endpoints::default(),
        })
    };
    let outcome = crate::handshake::server(&mut s, "fuzz", gate, || {}, descriptor);
    if matches!(outcome, Err(crate::handshake::Refused::Unauthenticated(_))) {
        crate::handshake::refuse_stranger(&mut s);
    }
    let admitted = outcome.is_ok();
    (admitted, s.output)
}
