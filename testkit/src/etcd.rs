//! Real components for tests and benchmarks: a throwaway single-member etcd.
//!
//! [`EtcdServer`] runs the `etcd` binary of Debian's `etcd-server` package (or the one
//! `KVFABRIC_ETCD_BIN` names) on free ports with a temporary data directory, and can stop,
//! restart (same member, ports and data) and kill it, to test what clients do meanwhile.
//!
//! In a test, [`EtcdServer::or_skip`] turns a missing binary into a counted skip and any other
//! failure into a panic:
//!
//! ```no_run
//! # async fn demo() {
//! use kvfabric_testkit::EtcdServer;
//! let Some(etcd) = EtcdServer::or_skip(EtcdServer::start().await) else {
//!     return;
//! };
//! println!("etcd at {}", etcd.endpoint());
//! # }
//! ```

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::skip::{Why, skip};

/// Environment variable naming the etcd binary to run.
pub const ETCD_BIN_ENV: &str = "KVFABRIC_ETCD_BIN";
/// How long a start may take until etcd answers.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long `stop` waits after SIGTERM before it kills.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A single-member etcd for one test. Dropping it kills the process and removes its data.
#[derive(Debug)]
pub struct EtcdServer {
    bin: PathBuf,
    /// Serves https and requires client certificates (see [`EtcdServer::start_tls`]).
    tls: bool,
    /// `root`'s password once authentication is on (see [`EtcdServer::enable_auth`]).
    root_password: Option<String>,
    host: IpAddr,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl EtcdServer {
    /// The etcd binary: `$KVFABRIC_ETCD_BIN`, else `etcd` on `PATH`, else `/usr/bin/etcd`.
    pub fn binary() -> Result<PathBuf> {
        if let Some(bin) = std::env::var_os(ETCD_BIN_ENV) {
            let bin = PathBuf::from(bin);
            return if bin.is_file() {
                Ok(bin)
            } else {
                Err(Error::EtcdNotFound {
                    looked: format!("{ETCD_BIN_ENV}={}", bin.display()),
                })
            };
        }
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .map(|dir| dir.join("etcd"))
            .chain([PathBuf::from("/usr/bin/etcd")])
            .find(|bin| bin.is_file())
            .ok_or_else(|| Error::EtcdNotFound {
                looked: "etcd on PATH and /usr/bin/etcd".into(),
            })
    }

    /// For a test: the started server, or None after a [`skip`] where a binary it needs (etcd,
    /// openssl) is missing. Any other failure panics: an etcd that is installed must start.
    #[track_caller]
    pub fn or_skip(started: Result<Self>) -> Option<Self> {
        or_skip(started)
    }

    /// Starts etcd on 127.0.0.1 and waits until it answers.
    pub async fn start() -> Result<Self> {
        Self::start_on(IpAddr::V4(Ipv4Addr::LOCALHOST)).await
    }

    /// Starts etcd listening on `ip` (e.g. a bridge address that network namespaces reach).
    pub async fn start_on(ip: IpAddr) -> Result<Self> {
        let bin = Self::binary()?;
        let (client_port, peer_port) = free_ports(ip)?;
        let dir = tempfile::Builder::new()
            .prefix("kvfabric-etcd-")
            .tempdir()
            .map_err(|e| Error::io("create a data directory for etcd", e))?;
        let mut server = EtcdServer {
            bin,
            tls: false,
            root_password: None,
            host: ip,
            client_port,
            peer_port,
            dir,
            child: None,
        };
        server.start_again().await?;
        Ok(server)
    }

    /// Starts etcd on 127.0.0.1 with TLS: https only, client certificates required. The
    /// certificates (a throwaway CA, a server certificate for 127.0.0.1 and a client one) are
    /// made with the `openssl` command; [`EtcdServer::client_tls_dir`] holds what a client
    /// needs in the layout of a Kubernetes TLS secret (`ca.crt`, `tls.crt`, `tls.key`).
    pub async fn start_tls() -> Result<Self> {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let bin = Self::binary()?;
        let (client_port, peer_port) = free_ports(ip)?;
        let dir = tempfile::Builder::new()
            .prefix("kvfabric-etcd-")
            .tempdir()
            .map_err(|e| Error::io("create a data directory for etcd", e))?;
        let certs = dir.path().to_path_buf();
        tokio::task::spawn_blocking(move || make_certificates(&certs, ip))
            .await
            .map_err(|e| Error::io("make certificates", std::io::Error::other(e)))??;
        let mut server = EtcdServer {
            bin,
            tls: true,
            root_password: None,
            host: ip,
            client_port,
            peer_port,
            dir,
            child: None,
        };
        server.start_again().await?;
        Ok(server)
    }

    /// `http://HOST:PORT` (`https://` with TLS) for clients.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!(
            "{scheme}://{}",
            SocketAddr::new(self.host, self.client_port)
        )
    }

    /// With [`EtcdServer::start_tls`]: `ca.crt`, `tls.crt` and `tls.key` for a client.
    pub fn client_tls_dir(&self) -> PathBuf {
        self.dir.path().join("client")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// etcd's own log (stdout and stderr, across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Whether the process is running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// (Re)starts the same member: same name, ports and data directory. No-op if running.
    pub async fn start_again(&mut self) -> Result<()> {
        if self.is_running() {
            return Ok(());
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|e| Error::io(format!("open {}", self.log_path().display()), e))?;
        let stderr = log
            .try_clone()
            .map_err(|e| Error::io("duplicate the etcd log file", e))?;
        let client_url = self.endpoint();
        let peer_url = format!("http://{}", SocketAddr::new(self.host, self.peer_port));
        let name = "kvfabric-test";
        let mut command = Command::new(&self.bin);
        if self.tls {
            let server = self.dir.path().join("server");
            command
                .arg("--cert-file")
                .arg(server.join("tls.crt"))
                .arg("--key-file")
                .arg(server.join("tls.key"))
                .arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(server.join("ca.crt"));
        }
        let child = command
            .arg("--name")
            .arg(name)
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("{name}={peer_url}"))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--logger")
            .arg("zap")
            .arg("--log-outputs")
            .arg("stderr")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .spawn()
            .map_err(|e| Error::io(format!("run {}", self.bin.display()), e))?;
        self.child = Some(child);
        self.wait_ready().await
    }

    /// SIGTERM, then waits for the exit (SIGKILL after 10 s). Data stays for `start_again`.
    pub async fn stop(&mut self) -> Result<()> {
        if self.is_running() {
            let _ = self.signal(rustix::process::Signal::TERM);
            let deadline = Instant::now() + STOP_TIMEOUT;
            while self.is_running() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        self.kill().await
    }

    /// Freezes the process (SIGSTOP): it keeps its connections and answers nothing, as an
    /// overloaded or partitioned etcd would, until [`EtcdServer::resume`].
    pub fn pause(&mut self) -> Result<()> {
        self.signal(rustix::process::Signal::STOP)
    }

    /// Lets a paused etcd go on (SIGCONT); the requests sent meanwhile are answered.
    pub fn resume(&mut self) -> Result<()> {
        self.signal(rustix::process::Signal::CONT)
    }

    fn signal(&mut self, signal: rustix::process::Signal) -> Result<()> {
        let pid = self
            .child
            .as_ref()
            .and_then(|c| rustix::process::Pid::from_raw(c.id() as i32))
            .ok_or_else(|| Error::Etcd {
                endpoint: self.endpoint(),
                reason: format!("not running: cannot send {signal:?}"),
            })?;
        rustix::process::kill_process(pid, signal).map_err(|e| {
            Error::io(
                format!("send {signal:?} to etcd ({pid:?})"),
                std::io::Error::from(e),
            )
        })
    }

    /// SIGKILL and wait. Data stays for `start_again`.
    pub async fn kill(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let _ = child.kill();
        while matches!(child.try_wait(), Ok(None)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// A client of this etcd: with the client certificate under TLS, as `root` once
    /// authentication is on.
    pub async fn client(&self) -> Result<etcd_client::Client> {
        let root = self.root_password.as_deref().map(|p| ("root", p));
        self.client_as(root).await
    }

    /// Every key under `prefix`, sorted, read as `root` (the tests' view of what the registry
    /// holds).
    pub async fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        let mut client = self.client().await?;
        let options = etcd_client::GetOptions::new()
            .with_prefix()
            .with_keys_only();
        let resp = client
            .get(prefix, Some(options))
            .await
            .map_err(|e| Error::Etcd {
                endpoint: self.endpoint(),
                reason: format!("get {prefix}: {e}"),
            })?;
        let mut keys: Vec<String> = resp
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect();
        keys.sort();
        Ok(keys)
    }

    /// A client of this etcd as `user` (`(name, password)`; None: no credentials), with the
    /// client certificate under TLS.
    pub async fn client_as(&self, user: Option<(&str, &str)>) -> Result<etcd_client::Client> {
        let mut options = self.connect_options()?;
        if let Some((name, password)) = user {
            options = Some(options.unwrap_or_default().with_user(name, password));
        }
        etcd_client::Client::connect([self.endpoint()], options)
            .await
            .map_err(|e| self.etcd_error(e))
    }

    /// Turns authentication on: a `root` user (random password, used by [`EtcdServer::client`]
    /// from now on) and `user` with `password`, allowed to read and write the keys under
    /// `prefix` only, as a fabric's etcd account would be.
    pub async fn enable_auth(&mut self, user: &str, password: &str, prefix: &str) -> Result<()> {
        let mut c = self.client().await?;
        let root_password = format!(
            "root-{:x}",
            std::process::id() ^ u32::from(self.client_port)
        );
        let role = format!("{user}-prefix");
        let fail = |e| self.etcd_error(e);
        c.user_add("root", root_password.as_str(), None)
            .await
            .map_err(fail)?;
        c.user_grant_role("root", "root").await.map_err(fail)?;
        c.role_add(role.as_str()).await.map_err(fail)?;
        c.role_grant_permission(
            role.as_str(),
            etcd_client::Permission::read_write(prefix).with_prefix(),
        )
        .await
        .map_err(fail)?;
        c.user_add(user, password, None).await.map_err(fail)?;
        c.user_grant_role(user, role.as_str()).await.map_err(fail)?;
        c.auth_enable().await.map_err(fail)?;
        self.root_password = Some(root_password);
        Ok(())
    }

    fn etcd_error(&self, e: etcd_client::Error) -> Error {
        Error::Etcd {
            endpoint: self.endpoint(),
            reason: e.to_string(),
        }
    }

    /// Under TLS: the throwaway CA and the client certificate, as an agent reads them.
    fn connect_options(&self) -> Result<Option<etcd_client::ConnectOptions>> {
        if !self.tls {
            return Ok(None);
        }
        let dir = self.client_tls_dir();
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|e| Error::io(format!("read {}", path.display()), e))
        };
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read("ca.crt")?))
            .identity(etcd_client::Identity::from_pem(
                read("tls.crt")?,
                read("tls.key")?,
            ));
        Ok(Some(etcd_client::ConnectOptions::new().with_tls(tls)))
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut options = self.connect_options()?;
        if let Some(password) = &self.root_password {
            options = Some(
                options
                    .unwrap_or_default()
                    .with_user("root", password.as_str()),
            );
        }
        let mut last = String::from("no answer yet");
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(self.start_error(format!("etcd exited: {status}")));
            }
            if Instant::now() >= deadline {
                return Err(self.start_error(format!("not ready in {READY_TIMEOUT:?}: {last}")));
            }
            let probe = async {
                let options = options.clone();
                let mut client = etcd_client::Client::connect([self.endpoint()], options).await?;
                client.status().await
            };
            match tokio::time::timeout(Duration::from_secs(1), probe).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "status timed out".into(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn start_error(&mut self, reason: String) -> Error {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = self.log_path();
        Error::EtcdStart {
            endpoint: self.endpoint(),
            reason: format!("{reason}; log ends with: {}", tail(&log, 2000)),
            log: log.display().to_string(),
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A started etcd (server or cluster), or None after a [`skip`] where a binary it needs is
/// missing; any other failure panics.
#[track_caller]
pub(crate) fn or_skip<T>(started: Result<T>) -> Option<T> {
    match started {
        Ok(started) => Some(started),
        Err(e @ Error::EtcdNotFound { .. }) => {
            skip(Why::Missing("no etcd binary"), e);
            None
        }
        Err(e @ Error::OpensslNotFound { .. }) => {
            skip(Why::Missing("no openssl command"), e);
            None
        }
        Err(e) => panic!("etcd did not start: {e}"),
    }
}

/// Two distinct free TCP ports on `ip` (bound, then released for etcd to take).
pub(crate) fn free_ports(ip: IpAddr) -> Result<(u16, u16)> {
    let bind = || {
        TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("bind a free port on {ip}"), e))
    };
    let (a, b) = (bind()?, bind()?);
    let port = |l: &TcpListener| {
        l.local_addr()
            .map(|a| a.port())
            .map_err(|e| Error::io("read a bound port", e))
    };
    Ok((port(&a)?, port(&b)?))
}

/// The last `max` bytes of a file, for error messages.
pub(crate) fn tail(path: &Path, max: u64) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::from("(no log)");
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A throwaway CA in `dir`, a server certificate for `ip` in `dir/server` and a client one in
/// `dir/client`, each directory with `ca.crt`, `tls.crt`, `tls.key` (P-256, one day).
fn make_certificates(dir: &Path, ip: IpAddr) -> Result<()> {
    let openssl = |args: &[&str]| -> Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Error::OpensslNotFound { source: e },
                _ => Error::io("run openssl", e),
            })?;
        if !out.status.success() {
            return Err(Error::io(
                format!("openssl {}", args.join(" ")),
                std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
            ));
        }
        Ok(())
    };
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).map_err(|e| Error::io(format!("write {name}"), e))
    };
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &key,
            &[
                "-days",
                "1",
                "-subj",
                "/CN=kvfabric-test-ca",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
            ],
            &["-addext", "basicConstraints=critical,CA:TRUE"],
            &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ]
        .concat(),
    )?;
    for (who, usage, san) in [
        ("server", "serverAuth", format!("IP:{ip},DNS:localhost")),
        ("client", "clientAuth", "DNS:kvfabric-agent".to_string()),
    ] {
        let sub = dir.join(who);
        std::fs::create_dir_all(&sub).map_err(|e| Error::io(format!("create {who}/"), e))?;
        write(
            &format!("{who}.ext"),
            &format!(
                "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
                 extendedKeyUsage={usage}\nsubjectAltName={san}\n"
            ),
        )?;
        let (crt, key_file) = (format!("{who}/tls.crt"), format!("{who}/tls.key"));
        openssl(
            &[
                &["req"][..],
                &key,
                &[
                    "-subj",
                    &format!("/CN=kvfabric-test-{who}"),
                    "-keyout",
                    &key_file,
                ],
                &["-out", &format!("{who}.csr")],
            ]
            .concat(),
        )?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{who}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            &crt,
            "-extfile",
            &format!("{who}.ext"),
        ])?;
        std::fs::copy(dir.join("ca.crt"), sub.join("ca.crt"))
            .map_err(|e| Error::io(format!("copy ca.crt to {who}/"), e))?;
    }
    Ok(())
}
