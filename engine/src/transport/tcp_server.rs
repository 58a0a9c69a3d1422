//! TCP, target side: one thread per data connection. Every manifest is checked in full (region,
//! key, bounds, overlaps) before the first payload byte is read; a refused chunk's payload is read
//! into scratch and dropped so the stream stays in step and the peer's next chunk still works.
//! Entries naming GPU regions are staged through the connection's pinned ring (see
//! [`super::staging`]) once the whole manifest has passed its checks.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tracing::{debug, info};

use super::TransportKind;
use super::io::{discard, hang_up, read_exact_vectored, read_to_len, write_all_vectored};
use super::listener::Admission;
use super::staging::{Span, Staging, device_of};
use super::target::ServedChunk;
use super::target::Target;
use crate::error::{Error, Result, Side};
use crate::frame::{
    FLAG_CRC, FrameError, FrameKind, Header, TraceContext, decode_crcs, decode_manifest,
    decode_trace,
};
use crate::handshake::{self, closed_or_io, read_header, send_error};
use crate::op::Opcode;
use crate::op::check_disjoint;
use crate::region::{Lease, Location, RawRange};

/// Largest refused payload we drain to keep a connection; past it we just close.
const DISCARD_LIMIT: u64 = 1 << 32;

/// A connection's manifest buffer is kept between chunks up to this size (4096 entries).
const MANIFEST_KEPT: usize = 128 << 10;

pub(crate) fn serve_conn(
    target: Arc<Target>,
    mut stream: TcpStream,
    peer: String,
    admission: Admission<TcpStream>,
) {
    if let Some(tls) = &target.config.tls {
        let deadline = std::time::Instant::now() + target.config.handshake_timeout;
        match super::tls_relay::server(stream, tls, deadline) {
            Ok(plain) => stream = plain,
            Err(e) => {
                debug!(%peer, error = %e, "tls handshake refused");
                return;
            }
        }
    }
    if handshake::accept(
        &mut stream,
        &peer,
        "tcp",
        target.gate(),
        || target.descriptor(),
        || admission.authenticated(),
    )
    .is_none()
    {
        return;
    }
    let mut conn = ServerConn {
        target,
        peer,
        manifest: Vec::new(),
        scratch: Vec::new(),
        trace: None,
        refusal: None,
        staging: None,
    };
    loop {
        match conn.serve_one(&mut stream) {
            Ok(()) => {}
            Err(Error::PeerClosed { .. }) | Err(Error::ShuttingDown) => break,
            Err(e) if e.timed_out() => {
                // Silent past the idle timeout (live initiators send KeepAlive), or stuck.
                debug!(peer = %conn.peer, "closing idle tcp data connection");
                break;
            }
            Err(e) => {
                // The stream can no longer be trusted to be in step: say why, then hang up.
                info!(peer = %conn.peer, error = %e, "closing tcp data connection");
                send_error(&mut stream, FrameKind::Ack, 0, &e);
                hang_up(&mut stream);
                break;
            }
        }
    }
    debug!(peer = %conn.peer, "tcp data connection closed");
}

struct ServerConn {
    target: Arc<Target>,
    peer: String,
    manifest: Vec<u8>,
    scratch: Vec<u8>,
    /// The trace context of the chunk being served, for the observer.
    trace: Option<TraceContext>,
    /// Why the chunk being served was refused (the connection lives on), for the observer.
    refusal: Option<String>,
    /// The pinned ring for GPU regions, made at the first chunk that names one.
    staging: Option<Staging>,
}

/// A manifest that passed every check: the leases keep the memory alive while we use it.
struct Checked {
    ranges: Vec<RawRange>,
    /// Where each range lives.
    locations: Vec<Location>,
    /// The first GPU any range lives on: the chunk must be staged.
    device: Option<u32>,
    _leases: Vec<Lease>,
}

impl Checked {
    fn spans(&self) -> Vec<Span> {
        self.ranges
            .iter()
            .copied()
            .zip(self.locations.iter().copied())
            .collect()
    }
}

