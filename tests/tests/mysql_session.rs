//! The conformance suite on MySQL/MariaDB `GET_LOCK` (`?mode=session`), and
//! what only session mode has: loss when the holder's connection is killed,
//! waits pushed by the server, tokens from the fence table.
#![cfg(feature = "mysql")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{MysqlBackend, Registry};
use dlock_tests::sql_support::{
    MyFaults, SqlMode, black_hole_then_reset, loss_cancels_the_body, session_hash,
};
use dlock_tests::{Harness, server_url, servers_missing, unique_key};
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
            let backend = MysqlBackend::connect(&format!("{url}?mode=session"))
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(MyFaults {
                    url,
                    mode: SqlMode::Session,
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
        mode: SqlMode::Session,
    }
}

/// A second backend on its own connections: what another process would have.
async fn other_process() -> Registry {
    Registry::builder()
        .default_backend(
            MysqlBackend::connect(&format!("{}?mode=session", url()))
                .await
                .expect("connect"),
        )
        .build()
}

/// The holder's connection killed (`KILL`): lost at the next ping (a third
/// of the lease), before the lease ends, the body cancelled; the key is
/// free for others, with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_is_lost_before_the_lease_ends() {
    let h = harness().await;
    let key = unique_key("killed");
    let before = {
        let g = h.registry().lock(&key).acquire().await.expect("acquire");
        let t = g.fencing_token().expect("token");
        g.release().await.expect("release");
        t
    };
    let stored = h.stored(&key);
    loss_cancels_the_body(&key, async {
        let holder = faults().session_holder(&stored).await;
        faults().kill(holder.expect("held")).await;
    })
    .await;
    let next = h.registry().lock(&key).acquire().await.expect("free again");
    assert!(next.fencing_token().expect("token") > before);
    next.release().await.expect("release");
}

/// Waiting is server-side (`GET_LOCK` with a timeout): the server hands the
/// key to a waiter of another backend the moment the holder unlocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_hands_the_key_to_a_waiter_of_another_backend() {
    harness().await;
    let (holder, waiter) = (other_process().await, other_process().await);
    let key = unique_key("pushed");
    let mut handoffs = Vec::new();
    for _ in 0..5 {
        let guard = holder
            .lock(&key)
            .lease(Duration::from_secs(30))
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
        tokio::time::sleep(Duration::from_millis(100)).await;
        let released = Instant::now();
        guard.release().await.expect("release");
        let (next, acquired) = waiting.await.expect("task");
        next.expect("handed over").release().await.expect("release");
        handoffs.push(acquired - released);
    }
    handoffs.sort();
    assert!(
        handoffs[2] < Duration::from_millis(50),
        "median handoff {:?} ({handoffs:?})",
        handoffs[2]
    );
}

/// Acquisitions dropped while `GET_LOCK` waits leave no lock behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_waits_leave_no_lock() {
    let h = harness().await;
    let (holder, waiters) = (other_process().await, other_process().await);
    let key = unique_key("abandoned-waits");
    let guard = holder.lock(&key).acquire().await.expect("acquire");
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (waiters, key) = (waiters.clone(), key.clone());
            tokio::spawn(async move {
                let _ = waiters
                    .lock(&key)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await;
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for task in &tasks {
        task.abort();
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    guard.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !h.faults.is_held(&h.stored(&key)).await,
        "an abandoned waiter was granted the key"
    );
    let free = h
        .registry()
        .lock(&key)
        .acquire()
        .await
        .expect("free for a try");
    free.release().await.expect("release");
}

/// The token keeps growing when the fence row is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_when_the_fence_row_is_deleted() {
    let h = harness().await;
    let key = unique_key("fence-deleted");
    let first = h.registry().lock(&key).acquire().await.expect("acquire");
    let before = first.fencing_token().expect("token");
    first.release().await.expect("release");
    let deleted = sqlx::query("DELETE FROM dlock_leases_fence WHERE k = ?")
        .bind(session_hash(&h.stored(&key)) as i64)
        .execute(&mut faults().connect().await)
        .await
        .expect("delete");
    assert_eq!(deleted.rows_affected(), 1);
    let second = h.registry().lock(&key).acquire().await.expect("acquire");
    assert!(second.fencing_token().expect("token") > before);
    second.release().await.expect("release");
}

/// Black hole: lost before the lease ends, and the server ends the silent
/// session (`wait_timeout`, the lease rounded up to a second); reset: the
/// backend reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn black_hole_then_reset_through_a_proxy() {
    harness().await;
    black_hole_then_reset(&url(), "?mode=session&timeout=500ms", |url| async move {
        Registry::builder()
            .default_backend(MysqlBackend::connect(&url).await.expect("connect"))
            .build()
    })
    .await;
}
