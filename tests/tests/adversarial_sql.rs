//! Adversarial tests of the PostgreSQL backend: each one pins a defect found by
//! reading the code adversarially (each failed before its fix): sessions the
//! server ended with a message, secrets in query strings, month-long session
//! leases.
#![cfg(feature = "postgres")]

use std::time::Duration;

use dlock_runtime::Registry;
use dlock_tests::{server_url, servers_missing, unique_key};

fn pg_url() -> String {
    server_url(
        "DLOCK_TEST_POSTGRES_URL",
        "postgres://dlock:dlock@127.0.0.1:45432/dlock",
    )
}

/// A name no other test (or other process on the shared servers) uses.
fn unique_name(what: &str) -> String {
    format!("adv_{what}_{:08x}", rand::random::<u32>())
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

async fn pg_registry(options: &str) -> Registry {
    let url = format!("{}?{options}", pg_url());
    let backend = dlock_runtime::PostgresBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    Registry::builder().default_backend(backend).build()
}

/// Idle pooled connections ended by the server with a FATAL message
/// (`pg_terminate_backend`, a graceful restart or failover, a role's
/// `idle_session_timeout`) are dead connections like any other: the next
/// acquisition must try another connection (`Pooled::call` retries
/// connection errors "after a restart"), not fail. Today the FATAL
/// `ErrorResponse` waiting in the socket comes back as a
/// `sqlx::Error::Database` (57P01), which `is_connection_error` does not
/// count, so the acquisition fails on the first dead connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_lease_acquire_survives_terminated_idle_pool_connections() {
    let app = unique_name("lease_term");
    let registry = pg_registry(&format!("application_name={app}")).await;
    let key = unique_key("adv-lease-terminated");
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
/// locks. A lock taken after the pool sat idle fails (57P05, classified
/// *permanent*), instead of opening a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_lease_acquire_after_idle_session_timeout() {
    let listen = pg_url()
        .replace(':', "%3A")
        .replace('/', "%2F")
        .replace('@', "%40");
    // The listener gets a plain URL (it pings every 3 s); dlock's lease pool
    // gets the server-side idle limit a DBA would set on the role.
    let registry = pg_registry(&format!(
        "options=-c%20idle_session_timeout%3D500&listen_url={listen}"
    ))
    .await;
    let key = unique_key("adv-idle-session-timeout");
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
/// the server meanwhile must be replaced, not make the acquisition fail.
/// (`SessionDb::lock` retries on a fresh connection only for
/// `is_connection_error`, which a FATAL 57P01 is not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_session_acquire_survives_a_terminated_kept_connection() {
    let app = unique_name("session_term");
    let registry = pg_registry(&format!("mode=session&application_name={app}")).await;
    let key = unique_key("adv-session-terminated");
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

/// Secrets never appear in `Debug`/`Display`: `redact_url` hides only the
/// userinfo, so a password given as `?password=` (which sqlx accepts) shows
/// in connect errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_password_in_the_query_string_is_not_shown_in_errors() {
    let Err(err) = dlock_runtime::PostgresBackend::connect(
        "postgres://dlock@127.0.0.1:1/dlock?password=hunter2secret&timeout=1s",
    )
    .await
    else {
        panic!("nothing listens on port 1")
    };
    let shown = format!("{err} / {err:?}");
    assert!(!shown.contains("hunter2secret"), "secret shown: {shown}");
}

/// … and a password inside `?listen_url=` (percent-encoded userinfo) shows
/// in the backend's `Debug`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_listen_url_password_is_not_shown_in_debug() {
    let url = pg_url();
    let hostpart = url
        .rsplit_once('@')
        .map(|(_, h)| h.to_owned())
        .expect("url with userinfo");
    let listen = format!(
        "postgres%3A%2F%2Fdlock%3Ahunter2secret%40{}",
        hostpart.replace(':', "%3A").replace('/', "%2F")
    );
    let backend =
        dlock_runtime::PostgresBackend::connect(&format!("{url}?listen_url={listen}&timeout=1s"))
            .await
            .unwrap_or_else(|e| servers_missing(&url, e));
    let shown = format!("{backend:?}");
    assert!(!shown.contains("hunter2secret"), "secret shown: {shown}");
}

/// A long lease in session mode: the idle limit is set to the lease in
/// milliseconds, but `idle_session_timeout` is an `int` GUC (at most
/// 2^31 − 1 ms ≈ 24.8 days): any longer lease makes every acquisition fail,
/// while lease mode (and MySQL, whose `wait_timeout` is clamped) accept it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_session_accepts_a_month_long_lease() {
    let registry = pg_registry("mode=session").await;
    let key = unique_key("adv-session-month");
    let got = registry
        .lock(&key)
        .lease(Duration::from_secs(30 * 24 * 3600))
        .acquire()
        .await;
    match got {
        Ok(g) => g.release().await.expect("release"),
        Err(e) => panic!("a 30-day lease in session mode: {e}"),
    }
}

/// The renewal side of the same defect: after a graceful restart (every
/// pooled connection ended with FATAL 57P01), each renewal attempt fails on
/// one dead connection instead of retrying on a fresh one, so a held lease
/// whose pool had many idle connections runs out of retries and is lost
/// though the server is up the whole time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_lease_renewal_survives_terminated_idle_pool_connections() {
    let app = unique_name("renew_term");
    let registry = pg_registry(&format!("application_name={app}")).await;
    let key = unique_key("adv-renew-terminated");
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