impl ServerConn {
    fn serve_one(&mut self, s: &mut TcpStream) -> Result<()> {
        let h = read_header(s, &self.peer)?;
        let (started, clock) = (Instant::now(), SystemTime::now());
        self.trace = None;
        self.refusal = None;
        let (opcode, result) = match h.kind {
            // An idle initiator's sign of life: nothing to answer.
            FrameKind::KeepAlive if h.len == 0 && h.count == 0 => return Ok(()),
            FrameKind::WriteManifest => (Opcode::Write, self.write(s, &h)),
            FrameKind::ReadManifest => (Opcode::Read, self.read(s, &h)),
            kind => {
                return Err(FrameError::Unexpected {
                    kind,
                    expected: "a WriteManifest or ReadManifest frame",
                }
                .into());
            }
        };
        if let Some(observer) = &self.target.observer {
            observer.served(&ServedChunk {
                peer: &self.peer,
                opcode,
                ops: h.count,
                bytes: h.len,
                started: clock,
                elapsed: started.elapsed(),
                trace: self.trace,
                error: match &result {
                    Err(e) => Some(e.to_string()),
                    Ok(()) => self.refusal.take(),
                },
            });
        }
        result
    }

    fn entries(&mut self, s: &mut TcpStream, h: &Header) -> Result<Vec<crate::frame::Entry>> {
        read_to_len(s, &mut self.manifest, h.manifest_len())
            .map_err(|e| closed_or_io(e, &self.peer))?;
        self.trace = decode_trace(h, &self.manifest);
        let entries = decode_manifest(h, &self.manifest);
        // A connection keeps what a usual manifest needs, not the largest it was ever sent.
        if self.manifest.capacity() > MANIFEST_KEPT {
            self.manifest = Vec::new();
        }
        Ok(entries?)
    }

    fn check(&self, entries: &[crate::frame::Entry], writes: bool) -> Result<Checked> {
        let mut leases: Vec<Lease> = Vec::new();
        let mut ranges = Vec::with_capacity(entries.len());
        let mut locations = Vec::with_capacity(entries.len());
        let mut device = None;
        for (i, e) in entries.iter().enumerate() {
            if e.len == 0 {
                return Err(Error::ZeroLength { op: i });
            }
            let region = match leases.last() {
                Some(l) if l.region().id() == e.region => {
                    l.region().check_key(e.key, Side::Remote)?;
                    l.region().clone()
                }
                _ => {
                    let lease = self
                        .target
                        .regions
                        .lease_checked(e.region, e.key, Side::Remote)?;
                    let r = lease.region().clone();
                    leases.push(lease);
                    r
                }
            };
            // A device pointer is no host address: a socket never reads or writes through it;
            // its bytes go through the staging ring, or nowhere when staging is off.
            if let Some(d) = device_of(region.location()) {
                if self.target.config.staging_bytes == 0 {
                    return Err(Error::StagingNotConfigured {
                        op: i,
                        region: region.id(),
                        location: region.location(),
                        transport: TransportKind::Tcp,
                    });
                }
                device = device.or(Some(d));
            }
            ranges.push(region.range(i, "remote_offset", e.offset, e.len)?);
            locations.push(region.location());
        }
        if writes {
            check_disjoint(entries.len(), |i| {
                let e = &entries[i];
                (e.region, e.offset, e.len)
            })?;
        }
        Ok(Checked {
            ranges,
            locations,
            device,
            _leases: leases,
        })
    }

    /// The staging ring, made on first use (`NoCudaDriver` and friends when it cannot be).
    fn ring(&mut self, device: u32) -> Result<&mut Staging> {
        if self.staging.is_none() {
            self.staging = Some(Staging::new(self.target.config.staging_bytes, device)?);
        }
        Ok(self.staging.as_mut().expect("just made"))
    }

    /// A checked manifest whose GPU ranges cannot be staged is refused like a bad one.
    fn check_staged(&mut self, entries: &[crate::frame::Entry], writes: bool) -> Result<Checked> {
        let checked = self.check(entries, writes)?;
        if let Some(device) = checked.device {
            self.ring(device)?;
        }
        Ok(checked)
    }

