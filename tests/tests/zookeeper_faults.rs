//! ZooKeeper under faults: connections cut or black-holed by a proxy, a
//! create whose reply is lost, a server SIGKILLed and restarted, containers
//! reaped. The proxied tests use the shared server of `scripts/servers.sh`
//! (tickTime 2 s); the kill/restart and reaping tests start a private one.
#![cfg(feature = "zookeeper")]

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, Registry, ZooKeeperBackend};
use dlock_testkit::Fault;
use dlock_tests::zk_support::{PrivateZk, ZkProxy, admin, children, port, url};
use dlock_tests::{servers_missing, unique_key};

async fn connect(url: &str) -> ZooKeeperBackend {
    ZooKeeperBackend::connect(url)
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

fn registry(backend: &ZooKeeperBackend) -> Registry {
    Registry::builder().default_backend(backend.clone()).build()
}

/// A backend whose every byte goes through `proxy`.
async fn through(proxy: &ZkProxy, query: &str) -> ZooKeeperBackend {
    connect(&format!(
        "zk://127.0.0.1:{}/dlock-test{query}",
        proxy.port()
    ))
    .await
}

/// The one child of a key's container, and its czxid.
async fn only_node(zk: &ZooKeeperBackend, key: &str) -> (String, u64) {
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    let kids = children(&admin, &container).await;
    assert_eq!(kids.len(), 1, "{kids:?}");
    let path = format!("{container}/{}", kids[0]);
    let (_, stat) = admin.get_data(&path).await.expect("the node");
    (path, stat.czxid as u64)
}

async fn exists(path: &str) -> bool {
    admin(&url())
        .await
        .check_stat(path)
        .await
        .expect("read")
        .is_some()
}

/// Connections reset, then a black hole shorter than the loss deadline:
/// the lock, its node and its token survive, and renewals go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_cut_keeps_the_lock_and_its_token() {
    let proxy = ZkProxy::start(port(&url())).await;
    let zk = through(&proxy, "?session_timeout=3s").await;
    let locks = registry(&zk);
    let key = unique_key("short-cut");
    let guard = locks
        .lock(&key)
        .lease(Duration::from_secs(2))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token().expect("token");
    let (node, czxid) = only_node(&zk, &key).await;

    proxy.reset_all();
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set(Fault::Hold);
    tokio::time::sleep(Duration::from_millis(800)).await;
    proxy.set(Fault::Pass);
    // Past two more renewal periods.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    assert!(!guard.is_lost(), "a short cut must not lose the lock");
    assert_eq!(only_node(&zk, &key).await, (node.clone(), czxid));
    assert_eq!(guard.fencing_token(), Some(token));
    let other = registry(&connect(&url()).await);
    assert!(matches!(
        other.lock(&key).acquire().await,
        Err(LockError::Busy { .. })
    ));
    guard.release().await.expect("release");
    assert!(!exists(&node).await);
    assert_eq!(zk.stats().sessions, 1, "the same session throughout");
}

/// A black hole longer than the loss deadline: the holder hears of the loss
/// while the server still has its node (the signal comes first), and the
/// node goes only later, when the server expires the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_hole_signals_loss_before_the_session_expires() {
    let proxy = ZkProxy::start(port(&url())).await;
    let timeout = Duration::from_secs(3);
    let zk = through(&proxy, "?session_timeout=3s").await;
    let locks = registry(&zk);
    let key = unique_key("black-hole");
    // A lease far longer than the session: only the session can lose it.
    let guard = locks
        .lock(&key)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token().expect("token");
    let (node, _) = only_node(&zk, &key).await;

    let cut = Instant::now();
    proxy.set(Fault::Hold);
    tokio::time::timeout(timeout, guard.lost())
        .await
        .expect("the loss is signalled within the session timeout");
    let signalled = cut.elapsed();
    assert!(
        exists(&node).await,
        "the signal must come while the node still exists (after {signalled:?})"
    );
    assert!(
        signalled >= Duration::from_millis(900),
        "with loss=session a cut is not lost at once: {signalled:?}"
    );
    // The server expires the session: at least a session timeout after it
    // last heard from us, rounded up to its 2 s tick.
    let deadline = Instant::now() + Duration::from_secs(10);
    while exists(&node).await {
        assert!(Instant::now() < deadline, "the node outlived its session");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let gone = cut.elapsed();
    assert!(gone > signalled, "loss {signalled:?}, node gone {gone:?}");
    eprintln!("loss signalled {signalled:?} after the cut, node gone after {gone:?}");

    proxy.set(Fault::Pass);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    // The backend opens a new session once the old one is known expired.
    let next = dlock_tests::acquire_eventually(&locks, &key).await;
    assert!(next.fencing_token().expect("token") > token);
    next.release().await.expect("release");
    assert_eq!(zk.stats().sessions, 2);
}

