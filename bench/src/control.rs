//! The bench's control channel: JSON lines over TCP beside the data plane. The initiator asks the
//! target to prepare pools, verify what it received, and to act as the raw-TCP ceiling.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};

use kvfabric_engine::{
    ConnectInfo, DataSecret, Location, RdmaExchange, RegionDesc, RegionId, SegmentDescriptor,
    TcpBuffer, TransportKind,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::pattern::{Expectation, Verdict};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    /// The target's segment descriptor.
    Hello,
    /// Register a pool of `bytes` filled block by block from `seed`, in host or GPU memory.
    Prepare {
        bytes: u64,
        block_size: u64,
        seed: u64,
        #[serde(default = "host")]
        location: Location,
    },
    /// Check every byte of a pool against what the initiator wrote.
    Verify {
        region: RegionId,
        expectation: Expectation,
    },
    Release {
        region: RegionId,
    },
    /// Ceiling: read a raw stream into random blocks of a `bytes` pool until EOF, then report
    /// the bytes.
    Sink {
        bytes: u64,
        block_size: u64,
        /// SO_SNDBUF/SO_RCVBUF on the target's end (None: autotuning).
        #[serde(default)]
        socket_buffer: Option<u32>,
        /// Above 1: one cache-resident buffer of `bytes`, named this many times per call
        /// (`scatter::Hot`).
        #[serde(default)]
        repeat: u32,
    },
    /// Ceiling: write a raw stream from random blocks of a `bytes` pool until the initiator hangs
    /// up.
    Source {
        bytes: u64,
        block_size: u64,
        #[serde(default)]
        socket_buffer: Option<u32>,
        #[serde(default)]
        repeat: u32,
    },
    /// Ceiling: answer each 32-byte request with `size` bytes; with `spin`, polling the socket
    /// without sleeping.
    PingPong {
        size: u64,
        #[serde(default)]
        spin: bool,
    },
    /// Test hook (`--test-corrupt`): XOR one byte of a host pool, as a stray write would.
    Poke {
        region: RegionId,
        offset: u64,
        xor: u8,
    },
    /// The initiator's rdma connection offer; answered with the target's QPs, connected.
    RdmaConnect {
        peer: String,
        offer: ConnectInfo,
    },
}

fn host() -> Location {
    Location::Host { numa: None }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    Segment {
        descriptor: SegmentDescriptor,
    },
    Prepared {
        descriptor: SegmentDescriptor,
        region: RegionDesc,
        /// The target engine's data secret, for its data connections. The bench's control
        /// channel is a test tool's: whoever reaches it can prepare and read pools anyway.
        secret: DataSecret,
    },
    Verified {
        verdict: Verdict,
    },
    Released,
    Poked,
    Ready,
    SinkDone {
        bytes: u64,
    },
    RdmaAnswer {
        answer: ConnectInfo,
    },
    Error {
        message: String,
    },
}

/// A blocking control connection (the bench's control calls are few and not on the data path).
#[derive(Debug)]
pub struct ControlClient {
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
}

impl ControlClient {
    /// The socket buffer size `buffer` gives a connection to this target (what kvfabric's own
    /// data connections to it get). None: autotuning.
    pub fn buffer_size(&self, buffer: TcpBuffer) -> Option<u32> {
        buffer.size_for(self.reader.get_ref())
    }

    pub fn connect(addr: SocketAddr) -> Result<Self> {
        let stream = TcpStream::connect(addr)
            .map_err(|e| Error::io(format!("connect control {addr}"), e))?;
        Ok(ControlClient {
            addr,
            reader: BufReader::new(stream),
        })
    }

    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Control {
            peer: self.addr.to_string(),
            reason: reason.into(),
        }
    }

    pub fn call(&mut self, req: &Request) -> Result<Reply> {
        let mut line = serde_json::to_vec(req).expect("request serializes");
        line.push(b'\n');
        self.reader
            .get_mut()
            .write_all(&line)
            .map_err(|e| self.err(e.to_string()))?;
        let mut answer = String::new();
        let n = self
            .reader
            .read_line(&mut answer)
            .map_err(|e| self.err(e.to_string()))?;
        if n == 0 {
            return Err(self.err("target closed the control connection"));
        }
        match serde_json::from_str(&answer) {
            Ok(Reply::Error { message }) => Err(self.err(message)),
            Ok(reply) => Ok(reply),
            Err(e) => Err(self.err(format!("bad reply {answer:?}: {e}"))),
        }
    }

    /// Opens a second connection for a raw-stream ceiling; returns it once the target is ready.
    pub fn raw(addr: SocketAddr, req: &Request) -> Result<TcpStream> {
        let mut s = TcpStream::connect(addr)
            .map_err(|e| Error::io(format!("connect control {addr}"), e))?;
        s.set_nodelay(true)
            .map_err(|e| Error::io("TCP_NODELAY", e))?;
        let mut line = serde_json::to_vec(req).expect("request serializes");
        line.push(b'\n');
        s.write_all(&line)
            .map_err(|e| Error::io("send ceiling request", e))?;
        // Read the reply byte by byte: nothing after the newline may be consumed.
        let mut answer = Vec::new();
        let mut b = [0u8; 1];
        loop {
            s.read_exact(&mut b)
                .map_err(|e| Error::io("read ceiling reply", e))?;
            if b[0] == b'\n' {
                break;
            }
            answer.push(b[0]);
        }
        match serde_json::from_slice(&answer) {
            Ok(Reply::Ready) => Ok(s),
            other => Err(Error::Control {
                peer: addr.to_string(),
                reason: format!("expected ready, got {other:?}"),
            }),
        }
    }
}

/// The engine's rdma exchange over the control channel: each offer (at connect, and at every
/// rebuild) goes to the target on a connection of its own.
#[derive(Debug)]
pub struct ControlExchange {
    pub addr: SocketAddr,
    /// The initiator engine's name (the target keeps the QPs under it).
    pub peer: String,
}

impl RdmaExchange for ControlExchange {
    fn exchange(&self, offer: &ConnectInfo) -> kvfabric_engine::Result<ConnectInfo> {
        let unavailable = |reason: String| kvfabric_engine::Error::TransportUnavailable {
            transport: TransportKind::Rdma,
            segment: format!("bench target at {}", self.addr),
            reason,
        };
        let reply = ControlClient::connect(self.addr)
            .and_then(|mut c| {
                c.call(&Request::RdmaConnect {
                    peer: self.peer.clone(),
                    offer: offer.clone(),
                })
            })
            .map_err(|e| unavailable(e.to_string()))?;
        match reply {
            Reply::RdmaAnswer { answer } => Ok(answer),
            other => Err(unavailable(format!(
                "expected an rdma answer, got {other:?}"
            ))),
        }
    }
}
