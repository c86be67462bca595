//! The fencing kit at its edges: which token `check_current` and
//! `set_current` fence a resource with when the task holds more than one
//! lock, MySQL's `LAST_INSERT_ID` report after earlier statements of the same
//! transaction, PostgreSQL's snapshot isolation levels and first-use table
//! creation under concurrency, byte-exact names on MySQL, tokens that do not
//! fit the SQL column, and Redis writes to a key of the wrong type.
#![cfg(all(feature = "sqlite", feature = "mysql", feature = "redis"))]

use std::time::Duration;

use dlock_runtime::fence::{self, Fence};
use dlock_runtime::{FencingToken, LockError, Registry};
use dlock_tests::sql_db::SqlDb;
use dlock_tests::{server_url, servers_missing, unique_key};
use tokio::sync::OnceCell;

/// The SQLite file every test of this process shares (locks, fences, data).
fn sqlite_path() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
        .join("edges.db")
        .leak()
}

async fn sqlite_pool() -> sqlx::SqlitePool {
    use std::str::FromStr;
    static POOL: OnceCell<sqlx::SqlitePool> = OnceCell::const_new();
    POOL.get_or_init(|| async {
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(&format!(
            "sqlite://{}",
            sqlite_path().display()
        ))
        .expect("sqlite url")
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .expect("sqlite pool");
        fence::create_table(&pool).await.expect("fence table");
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS edge_data (id TEXT PRIMARY KEY, val INTEGER NOT NULL)",
        )
        .execute(&pool)
        .await
        .expect("data table");
        pool
    })
    .await
    .clone()
}

/// A registry with the SQLite lock backend `sqlite`, on the same file as the
/// data it protects.
async fn sqlite_registry() -> Registry {
    static REGISTRY: OnceCell<Registry> = OnceCell::const_new();
    REGISTRY
        .get_or_init(|| async {
            sqlite_pool().await;
            let url = format!("sqlite://{}", sqlite_path().display());
            Registry::builder()
                .backend(
                    "sqlite",
                    dlock_runtime::SqliteBackend::connect(&url)
                        .await
                        .expect("sqlite backend"),
                )
                .build()
        })
        .await
        .clone()
}

async fn sqlite_stored_token(pool: &sqlx::SqlitePool, resource: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT token FROM dlock_fences WHERE resource = ?1")
        .bind(resource)
        .fetch_optional(pool)
        .await
        .unwrap()
}

async fn sqlite_value(pool: &sqlx::SqlitePool, id: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT val FROM edge_data WHERE id = ?1")
        .bind(id)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// `check_current(resource)` then a write of `val` to `resource`, committed
/// only when the check passed.
async fn sqlite_fenced_write(
    pool: &sqlx::SqlitePool,
    resource: &str,
    val: i64,
) -> Result<(), LockError> {
    let mut tx = pool.begin().await.unwrap();
    fence::check_current(&mut tx, resource).await?;
    sqlx::query(
        "INSERT INTO edge_data (id, val) VALUES (?1, ?2) \
         ON CONFLICT (id) DO UPDATE SET val = excluded.val",
    )
    .bind(resource)
    .bind(val)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    Ok(())
}

/// A holder whose lease of `resource` ran out takes another lock inside its
/// scope (an audit lock, a per-tenant lock) after a newer holder of
/// `resource` wrote; its late write to `resource` through `check_current`
/// must still be refused: the token that fences `resource` is the one of
/// `resource`'s lock, not of whatever lock is innermost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_current_in_a_nested_scope_refuses_a_stale_holder_of_the_outer_lock() {
    let pool = sqlite_pool().await;
    let registry = sqlite_registry().await;
    let resource = unique_key("edge-nested");
    let audit = unique_key("edge-nested-audit");

    let a = registry
        .lock(&*resource)
        .backend("sqlite")
        .lease(Duration::from_secs(1))
        .watchdog(false)
        .acquire()
        .await
        .expect("A acquires");
    let b = registry
        .lock(&*resource)
        .backend("sqlite")
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("B acquires after A's lease ran out");
    let (ta, tb) = (a.fencing_token().unwrap(), b.fencing_token().unwrap());
    assert!(tb > ta);
    b.scope(sqlite_fenced_write(&pool, &resource, 2))
        .await
        .expect("B writes");

    let late = a
        .scope(async {
            let inner = registry
                .lock(&*audit)
                .backend("sqlite")
                .acquire()
                .await
                .expect("A takes an unrelated lock");
            let written = inner.scope(sqlite_fenced_write(&pool, &resource, 1)).await;
            inner.release().await.unwrap();
            written
        })
        .await;
    assert_eq!(
        sqlite_value(&pool, &resource).await,
        Some(2),
        "A's stale write committed over B's (check_current answered {late:?})"
    );
    // Refused: `Lost` (A's lease is known to have run out) or `Fenced`.
    assert!(
        matches!(late, Err(LockError::Lost { .. } | LockError::Fenced { .. })),
        "A's stale write through check_current: {late:?}"
    );
    b.release().await.unwrap();
    let _ = a.release().await;
}

