//! The conformance suite on etcd, and what only etcd has: the entry layout,
//! create-revision tokens, a revoked session lease, FIFO wake-ups without a
//! herd, cancellation that leaves no entry, URLs.
#![cfg(feature = "etcd")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{EtcdBackend, LockError, Registry};
use dlock_tests::etcd_support::{EtcdFaults, admin, entries, url};
use dlock_tests::{Harness, servers_missing, unique_key};
use tokio::sync::OnceCell;

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = EtcdBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend.clone()).build())
                .expect("first init");
            Harness {
                faults: Arc::new(EtcdFaults { backend, url }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

/// A backend of its own (another process, as far as etcd can tell).
async fn backend(query: &str) -> EtcdBackend {
    let url = format!("{}{query}", url());
    EtcdBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

fn registry(backend: &EtcdBackend) -> Registry {
    Registry::builder().default_backend(backend.clone()).build()
}

/// An entry `{prefix}/{escaped key}/{owner}` under the session's lease; the
/// token is its create revision, and the next holder's is larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_layout_and_create_revision_tokens() {
    let etcd = backend("").await;
    let locks = registry(&etcd);
    let key = format!("{}/with%slash", unique_key("layout"));
    let guard = locks.lock(&key).acquire().await.expect("acquire");
    let queue = etcd.queue_prefix(&format!("dlock:{key}"));
    assert!(
        queue.starts_with("/dlock-test/dlock:conformance:layout:"),
        "{queue}"
    );
    assert!(queue.ends_with("%2Fwith%25slash/"), "{queue}");
    let admin = admin(&url()).await;
    let listed = entries(&admin, &queue).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let (entry, revision) = &listed[0];
    let owner = entry.strip_prefix(&queue).expect("under the queue");
    assert_eq!(owner.len(), 32, "the owner token: {entry}");
    assert_eq!(
        guard.fencing_token().map(u64::from),
        Some(*revision as u64),
        "the token is the entry's create revision"
    );
    let mut kv = admin.clone();
    let got = kv.get(entry.as_str(), None).await.expect("get");
    assert_eq!(
        Some(got.kvs()[0].lease()),
        etcd.session_lease_for_tests(),
        "the entry is under the session's lease"
    );
    let first = guard.fencing_token().expect("token");
    guard.release().await.expect("release");
    assert!(entries(&admin, &queue).await.is_empty());
    let again = locks.lock(&key).acquire().await.expect("acquire");
    assert!(again.fencing_token().expect("token") > first);
    again.release().await.expect("release");
}

/// Revoking the session's etcd lease (what its expiry does) signals the
/// loss at once and hands the key to the waiter; the backend carries on
/// with a new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_session_lease_signals_loss_and_hands_over() {
    let holder_etcd = backend("").await;
    let holder = registry(&holder_etcd);
    let other = registry(&backend("").await);
    let key = unique_key("revoked");
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
    let lease = holder_etcd.session_lease_for_tests().expect("a session");
    let mut admin = admin(&url()).await;
    let revoked_at = Instant::now();
    admin.lease_revoke(lease).await.expect("revoke");
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the holder hears of the loss");
    let noticed = revoked_at.elapsed();
    let next = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter is served")
        .expect("task")
        .expect("the waiter gets the key");
    assert!(next.fencing_token().expect("token") > token);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    next.release().await.expect("release");
    assert!(holder_etcd.stats().leases_lost >= 1);
    let again = holder.lock(&key).acquire().await.expect("a new session");
    assert!(again.fencing_token().expect("token") > token);
    again.release().await.expect("release");
    assert_eq!(holder_etcd.stats().sessions, 2);
    eprintln!("loss noticed {noticed:?} after the lease was revoked");
}

/// 30 waiters on one key: every release wakes exactly one of them (one
/// watch set and one watch event per waiter), in the order they queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_herd_each_release_wakes_one_waiter_in_fifo_order() {
    const WAITERS: usize = 30;
    let etcd = backend("").await;
    let locks = registry(&etcd);
    let key = unique_key("herd");
    let admin = admin(&url()).await;
    let queue = etcd.queue_prefix(&format!("dlock:{key}"));
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
        let deadline = Instant::now() + Duration::from_secs(10);
        while etcd.stats().watches_set < i as u64 + 1 {
            assert!(Instant::now() < deadline, "waiter {i} did not queue");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert_eq!(entries(&admin, &queue).await.len(), WAITERS + 1);
    let before = etcd.stats();
    holder.release().await.expect("release");
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("all served")
            .expect("task");
    }
    let after = etcd.stats();
    assert_eq!(
        after.watch_events - before.watch_events,
        WAITERS as u64,
        "one wake-up per release: {after:?}"
    );
    assert_eq!(after.watches_set, WAITERS as u64, "{after:?}");
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    assert!(entries(&admin, &queue).await.is_empty());
}

/// Acquisitions dropped at random points of their flight — uncontended, or
/// queued behind a holder — leave no entry behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_acquisitions_leave_no_entry() {
    let etcd = backend("").await;
    let locks = registry(&etcd);
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
        let cut = Duration::from_micros(rand::random_range(0..6000));
        let _ = tokio::time::timeout(cut, attempt).await;
    }
    let busy_queue = etcd.queue_prefix(&format!("dlock:{busy}"));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = entries(&admin, &busy_queue).await;
        let mut stray = Vec::new();
        for key in &free {
            stray.extend(entries(&admin, &etcd.queue_prefix(&format!("dlock:{key}"))).await);
        }
        if left.len() == 1 && stray.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "entries left: {} under the busy key (1 is the holder's), {stray:?}",
            left.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    holder.release().await.expect("release");
    assert!(entries(&admin, &busy_queue).await.is_empty());
}

#[tokio::test]
async fn bad_urls_are_config_errors() {
    for url in [
        "etcd://127.0.0.1:42379/a//b",
        "etcd://127.0.0.1:42379/?session_ttl=soon",
        "etcd://127.0.0.1:42379/?session_ttl=500ms",
        "etcd://127.0.0.1:42379/?timeout=1s",
        "etcd://127.0.0.1:423790/",
        "etcd://user@127.0.0.1:42379/",
    ] {
        let result = EtcdBackend::connect(url).await;
        assert!(
            matches!(result, Err(LockError::Config { .. })),
            "{url}: {result:?}"
        );
    }
    let through_connect = dlock_runtime::connect("etcd://127.0.0.1:42379/?session_ttl=1s").await;
    assert!(matches!(through_connect, Err(LockError::Config { .. })));
}

#[tokio::test]
async fn unreachable_cluster_fails_fast() {
    let started = Instant::now();
    let result = EtcdBackend::connect("etcd://u:hunter2@127.0.0.1:1/x?session_ttl=2s").await;
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
    let registry = Registry::from_url(&url()).await.expect("etcd:// opens");
    let guard = registry
        .lock(unique_key("from-url"))
        .acquire()
        .await
        .expect("acquire");
    assert!(guard.fencing_token().is_some());
    guard.release().await.expect("release");
}
