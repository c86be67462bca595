//! PostgreSQL backend options: passwords in query strings and in a nested
//! `listen_url` never shown in errors or `Debug`, and month-long leases in
//! session mode.
#![cfg(feature = "postgres")]

use std::time::Duration;

use dlock_tests::sql_db::SqlDb;
use dlock_tests::{servers_missing, unique_key};

fn pg_url() -> String {
    SqlDb::Postgres.url()
}

/// Secrets never appear in `Debug`/`Display`: a password given as
/// `?password=` (which sqlx accepts) is not shown in connect errors.
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

/// … nor a password inside `?listen_url=` (percent-encoded userinfo) in the
/// backend's `Debug`.
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

/// A month-long lease in session mode is accepted: the session's idle limit
/// (`idle_session_timeout`, an `int` GUC of at most 2^31 − 1 ms ≈ 24.8 days)
/// is clamped, as lease mode and MySQL accept such leases too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_session_accepts_a_month_long_lease() {
    let registry = SqlDb::Postgres.registry("mode=session").await;
    let key = unique_key("pg-session-month");
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
