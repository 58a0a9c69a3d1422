//! The peer API other agents call before opening data connections to this one.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::debug;

use crate::node::Node;
use crate::rpc::pb::peer_agent_server::PeerAgent;
use crate::rpc::pb::{HandshakeRequest, HandshakeResponse};

#[derive(Debug, Clone)]
pub struct PeerApi {
    pub node: Arc<Node>,
}

#[tonic::async_trait]
impl PeerAgent for PeerApi {
    async fn handshake(
        &self,
        request: Request<HandshakeRequest>,
    ) -> Result<Response<HandshakeResponse>, Status> {
        let req = request.into_inner();
        if req.fabric != self.node.config.fabric {
            return Err(Status::permission_denied(format!(
                "fabric {:?} is not this agent's fabric {:?}",
                req.fabric, self.node.config.fabric
            )));
        }
        debug!(peer = %req.agent, "peer handshake");
        Ok(Response::new(HandshakeResponse {
            agent: self.node.config.name.clone(),
            descriptor: self.node.descriptor().to_json(),
        }))
    }
}
