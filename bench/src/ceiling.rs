//! What the same path does without kvfabric, measured in the same run: each function measures one
//! raw variant of a row's path (raw TCP streams, a raw request/response, memcpy). A row's bound is
//! the best of its variants (see [`crate::bound`]).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use kvfabric_engine::TcpBuffer;
use kvfabric_proto::bytesize::human;

use crate::control::{ControlClient, Reply, Request};
use crate::error::{Error, Result};
use crate::scatter::RawPool;
use crate::stats::percentile;

/// One raw variant's result.
#[derive(Debug, Clone, Serialize)]
pub struct Ceiling {
    pub name: String,
    pub gbps: f64,
    /// Set for request/response variants: the median round trip.
    pub p50_us: Option<f64>,
}

/// Bytes a hot stream moves per call, from and into one buffer that stays in the caches: what
/// the kernel's TCP path itself allows, with no cold memory on either end.
pub const HOT_BYTES: u64 = 256 << 10;

/// Bytes a hot stream hands to one readv/writev (the buffer named as many times): what a call
/// that large costs the kernel, which kvfabric's own calls of up to a chunk approach.
pub const HOT_CALL_BYTES: u64 = 4 << 20;

/// A silent spinning peer sleeps after this long without a byte (an idle ping-pong must not hold
/// a core).
pub const SPIN_IDLE: Duration = Duration::from_millis(10);

/// A spinning reader yields its core between polls after this long without a byte: the other
/// end may be waiting for that core (two spinners on one core would each wait out the other).
const SPIN_PURE: Duration = Duration::from_micros(20);

/// What the raw streams read and write.
#[derive(Debug, Clone, Copy)]
pub enum Buffers {
    /// One `HOT_BYTES` buffer per stream and end, reused for every call.
    Hot,
    /// The row's shape: random blocks of `block_size` between cold pools of `pool_bytes` (split
    /// among the streams) with readv/writev — kvfabric minus its framing.
    SameShape { pool_bytes: u64, block_size: u64 },
}

/// Which way the streams' bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    ToTarget,
    FromTarget,
    /// `streams` each way at once (a bidirectional row).
    Both,
}

#[derive(Debug, Clone, Copy)]
pub struct StreamShape {
    pub flow: Flow,
    pub streams: usize,
    pub buffers: Buffers,
    /// SO_SNDBUF/SO_RCVBUF on both ends of every stream (None: the kernel's autotuning).
    pub socket_buffer: Option<u32>,
}

impl StreamShape {
    pub fn name(&self) -> String {
        let each = if self.flow == Flow::Both {
            " each way"
        } else {
            ""
        };
        let buffers = match self.buffers {
            Buffers::Hot => "hot",
            Buffers::SameShape { .. } => "same shape",
        };
        let socket = match self.socket_buffer {
            Some(n) => format!(" buf {}", human(n.into())),
            None => String::new(),
        };
        format!("raw tcp ×{}{each} {buffers}{socket}", self.streams)
    }

    /// Whether stream `i` carries bytes towards the target.
    fn towards_target(&self, i: usize) -> bool {
        match self.flow {
            Flow::ToTarget => true,
            Flow::FromTarget => false,
            Flow::Both => i % 2 == 1,
        }
    }

    /// Streams in all (both ways for `Flow::Both`).
    fn total(&self) -> usize {
        self.streams.max(1) * if self.flow == Flow::Both { 2 } else { 1 }
    }

    /// Times a hot stream's buffer is named in one call (1: a scatter pool).
    fn repeat(&self) -> u32 {
        match self.buffers {
            Buffers::Hot => (HOT_CALL_BYTES / HOT_BYTES) as u32,
            Buffers::SameShape { .. } => 1,
        }
    }

    /// Each stream's pool and the bytes of one of its places.
    fn share(&self) -> (u64, u64) {
        match self.buffers {
            Buffers::Hot => (HOT_BYTES, HOT_BYTES),
            Buffers::SameShape {
                pool_bytes,
                block_size,
            } => (
                (pool_bytes / self.total() as u64).max(block_size),
                block_size,
            ),
        }
    }
}

/// Both buffers of one end of a raw stream (None: the kernel's autotuning, left alone).
pub fn set_socket_buffer(s: &TcpStream, size: Option<u32>) -> Result<()> {
    size.map_or(Ok(()), |n| TcpBuffer::Bytes(n).apply(s))
        .map_err(|e| Error::io("set ceiling socket buffers", e))
}

