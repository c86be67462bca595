//! The conformance suite on the PostgreSQL lease table, and what only it
//! has: LISTEN/NOTIFY wake-ups between processes, a listener that comes
//! back after its connection is killed, loss when the row is changed behind
//! the holder, tokens that survive deleted rows, the table's options.
#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{PostgresBackend, Registry};
use dlock_tests::sql_support::{PgFaults, SqlMode, loss_cancels_the_body};
use dlock_tests::{Harness, server_url, servers_missing, unique_key};
use tokio::sync::OnceCell;

fn url() -> String {
    server_url(
        "DLOCK_TEST_POSTGRES_URL",
        "postgres://dlock:dlock@127.0.0.1:45432/dlock",
    )
}

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = PostgresBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            assert!(backend.is_listening(), "{backend:?}");
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(PgFaults {
                    url,
                    mode: SqlMode::Lease,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);

/// A second backend on its own connections: what another process would have.
async fn other_process(options: &str) -> (Registry, PostgresBackend) {
    let backend = PostgresBackend::connect(&format!("{}{options}", url()))
        .await
        .expect("connect");
    let registry = Registry::builder().default_backend(backend.clone()).build();
    (registry, backend)
}

fn faults() -> PgFaults {
    PgFaults {
        url: url(),
        mode: SqlMode::Lease,
    }
}

/// Hands `key` from `holder` to a waiter of `waiter` five times (the
/// holder's lease is 30 s) and answers the median handoff.
async fn median_handoff(holder: &Registry, waiter: &Registry, key: &str) -> Duration {
    let mut handoffs = Vec::new();
    for _ in 0..5 {
        let guard = holder
            .lock(key)
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .expect("acquire");
        let waiting = tokio::spawn({
            let (waiter, key) = (waiter.clone(), key.to_owned());
            async move {
                let g = waiter
                    .lock(&key)
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await;
                (g, Instant::now())
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let released = Instant::now();
        guard.release().await.expect("release");
        let (next, acquired) = waiting.await.expect("task");
        next.expect("handed over").release().await.expect("release");
        handoffs.push(acquired - released);
    }
    handoffs.sort();
    handoffs[2]
}

/// Cross-process handoff is pushed by NOTIFY: a few round trips, not the
/// 1 s fallback poll, nor the holder's 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_of_another_backend_at_once() {
    harness().await;
    let ((holder, _), (waiter, _)) = (other_process("").await, other_process("").await);
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
        h.registry()
            .lock(&quiet)
            .acquire()
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
    }
    let contended = unique_key("contended");
    let (other, _) = other_process("").await;
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
    harness().await;
    let app = format!("dlock-test-{:08x}", rand::random::<u32>());
    let ((holder, _), (waiter, backend)) = (
        other_process("").await,
        other_process(&format!("?application_name={app}")).await,
    );
    assert!(backend.is_listening());
    let key = unique_key("listener-killed");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(10))
        .acquire()
        .await
        .expect("acquire");
    let waiting = tokio::spawn({
        let (waiter, key) = (waiter.clone(), key.clone());
        async move {
            let g = waiter
                .lock(&key)
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (g, Instant::now())
        }
    });
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
    use dlock_tests::sql_support::{Proxy, ProxyMode, host_port, via};
    harness().await;
    let proxy = Proxy::start(&host_port(&url())).await;
    proxy.set_mode(ProxyMode::BlackHole);
    let listen_url: String = via(&url(), proxy.addr)
        .bytes()
        .map(|b| match b {
            b':' | b'/' | b'@' | b'?' | b'&' | b'=' => format!("%{b:02X}"),
            b => (b as char).to_string(),
        })
        .collect();
    let started = Instant::now();
    let (waiter, backend) = other_process(&format!("?timeout=1s&listen_url={listen_url}")).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!backend.is_listening(), "{backend:?}");
    let (holder, _) = other_process("").await;
    let median = median_handoff(&holder, &waiter, &unique_key("deaf")).await;
    assert!(
        median < Duration::from_millis(200),
        "median handoff {median:?}"
    );
}

/// The fencing token keeps growing when the row is deleted (by an operator,
/// or the collection of free rows): it is the larger of the row's token + 1
/// and the database clock in µs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_when_the_row_is_deleted() {
    let h = harness().await;
    let key = unique_key("row-deleted");
    let first = h.registry().lock(&key).acquire().await.expect("acquire");
    let before = first.fencing_token().expect("token");
    first.release().await.expect("release");
    sqlx::query("DELETE FROM dlock_leases WHERE key = $1")
        .bind(h.stored(&key))
        .execute(&mut faults().connect().await)
        .await
        .expect("delete");
    let second = h.registry().lock(&key).acquire().await.expect("acquire");
    assert!(second.fencing_token().expect("token") > before);
    second.release().await.expect("release");
}

