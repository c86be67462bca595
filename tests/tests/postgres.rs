//! The conformance suite and the lease-table suite on the PostgreSQL lease
//! table, and what only it has: LISTEN/NOTIFY wake-ups between processes
//! (only contended releases notify), a listener that comes back after its
//! connection is killed, waiters that poll when LISTEN does not work.
#![cfg(feature = "postgres")]

use std::time::{Duration, Instant};

use dlock_runtime::Registry;
use dlock_tests::handoff;
use dlock_tests::sql_db::{SqlDb, SqlTarget};
use dlock_tests::sql_support::{PgFaults, SqlMode};
use dlock_tests::{Harness, acquire_and_release, unique_key};

async fn target() -> SqlTarget {
    SqlTarget::get(SqlDb::Postgres, SqlMode::Lease).await
}

async fn harness() -> &'static Harness {
    target().await.h
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);
dlock_tests::sql_lease_table_suite!(target);
dlock_tests::sql_server_lease_table_suite!(target);

fn url() -> String {
    SqlDb::Postgres.url()
}

fn faults() -> PgFaults {
    PgFaults {
        url: url(),
        mode: SqlMode::Lease,
    }
}

/// The median of five handoffs of `key` from `holder` to a waiter of `waiter`.
async fn median_handoff(holder: &Registry, waiter: &Registry, key: &str) -> Duration {
    handoff::measure(holder, waiter, key, 5, Duration::from_millis(100))
        .await
        .median()
}

/// Cross-process handoff is pushed by NOTIFY: a few round trips, not the
/// 1 s fallback poll, nor the holder's 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_of_another_backend_at_once() {
    let t = target().await;
    let (holder, waiter) = (
        t.other_process("").await.registry(),
        t.other_process("").await.registry(),
    );
    let median = median_handoff(&holder, &waiter, &unique_key("notify-handoff")).await;
    assert!(
        median < Duration::from_millis(100),
        "median handoff {median:?}"
    );
}

/// A release notifies only when a waiter marked the key: an uncontended
/// lock sends no NOTIFY (a cluster-wide lock at commit), a contended one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_contended_releases_notify() {
    let h = harness().await;
    let mut listener = sqlx::postgres::PgListener::connect(&url())
        .await
        .expect("listen");
    listener.listen("dlock").await.expect("LISTEN dlock");
    let quiet = unique_key("quiet");
    for _ in 0..3 {
        acquire_and_release(h.registry(), &quiet).await;
    }
    let contended = unique_key("contended");
    let other = target().await.other_process("").await.registry();
    let guard = other.lock(&contended).acquire().await.expect("acquire");
    let waiter = tokio::spawn({
        let contended = contended.clone();
        async move {
            dlock_runtime::lock(&contended)
                .wait(Duration::from_secs(10))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    guard.release().await.expect("release");
    waiter
        .await
        .expect("task")
        .expect("handed over")
        .release()
        .await
        .expect("release");
    let mut heard = Vec::new();
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await {
        heard.push(n.payload().to_owned());
    }
    assert!(
        !heard.contains(&h.stored(&quiet)),
        "uncontended releases notified: {heard:?}"
    );
    assert!(
        heard.contains(&h.stored(&contended)),
        "the contended release did not notify: {heard:?}"
    );
}

/// The listener's connection terminated by the server: a waiter still gets
/// the key well within the holder's remaining lease, and once the listener
/// is back, handoff is push-speed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_comes_back_after_its_connection_is_killed() {
    let app = format!("dlock-test-{:08x}", rand::random::<u32>());
    let t = target().await;
    let holder = t.other_process("").await.registry();
    let backend = t
        .other_process(&format!("&application_name={app}"))
        .await
        .postgres()
        .clone();
    let waiter = Registry::builder().default_backend(backend.clone()).build();
    assert!(backend.is_listening());
    let key = unique_key("listener-killed");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(10))
        .acquire()
        .await
        .expect("acquire");
    let waiting = dlock_tests::handoff::start_waiting(&waiter, &key, Duration::from_secs(20));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
         AND (query LIKE 'LISTEN%' OR query LIKE '%dlock listener%')",
    )
    .bind(&app)
    .fetch_all(&mut faults().connect().await)
    .await
    .expect("find the listener");
    assert_eq!(
        pids.len(),
        1,
        "one listener connection per backend: {pids:?}"
    );
    faults().terminate(&pids).await;
    let released = Instant::now();
    guard.release().await.expect("release");
    let (next, acquired) = waiting.await.expect("task");
    next.expect("handed over").release().await.expect("release");
    let took = acquired - released;
    assert!(
        took < Duration::from_secs(2),
        "the waiter got the key {took:?} after the release (holder's lease: 10 s)"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !backend.is_listening() {
        assert!(Instant::now() < deadline, "the listener did not come back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let median = median_handoff(&holder, &waiter, &key).await;
    assert!(
        median < Duration::from_millis(100),
        "median handoff after the reconnect {median:?}"
    );
}

/// Without a working LISTEN (here: `listen_url` through a proxy that drops
/// everything, as a transaction-pooling proxy loses notifications), the
/// backend says so at connect and its waiters poll with back-off: handoff
/// still takes milliseconds, not the holder's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_listen_waiters_poll_with_back_off() {
    use dlock_tests::sql_support::{Fault, host_port, proxy_to, via};
    harness().await;
    let proxy = proxy_to(&host_port(&url())).await;
    proxy.set(Fault::Drop);
    let listen_url: String = via(&url(), proxy.addr())
        .bytes()
        .map(|b| match b {
            b':' | b'/' | b'@' | b'?' | b'&' | b'=' => format!("%{b:02X}"),
            b => (b as char).to_string(),
        })
        .collect();
    let started = Instant::now();
    let t = target().await;
    let backend = t
        .other_process(&format!("&timeout=2s&listen_url={listen_url}"))
        .await
        .postgres()
        .clone();
    let waiter = Registry::builder().default_backend(backend.clone()).build();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!backend.is_listening(), "{backend:?}");
    let holder = t.other_process("").await.registry();
    let median = median_handoff(&holder, &waiter, &unique_key("deaf")).await;
    assert!(
        median < Duration::from_millis(200),
        "median handoff {median:?}"
    );
}
