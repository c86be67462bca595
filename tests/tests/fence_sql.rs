//! The SQL fence (`dlock_runtime::fence`) on SQLite, PostgreSQL and
//! MySQL/MariaDB, each fencing writes to the database its lock lives in: a
//! stale holder's late write is refused and rolled back, concurrent checkers
//! commit in token order, `check_current` takes the token of the held lock,
//! the column form, and the collection of old rows.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]

use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::fence::{self, Fence};
use dlock_runtime::{FencingToken, LockError, Registry, distributed_lock};
use dlock_tests::fence_support::assert_fenced;
use dlock_tests::sql_db::SqlDb;
use dlock_tests::unique_key;
use rand::seq::SliceRandom;
use tokio::sync::OnceCell;

/// The data the tests protect: `val` written under a lock, `fence` for the
/// column form.
const DATA_DDL: &str = "CREATE TABLE IF NOT EXISTS fence_test_data \
    (id VARCHAR(200) PRIMARY KEY, val BIGINT NOT NULL, fence BIGINT NOT NULL DEFAULT 0)";

/// `?` placeholders as PostgreSQL numbers them.
fn numbered(sql: &str) -> String {
    let mut out = String::new();
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(c);
        }
    }
    out
}

fn same(sql: &str) -> String {
    sql.to_owned()
}

/// The SQLite file every test of this process shares (locks and data).
fn sqlite_path() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
        .join("fence.db")
        .leak()
}

async fn sqlite_pool() -> sqlx::SqlitePool {
    use std::str::FromStr;
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(&format!(
        "sqlite://{}",
        sqlite_path().display()
    ))
    .expect("sqlite url")
    .create_if_missing(true)
    .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
    .busy_timeout(Duration::from_secs(30));
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("sqlite pool")
}

async fn postgres_pool() -> sqlx::PgPool {
    let url = SqlDb::Postgres.url();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&url)
        .await
        .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e))
}

async fn mysql_pool() -> sqlx::MySqlPool {
    let url = SqlDb::Mysql.url();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(20)
        .connect(&url)
        .await
        .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e));
    // No check creates the table on MySQL: its DDL commits the transaction.
    fence::create_table(&pool).await.expect("fence table");
    pool
}

/// The lock backends of the three databases, named `sqlite`, `postgres` and
/// `mysql`, installed once as the global registry (for the attribute).
async fn registry() -> Registry {
    static REGISTRY: OnceCell<Registry> = OnceCell::const_new();
    REGISTRY
        .get_or_init(|| async {
            let sqlite = format!("sqlite://{}", sqlite_path().display());
            let (pg, my) = (SqlDb::Postgres.url(), SqlDb::Mysql.url());
            let registry = Registry::builder()
                .backend(
                    "sqlite",
                    dlock_runtime::SqliteBackend::connect(&sqlite)
                        .await
                        .expect("sqlite backend"),
                )
                .backend(
                    "postgres",
                    dlock_runtime::PostgresBackend::connect(&pg)
                        .await
                        .unwrap_or_else(|e| dlock_tests::servers_missing(&pg, e)),
                )
                .backend(
                    "mysql",
                    dlock_runtime::MysqlBackend::connect(&my)
                        .await
                        .unwrap_or_else(|e| dlock_tests::servers_missing(&my, e)),
                )
                .build();
            dlock_runtime::init(registry.clone()).expect("first init");
            registry
        })
        .await
        .clone()
}

