//! The conformance suite on the MySQL/MariaDB lease table, and what only it
//! has: the `LAST_INSERT_ID` outcome of the acquire, grouped renewals, loss
//! when the row is changed behind the holder, polling waiters.
#![cfg(feature = "mysql")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal};
use dlock_runtime::{MysqlBackend, Registry};
use dlock_tests::sql_support::{MyFaults, SqlMode, loss_cancels_the_body};
use dlock_tests::{Faults, Harness, server_url, servers_missing, unique_key};
use tokio::sync::OnceCell;

fn url() -> String {
    server_url(
        "DLOCK_TEST_MYSQL_URL",
        "mysql://dlock:dlock@127.0.0.1:43306/dlock",
    )
}

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = MysqlBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(MyFaults {
                    url,
                    mode: SqlMode::Lease,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);

fn faults() -> MyFaults {
    MyFaults {
        url: url(),
        mode: SqlMode::Lease,
    }
}

/// A second backend on its own connections: what another process would have.
async fn other_process(options: &str) -> (Registry, MysqlBackend) {
    let backend = MysqlBackend::connect(&format!("{}{options}", url()))
        .await
        .expect("connect");
    let registry = Registry::builder().default_backend(backend.clone()).build();
    (registry, backend)
}

fn request(key: &str, owner: &str, lease: Duration) -> AcquireRequest {
    AcquireRequest::new(key, owner, lease)
}

async fn try_once(backend: &MysqlBackend, req: &AcquireRequest) -> Attempt {
    backend.try_acquire(req).await.expect("one attempt")
}

/// The acquire statement reports its outcome through `LAST_INSERT_ID`: a
/// token (the clock in µs) when taken, the holder's remaining time when busy,
/// a new, larger token for a retry by the same owner and for a takeover
/// after expiry — on MariaDB here, and the same statement on MySQL 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acquire_reports_its_outcome_through_last_insert_id() {
    harness().await;
    let (_, backend) = other_process("").await;
    let key = format!("dlock:{}", unique_key("last-insert-id"));
    let lease = Duration::from_millis(400);
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as u64;
    let Attempt::Held(first) = try_once(&backend, &request(&key, "a", lease)).await else {
        panic!("a free key is taken")
    };
    let first = first.token.expect("token").get();
    // The database clock in µs (the two clocks are one machine's).
    assert!(first.abs_diff(now_us) < 5_000_000, "{first} vs {now_us}");
    match try_once(&backend, &request(&key, "b", lease)).await {
        Attempt::Busy {
            retry_in: Some(left),
        } => assert!(
            left > Duration::from_millis(200) && left <= lease,
            "remaining {left:?}"
        ),
        other => panic!("busy for another owner, got {other:?}"),
    }
    let Attempt::Held(again) = try_once(&backend, &request(&key, "a", lease)).await else {
        panic!("a retry by the owner takes it again")
    };
    let again = again.token.expect("token").get();
    assert!(again > first);
    tokio::time::sleep(lease + Duration::from_millis(50)).await;
    let Attempt::Held(taken) = try_once(&backend, &request(&key, "b", lease)).await else {
        panic!("an expired key is taken over")
    };
    assert!(taken.token.expect("token").get() > again);
    // The row says so too: owner b, the token handed out.
    let (owner, token): (Vec<u8>, u64) =
        sqlx::query_as("SELECT owner, token FROM dlock_leases WHERE k = ?")
            .bind(&key)
            .fetch_one(&mut faults().connect().await)
            .await
            .expect("row");
    assert_eq!(owner, b"b");
    assert_eq!(Some(token), taken.token.map(|t| t.get()));
    backend.release(&taken).await.expect("release");
}

/// One grouped statement renews a batch; the one lease revoked behind its
/// holder's back, and only it, is reported lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_renewal_reports_exactly_the_lost_leases() {
    harness().await;
    let (_, backend) = other_process("").await;
    let lease = Duration::from_secs(5);
    let mut leases = Vec::new();
    for i in 0..5 {
        let key = format!("dlock:{}", unique_key(&format!("batch-{i}")));
        let Attempt::Held(lease) = try_once(&backend, &request(&key, "owner", lease)).await else {
            panic!("free")
        };
        leases.push(lease);
    }
    faults().revoke(&leases[3].key).await;
    let batch: Vec<(&Lease, Duration)> = leases.iter().map(|l| (l, lease)).collect();
    let answers: Vec<Renewal> = backend
        .renew_all(&batch)
        .await
        .into_iter()
        .map(|r| r.expect("renewed or lost"))
        .collect();
    let lost: Vec<usize> = (0..5).filter(|i| answers[*i] == Renewal::Lost).collect();
    assert_eq!(lost, [3], "{answers:?}");
    for lease in &leases {
        backend.release(lease).await.expect("release");
    }
}

