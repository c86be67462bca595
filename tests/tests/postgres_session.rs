//! The conformance suite on PostgreSQL advisory locks (`?mode=session`), and
//! what only session mode has: loss the moment the holder's connection is
//! terminated, waits pushed by the server, tokens from the fence table.
#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{PostgresBackend, Registry};
use dlock_tests::sql_support::{
    PG_SESSION_KEY, PgFaults, SqlMode, black_hole_then_reset, loss_cancels_the_body,
};
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
            let backend = PostgresBackend::connect(&format!("{url}?mode=session"))
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(PgFaults {
                    url,
                    mode: SqlMode::Session,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);

fn faults() -> PgFaults {
    PgFaults {
        url: url(),
        mode: SqlMode::Session,
    }
}

/// A second backend on its own connections: what another process would have.
async fn other_process(options: &str) -> Registry {
    Registry::builder()
        .default_backend(
            PostgresBackend::connect(&format!("{}?mode=session{options}", url()))
                .await
                .expect("connect"),
        )
        .build()
}

/// The holder's connection terminated by the server (`pg_terminate_backend`):
/// the idle connection is watched, so the loss reaches the body at once —
/// long before the next ping — and the key is free for others, with a
/// larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_connection_is_lost_at_once() {
    let h = harness().await;
    let key = unique_key("terminated");
    let before = {
        let g = h.registry().lock(&key).acquire().await.expect("acquire");
        let t = g.fencing_token().expect("token");
        g.release().await.expect("release");
        t
    };
    let stored = h.stored(&key);
    let noticed = loss_cancels_the_body(&key, async {
        let holders = faults().session_holders(&stored).await;
        assert_eq!(holders.len(), 1, "one connection holds the lock");
        faults().terminate(&holders).await;
    })
    .await;
    assert!(
        noticed < Duration::from_millis(300),
        "noticed {noticed:?} after the termination (a ping is due every 500 ms)"
    );
    let next = h.registry().lock(&key).acquire().await.expect("free again");
    assert!(next.fencing_token().expect("token") > before);
    next.release().await.expect("release");
}

/// Waiting is server-side: the server hands the key to a waiter of another
/// backend the moment the holder unlocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_hands_the_key_to_a_waiter_of_another_backend() {
    harness().await;
    let (holder, waiter) = (other_process("").await, other_process("").await);
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

/// Acquisitions dropped while the server makes them wait leave no lock
/// behind: their connections are closed, never reused, and the key is free
/// at once for a try after the holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_waits_leave_no_lock() {
    let h = harness().await;
    let (holder, waiters) = (other_process("").await, other_process("").await);
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
    // The server notices a vanished waiter within a second
    // (`client_connection_check_interval`).
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
    let deleted = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM dlock_leases_fence WHERE k = {PG_SESSION_KEY}"
    )))
    .bind(h.stored(&key))
    .execute(&mut faults().connect().await)
    .await
    .expect("delete");
    assert_eq!(deleted.rows_affected(), 1);
    let second = h.registry().lock(&key).acquire().await.expect("acquire");
    assert!(second.fencing_token().expect("token") > before);
    second.release().await.expect("release");
}

/// Black hole: lost before the lease ends, and the server ends the silent
/// session (`idle_session_timeout` = the lease) so the key is free just
/// after it; reset: the backend reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn black_hole_then_reset_through_a_proxy() {
    harness().await;
    black_hole_then_reset(&url(), "?mode=session&timeout=500ms", |url| async move {
        Registry::builder()
            .default_backend(PostgresBackend::connect(&url).await.expect("connect"))
            .build()
    })
    .await;
}
