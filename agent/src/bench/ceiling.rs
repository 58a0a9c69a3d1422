//! What the same path can do without kvfabric, measured in the same run: a raw TCP stream and a
//! raw TCP ping-pong between the same hosts, and single-thread memcpy over the same blocks.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::control::{ControlClient, Reply, Request};
use super::stats::percentile;
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct Ceiling {
    pub name: String,
    pub gbps: f64,
    /// Set for latency ceilings (ping-pong).
    pub p50_us: Option<f64>,
}

/// One raw TCP stream in the direction the data of the row flows.
pub fn tcp_stream(control: SocketAddr, towards_target: bool, secs: f64) -> Result<Ceiling> {
    let span = Duration::from_secs_f64(secs);
    let mut buf = vec![0u8; 1 << 20];
    super::pattern::fill_block(3, 0, &mut buf);
    let gbps = if towards_target {
        let mut s = ControlClient::raw(control, &Request::Sink)?;
        let start = Instant::now();
        while start.elapsed() < span {
            s.write_all(&buf)
                .map_err(|e| Error::io("ceiling stream", e))?;
        }
        s.shutdown(Shutdown::Write)
            .map_err(|e| Error::io("ceiling stream", e))?;
        let mut line = String::new();
        BufReader::new(&s)
            .read_line(&mut line)
            .map_err(|e| Error::io("ceiling stream", e))?;
        let secs = start.elapsed().as_secs_f64();
        match serde_json::from_str(&line) {
            Ok(Reply::SinkDone { bytes }) => bytes as f64 / secs / 1e9,
            _ => {
                return Err(Error::Control {
                    peer: control.to_string(),
                    reason: format!("bad sink reply {line:?}"),
                });
            }
        }
    } else {
        let mut s = ControlClient::raw(control, &Request::Source)?;
        let start = Instant::now();
        let mut total = 0u64;
        while start.elapsed() < span {
            let n = s
                .read(&mut buf)
                .map_err(|e| Error::io("ceiling stream", e))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        total as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    Ok(Ceiling {
        name: "raw tcp stream".into(),
        gbps,
        p50_us: None,
    })
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