/// Waiters in the releasing process are woken at once; waiters elsewhere
/// poll with back-off, within the poll cap (50 ms), not the holder's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_locally_and_poll_across_processes() {
    harness().await;
    let ((holder, _), (waiter, _)) = (other_process("").await, other_process("").await);
    for (name, waiting_side) in [("local", &holder), ("remote", &waiter)] {
        let key = unique_key(&format!("poll-{name}"));
        let mut handoffs = Vec::new();
        for _ in 0..5 {
            let guard = holder
                .lock(&key)
                .lease(Duration::from_secs(30))
                .acquire()
                .await
                .expect("acquire");
            let waiting = tokio::spawn({
                let (registry, key) = (waiting_side.clone(), key.clone());
                async move {
                    let g = registry
                        .lock(&key)
                        .wait(Duration::from_secs(20))
                        .acquire()
                        .await;
                    (g, Instant::now())
                }
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            let released = Instant::now();
            guard.release().await.expect("release");
            let (next, acquired) = waiting.await.expect("task");
            next.expect("handed over").release().await.expect("release");
            handoffs.push(acquired - released);
        }
        handoffs.sort();
        let median = handoffs[2];
        assert!(
            median < Duration::from_millis(if name == "local" { 25 } else { 100 }),
            "{name}: median handoff {median:?} ({handoffs:?})"
        );
    }
}

/// The fencing token keeps growing when the row is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_when_the_row_is_deleted() {
    let h = harness().await;
    let key = unique_key("row-deleted");
    let first = h.registry().lock(&key).acquire().await.expect("acquire");
    let before = first.fencing_token().expect("token");
    first.release().await.expect("release");
    faults().revoke(&h.stored(&key)).await;
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
        let done = sqlx::query("UPDATE dlock_leases SET owner = 'intruder' WHERE k = ?")
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
    match MysqlBackend::connect(&format!("{}?create=false&table={table}", url())).await {
        Err(dlock_runtime::LockError::Config { message }) => {
            assert!(message.contains(&table), "{message}")
        }
        other => panic!("a missing table with create=false: {other:?}"),
    }
    let (created, _) = other_process(&format!("?table={table}")).await;
    let (checked, _) = other_process(&format!("?create=false&table={table}")).await;
    let key = unique_key("custom-table");
    let guard = created.lock(&key).acquire().await.expect("acquire");
    assert!(matches!(
        checked.lock(&key).acquire().await,
        Err(dlock_runtime::LockError::Busy { .. })
    ));
    guard.release().await.expect("release");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&mut faults().connect().await)
        .await
        .expect("drop");
}

/// Free rows are collected after the retention.
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

/// Bad URLs are configuration errors without the password; a wrong password
/// and an unreachable server are backend errors within the timeout.
#[tokio::test]
async fn bad_urls_and_unreachable_servers() {
    for bad in [
        "mysql://u:hunter2@127.0.0.1:43306/dlock?mode=advisory",
        "mysql://u:hunter2@127.0.0.1:43306/dlock?table=a;b",
        "mysql://u:hunter2@127.0.0.1:43306/dlock?poll=never",
    ] {
        let err = MysqlBackend::connect(bad).await.expect_err(bad);
        assert!(
            matches!(err, dlock_runtime::LockError::Config { .. }),
            "{bad}: {err}"
        );
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err:?}");
    }
    let started = Instant::now();
    let err = MysqlBackend::connect("mysql://u:hunter2@127.0.0.1:1/db?timeout=500ms")
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        matches!(err, dlock_runtime::LockError::Backend { .. }),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let wrong = MysqlBackend::connect("mysql://dlock:not-the-password@127.0.0.1:43306/dlock")
        .await
        .expect_err("wrong password");
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
            .default_backend(MysqlBackend::connect(&url).await.expect("connect"))
            .build()
    })
    .await;
}
