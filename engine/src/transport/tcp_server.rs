//! TCP, target side: one thread per data connection. Every manifest is checked in full (region,
//! key, bounds, overlaps) before the first payload byte is read; a refused chunk's payload is read
//! into scratch and dropped so the stream stays in step and the peer's next chunk still works.
//! Entries naming GPU regions are staged through the connection's pinned ring (see
//! [`super::staging`]) once the whole manifest has passed its checks.

use std::io::{BufReader, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tracing::{debug, info};

use super::checked::Checked;
use super::data_stream::{DataStream, Out};
use super::io::{
    SpinReader, discard, extend_to_len, hang_up, read_exact_vectored, read_to_len, spin_fill,
    write_all_vectored,
};
use super::listener::Admission;
use super::staging::Staging;
use super::target::ServedChunk;
use super::target::Target;
use crate::error::{Error, Result};
use crate::frame::{
    FLAG_CRC, FLAG_TRACE, FrameError, FrameKind, Header, TABLE_HEAD_LEN, TRACE_LEN, TableHead,
    TableManifest, TraceContext, decode_crcs, decode_manifest, decode_table, decode_trace,
};
use crate::handshake::{self, closed_or_io, read_header, send_error};
use crate::op::Opcode;

/// Largest refused payload we drain to keep a connection; past it we just close.
const DISCARD_LIMIT: u64 = 1 << 32;

/// A connection's manifest buffer is kept between chunks up to this size (4096 entries).
const MANIFEST_KEPT: usize = 128 << 10;

/// Bytes asked of the socket at once when a frame begins: its header and manifest (and a small
/// write's payload) then take one read, not one each. Payload reads this large or larger go
/// straight into the destination.
const READ_AHEAD: usize = 16 << 10;

pub(crate) fn serve_conn(
    target: Arc<Target>,
    stream: TcpStream,
    peer: String,
    admission: Admission<TcpStream>,
) {
    if let Err(e) = target.config.tcp_buffer.apply(&stream) {
        // The connection still works, with the kernel's buffers.
        debug!(%peer, error = %e, "tcp buffer sizes not set");
    }
    let deadline = std::time::Instant::now() + target.config.handshake_timeout;
    let mut stream = match DataStream::accept(stream, target.config.tls.as_ref(), deadline) {
        Ok(s) => s,
        Err(e) => {
            debug!(%peer, error = %e, "tls handshake refused");
            return;
        }
    };
    if handshake::accept(
        &mut stream,
        &peer,
        "tcp",
        target.gate(),
        || target.descriptor(),
        || {
            admission.proven();
        },
    )
    .is_none()
    {
        return;
    }
    let (writer, input) = match stream.split() {
        Ok((w, r)) => (w, BufReader::with_capacity(READ_AHEAD, r)),
        Err(e) => {
            info!(%peer, error = %e, "closing tcp data connection");
            return;
        }
    };
    let mut conn = ServerConn {
        target,
        peer,
        input,
        manifest: Vec::new(),
        scratch: Vec::new(),
        trace: None,
        refusal: None,
        staging: None,
    };
    loop {
        // The writer's turn ends with the chunk: the error path below takes it again.
        let served = conn.serve_one(&mut writer.lock());
        match served {
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
                send_error(&mut writer.lock(), FrameKind::Ack, 0, &e);
                writer.close_notify();
                if let Ok(mut s) = writer.socket().try_clone() {
                    hang_up(&mut s);
                }
                break;
            }
        }
    }
    debug!(peer = %conn.peer, "tcp data connection closed");
}

struct ServerConn {
    target: Arc<Target>,
    peer: String,
    /// The read half: every frame is read through it, replies are written to the stream.
    input: BufReader<SpinReader<TcpStream>>,
    manifest: Vec<u8>,
    scratch: Vec<u8>,
    /// The trace context of the chunk being served, for the observer.
    trace: Option<TraceContext>,
    /// Why the chunk being served was refused (the connection lives on), for the observer.
    refusal: Option<String>,
    /// The pinned ring for GPU regions, made at the first chunk that names one.
    staging: Option<Staging>,
}

