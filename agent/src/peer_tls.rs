//! mTLS between agents: this agent's certificate, its key and the fabric's CA, read and checked
//! at start (so a bad Secret exits 64 naming the file, instead of every peer call failing
//! later), then used by the peer API server (which requires a client certificate of the CA
//! carrying the fabric's name), by the peer API client (which presents the certificate and
//! verifies the server against the CA for the fabric's name) and by the engine's tcp data port
//! ([`DataTls`]).
//!
//! cert-manager renews the certificate by rewriting the mounted Secret in place (Kubernetes
//! swaps a symlink, so the files' contents change at once, not their inodes). [`PeerTls::watch`]
//! reads the files every [`PeerTls::reload_every`]; a new set that passes the checks made at
//! start is used by every connection made after, on all three; one that fails is refused with a
//! warning naming the file, and the set in use stays. tonic's own TLS settings take PEM once
//! and cannot be changed, so the peer port's TLS is done here with tokio-rustls
//! ([`PeerTls::accept`], [`PeerTls::connector`]).

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt};
use hyper_util::rt::TokioIo;
use kvfabric_engine::{DataTls, NamedClientVerifier};
use kvfabric_proto::contract::tls_server_name;
use parking_lot::{Mutex, RwLock};
use prometheus_client::metrics::counter::Counter;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tracing::{debug, info, warn};

use crate::error::{Error, Result};

/// A TLS handshake on the peer port must finish within this. The handshake and the first
/// authenticated request together get [`crate::incoming::PEER_AUTH_DEADLINE`] (the accept
/// loop cuts the connection then); this bounds the handshake alone, no longer.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = crate::incoming::PEER_AUTH_DEADLINE;

/// The file names of a mounted `kubernetes.io/tls` Secret (with the CA, as cert-manager writes it).
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";
pub const CA_FILE: &str = "ca.crt";

/// How often the files are read again. The kubelet updates a mounted Secret a minute or so after
/// it changed; a few seconds more do not matter, and three small reads are cheap.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);

/// A warning is logged once this close to the certificate's notAfter (cert-manager renews at
/// two thirds of the lifetime, so a certificate this close to its end was not renewed).
pub const EXPIRY_WARNING: Duration = Duration::from_secs(24 * 3600);

/// The h2 ALPN protocol: tonic's client and server speak only HTTP/2.
const H2: &[u8] = b"h2";

/// The certificate, key and CA an agent uses, checked; clones share them, and a reload through
/// any clone is seen by all (and by the engine, which holds a clone of [`PeerTls::data`]).
#[derive(Clone)]
pub struct PeerTls {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    pub ca_path: PathBuf,
    /// The DNS name verified of peers, and required of this agent's certificate
    /// ([`tls_server_name`] of the fabric and namespace).
    pub name: String,
    server_name: ServerName<'static>,
    /// How often [`PeerTls::watch`] reads the files.
    pub reload_every: Duration,
    current: Arc<RwLock<Arc<Loaded>>>,
    /// What was refused last, so that one bad set (or one unreadable file) is warned of once,
    /// not at every look.
    refused: Arc<Mutex<Option<Refused>>>,
    /// The same material for the engine's tcp data port.
    pub data: DataTls,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("cert", &self.cert_path)
            .field("ca", &self.ca_path)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The three files' contents.
#[derive(Clone, PartialEq, Eq)]
struct Files {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

#[derive(PartialEq, Eq)]
enum Refused {
    Files(Files),
    /// A file could not be read: the error.
    Unreadable(String),
}

/// One checked set, as the peer port uses it.
struct Loaded {
    files: Files,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    data: DataTls,
    certificate: Certificate,
}

/// What identifies the certificate in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certificate {
    /// The serial number, hex.
    pub serial: String,
    pub not_after: SystemTime,
}

/// What one look at the files found.
#[derive(Debug)]
pub enum Reload {
    /// The files are as they were (or were being rewritten while read).
    Unchanged,
    /// A new set passed the checks; new connections use it.
    Reloaded(Certificate),
    /// The set refused last time (or the same unreadable file), still there.
    StillRefused,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl PeerTls {
    /// `tls.crt`, `tls.key` and `ca.crt` of `dir` (a mounted Secret), for the fabric's `name`.
    pub fn from_dir(dir: &Path, name: &str) -> Result<PeerTls> {
        if !dir.is_dir() {
            return Err(Error::config("tls-dir", dir.display(), "not a directory"));
        }
        PeerTls::load(
            &dir.join(CERT_FILE),
            &dir.join(KEY_FILE),
            &dir.join(CA_FILE),
            name,
        )
    }

    /// The fabric's name of `fabric` in `namespace` ([`tls_server_name`]).
    pub fn name_of(fabric: &str, namespace: &str) -> String {
        tls_server_name(fabric, namespace)
    }

    /// Reads the three files and checks that the key is the certificate's, and that the
    /// certificate chains to the CA and is valid now both as a client certificate and as a
    /// server certificate for `name` (the agent is both). Errors name the field.
    pub fn load(cert: &Path, key: &Path, ca: &Path, name: &str) -> Result<PeerTls> {
        let server_name = ServerName::try_from(name.to_owned())
            .map_err(|e| Error::config("tls-name", name, format!("not a DNS name: {e}")))?;
        let paths = Paths {
            cert,
            key,
            ca,
            name,
        };
        let loaded = paths.check(paths.read()?)?;
        // Anything else in the process that uses rustls' default gets ring too.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(PeerTls {
            cert_path: cert.to_owned(),
            key_path: key.to_owned(),
            ca_path: ca.to_owned(),
            name: name.to_owned(),
            server_name,
            reload_every: RELOAD_EVERY,
            data: loaded.data.clone(),
            current: Arc::new(RwLock::new(Arc::new(loaded))),
            refused: Arc::new(Mutex::new(None)),
        })
    }

