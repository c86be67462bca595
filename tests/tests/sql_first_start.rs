//! Eight processes connecting at once to a database without dlock's table:
//! every one of them creates (or finds) the table and takes the lock — the
//! `CREATE TABLE IF NOT EXISTS` race (PostgreSQL can fail it with a unique
//! violation on its catalog), and on SQLite the opening of a new file
//! (answered SQLITE_BUSY at once while another process switches it to
//! WAL), cost none of them an error.
#![cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]

use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use dlock_tests::{server_url, unique_key};

const CHILDREN: usize = 8;

/// Starts the children with one start instant, waits for them, and answers
/// their tokens (each child's, in order of the children).
fn race(url: &str, key: &str) -> Vec<u64> {
    let start_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        + 1500;
    let children: Vec<_> = (0..CHILDREN)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_dlock-lock-child"))
                .args(["race", url, key, &start_at.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a child process")
        })
        .collect();
    children
        .into_iter()
        .map(|child| {
            let out = child.wait_with_output().expect("child output");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "a child failed: {}{stdout}",
                String::from_utf8_lossy(&out.stderr)
            );
            stdout
                .trim()
                .strip_prefix("token ")
                .and_then(|t| t.parse().ok())
                .unwrap_or_else(|| panic!("no token in {stdout:?}"))
        })
        .collect()
}

fn check_tokens(mut tokens: Vec<u64>) {
    assert_eq!(tokens.len(), CHILDREN);
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(
        tokens.len(),
        CHILDREN,
        "two children got one token: {tokens:?}"
    );
}

/// A table name no run has used, so that the database is "empty" for dlock.
fn fresh_table() -> String {
    format!("race_{:016x}", rand::random::<u64>())
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_create_the_postgres_table_at_once() {
    use sqlx::Connection as _;
    let url = server_url(
        "DLOCK_TEST_POSTGRES_URL",
        "postgres://dlock:dlock@127.0.0.1:45432/dlock",
    );
    let mut admin = sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e));
    for mode in ["lease", "session"] {
        let table = fresh_table();
        let tokens = race(
            &format!("{url}?table={table}&mode={mode}"),
            &unique_key("pg-race"),
        );
        check_tokens(tokens);
        for t in [table.clone(), format!("{table}_fence")] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
                .execute(&mut admin)
                .await
                .expect("drop the race's table");
        }
    }
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_create_the_mysql_table_at_once() {
    use sqlx::Connection as _;
    let url = server_url(
        "DLOCK_TEST_MYSQL_URL",
        "mysql://dlock:dlock@127.0.0.1:43306/dlock",
    );
    let mut admin = sqlx::MySqlConnection::connect(&url)
        .await
        .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e));
    for mode in ["lease", "session"] {
        let table = fresh_table();
        let tokens = race(
            &format!("{url}?table={table}&mode={mode}"),
            &unique_key("my-race"),
        );
        check_tokens(tokens);
        for t in [table.clone(), format!("{table}_fence")] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
                .execute(&mut admin)
                .await
                .expect("drop the race's table");
        }
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_create_the_sqlite_file_at_once() {
    for _ in 0..3 {
        let dir = std::env::temp_dir().join(format!("dlock-race-{:016x}", rand::random::<u64>()));
        let file = dir.join("locks.db");
        let tokens = race(
            &format!("sqlite://{}", file.display()),
            &unique_key("sq-race"),
        );
        check_tokens(tokens);
        std::fs::remove_dir_all(&dir).expect("remove the race's directory");
    }
}
