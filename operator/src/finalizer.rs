//! The `kvfabric.io/registry-cleanup` finalizer: when a fabric is deleted, its registry keys in
//! etcd go with it, so a fabric recreated under the same name does not see ghost segments.

use std::fmt::Debug;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::{Error, Result};

/// Finalizer on every `TransferFabric`.
pub const FINALIZER: &str = "kvfabric.io/registry-cleanup";

/// Most deletes one cleanup attempt sends while etcd refuses them at once as unavailable (see
/// [`EtcdCleaner`]); the number of endpoints plus one, up to this.
const MAX_DELETES: usize = 8;
/// First pause between those deletes, doubling up to `DELETE_PAUSE_CAP`.
const DELETE_PAUSE: Duration = Duration::from_millis(20);
const DELETE_PAUSE_CAP: Duration = Duration::from_millis(200);

/// How to reach the fabric's etcd: its endpoints and the credentials from the fabric's Secrets.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    /// Client URLs.
    pub endpoints: Vec<String>,
    /// From `etcd.tlsSecret`: PEM `ca.crt`, and `tls.crt` + `tls.key` for a client certificate.
    pub tls: Option<EtcdTls>,
    /// From `etcd.authSecret`: `username` and `password`.
    pub auth: Option<(String, String)>,
}

/// PEM material for TLS to etcd.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// Certificate authority that signed etcd's serving certificate.
    pub ca: Option<Vec<u8>>,
    /// Client certificate and key, when etcd asks for one.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca", &self.ca.is_some())
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

impl Debug for EtcdAccess {
    // Never print secrets: only whether they are there.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAccess")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls.is_some())
            .field("auth", &self.auth.as_ref().map(|(user, _)| user))
            .finish()
    }
}

/// Deletes a key prefix from the registry. A trait so tests can inject a fake instead of etcd.
pub trait RegistryCleaner: Send + Sync + Debug {
    /// Deletes every key under `prefix`, returning how many were deleted.
    fn delete_prefix<'a>(
        &'a self,
        access: &'a EtcdAccess,
        prefix: &'a str,
    ) -> BoxFuture<'a, Result<u64>>;
}

/// The production cleaner: the `etcd-client` crate, with TLS and authentication when the fabric
/// names Secrets for them.
///
/// With several endpoints, the client spreads requests over one connection per member, and a
/// request sent to a member that is down fails at once ("tcp connect error"). One attempt
/// therefore sends the delete again on the same client while etcd refuses it that way (at most
/// once more than there are endpoints), so a cluster with a member down is cleaned on the
/// first attempt. Deleting a prefix twice is harmless.
#[derive(Debug, Clone)]
pub struct EtcdCleaner {
    /// Limit on connecting and on each request.
    pub timeout: Duration,
}

impl RegistryCleaner for EtcdCleaner {
    fn delete_prefix<'a>(
        &'a self,
        access: &'a EtcdAccess,
        prefix: &'a str,
    ) -> BoxFuture<'a, Result<u64>> {
        Box::pin(async move {
            let endpoints = &access.endpoints;
            let fail = |e: etcd_client::Error| Error::Registry {
                endpoints: endpoints.to_vec(),
                prefix: prefix.to_owned(),
                message: e.to_string(),
            };
            let mut options = etcd_client::ConnectOptions::new()
                .with_connect_timeout(self.timeout)
                .with_timeout(self.timeout);
            if let Some((user, password)) = &access.auth {
                options = options.with_user(user.clone(), password.clone());
            }
            if let Some(tls) = &access.tls {
                let mut t = etcd_client::TlsOptions::new();
                if let Some(ca) = &tls.ca {
                    t = t.ca_certificate(etcd_client::Certificate::from_pem(ca));
                }
                if let Some((cert, key)) = &tls.identity {
                    t = t.identity(etcd_client::Identity::from_pem(cert, key));
                }
                options = options.with_tls(t);
            }
            let mut client = etcd_client::Client::connect(endpoints, Some(options))
                .await
                .map_err(fail)?;
            let tries = endpoints.len().saturating_add(1).min(MAX_DELETES);
            let mut pause = kvfabric_rt::Backoff::new(DELETE_PAUSE, DELETE_PAUSE_CAP);
            let mut deleted = 0u64;
            for attempt in 1..=tries {
                let options = etcd_client::DeleteOptions::new().with_prefix();
                match client.delete(prefix, Some(options)).await {
                    Ok(resp) => {
                        // Keys a refused try deleted after all are counted by no one: the count
                        // is this delete's.
                        deleted = u64::try_from(resp.deleted()).unwrap_or(0);
                        break;
                    }
                    Err(e) if attempt < tries && refused_at_once(&e) => {
                        tracing::debug!(attempt, error = %e, "registry cleanup refused; again");
                        tokio::time::sleep(pause.next_delay()).await;
                    }
                    Err(e) => return Err(fail(e)),
                }
            }
            Ok(deleted)
        })
    }
}