    fn write(&mut self, s: &mut TcpStream, h: &Header) -> Result<()> {
        let entries = self.entries(s, h)?;
        let peer = self.peer.clone();
        let io = |e| closed_or_io(e, &peer);
        let checked = match self.check_staged(&entries, true) {
            Ok(c) => c,
            Err(refusal) => {
                if h.len > DISCARD_LIMIT {
                    return Err(refusal);
                }
                discard(s, h.len, &mut self.scratch).map_err(io)?;
                if h.has(FLAG_CRC) {
                    discard(s, h.count as u64 * 4, &mut self.scratch).map_err(io)?;
                }
                debug!(peer = %self.peer, error = %refusal, "write chunk refused");
                self.refusal = Some(refusal.to_string());
                send_error(s, FrameKind::Ack, h.tag, &refusal);
                return Ok(());
            }
        };
        let mut staged_crcs = None;
        if checked.device.is_some() {
            let mut crcs = h.has(FLAG_CRC).then(|| vec![0u32; checked.ranges.len()]);
            let spans = checked.spans();
            let ring = self.staging.as_mut().expect("made by check_staged");
            // Returns with every byte in place, or with no copy left running.
            ring.recv(s, &spans, crcs.as_deref_mut(), &io)?;
            staged_crcs = crcs;
        } else {
            let mut bufs: Vec<IoSliceMut<'_>> = checked
                .ranges
                .iter()
                // SAFETY: leased, bounds-checked and pairwise disjoint (checked above).
                .map(|r| IoSliceMut::new(unsafe { r.as_mut_slice() }))
                .collect();
            read_exact_vectored(s, &mut bufs).map_err(io)?;
        }
        if h.has(FLAG_CRC) {
            let mut raw = vec![0u8; h.count as usize * 4];
            s.read_exact(&mut raw).map_err(io)?;
            let crcs = decode_crcs(h.count, &raw)?;
            for (i, (r, expected)) in checked.ranges.iter().zip(crcs).enumerate() {
                let computed = match &staged_crcs {
                    Some(c) => c[i],
                    // SAFETY: leased; just written by this thread.
                    None => crc32c::crc32c(unsafe { r.as_slice() }),
                };
                if computed != expected {
                    let err = Error::Checksum {
                        op: i,
                        expected,
                        computed,
                    };
                    send_error(s, FrameKind::Ack, h.tag, &err);
                    return Ok(());
                }
            }
        }
        let ack = Header::new(FrameKind::Ack, h.tag, 0, 0);
        s.write_all(&ack.encode()).map_err(io)
    }

    fn read(&mut self, s: &mut TcpStream, h: &Header) -> Result<()> {
        let entries = self.entries(s, h)?;
        let peer = self.peer.clone();
        let io = |e| closed_or_io(e, &peer);
        let checked = match self.check_staged(&entries, false) {
            Ok(c) => c,
            Err(refusal) => {
                debug!(peer = %self.peer, error = %refusal, "read chunk refused");
                self.refusal = Some(refusal.to_string());
                send_error(s, FrameKind::ReadData, h.tag, &refusal);
                return Ok(());
            }
        };
        let crc = h.has(FLAG_CRC);
        let reply = Header::new(FrameKind::ReadData, h.tag, h.count, h.len).with_flags(if crc {
            FLAG_CRC
        } else {
            0
        });
        let head = reply.encode();
        if checked.device.is_some() {
            let mut crcs = crc.then(|| vec![0u32; checked.ranges.len()]);
            let spans = checked.spans();
            let ring = self.staging.as_mut().expect("made by check_staged");
            ring.send(s, &head, &spans, crcs.as_deref_mut(), &io)?;
            if let Some(crcs) = crcs {
                let trailer: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
                s.write_all(&trailer).map_err(io)?;
            }
            return Ok(());
        }
        let mut trailer = Vec::new();
        if crc {
            for r in &checked.ranges {
                // SAFETY: leased source range.
                trailer.extend_from_slice(&crc32c::crc32c(unsafe { r.as_slice() }).to_le_bytes());
            }
        }
        let mut bufs: Vec<IoSlice<'_>> = Vec::with_capacity(checked.ranges.len() + 2);
        bufs.push(IoSlice::new(&head));
        // SAFETY: leased, bounds-checked source ranges.
        bufs.extend(
            checked
                .ranges
                .iter()
                .map(|r| IoSlice::new(unsafe { r.as_slice() })),
        );
        if crc {
            bufs.push(IoSlice::new(&trailer));
        }
        write_all_vectored(s, &mut bufs).map_err(io)
    }
}
