//! ZooKeeper at the end of a key's sequence counter, where every later child
//! of one acquisition's GUID would get the same name
//! (`_c_{guid}-lock-2147483647`): a node of the acquisition's next attempt
//! must be neither taken for, nor deleted as, an earlier node of that name.
//! The server is a test's own (`tests/java/CounterEndZooKeeper.java`),
//! reached through a proxy that drops the replies of deletes.
#![cfg(feature = "zookeeper")]

use std::path::Path;
use std::time::{Duration, Instant};

use dlock_runtime::ZooKeeperBackend;
use dlock_runtime::backend::{AcquireRequest, Attempt, LockBackend};
use dlock_tests::zk_support::{CounterEndZk, ZkProxy, java_programs};
use zookeeper_client::Client;

async fn admin(port: u16) -> Client {
    Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(&format!("127.0.0.1:{port}"))
        .await
        .expect("admin session")
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The wait loop, given a grant too late to use, releases it and tries
/// again with the same request. When the release's delete never gets an
/// answer within half a session timeout, it goes on in the background, by
/// path, and retries after each lost answer. At the counter's end the next
/// attempt must not create its node on the released node's path (nor adopt
/// the released node): that background delete would remove it while its
/// lease is held, and the key would go to someone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_delete_spares_the_next_node_of_the_same_acquisition() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let mut server = CounterEndZk::start(&programs).await;
    let proxy = ZkProxy::start(server.port).await;
    let zk = ZooKeeperBackend::connect(&format!(
        "zk://127.0.0.1:{}/dlock-reuse?session_timeout=4s",
        proxy.port
    ))
    .await
    .expect("connect");
    let key = "dlock:same-name";
    let container = zk.container_path(key);
    server.set_counter(&container, i32::MAX).await;
    let request = AcquireRequest::new(
        key,
        "0123456789abcdef0123456789abcdef",
        Duration::from_secs(60),
    );
    let first = match zk.try_acquire(&request).await.expect("first attempt") {
        Attempt::Held(lease) => lease,
        other => panic!("the key is free: {other:?}"),
    };
    let admin = admin(server.port).await;
    let kids = admin.list_children(&container).await.expect("children");
    assert_eq!(kids.len(), 1, "{kids:?}");
    assert!(kids[0].ends_with("-lock-2147483647"), "{kids:?}");

    // Every answer to a delete is lost: the release gives up after half a
    // session timeout, and the delete goes on in the background.
    proxy.cut_deletes(true);
    let released = zk.release(&first).await;
    assert!(released.is_err(), "a delete was answered: {released:?}");
    // Once the background delete's back-off has grown (its seventh lost
    // answer: it sleeps 640 ms), deletes are answered again and the same
    // request is tried again.
    let background = proxy.deletes_cut();
    wait_for("the background delete did not retry", || {
        proxy.deletes_cut() >= background + 7
    })
    .await;
    proxy.cut_deletes(false);
    // The cut connection closes 200 ms after the delete.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let second = loop {
        match zk.try_acquire(&request).await.expect("next attempt") {
            Attempt::Held(lease) => break lease,
            Attempt::Unavailable { .. } => {}
            other => panic!("the key is free: {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "no grant once deletes are answered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };

    // Past the background delete's next try: the granted node is still
    // there, and nobody else can take the key.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let kids = admin.list_children(&container).await.expect("children");
    assert_eq!(kids.len(), 1, "the granted node was deleted: {kids:?}");
    let other = ZooKeeperBackend::connect(&server.url("/dlock-reuse"))
        .await
        .expect("connect");
    let intruder = AcquireRequest::new(
        key,
        "fedcba9876543210fedcba9876543210",
        Duration::from_secs(60),
    );
    let attempt = other.try_acquire(&intruder).await.expect("attempt");
    assert!(
        matches!(attempt, Attempt::Busy { .. }),
        "two holders at once: {attempt:?}"
    );
    zk.release(&second).await.expect("release");
}
