//! TLS on the tcp data port: one certificate (chain and key) and one CA for both ends. A target
//! requires a client certificate the CA signed; an initiator verifies the target's certificate
//! against the CA for `server_name`. The challenge–response on the data secret runs inside.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::error::{Error, Result};

/// Both sides' rustls configurations (ring provider), made once.
#[derive(Clone)]
pub struct DataTls {
    pub(crate) client: Arc<ClientConfig>,
    pub(crate) server: Arc<ServerConfig>,
    pub(crate) server_name: ServerName<'static>,
}

impl std::fmt::Debug for DataTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
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
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for c in ca {
            roots.add(c).map_err(bad)?;
        }
        let roots = Arc::new(roots);
        let versions = rustls::DEFAULT_VERSIONS;
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(bad)?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(bad)?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(bad)?;
        let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(bad)?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .map_err(bad)?
            .with_webpki_verifier(server_verifier)
            .with_client_auth_cert(chain, key)
            .map_err(bad)?;
        Ok(DataTls {
            client: Arc::new(client),
            server: Arc::new(server),
            server_name: ServerName::try_from(server_name.to_owned()).map_err(bad)?,
        })
    }
}
