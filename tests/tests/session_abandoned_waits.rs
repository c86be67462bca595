//! PostgreSQL session mode: a waiter whose caller goes away while the server
//! makes it wait is cancelled on the server at once (not left waiting out
//! its slice, to be granted the key for nobody), and its connection goes
//! back to use: a storm of callers that hang up costs no more connections
//! than the callers that wait.
#![cfg(feature = "postgres")]

use std::time::{Duration, Instant};

use dlock_runtime::Registry;
use dlock_tests::sql_db::SqlDb;
use dlock_tests::{servers_missing, unique_key};

const WAITERS: usize = 8;

async fn admin() -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let url = SqlDb::Postgres.url();
    sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// Server processes of `app` waiting for an advisory lock.
async fn waiting_on_the_server(app: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE a.application_name = $1 AND l.locktype = 'advisory' AND NOT l.granted",
    )
    .bind(app)
    .fetch_one(&mut admin().await)
    .await
    .expect("pg_locks")
}

/// Connections of `app` open on the server.
async fn connections(app: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(app)
        .fetch_one(&mut admin().await)
        .await
        .expect("pg_stat_activity")
}

/// Starts `WAITERS` waiters of `key`, lets the server make them wait, then
/// drops them all.
async fn abandon_waiters(waiters: &Registry, key: &str, app: &str) {
    let tasks: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (waiters, key) = (waiters.clone(), key.to_owned());
            tokio::spawn(async move {
                let _ = waiters
                    .lock(&key)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await;
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    while waiting_on_the_server(app).await < WAITERS as i64 {
        assert!(
            Instant::now() < deadline,
            "the waiters never waited on the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for task in &tasks {
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_waits_end_on_the_server_and_their_connections_are_reused() {
    let holder = SqlDb::Postgres.registry("mode=session").await;
    let app = format!("abandoned_{:08x}", rand::random::<u32>());
    let waiters = SqlDb::Postgres
        .registry(&format!("mode=session&application_name={app}"))
        .await;
    let key = unique_key("pg-abandoned-waits");
    let guard = holder.lock(&key).acquire().await.expect("hold");

    abandon_waiters(&waiters, &key, &app).await;
    // Each wait's slice is 10 s (a third of the 30 s lease): ended well
    // before that, by a cancel.
    let deadline = Instant::now() + Duration::from_secs(5);
    while waiting_on_the_server(&app).await > 0 {
        assert!(
            Instant::now() < deadline,
            "abandoned waits still wait on the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after_first = connections(&app).await;

    // A second storm reuses the connections of the first.
    abandon_waiters(&waiters, &key, &app).await;
    let after_second = connections(&app).await;
    assert!(
        after_second <= after_first,
        "a second storm of {WAITERS} abandoned waiters opened more connections: \
         {after_first} -> {after_second}"
    );

    // Nothing is left granted to the gone waiters when the key is released
    // (one the server granted before its cancel landed is unlocked within a
    // round trip; a wait left to run would hold the key for its 10 s slice).
    guard.release().await.expect("release");
    let free = holder
        .lock(&key)
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .expect("the key is free once released");
    free.release().await.expect("release");
}