/// The row taken over behind the holder's back (its owner changed, its
/// expiry kept): the holder learns it at its next renewal, before the lease
/// ends, and the body is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_taken_over_behind_the_holder_is_lost_before_the_lease_ends() {
    let h = harness().await;
    let key = unique_key("taken-over");
    let stored = h.stored(&key);
    loss_cancels_the_body(&key, async {
        let done = sqlx::query("UPDATE dlock_leases SET owner = 'intruder' WHERE key = $1")
            .bind(&stored)
            .execute(&mut faults().connect().await)
            .await
            .expect("update");
        assert_eq!(done.rows_affected(), 1);
    })
    .await;
}

/// `?create=false` checks the table and never creates it; `?table=` names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_option_and_create_false() {
    harness().await;
    let table = format!("custom_{:08x}", rand::random::<u32>());
    let missing = PostgresBackend::connect(&format!("{}?create=false&table={table}", url())).await;
    match missing {
        Err(dlock_runtime::LockError::Config { message }) => {
            assert!(message.contains(&table), "{message}")
        }
        other => panic!("a missing table with create=false: {other:?}"),
    }
    let (created, _) = other_process(&format!("?table={table}")).await;
    let checked = Registry::builder()
        .default_backend(
            PostgresBackend::connect(&format!("{}?create=false&table={table}", url()))
                .await
                .expect("the table exists now"),
        )
        .build();
    let key = unique_key("custom-table");
    let guard = created.lock(&key).acquire().await.expect("acquire");
    assert!(matches!(
        checked.lock(&key).acquire().await,
        Err(dlock_runtime::LockError::Busy { .. })
    ));
    guard.release().await.expect("release");
    let rows: i64 =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&mut faults().connect().await)
            .await
            .expect("count");
    assert_eq!(rows, 1);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&mut faults().connect().await)
        .await
        .expect("drop");
}

/// Free rows are collected after the retention: 500 keys locked and
/// released leave O(1) rows once the retention (1 s) has passed and one more
/// release runs the collection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_rows_are_collected() {
    harness().await;
    let table = format!("gc_{:08x}", rand::random::<u32>());
    let (registry, backend) = other_process(&format!("?table={table}&retention=1s")).await;
    let prefix = unique_key("bounded");
    for i in 0..500 {
        registry
            .lock(format!("{prefix}:{i}"))
            .acquire()
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
    }
    assert!(backend.row_count().await.expect("count") > 5);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    registry
        .lock(format!("{prefix}:last"))
        .acquire()
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let rows = backend.row_count().await.expect("count");
        if rows <= 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{rows} rows left of 501 free keys"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&mut faults().connect().await)
        .await
        .expect("drop");
}

/// Bad URLs are configuration errors that never show the password; an
/// unreachable server is an error within the timeout.
#[tokio::test]
async fn bad_urls_and_unreachable_servers() {
    for bad in [
        "postgres://u:hunter2@127.0.0.1:45432/dlock?mode=advisory",
        "postgres://u:hunter2@127.0.0.1:45432/dlock?table=a;b",
        "postgres://u:hunter2@127.0.0.1:45432/dlock?poll=never",
        "postgres://u:hunter2@127.0.0.1:45432/dlock?listen_url=mysql%3A%2F%2Fh",
    ] {
        let err = PostgresBackend::connect(bad).await.expect_err(bad);
        assert!(
            matches!(err, dlock_runtime::LockError::Config { .. }),
            "{bad}: {err}"
        );
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");
    }
    let started = Instant::now();
    let err = PostgresBackend::connect("postgres://u:hunter2@127.0.0.1:1/db?timeout=500ms")
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        matches!(err, dlock_runtime::LockError::Backend { .. }),
        "{err}"
    );
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // The test server trusts local logins: an unknown role is refused.
    let wrong =
        PostgresBackend::connect("postgres://no_such_role:not-the-password@127.0.0.1:45432/dlock")
            .await
            .expect_err("unknown role");
    assert!(
        matches!(wrong, dlock_runtime::LockError::Backend { .. }),
        "{wrong}"
    );
    assert!(
        !format!("{wrong} {wrong:?}").contains("not-the-password"),
        "{wrong:?}"
    );
}

/// Black hole: lost before the lease ends, the row expires on the server;
/// reset: the backend reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn black_hole_then_reset_through_a_proxy() {
    harness().await;
    dlock_tests::sql_support::black_hole_then_reset(&url(), "?timeout=500ms", |url| async move {
        Registry::builder()
            .default_backend(PostgresBackend::connect(&url).await.expect("connect"))
            .build()
    })
    .await;
}
