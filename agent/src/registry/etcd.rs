// TEMPORARY STUB (replaced by the registry branch).
use super::SharedRegistry;
use crate::error::Result;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
#[derive(Debug, Clone, Default)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub fabric: String,
    pub lease_ttl: Duration,
    pub tls: Option<EtcdTls>,
    pub auth: Option<(String, String)>,
    pub connect_timeout: Duration,
}
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub ca: PathBuf,
}
impl EtcdTls {
    pub fn from_dir(d: &Path) -> Result<Self> {
        Ok(EtcdTls { ca: d.into() })
    }
}
#[derive(Debug)]
pub struct EtcdRegistry;
impl EtcdRegistry {
    pub async fn connect(_c: EtcdConfig) -> Result<SharedRegistry> {
        Ok(Arc::new(super::memory::MemoryRegistry::new(
            super::memory::MemoryStore::new(),
        )))
    }
}
