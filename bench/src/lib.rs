//! `kvfabric bench`: kvfabric against the ceiling of the same path, in the same run.

pub mod args;
mod bound;
mod ceiling;
pub mod control;
mod error;
mod initiator;
pub mod layout;
pub mod pattern;
pub mod registry;
mod report;
mod scatter;
mod server;
mod stats;
mod through_agent;
mod verify;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use kvfabric_agent::telemetry::{self, Telemetry, TraceConfig};
use kvfabric_engine::{Engine, EngineConfig, Location, Opcode, RdmaConfig};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub use error::{Error, Result};
pub use initiator::RowPlan;
pub use report::Row;

use crate::args::{BenchArgs, OpArg, SelftestArgs, TransportArg};
use initiator::Initiator;
use layout::{BatchForm, Layout};

/// The single-block row: how long one 4 KiB pull takes, against the fastest raw TCP ping-pong.
const LATENCY_BLOCK: u64 = 4096;

/// `kvfabric bench`: installs the log subscriber (and, with `--trace`, exports every span to an
/// OTLP receiver in this process), then runs the rows.
pub async fn main(args: BenchArgs, filter: tracing_subscriber::EnvFilter) -> Result<()> {
    let sink = if args.trace {
        Some(kvfabric_testkit::otlp::Receiver::start([127, 0, 0, 1].into()).await?)
    } else {
        None
    };
    let trace = sink.as_ref().map(|s| TraceConfig {
        endpoint: Some(s.endpoint()),
        sample_ratio: Some(1.0),
        service_name: Some("kvfabric-bench".into()),
    });
    let telemetry = telemetry::init(filter, trace, "kvfabric-bench")?;
    let result = run(args, &telemetry).await;
    telemetry.shutdown();
    result
}

async fn run(args: BenchArgs, telemetry: &Telemetry) -> Result<()> {
    if let Some(addr) = args.serve {
        return server::run(&args, addr, kvfabric_rt::shutdown::signal()).await;
    }
    let layout = Layout {
        args: args.layout.clone(),
    };
    if args.through_agent {
        let block = args.block_size.unwrap_or_else(|| layout.block_bytes());
        let per_batch = args
            .blocks_per_batch
            .unwrap_or(layout.ops_per_request() as usize);
        let report = through_agent::run(&args, telemetry, block, per_batch).await?;
        // Spans still queued are flushed (and counted) before the report is printed.
        telemetry.flush();
        if args.json {
            println!(
                "{}",
                serde_json::to_string(&report).map_err(|e| Error::io("report", e.into()))?
            );
        } else {
            println!("{}", through_agent::table(&report));
        }
        return Ok(());
    }
    let plans = plans(&args, &layout);
    for p in &plans {
        p.validate()?;
    }
    let rdma = plans.iter().any(|p| p.transport == TransportArg::Rdma);
    let engine = Engine::new(EngineConfig {
        name: "bench-initiator".into(),
        tcp_connections: args.connections,
        tcp_buffer: args.tcp_buffer,
        cuda_path: args.cuda_path,
        cuda_spin: args.cuda_spin,
        staging_bytes: args.staging_bytes,
        // --cuda-spin is the lowest-latency setting: the waiting slot polls briefly too.
        spin_wait: args.spin_wait(),
        rdma: RdmaConfig {
            enabled: rdma,
            ..RdmaConfig::default()
        },
        ..EngineConfig::default()
    })?;
    if rdma {
        // No device (or a build without rdma): say so before starting anything.
        let nics = engine.rdma_devices()?;
        if !args.json {
            for n in &nics {
                eprintln!(
                    "rdma: {} port {} ({}, {}), line rate {}",
                    n.name,
                    n.port,
                    n.link_layer,
                    n.gid,
                    n.rate_gbps
                        .map_or("unknown".to_string(), |r| format!("{r} Gb/s"))
                );
            }
        }
    }
    if !args.json {
        eprintln!("{}", layout.describe());
    }
    let (control, mut child) = match args.connect {
        Some(addr) => (addr, None),
        None => {
            let (addr, child) = spawn_target(&args).await?;
            (addr, Some(child))
        }
    };
    let result = run_rows(engine, control, &plans, &args).await;
    if let Some(child) = child.as_mut() {
        stop_target(child).await;
    }
    let rows = result?;
    if !args.json {
        println!("{}", report::table(&rows));
    }
    Ok(())
}

