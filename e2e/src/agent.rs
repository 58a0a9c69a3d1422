//! `kvfabric agent` as a child process, optionally inside a network namespace.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::net::Host;

/// The `kvfabric` binary of this workspace, rebuilt once per test process when stale (a lone
/// `cargo test -p kvfabric-e2e` does not rebuild other packages' binaries).
pub fn kvfabric_bin() -> PathBuf {
    binaries().join("kvfabric")
}

/// The `kvfabric-operator` binary of this workspace, built with [`kvfabric_bin`].
pub fn operator_bin() -> PathBuf {
    binaries().join("kvfabric-operator")
}

/// Builds both binaries in one cargo run, once per test process, and returns the directory
/// that holds them. One run: built apart, their shared dependencies get different features
/// each time, and each build undoes the other's (a minute of rebuilding per test binary).
fn binaries() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test binary path");
        // target/<profile>/deps/<test> or target/<profile>/<bin> → target/<profile>/
        let dir = exe.parent().expect("target profile dir");
        let profile_dir = if dir.ends_with("deps") {
            dir.parent().expect("target profile dir")
        } else {
            dir
        }
        .to_path_buf();
        let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cargo.args([
            "build",
            "-q",
            "-p",
            "kvfabric-cli",
            "--bin",
            "kvfabric",
            "-p",
            "kvfabric-operator",
            "--bin",
            "kvfabric-operator",
        ]);
        if profile_dir.ends_with("release") {
            cargo.arg("--release");
        }
        // What cargo set for this test process describes the e2e package, not the build:
        // build scripts that watch such variables (ring's watch CARGO_PKG_NAME) would rerun
        // and rebuild everything above them on every test run.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_BIN_",
                "CARGO_CRATE_",
            ]
            .iter()
            .any(|p| name.starts_with(p))
                || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR"].contains(&name.as_ref())
            {
                cargo.env_remove(name.as_ref());
            }
        }
        // A failed build must fail the tests: an older binary left in target/ would test code
        // that is not this tree's.
        let status = cargo.status().expect("run cargo to build the binaries");
        assert!(
            status.success(),
            "could not build kvfabric and kvfabric-operator into {}",
            profile_dir.display()
        );
        profile_dir
    })
    .clone()
}

pub use kvfabric_proto::ready::Ready;

/// Flags of agents under faults: tcp only, registry lease TTL `ttl_secs`, batches given up
/// after `batch_timeout_ms`, and one second for a connection or an etcd request (also how
/// long a watch may stay silent).
pub fn fault_flags(ttl_secs: u64, batch_timeout_ms: u64) -> Vec<String> {
    [
        "--transports",
        "tcp",
        "--lease-ttl-secs",
        &ttl_secs.to_string(),
        "--batch-timeout-ms",
        &batch_timeout_ms.to_string(),
        "--connect-timeout-ms",
        "1000",
    ]
    .map(String::from)
    .to_vec()
}

#[derive(Debug)]
pub struct AgentProcess {
    pub name: String,
    pub ready: Ready,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// How it was started, for [`AgentProcess::restart`].
    netns: Option<String>,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl AgentProcess {
    /// Starts an agent on `host` with `etcd` endpoints and extra flags; waits for its ready line.
    pub fn spawn(name: &str, host: &Host, etcd: &str, extra: &[&str]) -> AgentProcess {
        AgentProcess::spawn_env(name, host, etcd, extra, &[])
    }

    /// Like [`AgentProcess::spawn`], with extra environment variables.
    pub fn spawn_env(
        name: &str,
        host: &Host,
        etcd: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> AgentProcess {
        let dir = tempfile::tempdir().expect("socket dir");
        let ip = host.ip.to_string();
        let mut args: Vec<String> = vec![
            "agent".into(),
            "--name".into(),
            name.into(),
            "--fabric".into(),
            "e2e".into(),
            "--socket-dir".into(),
            dir.path().display().to_string(),
            "--grpc-addr".into(),
            format!("{ip}:0"),
            "--data-addr".into(),
            format!("{ip}:0"),
            "--metrics-addr".into(),
            format!("{ip}:0"),
            "--advertise-addr".into(),
            ip,
            "--etcd-endpoints".into(),
            etcd.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let netns = host.netns.clone();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (child, ready) = launch(name, dir.path(), netns.as_deref(), &args, &env);
        AgentProcess {
            name: name.into(),
            ready,
            child: Some(child),
            dir,
            netns,
            args,
            env,
        }
    }

    /// Starts the agent again after it stopped: same name, flags and socket directory (new
    /// ports), as a restarted pod of the DaemonSet would come back.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "agent {} still runs", self.name);
        let (child, ready) = launch(
            &self.name,
            self.dir.path(),
            self.netns.as_deref(),
            &self.args,
            &self.env,
        );
        self.child = Some(child);
        self.ready = ready;
    }

    /// The agent's process id while it runs (`ip netns exec` execs it: the same process).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// SIGKILL: the agent dies with its connections and keeps its registry keys until the lease
    /// runs out.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes the agent (SIGSTOP): its sockets stay open and the kernel keeps receiving for
    /// it, but it reads, answers and renews nothing until [`AgentProcess::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused agent go on (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, which: &str) {
        let c = self.child.as_ref().expect("agent runs");
        let status = Command::new("kill")
            .args([which, &c.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {which} {}", c.id());
    }

    /// Sends SIGTERM (the agent starts draining) and returns at once.
    pub fn sigterm(&self) {
        self.signal("-TERM");
    }

    /// Waits up to `limit` for the agent to exit and returns its exit code (None: killed by a
    /// signal); SIGKILLs it and panics when it does not exit in time.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let mut c = self.child.take().expect("agent runs");
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!(
                    "agent {} did not exit within {limit:?}; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM and wait (20 s): the agent drains and deletes its keys. Returns its exit code.
    pub fn terminate(&mut self) -> Option<i32> {
        self.sigterm();
        self.wait_exit(Duration::from_secs(20))
    }
}

/// Runs the binary (in `netns`, if any) with its log appended to `dir/agent.log` and waits (30 s)
/// for its ready line; panics with the log if none comes.
fn launch(
    name: &str,
    dir: &Path,
    netns: Option<&str>,
    args: &[String],
    env: &[(String, String)],
) -> (Child, Ready) {
    let bin = kvfabric_bin();
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&bin);
            c
        }
        None => Command::new(&bin),
    };
    let log_path = dir.join("agent.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .expect("agent log");
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("KVFABRIC_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log));
    let mut child = cmd.spawn().expect("spawn kvfabric agent");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    match serde_json::from_str(&line) {
        Ok(ready) => (child, ready),
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            panic!("agent {name} did not start (line {line:?}); log:\n{log}");
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
