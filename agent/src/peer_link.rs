//! The calling side of the peer API: one handshake with another agent returns its data-plane
//! descriptor, from which the engine opens data connections; for rdma, the connection's QPs are
//! exchanged through it too (`PeerExchange`).

use std::sync::Arc;
use std::time::Duration;

use kvfabric_engine::{
    ConnectInfo, DataSecret, RdmaExchange, RegionDesc, SegmentDescriptor, TransportKind,
};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request};

use crate::error::{Error, Result};
use crate::holds::Grant;
use crate::peer_tls::PeerTls;
use crate::peer_token::PeerToken;
use crate::registry::AgentEntry;
use kvfabric_proto::limits::MAX_PEER_RESPONSE_BYTES;
use kvfabric_proto::pb::peer_agent_client::PeerAgentClient;
use kvfabric_proto::pb::{
    DeliverRequest, HandshakeRequest, RdmaConnectRequest, RevokeHoldRequest, SegmentAccessRequest,
};

fn failure(agent: &AgentEntry, reason: String) -> Error {
    Error::PeerAgent {
        agent: agent.name.clone(),
        addr: agent.peer_addr.to_string(),
        reason,
    }
}

async fn dial(
    agent: &AgentEntry,
    timeout: Duration,
    tls: Option<&PeerTls>,
) -> Result<PeerAgentClient<Channel>> {
    dial_for(agent, timeout, timeout, tls).await
}

/// `dial`, with calls allowed `answer` (a revocation waits for the peer's batches).
async fn dial_for(
    agent: &AgentEntry,
    timeout: Duration,
    answer: Duration,
    tls: Option<&PeerTls>,
) -> Result<PeerAgentClient<Channel>> {
    // http: with mTLS the connector does the TLS (with the certificate in use at the time of
    // the dial), which tonic's own TLS settings, fixed once, could not.
    let endpoint = Endpoint::from_shared(format!("http://{}", agent.peer_addr))
        .map_err(|e| failure(agent, e.to_string()))?
        .connect_timeout(timeout)
        .timeout(answer);
    let channel = match tls {
        Some(tls) => endpoint.connect_with_connector(tls.connector()).await,
        None => endpoint.connect().await,
    }
    .map_err(|e| failure(agent, format!("connect: {}", error_chain(&e))))?;
    Ok(PeerAgentClient::new(channel))
}

/// tonic's connect error says only "transport error"; the cause (refused, a certificate the
/// CA did not sign) is further down.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// How this agent calls other agents' peer API: as whom, for which fabric, with which token.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    pub fabric: String,
    pub me: String,
    pub timeout: Duration,
    pub token: Option<PeerToken>,
    pub tls: Option<Arc<PeerTls>>,
}