/// Under a hold of several keys, `check_current(resource)` fences `resource`
/// with the token of `resource`'s own key (tokens of two keys are not
/// comparable), not with the first key's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_current_under_several_keys_fences_with_the_resources_own_token() {
    let pool = sqlite_pool().await;
    let registry = sqlite_registry().await;
    let first = unique_key("edge-all-a");
    let second = unique_key("edge-all-b");

    // Tokens are per key, but a hold taken in one step draws both from one
    // clock reading: put `second`'s row ahead of the clock (an earlier grant
    // of it, its token moved forward) so that the two tokens differ.
    registry
        .lock(&second)
        .backend("sqlite")
        .acquire()
        .await
        .expect("second alone")
        .release()
        .await
        .unwrap();
    sqlx::query("UPDATE dlock_leases SET token = token + 1000000000 WHERE key = ?1")
        .bind(format!("{}{second}", registry.key_prefix()))
        .execute(&pool)
        .await
        .expect("move the token forward");
    let hold = registry
        .lock_all([first.clone(), second.clone()])
        .backend("sqlite")
        .acquire()
        .await
        .expect("both keys");
    assert_eq!(hold.keys(), [first.clone(), second.clone()]);
    let own = hold.fencing_token_of(&second).expect("second's token");
    assert_ne!(
        hold.fencing_token(),
        Some(own),
        "the two keys' tokens differ"
    );

    hold.scope(sqlite_fenced_write(&pool, &second, 1))
        .await
        .expect("the holder of both keys writes");
    assert_eq!(
        sqlite_stored_token(&pool, &second).await,
        Some(own.get() as i64),
        "the fence of `{second}` holds the token of key `{first}` ({:?}), not its own ({own})",
        hold.fencing_token()
    );
    hold.release().await.unwrap();
}

async fn mysql_pool() -> sqlx::MySqlPool {
    let url = SqlDb::Mysql.url();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    fence::create_table(&pool).await.expect("fence table");
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS edge_autoinc \
         (id BIGINT AUTO_INCREMENT PRIMARY KEY, note VARCHAR(64) NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("auto-increment table");
    pool
}

/// On MySQL/MariaDB the check reads its verdict from `LAST_INSERT_ID`: an
/// insert into an AUTO_INCREMENT table, or an explicit
/// `LAST_INSERT_ID(expr)`, earlier in the same transaction must not turn a
/// passing check into a refusal (nor a refusal into a pass).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_check_ignores_earlier_insert_ids_of_its_transaction() {
    let pool = mysql_pool().await;
    let resource = unique_key("edge-insert-id");

    let mut tx = pool.begin().await.unwrap();
    let inserted = sqlx::query("INSERT INTO edge_autoinc (note) VALUES ('before the check')")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(inserted.last_insert_id() > 0);
    fence::check(&mut tx, &resource, FencingToken::new(10))
        .await
        .expect("a new resource passes after an auto-increment insert");
    sqlx::query("SELECT LAST_INSERT_ID(999)")
        .execute(&mut *tx)
        .await
        .unwrap();
    fence::check(&mut tx, &resource, FencingToken::new(11))
        .await
        .expect("a larger token passes after LAST_INSERT_ID(999)");
    sqlx::query("INSERT INTO edge_autoinc (note) VALUES ('between checks')")
        .execute(&mut *tx)
        .await
        .unwrap();
    fence::check(&mut tx, &resource, FencingToken::new(11))
        .await
        .expect("an equal token passes after another insert");
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO edge_autoinc (note) VALUES ('before a stale check')")
        .execute(&mut *tx)
        .await
        .unwrap();
    match fence::check(&mut tx, &resource, FencingToken::new(5)).await {
        Err(LockError::Fenced { token, seen, .. }) => {
            assert_eq!(token, FencingToken::new(5));
            assert_eq!(seen, Some(FencingToken::new(11)));
        }
        other => panic!("a smaller token after an insert: {other:?}"),
    }
    drop(tx);
}

