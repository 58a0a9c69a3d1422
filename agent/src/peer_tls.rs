//! mTLS between agents: this agent's certificate, its key and the fabric's CA, read and checked
//! once at start (so a bad Secret exits 64 naming the file, instead of every peer call failing
//! later), then handed to the peer API server (which requires a client certificate of the CA) and
//! to the peer API client (which presents the certificate and verifies the server against the
//! CA under [`TLS_SERVER_NAME`]); the engine's tcp data port gets the same ([`DataTls`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvfabric_engine::DataTls;
use kvfabric_proto::contract::TLS_SERVER_NAME;
use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::error::{Error, Result};

/// A TLS handshake on the peer port must finish within this. The handshake and the first
/// authenticated request together get [`crate::incoming::PEER_AUTH_DEADLINE`] (the accept
/// loop cuts the connection then); this is tonic's own bound on the handshake, no longer.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = crate::incoming::PEER_AUTH_DEADLINE;

/// The file names of a mounted `kubernetes.io/tls` Secret (with the CA, as cert-manager writes it).
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";
pub const CA_FILE: &str = "ca.crt";

/// Checked PEM material. The key is kept only as PEM for tonic and never printed.
#[derive(Clone)]
pub struct PeerTls {
    pub cert_path: PathBuf,
    pub ca_path: PathBuf,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
    /// The same material for the engine's tcp data port.
    pub data: DataTls,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls")
            .field("cert", &self.cert_path)
            .field("ca", &self.ca_path)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl PeerTls {
    /// `tls.crt`, `tls.key` and `ca.crt` of `dir` (a mounted Secret).
    pub fn from_dir(dir: &Path) -> Result<PeerTls> {
        if !dir.is_dir() {
            return Err(Error::config("tls-dir", dir.display(), "not a directory"));
        }
        PeerTls::load(
            &dir.join(CERT_FILE),
            &dir.join(KEY_FILE),
            &dir.join(CA_FILE),
        )
    }

    /// Reads the three files and checks that the key is the certificate's, and that the
    /// certificate chains to the CA and is valid now both as a client certificate and as a
    /// server certificate for [`TLS_SERVER_NAME`] (the agent is both). Errors name the field.
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<PeerTls> {
        let read = |field: &'static str, path: &Path| {
            std::fs::read(path).map_err(|e| Error::config(field, path.display(), e.to_string()))
        };
        let (cert_pem, key_pem, ca_pem) = (
            read("tls-cert", cert)?,
            read("tls-key", key)?,
            read("tls-ca", ca)?,
        );
        let chain = certificates("tls-cert", cert, &cert_pem)?;
        let roots = certificates("tls-ca", ca, &ca_pem)?;
        let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
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
        let data = DataTls::new(chain.clone(), private, roots.clone(), TLS_SERVER_NAME)
            .map_err(|e| Error::config("tls-cert", cert.display(), e.to_string()))?;
        let (leaf, intermediates) = chain.split_first().expect("certificates() is never empty");
        let now = UnixTime::now();
        let not_ours = |role: &str, e: rustls::Error| {
            Error::config(
                "tls-cert",
                cert.display(),
                format!(
                    "not a {role} certificate of the CA in {}: {e}",
                    ca.display()
                ),
            )
        };
        WebPkiClientVerifier::builder_with_provider(store.clone(), provider.clone())
            .build()
            .map_err(|e| Error::config("tls-ca", ca.display(), e.to_string()))?
            .verify_client_cert(leaf, intermediates, now)
            .map_err(|e| not_ours("client", e))?;
        let name = ServerName::try_from(TLS_SERVER_NAME).expect("a valid DNS name");
        WebPkiServerVerifier::builder_with_provider(store, provider)
            .build()
            .map_err(|e| Error::config("tls-ca", ca.display(), e.to_string()))?
            .verify_server_cert(leaf, intermediates, &name, &[], now)
            .map_err(|e| not_ours(&format!("server ({TLS_SERVER_NAME})"), e))?;

        // tonic's server takes the process-wide provider; make it ring whatever else is linked.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(PeerTls {
            cert_path: cert.to_owned(),
            ca_path: ca.to_owned(),
            cert_pem,
            key_pem,
            ca_pem,
            data,
        })
    }

    /// The peer API server: this certificate, and a client certificate of the CA required
    /// before any request is read.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .timeout(TLS_HANDSHAKE_TIMEOUT)
    }

    /// Dialling another agent: present this certificate, accept only a server certificate of
    /// the CA for [`TLS_SERVER_NAME`].
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(self.identity())
            .domain_name(TLS_SERVER_NAME)
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert_pem, &self.key_pem)
    }
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
