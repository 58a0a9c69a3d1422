//! TCP, initiator side: several connections per peer, each with a writer thread that streams
//! chunks (manifest + payload, one writev per up to 1024 buffers) and a reader thread that takes
//! replies in order and reads read-payload straight into local memory. Nothing waits for a reply
//! before sending the next chunk.
//!
//! A chunk's pieces all live in one place (host memory, or one GPU). GPU chunks travel through
//! the connection's pinned staging rings (see [`super::staging`]): the writer thread copies unit
//! k+1 device → host while it writes unit k, and the reader copies unit k host → device while it
//! reads unit k+1. The wire is the same either way.

use std::collections::VecDeque;
use std::io::{BufReader, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use rustix::net::{SendFlags, send};
use tracing::{debug, warn};

use super::data_stream::{DataStream, DataWriter, Out};
use super::io::{SpinReader, Until, discard, read_exact_vectored, spin_fill, write_all_vectored};
use super::staging::{Span, Staging, device_of};
use super::{Piece, PlannedTable, Transport, TransportKind, TransportStats};
use crate::batch::Job;
use crate::error::{Error, Result};
use crate::frame::{
    ENTRY_LEN, FLAG_CRC, FLAG_ERROR, FLAG_TRACE, FrameError, FrameKind, HEADER_LEN, Header,
    MAX_ENTRIES, TABLE_HEAD_LEN, TABLE_PLANE_LEN, TRACE_LEN, TablePlane, decode_crcs, encode_table,
};
use crate::handshake::{self, Credentials, closed_or_io, read_header, read_remote_error};
use crate::op::Opcode;
use crate::segment::SegmentDescriptor;

/// One manifest's worth of a batch, sent on one connection.
#[derive(Debug)]
struct Chunk {
    job: Arc<Job>,
    pieces: Vec<Piece>,
    bytes: u64,
    tag: u64,
    /// The GPU every local piece lives on (staged), or None for host memory.
    device: Option<u32>,
    /// Sent as a table manifest: `pieces` are these elements of the table, in element order.
    table: Option<TableSlice>,
}

/// Planes `planes` × blocks `blocks` of a block-table batch.
#[derive(Debug)]
struct TableSlice {
    table: Arc<PlannedTable>,
    planes: Range<usize>,
    blocks: Range<usize>,
}

impl TableSlice {
    fn new(table: &Arc<PlannedTable>, planes: Range<usize>, blocks: Range<usize>) -> Self {
        TableSlice {
            table: table.clone(),
            planes,
            blocks,
        }
    }

    fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::with_capacity(self.planes.len() * self.blocks.len());
        for p in self.planes.clone() {
            out.extend(self.blocks.clone().map(|j| self.table.piece(p, j)));
        }
        out
    }

    fn manifest_len(&self) -> usize {
        TABLE_HEAD_LEN + self.planes.len() * TABLE_PLANE_LEN + self.blocks.len() * 4
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        let planes: Vec<TablePlane> = self.table.planes[self.planes.clone()]
            .iter()
            .map(|p| p.remote)
            .collect();
        let ids = self.table.blocks[self.blocks.clone()]
            .iter()
            .map(|b| b.remote);
        encode_table(&planes, ids, out);
    }
}

impl Chunk {
    /// Bytes of manifest after the header (not counting a trace block).
    fn manifest_len(&self) -> usize {
        match &self.table {
            Some(t) => t.manifest_len(),
            None => self.pieces.len() * ENTRY_LEN,
        }
    }
}

/// Chunks up to this size (header, manifest and payload) are written by the submitting thread
/// itself when the connection is idle: a small batch then does not wait for a thread wake-up.
const INLINE_MAX: usize = 64 << 10;

/// Bytes asked of the socket at once when a reply begins: a small read's header, payload and
/// trailer then take one read, not one each. Payload reads this large or larger go straight
/// into local memory.
const READ_AHEAD: usize = 16 << 10;

/// The read half of a connection, read only by whoever holds the reading turn.
type Inbox = BufReader<SpinReader<TcpStream>>;

#[derive(Debug)]
enum Work {
    Chunk(Chunk),
    /// The unsent rest of an inline write that the socket could not take at once (as on the
    /// wire: sealed already, under TLS).
    Tail(Vec<u8>),
    /// A sign of life after `Conn::keepalive` of silence.
    KeepAlive,
}

#[derive(Debug, Default)]
struct Queue {
    items: VecDeque<Work>,
    /// Someone (the writer thread or an inline submitter) is writing to the socket.
    busy: bool,
    closed: bool,
    /// When the last write started (the writer sends a KeepAlive after `Conn::keepalive` of
    /// silence).
    last: Option<Instant>,
}