async fn postgres_pool() -> sqlx::PgPool {
    let url = SqlDb::Postgres.url();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// A token above `i64::MAX` does not fit the BIGINT column: the check refuses
/// it as a configuration error on every database, and stores nothing
/// (neither wrapped to a negative token nor truncated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_above_the_signed_column_is_refused_not_wrapped() {
    let huge = FencingToken::new(i64::MAX as u64 + 1);
    let resource = unique_key("edge-huge");

    let pg = postgres_pool().await;
    // The table exists whatever ran before (a refused check creates nothing).
    fence::create_table(&pg).await.expect("fence table");
    let mut tx = pg.begin().await.unwrap();
    let checked = Fence::new().check(&mut tx, &resource, huge).await;
    assert!(
        matches!(checked, Err(LockError::Config { .. })),
        "{checked:?}"
    );
    drop(tx);
    let stored: Option<i64> =
        sqlx::query_scalar("SELECT token FROM dlock_fences WHERE resource = $1")
            .bind(&resource)
            .fetch_optional(&pg)
            .await
            .unwrap();
    assert_eq!(stored, None);

    let my = mysql_pool().await;
    fence::create_table(&my).await.expect("fence table");
    let mut tx = my.begin().await.unwrap();
    let checked = fence::check(&mut tx, &resource, huge).await;
    assert!(
        matches!(checked, Err(LockError::Config { .. })),
        "{checked:?}"
    );
    drop(tx);

    let lite = sqlite_pool().await;
    let mut tx = lite.begin().await.unwrap();
    let checked = fence::check(&mut tx, &resource, huge).await;
    assert!(
        matches!(checked, Err(LockError::Config { .. })),
        "{checked:?}"
    );
    drop(tx);
    assert_eq!(sqlite_stored_token(&lite, &resource).await, None);

    // The largest token that fits still passes, and is kept exactly.
    let mut tx = lite.begin().await.unwrap();
    fence::check(&mut tx, &resource, FencingToken::new(i64::MAX as u64))
        .await
        .expect("i64::MAX fits");
    tx.commit().await.unwrap();
    assert_eq!(sqlite_stored_token(&lite, &resource).await, Some(i64::MAX));
}

/// `hset` on a key that holds a string fails with a permanent (not
/// retryable) error, and neither the key nor its fence is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hset_on_a_key_of_another_type_fails_without_writing() {
    use redis::AsyncCommands;
    let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
    let mut conn = redis::Client::open(url.as_str())
        .unwrap_or_else(|e| servers_missing(&url, e))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let key = unique_key("edge-wrongtype");
    let _: () = conn.set_ex(&key, "plain", 60).await.unwrap();

    let written = fence::redis::hset(&mut conn, &key, "field", "v", FencingToken::new(7)).await;
    match &written {
        Err(e @ LockError::Backend { .. }) => assert!(!e.is_retryable(), "{e}"),
        other => panic!("hset on a string: {other:?}"),
    }
    let kept: String = conn.get(&key).await.unwrap();
    assert_eq!(kept, "plain");
    let fence_exists: bool = conn
        .exists(fence::redis::hash_fence_key(&key))
        .await
        .unwrap();
    assert!(!fence_exists, "no fence recorded for a failed write");
    let _: () = conn.del(&key).await.unwrap();
}