/// `loss=disconnect` (Curator's default): the first disconnection loses
/// every lease at once, and their nodes are deleted once the same session
/// is back, so the key is free for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loss_disconnect_loses_at_the_first_disconnection() {
    let proxy = ZkProxy::start(port(&url())).await;
    let zk = through(&proxy, "?session_timeout=10s&loss=disconnect").await;
    let locks = registry(&zk);
    let key = unique_key("loss-disconnect");
    let guard = locks
        .lock(&key)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .expect("acquire");
    let (node, _) = only_node(&zk, &key).await;
    let cut = Instant::now();
    proxy.reset_all();
    tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .expect("lost at the first disconnection");
    let took = cut.elapsed();
    let deadline = Instant::now() + Duration::from_secs(5);
    while exists(&node).await {
        assert!(
            Instant::now() < deadline,
            "the lost lease's node is deleted once reconnected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(zk.stats().sessions, 1, "the session itself survived");
    let other = registry(&connect(&url()).await);
    other
        .lock(&key)
        .acquire()
        .await
        .expect("free for others")
        .release()
        .await
        .expect("release");
    eprintln!("loss=disconnect signalled {took:?} after the reset");
}

/// A release while the connection is black-holed: the call answers a
/// retryable error within half a session timeout and the delete goes on in
/// the background; once the network heals, the node is deleted by the same
/// session (not by its expiry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_during_a_black_hole_is_retried_until_it_succeeds() {
    let proxy = ZkProxy::start(port(&url())).await;
    let zk = through(&proxy, "?session_timeout=4s").await;
    let locks = registry(&zk);
    let key = unique_key("release-retried");
    let guard = locks
        .lock(&key)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .expect("acquire");
    let (node, _) = only_node(&zk, &key).await;
    let cut = Instant::now();
    proxy.set(Fault::Hold);
    let released = guard.release().await;
    let answered = cut.elapsed();
    match released {
        Err(e @ LockError::Backend { .. }) => assert!(e.is_retryable(), "{e}"),
        other => panic!("a release that could not reach the server: {other:?}"),
    }
    assert!(answered < Duration::from_millis(3500), "{answered:?}");
    assert!(exists(&node).await, "nothing reached the server yet");
    // Heal before the server could expire the session (4 s after it last
    // heard from us).
    tokio::time::sleep_until((cut + Duration::from_millis(2500)).into()).await;
    proxy.set(Fault::Pass);
    let deadline = Instant::now() + Duration::from_secs(3);
    while exists(&node).await {
        assert!(Instant::now() < deadline, "the delete was not retried");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        cut.elapsed() < Duration::from_secs(4),
        "deleted by the session's expiry, not by the release: {:?}",
        cut.elapsed()
    );
    assert_eq!(zk.stats().sessions, 1, "the same session");
    locks
        .lock(&key)
        .acquire()
        .await
        .expect("free again")
        .release()
        .await
        .expect("release");
}

/// The reply of our create is lost (the proxy forwards the create, drops
/// what the server answers and cuts the connection): the node is found again
/// by its GUID on the same session and used — exactly one node, and it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_create_reply_leaves_exactly_one_node_that_holds() {
    let proxy = ZkProxy::start(port(&url())).await;
    let zk = through(&proxy, "?session_timeout=5s").await;
    let locks = registry(&zk);
    let key = unique_key("lost-reply-held");
    // The key's container first, so that the cut create is the lock node's.
    let warm = locks.lock(&key).acquire().await.expect("acquire");
    warm.release().await.expect("release");
    let before = zk.stats();
    proxy.cut_after_next_create();
    let guard = locks
        .lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("acquired despite the lost reply");
    assert_eq!(proxy.creates_cut(), 1);
    let after = zk.stats();
    assert_eq!(
        after.creates_recovered - before.creates_recovered,
        1,
        "{after:?}"
    );
    assert_eq!(
        after.nodes_created, before.nodes_created,
        "no second create: {after:?}"
    );
    let (node, czxid) = only_node(&zk, &key).await;
    assert_eq!(guard.fencing_token().map(u64::from), Some(czxid));
    guard.release().await.expect("release");
    assert!(!exists(&node).await);
}

