//! The registry against its two backends: memory, and a real etcd (Debian's `etcd-server`)
//! that the tests start, stop, restart and kill.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_agent::Error;
use kvfabric_agent::discovery::Devices;
use kvfabric_agent::registry::{
    AgentEntry, EtcdConfig, EtcdRegistry, EtcdTls, Event, MemoryStore, Registry, SegmentEntry,
    SegmentRegion,
};
use kvfabric_engine::{Location, RegionId};
use kvfabric_testkit::{EtcdCluster, EtcdServer};
use tokio::sync::broadcast;

/// Short leases keep the fault tests fast.
const TTL: Duration = Duration::from_secs(2);
/// Generous bound for anything that should happen "soon".
const WAIT: Duration = Duration::from_secs(20);

fn agent(name: &str) -> AgentEntry {
    AgentEntry {
        name: name.into(),
        pool: "prefill".into(),
        role: None,
        node: format!("boot-{name}"),
        peer_addr: SocketAddr::from(([127, 0, 0, 1], 50051)),
        devices: Devices::default(),
        started_at: 1_700_000_000,
        instance: 0,
    }
}

fn segment(name: &str, agent: &str) -> SegmentEntry {
    SegmentEntry {
        name: name.into(),
        agent: agent.into(),
        regions: vec![SegmentRegion {
            id: RegionId(7),
            len: 4096,
            location: Location::Host { numa: Some(0) },
        }],
    }
}

/// A fresh etcd, or `None` (a counted skip; a failure in CI) where the binary is missing.
async fn etcd() -> Option<EtcdServer> {
    EtcdServer::or_skip(EtcdServer::start().await)
}

fn config(etcd: &EtcdServer, fabric: &str) -> EtcdConfig {
    let mut cfg = EtcdConfig::new([etcd.endpoint()], fabric);
    cfg.lease_ttl = TTL;
    cfg.connect_timeout = Duration::from_secs(3);
    cfg
}