/// PostgreSQL at REPEATABLE READ and SERIALIZABLE: a checker with a smaller
/// token whose snapshot predates a larger token's commit never passes (it
/// is refused, or fails with a retryable serialization failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_snapshot_isolation_never_passes_a_smaller_token() {
    let pool = postgres_pool().await;
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let resource = unique_key(&format!("edge-pg-{}", level.replace(' ', "-")));
        let mut seed = pool.begin().await.unwrap();
        fence::check(&mut seed, &resource, FencingToken::new(1))
            .await
            .expect("seed");
        seed.commit().await.unwrap();

        let mut stale = pool.begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET TRANSACTION ISOLATION LEVEL {level}"
        )))
        .execute(&mut *stale)
        .await
        .unwrap();
        // Takes the snapshot before the newer holder commits.
        let before: i64 = sqlx::query_scalar("SELECT token FROM dlock_fences WHERE resource = $1")
            .bind(&resource)
            .fetch_one(&mut *stale)
            .await
            .unwrap();
        assert_eq!(before, 1);

        let mut newer = pool.begin().await.unwrap();
        fence::check(&mut newer, &resource, FencingToken::new(9))
            .await
            .expect("the newer holder passes");
        newer.commit().await.unwrap();

        match fence::check(&mut stale, &resource, FencingToken::new(5)).await {
            Err(LockError::Fenced { .. }) => {}
            Err(e) if e.is_retryable() => {}
            other => panic!("{level}: a stale token 5 after 9 committed: {other:?}"),
        }
        drop(stale);
    }
}

/// MySQL/MariaDB keep resource names as bytes: names that differ only in
/// case or trailing spaces are distinct resources, so a large token on one
/// does not refuse the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_names_differing_in_case_or_trailing_spaces_are_distinct() {
    let pool = mysql_pool().await;
    let base = unique_key("edge-names");
    let mut tx = pool.begin().await.unwrap();
    fence::check(&mut tx, &format!("{base} "), FencingToken::new(100))
        .await
        .unwrap();
    fence::check(&mut tx, &base.to_uppercase(), FencingToken::new(100))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    fence::check(&mut tx, &base, FencingToken::new(5))
        .await
        .expect("the name without the trailing space is its own resource");
    tx.commit().await.unwrap();
}

/// Many first users of the fence on a PostgreSQL schema without the table,
/// at once: each check passes or fails retryably, none fails for good (no
/// duplicate-creation error aborting a caller's transaction), and once
/// retried every one passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_first_users_racing_to_create_the_table_all_pass() {
    use std::str::FromStr;
    let admin = postgres_pool().await;
    let schema = format!("fence_edge_{:016x}", rand::random::<u64>());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let options = sqlx::postgres::PgConnectOptions::from_str(&SqlDb::Postgres.url())
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for t in 1..=16u64 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let mut tx = pool.begin().await.unwrap();
                match fence::check(&mut tx, &format!("r{}", t % 4), FencingToken::new(t)).await {
                    Ok(()) => {
                        tx.commit().await.unwrap();
                        return Ok(());
                    }
                    Err(LockError::Fenced { .. }) => return Ok(()),
                    Err(e) if e.is_retryable() => continue,
                    Err(e) => return Err(e.to_string()),
                }
            }
            Err("still failing after 5 tries".to_owned())
        }));
    }
    let mut failures = Vec::new();
    for task in tasks {
        if let Err(e) = task.await.unwrap() {
            failures.push(e);
        }
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM dlock_fences")
        .fetch_one(&pool)
        .await
        .unwrap_or(-1);
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(rows, 4);
}