#[derive(Debug)]
struct Conn {
    peer: String,
    /// The sending half; its turn is `Queue::busy`.
    out: DataWriter,
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Chunks written and awaiting their reply, in wire order.
    pending: Mutex<VecDeque<Arc<Chunk>>>,
    /// The read half; locked only by whoever holds the reading turn.
    inbox: Mutex<Inbox>,
    /// Someone (the reader thread, or a caller running its own small batch) reads replies.
    reading: Mutex<bool>,
    read_turn: Condvar,
    alive: AtomicBool,
    /// Pinned bytes per staging ring (`EngineConfig::staging_bytes`).
    staging_bytes: u64,
    /// The writer's ring (GPU → wire), made at the first GPU write.
    tx_staging: Mutex<Option<Staging>>,
    /// The reader's ring (wire → GPU), made at the first GPU read; held by whoever reads.
    rx_staging: Mutex<Option<Staging>>,
    /// A third of the target's idle timeout: how long the connection may stay silent.
    keepalive: Option<Duration>,
    /// How long a caller running its own small batch polls for the reply before it sleeps.
    busy_poll: Duration,
    /// Bytes queued or on the wire, to spread chunks over connections.
    outstanding: AtomicU64,
    moved: AtomicU64,
    next_tag: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct TcpLink {
    conns: Vec<Arc<Conn>>,
    chunk_bytes: u64,
}

pub(crate) struct TcpOptions {
    pub connections: usize,
    pub buffer: crate::TcpBuffer,
    pub chunk_bytes: u64,
    pub staging_bytes: u64,
    /// Connect and handshake, each connection, within this.
    pub handshake_timeout: Duration,
    /// A batch run on the caller's thread polls its socket this long before it sleeps
    /// (`EngineConfig::spin_wait`).
    pub busy_poll: Duration,
    /// TLS to the target (records sealed and opened by the connection's own threads).
    pub tls: Option<crate::DataTls>,
}

impl TcpLink {
    /// Opens `connections` data connections to `addr` and shakes hands on each. Blocking.
    /// Returns the peer's descriptor when its answer carried one.
    pub(crate) fn connect(
        addr: SocketAddr,
        creds: Credentials<'_>,
        opts: TcpOptions,
    ) -> Result<(TcpLink, Option<SegmentDescriptor>)> {
        let peer = addr.to_string();
        let mut conns = Vec::with_capacity(opts.connections);
        let mut descriptor = None;
        for _ in 0..opts.connections.max(1) {
            let deadline = Instant::now() + opts.handshake_timeout;
            let stream = TcpStream::connect_timeout(&addr, opts.handshake_timeout)
                .map_err(|e| Error::io(format!("connect tcp {peer}"), e))?;
            stream
                .set_nodelay(true)
                .map_err(|e| Error::io("set TCP_NODELAY", e))?;
            opts.buffer
                .apply(&stream)
                .map_err(|e| Error::io("set tcp buffer sizes", e))?;
            let mut stream = DataStream::connect(stream, opts.tls.as_ref(), deadline)
                .map_err(|e| Error::io(format!("tls to {peer}"), e))?;
            let until = &mut Until {
                s: &mut stream,
                deadline,
            };
            let welcomed = handshake::client(until, &peer, creds)?;
            // From here on batches carry their own deadlines.
            stream
                .clear_timeouts()
                .map_err(|e| Error::io("clear socket timeouts", e))?;
            descriptor = welcomed.descriptor;
            let keepalive = (!welcomed.idle_timeout.is_zero()).then(|| welcomed.idle_timeout / 3);
            conns.push(Conn::start(
                peer.clone(),
                stream,
                opts.staging_bytes,
                keepalive,
                opts.busy_poll,
            )?);
        }
        let link = TcpLink {
            conns,
            chunk_bytes: opts.chunk_bytes.max(1),
        };
        Ok((link, descriptor))
    }

    /// Cuts the pieces into chunks of about `chunk_bytes` (splitting large pieces) so a big batch
    /// spreads over every connection and replies pipeline behind it. A chunk holds pieces of one
    /// place only (host, or one GPU).
    fn chunks(&self, job: &Arc<Job>, pieces: Vec<Piece>) -> Vec<Chunk> {
        let mut chunks = Vec::new();
        let mut cur: Vec<Piece> = Vec::new();
        let mut cur_bytes = 0u64;
        let flush = |cur: &mut Vec<Piece>, cur_bytes: &mut u64, chunks: &mut Vec<Chunk>| {
            if !cur.is_empty() {
                chunks.push(Chunk {
                    job: job.clone(),
                    device: device_of(cur[0].location),
                    pieces: std::mem::take(cur),
                    bytes: std::mem::take(cur_bytes),
                    tag: 0,
                    table: None,
                });
            }
        };
        for piece in pieces {
            if cur
                .first()
                .is_some_and(|c| device_of(c.location) != device_of(piece.location))
            {
                flush(&mut cur, &mut cur_bytes, &mut chunks);
            }
            let mut done = 0u64;
            let total = piece.remote.len;
            while done < total {
                let take = (total - done).min(self.chunk_bytes - cur_bytes);
                let mut p = piece;
                // SAFETY: done + take <= piece length, so the pointer stays in the checked range.
                p.local.ptr = unsafe { piece.local.ptr.add(done as usize) };
                p.local.len = take as usize;
                p.remote.offset += done;
                p.remote.len = take;
                cur.push(p);
                cur_bytes += take;
                done += take;
                if cur_bytes >= self.chunk_bytes || cur.len() >= MAX_ENTRIES as usize {
                    flush(&mut cur, &mut cur_bytes, &mut chunks);
                }
            }
        }
        flush(&mut cur, &mut cur_bytes, &mut chunks);
        chunks
    }