/// The same while another holds the key: our recovered node queues behind
/// the holder (two nodes, one of them ours) and is served when it releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_create_reply_leaves_exactly_one_node_that_queues() {
    let proxy = ZkProxy::start(port(&url())).await;
    let zk = through(&proxy, "?session_timeout=5s").await;
    let locks = registry(&zk);
    let other = registry(&connect(&url()).await);
    let key = unique_key("lost-reply-queued");
    let holder = other.lock(&key).acquire().await.expect("acquire");
    let (holder_node, _) = only_node(&zk, &key).await;
    proxy.cut_after_next_create();
    let waiter = tokio::spawn({
        let (locks, key) = (locks.clone(), key.clone());
        async move {
            locks
                .lock(&key)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while zk.stats().watches_set == 0 {
        assert!(Instant::now() < deadline, "{:?}", zk.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(proxy.creates_cut(), 1);
    assert_eq!(zk.stats().creates_recovered, 1, "{:?}", zk.stats());
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    let kids = children(&admin, &container).await;
    assert_eq!(kids.len(), 2, "the holder's and ours: {kids:?}");
    let holder_token = holder.fencing_token().expect("token");
    holder.release().await.expect("release");
    assert!(!exists(&holder_node).await);
    let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("served")
        .expect("task")
        .expect("acquired");
    let (_, czxid) = only_node(&zk, &key).await;
    let token = guard.fencing_token().expect("token");
    // Taken at the grant, after the holder's node was deleted.
    assert!(
        token > holder_token && u64::from(token) > czxid,
        "{token:?}"
    );
    let info = locks.inspect(&key).await.expect("inspect").expect("held");
    assert_eq!(info.holders()[0].token(), Some(token), "{info:?}");
    guard.release().await.expect("release");
}

/// ZooKeeper SIGKILLed and restarted within the session timeout: sessions
/// are in its transaction log, so the session and the lock survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restarted_within_the_session_timeout_keeps_the_lock() {
    let mut server = PrivateZk::start(&[]).await;
    let zk = connect(&server.url("/locks?session_timeout=15s")).await;
    let locks = registry(&zk);
    // Renewed every 5 s: the outage spans a renewal, which is retried.
    let guard = locks
        .lock("job")
        .lease(Duration::from_secs(15))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token();
    let killed = Instant::now();
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart().await;
    let back = killed.elapsed();
    // Past a renewal on the restarted server.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !guard.is_lost(),
        "the server was back after {back:?}, within the session timeout"
    );
    assert_eq!(guard.fencing_token(), token);
    let other = registry(&connect(&server.url("/locks")).await);
    assert!(matches!(
        other.lock("job").acquire().await,
        Err(LockError::Busy { .. })
    ));
    guard.release().await.expect("release");
    other
        .lock("job")
        .acquire()
        .await
        .expect("free after the release")
        .release()
        .await
        .expect("release");
    assert_eq!(zk.stats().sessions, 1);
}

/// ZooKeeper SIGKILLed for longer than the session timeout: the loss is
/// signalled while the server is down (before the session can expire), and
/// after the restart the key is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_down_past_the_session_timeout_signals_loss() {
    let mut server = PrivateZk::start(&[]).await;
    let zk = connect(&server.url("/locks?session_timeout=2s")).await;
    let locks = registry(&zk);
    let guard = locks
        .lock("job")
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token().expect("token");
    let killed = Instant::now();
    server.kill();
    tokio::time::timeout(Duration::from_secs(2), guard.lost())
        .await
        .expect("lost before the session timeout");
    let signalled = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.restart().await;
    let next = dlock_tests::acquire_eventually(&locks, "job").await;
    assert!(next.fencing_token().expect("token") > token);
    next.release().await.expect("release");
    eprintln!("loss signalled {signalled:?} after the kill");
}

/// Containers of released keys are reaped by the server (here every 100 ms):
/// N keys locked and released leave nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_containers_are_reaped() {
    let server = PrivateZk::start(&["znode.container.checkIntervalMs=100"]).await;
    let zk = connect(&server.url("/reaped")).await;
    let locks = registry(&zk);
    for i in 0..30 {
        let guard = locks
            .lock(format!("order:{i}"))
            .acquire()
            .await
            .expect("acquire");
        guard.release().await.expect("release");
    }
    let admin = dlock_tests::zk_support::admin(&server.url("")).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = children(&admin, "/reaped").await;
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "containers left: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A reaped key locks again (its container is created anew).
    let guard = locks.lock("order:0").acquire().await.expect("acquire");
    guard.release().await.expect("release");
}

/// Semaphore and read-lock keys leave nothing behind either: 10,000 names,
/// each taken as a permit or a read lock and given back, are all reaped
/// (the key's node and its `leases` child).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_and_read_lock_keys_are_reaped() {
    let server = PrivateZk::start(&[
        "znode.container.checkIntervalMs=100",
        "znode.container.maxPerMinute=10000000",
    ])
    .await;
    let zk = connect(&server.url("/reaped-shared")).await;
    let locks = registry(&zk);
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let locks = locks.clone();
        tasks.push(tokio::spawn(async move {
            for i in (worker..10_000).step_by(8) {
                let builder = locks.lock(format!("name:{i}"));
                let builder = if i % 2 == 0 {
                    builder.permits(3)
                } else {
                    builder.read()
                };
                let guard = builder.acquire().await.expect("acquire");
                guard.release().await.expect("release");
            }
        }));
    }
    for task in tasks {
        task.await.expect("worker");
    }
    let admin = dlock_tests::zk_support::admin(&server.url("")).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = children(&admin, "/reaped-shared").await;
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} containers left, e.g. {:?}",
            left.len(),
            &left[..left.len().min(5)]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
