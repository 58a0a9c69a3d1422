//! The multi-member etcd of the test kit itself: members start as one cluster, the leader is
//! found through etcd's own status API, a killed leader is replaced and comes back as a
//! follower, and compaction drops the history.

use std::time::Duration;

use kvfabric_testkit::EtcdCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_elect_a_new_leader_when_theirs_is_killed_and_take_it_back() {
    let Some(mut cluster) = EtcdCluster::or_skip(EtcdCluster::start_on_loopback(3).await) else {
        return;
    };
    assert_eq!(cluster.names(), ["m0", "m1", "m2"]);
    assert_eq!(cluster.endpoints().len(), 3);
    let first = cluster.leader().await.unwrap();
    let mut client = cluster.client().await.unwrap();
    client.put("/t/a", "1", None).await.unwrap();

    cluster.kill(&first).await.unwrap();
    assert_eq!(cluster.running().len(), 2);
    let second = cluster.leader().await.unwrap();
    assert_ne!(first, second, "a killed member cannot lead");
    // Two of three are a quorum: writes go on.
    let mut client = cluster.client().await.unwrap();
    client.put("/t/b", "2", None).await.unwrap();

    cluster.start_again(&first).await.unwrap();
    assert_eq!(cluster.running().len(), 3);
    cluster.leader().await.unwrap();
    assert_eq!(cluster.keys("/t/").await.unwrap(), ["/t/a", "/t/b"]);

    // Compaction: a watch from before it is answered "compacted".
    let compacted = cluster.compact().await.unwrap();
    let mut client = cluster.client().await.unwrap();
    let mut stream = client
        .watch(
            "/t/",
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(1),
            ),
        )
        .await
        .unwrap();
    let answer = loop {
        let resp = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("no watch answer")
            .unwrap()
            .expect("watch closed");
        if !resp.created() || resp.compact_revision() != 0 {
            break resp;
        }
    };
    assert_eq!(answer.compact_revision(), compacted);
    assert!(answer.canceled());
}
