//! `kvfabric-socket-dir --dir D --uid U --gid G --mode 2750`: the init container of every agent
//! pod (see `kvfabric_operator::socket_dir`). Exit 0 when done, 1 when it fails, 64 on bad flags.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Give the agent's hostPath socket directory to its user and the socket group.
#[derive(Debug, Parser)]
#[command(name = "kvfabric-socket-dir", version)]
struct Args {
    /// The directory (the hostPath volume's mount point).
    #[arg(long)]
    dir: PathBuf,
    /// Owner: the agent container's user.
    #[arg(long)]
    uid: u32,
    /// Group: the fabric's socket group.
    #[arg(long)]
    gid: u32,
    /// Octal mode, e.g. 2750.
    #[arg(long, value_parser = |s: &str| u32::from_str_radix(s, 8).map_err(|e| e.to_string()))]
    mode: u32,
}

fn main() -> ExitCode {
    let args: Args = match kvfabric_rt::args::parse() {
        Ok(a) => a,
        Err(exit) => return exit,
    };
    match kvfabric_operator::socket_dir::prepare(&args.dir, args.uid, args.gid, args.mode) {
        Ok(()) => {
            println!(
                "kvfabric-socket-dir: {} is {}:{} {:o}",
                args.dir.display(),
                args.uid,
                args.gid,
                args.mode
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvfabric-socket-dir: {e}");
            ExitCode::FAILURE
        }
    }
}