/// Whether etcd's client failed a request as unavailable (a member down or restarting, no
/// leader): another try may reach another member.
fn refused_at_once(e: &etcd_client::Error) -> bool {
    // gRPC's UNAVAILABLE (tonic's `Code` as i32; the operator does not link tonic itself).
    const UNAVAILABLE: i32 = 14;
    match e {
        etcd_client::Error::GRpcStatus(status) => i32::from(status.code()) == UNAVAILABLE,
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// How hard cleanup tries before giving up. Deletion must not hang forever on an etcd that is
/// gone for good, so after `attempts` the finalizer is removed anyway (with a `Degraded`
/// condition and a Warning event saying which keys may be left behind).
#[derive(Debug, Clone)]
pub struct CleanupPolicy {
    /// Attempts before giving up (at least 1).
    pub attempts: u32,
    /// Limit of each attempt.
    pub timeout: Duration,
    /// Pause between attempts, doubled after each failure.
    pub backoff: Duration,
}

impl Default for CleanupPolicy {
    fn default() -> Self {
        Self {
            attempts: 3,
            timeout: Duration::from_secs(5),
            backoff: Duration::from_millis(500),
        }
    }
}

/// Runs the cleaner up to `policy.attempts` times; the last error if all fail.
pub async fn clean_registry(
    cleaner: &dyn RegistryCleaner,
    policy: &CleanupPolicy,
    access: &EtcdAccess,
    prefix: &str,
) -> Result<u64> {
    let endpoints = &access.endpoints;
    let attempts = policy.attempts.max(1);
    let mut pause = policy.backoff;
    let mut last = None;
    for attempt in 1..=attempts {
        match tokio::time::timeout(policy.timeout, cleaner.delete_prefix(access, prefix)).await {
            Ok(Ok(n)) => return Ok(n),
            Ok(Err(e)) => {
                tracing::warn!(attempt, attempts, error = %e, "registry cleanup failed");
                last = Some(e);
            }
            Err(_) => {
                tracing::warn!(attempt, attempts, "registry cleanup timed out");
                last = Some(Error::Registry {
                    endpoints: endpoints.to_vec(),
                    prefix: prefix.to_owned(),
                    message: format!("timed out after {:?}", policy.timeout),
                });
            }
        }
        if attempt < attempts {
            tokio::time::sleep(pause).await;
            pause = pause.saturating_mul(2);
        }
    }
    Err(last.unwrap_or_else(|| Error::Registry {
        endpoints: endpoints.to_vec(),
        prefix: prefix.to_owned(),
        message: "no attempt was made".to_owned(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct Flaky {
        fail_first: u32,
        calls: Mutex<u32>,
    }

    impl RegistryCleaner for Flaky {
        fn delete_prefix<'a>(
            &'a self,
            a: &'a EtcdAccess,
            p: &'a str,
        ) -> BoxFuture<'a, Result<u64>> {
            let e = &a.endpoints;
            Box::pin(async move {
                let mut n = self.calls.lock().expect("lock");
                *n += 1;
                if *n <= self.fail_first {
                    Err(Error::Registry {
                        endpoints: e.to_vec(),
                        prefix: p.into(),
                        message: "down".into(),
                    })
                } else {
                    Ok(7)
                }
            })
        }
    }

    fn access(endpoint: &str) -> EtcdAccess {
        EtcdAccess {
            endpoints: vec![endpoint.into()],
            ..EtcdAccess::default()
        }
    }

    #[test]
    fn access_debug_hides_secrets() {
        let a = EtcdAccess {
            endpoints: vec!["https://e:2379".into()],
            tls: Some(EtcdTls {
                ca: Some(b"-----BEGIN CERTIFICATE-----".to_vec()),
                identity: None,
            }),
            auth: Some(("kvf".into(), "hunter2".into())),
        };
        let shown = format!("{a:?}");
        assert!(shown.contains("kvf") && !shown.contains("hunter2") && !shown.contains("BEGIN"));
    }

    #[tokio::test]
    async fn real_etcd_client_with_tls_and_auth_fails_fast_on_a_closed_port() {
        let c = EtcdCleaner {
            timeout: Duration::from_millis(300),
        };
        let a = EtcdAccess {
            endpoints: vec!["https://127.0.0.1:1".into()],
            tls: Some(EtcdTls::default()),
            auth: Some(("kvf".into(), "pw".into())),
        };
        let e = clean_registry(&c, &policy(), &a, "/kvfabric/tf/")
            .await
            .expect_err("fails");
        assert!(matches!(e, Error::Registry { .. }), "{e}");
    }

    fn policy() -> CleanupPolicy {
        CleanupPolicy {
            attempts: 3,
            timeout: Duration::from_millis(100),
            backoff: Duration::ZERO,
        }
    }

    #[tokio::test]
    async fn retries_until_success() {
        let c = Flaky {
            fail_first: 2,
            ..Flaky::default()
        };
        let n = clean_registry(&c, &policy(), &access("http://e:2379"), "/k/tf/")
            .await
            .expect("ok");
        assert_eq!(n, 7);
        assert_eq!(*c.calls.lock().expect("lock"), 3);
    }

    #[tokio::test]
    async fn gives_up_after_the_bound() {
        let c = Flaky {
            fail_first: 99,
            ..Flaky::default()
        };
        let e = clean_registry(&c, &policy(), &access("http://e:2379"), "/k/tf/")
            .await
            .expect_err("fails");
        assert_eq!(*c.calls.lock().expect("lock"), 3);
        assert!(e.to_string().contains("http://e:2379"), "{e}");
    }

    #[tokio::test]
    async fn deleting_a_fabric_spares_its_namesake_in_another_namespace() {
        use crate::contract::registry_root;
        use kvfabric_testkit::EtcdServer;
        let Some(etcd) = EtcdServer::or_skip(EtcdServer::start().await) else {
            return;
        };
        let mut client = etcd.client().await.expect("client");
        // Keys as the agents write them: `<prefix>/<namespace>/<fabric>/…`.
        for ns in ["team-a", "team-b"] {
            for fabric in ["llama", "llama2"] {
                let root = registry_root("/kvfabric", ns, fabric);
                client
                    .put(format!("{root}/agents/node-1"), "{}", None)
                    .await
                    .expect("put");
                client
                    .put(format!("{root}/segments/w0"), "{}", None)
                    .await
                    .expect("put");
            }
        }
        let cleaner = EtcdCleaner {
            timeout: Duration::from_secs(2),
        };
        let n = clean_registry(
            &cleaner,
            &policy(),
            &access(&etcd.endpoint()),
            &(registry_root("/kvfabric", "team-a", "llama") + "/"),
        )
        .await
        .expect("cleans");
        assert_eq!(n, 2, "exactly team-a/llama's keys");
        let keys = etcd.keys("/kvfabric/").await.expect("get");
        assert_eq!(
            keys,
            vec![
                "/kvfabric/team-a/llama2/agents/node-1",
                "/kvfabric/team-a/llama2/segments/w0",
                "/kvfabric/team-b/llama/agents/node-1",
                "/kvfabric/team-b/llama/segments/w0",
                "/kvfabric/team-b/llama2/agents/node-1",
                "/kvfabric/team-b/llama2/segments/w0",
            ]
        );
    }

    /// A three-member cluster with its leader down: each cleanup's fresh client spreads its
    /// requests over all three endpoints, and one sent to the dead member fails at once. Every
    /// cleanup must still succeed on its first (and here only) attempt.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_with_its_leader_down_is_cleaned_on_the_first_attempt() {
        use kvfabric_testkit::EtcdCluster;
        let Some(mut cluster) = EtcdCluster::or_skip(EtcdCluster::start_on_loopback(3).await)
        else {
            return;
        };
        let leader = cluster.leader().await.expect("leader");
        cluster.kill(&leader).await.expect("kill");
        cluster.leader().await.expect("a new leader");
        let access = EtcdAccess {
            endpoints: cluster.endpoints(),
            ..EtcdAccess::default()
        };
        let once = CleanupPolicy {
            attempts: 1,
            timeout: Duration::from_secs(5),
            backoff: Duration::ZERO,
        };
        let cleaner = EtcdCleaner {
            timeout: Duration::from_secs(2),
        };
        let mut client = cluster.client().await.expect("client");
        for round in 0..12 {
            for key in ["agents/a", "segments/s"] {
                client
                    .put(format!("/kvfabric/ns/tf/{key}"), "{}", None)
                    .await
                    .expect("put");
            }
            let n = clean_registry(&cleaner, &once, &access, "/kvfabric/ns/tf/")
                .await
                .unwrap_or_else(|e| panic!("round {round}, {leader} down: {e}"));
            assert_eq!(n, 2, "round {round}");
        }
        assert!(cluster.keys("/kvfabric/").await.expect("keys").is_empty());
    }

    #[tokio::test]
    async fn real_etcd_client_fails_fast_on_a_closed_port() {
        // Nothing listens on port 1 of loopback: the real client must error, not hang.
        let c = EtcdCleaner {
            timeout: Duration::from_millis(300),
        };
        let p = CleanupPolicy {
            attempts: 2,
            timeout: Duration::from_secs(2),
            backoff: Duration::ZERO,
        };
        let started = std::time::Instant::now();
        let e = clean_registry(&c, &p, &access("http://127.0.0.1:1"), "/kvfabric/tf/")
            .await
            .expect_err("fails");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(e, Error::Registry { .. }), "{e}");
    }
}
