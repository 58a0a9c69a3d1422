//! `kvfabric bench --serve ADDR`: the target. Registers pools on request, serves the engine's
//! tcp and shm data planes, and answers ceiling streams, until SIGTERM/SIGINT.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvfabric_engine::{Engine, EngineConfig, RdmaConfig, RegionDesc, TcpBuffer};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::args::{BenchArgs, TransportArg};
use crate::ceiling;
use crate::control::{Reply, Request};
use crate::error::{Error, Result};
use crate::pattern;
use crate::scatter::RawPool;

/// How long in-flight work may take to finish after a stop signal.
const GRACE: Duration = Duration::from_secs(5);
/// Largest ping-pong reply a client may ask for.
const MAX_PING: u64 = 64 << 20;
/// Largest scratch pool a ceiling stream may ask for.
const MAX_SCRATCH: u64 = 16 << 30;

pub async fn run(
    args: &BenchArgs,
    addr: SocketAddr,
    stop: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let engine = Engine::new(EngineConfig {
        name: "bench-target".into(),
        segment_key: args.key,
        tcp_connections: args.connections,
        tcp_buffer: args.tcp_buffer,
        staging_bytes: args.staging_bytes,
        spin_wait: args.spin_wait(),
        // Pools are registered with the NICs (pinned) only for an rdma run.
        rdma: RdmaConfig {
            enabled: args.transport == Some(TransportArg::Rdma),
            ..RdmaConfig::default()
        },
        ..EngineConfig::default()
    })?;
    let control = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("bind control {addr}"), e))?;
    let data = tokio::net::TcpListener::bind((addr.ip(), 0))
        .await
        .map_err(|e| Error::io(format!("bind data port on {}", addr.ip()), e))?;
    let shm_path = std::env::temp_dir().join(format!("kvfabric-bench-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&shm_path);
    let uds = tokio::net::UnixListener::bind(&shm_path)
        .map_err(|e| Error::io(format!("bind {}", shm_path.display()), e))?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let tcp = tokio::spawn({
        let engine = engine.clone();
        let s = stopped(stop_rx.clone());
        async move { engine.serve_tcp(data, s).await }
    });
    let shm = tokio::spawn({
        let engine = engine.clone();
        let s = stopped(stop_rx.clone());
        async move { engine.serve_shm(uds, s).await }
    });
    while engine.descriptor().endpoints.tcp.is_none() || engine.descriptor().endpoints.shm.is_none()
    {
        tokio::task::yield_now().await;
    }
    let local = control
        .local_addr()
        .map_err(|e| Error::io("control address", e))?;
    // The parent process (or a person) reads this line to learn where to connect.
    println!("{}", serde_json::json!({ "control": local.to_string() }));
    let _ = std::io::stdout().flush();
    info!(%local, "bench target ready");

    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            accepted = control.accept() => match accepted {
                Ok(a) => a,
                Err(e) => { warn!(error = %e, "control accept failed"); continue; }
            },
        };
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        if stream.set_nonblocking(false).is_err() || stream.set_nodelay(true).is_err() {
            continue;
        }
        let engine = engine.clone();
        let rt = tokio::runtime::Handle::current();
        std::thread::spawn(move || {
            if let Err(e) = serve_control(&engine, &rt, stream) {
                info!(%peer, error = %e, "control connection ended");
            }
        });
    }
    info!("stopping: draining data connections");
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(GRACE, async {
        let _ = tcp.await;
        let _ = shm.await;
    })
    .await;
    if drained.is_err() {
        warn!("data plane did not stop within {GRACE:?}");
    }
    let _ = std::fs::remove_file(&shm_path);
    Ok(())
}

fn serve_control(engine: &Engine, rt: &tokio::runtime::Handle, stream: TcpStream) -> Result<()> {
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| Error::io("clone", e))?);
    let mut out = stream;
    let mut line = String::new();
    loop {
        line.clear();
        if reader
            .read_line(&mut line)
            .map_err(|e| Error::io("read control", e))?
            == 0
        {
            return Ok(());
        }
        let reply = match serde_json::from_str::<Request>(&line) {
            Err(e) => Reply::Error {
                message: format!("bad request: {e}"),
            },
            Ok(Request::Sink { socket_buffer, .. } | Request::Source { socket_buffer, .. })
                if socket_buffer.is_some_and(|n| TcpBuffer::Bytes(n).invalid().is_some()) =>
            {
                Reply::Error {
                    message: format!("socket buffer {socket_buffer:?} out of range"),
                }
            }
            Ok(Request::Sink {
                bytes,
                block_size,
                socket_buffer,
                repeat,
            }) if bytes <= MAX_SCRATCH => {
                ceiling::set_socket_buffer(&out, socket_buffer)?;
                let pool = RawPool::new(bytes as usize, block_size as usize, repeat as usize, 8);
                return sink(reader, out, pool);
            }
            Ok(Request::Source {
                bytes,
                block_size,
                socket_buffer,
                repeat,
            }) if bytes <= MAX_SCRATCH => {
                ceiling::set_socket_buffer(&out, socket_buffer)?;
                let pool = RawPool::new(bytes as usize, block_size as usize, repeat as usize, 9);
                return source(out, pool);
            }
            Ok(Request::Sink { bytes, .. } | Request::Source { bytes, .. }) => Reply::Error {
                message: format!("ceiling pool of {bytes} bytes exceeds {MAX_SCRATCH}"),
            },
            Ok(Request::PingPong { size, spin }) if size <= MAX_PING => {
                return ping_pong(reader, out, size, spin);
            }
            Ok(Request::PingPong { size, .. }) => Reply::Error {
                message: format!("ping-pong size {size} exceeds {MAX_PING}"),
            },
            Ok(req) => handle(engine, rt, req).unwrap_or_else(|e| Reply::Error {
                message: e.to_string(),
            }),
        };
        let mut bytes = serde_json::to_vec(&reply).expect("reply serializes");
        bytes.push(b'\n');
        out.write_all(&bytes)
            .map_err(|e| Error::io("write control", e))?;
    }
}