    /// Cuts a block table into table-manifest chunks of about `chunk_bytes`: runs of blocks
    /// over every plane, or, when one block over all planes is larger than a chunk, runs of
    /// planes of one block. Hands the table back when it is not of one place (host, or one GPU)
    /// or has blocks larger than a chunk: it then goes as op manifests.
    fn table_chunks(
        &self,
        job: &Arc<Job>,
        table: PlannedTable,
    ) -> std::result::Result<Vec<Chunk>, PlannedTable> {
        let device = device_of(table.planes[0].location);
        if table
            .planes
            .iter()
            .any(|p| device_of(p.location) != device || p.remote.block_bytes > self.chunk_bytes)
        {
            return Err(table);
        }
        let row: u64 = table.planes.iter().map(|p| p.remote.block_bytes).sum();
        let table = Arc::new(table);
        let (planes, blocks) = (table.planes.len(), table.blocks.len());
        let chunk = |planes: Range<usize>, blocks: Range<usize>| {
            let slice = TableSlice::new(&table, planes, blocks);
            let row: u64 = table.planes[slice.planes.clone()]
                .iter()
                .map(|p| p.remote.block_bytes)
                .sum();
            Chunk {
                job: job.clone(),
                pieces: slice.pieces(),
                bytes: row * slice.blocks.len() as u64,
                tag: 0,
                device,
                table: Some(slice),
            }
        };
        let mut chunks = Vec::new();
        if row <= self.chunk_bytes {
            let per = ((self.chunk_bytes / row) as usize)
                .min(MAX_ENTRIES as usize / planes)
                .max(1);
            for start in (0..blocks).step_by(per) {
                chunks.push(chunk(0..planes, start..(start + per).min(blocks)));
            }
            return Ok(chunks);
        }
        for j in 0..blocks {
            let mut start = 0;
            while start < planes {
                let (mut end, mut bytes) = (start, 0);
                while end < planes
                    && bytes + table.planes[end].remote.block_bytes <= self.chunk_bytes
                {
                    bytes += table.planes[end].remote.block_bytes;
                    end += 1;
                }
                chunks.push(chunk(start..end, j..j + 1));
                start = end;
            }
        }
        Ok(chunks)
    }

    /// `run_here`'s choice for chunks ready to go: one chunk is carried by this thread.
    fn run_chunks(&self, job: Arc<Job>, mut chunks: Vec<Chunk>, deadline: Instant) {
        let conn = self.least_loaded();
        match (chunks.len(), conn) {
            (1, Some(conn)) => {
                job.expect_pieces(1);
                let chunk = chunks.pop().expect("one chunk");
                if let Some(busy) = conn.run_here(chunk, deadline) {
                    conn.enqueue(busy);
                }
            }
            _ => self.dispatch(job, chunks),
        }
    }
}

impl TcpLink {
    fn least_loaded(&self) -> Option<&Arc<Conn>> {
        self.conns
            .iter()
            .filter(|c| c.alive.load(Ordering::Acquire))
            .min_by_key(|c| c.outstanding.load(Ordering::Relaxed))
    }

    fn dispatch(&self, job: Arc<Job>, chunks: Vec<Chunk>) {
        job.expect_pieces(chunks.len());
        for chunk in chunks {
            match self.least_loaded() {
                Some(conn) => conn.enqueue(chunk),
                None => chunk.job.piece_failed(Error::PeerClosed {
                    peer: self.conns[0].peer.clone(),
                }),
            }
        }
    }
}

impl Transport for TcpLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn submit(&self, pieces: Vec<Piece>, job: Arc<Job>) {
        let chunks = self.chunks(&job, pieces);
        self.dispatch(job, chunks);
    }

    fn run_here(&self, pieces: Vec<Piece>, job: Arc<Job>, deadline: Instant) {
        let chunks = self.chunks(&job, pieces);
        self.run_chunks(job, chunks, deadline);
    }

    fn submit_table(&self, table: PlannedTable, job: Arc<Job>) {
        let chunks = match self.table_chunks(&job, table) {
            Ok(chunks) => chunks,
            Err(table) => self.chunks(&job, table.pieces()),
        };
        self.dispatch(job, chunks);
    }

    fn run_table_here(&self, table: PlannedTable, job: Arc<Job>, deadline: Instant) {
        let chunks = match self.table_chunks(&job, table) {
            Ok(chunks) => chunks,
            Err(table) => self.chunks(&job, table.pieces()),
        };
        self.run_chunks(job, chunks, deadline);
    }

    fn stats(&self) -> TransportStats {
        TransportStats {
            connections: self
                .conns
                .iter()
                .filter(|c| c.alive.load(Ordering::Acquire))
                .count(),
            bytes: self
                .conns
                .iter()
                .map(|c| c.moved.load(Ordering::Relaxed))
                .sum(),
            resident_kernels: 0,
        }
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        for c in &self.conns {
            c.close(Error::ShuttingDown);
        }
    }
}

impl Conn {
    fn start(
        peer: String,
        stream: DataStream,
        staging_bytes: u64,
        keepalive: Option<Duration>,
        busy_poll: Duration,
    ) -> Result<Arc<Conn>> {
        let (out, reader) = stream
            .split()
            .map_err(|e| Error::io("clone tcp stream", e))?;
        let conn = Arc::new(Conn {
            peer,
            out,
            queue: Mutex::new(Queue {
                last: Some(Instant::now()),
                ..Queue::default()
            }),
            wake: Condvar::new(),
            pending: Mutex::default(),
            inbox: Mutex::new(BufReader::with_capacity(READ_AHEAD, reader)),
            reading: Mutex::new(false),
            read_turn: Condvar::new(),
            alive: AtomicBool::new(true),
            staging_bytes,
            keepalive,
            busy_poll,
            tx_staging: Mutex::new(None),
            rx_staging: Mutex::new(None),
            outstanding: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            next_tag: AtomicU64::new(1),
        });
        let w = conn.clone();
        thread::Builder::new()
            .name("kvf-tcp-tx".into())
            .spawn(move || w.write_loop())
            .map_err(|e| Error::io("spawn tcp writer", e))?;
        let r = conn.clone();
        thread::Builder::new()
            .name("kvf-tcp-rx".into())
            .spawn(move || r.read_loop())
            .map_err(|e| Error::io("spawn tcp reader", e))?;
        Ok(conn)
    }

