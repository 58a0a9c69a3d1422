//! The peer API other agents call before opening data connections to this one (and, for rdma,
//! to exchange the QPs of the connection).

use std::sync::Arc;
use std::time::Duration;

use kvfabric_engine::ConnectInfo;
use tonic::{Request, Response, Status};
use tracing::{debug, warn};

use crate::error::Error;
use crate::holds;
use crate::node::Node;
use kvfabric_proto::limits::MAX_HOLD_TTL_MS;
use kvfabric_proto::pb::peer_agent_server::PeerAgent;
use kvfabric_proto::pb::{
    DeliverRequest, DeliverResponse, HandshakeRequest, HandshakeResponse, RdmaConnectRequest,
    RdmaConnectResponse, RevokeHoldRequest, RevokeHoldResponse, SegmentAccessRequest,
    SegmentAccessResponse,
};

#[derive(Debug, Clone)]
pub(crate) struct PeerApi {
    pub node: Arc<Node>,
}

impl PeerApi {
    /// The fabric a caller names must be ours. (The peer token was checked before the request
    /// body was read: `server.rs` puts [`crate::peer_token::PeerToken::interceptor`] in front of this service.)
    fn admit(&self, fabric: &str) -> Result<(), Status> {
        if fabric != self.node.config.fabric {
            return Err(Status::permission_denied(format!(
                "fabric {:?} is not this agent's fabric {:?}",
                fabric, self.node.config.fabric
            )));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl PeerAgent for PeerApi {
    async fn handshake(
        &self,
        request: Request<HandshakeRequest>,
    ) -> Result<Response<HandshakeResponse>, Status> {
        self.admit(&request.get_ref().fabric)?;
        let req = request.into_inner();
        debug!(peer = %req.agent, "peer handshake");
        // Endpoints only: what reaching a region takes is given per segment, for its key.
        let mut descriptor = self.node.descriptor();
        descriptor.regions.clear();
        Ok(Response::new(HandshakeResponse {
            agent: self.node.config.name.clone(),
            descriptor: descriptor.to_json(),
            data_secret: self.node.engine.data_secret().as_bytes().to_vec(),
        }))
    }

    async fn segment_access(
        &self,
        request: Request<SegmentAccessRequest>,
    ) -> Result<Response<SegmentAccessResponse>, Status> {
        self.admit(&request.get_ref().fabric)?;
        let req = request.into_inner();
        let (regions, grant) = self
            .node
            .segment_access(&req.agent, &req.segment, req.key)?;
        debug!(peer = %req.agent, segment = %req.segment, hold = grant.is_some(), "segment access");
        let regions_json = serde_json::to_string(&regions)
            .map_err(|e| Status::internal(format!("regions: {e}")))?;
        Ok(Response::new(SegmentAccessResponse {
            regions_json,
            grant: grant.map(|(g, left)| holds::to_wire(&g, left)),
        }))
    }

    async fn revoke_hold(
        &self,
        request: Request<RevokeHoldRequest>,
    ) -> Result<Response<RevokeHoldResponse>, Status> {
        self.admit(&request.get_ref().fabric)?;
        let req = request.into_inner();
        debug!(peer = %req.agent, segment = %req.segment, "revoke hold");
        // The caller's own deadline (grpc-timeout) ends the call too; this bounds the wait
        // when it sent none.
        let wait = Duration::from_millis(req.wait_ms.min(MAX_HOLD_TTL_MS));
        self.node
            .revoke_grant(&req.segment, req.hold_key, wait)
            .await?;
        Ok(Response::new(RevokeHoldResponse {}))
    }

    async fn deliver(
        &self,
        request: Request<DeliverRequest>,
    ) -> Result<Response<DeliverResponse>, Status> {
        self.admit(&request.get_ref().fabric)?;
        let req = request.into_inner();
        self.node
            .deliver(&req.segment, req.key, req.sender, req.message)?;
        Ok(Response::new(DeliverResponse {}))
    }

    async fn rdma_connect(
        &self,
        request: Request<RdmaConnectRequest>,
    ) -> Result<Response<RdmaConnectResponse>, Status> {
        self.admit(&request.get_ref().fabric)?;
        let req = request.into_inner();
        let offer = ConnectInfo::from_json(&req.agent, &req.connect_info_json)
            .map_err(|e| Status::from(Error::from(e)))?;
        debug!(peer = %req.agent, session = offer.session, qps = offer.qps.len(), "rdma connect");
        let engine = self.node.engine.clone();
        let peer = req.agent.clone();
        let answer = tokio::task::spawn_blocking(move || engine.rdma_accept(&peer, &offer))
            .await
            .map_err(|e| Status::internal(format!("rdma accept task: {e}")))?
            .map_err(|e| {
                warn!(peer = %req.agent, error = %e, "rdma connect refused");
                Status::from(Error::from(e))
            })?;
        Ok(Response::new(RdmaConnectResponse {
            connect_info_json: answer.to_json(),
        }))
    }
}