/// Polls `done` until it holds; panics after `within`. Returns how long it took.
async fn eventually(what: &str, within: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

/// The next event that is not `Resynced`, within `WAIT`.
async fn next_change(events: &mut broadcast::Receiver<Event>) -> Event {
    loop {
        match tokio::time::timeout(WAIT, events.recv()).await {
            Ok(Ok(Event::Resynced)) => continue,
            Ok(Ok(event)) => return event,
            other => panic!("no registry event: {other:?}"),
        }
    }
}

// ---- memory -----------------------------------------------------------------------------

#[tokio::test]
async fn memory_put_get_delete_and_events() {
    let registry = MemoryStore::new().registry();
    let mut events = registry.subscribe();
    registry.register_agent(agent("a")).await.unwrap();
    registry.put_segment(segment("s1", "a")).await.unwrap();
    assert_eq!(registry.agent("a"), Some(agent("a")));
    assert_eq!(registry.segment("s1"), Some(segment("s1", "a")));
    assert_eq!(registry.segments().len(), 1);
    assert_eq!(next_change(&mut events).await, Event::AgentPut(agent("a")));
    assert_eq!(
        next_change(&mut events).await,
        Event::SegmentPut(segment("s1", "a"))
    );

    registry.delete_segment("s1").await.unwrap();
    assert_eq!(registry.segment("s1"), None);
    assert_eq!(
        next_change(&mut events).await,
        Event::SegmentDeleted("s1".into())
    );
    assert!(matches!(
        registry.delete_segment("s1").await,
        Err(Error::UnknownSegment { name }) if name == "s1"
    ));
    assert!(matches!(
        registry.put_segment(segment("", "a")).await,
        Err(Error::Config {
            field: "segment.name",
            ..
        })
    ));
    let state = registry.state();
    assert_eq!(
        (state.backend.as_str(), state.agents, state.segments),
        ("memory", 1, 0)
    );
}

#[tokio::test]
async fn memory_handles_share_a_store_and_shutdown_deletes_only_their_own() {
    let store = MemoryStore::new();
    let (a, b) = (store.registry(), store.registry());
    let mut b_events = b.subscribe();
    a.register_agent(agent("a")).await.unwrap();
    a.put_segment(segment("sa", "a")).await.unwrap();
    b.register_agent(agent("b")).await.unwrap();
    b.put_segment(segment("sb", "b")).await.unwrap();
    // Each handle sees the other's entries and events.
    assert_eq!(b.segment("sa"), Some(segment("sa", "a")));
    assert_eq!(a.agents().len(), 2);
    assert_eq!(
        next_change(&mut b_events).await,
        Event::AgentPut(agent("a"))
    );
    // b cannot delete what a put.
    assert!(matches!(
        b.delete_segment("sa").await,
        Err(Error::UnknownSegment { .. })
    ));

    a.shutdown().await.unwrap();
    a.shutdown().await.unwrap(); // idempotent
    assert_eq!(b.segment("sa"), None);
    assert_eq!(b.agent("a"), None);
    assert_eq!(b.segment("sb"), Some(segment("sb", "b")));
    assert_eq!(b.agent("b"), Some(agent("b")));
    assert!(a.put_segment(segment("late", "a")).await.is_err());

    // A name another handle took over stays with it.
    b.put_segment(segment("shared", "b")).await.unwrap();
    let c = store.registry();
    c.put_segment(segment("shared", "c")).await.unwrap();
    b.shutdown().await.unwrap();
    assert_eq!(c.segment("shared"), Some(segment("shared", "c")));
}

// ---- etcd -------------------------------------------------------------------------------

#[tokio::test]
async fn etcd_entries_reach_other_watch_caches_and_shutdown_removes_them() {
    let Some(etcd) = etcd().await else { return };
    let a = EtcdRegistry::connect(config(&etcd, "f1")).await.unwrap();
    let b = EtcdRegistry::connect(config(&etcd, "f1")).await.unwrap();
    let other_fabric = EtcdRegistry::connect(config(&etcd, "f2")).await.unwrap();
    let mut b_events = b.subscribe();

    a.register_agent(agent("a")).await.unwrap();
    a.put_segment(segment("s1", "a")).await.unwrap();
    a.put_segment(segment("s2", "a")).await.unwrap();
    // Read-your-writes in a's own cache.
    assert_eq!(a.segment("s1"), Some(segment("s1", "a")));
    assert_eq!(a.agent("a"), Some(agent("a")));

    let took = eventually("b sees a's entries", WAIT, || {
        b.agent("a").is_some() && b.segments().len() == 2
    })
    .await;
    eprintln!("visible to a second watch cache after {took:?}");
    assert_eq!(
        next_change(&mut b_events).await,
        Event::AgentPut(agent("a"))
    );
    assert_eq!(
        next_change(&mut b_events).await,
        Event::SegmentPut(segment("s1", "a"))
    );
    assert_eq!(
        next_change(&mut b_events).await,
        Event::SegmentPut(segment("s2", "a"))
    );
    assert!(other_fabric.segments().is_empty(), "fabrics are separate");

    // A replaced entry is replaced everywhere.
    let mut bigger = segment("s1", "a");
    bigger.regions[0].len = 8192;
    a.put_segment(bigger.clone()).await.unwrap();
    eventually("b sees the new s1", WAIT, || {
        b.segment("s1") == Some(bigger.clone())
    })
    .await;

    a.delete_segment("s2").await.unwrap();
    assert_eq!(a.segment("s2"), None);
    eventually("b sees s2 deleted", WAIT, || b.segment("s2").is_none()).await;
    assert!(matches!(
        a.delete_segment("s2").await,
        Err(Error::UnknownSegment { .. })
    ));

    // A registry only deletes what it put.
    assert!(matches!(
        b.delete_segment("s1").await,
        Err(Error::UnknownSegment { .. })
    ));

    let state = a.state();
    assert!(state.connected && state.lease_id != 0, "{state:?}");
    assert_eq!(state.lease_ttl_secs, 2);
    assert_eq!((state.agents, state.segments), (1, 1));

    a.shutdown().await.unwrap();
    a.shutdown().await.unwrap(); // idempotent
    eventually("b sees a's keys gone after shutdown", WAIT, || {
        b.agent("a").is_none() && b.segments().is_empty()
    })
    .await;
    assert_eq!(a.state().lease_id, 0);
    assert!(a.put_segment(segment("late", "a")).await.is_err());
    b.shutdown().await.unwrap();
}

#[tokio::test]
async fn etcd_outage_keeps_lookups_answering_and_reregisters_after_restart() {
    let Some(mut etcd) = etcd().await else { return };
    let a = EtcdRegistry::connect(config(&etcd, "f")).await.unwrap();
    let b = EtcdRegistry::connect(config(&etcd, "f")).await.unwrap();
    a.register_agent(agent("a")).await.unwrap();
    a.put_segment(segment("s1", "a")).await.unwrap();
    eventually("b sees s1", WAIT, || b.segment("s1").is_some()).await;
    let lease_before = a.state().lease_id;

    etcd.stop().await.unwrap();
    // Cached lookups keep answering while etcd is down.
    assert_eq!(a.segment("s1"), Some(segment("s1", "a")));
    assert_eq!(b.segment("s1"), Some(segment("s1", "a")));
    eventually("a notices etcd is down", WAIT, || !a.state().connected).await;
    eventually("b notices etcd is down", WAIT, || !b.state().connected).await;
    assert!(a.state().last_error.is_some());

    // A write while down is a typed error, and the entry is remembered.
    let err = a.put_segment(segment("s2", "a")).await.unwrap_err();
    assert!(matches!(err, Error::RegistryUnavailable { .. }), "{err}");

    // Longer than the TTL: the lease must be considered lost.
    tokio::time::sleep(TTL * 2 + Duration::from_millis(500)).await;
    assert_eq!(
        b.segment("s1"),
        Some(segment("s1", "a")),
        "cache kept while down"
    );

    etcd.start_again().await.unwrap();
    let back = Instant::now();
    let took = eventually("a re-registers", WAIT, || a.state().reregistrations >= 1).await;
    eprintln!("re-registered {took:?} after etcd was back (TTL {TTL:?})");
    eventually(
        "b sees a's entries, including the one put while down",
        WAIT,
        || b.agent("a").is_some() && b.segment("s1").is_some() && b.segment("s2").is_some(),
    )
    .await;
    eprintln!(
        "second watcher complete {:?} after etcd was back",
        back.elapsed()
    );
    let state = a.state();
    assert!(state.connected, "{state:?}");
    assert_ne!(state.lease_id, lease_before, "a new lease");
    // etcd came back with its data: b's watch resumed where it was, without reading
    // everything again (only compaction makes that necessary).
    let state = b.state();
    assert!(
        state.watch_resumes >= 1 && state.resyncs == 0,
        "b's watch resumed without a relist: {state:?}"
    );

    // Every key of a is bound to the new lease.
    let mut client = etcd.client().await.unwrap();
    let resp = client
        .get(
            "/kvfabric/default/f/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert_eq!(resp.kvs().len(), 3);
    for kv in resp.kvs() {
        assert_eq!(kv.lease(), a.state().lease_id, "{:?}", kv.key_str());
    }
    a.shutdown().await.unwrap();
    eventually("b sees a gone", WAIT, || b.segments().is_empty()).await;
}

#[tokio::test]
async fn etcd_write_during_a_short_outage_is_published_when_etcd_is_back() {
    let Some(mut etcd) = etcd().await else { return };
    // A lease that outlives the outage: no re-registration, the same lease goes on.
    let mut cfg = config(&etcd, "f");
    cfg.lease_ttl = Duration::from_secs(30);
    let a = EtcdRegistry::connect(cfg.clone()).await.unwrap();
    let b = EtcdRegistry::connect(cfg).await.unwrap();
    a.register_agent(agent("a")).await.unwrap();
    let lease = a.state().lease_id;

    etcd.stop().await.unwrap();
    let err = a.put_segment(segment("s1", "a")).await.unwrap_err();
    assert!(matches!(err, Error::RegistryUnavailable { .. }), "{err}");
    etcd.start_again().await.unwrap();

    let took = eventually("b sees the segment put while etcd was down", WAIT, || {
        b.segment("s1").is_some()
    })
    .await;
    eprintln!("remembered write published {took:?} after etcd was back");
    let state = a.state();
    assert_eq!(
        (state.lease_id, state.reregistrations),
        (lease, 0),
        "{state:?}"
    );
    a.shutdown().await.unwrap();
    eventually("b sees a gone", WAIT, || b.segment("s1").is_none()).await;
}

/// etcd loses its data (stopped, data directory wiped, started again): it counts revisions from
/// 1 again, so a watch resumed from where it was would wait for that revision and skip what
/// comes before. The watcher sees etcd behind its cache and reads everything again, once; a
/// segment put afterwards reaches it.
#[tokio::test]
async fn etcd_wiped_makes_the_watch_read_everything_again() {
    let Some(mut etcd) = etcd().await else { return };
    let a = EtcdRegistry::connect(config(&etcd, "f")).await.unwrap();
    let b = EtcdRegistry::connect(config(&etcd, "f")).await.unwrap();
    a.register_agent(agent("a")).await.unwrap();
    // Enough writes that the watch's revision is well past a fresh store's.
    for i in 0..10 {
        a.put_segment(segment(&format!("old{i}"), "a"))
            .await
            .unwrap();
    }
    eventually("b sees a's segments", WAIT, || b.segments().len() == 10).await;
    etcd.stop().await.unwrap();
    std::fs::remove_dir_all(etcd.data_dir()).unwrap();
    etcd.start_again().await.unwrap();
    eventually("a re-registers in the wiped etcd", WAIT, || {
        a.state().reregistrations >= 1
    })
    .await;
    a.put_segment(segment("new", "a")).await.unwrap();
    eventually("b sees the segment put after the wipe", WAIT, || {
        b.segment("new").is_some() && b.segments().len() == 11
    })
    .await;
    let state = b.state();
    assert_eq!(state.resyncs, 1, "{state:?}");
    a.shutdown().await.unwrap();
    eventually("b sees a gone", WAIT, || b.segments().is_empty()).await;
}

#[tokio::test]
async fn etcd_dead_agent_disappears_from_other_caches_after_its_ttl() {
    let Some(etcd) = etcd().await else { return };
    let a = EtcdRegistry::connect(config(&etcd, "f")).await.unwrap();
    let b = EtcdRegistry::connect(config(&etcd, "f")).await.unwrap();
    a.register_agent(agent("a")).await.unwrap();
    a.put_segment(segment("s1", "a")).await.unwrap();
    eventually("b sees a", WAIT, || b.segment("s1").is_some()).await;
    let mut events = b.subscribe();

    // The agent dies: no shutdown, its keepalive stops with it.
    drop(a);
    let died = Instant::now();
    // Still there right after (the lease outlives the last keepalive by up to a TTL).
    assert!(b.segment("s1").is_some());
    let took = eventually("b sees a's entries expire", WAIT, || {
        b.segment("s1").is_none() && b.agent("a").is_none()
    })
    .await;
    eprintln!("dead agent gone from the other cache {took:?} after it died (TTL {TTL:?})");
    assert!(
        died.elapsed() >= Duration::from_millis(500),
        "not before the lease ran out"
    );
    let mut deleted = Vec::new();
    for _ in 0..2 {
        deleted.push(next_change(&mut events).await);
    }
    assert!(
        deleted.contains(&Event::SegmentDeleted("s1".into())),
        "{deleted:?}"
    );
    assert!(
        deleted.contains(&Event::AgentDeleted("a".into())),
        "{deleted:?}"
    );
}

/// Every member of a three-member cluster restarted in turn, a write right after each: the
/// writes succeed at once (the first request on a connection to a restarted member fails with
/// the connect error the client met while it was down; the registry tries another), and the
/// other registry's watch follows every change by resuming, never reading everything again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cluster_members_restarted_in_turn_keep_writes_working_and_watches_resuming() {
    let Some(mut cluster) = EtcdCluster::or_skip(EtcdCluster::start_on_loopback(3).await) else {
        return;
    };
    let mut cfg = EtcdConfig::new(cluster.endpoints(), "f");
    cfg.lease_ttl = Duration::from_secs(10);
    cfg.connect_timeout = Duration::from_secs(3);
    let a = EtcdRegistry::connect(cfg.clone()).await.unwrap();
    let b = EtcdRegistry::connect(cfg).await.unwrap();
    a.register_agent(agent("a")).await.unwrap();
    for (i, member) in cluster.names().iter().enumerate() {
        cluster.kill(member).await.unwrap();
        cluster.start_again(member).await.unwrap();
        cluster.leader().await.unwrap();
        let name = format!("s{i}");
        a.put_segment(segment(&name, "a"))
            .await
            .unwrap_or_else(|e| panic!("write after {member} restarted: {e}"));
        eventually(&format!("b sees {name}"), WAIT, || {
            b.segment(&name).is_some()
        })
        .await;
    }
    let state = b.state();
    eprintln!("after a rolling restart: {state:?}");
    assert_eq!(state.resyncs, 0, "{state:?}");
    assert!(state.watch_resumes >= 1, "{state:?}");
    assert_eq!(state.segments, 3, "{state:?}");
    a.shutdown().await.unwrap();
    eventually("b sees a gone", WAIT, || b.segments().is_empty()).await;
}

/// The whole cluster down, requests failing meanwhile, then every member back: the client
/// keeps, per member, the connect error it met while the member was away and fails the first
/// request sent to it with that error ("tcp connect error") though the member is up again. The
/// registry tries another connection: writes right after the restart succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cluster_back_from_a_full_stop_takes_writes_at_once() {
    let Some(mut cluster) = EtcdCluster::or_skip(EtcdCluster::start_on_loopback(3).await) else {
        return;
    };
    let mut cfg = EtcdConfig::new(cluster.endpoints(), "f");
    // Outlives the stops: no re-registration, only the writes under test.
    cfg.lease_ttl = Duration::from_secs(30);
    cfg.connect_timeout = Duration::from_secs(3);
    let a = EtcdRegistry::connect(cfg).await.unwrap();
    a.register_agent(agent("a")).await.unwrap();
    a.put_segment(segment("kept", "a")).await.unwrap();
    let names = cluster.names();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    for round in 0..5 {
        for member in &names {
            cluster.kill(member).await.unwrap();
        }
        // Requests while every member is down fail, and leave their connect errors behind.
        for _ in 0..3 {
            let err = a.delete_segment("kept").await.unwrap_err();
            assert!(matches!(err, Error::RegistryUnavailable { .. }), "{err}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cluster.start_members(&names).await.unwrap();
        cluster.leader().await.unwrap();
        for i in 0..3 {
            let name = format!("s{round}-{i}");
            a.put_segment(segment(&name, "a"))
                .await
                .unwrap_or_else(|e| panic!("{name}, right after the cluster came back: {e}"));
        }
    }
    assert_eq!(
        cluster
            .keys("/kvfabric/default/f/segments/")
            .await
            .unwrap()
            .len(),
        16
    );
}

#[tokio::test]
async fn etcd_unreachable_is_a_typed_error() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = EtcdConfig::new([format!("http://127.0.0.1:{port}")], "f");
    cfg.connect_timeout = Duration::from_secs(1);
    let err = EtcdRegistry::connect(cfg).await.unwrap_err();
    assert!(matches!(err, Error::RegistryUnavailable { .. }), "{err}");
    assert!(err.to_string().contains(&port.to_string()), "{err}");
}

#[tokio::test]
async fn etcd_credentials_are_checked() {
    let Some(etcd) = etcd().await else { return };
    let mut admin = etcd.client().await.unwrap();
    admin.user_add("root", "right", None).await.unwrap();
    let _ = admin.role_add("root").await; // built in on some versions
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    let mut cfg = config(&etcd, "f");
    cfg.auth = Some(("root".into(), "wrong".into()));
    let err = EtcdRegistry::connect(cfg.clone()).await.unwrap_err();
    assert!(
        matches!(&err, Error::RegistryAuth { user, .. } if user == "root"),
        "{err}"
    );

    cfg.auth = Some(("root".into(), "right".into()));
    let a = EtcdRegistry::connect(cfg).await.unwrap();
    a.put_segment(segment("s1", "a")).await.unwrap();
    assert_eq!(a.segment("s1"), Some(segment("s1", "a")));
    a.shutdown().await.unwrap();

    // Without credentials, etcd refuses: a typed error, not a hang.
    let err = EtcdRegistry::connect(config(&etcd, "f")).await.unwrap_err();
    assert!(!matches!(err, Error::RegistryUnavailable { .. }), "{err}");
}

#[tokio::test]
async fn etcd_over_tls_with_a_client_certificate() {
    let Some(etcd) = EtcdServer::or_skip(EtcdServer::start_tls().await) else {
        return;
    };
    assert!(etcd.endpoint().starts_with("https://"));
    let mut cfg = config(&etcd, "f");
    cfg.tls = Some(EtcdTls::from_dir(etcd.client_tls_dir()).unwrap());
    let a = EtcdRegistry::connect(cfg.clone()).await.unwrap();
    a.register_agent(agent("a")).await.unwrap();
    a.put_segment(segment("s1", "a")).await.unwrap();
    assert_eq!(a.segment("s1"), Some(segment("s1", "a")));
    a.shutdown().await.unwrap();

    // The server requires a client certificate: the CA alone is not enough.
    let mut ca_only = cfg.clone();
    ca_only.tls = Some(EtcdTls {
        cert: None,
        key: None,
        ..cfg.tls.clone().unwrap()
    });
    let err = EtcdRegistry::connect(ca_only).await.unwrap_err();
    eprintln!("without a client certificate: {err}");

    // Plain http towards a TLS configuration is refused before connecting.
    let mut plain = cfg;
    plain.endpoints = vec![etcd.endpoint().replace("https://", "http://")];
    let err = EtcdRegistry::connect(plain).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Config {
                field: "etcd.endpoints",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn etcd_server_start_on_an_explicit_ip_and_kill() {
    let Some(mut etcd) =
        EtcdServer::or_skip(EtcdServer::start_on("127.0.0.1".parse().unwrap()).await)
    else {
        return;
    };
    assert!(etcd.endpoint().starts_with("http://127.0.0.1:"));
    assert!(etcd.is_running());
    etcd.kill().await.unwrap();
    assert!(!etcd.is_running());
    etcd.start_again().await.unwrap();
    assert!(etcd.is_running());
}

/// Both backends are usable as the agent's shared registry.
#[allow(dead_code)]
fn shared(etcd: Arc<EtcdRegistry>, memory: Arc<kvfabric_agent::registry::MemoryRegistry>) {
    let _: Vec<Arc<dyn Registry>> = vec![etcd, memory];
}
