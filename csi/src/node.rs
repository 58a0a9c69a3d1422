//! The CSI Identity and Node services: publish binds a pool's socket directory onto the pod's
//! target; unpublish takes it away and, after the last pod of that directory, removes the
//! directory (the sockets of an agent that is gone, or of a fabric that was deleted).

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use kvfabric_proto::contract::csi;
use tonic::{Request, Response, Status};

use crate::config::Config;
use crate::ledger::Ledger;
use crate::pb::csi as pb;
use crate::volume::{self, Volume};
use crate::{Error, Result, mounts};

/// The driver's state: its settings and the volumes it has published.
#[derive(Clone, Debug)]
pub struct Node {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Config,
    /// One publish or unpublish at a time: each is a few system calls, and the count of a
    /// directory's users must not change between the check and the removal.
    ledger: Mutex<Ledger>,
}

impl Node {
    /// Opens the state directory in the socket root.
    pub fn open(config: Config) -> Result<Self> {
        let ledger = Ledger::open(&config.socket_root)?;
        tracing::info!(volumes = ledger.len(), root = %config.socket_root.display(), "state read");
        Ok(Node {
            inner: Arc::new(Inner {
                config,
                ledger: Mutex::new(ledger),
            }),
        })
    }

    /// Publishes one volume (what `NodePublishVolume` does, without gRPC).
    pub fn publish(&self, req: &pb::NodePublishVolumeRequest) -> Result<Volume> {
        let config = &self.inner.config;
        let v = volume::publish_request(req, &config.kubelet_dir)?;
        let mut ledger = self
            .inner
            .ledger
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match ledger.get(&v.volume_id) {
            // The kubelet retries a publish whose answer it did not see: the same again is done.
            Some(old) if *old == v && mounts::is_mount_point(&v.target)? => return Ok(v),
            // Recorded, then the driver stopped before the mount: make it now.
            Some(old) if *old == v => {}
            Some(old) => {
                return Err(Error::Conflict {
                    volume_id: v.volume_id,
                    target: old.target.display().to_string(),
                });
            }
            None if ledger.len() >= config.max_volumes => {
                return Err(Error::Exhausted {
                    published: ledger.len(),
                });
            }
            None => {}
        }
        // The target first: a refused one leaves no socket directory behind.
        std::fs::create_dir_all(&v.target)
            .map_err(Error::io(format!("create {}", v.target.display())))?;
        if mounts::is_mount_point(&v.target)? {
            return Err(Error::invalid(
                "target_path",
                &v.target.display().to_string(),
                "is a mount point of another volume",
            ));
        }
        let source = config.socket_root.join(&v.dir);
        std::fs::create_dir_all(&source)
            .map_err(Error::io(format!("create {}", source.display())))?;
        let meta = std::fs::symlink_metadata(&source)
            .map_err(Error::io(format!("stat {}", source.display())))?;
        if !meta.file_type().is_dir() {
            return Err(Error::invalid(
                "volume_context[pool]",
                &source.display().to_string(),
                "the socket directory is not a directory (a symlink is never followed)",
            ));
        }
        ledger.record(v.clone())?;
        if let Err(e) = mounts::bind(&source, &v.target, v.readonly) {
            let _ = ledger.forget(&v.volume_id);
            remove_if_unused(&ledger, &config.socket_root, &v.dir);
            return Err(e);
        }
        tracing::info!(
            volume = %v.volume_id, dir = %v.dir.display(), target = %v.target.display(),
            readonly = v.readonly, "published"
        );
        Ok(v)
    }

    /// Unpublishes one volume (what `NodeUnpublishVolume` does); a volume not published at the
    /// target is done already, as the spec asks.
    pub fn unpublish(&self, req: &pb::NodeUnpublishVolumeRequest) -> Result<()> {
        let config = &self.inner.config;
        let id = volume::check_volume_id(&req.volume_id)?;
        let target = volume::check_target(&req.target_path, &config.kubelet_dir)?;
        let mut ledger = self
            .inner
            .ledger
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let recorded = ledger.get(id).cloned();
        if let Some(v) = &recorded
            && v.target != target
        {
            return Err(Error::invalid(
                "target_path",
                &req.target_path,
                "the volume is published at another target",
            ));
        }
        if mounts::is_mount_point(&target)? {
            mounts::unbind(&target)?;
        }
        match std::fs::remove_dir(&target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("remove {}", target.display()))(e)),
        }
        if let Some(v) = recorded {
            ledger.forget(id)?;
            remove_if_unused(&ledger, &config.socket_root, &v.dir);
            tracing::info!(volume = %id, dir = %v.dir.display(), "unpublished");
        }
        Ok(())
    }
}

/// Removes `<root>/<dir>` (the sockets of an agent whose pods have all gone) and then its
/// fabric and namespace directories if empty. Failures are logged: the pod is gone either way.
fn remove_if_unused(ledger: &Ledger, root: &Path, dir: &Path) {
    if ledger.uses(dir) {
        return;
    }
    let path = root.join(dir);
    // remove_dir_all never follows a symlink an agent may have left in its directory.
    match std::fs::remove_dir_all(&path) {
        Ok(()) => tracing::info!(dir = %path.display(), "socket directory removed: no pod uses it"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %path.display(), error = %e, "cannot remove socket directory")
        }
    }
    for parent in dir
        .ancestors()
        .skip(1)
        .filter(|p| !p.as_os_str().is_empty())
    {
        // Fails while another pool or fabric of the namespace still has a directory: fine.
        if std::fs::remove_dir(root.join(parent)).is_err() {
            break;
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T, Status> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(Status::from),
        Err(e) => Err(Status::internal(format!("the call's task failed: {e}"))),
    }
}

#[tonic::async_trait]
impl pb::node_server::Node for Node {
    async fn node_publish_volume(
        &self,
        request: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let node = self.clone();
        let req = request.into_inner();
        blocking(move || node.publish(&req)).await?;
        Ok(Response::new(pb::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let node = self.clone();
        let req = request.into_inner();
        blocking(move || node.unpublish(&req)).await?;
        Ok(Response::new(pb::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        // No staging, stats or expansion: publish and unpublish are all there is.
        Ok(Response::new(pb::NodeGetCapabilitiesResponse {
            capabilities: Vec::new(),
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        Ok(Response::new(pb::NodeGetInfoResponse {
            node_id: self.inner.config.node_id.clone(),
            // 0: no limit for the scheduler to count; --max-volumes bounds the node itself.
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

#[tonic::async_trait]
impl pb::identity_server::Identity for Node {
    async fn get_plugin_info(
        &self,
        _: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: csi::DRIVER.to_owned(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        // Node only: no controller service, no topology.
        Ok(Response::new(pb::GetPluginCapabilitiesResponse {
            capabilities: Vec::new(),
        }))
    }

    async fn probe(
        &self,
        _: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        // Ready from the start: the state was read before the socket was served.
        Ok(Response::new(pb::ProbeResponse { ready: Some(true) }))
    }
}