impl ServerConn {
    fn serve_one(&mut self, s: &mut Out<'_>) -> Result<()> {
        let spin = self.target.config.spin_wait;
        // The initiator's next request often follows its last reply within microseconds;
        // whether it came or not, the read below waits as ever (with the idle timeout).
        spin_fill(&mut self.input, spin, None);
        let h = read_header(&mut self.input, &self.peer)?;
        let (started, clock) = (Instant::now(), SystemTime::now());
        self.trace = None;
        self.refusal = None;
        let (opcode, result) = match h.kind {
            // An idle initiator's sign of life: nothing to answer.
            FrameKind::KeepAlive if h.len == 0 && h.count == 0 => return Ok(()),
            FrameKind::WriteManifest | FrameKind::WriteTable => (Opcode::Write, self.write(s, &h)),
            FrameKind::ReadManifest | FrameKind::ReadTable => (Opcode::Read, self.read(s, &h)),
            kind => {
                return Err(FrameError::Unexpected {
                    kind,
                    expected: "a manifest (WriteManifest, ReadManifest, WriteTable, ReadTable)",
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

    fn entries(&mut self, h: &Header) -> Result<Vec<crate::frame::Entry>> {
        read_to_len(&mut self.input, &mut self.manifest, h.manifest_len())
            .map_err(|e| closed_or_io(e, &self.peer))?;
        self.trace = decode_trace(h, &self.manifest);
        let entries = decode_manifest(h, &self.manifest);
        // A connection keeps what a usual manifest needs, not the largest it was ever sent.
        if self.manifest.capacity() > MANIFEST_KEPT {
            self.manifest = Vec::new();
        }
        Ok(entries?)
    }

    /// The trace block and table manifest of a table chunk: the fixed head first, then (its
    /// sizes bounded) the planes and ids.
    fn table(&mut self, h: &Header) -> Result<TableManifest> {
        let io = |e| closed_or_io(e, &self.peer);
        let pre = if h.has(FLAG_TRACE) { TRACE_LEN } else { 0 };
        read_to_len(&mut self.input, &mut self.manifest, pre + TABLE_HEAD_LEN).map_err(io)?;
        self.trace = decode_trace(h, &self.manifest);
        let head = TableHead::decode(h, self.manifest[pre..].try_into().expect("head length"))?;
        extend_to_len(
            &mut self.input,
            &mut self.manifest,
            pre + TABLE_HEAD_LEN + head.body_len(),
        )
        .map_err(io)?;
        let table = decode_table(h, &head, &self.manifest[pre + TABLE_HEAD_LEN..]);
        if self.manifest.capacity() > MANIFEST_KEPT {
            self.manifest = Vec::new();
        }
        Ok(table?)
    }

    /// The chunk's manifest, read and checked. The outer error leaves the stream out of step
    /// (the connection closes); the inner one refuses the chunk alone.
    fn manifest(&mut self, h: &Header, writes: bool) -> Result<Result<Checked>> {
        let target = self.target.clone();
        let (known, staging) = (&target.regions, target.config.staging_bytes);
        let checked = if matches!(h.kind, FrameKind::WriteTable | FrameKind::ReadTable) {
            let table = self.table(h)?;
            Checked::table(known, staging, &table, writes)
        } else {
            let entries = self.entries(h)?;
            Checked::entries(known, staging, &entries, writes)
        };
        // A checked manifest whose GPU ranges cannot be staged is refused like a bad one.
        Ok(checked.and_then(|c| {
            if let Some(device) = c.device {
                self.ring(device)?;
            }
            Ok(c)
        }))
    }

    /// The staging ring, made on first use (`NoCudaDriver` and friends when it cannot be).
    fn ring(&mut self, device: u32) -> Result<&mut Staging> {
        if self.staging.is_none() {
            self.staging = Some(Staging::new(self.target.config.staging_bytes, device)?);
        }
        Ok(self.staging.as_mut().expect("just made"))
    }

    fn write(&mut self, s: &mut Out<'_>, h: &Header) -> Result<()> {
        let checked = self.manifest(h, true)?;
        let peer = self.peer.clone();
        let io = |e| closed_or_io(e, &peer);
        let checked = match checked {
            Ok(c) => c,
            Err(refusal) => {
                if h.len > DISCARD_LIMIT {
                    return Err(refusal);
                }
                discard(&mut self.input, h.len, &mut self.scratch).map_err(io)?;
                if h.has(FLAG_CRC) {
                    discard(&mut self.input, h.count as u64 * 4, &mut self.scratch).map_err(io)?;
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
            ring.recv(&mut self.input, &spans, crcs.as_deref_mut(), &io)?;
            staged_crcs = crcs;
        } else {
            let mut bufs: Vec<IoSliceMut<'_>> = checked
                .ranges
                .iter()
                // SAFETY: leased, bounds-checked and pairwise disjoint (checked above).
                .map(|r| IoSliceMut::new(unsafe { r.as_mut_slice() }))
                .collect();
            read_exact_vectored(&mut self.input, &mut bufs).map_err(io)?;
        }
        if h.has(FLAG_CRC) {
            let mut raw = vec![0u8; h.count as usize * 4];
            self.input.read_exact(&mut raw).map_err(io)?;
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

    fn read(&mut self, s: &mut Out<'_>, h: &Header) -> Result<()> {
        let checked = self.manifest(h, false)?;
        let peer = self.peer.clone();
        let io = |e| closed_or_io(e, &peer);
        let checked = match checked {
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