    fn enqueue(&self, mut chunk: Chunk) {
        chunk.tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        self.outstanding.fetch_add(chunk.bytes, Ordering::Relaxed);
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            drop(q);
            chunk.job.piece_failed(Error::PeerClosed {
                peer: self.peer.clone(),
            });
            return;
        }
        // GPU chunks are staged by the writer thread, never written by the submitter.
        let small = chunk.device.is_none()
            && chunk.bytes as usize + chunk.manifest_len() + HEADER_LEN <= INLINE_MAX;
        if q.busy || !q.items.is_empty() || !small {
            q.items.push_back(Work::Chunk(chunk));
            drop(q);
            self.wake.notify_one();
            return;
        }
        q.busy = true;
        q.last = Some(Instant::now());
        drop(q);
        self.write_inline(chunk);
    }

    fn write_inline(&self, chunk: Chunk) {
        let chunk = self.await_reply(chunk);
        let mut bytes = Vec::new();
        encode_head(&chunk, &mut bytes);
        if chunk.job.opcode == Opcode::Write {
            for p in &chunk.pieces {
                // SAFETY: the job leases every local region for as long as the chunk exists.
                bytes.extend_from_slice(unsafe { p.local.as_slice() });
            }
            bytes.extend_from_slice(&crc_trailer(&chunk));
        }
        // Never block the submitter (it may be an async task): what the socket does not take
        // now goes to the writer thread, ahead of anything queued meanwhile.
        let mut bytes = match self.out.wire_bytes(bytes) {
            Ok(wire) => wire,
            Err(e) => {
                self.queue.lock().unwrap_or_else(|e| e.into_inner()).busy = false;
                self.close(closed_or_io(e, &self.peer));
                return;
            }
        };
        let sent = match send(
            self.out.socket(),
            &bytes,
            SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
        ) {
            Ok(n) => Ok(n),
            Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::INTR => Ok(0),
            Err(e) => Err(std::io::Error::from(e)),
        };
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.busy = false;
        match sent {
            Ok(n) if n == bytes.len() => {}
            Ok(n) => q.items.push_front(Work::Tail(bytes.split_off(n))),
            Err(e) => {
                drop(q);
                self.close(closed_or_io(e, &self.peer));
                return;
            }
        }
        let wake = !q.items.is_empty();
        drop(q);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Registers a chunk as awaiting its reply; must happen before its first byte is sent.
    fn await_reply(&self, chunk: Chunk) -> Arc<Chunk> {
        let chunk = Arc::new(chunk);
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(chunk.clone());
        // Taking the lock orders this after the reader thread's check of `pending`.
        if !*self.reading.lock().unwrap_or_else(|e| e.into_inner()) {
            self.read_turn.notify_one();
        }
        chunk
    }

    fn nothing_pending(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Runs a one-chunk batch on the calling thread: it sends the chunk and reads the reply
    /// itself, so completion costs no wake-up of another thread. Hands the chunk back when the
    /// connection is already busy (then the reader thread is the one to read).
    fn run_here(&self, chunk: Chunk, deadline: Instant) -> Option<Chunk> {
        {
            let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
            if *reading || !self.alive.load(Ordering::Acquire) || !self.nothing_pending() {
                return Some(chunk);
            }
            *reading = true;
        }
        let job = chunk.job.clone();
        self.enqueue(chunk);
        let mut scratch = Vec::new();
        let mut outcome = Ok(());
        let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        while !job.is_finished() && !self.nothing_pending() {
            let ready = wait_readable(&mut inbox, deadline, self.busy_poll);
            match ready {
                Ok(true) => {}
                // Past the batch's deadline: the caller's wait reports the timeout, and the
                // reader thread takes the late reply (and drops it).
                Ok(false) => break,
                Err(e) => {
                    outcome = Err(closed_or_io(e, &self.peer));
                    break;
                }
            }
            if let Err(e) = self.read_reply(&mut inbox, &mut scratch) {
                outcome = Err(e);
                break;
            }
        }
        drop(inbox);
        self.end_reading_turn();
        if let Err(e) = outcome {
            self.close(e);
        }
        None
    }

    /// Waits until something is pending and nobody else is reading; false once closed.
    fn take_reading_turn(&self) -> bool {
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if !self.alive.load(Ordering::Acquire) {
                return false;
            }
            if !*reading && !self.nothing_pending() {
                *reading = true;
                return true;
            }
            reading = self
                .read_turn
                .wait(reading)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Hands reading back; wakes the reader thread only if replies are still due.
    fn end_reading_turn(&self) {
        let mut reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        *reading = false;
        if !self.nothing_pending() {
            self.read_turn.notify_all();
        }
    }

    /// The next thing to write: queued work, or a KeepAlive after `keepalive` of silence.
    fn next_work(&self) -> Option<Work> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if q.closed {
                return None;
            }
            let now = Instant::now();
            let silent = q.last.map_or(Duration::MAX, |t| now - t);
            if !q.busy {
                let work = q.items.pop_front().or_else(|| {
                    self.keepalive
                        .filter(|&k| silent >= k)
                        .map(|_| Work::KeepAlive)
                });
                if let Some(w) = work {
                    q.busy = true;
                    q.last = Some(now);
                    return Some(w);
                }
            }
            q = match self.keepalive {
                Some(k) => {
                    let wait = k.saturating_sub(silent).max(Duration::from_millis(1));
                    self.wake
                        .wait_timeout(q, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.wake.wait(q).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    /// The connection's staging ring in `slot`, made on first use.
    fn staging<'a>(
        &self,
        slot: &'a Mutex<Option<Staging>>,
        device: u32,
    ) -> Result<MutexGuard<'a, Option<Staging>>> {
        let mut ring = slot.lock().unwrap_or_else(|e| e.into_inner());
        if ring.is_none() {
            if self.staging_bytes == 0 {
                return Err(Error::InvalidConfig {
                    field: "staging_bytes",
                    value: "0".into(),
                    reason: "GPU memory over tcp needs pinned staging",
                });
            }
            *ring = Some(Staging::new(self.staging_bytes, device)?);
        }
        Ok(ring)
    }

    fn write_loop(self: Arc<Self>) {
        let mut head = Vec::new();
        let io = |e| closed_or_io(e, &self.peer);
        while let Some(work) = self.next_work() {
            let mut stream = self.out.lock();
            let written = match work {
                Work::Tail(bytes) => stream.write_wire(&bytes).map_err(io),
                Work::KeepAlive => stream
                    .write_all(&Header::new(FrameKind::KeepAlive, 0, 0, 0).encode())
                    .map_err(io),
                Work::Chunk(chunk) if chunk.job.is_cancelled() => {
                    self.outstanding.fetch_sub(chunk.bytes, Ordering::Relaxed);
                    chunk.job.piece_failed(Error::Cancelled {
                        batch: chunk.job.id,
                    });
                    Ok(())
                }
                Work::Chunk(chunk) => match chunk.device {
                    Some(device) if chunk.job.opcode == Opcode::Write => {
                        // The ring is made before the chunk counts as sent: a chunk that cannot
                        // be staged fails alone and the connection stays in step.
                        match self.staging(&self.tx_staging, device) {
                            Ok(mut ring) => {
                                let chunk = self.await_reply(chunk);
                                let ring = ring.as_mut().expect("made by staging()");
                                write_staged(&mut stream, &chunk, &mut head, ring, &io)
                            }
                            Err(e) => {
                                self.outstanding.fetch_sub(chunk.bytes, Ordering::Relaxed);
                                chunk.job.piece_failed(e);
                                Ok(())
                            }
                        }
                    }
                    _ => {
                        let chunk = self.await_reply(chunk);
                        write_chunk(&mut stream, &chunk, &mut head).map_err(io)
                    }
                },
            };
            drop(stream);
            self.queue.lock().unwrap_or_else(|e| e.into_inner()).busy = false;
            if let Err(e) = written {
                self.close(e);
                return;
            }
        }
    }

    /// The reader thread: reads replies whenever some are due and no caller is reading its own.
    fn read_loop(self: Arc<Self>) {
        let mut scratch = Vec::new();
        while self.take_reading_turn() {
            let mut outcome = Ok(());
            let mut inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
            while outcome.is_ok() && !self.nothing_pending() {
                outcome = self.read_reply(&mut inbox, &mut scratch);
            }
            drop(inbox);
            self.end_reading_turn();
            if let Err(err) = outcome {
                if !matches!(err, Error::ShuttingDown) {
                    debug!(peer = %self.peer, error = %err, "tcp connection closed");
                }
                self.close(err);
                return;
            }
        }
    }

    /// Reads one reply and completes its chunk. An error here is fatal for the connection.
    fn read_reply(&self, stream: &mut Inbox, scratch: &mut Vec<u8>) -> Result<()> {
        let h = read_header(stream, &self.peer).map_err(|e| {
            if self.alive.load(Ordering::Acquire) {
                e
            } else {
                Error::ShuttingDown
            }
        })?;
        let chunk = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
            .ok_or(FrameError::Unexpected {
                kind: h.kind,
                expected: "no reply (nothing outstanding)",
            })?;
        self.outstanding.fetch_sub(chunk.bytes, Ordering::Relaxed);
        // A reply that does not match what we asked fails its batch with what was wrong (and
        // the connection, which is out of step): nothing of its payload is read.
        let mismatch = |e: FrameError| {
            // Closed first: by the time its batch hears why, the connection takes no more.
            self.close(Error::Frame(e.clone()));
            chunk.job.piece_failed(Error::Frame(e.clone()));
            Err(Error::Frame(e))
        };
        if h.tag != chunk.tag {
            return mismatch(FrameError::TagMismatch {
                expected: chunk.tag,
                found: h.tag,
            });
        }
        let expected = match chunk.job.opcode {
            Opcode::Write => FrameKind::Ack,
            Opcode::Read => FrameKind::ReadData,
        };
        if h.kind != expected {
            return mismatch(FrameError::Unexpected {
                kind: h.kind,
                expected: "the reply to the oldest outstanding chunk",
            });
        }
        if h.has(FLAG_ERROR) {
            let err = read_remote_error(stream, &h, &self.peer)?;
            chunk.job.piece_failed(err);
            return Ok(());
        }
        if h.kind == FrameKind::Ack {
            self.moved.fetch_add(chunk.bytes, Ordering::Relaxed);
            chunk.job.piece_done(chunk.bytes);
            return Ok(());
        }
        if h.len != chunk.bytes || h.count as usize != chunk.pieces.len() {
            return mismatch(FrameError::ReplyMismatch {
                field: if h.len != chunk.bytes { "len" } else { "count" },
                claimed: if h.len != chunk.bytes {
                    h.len
                } else {
                    u64::from(h.count)
                },
                expected: if h.len != chunk.bytes {
                    chunk.bytes
                } else {
                    chunk.pieces.len() as u64
                },
            });
        }
        let io = |e| closed_or_io(e, &self.peer);
        if chunk.job.is_cancelled() {
            // The caller has moved on; keep the stream in step without touching its memory.
            discard_reply(stream, &h, scratch).map_err(io)?;
            chunk.job.piece_failed(Error::Cancelled {
                batch: chunk.job.id,
            });
            return Ok(());
        }
        if let Some(device) = chunk.device {
            return self.read_staged(stream, &h, &chunk, device, scratch);
        }
        {
            let mut bufs: Vec<IoSliceMut<'_>> = chunk
                .pieces
                .iter()
                // SAFETY: the job leases the local regions; read destinations were checked
                // disjoint when the batch was submitted, so nothing else writes here.
                .map(|p| IoSliceMut::new(unsafe { p.local.as_mut_slice() }))
                .collect();
            if let Err(e) = read_exact_vectored(stream, &mut bufs) {
                // The chunk is off the pending list: fail it here, or its batch waits for its
                // timeout instead of hearing that the peer is gone.
                let e = io(e);
                chunk.job.piece_failed(e.duplicate());
                return Err(e);
            }
        }
        let computed = chunk.job.checksum.then(|| {
            chunk
                .pieces
                .iter()
                // SAFETY: leased and just filled by this thread.
                .map(|p| crc32c::crc32c(unsafe { p.local.as_slice() }))
                .collect()
        });
        self.finish_read(stream, &h, &chunk, computed, scratch)
    }

    /// The GPU half of `read_reply`: the payload goes through the reader's staging ring into
    /// device memory, and the chunk completes once every byte is there.
    fn read_staged(
        &self,
        stream: &mut Inbox,
        h: &Header,
        chunk: &Chunk,
        device: u32,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let io = |e| closed_or_io(e, &self.peer);
        let mut ring = match self.staging(&self.rx_staging, device) {
            Ok(r) => r,
            Err(e) => {
                // Keep the stream in step without touching the destination.
                discard_reply(stream, h, scratch).map_err(io)?;
                chunk.job.piece_failed(e);
                return Ok(());
            }
        };
        let spans: Vec<Span> = chunk.pieces.iter().map(|p| (p.local, p.location)).collect();
        let mut crcs = chunk.job.checksum.then(|| vec![0u32; spans.len()]);
        let ring = ring.as_mut().expect("made by staging()");
        if let Err(e) = ring.recv(stream, &spans, crcs.as_deref_mut(), &io) {
            chunk.job.piece_failed(e.duplicate());
            return Err(e);
        }
        self.finish_read(stream, h, chunk, crcs, scratch)
    }

    /// The end of a read reply whose payload has landed: the checksums the batch asked for
    /// (`computed`, one per piece) against the trailer, then completion.
    fn finish_read(
        &self,
        stream: &mut Inbox,
        h: &Header,
        chunk: &Chunk,
        computed: Option<Vec<u32>>,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let io = |e| closed_or_io(e, &self.peer);
        if let Some(computed) = computed {
            if !h.has(FLAG_CRC) {
                chunk.job.piece_failed(Error::Frame(FrameError::Body {
                    what: "read data",
                    reason: "checksum requested but none sent".into(),
                }));
                return Ok(());
            }
            let mut raw = vec![0u8; h.count as usize * 4];
            stream.read_exact(&mut raw).map_err(io)?;
            let expected = decode_crcs(h.count, &raw)?;
            for ((p, expected), computed) in chunk.pieces.iter().zip(expected).zip(computed) {
                if computed != expected {
                    chunk.job.piece_failed(Error::Checksum {
                        op: p.op,
                        expected,
                        computed,
                    });
                    return Ok(());
                }
            }
        } else if h.has(FLAG_CRC) {
            discard(stream, h.count as u64 * 4, scratch).map_err(io)?;
        }
        self.moved.fetch_add(chunk.bytes, Ordering::Relaxed);
        chunk.job.piece_done(chunk.bytes);
        Ok(())
    }

    /// Marks the connection dead and fails everything queued or outstanding on it.
    fn close(&self, err: Error) {
        if self.alive.swap(false, Ordering::AcqRel) && !matches!(err, Error::ShuttingDown) {
            warn!(peer = %self.peer, error = %err, "tcp data connection lost");
        }
        self.out.close_notify();
        let _ = self.out.socket().shutdown(Shutdown::Both);
        {
            // Under the lock, so a reader thread between its check and its wait still hears it.
            let _reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
            self.read_turn.notify_all();
        }
        let queued: Vec<Chunk> = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.closed = true;
            q.items
                .drain(..)
                .filter_map(|w| match w {
                    Work::Chunk(c) => Some(c),
                    Work::Tail(_) | Work::KeepAlive => None,
                })
                .collect()
        };
        self.wake.notify_all();
        let pending: Vec<Arc<Chunk>> = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for c in queued {
            c.job.piece_failed(err.duplicate());
        }
        for c in pending {
            c.job.piece_failed(err.duplicate());
        }
    }
}

/// Waits until the inbox has bytes (read ahead already, or on the socket; or an error/hang-up)
/// to read; false at the deadline. For the first `busy_poll` it reads ahead without sleeping.
fn wait_readable(
    inbox: &mut Inbox,
    deadline: Instant,
    busy_poll: Duration,
) -> std::io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    if spin_fill(inbox, busy_poll, Some(deadline)) {
        return Ok(true);
    }
    let stream = inbox.get_ref().socket();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let timeout = Timespec {
            tv_sec: left.as_secs() as _,
            tv_nsec: left.subsec_nanos() as _,
        };
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => continue,
            Ok(_) => return Ok(true),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Header and manifest of a chunk.
fn encode_head(chunk: &Chunk, out: &mut Vec<u8>) {
    let kind = match (chunk.job.opcode, &chunk.table) {
        (Opcode::Write, None) => FrameKind::WriteManifest,
        (Opcode::Read, None) => FrameKind::ReadManifest,
        (Opcode::Write, Some(_)) => FrameKind::WriteTable,
        (Opcode::Read, Some(_)) => FrameKind::ReadTable,
    };
    let mut flags = if chunk.job.checksum { FLAG_CRC } else { 0 };
    if chunk.job.trace.is_some() {
        flags |= FLAG_TRACE;
    }
    let header =
        Header::new(kind, chunk.tag, chunk.pieces.len() as u32, chunk.bytes).with_flags(flags);
    out.clear();
    out.reserve(HEADER_LEN + TRACE_LEN + chunk.manifest_len());
    out.extend_from_slice(&header.encode());
    if let Some(trace) = &chunk.job.trace {
        trace.encode_into(out);
    }
    match &chunk.table {
        Some(table) => table.encode_into(out),
        None => {
            for p in &chunk.pieces {
                p.remote.encode_into(out);
            }
        }
    }
}

/// crc32c of every piece of a write chunk, when the batch asked for checksums.
fn crc_trailer(chunk: &Chunk) -> Vec<u8> {
    if !chunk.job.checksum {
        return Vec::new();
    }
    chunk
        .pieces
        .iter()
        // SAFETY: leased source; concurrent writers to a write's source are the caller's bug.
        .flat_map(|p| crc32c::crc32c(unsafe { p.local.as_slice() }).to_le_bytes())
        .collect()
}

/// Writes one GPU write chunk: header and manifest, then the payload staged through `ring`, then
/// the crc trailer (computed from the staged bytes).
fn write_staged(
    stream: &mut Out<'_>,
    chunk: &Chunk,
    head: &mut Vec<u8>,
    ring: &mut Staging,
    io: &dyn Fn(std::io::Error) -> Error,
) -> Result<()> {
    encode_head(chunk, head);
    let spans: Vec<Span> = chunk.pieces.iter().map(|p| (p.local, p.location)).collect();
    let mut crcs = chunk.job.checksum.then(|| vec![0u32; spans.len()]);
    ring.send(stream, head, &spans, crcs.as_deref_mut(), io)?;
    if let Some(crcs) = crcs {
        let trailer: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
        stream.write_all(&trailer).map_err(io)?;
    }
    Ok(())
}

/// Writes one chunk: header, manifest, then (for writes) every payload and the crc trailer.
fn write_chunk(stream: &mut Out<'_>, chunk: &Chunk, head: &mut Vec<u8>) -> std::io::Result<()> {
    encode_head(chunk, head);
    if chunk.job.opcode == Opcode::Read {
        return stream.write_all(head);
    }
    let trailer = crc_trailer(chunk);
    let mut bufs: Vec<IoSlice<'_>> = Vec::with_capacity(chunk.pieces.len() + 2);
    bufs.push(IoSlice::new(head));
    // SAFETY: the job leases every local region for as long as the chunk exists.
    bufs.extend(
        chunk
            .pieces
            .iter()
            .map(|p| IoSlice::new(unsafe { p.local.as_slice() })),
    );
    if !trailer.is_empty() {
        bufs.push(IoSlice::new(&trailer));
    }
    write_all_vectored(stream, &mut bufs)
}

/// Skips a read reply's payload and crc trailer, keeping the stream in step.
fn discard_reply(stream: &mut Inbox, h: &Header, scratch: &mut Vec<u8>) -> std::io::Result<()> {
    discard(stream, h.len, scratch)?;
    if h.has(FLAG_CRC) {
        discard(stream, h.count as u64 * 4, scratch)?;
    }
    Ok(())
}

/// GPU `device`, or the host.
#[cfg(any(test, feature = "fuzzing"))]
fn location(device: Option<u32>) -> crate::region::Location {
    match device {
        Some(device) => crate::region::Location::Cuda { device },
        None => crate::region::Location::Host { numa: None },
    }
}

/// A planned block table of planes of `planes[i].0` bytes per block (on GPU `planes[i].1` or
/// the host) and blocks `0..blocks`, its local side all in `buf`: for the chunk planners' tests
/// and fuzz target.
#[cfg(any(test, feature = "fuzzing"))]
fn planned_table(planes: &[(u64, Option<u32>)], blocks: u32, buf: &mut [u8]) -> PlannedTable {
    use crate::block_table::{BlockPair, TableShape};
    use crate::frame::TablePlane;
    use crate::region::{AccessKey, RawRange, RegionId};
    use crate::transport::planned_table::PlannedPlane;
    PlannedTable {
        planes: planes
            .iter()
            .enumerate()
            .map(|(i, &(len, device))| PlannedPlane {
                local: RawRange {
                    ptr: buf.as_mut_ptr(),
                    len: buf.len(),
                },
                local_region: RegionId(1),
                local_base: 0,
                local_stride: 0,
                location: location(device),
                remote: TablePlane {
                    region: RegionId(2),
                    key: AccessKey(3),
                    base: i as u64 * (1 << 40),
                    stride: len,
                    block_bytes: len,
                },
            })
            .collect(),
        blocks: (0..blocks)
            .map(|j| BlockPair {
                local: 0,
                remote: j,
            })
            .collect(),
        shape: TableShape {
            max_local: 0,
            max_remote: blocks.saturating_sub(1),
        },
        bytes: planes.iter().map(|p| p.0).sum::<u64>() * u64::from(blocks),
    }
}

/// The link's chunk planners without connections, as plain numbers (cargo-fuzz target
/// `chunks`): what a batch of any shape is cut into.
#[cfg(feature = "fuzzing")]
pub(crate) mod fuzzing {
    use std::sync::Arc;

    use super::{Chunk, TcpLink};
    use crate::batch::Job;
    use crate::frame::Entry;
    use crate::fuzzing::PlannedChunk;
    use crate::op::Opcode;
    use crate::region::{AccessKey, RawRange, RegionId};
    use crate::transport::{Piece, staging::device_of};

    fn link(chunk_bytes: u64) -> TcpLink {
        TcpLink {
            conns: Vec::new(),
            chunk_bytes: chunk_bytes.max(1),
        }
    }

    fn job() -> Arc<Job> {
        Job::new(1, Opcode::Write, false, None, Vec::new(), None)
    }

    fn plain(c: &Chunk) -> PlannedChunk {
        PlannedChunk {
            pieces: c
                .pieces
                .iter()
                .map(|p| (p.op, p.remote.offset, p.remote.len, p.local.len as u64))
                .collect(),
            bytes: c.bytes,
            device: c.device,
            devices: c.pieces.iter().map(|p| device_of(p.location)).collect(),
            table: c
                .table
                .as_ref()
                .map(|t| (t.planes.clone(), t.blocks.clone())),
        }
    }

    /// Piece `i`: `len` bytes at remote offset `offset`, on GPU `device` or the host; the local
    /// side is one buffer, piece after piece.
    pub(crate) fn chunks(
        chunk_bytes: u64,
        pieces: &[(u64, u64, Option<u32>)],
    ) -> Vec<PlannedChunk> {
        let total: u64 = pieces.iter().map(|p| p.1).sum();
        let mut buf = vec![0u8; usize::try_from(total).expect("fits")];
        let mut at = 0usize;
        let planned = pieces
            .iter()
            .enumerate()
            .map(|(op, &(offset, len, device))| {
                // SAFETY: at + len <= buf.len(): the pieces' lengths add up to it.
                let ptr = unsafe { buf.as_mut_ptr().add(at) };
                at += len as usize;
                Piece {
                    local: RawRange {
                        ptr,
                        len: len as usize,
                    },
                    remote: Entry {
                        region: RegionId(2),
                        key: AccessKey(3),
                        offset,
                        len,
                    },
                    local_region: RegionId(1),
                    local_offset: 0,
                    op,
                    location: super::location(device),
                }
            })
            .collect();
        link(chunk_bytes)
            .chunks(&job(), planned)
            .iter()
            .map(plain)
            .collect()
    }

    /// A block table of planes of `lens[i]` bytes per block (plane `i` on GPU `devices[i]` or
    /// the host) and `blocks` blocks; `None` when the link hands it back to go as op manifests.
    pub(crate) fn table_chunks(
        chunk_bytes: u64,
        planes: &[(u64, Option<u32>)],
        blocks: u32,
    ) -> Option<Vec<PlannedChunk>> {
        let mut buf = [0u8; 1];
        let table = super::planned_table(planes, blocks, &mut buf);
        link(chunk_bytes)
            .table_chunks(&job(), table)
            .ok()
            .map(|chunks| chunks.iter().map(plain).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn a_busy_poll_window_ends_at_the_deadline_and_sees_bytes_at_once() {
        let (a, mut b) = pair();
        let mut a: Inbox = BufReader::with_capacity(READ_AHEAD, SpinReader::new(a));
        let ms = Duration::from_millis;
        // Nothing to read: a window longer than the batch's deadline still ends at the deadline,
        // and one shorter than it sleeps until the deadline.
        for window in [Duration::from_secs(60), ms(5), Duration::ZERO] {
            let start = Instant::now();
            assert!(!wait_readable(&mut a, start + ms(50), window).unwrap());
            let took = start.elapsed();
            assert!(took >= ms(50) && took < Duration::from_secs(10), "{took:?}");
        }
        // A byte waiting is seen at once, polling or not, and one read ahead counts.
        b.write_all(b"x").unwrap();
        for window in [Duration::ZERO, Duration::from_secs(60), Duration::ZERO] {
            let start = Instant::now();
            assert!(wait_readable(&mut a, start + Duration::from_secs(60), window).unwrap());
            assert!(start.elapsed() < Duration::from_secs(10));
        }
        assert_eq!(a.buffer(), b"x", "read ahead by the polling window");
    }

    fn table(lens: &[u64], blocks: u32, buf: &mut [u8]) -> PlannedTable {
        let planes: Vec<(u64, Option<u32>)> = lens.iter().map(|&len| (len, None)).collect();
        planned_table(&planes, blocks, buf)
    }

    /// Table chunks cover every element once, in element order within each chunk, each no
    /// larger than a chunk and no longer than a manifest may be; tables they cannot carry are
    /// handed back.
    #[test]
    fn table_chunks_cover_every_element_within_the_limits() {
        let mut buf = vec![0u8; 1 << 20];
        let job = Job::new(1, Opcode::Write, false, None, Vec::new(), None);
        for (chunk_bytes, lens, blocks) in [
            (64u64 << 10, vec![4096u64; 64], 100u32),
            (64 << 10, vec![1000, 3000, 17], 5000),
            (1 << 20, vec![1; 4096], 1000),
            (64 << 10, vec![40_000, 30_000, 64 << 10], 3),
        ] {
            let link = TcpLink {
                conns: Vec::new(),
                chunk_bytes,
            };
            let t = table(&lens, blocks, &mut buf);
            let total = t.bytes;
            let chunks = link.table_chunks(&job, t).expect("carried as tables");
            let mut seen = vec![0u32; lens.len() * blocks as usize];
            let mut bytes = 0;
            for c in &chunks {
                let slice = c.table.as_ref().expect("a table chunk");
                assert!(c.bytes <= chunk_bytes, "{} > {chunk_bytes}", c.bytes);
                assert!(c.pieces.len() <= MAX_ENTRIES as usize);
                assert_eq!(c.pieces.len(), slice.planes.len() * slice.blocks.len());
                let mut ops = c.pieces.iter().map(|p| p.op);
                for p in slice.planes.clone() {
                    for j in slice.blocks.clone() {
                        let op = ops.next().unwrap();
                        assert_eq!(op, p * blocks as usize + j, "element order");
                        seen[op] += 1;
                    }
                }
                assert_eq!(c.pieces.iter().map(|p| p.remote.len).sum::<u64>(), c.bytes);
                bytes += c.bytes;
            }
            assert!(seen.iter().all(|&n| n == 1));
            assert_eq!(bytes, total);
        }
        // A block larger than a chunk: handed back, to go as op manifests (which split it).
        let link = TcpLink {
            conns: Vec::new(),
            chunk_bytes: 64 << 10,
        };
        assert!(
            link.table_chunks(&job, table(&[4096, 65 << 10], 2, &mut buf))
                .is_err()
        );
    }
}
