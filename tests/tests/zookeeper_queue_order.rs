//! The order of a key's queue on ZooKeeper across its sequence counter's
//! end: waiters queued by sequence number before it and by creation zxid
//! after it are served in arrival order, each woken once; and where every
//! later child of one GUID would get the same name
//! (`_c_{guid}-lock-2147483647`), a node of an acquisition's next attempt is
//! neither taken for, nor deleted as, an earlier node of that name. The
//! server is a test's own (`tests/java/CounterEndZooKeeper.java`), reached
//! directly or through a proxy that drops the replies of deletes.
#![cfg(feature = "zookeeper")]

use std::path::Path;
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use dlock_runtime::backend::{AcquireRequest, Attempt, LockBackend};
use dlock_runtime::{Registry, ZooKeeperBackend};
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
        proxy.port()
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

/// The grants of one queue: `waiters` acquisitions of `key`, one backend
/// each on `url`, arriving one by one (each queued and watching before the
/// next) behind a holder, which then releases. Their arrival indexes and
/// tokens in the order they held, the holder's token first, and the
/// backends (for their stats).
async fn serve_a_queue(
    url: &str,
    key: &'static str,
    admin: &Client,
    waiters: usize,
) -> (Vec<(usize, u64)>, Vec<ZooKeeperBackend>) {
    let holder_backend = ZooKeeperBackend::connect(url).await.expect("connect");
    let container = holder_backend.container_path(&format!("dlock:{key}"));
    let queued_before = admin.list_children(&container).await.map_or(0, |k| k.len());
    let holder = Registry::builder()
        .default_backend(holder_backend.clone())
        .build()
        .lock(key)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .expect("acquire");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let mut backends = Vec::new();
    for i in 0..waiters {
        let backend = ZooKeeperBackend::connect(url).await.expect("connect");
        backends.push(backend.clone());
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let guard = Registry::builder()
                .default_backend(backend)
                .build()
                .lock(key)
                .lease(Duration::from_secs(60))
                .wait(Duration::from_secs(60))
                .acquire()
                .await
                .expect("acquire");
            let token = guard.fencing_token().map(u64::from).expect("a token");
            order.lock().unwrap().push((i, token));
            tokio::time::sleep(Duration::from_millis(30)).await;
            guard.release().await.expect("release");
        }));
        // Arrived: its node is queued and watches its predecessor.
        let queued = queued_before + i + 2;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let kids = admin.list_children(&container).await.expect("children");
            if kids.len() == queued && backends[i].stats().watches_set == 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "waiter {i} did not queue: {kids:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let holder_token = holder.fencing_token().map(u64::from).expect("a token");
    holder.release().await.expect("release");
    for task in tasks {
        task.await.expect("waiter");
    }
    let mut order = order.lock().unwrap().clone();
    order.insert(0, (usize::MAX, holder_token));
    (order, backends)
}

/// A holder on `2147483644`, then waiters arriving one by one: the first
/// two queue on `2147483645` and `2147483646` while every suffix is in
/// order (sequence order), the next four all on `2147483647` (creation
/// order). Released, the key goes to each waiter in arrival order, with
/// increasing tokens, and each waiter is woken exactly once (by its
/// predecessor's deletion: no herd, no early wake-up on the switch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_in_arrival_order_across_the_counters_end() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let mut server = CounterEndZk::start(&programs).await;
    let url = server.url("/dlock-fifo?session_timeout=10s");
    let key = "fifo";
    let container = format!("/dlock-fifo/dlock:{key}");
    server.set_counter(&container, i32::MAX - 3).await;
    let admin = admin(server.port).await;
    let waiters = 6;
    let (order, backends) = serve_a_queue(&url, key, &admin, waiters).await;
    let arrivals: Vec<usize> = order[1..].iter().map(|(i, _)| *i).collect();
    assert_eq!(arrivals, (0..waiters).collect::<Vec<_>>(), "{order:?}");
    assert!(order.windows(2).all(|w| w[0].1 < w[1].1), "{order:?}");
    for (i, backend) in backends.iter().enumerate() {
        let stats = backend.stats();
        assert_eq!(
            (stats.watches_set, stats.watch_events),
            (1, 1),
            "waiter {i}: {stats:?}"
        );
    }
    let (_, sequence) = admin
        .create(
            &format!("{container}/probe-"),
            b"",
            &zookeeper_client::CreateMode::EphemeralSequential
                .with_acls(zookeeper_client::Acls::anyone_all()),
        )
        .await
        .expect("probe");
    assert_eq!(
        sequence.into_i64(),
        i64::from(i32::MAX),
        "the queue did not reach the counter's end"
    );
}

/// Below the counter's end a queue costs what it did before creation order
/// was needed: one create per acquisition and no read of the queue's nodes
/// (no multi-read). Past it, the queue's nodes are read (which this proxy
/// sees).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_the_counters_end_the_queue_is_never_read_node_by_node() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    const CREATE: i32 = 1;
    const CREATE2: i32 = 15;
    const MULTI_READ: i32 = 22;
    let mut server = CounterEndZk::start(&programs).await;
    let proxy = ZkProxy::start(server.port).await;
    let url = format!(
        "zk://127.0.0.1:{}/dlock-cost?session_timeout=10s",
        proxy.port()
    );
    let admin = admin(server.port).await;
    let creates = || proxy.requests(CREATE) + proxy.requests(CREATE2);
    let waiters = 4;

    // The chroot and the key's container exist: only lock nodes are created.
    server.set_counter("/dlock-cost/dlock:below", 0).await;
    let before = (creates(), proxy.requests(MULTI_READ));
    let (order, _) = serve_a_queue(&url, "below", &admin, waiters).await;
    assert_eq!(order.len(), waiters + 1);
    assert_eq!(
        (creates() - before.0, proxy.requests(MULTI_READ) - before.1),
        (waiters as u64 + 1, 0),
        "(creates, multi-reads) of {} acquisitions below the counter's end",
        waiters + 1
    );

    server
        .set_counter("/dlock-cost/dlock:past", i32::MAX - 1)
        .await;
    let before = proxy.requests(MULTI_READ);
    let (order, _) = serve_a_queue(&url, "past", &admin, waiters).await;
    assert_eq!(order.len(), waiters + 1);
    assert!(
        proxy.requests(MULTI_READ) > before,
        "the queue past the counter's end was not read"
    );
}
