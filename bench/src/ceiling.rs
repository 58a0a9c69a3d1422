//! What the same path can do without kvfabric, measured in the same run: a raw TCP stream and a
//! raw TCP ping-pong between the same hosts, and single-thread memcpy over the same blocks.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::control::{ControlClient, Reply, Request};
use crate::error::{Error, Result};
use crate::scatter::Scatter;
use crate::stats::percentile;

#[derive(Debug, Clone)]
pub struct Ceiling {
    pub name: String,
    pub gbps: f64,
    /// Set for latency ceilings (ping-pong).
    pub p50_us: Option<f64>,
}

/// Raw TCP streams in the direction the data of the row flows, as many as kvfabric opens data
/// connections, each moving random blocks of the row's size between cold pools of the row's size
/// (split among the streams) with readv/writev: the same path and memory pattern, no framing.
pub fn tcp_stream(control: SocketAddr, shape: StreamShape, secs: f64) -> Result<Ceiling> {
    let span = Duration::from_secs_f64(secs);
    let streams = shape.streams.max(1);
    let share = (shape.pool_bytes / streams as u64).max(shape.block_size);
    // Pools are made (and their pages touched) before the clock starts.
    let pools: Vec<Scatter> = (0..streams)
        .map(|i| Scatter::new(share as usize, shape.block_size as usize, 100 + i as u64))
        .collect();
    // Every stream connects and the target fills its side first; then all start together.
    let go = Arc::new(Barrier::new(streams + 1));
    let workers: Vec<_> = pools
        .into_iter()
        .map(|pool| {
            let go = go.clone();
            std::thread::spawn(move || one_stream(control, shape, share, pool, span, &go))
        })
        .collect();
    go.wait();
    let start = Instant::now();
    let mut bytes = 0u64;
    for w in workers {
        bytes += w
            .join()
            .map_err(|_| Error::io("ceiling stream", std::io::Error::other("thread panicked")))??;
    }
    Ok(Ceiling {
        name: format!("raw tcp ×{streams}"),
        gbps: bytes as f64 / start.elapsed().as_secs_f64() / 1e9,
        p50_us: None,
    })
}

#[derive(Debug, Clone, Copy)]
pub struct StreamShape {
    pub towards_target: bool,
    pub streams: usize,
    pub pool_bytes: u64,
    pub block_size: u64,
}

/// Bytes one stream delivered within `span` (counted by the receiver).
fn one_stream(
    control: SocketAddr,
    shape: StreamShape,
    share: u64,
    mut pool: Scatter,
    span: Duration,
    go: &Barrier,
) -> Result<u64> {
    let io = |e| Error::io("ceiling stream", e);
    let (bytes, block_size) = (share, shape.block_size);
    if shape.towards_target {
        let s = ControlClient::raw(control, &Request::Sink { bytes, block_size });
        go.wait();
        let mut s = s?;
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
        let s = ControlClient::raw(control, &Request::Source { bytes, block_size });
        go.wait();
        let mut s = s?;
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

/// A 32-byte request answered by `size` bytes, back to back: the floor for one small read.
pub fn tcp_ping_pong(control: SocketAddr, size: u64, secs: f64) -> Result<Ceiling> {
    let mut s = ControlClient::raw(control, &Request::PingPong { size })?;
    let mut reply = vec![0u8; size as usize];
    let req = [0u8; 32];
    let span = Duration::from_secs_f64(secs);
    let mut rtts = Vec::new();
    let start = Instant::now();
    while start.elapsed() < span {
        let t = Instant::now();
        s.write_all(&req).map_err(|e| Error::io("ping-pong", e))?;
        s.read_exact(&mut reply)
            .map_err(|e| Error::io("ping-pong", e))?;
        rtts.push(t.elapsed());
    }
    let p50 = percentile(&mut rtts, 0.5);
    Ok(Ceiling {
        name: "raw tcp ping-pong".into(),
        gbps: size as f64 / p50.as_secs_f64() / 1e9,
        p50_us: Some(p50.as_secs_f64() * 1e6),
    })
}

/// One thread copying the same shape of batch (random blocks to random blocks) between two
/// pools of the row's size: what a plain memcpy loop gets from this memory.
pub fn memcpy(src: &[u8], dst: &mut [u8], block: usize, per_batch: usize, secs: f64) -> Ceiling {
    let blocks = src.len().min(dst.len()) / block;
    let mut rng = SmallRng::seed_from_u64(11);
    let span = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut moved = 0u64;
    while start.elapsed() < span {
        for _ in 0..per_batch {
            let s = rng.random_range(0..blocks) * block;
            let d = rng.random_range(0..blocks) * block;
            dst[d..d + block].copy_from_slice(&src[s..s + block]);
        }
        moved += (per_batch * block) as u64;
    }
    Ceiling {
        name: "memcpy 1 thread".into(),
        gbps: moved as f64 / start.elapsed().as_secs_f64() / 1e9,
        p50_us: None,
    }
}