    fn paths(&self) -> Paths<'_> {
        Paths {
            cert: &self.cert_path,
            key: &self.key_path,
            ca: &self.ca_path,
            name: &self.name,
        }
    }

    /// The certificate new connections present.
    pub fn in_use(&self) -> Certificate {
        self.current.read().certificate.clone()
    }

    /// Why the certificate in use cannot be used at `now` (it has expired); None while it can.
    pub fn expired(&self, now: SystemTime) -> Option<String> {
        let c = self.in_use();
        (now > c.not_after).then(|| {
            format!(
                "the certificate in {} (serial {}) expired at {} (unix seconds) and no valid \
                 renewal was found in the files",
                self.cert_path.display(),
                c.serial,
                unix(c.not_after)
            )
        })
    }

    /// Reads the files; a new set that passes the checks [`PeerTls::load`] makes is used from
    /// now on, one that fails is refused (the error names the file) and the set in use stays.
    pub fn reload(&self) -> Result<Reload> {
        let paths = self.paths();
        let files = match paths.read() {
            Ok(files) => files,
            Err(e) => return self.refuse(Refused::Unreadable(e.to_string()), e),
        };
        if files == self.current.read().files {
            return Ok(Reload::Unchanged);
        }
        let loaded = match paths.check(files.clone()) {
            Ok(loaded) => loaded,
            // Read while the kubelet swapped the Secret's files: look again next time.
            Err(_) if paths.read().ok().as_ref() != Some(&files) => return Ok(Reload::Unchanged),
            Err(e) => return self.refuse(Refused::Files(files), e),
        };
        let certificate = loaded.certificate.clone();
        self.data.update(&loaded.data);
        *self.current.write() = Arc::new(loaded);
        *self.refused.lock() = None;
        Ok(Reload::Reloaded(certificate))
    }

    fn refuse(&self, what: Refused, e: Error) -> Result<Reload> {
        let mut refused = self.refused.lock();
        if refused.as_ref() == Some(&what) {
            return Ok(Reload::StillRefused);
        }
        *refused = Some(what);
        Err(e)
    }

    /// Looks at the files every [`PeerTls::reload_every`] until `stop` resolves, counting
    /// reloads and refusals, and warning once as the certificate in use nears its notAfter.
    pub fn watch(
        self,
        reloads: Counter,
        refusals: Counter,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            tokio::pin!(stop);
            let mut every = tokio::time::interval(self.reload_every);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut warned_for = None;
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    () = &mut stop => return,
                }
                let me = self.clone();
                let looked = tokio::task::spawn_blocking(move || me.reload()).await;
                match looked {
                    Ok(Ok(Reload::Reloaded(c))) => {
                        reloads.inc();
                        info!(
                            cert = %self.cert_path.display(),
                            serial = %c.serial,
                            not_after = unix(c.not_after),
                            "renewed TLS certificate in use for new connections"
                        );
                    }
                    Ok(Ok(Reload::Unchanged | Reload::StillRefused)) => {}
                    Ok(Err(e)) => {
                        refusals.inc();
                        warn!(
                            error = %e,
                            "TLS files changed but the new set was refused (or a file could not \
                             be read); the certificate in use stays"
                        );
                    }
                    Err(e) => warn!(error = %e, "TLS reload task failed"),
                }
                let c = self.in_use();
                let left = c
                    .not_after
                    .duration_since(SystemTime::now())
                    .unwrap_or_default();
                if left < EXPIRY_WARNING && warned_for.as_ref() != Some(&c.serial) {
                    warn!(
                        cert = %self.cert_path.display(),
                        serial = %c.serial,
                        not_after = unix(c.not_after),
                        seconds_left = left.as_secs(),
                        "the TLS certificate in use expires soon and was not renewed"
                    );
                    warned_for = Some(c.serial);
                }
            }
        })
    }

    /// The peer port's TLS: each connection of `conns` is handshaken on its own task (a slow
    /// one holds up no other) with the set in use when it arrived; those that complete within
    /// [`TLS_HANDSHAKE_TIMEOUT`] come out. Ends when the server drops the stream.
    pub fn accept<S, T>(
        &self,
        conns: S,
    ) -> impl Stream<Item = io::Result<tokio_rustls::server::TlsStream<T>>> + use<S, T>
    where
        S: Stream<Item = io::Result<T>> + Send + 'static,
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let current = self.current.clone();
        tokio::spawn(async move {
            let mut conns = std::pin::pin!(conns);
            loop {
                let io = tokio::select! {
                    next = conns.next() => match next {
                        Some(Ok(io)) => io,
                        Some(Err(e)) => {
                            debug!(error = %e, "peer API accept failed");
                            continue;
                        }
                        None => return,
                    },
                    () = tx.closed() => return,
                };
                let acceptor = TlsAcceptor::from(current.read().server.clone());
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send(Ok(tls)).await;
                        }
                        Ok(Err(e)) => debug!(error = %e, "peer API TLS handshake failed"),
                        Err(_) => debug!("peer API TLS handshake timed out"),
                    }
                });
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }

    /// Dials for tonic (`Endpoint::connect_with_connector`, an `http://` URI): TCP to the URI's
    /// authority, then TLS with the set in use, verifying the server for [`PeerTls::name`].
    pub fn connector(&self) -> Connector {
        Connector {
            current: self.current.clone(),
            name: self.server_name.clone(),
        }
    }
}

