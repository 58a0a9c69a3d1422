//! A throwaway etcd cluster of several members: real `etcd` processes on one address, each with
//! its own ports, data directory and log, for tests of what clients do when the leader or a
//! follower dies, comes back, or the history they watch is compacted.
//!
//! ```no_run
//! # async fn demo() {
//! use kvfabric_testkit::EtcdCluster;
//! let Some(mut cluster) = EtcdCluster::or_skip(EtcdCluster::start_on_loopback(3).await) else {
//!     return;
//! };
//! let leader = cluster.leader().await.unwrap();
//! cluster.kill(&leader).await.unwrap();
//! let next = cluster.leader().await.unwrap(); // elected by the two left
//! assert_ne!(leader, next);
//! cluster.start_again(&leader).await.unwrap();
//! # }
//! ```

use std::fs::OpenOptions;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Client, CompactionOptions, GetOptions};

use crate::error::{Error, Result};
use crate::etcd::{EtcdServer, tail};

/// How long starting the cluster (or one member) may take until it answers.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a leader may take to be elected (several election timeouts on a loaded machine).
const LEADER_TIMEOUT: Duration = Duration::from_secs(20);
/// Each request of the harness itself.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Several etcd members forming one cluster. Dropping it kills every process and removes the
/// data.
#[derive(Debug)]
pub struct EtcdCluster {
    bin: PathBuf,
    /// The network namespace the members run in (None: this process's).
    netns: Option<String>,
    host: IpAddr,
    dir: tempfile::TempDir,
    /// `name=peer-url,…` of every member: the cluster they were created as.
    initial_cluster: String,
    members: Vec<Member>,
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl Member {
    fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl EtcdCluster {
    /// For a test: the started cluster, or None after a skip where the etcd binary is missing.
    /// Any other failure panics: an etcd that is installed must start.
    #[track_caller]
    pub fn or_skip(started: Result<Self>) -> Option<Self> {
        crate::etcd::or_skip(started)
    }

    /// `members` members on 127.0.0.1.
    pub async fn start_on_loopback(members: usize) -> Result<Self> {
        Self::start_in(None, IpAddr::V4(Ipv4Addr::LOCALHOST), members).await
    }

    /// `members` members (named `m0`, `m1`, …) run in network namespace `netns` (None: this
    /// process's, as `ip netns exec` would run them), listening for clients and for each other
    /// on `ip`, an address of that namespace that this process reaches; waits until every
    /// member answers and a leader is elected.
    pub async fn start_in(netns: Option<&str>, ip: IpAddr, members: usize) -> Result<Self> {
        let bin = EtcdServer::binary()?;
        let dir = tempfile::Builder::new()
            .prefix("kvfabric-etcd-cluster-")
            .tempdir()
            .map_err(|e| Error::io("create a data directory for the etcd cluster", e))?;
        // In a namespace of its own the address cannot be bound from here, and every port is
        // free there: any distinct numbers do (taken from loopback here).
        let probe_ip = match netns {
            Some(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            None => ip,
        };
        let ports = free_port_list(probe_ip, members.saturating_mul(2))?;
        let members: Vec<Member> = ports
            .chunks(2)
            .enumerate()
            .map(|(i, p)| Member {
                name: format!("m{i}"),
                client_port: p[0],
                peer_port: p[1],
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://{}", m.name, SocketAddr::new(ip, m.peer_port)))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            bin,
            netns: netns.map(str::to_owned),
            host: ip,
            dir,
            initial_cluster,
            members,
        };
        // All at once: each member waits for the others to form the first quorum.
        for i in 0..cluster.members.len() {
            cluster.spawn(i)?;
        }
        for name in cluster.names() {
            cluster.wait_answers(&name).await?;
        }
        cluster.leader().await?;
        Ok(cluster)
    }

    /// Member names, `m0`, `m1`, ….
    pub fn names(&self) -> Vec<String> {
        self.members.iter().map(|m| m.name.clone()).collect()
    }

    /// Every member's client URL, down or not (what agents are configured with).
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| self.url(m.client_port))
            .collect()
    }

    /// The client URL of member `name`.
    pub fn endpoint(&self, name: &str) -> Result<String> {
        Ok(self.url(self.members[self.index(name)?].client_port))
    }

    /// Names of the members whose process runs.
    pub fn running(&mut self) -> Vec<String> {
        self.members
            .iter_mut()
            .filter_map(|m| m.is_running().then(|| m.name.clone()))
            .collect()
    }

    /// Member `name`'s log (stdout and stderr, across restarts).
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// The last `max` bytes of every member's log, for failure messages.
    pub fn log_tails(&self, max: u64) -> String {
        self.members
            .iter()
            .map(|m| format!("--- {} ---\n{}", m.name, tail(&self.log_path(&m.name), max)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// SIGKILL member `name` and wait for it to exit; its data stays for `start_again`.
    pub async fn kill(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        let Some(mut child) = self.members[i].child.take() else {
            return Ok(());
        };
        let _ = child.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(child.try_wait(), Ok(None)) {
            if Instant::now() >= deadline {
                return Err(self.member_error(name, "did not exit within 10 s of SIGKILL"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// Freezes member `name` (SIGSTOP): it keeps its connections and answers nothing.
    pub fn pause(&mut self, name: &str) -> Result<()> {
        self.signal(name, rustix::process::Signal::STOP)
    }

    /// Lets a paused member go on (SIGCONT).
    pub fn resume(&mut self, name: &str) -> Result<()> {
        self.signal(name, rustix::process::Signal::CONT)
    }

    /// Starts member `name` again with its data (no-op if it runs) and waits until it answers
    /// on its client port. A member serves clients only once it has rejoined, which takes a
    /// quorum: with most members down, start them together ([`EtcdCluster::start_members`]).
    pub async fn start_again(&mut self, name: &str) -> Result<()> {
        self.start_members(&[name]).await
    }

    /// [`EtcdCluster::start_again`] for several members at once: all are started, then each
    /// is waited for.
    pub async fn start_members(&mut self, names: &[&str]) -> Result<()> {
        let mut started = Vec::new();
        for name in names {
            let i = self.index(name)?;
            if !self.members[i].is_running() {
                self.spawn(i)?;
                started.push(name);
            }
        }
        for name in started {
            self.wait_answers(name).await?;
        }
        Ok(())
    }

    /// The leader's name once the running members agree on one that runs: one of them reports
    /// itself leader and every other that answers names it. Waits up to 20 s.
    pub async fn leader(&mut self) -> Result<String> {
        let deadline = Instant::now() + LEADER_TIMEOUT;
        loop {
            let running = self.running();
            let mut views = Vec::new();
            for name in &running {
                let endpoint = self.endpoint(name)?;
                if let Ok(Ok(status)) = tokio::time::timeout(REQUEST_TIMEOUT, async {
                    Client::connect([endpoint.as_str()], None)
                        .await?
                        .status()
                        .await
                })
                .await
                {
                    let own = status.header().map_or(0, |h| h.member_id());
                    views.push((name.clone(), own, status.leader()));
                }
            }
            let leaders: Vec<&(String, u64, u64)> = views
                .iter()
                .filter(|(_, own, leader)| *own != 0 && own == leader)
                .collect();
            if let [(name, id, _)] = leaders.as_slice()
                && views.iter().all(|(_, _, leader)| leader == id)
            {
                return Ok(name.clone());
            }
            if Instant::now() >= deadline {
                let seen = format!("(member, id, leader it names): {views:x?}");
                return Err(Error::Etcd {
                    endpoint: self.endpoints().join(","),
                    reason: format!(
                        "no leader agreed on within {LEADER_TIMEOUT:?}; last seen {seen}; \
                         logs:\n{}",
                        self.log_tails(1500)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A client of the running members (only: a dead endpoint in the list fails some calls).
    pub async fn client(&mut self) -> Result<Client> {
        let endpoints: Vec<String> = self
            .running()
            .iter()
            .map(|n| self.endpoint(n))
            .collect::<Result<_>>()?;
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT);
        Client::connect(&endpoints, Some(options))
            .await
            .map_err(|e| self.etcd_error("connect", e))
    }

    /// Every key under `prefix`, sorted, by a linearizable read (what the cluster agreed on,
    /// not one member's view).
    pub async fn keys(&mut self, prefix: &str) -> Result<Vec<String>> {
        let mut client = self.client().await?;
        let options = GetOptions::new().with_prefix().with_keys_only();
        let resp = client
            .get(prefix, Some(options))
            .await
            .map_err(|e| self.etcd_error(&format!("get {prefix}"), e))?;
        let mut keys: Vec<String> = resp
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect();
        keys.sort();
        Ok(keys)
    }

    /// Every key under `prefix` with the lease it is bound to (0: none), sorted by key.
    pub async fn keys_and_leases(&mut self, prefix: &str) -> Result<Vec<(String, i64)>> {
        let mut client = self.client().await?;
        let resp = client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.etcd_error(&format!("get {prefix}"), e))?;
        let mut keys: Vec<(String, i64)> = resp
            .kvs()
            .iter()
            .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.lease()))
            .collect();
        keys.sort();
        Ok(keys)
    }

    /// The ids of every lease the cluster holds, sorted.
    pub async fn leases(&mut self) -> Result<Vec<i64>> {
        let mut client = self.client().await?;
        let resp = client
            .leases()
            .await
            .map_err(|e| self.etcd_error("list leases", e))?;
        let mut ids: Vec<i64> = resp.leases().iter().map(|l| l.id()).collect();
        ids.sort_unstable();
        Ok(ids)
    }

    /// The cluster's current revision.
    pub async fn revision(&mut self) -> Result<i64> {
        let mut client = self.client().await?;
        let resp = client
            .get("/", Some(GetOptions::new().with_keys_only().with_limit(1)))
            .await
            .map_err(|e| self.etcd_error("read the revision", e))?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    /// Compacts the history up to the current revision (physically: every member has dropped
    /// it when this returns) and returns that revision. A watch from an older revision is
    /// answered "compacted" from now on.
    pub async fn compact(&mut self) -> Result<i64> {
        let revision = self.revision().await?;
        let mut client = self.client().await?;
        client
            .compact(revision, Some(CompactionOptions::new().with_physical()))
            .await
            .map_err(|e| self.etcd_error(&format!("compact at {revision}"), e))?;
        Ok(revision)
    }

    fn url(&self, port: u16) -> String {
        format!("http://{}", SocketAddr::new(self.host, port))
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.members
            .iter()
            .position(|m| m.name == name)
            .ok_or_else(|| Error::Etcd {
                endpoint: self.endpoints().join(","),
                reason: format!("no member {name:?} (members: {:?})", self.names()),
            })
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let (name, client_port, peer_port) = {
            let m = &self.members[i];
            (m.name.clone(), m.client_port, m.peer_port)
        };
        let log_path = self.log_path(&name);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| Error::io(format!("open {}", log_path.display()), e))?;
        let stderr = log
            .try_clone()
            .map_err(|e| Error::io("duplicate the etcd log file", e))?;
        let client_url = self.url(client_port);
        let peer_url = self.url(peer_port);
        // `ip netns exec` execs the binary (no fork): the child's pid is etcd's, for signals.
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        let child = command
            .arg("--name")
            .arg(&name)
            .arg("--data-dir")
            .arg(self.dir.path().join(&name))
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(&self.initial_cluster)
            // Ignored once the data directory exists (a restart rejoins as the same member).
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg(format!("kvfabric-test-{}", std::process::id()))
            .arg("--logger")
            .arg("zap")
            .arg("--log-outputs")
            .arg("stderr")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .map_err(|e| Error::io(format!("run {}", self.bin.display()), e))?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// Waits until member `name` answers a status request on its client port (served by the
    /// member itself, with or without a leader).
    async fn wait_answers(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        let endpoint = self.endpoint(name)?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last = String::from("no answer yet");
        loop {
            if let Some(child) = self.members[i].child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.members[i].child = None;
                return Err(self.start_error(name, format!("etcd exited: {status}")));
            }
            if Instant::now() >= deadline {
                return Err(
                    self.start_error(name, format!("not answering in {READY_TIMEOUT:?}: {last}"))
                );
            }
            let probe = async {
                Client::connect([endpoint.as_str()], None)
                    .await?
                    .status()
                    .await
            };
            match tokio::time::timeout(Duration::from_secs(1), probe).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "status timed out".into(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn signal(&mut self, name: &str, signal: rustix::process::Signal) -> Result<()> {
        let i = self.index(name)?;
        let pid = self.members[i]
            .child
            .as_ref()
            .and_then(|c| rustix::process::Pid::from_raw(c.id() as i32))
            .ok_or_else(|| {
                self.member_error(name, &format!("not running: cannot send {signal:?}"))
            })?;
        rustix::process::kill_process(pid, signal).map_err(|e| {
            Error::io(
                format!("send {signal:?} to etcd member {name} ({pid:?})"),
                std::io::Error::from(e),
            )
        })
    }

    fn member_error(&self, name: &str, reason: &str) -> Error {
        Error::Etcd {
            endpoint: self.endpoint(name).unwrap_or_default(),
            reason: format!("member {name}: {reason}"),
        }
    }

    fn etcd_error(&self, op: &str, e: etcd_client::Error) -> Error {
        Error::Etcd {
            endpoint: self.endpoints().join(","),
            reason: format!("{op}: {e}"),
        }
    }

    fn start_error(&self, name: &str, reason: String) -> Error {
        let log = self.log_path(name);
        Error::EtcdStart {
            endpoint: self.endpoint(name).unwrap_or_default(),
            reason: format!(
                "member {name}: {reason}; log ends with: {}",
                tail(&log, 2000)
            ),
            log: log.display().to_string(),
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut child) = m.child.take() {
                // A paused member must not keep a SIGKILL waiting: SIGKILL works on stopped
                // processes too.
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// `n` distinct free TCP ports on `ip`, all bound at once (so none is handed out twice), then
/// released for etcd to take.
fn free_port_list(ip: IpAddr, n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| {
            TcpListener::bind((ip, 0))
                .map_err(|e| Error::io(format!("bind a free port on {ip}"), e))
        })
        .collect::<Result<_>>()?;
    listeners
        .iter()
        .map(|l| {
            l.local_addr()
                .map(|a| a.port())
                .map_err(|e| Error::io("read a bound port", e))
        })
        .collect()
}
