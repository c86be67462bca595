//! PostgreSQL connections the server ends with a message (`pg_terminate_backend`,
//! a graceful restart or failover, `idle_session_timeout`): acquisitions and
//! renewals go on over another connection, in both modes; never an error, never
//! a loss.
#![cfg(feature = "postgres")]

use std::time::Duration;

use dlock_tests::sql_db::SqlDb;
use dlock_tests::{servers_missing, unique_key};

fn pg_url() -> String {
    SqlDb::Postgres.url()
}

/// A name no other test (or other process on the shared servers) uses.
fn unique_name(what: &str) -> String {
    format!("pg_{what}_{:08x}", rand::random::<u32>())
}

async fn pg_admin() -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let url = pg_url();
    sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// Terminates (`pg_terminate_backend`) every server backend whose
/// `application_name` is `app`; answers how many.
async fn pg_terminate_app(app: &str) -> usize {
    let pids: Vec<i32> =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(app)
            .fetch_all(&mut pg_admin().await)
            .await
            .expect("pg_stat_activity");
    let mut admin = pg_admin().await;
    for pid in &pids {
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(&mut admin)
            .await
            .expect("pg_terminate_backend");
    }
    pids.len()
}

/// Idle pooled connections ended by the server with a FATAL message
/// (`pg_terminate_backend`, a graceful restart or failover) are dead
/// connections like any other: the next acquisition tries another connection
/// and succeeds (the FATAL `ErrorResponse` waiting in the socket, 57P01, counts
/// as a connection error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_lease_acquire_survives_terminated_idle_pool_connections() {
    let app = unique_name("lease_term");
    let registry = SqlDb::Postgres
        .registry(&format!("application_name={app}"))
        .await;
    let key = unique_key("pg-lease-terminated");
    // Warm the pool: a few connections sit idle afterwards.
    let guards = futures_util::future::join_all(
        (0..4).map(|i| registry.lock(format!("{key}:{i}")).acquire()),
    )
    .await;
    for g in guards {
        g.expect("acquire").release().await.expect("release");
    }
    assert!(pg_terminate_app(&app).await >= 2, "pool connections found");
    // Let the FATAL messages reach the client sockets.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..4 {
        let got = registry.lock(format!("{key}:{i}")).acquire().await;
        match got {
            Ok(g) => g.release().await.expect("release"),
            Err(e) => panic!("acquisition {i} after the pool's connections were terminated: {e}"),
        }
    }
}

/// The same with the most common real trigger: the role or database has
/// `idle_session_timeout` (PostgreSQL ≥ 14) shorter than the gaps between
/// locks. A lock taken after the pool sat idle opens a fresh connection (57P05
/// is a connection error, not a permanent one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_lease_acquire_after_idle_session_timeout() {
    let listen = pg_url()
        .replace(':', "%3A")
        .replace('/', "%2F")
        .replace('@', "%40");
    // The listener gets a plain URL (it pings every 3 s); dlock's lease pool
    // gets the server-side idle limit a DBA would set on the role.
    let registry = SqlDb::Postgres
        .registry(&format!(
            "options=-c%20idle_session_timeout%3D500&listen_url={listen}"
        ))
        .await;
    let key = unique_key("pg-idle-session-timeout");
    let g = registry.lock(&key).acquire().await.expect("first acquire");
    g.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let again = registry.lock(&key).acquire().await;
    match again {
        Ok(g) => g.release().await.expect("release"),
        Err(e) => panic!("acquisition after the pool idled past idle_session_timeout: {e}"),
    }
}

/// Session mode keeps clean connections for reuse (up to 60 s): one ended by
/// the server meanwhile is replaced, and the acquisition succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_session_acquire_survives_a_terminated_kept_connection() {
    let app = unique_name("session_term");
    let registry = SqlDb::Postgres
        .registry(&format!("mode=session&application_name={app}"))
        .await;
    let key = unique_key("pg-session-terminated");
    let g = registry.lock(&key).acquire().await.expect("acquire");
    g.release().await.expect("release");
    assert!(
        pg_terminate_app(&app).await >= 1,
        "kept session connection found"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = registry.lock(&key).acquire().await;
    match again {
        Ok(g) => g.release().await.expect("release"),
        Err(e) => panic!("session acquisition after its kept connection was terminated: {e}"),
    }
}

/// The renewal side: after every pooled connection was ended with FATAL 57P01
/// (a graceful restart), each renewal retries on a fresh connection, so a held
/// lease whose pool had many idle connections is kept while the server is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_lease_renewal_survives_terminated_idle_pool_connections() {
    let app = unique_name("renew_term");
    let registry = SqlDb::Postgres
        .registry(&format!("application_name={app}"))
        .await;
    let key = unique_key("pg-renew-terminated");
    // Fill the pool (10 connections) with idle ones.
    let guards = futures_util::future::join_all(
        (0..10).map(|i| registry.lock(format!("{key}:warm:{i}")).acquire()),
    )
    .await;
    for g in guards {
        g.expect("acquire").release().await.expect("release");
    }
    let held = registry
        .lock(format!("{key}:held"))
        .lease(Duration::from_millis(1500))
        .acquire()
        .await
        .expect("acquire");
    assert!(pg_terminate_app(&app).await >= 5, "pool connections found");
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert!(
        !held.is_lost(),
        "the lease was lost while the server was up (renewals failed on dead pool connections)"
    );
    held.release().await.expect("release");
}