/// See [`PeerTls::connector`].
#[derive(Clone)]
pub struct Connector {
    current: Arc<RwLock<Arc<Loaded>>>,
    name: ServerName<'static>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

type Connecting = Pin<
    Box<
        dyn Future<Output = io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>> + Send,
    >,
>;

impl tower::Service<http::Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Connecting {
        let connector = TlsConnector::from(self.current.read().client.clone());
        let name = self.name.clone();
        Box::pin(async move {
            let addr = uri
                .authority()
                .map(|a| a.as_str().to_owned())
                .ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, format!("no address in {uri}"))
                })?;
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            Ok(TokioIo::new(connector.connect(name, tcp).await?))
        })
    }
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

struct Paths<'a> {
    cert: &'a Path,
    key: &'a Path,
    ca: &'a Path,
    name: &'a str,
}

impl Paths<'_> {
    fn read(&self) -> Result<Files> {
        let read = |field: &'static str, path: &Path| {
            std::fs::read(path).map_err(|e| Error::config(field, path.display(), e.to_string()))
        };
        Ok(Files {
            cert: read("tls-cert", self.cert)?,
            key: read("tls-key", self.key)?,
            ca: read("tls-ca", self.ca)?,
        })
    }

    fn check(&self, files: Files) -> Result<Loaded> {
        let Paths {
            cert,
            key,
            ca,
            name,
        } = *self;
        let chain = certificates("tls-cert", cert, &files.cert)?;
        let roots = certificates("tls-ca", ca, &files.ca)?;
        let private = PrivateKeyDer::from_pem_slice(&files.key).map_err(|e| {
            Error::config(
                "tls-key",
                key.display(),
                format!("no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
            )
        })?;
        let provider = provider();
        let signing = provider
            .key_provider
            .load_private_key(private.clone_key())
            .map_err(|e| Error::config("tls-key", key.display(), e.to_string()))?;
        CertifiedKey::new(chain.clone(), signing)
            .keys_match()
            .map_err(|e| {
                Error::config(
                    "tls-key",
                    key.display(),
                    format!("does not match the certificate in {}: {e}", cert.display()),
                )
            })?;

        let mut store = RootCertStore::empty();
        for root in &roots {
            store
                .add(root.clone())
                .map_err(|e| Error::config("tls-ca", ca.display(), e.to_string()))?;
        }
        let store = Arc::new(store);
        let data = DataTls::new(chain.clone(), private, roots.clone(), name)
            .map_err(|e| Error::config("tls-cert", cert.display(), e.to_string()))?;
        let (leaf, intermediates) = chain.split_first().expect("certificates() is never empty");
        let now = UnixTime::now();
        let not_ours = |role: &str, e: rustls::Error| {
            let why = match e {
                rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                ) => format!(
                    "does not carry the DNS name {name} (a subjectAltName: the fabric's name, \
                     <fabric>.<namespace>.kvfabric), which peers verify"
                ),
                e => format!(
                    "not a {role} certificate of the CA in {}: {e}",
                    ca.display()
                ),
            };
            Error::config("tls-cert", cert.display(), why)
        };
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(store.clone(), provider.clone())
                .build()
                .map_err(|e| Error::config("tls-ca", ca.display(), e.to_string()))?;
        let dns = ServerName::try_from(name.to_owned())
            .map_err(|e| Error::config("tls-name", name, format!("not a DNS name: {e}")))?;
        NamedClientVerifier::new(client_verifier, dns.clone())
            .verify_client_cert(leaf, intermediates, now)
            .map_err(|e| not_ours("client", e))?;
        WebPkiServerVerifier::builder_with_provider(store, provider)
            .build()
            .map_err(|e| Error::config("tls-ca", ca.display(), e.to_string()))?
            .verify_server_cert(leaf, intermediates, &dns, &[], now)
            .map_err(|e| not_ours("server", e))?;
        let certificate =
            describe(leaf).map_err(|e| Error::config("tls-cert", cert.display(), e.to_string()))?;

        // The data port's configurations, but rustls keeps the peer API's secrets to itself.
        let mut server = (*data.server_config()).clone();
        server.alpn_protocols = vec![H2.to_vec()];
        server.enable_secret_extraction = false;
        let mut client = (*data.client_config()).clone();
        client.alpn_protocols = vec![H2.to_vec()];
        client.enable_secret_extraction = false;
        Ok(Loaded {
            files,
            server: Arc::new(server),
            client: Arc::new(client),
            data,
            certificate,
        })
    }
}

