use std::io;

// Values a caller sent are quoted cut short: an error must not grow with the input.
use kvfabric_proto::limits::echo;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Engine(#[from] kvfabric_engine::Error),

    #[error("invalid {field}: {:?} ({reason})", echo(.value))]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },

    /// A segment no agent serves, or (`delete_segment`) one this agent did not put.
    #[error("unknown segment {:?}", echo(.name))]
    UnknownSegment { name: String },

    /// etcd did not answer (down, partitioned, timed out). For writes, the entry is still
    /// remembered and gets published when the lease is re-established.
    #[error("etcd at {endpoints} unavailable for {op}: {reason}")]
    RegistryUnavailable {
        op: String,
        endpoints: String,
        reason: String,
    },

    /// etcd answered with an error (permission denied, bad request, ...).
    #[error("etcd at {endpoints} refused {op}: {reason}")]
    Registry {
        op: String,
        endpoints: String,
        reason: String,
    },

    /// etcd no longer holds the revisions a read or watch asked for: compaction dropped them,
    /// or etcd lost its data (wiped, restored) and counts revisions anew. Only a read of the
    /// current state catches up (the watcher then reads everything again).
    #[error("etcd at {endpoints} no longer holds the history {op} needed: {reason}")]
    RegistryCompacted {
        op: String,
        endpoints: String,
        reason: String,
    },

    /// etcd rejected the username or password.
    #[error("etcd at {endpoints} rejected user {user:?}: {reason}")]
    RegistryAuth {
        user: String,
        endpoints: String,
        reason: String,
    },

    #[error("segment {:?} already exists (served by agent {:?})", echo(.name), echo(.agent))]
    SegmentExists { name: String, agent: String },

    #[error("wrong key for segment {:?}", echo(.name))]
    WrongKey { name: String },

    /// A hold asked of an agent that does not serve the segment: holds are made where the
    /// segment's memory is registered.
    #[error(
        "segment {:?} is registered with agent {:?}, not this one: create its holds there",
        echo(.name),
        echo(.agent)
    )]
    SegmentElsewhere { name: String, agent: String },

    /// ExtendHold of a hold that is not live (never issued, expired, ended).
    #[error("no live hold with this key on segment {:?}", echo(.segment))]
    NoSuchHold { segment: String },

    /// A batch under a hold key whose hold has ended, expired or was never granted here.
    #[error("the hold on segment {:?} has ended or expired", echo(.segment))]
    HoldEnded { segment: String },

    /// A batch under a hold key that reaches past what the hold grants.
    #[error("hold on segment {:?}: {what}", echo(.segment))]
    OutsideHold { segment: String, what: String },

    /// EndHold: agents that were handed the hold did not confirm dropping it in time.
    #[error(
        "hold on segment {:?}: agent(s) {agents} did not confirm dropping it ({reason}); reads \
         under it may still land until it expires in {remaining_ms} ms: wait that long before \
         reusing its blocks, or call EndHold again",
        echo(.segment)
    )]
    HoldUnconfirmed {
        segment: String,
        agents: String,
        reason: String,
        remaining_ms: u64,
    },

    #[error("invalid {}: {} ({reason})", echo(.field), echo(.value))]
    InvalidRequest {
        field: String,
        value: String,
        reason: String,
    },

    /// A bounded resource a caller can make the agent hold is at its limit.
    #[error("too many {resource} (limit {limit}); retry once some are released")]
    Exhausted {
        resource: &'static str,
        limit: usize,
    },

    #[error("agent {:?} (serving segment {:?}) is not in the registry", echo(.agent), echo(.segment))]
    UnknownAgent { agent: String, segment: String },

    #[error("peer agent {agent:?} at {addr}: {reason}")]
    PeerAgent {
        agent: String,
        addr: String,
        reason: String,
    },

    /// The batch's deadline passed before its data moved (while dialling the peer, or asking it
    /// for the segment's regions).
    #[error("batch deadline of {millis} ms passed while {during}")]
    Deadline { during: &'static str, millis: u64 },

    /// A local client's HTTP/2 byte stream that cannot be parsed; its connection is closed.
    #[error("malformed HTTP/2 from a local client: {0}")]
    Http2(crate::authority::Http2Fault),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub fn config(field: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        Error::Config {
            field,
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    pub fn invalid(
        field: impl Into<String>,
        value: impl ToString,
        reason: impl Into<String>,
    ) -> Self {
        Error::InvalidRequest {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// A short, stable name for the kind of error (metrics label, span attribute).
    pub fn label(&self) -> &'static str {
        match self {
            Error::Engine(e) => e.code(),
            Error::Config { .. } => "config",
            Error::UnknownSegment { .. } => "unknown_segment",
            Error::RegistryUnavailable { .. } => "registry_unavailable",
            Error::Registry { .. } => "registry",
            Error::RegistryCompacted { .. } => "registry_compacted",
            Error::RegistryAuth { .. } => "registry_auth",
            Error::SegmentExists { .. } => "segment_exists",
            Error::WrongKey { .. } => "wrong_key",
            Error::SegmentElsewhere { .. } => "segment_elsewhere",
            Error::NoSuchHold { .. } => "unknown_hold",
            Error::HoldEnded { .. } => "hold_ended",
            Error::OutsideHold { .. } => "outside_hold",
            Error::HoldUnconfirmed { .. } => "hold_unconfirmed",
            Error::InvalidRequest { .. } => "invalid_request",
            Error::UnknownAgent { .. } => "unknown_agent",
            Error::Exhausted { .. } => "exhausted",
            Error::PeerAgent { .. } => "peer_agent",
            Error::Deadline { .. } => "timeout",
            Error::Http2(_) => "http2",
            Error::Io { .. } => "io",
        }
    }

    /// Bad configuration exits 64 (EX_USAGE); everything else is a runtime failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Config { .. } | Error::Engine(kvfabric_engine::Error::InvalidConfig { .. }) => {
                64
            }
            _ => 1,
        }
    }
}
