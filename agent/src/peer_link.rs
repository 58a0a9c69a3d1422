//! The calling side of the peer API: one handshake with another agent returns its data-plane
//! descriptor, from which the engine opens data connections.

use std::time::Duration;

use kvfabric_engine::SegmentDescriptor;
use tonic::transport::Endpoint;

use crate::error::{Error, Result};
use crate::registry::AgentEntry;
use crate::rpc::pb::HandshakeRequest;
use crate::rpc::pb::peer_agent_client::PeerAgentClient;

pub async fn handshake(
    agent: &AgentEntry,
    fabric: &str,
    me: &str,
    timeout: Duration,
) -> Result<SegmentDescriptor> {
    let fail = |reason: String| Error::PeerAgent {
        agent: agent.name.clone(),
        addr: agent.peer_addr.to_string(),
        reason,
    };
    let endpoint = Endpoint::from_shared(format!("http://{}", agent.peer_addr))
        .map_err(|e| fail(e.to_string()))?
        .connect_timeout(timeout)
        .timeout(timeout);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| fail(format!("connect: {e}")))?;
    let reply = PeerAgentClient::new(channel)
        .handshake(HandshakeRequest {
            fabric: fabric.into(),
            agent: me.into(),
        })
        .await
        .map_err(|s| fail(format!("handshake: {}", s.message())))?
        .into_inner();
    if reply.agent != agent.name {
        return Err(fail(format!(
            "answered as agent {:?}: the registry entry is stale",
            reply.agent
        )));
    }
    SegmentDescriptor::from_json(&reply.descriptor).map_err(|e| fail(e.to_string()))
}