/// Raw TCP streams in the direction the data of the row flows, all at once for `secs`.
pub fn tcp_stream(control: SocketAddr, shape: StreamShape, secs: f64) -> Result<Ceiling> {
    let span = Duration::from_secs_f64(secs);
    let streams = shape.total();
    let (share, block) = shape.share();
    // Pools are made (and their pages touched) before the clock starts.
    let pools: Vec<RawPool> = (0..streams)
        .map(|i| {
            let repeat = shape.repeat() as usize;
            RawPool::new(share as usize, block as usize, repeat, 100 + i as u64)
        })
        .collect();
    // Every stream connects and the target fills its side first; then all start together.
    let go = Arc::new(Barrier::new(streams + 1));
    let workers: Vec<_> = pools
        .into_iter()
        .enumerate()
        .map(|(i, pool)| {
            let go = go.clone();
            let towards_target = shape.towards_target(i);
            std::thread::spawn(move || one_stream(control, shape, towards_target, pool, span, &go))
        })
        .collect();
    go.wait();
    let start = Instant::now();
    let mut bytes = 0u64;
    for w in workers {
        bytes += w
            .join()
            .map_err(|_| Error::io("ceiling stream", io::Error::other("thread panicked")))??;
    }
    Ok(Ceiling {
        name: shape.name(),
        gbps: bytes as f64 / start.elapsed().as_secs_f64() / 1e9,
        p50_us: None,
    })
}

/// Bytes one stream delivered within `span` (counted by the receiver).
fn one_stream(
    control: SocketAddr,
    shape: StreamShape,
    towards_target: bool,
    mut pool: RawPool,
    span: Duration,
    go: &Barrier,
) -> Result<u64> {
    let io = |e| Error::io("ceiling stream", e);
    let (bytes, block_size) = shape.share();
    let (socket_buffer, repeat) = (shape.socket_buffer, shape.repeat());
    let set_buffer = |s: &TcpStream| set_socket_buffer(s, socket_buffer);
    if towards_target {
        let s = ControlClient::raw(
            control,
            &Request::Sink {
                bytes,
                block_size,
                socket_buffer,
                repeat,
            },
        );
        go.wait();
        let mut s = s?;
        set_buffer(&s)?;
        let start = Instant::now();
        while start.elapsed() < span {
            pool.write_some(&mut s).map_err(io)?;
        }
        s.shutdown(Shutdown::Write).map_err(io)?;
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line).map_err(io)?;
        match serde_json::from_str(&line) {
            Ok(Reply::SinkDone { bytes }) => Ok(bytes),
            _ => Err(Error::Control {
                peer: control.to_string(),
                reason: format!("bad sink reply {line:?}"),
            }),
        }
    } else {
        let s = ControlClient::raw(
            control,
            &Request::Source {
                bytes,
                block_size,
                socket_buffer,
                repeat,
            },
        );
        go.wait();
        let mut s = s?;
        set_buffer(&s)?;
        let start = Instant::now();
        let mut total = 0u64;
        while start.elapsed() < span {
            match pool.read_some(&mut s).map_err(io)? {
                0 => break,
                n => total += n as u64,
            }
        }
        Ok(total)
    }
}

/// A 32-byte request answered by `size` bytes, back to back: the floor for one small read. With
/// `spin`, both ends poll their sockets without sleeping (the target sleeps only after
/// `SPIN_IDLE` of silence).
pub fn tcp_ping_pong(control: SocketAddr, size: u64, spin: bool, secs: f64) -> Result<Ceiling> {
    let io = |e| Error::io("ping-pong", e);
    let mut s = ControlClient::raw(control, &Request::PingPong { size, spin })?;
    s.set_nonblocking(spin).map_err(io)?;
    let mut reply = vec![0u8; size as usize];
    let req = [0u8; 32];
    let span = Duration::from_secs_f64(secs);
    let mut rtts = Vec::new();
    let start = Instant::now();
    while start.elapsed() < span {
        let t = Instant::now();
        if spin {
            write_all_spinning(&mut s, &req).map_err(io)?;
            // The target answers at once; a silent one is an error, not a wait.
            read_exact_spinning(&mut s, &mut reply, Duration::MAX).map_err(io)?;
        } else {
            s.write_all(&req).map_err(io)?;
            s.read_exact(&mut reply).map_err(io)?;
        }
        rtts.push(t.elapsed());
    }
    let p50 = percentile(&mut rtts, 0.5);
    Ok(Ceiling {
        name: format!(
            "raw tcp ping-pong {}",
            if spin { "busy-poll" } else { "blocking" }
        ),
        gbps: size as f64 / p50.as_secs_f64() / 1e9,
        p50_us: Some(p50.as_secs_f64() * 1e6),
    })
}

