//! TLS on the tcp data port: one certificate (chain and key) and one CA for both ends. A target
//! requires a client certificate the CA signed for `server_name`; an initiator verifies the
//! target's certificate against the CA for `server_name`. The challenge–response on the data
//! secret runs inside.
//!
//! The configurations can be replaced while the engine runs ([`DataTls::update`]): a renewed
//! certificate (cert-manager rewrites the mounted Secret in place) is used by every connection
//! made after, without a restart; connections already open keep the session they have.

use std::sync::{Arc, PoisonError, RwLock};

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};

use crate::error::{Error, Result};
use crate::transport::kernel_tls::RecordLayer;

/// Both sides' rustls configurations ([`provider`]); clones share them, and an update of one
/// is seen by all.
#[derive(Clone)]
pub struct DataTls {
    current: Arc<RwLock<Arc<Configs>>>,
    /// Records sealed by the kernel where it offers TLS ([`RecordLayer`]); off by default.
    kernel_records: bool,
}

pub(crate) struct Configs {
    pub(crate) client: Arc<ClientConfig>,
    pub(crate) server: Arc<ServerConfig>,
    pub(crate) server_name: ServerName<'static>,
}

impl std::fmt::Debug for DataTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataTls")
            .field("server_name", &self.current().server_name)
            .finish_non_exhaustive()
    }
}

/// rustls' ring provider (the handshake) with TLS 1.3's suites in the order the data port
/// prefers: AES-128-GCM first — TLS 1.3's mandatory suite, with 128-bit security, and sealed
/// 1.1–1.2× as fast per core as AES-256-GCM where every byte of KV is sealed once and opened
/// once (docs/results.md) — then AES-256-GCM, then ChaCha20-Poly1305 for a peer that asks.
fn provider() -> CryptoProvider {
    use rustls::crypto::ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    CryptoProvider {
        cipher_suites: vec![
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..rustls::crypto::ring::default_provider()
    }
}

fn bad(e: impl std::fmt::Display) -> Error {
    Error::InvalidConfig {
        field: "tls",
        value: e.to_string(),
        reason: "a certificate chain, its private key and the CA that signed it",
    }
}

impl DataTls {
    pub fn new(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        ca: Vec<CertificateDer<'static>>,
        server_name: &str,
    ) -> Result<DataTls> {
        let provider = Arc::new(provider());
        let server_name = ServerName::try_from(server_name.to_owned()).map_err(bad)?;
        let mut roots = RootCertStore::empty();
        for c in ca {
            roots.add(c).map_err(bad)?;
        }
        let roots = Arc::new(roots);
        // TLS 1.3 only: the data port seals its own records after the handshake (RFC 8446
        // records; TLS 1.2's are not implemented there).
        let versions = &[&rustls::version::TLS13];
        let client_verifier = NamedClientVerifier::new(
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(bad)?,
            server_name.clone(),
        );
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(bad)?
            .with_client_cert_verifier(Arc::new(client_verifier))
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(bad)?;
        let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(bad)?;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .map_err(bad)?
            .with_webpki_verifier(server_verifier)
            .with_client_auth_cert(chain, key)
            .map_err(bad)?;
        // The data port takes the traffic secrets after the handshake, and never resumes a
        // session: no tickets to send or keep.
        server.enable_secret_extraction = true;
        server.send_tls13_tickets = 0;
        client.enable_secret_extraction = true;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(DataTls {
            current: Arc::new(RwLock::new(Arc::new(Configs {
                client: Arc::new(client),
                server: Arc::new(server),
                server_name,
            }))),
            kernel_records: false,
        })
    }

    /// Records sealed and opened by the kernel where it offers TLS (`on`), or always in
    /// userspace (the default: the kernel path has not run on a kernel with TLS here).
    pub fn kernel_records(mut self, on: bool) -> DataTls {
        self.kernel_records = on;
        self
    }

    /// Where this configuration's connections seal their records.
    pub fn record_layer(&self) -> RecordLayer {
        RecordLayer::chosen(self.kernel_records)
    }

    /// From now on, new connections (of this value and every clone of it) use `newer`'s
    /// certificate, key, CA and name.
    pub fn update(&self, newer: &DataTls) {
        let next = newer.current();
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = next;
    }

    pub(crate) fn current(&self) -> Arc<Configs> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The current client side: presents the certificate, verifies the server for the name.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.current().client.clone()
    }

    /// The current server side: presents the certificate, requires a client certificate of the
    /// CA for the name.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.current().server.clone()
    }

    pub fn server_name(&self) -> ServerName<'static> {
        self.current().server_name.clone()
    }

    /// For tests and benchmarks: a CA of its own (a fresh key, trusted by nothing else) and
    /// one certificate of it for `server_name`, as both sides' configuration.
    #[cfg(any(test, feature = "bench-helpers"))]
    pub fn throwaway(server_name: &str) -> DataTls {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        use rustls::pki_types::PrivatePkcs8KeyDer;
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().expect("a CA key");
        let ca = CertifiedIssuer::self_signed(params, key).expect("self-signed");
        let key = KeyPair::generate().expect("a key");
        let cert = CertificateParams::new(vec![server_name.to_string()])
            .expect("a DNS name")
            .signed_by(&key, &ca)
            .expect("signed");
        DataTls::new(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            vec![CertificateDer::from(ca.der().to_vec())],
            server_name,
        )
        .expect("a valid set")
    }
}

/// A client certificate verifier that also requires the certificate to carry `name` (a DNS
/// SAN), as a client verifies a server's: one CA may sign certificates of many fabrics, and
/// only this fabric's agents may call in.
#[derive(Debug)]
pub struct NamedClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl NamedClientVerifier {
    pub fn new(inner: Arc<dyn ClientCertVerifier>, name: ServerName<'static>) -> Self {
        NamedClientVerifier { inner, name }
    }
}

impl ClientCertVerifier for NamedClientVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        cert.verify_is_valid_for_subject_name(&self.name)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::NotValidForName))?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
