//! The conformance suite on ZooKeeper, and what only ZooKeeper has: Curator's
//! layout, czxid tokens, forced session expiry, FIFO wake-ups without a herd,
//! cancellation that leaves no node, URLs and credentials.
#![cfg(feature = "zookeeper")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, Registry, ZooKeeperBackend};
use dlock_testkit::Fault;
use dlock_tests::zk_support::{ZkFaults, ZkProxy, admin, children, hosts, port, url};
use dlock_tests::{Harness, servers_missing, unique_key};
use tokio::sync::OnceCell;
use zookeeper_client::{Acls, Client, CreateMode};

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = ZooKeeperBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend.clone()).build())
                .expect("first init");
            Harness {
                faults: Arc::new(ZkFaults { backend, url }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

/// A backend of its own (another process, as far as ZooKeeper can tell).
async fn backend(query: &str) -> ZooKeeperBackend {
    let url = format!("{}{query}", url());
    ZooKeeperBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

fn registry(backend: &ZooKeeperBackend) -> Registry {
    Registry::builder().default_backend(backend.clone()).build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_layout_and_czxid_tokens() {
    let zk = backend("").await;
    let locks = registry(&zk);
    let key = unique_key("layout");
    let guard = locks.lock(&key).acquire().await.expect("acquire");
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    let (_, stat) = admin.get_data(&container).await.expect("the key's node");
    assert_eq!(stat.ephemeral_owner, 0, "the key's node is not ephemeral");
    let kids = children(&admin, &container).await;
    assert_eq!(kids.len(), 1, "{kids:?}");
    // Curator's protected name: _c_ + a 36-character UUID + -lock- + 10 digits.
    let name = &kids[0];
    assert!(name.starts_with("_c_"), "{name}");
    let uuid = &name[3..39];
    assert!(uuid.split('-').map(str::len).eq([8, 4, 4, 4, 12]), "{name}");
    let suffix = name
        .strip_prefix(&format!("_c_{uuid}-lock-"))
        .unwrap_or_else(|| panic!("{name}"));
    assert!(
        suffix.len() == 10 && suffix.bytes().all(|b| b.is_ascii_digit()),
        "{name}"
    );
    let node = format!("{container}/{name}");
    let (data, stat) = admin.get_data(&node).await.expect("our node");
    assert_ne!(stat.ephemeral_owner, 0, "lock nodes are ephemeral");
    // The owner token, then the holder record on the next line.
    let data = String::from_utf8(data).expect("text");
    let (owner, record) = data.split_once('\n').expect("a holder record");
    assert_eq!(owner.len(), 32, "the node holds the owner token: {data}");
    assert!(
        record.starts_with(&format!("h1 {} ", std::process::id())),
        "the node holds the holder record: {data}"
    );
    assert_eq!(
        guard.fencing_token().map(u64::from),
        Some(stat.czxid as u64),
        "the token is the node's czxid"
    );
    let first = guard.fencing_token().expect("token");
    guard.release().await.expect("release");
    assert!(children(&admin, &container).await.is_empty());
    let again = locks.lock(&key).acquire().await.expect("acquire");
    assert!(again.fencing_token().expect("token") > first);
    again.release().await.expect("release");
}

/// Curator's InterProcessMutex, on the same path, takes turns with dlock:
/// a child `_c_{uuid}-lock-` it created holds the key until deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takes_turns_with_a_curator_node() {
    let zk = backend("").await;
    let locks = registry(&zk);
    let key = unique_key("curator");
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    admin
        .create(
            &container,
            &[],
            &CreateMode::Container.with_acls(Acls::anyone_all()),
        )
        .await
        .expect("container");
    let protected = format!("{container}/_c_0a1b2c3d-0000-4000-8000-00000000c0de-lock-");
    let (_, seq) = admin
        .create(
            &protected,
            b"curator",
            &CreateMode::EphemeralSequential.with_acls(Acls::anyone_all()),
        )
        .await
        .expect("a Curator node");
    let curator_node = format!("{protected}{seq}");
    assert!(matches!(
        locks.lock(&key).acquire().await,
        Err(LockError::Busy { .. })
    ));
    assert_eq!(
        children(&admin, &container).await.len(),
        1,
        "a busy try leaves no node"
    );
    let waiter = tokio::spawn({
        let (locks, key) = (locks.clone(), key.clone());
        async move {
            let guard = locks
                .lock(&key)
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (guard, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    admin
        .delete(&curator_node, None)
        .await
        .expect("Curator releases");
    let (guard, acquired) = waiter.await.expect("task");
    let guard = guard.expect("dlock gets it after Curator");
    assert!(acquired - released < Duration::from_secs(1));
    guard.release().await.expect("release");
}

/// A session stolen and closed by another client (what a server-side
/// expiry does to the holder): the holder's `lost()` fires, a waiter of
/// another process gets the key with a larger token, and the backend opens a
/// new session for what comes next.
///
/// The holder talks through a proxy that holds its bytes while the session is
/// stolen: otherwise its client reconnects with the same session at once, the
/// server hands the session back and forth, and the thief's handshake can
/// time out on a loaded machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_session_expiry_signals_loss_and_hands_over() {
    let proxy = ZkProxy::start(port(&url())).await;
    let holder_url = format!(
        "{}?session_timeout=4s",
        url().replacen(&hosts(&url()), &format!("127.0.0.1:{}", proxy.port()), 1)
    );
    let holder_zk = ZooKeeperBackend::connect(&holder_url)
        .await
        .unwrap_or_else(|e| servers_missing(&holder_url, e));
    let holder = registry(&holder_zk);
    let other = registry(&backend("").await);
    let key = unique_key("expiry");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token().expect("token");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            other
                .lock(&key)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "the waiter queues behind the holder");

    let stolen = holder_zk.session_for_tests().expect("a session");
    proxy.set(Fault::Hold);
    let mut attempts = 0;
    let thief = loop {
        attempts += 1;
        match Client::connector()
            .with_session(stolen.clone())
            .with_session_timeout(Duration::from_secs(4))
            .with_connection_timeout(Duration::from_secs(3))
            .connect(&hosts(&url()))
            .await
        {
            Ok(thief) => break thief,
            Err(e) if attempts < 5 => eprintln!("stealing the session: {e}; again"),
            Err(e) => panic!("steal the session: {e}"),
        }
    };
    let stolen_at = Instant::now();
    drop(thief); // closes the session: its nodes go.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The holder's client reconnects with the closed session and hears Expired.
    proxy.set(Fault::Pass);

    tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .expect("the holder hears of the loss");
    let noticed = stolen_at.elapsed();
    assert!(guard.is_lost());
    let next = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is served")
        .expect("task")
        .expect("the waiter gets the key");
    assert!(
        next.fencing_token().expect("token") > token,
        "the next holder's token is larger"
    );
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    next.release().await.expect("release");
    assert!(holder_zk.stats().leases_lost >= 1);
    // The backend carries on with a new session.
    let again = holder.lock(&key).acquire().await.expect("a new session");
    assert!(again.fencing_token().expect("token") > token);
    again.release().await.expect("release");
    assert_eq!(holder_zk.stats().sessions, 2);
    eprintln!("loss noticed {noticed:?} after the session was stolen");
}

/// 50 waiters on one key: every release wakes exactly one of them (one
/// watch set and one watch event per waiter), in the order they queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_herd_each_release_wakes_one_waiter_in_fifo_order() {
    const WAITERS: usize = 50;
    let zk = backend("").await;
    let locks = registry(&zk);
    let key = unique_key("herd");
    let admin = admin(&url()).await;
    let container = zk.container_path(&format!("dlock:{key}"));
    let holder = locks.lock(&key).acquire().await.expect("acquire");
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let (locks, key, order) = (locks.clone(), key.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let guard = locks
                .lock(&key)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
                .expect("served");
            order.lock().unwrap().push(i);
            guard.release().await.expect("release");
        }));
        // One at a time, so that the queue order is known.
        let deadline = Instant::now() + Duration::from_secs(10);
        while zk.stats().watches_set < i as u64 + 1 {
            assert!(Instant::now() < deadline, "waiter {i} did not queue");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert_eq!(children(&admin, &container).await.len(), WAITERS + 1);
    let before = zk.stats();
    holder.release().await.expect("release");
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("all served")
            .expect("task");
    }
    let after = zk.stats();
    assert_eq!(
        after.watch_events - before.watch_events,
        WAITERS as u64,
        "one wake-up per release: {after:?}"
    );
    assert_eq!(after.watches_set, WAITERS as u64, "{after:?}");
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    assert!(children(&admin, &container).await.is_empty());
}

/// Acquisitions dropped at random points of their flight — uncontended, or
/// queued behind a holder — leave no node behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_acquisitions_leave_no_node() {
    let zk = backend("").await;
    let locks = registry(&zk);
    let admin = admin(&url()).await;
    let busy = unique_key("cancel-busy");
    let holder = locks.lock(&busy).acquire().await.expect("acquire");
    let mut free = Vec::new();
    for i in 0..120u64 {
        let key = if i % 2 == 0 {
            busy.clone()
        } else {
            let key = unique_key(&format!("cancel-free-{i}"));
            free.push(key.clone());
            key
        };
        let attempt = locks
            .lock(&key)
            .wait(Duration::from_secs(30))
            .lease(Duration::from_secs(30))
            .acquire();
        // Granted guards are dropped here too (released in the background).
        let cut = Duration::from_micros(rand::random_range(0..4000));
        let _ = tokio::time::timeout(cut, attempt).await;
    }
    let busy_container = zk.container_path(&format!("dlock:{busy}"));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = children(&admin, &busy_container).await;
        let mut stray = Vec::new();
        for key in &free {
            let c = zk.container_path(&format!("dlock:{key}"));
            stray.extend(children(&admin, &c).await);
        }
        if left.len() == 1 && stray.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "nodes left: {} under the busy key (1 is the holder's), {stray:?}",
            left.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    holder.release().await.expect("release");
    assert!(children(&admin, &busy_container).await.is_empty());
}

#[tokio::test]
async fn digest_credentials_and_a_new_chroot() {
    let base = url();
    let chroot = format!("/dlock-test/auth-{:x}/nested", rand::random::<u32>());
    let url = format!("zk://dlock:s%3Acret@{}{chroot}", hosts(&base));
    let zk = ZooKeeperBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let shown = format!("{zk:?}");
    assert!(
        !shown.contains("s%3Acret") && !shown.contains("s:cret"),
        "{shown}"
    );
    let admin = admin(&base).await;
    assert!(
        admin.check_stat(&chroot).await.expect("read").is_some(),
        "the chroot is created"
    );
    let locks = registry(&zk);
    let guard = locks.lock("k").acquire().await.expect("acquire");
    assert!(zk.container_path("dlock:k").starts_with(&chroot));
    let kids = children(&admin, &zk.container_path("dlock:k")).await;
    assert_eq!(kids.len(), 1);
    guard.release().await.expect("release");
}

#[tokio::test]
async fn bad_urls_are_config_errors() {
    for url in [
        "zk://127.0.0.1:42181/a//b",
        "zk://127.0.0.1:42181/?session_timeout=soon",
        "zk://127.0.0.1:42181/?loss=sometimes",
        "zk://127.0.0.1:42181/?timeout=1s",
        "zk://127.0.0.1:42181/zookeeper",
        "zk://user@127.0.0.1:42181/",
    ] {
        let result = ZooKeeperBackend::connect(url).await;
        assert!(
            matches!(result, Err(LockError::Config { .. })),
            "{url}: {result:?}"
        );
    }
    let through_connect = dlock_runtime::connect("zk://127.0.0.1:42181/?loss=never").await;
    assert!(matches!(through_connect, Err(LockError::Config { .. })));
}

#[tokio::test]
async fn unreachable_server_fails_fast() {
    let started = Instant::now();
    let result = ZooKeeperBackend::connect("zk://u:hunter2@127.0.0.1:1/x?session_timeout=2s").await;
    let err = result.expect_err("nothing listens on port 1");
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    assert!(err.is_retryable(), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("hunter2"));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_from_url() {
    let registry = Registry::from_url(&url()).await.expect("zk:// opens");
    let guard = registry
        .lock(unique_key("from-url"))
        .acquire()
        .await
        .expect("acquire");
    assert!(guard.fencing_token().is_some());
    guard.release().await.expect("release");
}