fn handle(engine: &Engine, rt: &tokio::runtime::Handle, req: Request) -> Result<Reply> {
    Ok(match req {
        Request::Hello => Reply::Segment {
            descriptor: engine.descriptor(),
        },
        Request::Prepare {
            bytes,
            block_size,
            seed,
            location,
        } => {
            if block_size == 0 || bytes < block_size {
                return Err(Error::config(
                    "block_size",
                    block_size,
                    "must be 1..=pool bytes",
                ));
            }
            // The verifier compares whole blocks: a tail would be a part of the pool no row
            // writes and no check names.
            if !bytes.is_multiple_of(block_size) {
                return Err(Error::config(
                    "bytes",
                    bytes,
                    format!("not a whole number of {block_size}-byte blocks"),
                ));
            }
            let region = pattern::alloc_pool(engine, location, bytes, block_size, seed)?;
            Reply::Prepared {
                descriptor: engine.descriptor(),
                region: RegionDesc::of(&region),
                secret: engine.data_secret().clone(),
            }
        }
        Request::Verify {
            region,
            expectation,
        } => {
            let region = engine.region(region)?;
            let verdict = expectation.verify_region(&region)?;
            Reply::Verified { verdict }
        }
        Request::Poke {
            region,
            offset,
            xor,
        } => {
            pattern::poke(&*engine.region(region)?, offset, xor)?;
            Reply::Poked
        }
        Request::Release { region } => {
            rt.block_on(engine.deregister(region))?;
            Reply::Released
        }
        Request::RdmaConnect { peer, offer } => Reply::RdmaAnswer {
            answer: engine.rdma_accept(&peer, &offer)?,
        },
        Request::Sink { .. } | Request::Source { .. } | Request::PingPong { .. } => {
            unreachable!("raw modes are served by serve_control")
        }
    })
}

fn ready(out: &mut TcpStream) -> Result<()> {
    let mut bytes = serde_json::to_vec(&Reply::Ready).expect("serializes");
    bytes.push(b'\n');
    out.write_all(&bytes)
        .map_err(|e| Error::io("write control", e))
}

fn sink(reader: BufReader<TcpStream>, mut out: TcpStream, mut pool: RawPool) -> Result<()> {
    ready(&mut out)?;
    // The client waits for `ready` before streaming, so the reader holds no buffered bytes.
    let mut s = reader.into_inner();
    let mut total = 0u64;
    loop {
        match pool.read_some(&mut s) {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("sink", e)),
        }
    }
    let mut bytes = serde_json::to_vec(&Reply::SinkDone { bytes: total }).expect("serializes");
    bytes.push(b'\n');
    out.write_all(&bytes)
        .map_err(|e| Error::io("write control", e))
}

fn source(mut out: TcpStream, mut pool: RawPool) -> Result<()> {
    ready(&mut out)?;
    // Ends when the initiator hangs up.
    while pool.write_some(&mut out).is_ok() {}
    Ok(())
}

fn ping_pong(
    mut reader: BufReader<TcpStream>,
    mut out: TcpStream,
    size: u64,
    spin: bool,
) -> Result<()> {
    ready(&mut out)?;
    let mut reply = vec![0u8; size as usize];
    pattern::fill_block(7, 0, &mut reply);
    let mut req = [0u8; 32];
    if spin {
        // The client waits for `ready` before its first request: nothing is buffered yet.
        let mut s = reader.into_inner();
        s.set_nonblocking(true)
            .map_err(|e| Error::io("ping-pong", e))?;
        while ceiling::read_exact_spinning(&mut s, &mut req, ceiling::SPIN_IDLE).is_ok() {
            if ceiling::write_all_spinning(&mut s, &reply).is_err() {
                break;
            }
        }
        return Ok(());
    }
    while reader.read_exact(&mut req).is_ok() {
        if out.write_all(&reply).is_err() {
            break;
        }
    }
    Ok(())
}
