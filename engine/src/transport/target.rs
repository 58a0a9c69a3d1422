//! What this engine's tcp and shm servers serve: its regions, the settings they apply to callers,
//! and who is told about the chunks they serve. The servers depend on this, not on the engine.

use std::sync::Arc;
use std::time::Duration;

use super::listener::Limits;
use crate::auth::DataSecret;
use crate::engine_config::EngineConfig;
use crate::handshake::Gate;
use crate::region_table::RegionTable;
use crate::segment::SegmentDescriptor;
use kvfabric_rt::Throttle;

/// A chunk this engine served as the target.
#[derive(Debug, Clone)]
pub struct ServedChunk<'a> {
    pub peer: &'a str,
    pub opcode: crate::op::Opcode,
    pub ops: u32,
    pub bytes: u64,
    pub started: std::time::SystemTime,
    pub elapsed: Duration,
    pub trace: Option<crate::frame::TraceContext>,
    /// Why the chunk was refused or failed.
    pub error: Option<String>,
}

pub trait ServeObserver: Send + Sync + std::fmt::Debug {
    fn served(&self, chunk: &ServedChunk<'_>);
}

/// How the target describes itself to a caller entitled to its descriptor (None once the
/// engine is gone).
pub(crate) type Describe = Box<dyn Fn() -> Option<SegmentDescriptor> + Send + Sync>;

pub(crate) struct Target {
    pub regions: Arc<RegionTable>,
    pub config: EngineConfig,
    pub observer: Option<Arc<dyn ServeObserver>>,
    /// `config.data_secret`, or the one generated at start.
    pub secret: DataSecret,
    /// Failed authentications are logged at most this often.
    pub auth_log: Throttle,
    describe: Describe,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.config.name)
            .field("regions", &self.regions)
            .finish_non_exhaustive()
    }
}

impl Target {
    pub(crate) fn new(
        regions: Arc<RegionTable>,
        config: EngineConfig,
        secret: DataSecret,
        describe: Describe,
    ) -> Target {
        Target {
            regions,
            observer: config.observer.clone(),
            config,
            secret,
            auth_log: Throttle::new(Duration::from_secs(10)),
            describe,
        }
    }

    /// This engine's descriptor, region keys included.
    pub(crate) fn descriptor(&self) -> Option<SegmentDescriptor> {
        (self.describe)()
    }

    /// How many connections each listener serves.
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            connections: self.config.max_connections,
            unauthenticated: self.config.max_unauthenticated,
        }
    }

    /// What callers are checked against.
    pub(crate) fn gate(&self) -> Gate<'_> {
        Gate {
            secret: &self.secret,
            name: &self.config.name,
            segment_key: self.config.segment_key,
            idle_timeout: self.config.idle_timeout,
            handshake_timeout: self.config.handshake_timeout,
            auth_log: &self.auth_log,
        }
    }
}
