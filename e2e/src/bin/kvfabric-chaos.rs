//! `kvfabric-chaos`: faults for as long as it is told, invariants checked all along, a table
//! at the end (see `kvfabric_e2e::chaos`). Needs root (network namespaces) and etcd. Exit 0:
//! every invariant held; 1: one did not; 64: bad configuration; 69: no namespaces or etcd.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvfabric_e2e::chaos::{self, Config, Fault, Shape};

#[derive(Debug, Parser)]
#[command(
    name = "kvfabric-chaos",
    about = "Agents, etcd and workers under a schedule of faults"
)]
struct Args {
    /// Agents (each in its own network namespace, with one worker).
    #[arg(long, env = "KVFABRIC_CHAOS_AGENTS", default_value_t = 3)]
    agents: usize,
    /// How long to inject faults, in seconds.
    #[arg(long, env = "KVFABRIC_CHAOS_SECS", default_value_t = 600)]
    secs: u64,
    /// Seconds between one fault's recovery and the next fault.
    #[arg(long, env = "KVFABRIC_CHAOS_FAULT_EVERY_SECS", default_value_t = 5)]
    fault_every_secs: u64,
    #[arg(long, env = "KVFABRIC_CHAOS_SEED")]
    seed: Option<u64>,
    /// Bytes per block.
    #[arg(long, default_value_t = 64 << 10)]
    block: u64,
    /// Blocks per worker's source segment.
    #[arg(long, default_value_t = 64)]
    blocks: u64,
    /// Blocks per pull.
    #[arg(long, default_value_t = 16)]
    per_pull: u64,
    /// The agents' registry lease TTL, seconds.
    #[arg(long, default_value_t = 5)]
    lease_ttl_secs: u64,
}

impl Args {
    fn config(self) -> Result<Config, String> {
        if !(2..=32).contains(&self.agents) {
            return Err(format!("--agents {}: between 2 and 32", self.agents));
        }
        if self.block == 0 || self.block > 64 << 20 {
            return Err(format!("--block {}: between 1 and 64 MiB", self.block));
        }
        if self.per_pull == 0 || self.per_pull > self.blocks || self.blocks > 4096 {
            return Err(format!(
                "--per-pull {} and --blocks {}: 1 ≤ per-pull ≤ blocks ≤ 4096",
                self.per_pull, self.blocks
            ));
        }
        if self.lease_ttl_secs < 2 {
            return Err(format!(
                "--lease-ttl-secs {}: at least 2",
                self.lease_ttl_secs
            ));
        }
        Ok(Config {
            agents: self.agents,
            duration: Duration::from_secs(self.secs),
            fault_every: Duration::from_secs(self.fault_every_secs),
            seed: self.seed.unwrap_or_else(rand::random),
            shape: Shape {
                block: self.block,
                blocks: self.blocks,
                per_pull: self.per_pull,
            },
            lease_ttl_secs: self.lease_ttl_secs,
            faults: Fault::ALL.to_vec(),
            max_faults: None,
        })
    }
}

fn main() -> ExitCode {
    let config = match Args::parse().config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvfabric-chaos: {e}");
            return ExitCode::from(64);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvfabric-chaos: cannot start the async runtime: {e}");
            return ExitCode::from(70);
        }
    };
    eprintln!(
        "kvfabric-chaos: {} agents, {} s, seed {} (KVFABRIC_CHAOS_SEED repeats the schedule)",
        config.agents,
        config.duration.as_secs(),
        config.seed
    );
    let bar = ProgressBar::new(config.duration.as_secs());
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} s {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let shown = bar.clone();
    let done = runtime.block_on(chaos::run(config, move |elapsed, counts| {
        shown.set_position(elapsed.as_secs());
        shown.set_message(counts);
    }));
    bar.finish();
    let report = match done {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvfabric-chaos: {e}");
            return ExitCode::from(69);
        }
    };
    println!("{}", report.recovery_table());
    println!("{}", report.invariant_table());
    for incident in &report.incidents {
        println!("incident: {incident}");
    }
    let violations = report.violations();
    if violations.is_empty() {
        println!(
            "every invariant held over {:.0} s and {} faults",
            report.elapsed.as_secs_f64(),
            report.recoveries.len()
        );
        ExitCode::SUCCESS
    } else {
        println!("violated: {}", violations.join("; "));
        ExitCode::FAILURE
    }
}