/// The suite on one database: `$db` the sqlx database, `$pool` its pool,
/// `$sql` how it writes `?` placeholders, `$backend` its lock backend's name,
/// `$age` the statement that ages a fence row past the default retention.
macro_rules! fence_suite {
    ($name:ident, $db:ty, $pool:path, $sql:path, $backend:literal, $age:literal) => {
        mod $name {
            use super::*;

            async fn setup() -> sqlx::Pool<$db> {
                let pool = $pool().await;
                static DATA: OnceCell<()> = OnceCell::const_new();
                DATA.get_or_init(|| async {
                    sqlx::query(DATA_DDL)
                        .execute(&pool)
                        .await
                        .expect("data table");
                })
                .await;
                pool
            }

            async fn insert(pool: &sqlx::Pool<$db>, id: &str) {
                sqlx::query(sqlx::AssertSqlSafe($sql(
                    "INSERT INTO fence_test_data (id, val, fence) VALUES (?, 0, 0)",
                )))
                .bind(id)
                .execute(pool)
                .await
                .expect("insert");
            }

            async fn value(pool: &sqlx::Pool<$db>, id: &str) -> i64 {
                sqlx::query_scalar(sqlx::AssertSqlSafe($sql(
                    "SELECT val FROM fence_test_data WHERE id = ?",
                )))
                .bind(id)
                .fetch_one(pool)
                .await
                .expect("value")
            }

            async fn stored_token(pool: &sqlx::Pool<$db>, resource: &str) -> Option<i64> {
                sqlx::query_scalar(sqlx::AssertSqlSafe($sql(
                    "SELECT token FROM dlock_fences WHERE resource = ?",
                )))
                .bind(resource)
                .fetch_optional(pool)
                .await
                .expect("stored token")
            }

            /// Sets `val` inside `tx`.
            async fn write(tx: &mut sqlx::Transaction<'_, $db>, id: &str, val: i64) {
                sqlx::query(sqlx::AssertSqlSafe($sql(
                    "UPDATE fence_test_data SET val = ? WHERE id = ?",
                )))
                .bind(val)
                .bind(id)
                .execute(&mut **tx)
                .await
                .expect("write");
            }

            /// A's lease runs out (no watchdog); B takes the lock with a
            /// larger token and writes through the fence; A's late write,
            /// made before its check in the same transaction, is refused and
            /// rolled back: the data keeps B's value.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stale_holders_write_is_refused_and_rolled_back() {
                let pool = setup().await;
                let registry = registry().await;
                let key = unique_key(concat!("fence-stale-", $backend));
                insert(&pool, &key).await;

                let a = registry
                    .lock(&*key)
                    .backend($backend)
                    .lease(Duration::from_secs(1))
                    .watchdog(false)
                    .acquire()
                    .await
                    .expect("A acquires");
                let b = registry
                    .lock(&*key)
                    .backend($backend)
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
                    .expect("B acquires after A's lease ran out");
                let (ta, tb) = (a.fencing_token().unwrap(), b.fencing_token().unwrap());
                assert!(tb > ta, "B's token {tb} above A's {ta}");

                b.scope(async {
                    let mut tx = pool.begin().await.unwrap();
                    fence::check_current(&mut tx, &key).await.expect("B passes");
                    write(&mut tx, &key, 2).await;
                    tx.commit().await.unwrap();
                })
                .await;

                let refused = a
                    .scope(async {
                        let mut tx = pool.begin().await.unwrap();
                        write(&mut tx, &key, 1).await;
                        let checked = fence::check_current(&mut tx, &key).await;
                        if checked.is_ok() {
                            tx.commit().await.unwrap();
                        }
                        // Else dropped: rolled back.
                        checked
                    })
                    .await;
                assert_fenced(refused, &key, ta.get(), tb.get());
                assert_eq!(value(&pool, &key).await, 2, "A's write did not commit");
                assert_eq!(stored_token(&pool, &key).await, Some(tb.get() as i64));

                // B writes again with the same token: equal passes.
                b.scope(async {
                    let mut tx = pool.begin().await.unwrap();
                    fence::check_current(&mut tx, &key)
                        .await
                        .expect("equal passes");
                    write(&mut tx, &key, 3).await;
                    tx.commit().await.unwrap();
                })
                .await;
                assert_eq!(value(&pool, &key).await, 3);
                b.release().await.unwrap();
                let _ = a.release().await;
            }

            /// An operator revokes A's hold (`Registry::revoke`): B is
            /// granted the key with a larger token and writes through the
            /// fence; A's late write with its revoked token is refused and
            /// rolled back, and A is told it lost the key.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_revoked_holders_late_write_is_refused() {
                let pool = setup().await;
                let registry = registry().await;
                let key = unique_key(concat!("fence-revoked-", $backend));
                insert(&pool, &key).await;

                let a = registry
                    .lock(&*key)
                    .backend($backend)
                    .acquire()
                    .await
                    .expect("A acquires");
                let ta = a.fencing_token().expect("A's token");
                let revoked = registry
                    .admin(Some($backend))
                    .expect("the backend")
                    .revoke(&key)
                    .await
                    .expect("revoke");
                assert_eq!(revoked.len(), 1, "{revoked:?}");
                assert_eq!(revoked[0].token(), Some(ta));
                let b = registry
                    .lock(&*key)
                    .backend($backend)
                    .wait(Duration::from_secs(10))
                    .acquire()
                    .await
                    .expect("B acquires after the revocation");
                let tb = b.fencing_token().expect("B's token");
                assert!(tb > ta, "B's token {tb} above the revoked {ta}");
                b.scope(async {
                    let mut tx = pool.begin().await.unwrap();
                    fence::check_current(&mut tx, &key).await.expect("B passes");
                    write(&mut tx, &key, 2).await;
                    tx.commit().await.unwrap();
                })
                .await;

                // A, paused through all of it, writes with the token it had.
                let mut tx = pool.begin().await.unwrap();
                write(&mut tx, &key, 1).await;
                let refused = fence::check(&mut tx, &key, ta).await;
                drop(tx);
                assert_fenced(refused, &key, ta.get(), tb.get());
                assert_eq!(value(&pool, &key).await, 2, "A's write did not commit");
                tokio::time::timeout(Duration::from_secs(15), a.lost())
                    .await
                    .expect("A learns that it lost the key");
                b.release().await.unwrap();
                let _ = a.release().await;
            }

            /// Many checkers of one resource at once, tokens shuffled: each
            /// one that passes reads the value committed before it, which is
            /// never from a larger token, and the last value is the largest
            /// token's.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_checkers_commit_in_token_order() {
                let pool = setup().await;
                let key = unique_key(concat!("fence-order-", $backend));
                insert(&pool, &key).await;
                let mut tokens: Vec<i64> = (1..=24).collect();
                tokens.shuffle(&mut rand::rng());
                let key = Arc::new(key);
                let mut tasks = Vec::new();
                for t in tokens {
                    let (pool, key) = (pool.clone(), key.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut tx = pool.begin().await.unwrap();
                        match fence::check(&mut tx, &key, FencingToken::new(t as u64)).await {
                            Ok(()) => {}
                            Err(LockError::Fenced { seen, .. }) => {
                                let seen = seen.expect("the larger token").get() as i64;
                                assert!(seen > t, "refused {t} for a smaller {seen}");
                                return None;
                            }
                            Err(e) => panic!("check {t}: {e}"),
                        }
                        let before: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe($sql(
                            "SELECT val FROM fence_test_data WHERE id = ?",
                        )))
                        .bind(&*key)
                        .fetch_one(&mut *tx)
                        .await
                        .unwrap();
                        write(&mut tx, &key, t).await;
                        tx.commit().await.unwrap();
                        Some((before, t))
                    }));
                }
                let mut committed = Vec::new();
                for task in tasks {
                    if let Some(pair) = task.await.unwrap() {
                        committed.push(pair);
                    }
                }
                for (before, t) in &committed {
                    assert!(before <= t, "token {t} committed after {before}");
                }
                assert!(committed.iter().any(|&(_, t)| t == 24));
                assert_eq!(value(&pool, &key).await, 24);
                assert_eq!(stored_token(&pool, &key).await, Some(24));
            }

            #[distributed_lock(key = "{key}", backend = $backend)]
            async fn pay(
                pool: &sqlx::Pool<$db>,
                key: &str,
                val: i64,
            ) -> Result<FencingToken, LockError> {
                let mut tx = pool.begin().await.expect("begin");
                fence::check_current(&mut tx, key).await?;
                write(&mut tx, key, val).await;
                tx.commit().await.expect("commit");
                Ok(dlock_runtime::current().unwrap().fencing_token().unwrap())
            }

            /// Inside the attribute, `check_current` fences with the held
            /// lock's token.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn check_current_inside_the_attribute_uses_the_held_token() {
                registry().await;
                let pool = setup().await;
                let key = unique_key(concat!("fence-attr-", $backend));
                insert(&pool, &key).await;
                let first = pay(&pool, &key, 7).await.expect("first pay");
                assert_eq!(stored_token(&pool, &key).await, Some(first.get() as i64));
                let second = pay(&pool, &key, 8).await.expect("second pay");
                assert!(second > first);
                assert_eq!(stored_token(&pool, &key).await, Some(second.get() as i64));
                assert_eq!(value(&pool, &key).await, 8);
            }

            /// Outside a held lock there is no token: a configuration error,
            /// and nothing is stored.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn check_current_outside_a_lock_is_an_error() {
                let pool = setup().await;
                let key = unique_key(concat!("fence-outside-", $backend));
                let mut tx = pool.begin().await.unwrap();
                let err = fence::check_current(&mut tx, &key).await.unwrap_err();
                assert!(matches!(err, LockError::Config { .. }), "{err:?}");
                assert!(err.to_string().contains("outside a held lock"), "{err}");
                drop(tx);
                assert_eq!(stored_token(&pool, &key).await, None);
            }

            /// The column form: `UPDATE … WHERE fence <= token`; zero rows
            /// for a stale token, one for an equal or larger one.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_column_form_refuses_a_stale_token() {
                let pool = setup().await;
                let key = unique_key(concat!("fence-column-", $backend));
                insert(&pool, &key).await;
                let update = |val: i64, token: i64| {
                    let pool = pool.clone();
                    let key = key.clone();
                    async move {
                        sqlx::query(sqlx::AssertSqlSafe($sql(
                            "UPDATE fence_test_data SET val = ?, fence = ? \
                             WHERE id = ? AND fence <= ?",
                        )))
                        .bind(val)
                        .bind(token)
                        .bind(&key)
                        .bind(token)
                        .execute(&pool)
                        .await
                        .unwrap()
                        .rows_affected()
                    }
                };
                assert_eq!(update(1, 10).await, 1, "larger token");
                assert_eq!(update(2, 5).await, 0, "stale token");
                assert_eq!(value(&pool, &key).await, 1);
                assert_eq!(update(1, 10).await, 1, "equal token, same value");
                assert_eq!(update(3, 11).await, 1);
                assert_eq!(value(&pool, &key).await, 3);
            }

            /// `collect` deletes rows not checked for the retention, and only
            /// those; a deleted fence lets the next check through.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn collect_deletes_only_rows_older_than_the_retention() {
                let pool = setup().await;
                let old = unique_key(concat!("fence-old-", $backend));
                let fresh = unique_key(concat!("fence-fresh-", $backend));
                for resource in [&old, &fresh] {
                    let mut tx = pool.begin().await.unwrap();
                    fence::check(&mut tx, resource, FencingToken::new(100))
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                }
                sqlx::query(sqlx::AssertSqlSafe($sql($age)))
                    .bind(&old)
                    .execute(&pool)
                    .await
                    .unwrap();
                let deleted = fence::collect(&pool, fence::DEFAULT_RETENTION)
                    .await
                    .unwrap();
                assert!(deleted >= 1);
                assert_eq!(stored_token(&pool, &old).await, None);
                assert_eq!(stored_token(&pool, &fresh).await, Some(100));
                let mut tx = pool.begin().await.unwrap();
                fence::check(&mut tx, &old, FencingToken::new(1))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                let refused = fence::check(&mut tx, &fresh, FencingToken::new(1)).await;
                assert_fenced(refused, &fresh, 1, 100);
            }

            /// With creation off, a check never runs DDL; the table's absence
            /// would be a `Config` error, its presence passes.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_fence_without_creation_checks_the_existing_table() {
                let pool = setup().await;
                let key = unique_key(concat!("fence-nocreate-", $backend));
                fence::create_table(&pool).await.unwrap();
                let fence = Fence::new().create_table(false);
                let mut tx = pool.begin().await.unwrap();
                fence
                    .check(&mut tx, &key, FencingToken::new(5))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                assert_fenced(
                    fence.check(&mut tx, &key, FencingToken::new(4)).await,
                    &key,
                    4,
                    5,
                );
            }
        }
    };
}

