//! The etcd backend where its layout and its sessions meet edge cases:
//! prefixes nested in another backend's queues, prefixes whose empty
//! components hide behind percent-encoding, acquisitions that need a new
//! session while the cluster is unreachable, sub-second leases left
//! unrenewed or cut off, acquisitions dropped on a slow link, and a waiter
//! whose session is revoked.
#![cfg(feature = "etcd")]

use std::time::{Duration, Instant};

use dlock_runtime::{EtcdBackend, LockError};
use dlock_testkit::{Fault, FaultProxy};
use dlock_tests::etcd_support::{backend, endpoints, registry, url, url_to};
use dlock_tests::unique_key;
use tokio::sync::Mutex;

/// One test at a time: the proxy tests cut a member off for a while.
static CLUSTER: Mutex<()> = Mutex::const_new(());

/// A namespace of its own under the test cluster's prefix.
fn namespace(case: &str) -> String {
    unique_key(case).replace(':', "-")
}

/// Two backends whose prefixes differ are separate namespaces: a key of
/// one is never held up by the keys of the other, even when the other's
/// prefix is `{prefix}/{escaped key}` of the first (its entries then sit
/// under the first backend's queue of that key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_inside_another_backends_queue_does_not_hold_up_its_key() {
    let _one = CLUSTER.lock().await;
    let outer = backend(&format!("{}/{}", url(), namespace("nested"))).await;
    let queue = outer.queue_prefix("dlock:x");
    let inner_prefix = queue.trim_end_matches('/');
    let base = url();
    let hosts_end = base.find("/dlock-test").expect("the test URL's prefix");
    let inner = backend(&format!("{}{inner_prefix}", &base[..hosts_end])).await;
    assert!(
        inner.queue_prefix("dlock:k").starts_with(&queue),
        "the inner backend's queue {} is not under {queue}",
        inner.queue_prefix("dlock:k")
    );
    let held = registry(&inner)
        .lock("k")
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("the inner backend takes its key k");
    let other = registry(&outer)
        .lock("x")
        .wait(Duration::from_secs(2))
        .acquire()
        .await;
    let result = match other {
        Ok(guard) => {
            guard.release().await.expect("release x");
            Ok(())
        }
        Err(err) => Err(err),
    };
    held.release().await.expect("release k");
    result.expect("key x of the outer backend is free: nobody holds it");
}

/// A prefix with an empty component is refused, also when it is written
/// percent-encoded (`%2F%2F` is `//`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_percent_encoded_empty_prefix_component_is_refused() {
    let url = format!("{}/a%2F%2Fb", url());
    match EtcdBackend::connect(&url).await {
        Err(LockError::Config { .. }) => {}
        Err(other) => panic!("refused, but not as a configuration error: {other:?}"),
        Ok(backend) => panic!(
            "accepted, with the queues of key k under {}",
            backend.queue_prefix("k")
        ),
    }
}

/// A prefix written with a percent-encoded trailing `/` names the same
/// namespace as the one without it (the plain trailing `/` is dropped):
/// both backends exclude each other on one key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_percent_encoded_trailing_slash_names_the_same_prefix() {
    let _one = CLUSTER.lock().await;
    let ns = namespace("trailing");
    let plain = backend(&format!("{}/{ns}/", url())).await;
    let encoded = backend(&format!("{}/{ns}%2F", url())).await;
    assert_eq!(
        encoded.queue_prefix("dlock:k"),
        plain.queue_prefix("dlock:k"),
        "`/{ns}/` and `/{ns}%2F` put key k in different queues"
    );
}

/// After the session ended while the cluster is unreachable, every
/// acquisition — several at once, on different keys — answers within its
/// `wait` and about one request bound: opening the new session is not a
/// line the acquisitions wait in, one bound after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_needing_a_new_session_on_an_unreachable_cluster_answer_within_wait() {
    let _one = CLUSTER.lock().await;
    let member = endpoints(&url())[2].clone();
    let proxy = FaultProxy::start(member).await.expect("proxy");
    let cut_url = url_to(&[format!("127.0.0.1:{}", proxy.port())], "?session_ttl=3s");
    let etcd = backend(&cut_url).await;
    let locks = registry(&etcd);
    let warm = locks
        .lock(unique_key("unreachable-session-warm"))
        .acquire()
        .await
        .expect("acquire while reachable");
    warm.release().await.expect("release");
    proxy.set(Fault::Hold);
    // The keeper ends the session ⅔ of its TTL (2 s) after its last answer.
    let ended_by = Instant::now() + Duration::from_secs(6);
    while etcd.stats().sessions_ended == 0 {
        assert!(Instant::now() < ended_by, "the session never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let wait = Duration::from_secs(1);
    let mut tasks = Vec::new();
    for n in 0..8 {
        let locks = locks.clone();
        let key = unique_key(&format!("unreachable-session-{n}"));
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let result = locks.lock(key).wait(wait).acquire().await;
            (result.map(|_| ()), started.elapsed())
        }));
    }
    let mut took = Vec::new();
    for task in tasks {
        let (result, elapsed) = task.await.expect("task");
        assert!(result.is_err(), "granted with the cluster unreachable");
        took.push(elapsed);
    }
    proxy.set(Fault::Pass);
    eprintln!("answered after {took:?}");
    // `wait` (1 s) + one request bound (750 ms at a 3 s TTL), with slack.
    for elapsed in &took {
        assert!(
            *elapsed < Duration::from_secs(3),
            "an acquisition with wait = 1 s answered after {elapsed:?} (all: {took:?})"
        );
    }
}