async fn run_rows(
    engine: Engine,
    control: SocketAddr,
    plans: &[RowPlan],
    args: &BenchArgs,
) -> Result<Vec<Row>> {
    let mut initiator = Initiator::new(engine, control, args.json)?;
    initiator.corrupt = args.test_corrupt;
    let mut rows = Vec::new();
    for plan in plans {
        let row = initiator.run_row(plan).await?;
        if args.json {
            println!("{}", serde_json::to_string(&row).expect("row serializes"));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// The rows a run measures: the flags given, or the main job (tcp and shm, write and read, at
/// the model's block size, plus the single-block latency row).
pub fn plans(args: &BenchArgs, layout: &Layout) -> Vec<RowPlan> {
    let gpu = |l: Location| matches!(l, Location::Cuda { .. });
    let transports = match args.transport {
        Some(t) => vec![t],
        None if gpu(args.location) && gpu(args.peer_location) => vec![TransportArg::CudaIpc],
        None if gpu(args.location) || gpu(args.peer_location) => vec![TransportArg::Auto],
        None => vec![TransportArg::Tcp, TransportArg::Shm],
    };
    let ops = match args.op {
        Some(OpArg::Read) => vec![Opcode::Read],
        Some(OpArg::Write) => vec![Opcode::Write],
        None => vec![Opcode::Write, Opcode::Read],
    };
    let base = RowPlan {
        transport: TransportArg::Tcp,
        op: Opcode::Read,
        block_size: args.block_size.unwrap_or_else(|| layout.block_bytes()),
        per_batch: args
            .blocks_per_batch
            .unwrap_or(layout.ops_per_request() as usize),
        concurrency: args.concurrency,
        pool_bytes: args.pool_bytes,
        duration: args.duration,
        checksum: args.checksum,
        key: args.key,
        location: args.location,
        peer_location: args.peer_location,
        bidirectional: args.bidirectional,
        cuda_path: args.cuda_path,
        planes: match args.form {
            BatchForm::Ops => None,
            BatchForm::Planes(n) => Some(n.unwrap_or_else(|| layout.planes())),
        },
    };
    let default_shape = args.block_size.is_none() && args.blocks_per_batch.is_none();
    // Block tables at the model's shape come with the TP-sharded one: the same ops per batch
    // in blocks of one rank's KV heads.
    let mut shapes = vec![base.clone()];
    if base.planes.is_some() && default_shape {
        shapes.push(RowPlan {
            block_size: layout.sharded_block_bytes(),
            ..base.clone()
        });
    }
    let mut plans = Vec::new();
    for shape in &shapes {
        for &transport in &transports {
            if args.bidirectional {
                plans.push(RowPlan {
                    transport,
                    ..shape.clone()
                });
                continue;
            }
            for &op in &ops {
                plans.push(RowPlan {
                    transport,
                    op,
                    ..shape.clone()
                });
            }
        }
    }
    let latency_transport = [TransportArg::Tcp, TransportArg::CudaIpc]
        .into_iter()
        .find(|t| transports.contains(t));
    if let Some(transport) = latency_transport.filter(|_| default_shape && !args.no_latency) {
        plans.push(RowPlan {
            transport,
            op: Opcode::Read,
            bidirectional: false,
            block_size: LATENCY_BLOCK,
            per_batch: 1,
            concurrency: 1,
            // One op, whatever the layout: the row measures completion.
            planes: None,
            ..base
        });
    }
    plans
}

/// Starts `kvfabric bench --serve 127.0.0.1:0` as a second process and learns its address.
async fn spawn_target(args: &BenchArgs) -> Result<(SocketAddr, Child)> {
    let exe = std::env::current_exe().map_err(|e| Error::io("locate own binary", e))?;
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "--serve", "127.0.0.1:0"])
        .arg("--connections")
        .arg(args.connections.to_string())
        .arg("--tcp-buffer")
        .arg(args.tcp_buffer.to_string())
        .arg("--staging-bytes")
        .arg(args.staging_bytes.to_string())
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if let Some(key) = args.key {
        cmd.arg("--key").arg(key.to_string());
    }
    if let Some(us) = args.busy_poll_us {
        cmd.arg("--busy-poll-us").arg(us.to_string());
    }
    if args.transport == Some(TransportArg::Rdma) {
        // The target registers its pools with its NICs only when told.
        cmd.args(["--transport", "rdma"]);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io("start bench target", e))?;
    let stdout = child.stdout.take().expect("piped");
    let mut line = String::new();
    let read = tokio::time::timeout(
        Duration::from_secs(30),
        BufReader::new(stdout).read_line(&mut line),
    )
    .await;
    let addr = match read {
        Ok(Ok(n)) if n > 0 => serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v["control"].as_str().and_then(|s| s.parse().ok())),
        _ => None,
    };
    match addr {
        Some(addr) => Ok((addr, child)),
        None => Err(Error::Control {
            peer: "bench target".into(),
            reason: format!("did not announce its address (got {line:?})"),
        }),
    }
}

/// `kvfabric gpu-selftest`: the GPU copy machinery against host mirrors; prints one JSON line.
pub fn selftest(args: SelftestArgs) -> Result<()> {
    let report = kvfabric_engine::cuda::selftest(args.devices, args.rounds, args.seed)?;
    println!(
        "{}",
        serde_json::json!({ "selftest": "passed", "report": report })
    );
    Ok(())
}

async fn stop_target(child: &mut Child) {
    if let Some(pid) = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32))
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}