fence_suite!(
    sqlite,
    sqlx::Sqlite,
    sqlite_pool,
    same,
    "sqlite",
    "UPDATE dlock_fences SET updated_at = updated_at - 2 * 86400000 WHERE resource = ?"
);
fence_suite!(
    postgres,
    sqlx::Postgres,
    postgres_pool,
    numbered,
    "postgres",
    "UPDATE dlock_fences SET updated_at = now() - interval '2 days' WHERE resource = ?"
);
fence_suite!(
    mysql,
    sqlx::MySql,
    mysql_pool,
    same,
    "mysql",
    "UPDATE dlock_fences SET updated_at = UTC_TIMESTAMP(6) - INTERVAL 2 DAY WHERE resource = ?"
);

/// On a database without the table, the first check creates it inside the
/// caller's transaction: a rollback takes it away again, and the next check
/// creates it again. (A check may first answer a retryable error if this
/// process already saw the table on another SQLite database.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_is_created_by_the_first_check_and_goes_with_its_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/fresh.db?mode=rwc", dir.path().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let exists = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE name = 'dlock_fences')",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    async fn check_once(pool: &sqlx::SqlitePool) -> sqlx::Transaction<'static, sqlx::Sqlite> {
        for _ in 0..2 {
            let mut tx = pool.begin().await.unwrap();
            match fence::check(&mut tx, "r", FencingToken::new(1)).await {
                Ok(()) => return tx,
                Err(e) if e.is_retryable() => continue,
                Err(e) => panic!("{e}"),
            }
        }
        panic!("the table was not created by the second check");
    }
    assert!(!exists().await);
    drop(check_once(&pool).await);
    assert!(!exists().await, "the rollback took the table away");
    check_once(&pool).await.commit().await.unwrap();
    assert!(exists().await);
}