impl Caller {
    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(token) = &self.token {
            token.attach(&mut request);
        }
        request
    }

    /// The data-plane descriptor of `agent` (endpoints, no regions) and its engine's data secret.
    pub(crate) async fn handshake(
        &self,
        agent: &AgentEntry,
    ) -> Result<(SegmentDescriptor, DataSecret)> {
        let fail = |reason: String| failure(agent, reason);
        let reply = dial(agent, self.timeout, self.tls.as_deref())
            .await?
            .handshake(self.request(HandshakeRequest {
                fabric: self.fabric.clone(),
                agent: self.me.clone(),
            }))
            .await
            .map_err(|s| fail(format!("handshake: {}", s.message())))?
            .into_inner();
        if reply.agent != agent.name {
            return Err(fail(format!(
                "answered as agent {:?}: the registry entry is stale",
                reply.agent
            )));
        }
        let secret = DataSecret::from_bytes(&reply.data_secret).map_err(|e| fail(e.to_string()))?;
        let descriptor =
            SegmentDescriptor::from_json(&reply.descriptor).map_err(|e| fail(e.to_string()))?;
        Ok((descriptor, secret))
    }

    /// The regions of `segment` at `agent`, for the segment's `key`, or for a hold's key with
    /// the hold's grant and its time left; answered within `wait` (the batch's time left: a
    /// peer slowed by a loaded node has all of it, not just the connect timeout).
    pub(crate) async fn segment_access(
        &self,
        agent: &AgentEntry,
        segment: &str,
        key: u64,
        wait: Duration,
    ) -> Result<(Vec<RegionDesc>, Option<(Grant, Duration)>)> {
        let mut request = self.request(SegmentAccessRequest {
            fabric: self.fabric.clone(),
            agent: self.me.clone(),
            segment: segment.into(),
            key,
        });
        request.set_timeout(wait);
        let reply = dial_for(agent, self.timeout.min(wait), wait, self.tls.as_deref())
            .await?
            // A grant of 2^20 block ids is up to 10 MiB.
            .max_decoding_message_size(MAX_PEER_RESPONSE_BYTES)
            .segment_access(request)
            .await
            .map_err(|s| match s.code() {
                Code::PermissionDenied => Error::WrongKey {
                    name: segment.into(),
                },
                Code::NotFound => Error::PeerAgent {
                    agent: agent.name.clone(),
                    addr: agent.peer_addr.to_string(),
                    reason: format!(
                        "does not serve segment {:?} (the registry entry is stale)",
                        kvfabric_proto::limits::echo(segment)
                    ),
                },
                _ => failure(agent, format!("segment access: {}", s.message())),
            })?
            .into_inner();
        let regions = serde_json::from_str(&reply.regions_json)
            .map_err(|e| failure(agent, format!("segment access: regions: {e}")))?;
        let grant = reply
            .grant
            .map(crate::holds::from_wire)
            .transpose()
            .map_err(|e| failure(agent, format!("segment access: grant: {e}")))?;
        Ok((regions, grant))
    }

    /// Asks `agent` to drop its grant of hold `hold_key` on `segment` and to answer once its
    /// batches under it can no longer land; at most `wait`.
    pub(crate) async fn revoke_hold(
        &self,
        agent: &AgentEntry,
        segment: &str,
        hold_key: u64,
        wait: Duration,
    ) -> Result<()> {
        let mut request = self.request(RevokeHoldRequest {
            fabric: self.fabric.clone(),
            agent: self.me.clone(),
            segment: segment.into(),
            hold_key,
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        });
        request.set_timeout(wait);
        dial_for(agent, self.timeout.min(wait), wait, self.tls.as_deref())
            .await?
            .revoke_hold(request)
            .await
            .map_err(|s| {
                failure(
                    agent,
                    format!("revoke hold: {:?}: {}", s.code(), s.message()),
                )
            })?;
        Ok(())
    }

    /// Queues a worker's message at `agent` for the registrant of `segment`, within `wait`.
    pub(crate) async fn deliver(
        &self,
        agent: &AgentEntry,
        segment: &str,
        key: u64,
        sender: String,
        message: Vec<u8>,
        wait: Duration,
    ) -> Result<()> {
        let mut request = self.request(DeliverRequest {
            fabric: self.fabric.clone(),
            agent: self.me.clone(),
            segment: segment.into(),
            key,
            sender,
            message,
        });
        request.set_timeout(wait);
        dial_for(agent, self.timeout.min(wait), wait, self.tls.as_deref())
            .await?
            .deliver(request)
            .await
            .map_err(|s| match s.code() {
                Code::PermissionDenied => Error::WrongKey {
                    name: segment.into(),
                },
                Code::ResourceExhausted => Error::Exhausted {
                    resource: "notifications queued for the segment at its agent",
                    limit: kvfabric_proto::limits::MAX_QUEUED_NOTIFICATIONS,
                },
                Code::NotFound => Error::UnknownSegment {
                    name: segment.into(),
                },
                _ => failure(agent, format!("deliver: {:?}: {}", s.code(), s.message())),
            })?;
        Ok(())
    }

    /// Sends an rdma connection offer to `agent` and returns its answer.
    pub(crate) async fn rdma_connect(
        &self,
        agent: &AgentEntry,
        offer: &ConnectInfo,
    ) -> Result<ConnectInfo> {
        let reply = dial(agent, self.timeout, self.tls.as_deref())
            .await?
            .rdma_connect(self.request(RdmaConnectRequest {
                fabric: self.fabric.clone(),
                agent: self.me.clone(),
                connect_info_json: offer.to_json(),
            }))
            .await
            .map_err(|s| failure(agent, format!("rdma connect: {}", s.message())))?
            .into_inner();
        Ok(ConnectInfo::from_json(
            &agent.name,
            &reply.connect_info_json,
        )?)
    }
}

/// The engine's [`RdmaExchange`] over the peer API: the offer goes to the peer agent's
/// `RdmaConnect`, at connect time and whenever the engine rebuilds the connection.
#[derive(Debug)]
pub(crate) struct PeerExchange {
    pub agent: AgentEntry,
    pub caller: Caller,
    /// The agent's runtime: the engine calls from its own threads.
    pub runtime: tokio::runtime::Handle,
}

impl RdmaExchange for PeerExchange {
    fn exchange(&self, offer: &ConnectInfo) -> kvfabric_engine::Result<ConnectInfo> {
        let answer = self
            .runtime
            .block_on(self.caller.rdma_connect(&self.agent, offer));
        answer.map_err(|e| match e {
            Error::Engine(e) => e,
            other => kvfabric_engine::Error::TransportUnavailable {
                transport: TransportKind::Rdma,
                segment: self.agent.name.clone(),
                reason: other.to_string(),
            },
        })
    }
}
