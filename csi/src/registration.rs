//! The kubelet's plugin registration: it finds the socket in `plugins_registry/`, asks where the
//! CSI socket is, and tells the result. A refused registration ends the driver (the pod restarts
//! and registers again), as the node-driver-registrar sidecar does.

use std::path::PathBuf;

use kvfabric_proto::contract::csi;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::pb::registration as pb;

/// CSI versions the driver speaks.
pub const SUPPORTED_VERSIONS: [&str; 1] = ["1.0.0"];

/// What the kubelet said last: `None` before it said anything.
pub type Outcome = Option<Result<(), String>>;

/// The Registration service.
#[derive(Debug)]
pub struct Registration {
    endpoint: PathBuf,
    said: watch::Sender<Outcome>,
}

impl Registration {
    /// Tells the kubelet that the CSI socket is at `endpoint` (a path on the node).
    pub fn new(endpoint: PathBuf) -> (Self, watch::Receiver<Outcome>) {
        let (said, heard) = watch::channel(None);
        (Registration { endpoint, said }, heard)
    }
}

#[tonic::async_trait]
impl pb::registration_server::Registration for Registration {
    async fn get_info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::PluginInfo>, Status> {
        Ok(Response::new(pb::PluginInfo {
            r#type: "CSIPlugin".to_owned(),
            name: csi::DRIVER.to_owned(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: SUPPORTED_VERSIONS.map(str::to_owned).to_vec(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<pb::RegistrationStatus>,
    ) -> Result<Response<pb::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let outcome = if status.plugin_registered {
            tracing::info!("registered with the kubelet");
            Ok(())
        } else {
            tracing::error!(error = %status.error, "the kubelet refused the registration");
            Err(status.error)
        };
        self.said.send_replace(Some(outcome));
        Ok(Response::new(pb::RegistrationStatusResponse {}))
    }
}