/// Fills `buf` from a nonblocking socket, polling without sleeping (spinning, then yielding the
/// core between polls); after `idle` without a byte it sleeps in poll(2) until the socket is
/// readable.
pub fn read_exact_spinning(s: &mut TcpStream, buf: &mut [u8], idle: Duration) -> io::Result<()> {
    let mut got = 0;
    let mut quiet = Instant::now();
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                quiet = Instant::now();
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let silent = quiet.elapsed();
                if silent >= idle {
                    let mut fds = [rustix::event::PollFd::new(
                        &*s,
                        rustix::event::PollFlags::IN,
                    )];
                    match rustix::event::poll(&mut fds, None) {
                        Ok(_) | Err(rustix::io::Errno::INTR) => {}
                        Err(e) => return Err(e.into()),
                    }
                    quiet = Instant::now();
                } else if silent >= SPIN_PURE {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a nonblocking socket, polling while its send buffer is full.
pub fn write_all_spinning(s: &mut TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                std::thread::yield_now();
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `threads` threads each copying its contiguous share of `src` into `dst`, over and over: the
/// memory's copy bandwidth.
pub fn memcpy_contiguous(src: &[u8], dst: &mut [u8], threads: usize, secs: f64) -> Ceiling {
    const STEP: usize = 1 << 20;
    let len = src.len().min(dst.len());
    let threads = threads.clamp(1, len.div_ceil(STEP).max(1));
    let share = len.div_ceil(threads);
    let name = format!("memcpy ×{threads} contiguous");
    copy_on_threads(name, dst[..len].chunks_mut(share), secs, |t, d, _| {
        let s = &src[t * share..][..d.len()];
        for (d, s) in d.chunks_mut(STEP).zip(s.chunks(STEP)) {
            d.copy_from_slice(s);
        }
        d.len() as u64
    })
}

/// What a thread's bounce buffer holds: small enough to stay in its core's caches between the
/// two copies, as a socket buffer's bytes do at best between the sender's and the receiver's.
pub const BOUNCE_BYTES: usize = 64 << 10;

/// `threads` threads copying random blocks of `src` into random blocks of their own share of
/// `dst`, `per_batch` blocks between looks at the clock: the row's access pattern as plain
/// memcpy (shm), or, `via_cache`, as the two copies the kernel's TCP path makes of every byte
/// and nothing else: into a bounce buffer that stays in the thread's caches (send: user →
/// socket buffer), then out of it (receive: socket buffer → user). A tcp row between pools in
/// DRAM makes at least those copies, across two cores' caches, and does the protocol's work
/// besides: it cannot move more.
pub fn scattered_copies(
    src: &[u8],
    dst: &mut [u8],
    block: usize,
    per_batch: usize,
    threads: usize,
    secs: f64,
    via_cache: bool,
) -> Ceiling {
    let blocks = src.len().min(dst.len()) / block;
    let threads = threads.clamp(1, blocks.max(1));
    let mine = blocks / threads;
    let bounce = if via_cache {
        BOUNCE_BYTES.min(block)
    } else {
        0
    };
    let shares = dst[..mine * threads * block]
        .chunks_mut(mine * block)
        .map(|share| (share, vec![1u8; bounce]));
    let name = if via_cache {
        format!("2 copies ×{threads} via cache")
    } else {
        format!("memcpy ×{threads} same shape")
    };
    copy_on_threads(name, shares, secs, |_, (share, bounce), rng| {
        for _ in 0..per_batch {
            let s = rng.random_range(0..blocks) * block;
            let d = rng.random_range(0..mine) * block;
            if bounce.is_empty() {
                share[d..d + block].copy_from_slice(&src[s..s + block]);
                continue;
            }
            for at in (0..block).step_by(bounce.len()) {
                let n = bounce.len().min(block - at);
                bounce[..n].copy_from_slice(&src[s + at..][..n]);
                // Keeps the compiler from forwarding the first copy's source to the second.
                std::hint::black_box(&mut bounce[..n]);
                share[d + at..][..n].copy_from_slice(&bounce[..n]);
            }
        }
        (per_batch * block) as u64
    })
}

/// One thread per share of a destination, each running `pass(thread, share, rng)` (which
/// returns the bytes it copied) until `secs` have passed: the rate of all of them together.
fn copy_on_threads<S: Send>(
    name: String,
    shares: impl Iterator<Item = S>,
    secs: f64,
    pass: impl Fn(usize, &mut S, &mut SmallRng) -> u64 + Sync,
) -> Ceiling {
    let span = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let moved: u64 = std::thread::scope(|scope| {
        let pass = &pass;
        let workers: Vec<_> = shares
            .enumerate()
            .map(|(t, mut share)| {
                scope.spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(11 + t as u64);
                    let mut moved = 0u64;
                    while start.elapsed() < span {
                        moved += pass(t, &mut share, &mut rng);
                    }
                    moved
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("memcpy thread"))
            .sum()
    });
    Ceiling {
        name,
        gbps: moved as f64 / start.elapsed().as_secs_f64() / 1e9,
        p50_us: None,
    }
}
