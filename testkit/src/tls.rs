//! Certificates for tests of mTLS between agents: a CA made in memory (`rcgen`), and agent
//! certificates it signs, written as a mounted `kubernetes.io/tls` Secret lays them out.

use std::path::Path;
use std::time::{Duration, SystemTime};

pub use rcgen::ExtendedKeyUsagePurpose;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

use time::OffsetDateTime;

use crate::error::{Error, Result};

/// A test CA. Every one is a different key, so two of them do not trust each other.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct TestCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("generate a CA key");
        TestCa {
            issuer: CertifiedIssuer::self_signed(params, key).expect("self-sign the CA"),
        }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `names` (DNS names), usable as client and server, as the operator's
    /// documented cert-manager Certificate makes one.
    pub fn issue(&self, names: &[&str]) -> TestCert {
        self.issue_for(
            names,
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    /// A certificate for `names` with only the extended key usages `usages`.
    pub fn issue_for(&self, names: &[&str], usages: &[ExtendedKeyUsagePurpose]) -> TestCert {
        self.make(names, usages, None)
    }

    /// [`TestCa::issue`], valid from an hour ago until `not_after` (which may have passed).
    pub fn issue_until(&self, names: &[&str], not_after: SystemTime) -> TestCert {
        let usages = [
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.make(names, &usages, Some(not_after))
    }

    fn make(
        &self,
        names: &[&str],
        usages: &[ExtendedKeyUsagePurpose],
        not_after: Option<SystemTime>,
    ) -> TestCert {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("valid DNS names");
        params
            .distinguished_name
            .push(DnType::CommonName, "kvfabric test agent");
        params.extended_key_usages = usages.to_vec();
        if let Some(not_after) = not_after {
            let hour_ago = SystemTime::now() - Duration::from_secs(3600);
            params.not_before = OffsetDateTime::from(hour_ago.min(not_after));
            params.not_after = OffsetDateTime::from(not_after);
        }
        let key = KeyPair::generate().expect("generate a key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        TestCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// Writes `tls.crt`, `tls.key` and `ca.crt` (this CA) into `dir`, as a Secret mounts them.
    pub fn write_dir(&self, dir: &Path, cert: &TestCert) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create tls dir", e))?;
        for (name, pem) in [
            ("tls.crt", &cert.cert_pem),
            ("tls.key", &cert.key_pem),
            ("ca.crt", &self.pem()),
        ] {
            std::fs::write(dir.join(name), pem)
                .map_err(|e| Error::io(format!("write {name}"), e))?;
        }
        Ok(())
    }
}