/// A sub-second lease left unrenewed (`watchdog = false`) ends at its own
/// end, not at the session's: the holder hears of the loss, then a waiter
/// in another process is granted the key about a lease later, with a
/// larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrenewed_sub_second_lease_frees_its_key_at_its_end() {
    let _one = CLUSTER.lock().await;
    let holder = registry(&backend(&url()).await);
    let other = registry(&backend(&url()).await);
    let key = unique_key("sub-second-unrenewed");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_millis(100))
        .watchdog(false)
        .acquire()
        .await
        .expect("acquire");
    let taken = Instant::now();
    let token = guard.fencing_token().expect("token");
    let next = other
        .lock(&key)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("the waiter gets the key");
    let granted = taken.elapsed();
    assert!(
        guard.is_lost(),
        "a second holder while the first is not lost"
    );
    assert!(next.fencing_token().expect("token") > token);
    assert!(
        granted < Duration::from_secs(2),
        "granted {granted:?} after a 100 ms lease was taken"
    );
    next.release().await.expect("release");
}

/// A holder of a 100 ms lease (renewed by the watchdog) whose process is
/// cut off hears of its loss at its lease's end; the key is granted to
/// another process only after that, once the session's etcd lease expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_sub_second_holder_is_lost_before_the_key_moves() {
    let _one = CLUSTER.lock().await;
    let member = endpoints(&url())[0].clone();
    let proxy = FaultProxy::start(member).await.expect("proxy");
    let cut_url = url_to(&[format!("127.0.0.1:{}", proxy.port())], "?session_ttl=2s");
    let holder = registry(&backend(&cut_url).await);
    let other = registry(&backend(&url()).await);
    let key = unique_key("sub-second-cut");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_millis(100))
        .acquire()
        .await
        .expect("acquire");
    let token = guard.fencing_token().expect("token");
    // Renewed several times over.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!guard.is_lost(), "lost while the cluster answers");
    proxy.set(Fault::Drop);
    let cut = Instant::now();
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let next = other
                .lock(&key)
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (next, Instant::now())
        }
    });
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the holder hears of the loss");
    let lost_at = Instant::now();
    let (next, granted_at) = waiter.await.expect("task");
    let next = next.expect("the waiter gets the key");
    proxy.set(Fault::Pass);
    assert!(
        lost_at < granted_at,
        "granted before the holder heard of its loss"
    );
    assert!(
        lost_at - cut < Duration::from_secs(1),
        "a 100 ms lease heard of its loss {:?} after the cut",
        lost_at - cut
    );
    assert!(next.fencing_token().expect("token") > token);
    next.release().await.expect("release");
}

/// An acquisition dropped at any point — its put on the wire, its queue
/// read on the wire, its watch being set up, or waiting — leaves no entry
/// behind, even on a slow link: once the holder releases, the key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_dropped_on_a_slow_link_leave_no_entry() {
    let _one = CLUSTER.lock().await;
    let member = endpoints(&url())[1].clone();
    let proxy = FaultProxy::start(member).await.expect("proxy");
    let slow_url = url_to(&[format!("127.0.0.1:{}", proxy.port())], "");
    let slow_backend = backend(&slow_url).await;
    let slow = registry(&slow_backend);
    let holder = registry(&backend(&url()).await);
    let admin = dlock_tests::etcd_support::admin(&url()).await;
    for drop_after in [50u64, 150, 250, 350, 450, 600, 900] {
        let key = unique_key(&format!("dropped-slow-{drop_after}"));
        let queue = slow_backend.queue_prefix(&format!("dlock:{key}"));
        let guard = holder.lock(&key).acquire().await.expect("holder");
        proxy.set(Fault::Delay(Duration::from_millis(120)));
        let attempt = tokio::spawn({
            let (slow, key) = (slow.clone(), key.clone());
            async move {
                slow.lock(&key)
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(drop_after)).await;
        attempt.abort();
        let _ = attempt.await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        proxy.set(Fault::Pass);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let left = dlock_tests::etcd_support::entries(&admin, &queue).await;
        assert_eq!(
            left.len(),
            1,
            "dropped after {drop_after} ms: entries left besides the holder's: {left:?}"
        );
        guard.release().await.expect("release");
        let left = dlock_tests::etcd_support::entries(&admin, &queue).await;
        assert!(left.is_empty(), "dropped after {drop_after} ms: {left:?}");
    }
}

/// A waiter whose session's etcd lease is revoked (its queued entry goes
/// with it) is not left asleep: when the holder releases right after, it
/// opens a new session and is granted the key within a second, with a
/// larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_session_is_revoked_is_served_at_the_next_release() {
    let _one = CLUSTER.lock().await;
    let holder = registry(&backend(&url()).await);
    let waiting_backend = backend(&url()).await;
    let waiting = registry(&waiting_backend);
    let key = unique_key("revoked-waiter");
    let guard = holder.lock(&key).acquire().await.expect("holder");
    let token = guard.fencing_token().expect("token");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let next = waiting
                .lock(&key)
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (next, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lease = waiting_backend
        .session_lease_for_tests()
        .expect("a session");
    let mut admin = dlock_tests::etcd_support::admin(&url()).await;
    admin.lease_revoke(lease).await.expect("revoke");
    guard.release().await.expect("release");
    let released = Instant::now();
    let (next, granted_at) = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter is served")
        .expect("task");
    let next = next.expect("the waiter gets the key");
    assert!(next.fencing_token().expect("token") > token);
    assert!(
        granted_at - released < Duration::from_secs(1),
        "granted {:?} after the release",
        granted_at - released
    );
    assert!(
        waiting_backend.stats().sessions >= 2,
        "{:?}",
        waiting_backend.stats()
    );
    next.release().await.expect("release");
}