fn describe(leaf: &CertificateDer<'_>) -> std::result::Result<Certificate, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf).map_err(|e| e.to_string())?;
    let not_after = u64::try_from(parsed.validity().not_after.timestamp())
        .map_err(|_| "notAfter before 1970".to_owned())?;
    Ok(Certificate {
        serial: parsed.tbs_certificate.raw_serial_as_string(),
        not_after: UNIX_EPOCH + Duration::from_secs(not_after),
    })
}

fn certificates(
    field: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::config(field, path.display(), format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(Error::config(
            field,
            path.display(),
            "no PEM certificate in the file",
        ));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use kvfabric_testkit::TestCa;

    use super::*;

    const NAME: &str = "f.ns.kvfabric";

    #[test]
    fn an_unreadable_file_is_refused_once_and_a_good_set_after_is_taken() {
        let ca = TestCa::new("ca");
        let dir = tempfile::tempdir().unwrap();
        ca.write_dir(dir.path(), &ca.issue(&[NAME])).unwrap();
        let tls = PeerTls::from_dir(dir.path(), NAME).unwrap();
        let first = tls.in_use();
        let engine = tls.data.clone();
        let data_before = engine.server_config();
        assert!(matches!(tls.reload(), Ok(Reload::Unchanged)));

        std::fs::remove_file(dir.path().join(KEY_FILE)).unwrap();
        let e = tls.reload().unwrap_err();
        assert!(e.to_string().contains("tls-key"), "{e}");
        assert!(matches!(tls.reload(), Ok(Reload::StillRefused)));
        assert_eq!(tls.in_use(), first);

        ca.write_dir(dir.path(), &ca.issue(&[NAME])).unwrap();
        let Ok(Reload::Reloaded(renewed)) = tls.reload() else {
            panic!("the good set was not taken");
        };
        assert_ne!(renewed.serial, first.serial);
        assert_eq!(tls.in_use(), renewed);
        // Clones see it, the engine's data port configuration too.
        assert_eq!(tls.clone().in_use(), renewed);
        assert!(!Arc::ptr_eq(&data_before, &engine.server_config()));
        assert!(tls.expired(SystemTime::now()).is_none());
        let after = renewed.not_after + Duration::from_secs(1);
        let why = tls.expired(after).expect("expired after notAfter");
        assert!(why.contains(&renewed.serial), "{why}");
    }
}
