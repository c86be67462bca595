//! The conformance suite and the lease-table suite on the MySQL/MariaDB lease
//! table, and what only it has: the `LAST_INSERT_ID` outcome of the acquire,
//! grouped renewals, waiters woken locally and polling across processes.
#![cfg(feature = "mysql")]

use std::time::Duration;

use dlock_runtime::MysqlBackend;
use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal};
use dlock_tests::handoff;
use dlock_tests::sql_db::{SqlDb, SqlTarget};
use dlock_tests::sql_support::{MyFaults, SqlMode};
use dlock_tests::{Faults, Harness, unique_key};

async fn target() -> SqlTarget {
    SqlTarget::get(SqlDb::Mysql, SqlMode::Lease).await
}

async fn harness() -> &'static Harness {
    target().await.h
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);
dlock_tests::sql_lease_table_suite!(target);
dlock_tests::sql_server_lease_table_suite!(target);

fn faults() -> MyFaults {
    MyFaults {
        url: SqlDb::Mysql.url(),
        mode: SqlMode::Lease,
    }
}

/// A MySQL backend on connections of its own.
async fn other_backend() -> MysqlBackend {
    target().await.other_process("").await.mysql().clone()
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
    let backend = other_backend().await;
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
    let backend = other_backend().await;
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
    let t = target().await;
    let (holder, waiter) = (
        t.other_process("").await.registry(),
        t.other_process("").await.registry(),
    );
    for (name, waiting_side) in [("local", &holder), ("remote", &waiter)] {
        let key = unique_key(&format!("poll-{name}"));
        let handoffs =
            handoff::measure(&holder, waiting_side, &key, 5, Duration::from_millis(300)).await;
        let median = handoffs.median();
        assert!(
            median < Duration::from_millis(if name == "local" { 25 } else { 100 }),
            "{name}: median handoff {median:?} ({handoffs:?})"
        );
    }
}