/// The same nested scope on Redis: a stale holder of `key` that takes an
/// unrelated lock inside its scope writes `key` through `set_current`; the
/// write must be refused and the value stay the newer holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_set_current_in_a_nested_scope_refuses_a_stale_holder_of_the_outer_lock() {
    use redis::AsyncCommands;
    let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
    let registry = Registry::from_url(&url).await.expect("backend");
    let mut conn = redis::Client::open(url.as_str())
        .unwrap_or_else(|e| servers_missing(&url, e))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let key = unique_key("edge-redis-nested");
    let audit = unique_key("edge-redis-nested-audit");
    let a = registry
        .lock(&*key)
        .lease(Duration::from_secs(1))
        .watchdog(false)
        .acquire()
        .await
        .expect("A acquires");
    let b = registry
        .lock(&*key)
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .expect("B acquires after A's lease ran out");
    b.scope(fence::redis::set_current(&mut conn, &key, "B"))
        .await
        .expect("B writes");
    let late = a
        .scope(async {
            let inner = registry.lock(&*audit).acquire().await.expect("inner lock");
            let written = inner
                .scope(fence::redis::set_current(&mut conn.clone(), &key, "A"))
                .await;
            inner.release().await.unwrap();
            written
        })
        .await;
    let value: String = conn.get(&key).await.unwrap();
    let _: () = conn
        .del(&[&key, &fence::redis::fence_key(&key)])
        .await
        .unwrap();
    b.release().await.unwrap();
    let _ = a.release().await;
    assert_eq!(
        value, "B",
        "A's stale write replaced B's (set_current answered {late:?})"
    );
}

/// SQLite with two connections to one file (as two processes would have): a
/// deferred transaction that read before a larger token committed never
/// passes a smaller token (refused, or a retryable busy error), and its
/// write does not commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_reader_turned_checker_never_passes_a_smaller_token() {
    use std::str::FromStr;
    let shared = sqlite_pool().await;
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(&format!(
        "sqlite://{}",
        sqlite_path().display()
    ))
    .unwrap()
    .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
    .busy_timeout(Duration::from_secs(5));
    let other = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    let resource = unique_key("edge-sqlite-reader");

    let mut stale = shared.begin().await.unwrap();
    let before: Option<i64> = sqlx::query_scalar("SELECT val FROM edge_data WHERE id = ?1")
        .bind(&resource)
        .fetch_optional(&mut *stale)
        .await
        .unwrap();
    assert_eq!(before, None);

    let mut newer = other.begin().await.unwrap();
    fence::check(&mut newer, &resource, FencingToken::new(9))
        .await
        .expect("the newer holder passes");
    newer.commit().await.unwrap();

    match fence::check(&mut stale, &resource, FencingToken::new(5)).await {
        Err(LockError::Fenced { .. }) => {}
        Err(e) if e.is_retryable() => {}
        other => panic!("a stale token 5 after 9 committed: {other:?}"),
    }
    drop(stale);
    assert_eq!(sqlite_stored_token(&shared, &resource).await, Some(9));
    other.close().await;
}

/// Odd keys on Redis Cluster (unclosed, empty, nested and repeated braces,
/// non-ASCII, empty key): each fence is in the key's own slot as the server
/// computes it (`CLUSTER KEYSLOT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_of_odd_keys_are_in_their_keys_slot() {
    let url = server_url(
        "DLOCK_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
    );
    let first = url
        .trim_start_matches("redis+cluster://")
        .split(',')
        .next()
        .map(|n| format!("redis://{}", n.trim_end_matches('/')))
        .unwrap();
    let mut node = redis::Client::open(first.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(&first, e));
    let keys = [
        "", "x{", "}{", "{}{a}", "{{a}}", "a{}b}", "{a}{b}", "{ü}é", "é{", "{\u{0}}", "{ }", "{a",
        "a}b{c}",
    ];
    for key in keys {
        let mut slots = Vec::new();
        for k in [
            key.to_owned(),
            fence::redis::fence_key(key),
            fence::redis::hash_fence_key(key),
        ] {
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(k)
                .query_async(&mut node)
                .await
                .unwrap();
            slots.push(slot);
        }
        assert!(slots.iter().all(|&s| s == slots[0]), "{key:?}: {slots:?}");
    }
}

/// SQLite keeps names with a NUL byte whole: two names that differ only
/// after the NUL are two resources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_names_differing_after_a_nul_byte_are_distinct() {
    let pool = sqlite_pool().await;
    let base = unique_key("edge-nul");
    let mut tx = pool.begin().await.unwrap();
    fence::check(&mut tx, &format!("{base}\0a"), FencingToken::new(100))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    fence::check(&mut tx, &format!("{base}\0b"), FencingToken::new(5))
        .await
        .expect("another resource");
    tx.commit().await.unwrap();
    assert_eq!(
        sqlite_stored_token(&pool, &format!("{base}\0b")).await,
        Some(5)
    );
}
