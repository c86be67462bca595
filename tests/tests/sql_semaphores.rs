//! Semaphores and read-write locks on the lease tables of PostgreSQL and
//! MySQL/MariaDB: slots, per-slot tokens, mismatched modes, writer
//! preference, renewal and release by slot, admin views, concurrency across
//! processes, old tables altered, `?create=false`, collection of holder rows.
#![cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, Renewal};
use dlock_runtime::{HoldMode, LockBackend, LockError, Registry};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use dlock_tests::sql_db::SqlDb;
use dlock_tests::unique_key;

const LEASE: Duration = Duration::from_secs(10);

/// A database under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Db {
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "mysql")]
    Mysql,
    #[cfg(feature = "sqlite")]
    Sqlite,
}

fn dbs() -> Vec<Db> {
    vec![
        #[cfg(feature = "postgres")]
        Db::Postgres,
        #[cfg(feature = "mysql")]
        Db::Mysql,
        #[cfg(feature = "sqlite")]
        Db::Sqlite,
    ]
}

impl Db {
    /// The URL of `table` (a database file of that name on SQLite), with
    /// `options` (`&a=b…`).
    fn url(self, table: &str, options: &str) -> String {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres => format!("{}?table={table}{options}", SqlDb::Postgres.url()),
            #[cfg(feature = "mysql")]
            Db::Mysql => format!("{}?table={table}{options}", SqlDb::Mysql.url()),
            #[cfg(feature = "sqlite")]
            Db::Sqlite => format!(
                "sqlite://{}?{}",
                sqlite_path(table).display(),
                options.trim_start_matches('&')
            ),
        }
    }

    fn names_tables(self) -> bool {
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite => false,
            #[allow(unreachable_patterns)]
            _ => true,
        }
    }
}

#[cfg(feature = "sqlite")]
fn sqlite_path(table: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("dlock-{table}.db"))
}

/// A backend of `db` on a table of the test's own, and that table's name.
async fn own_table(db: Db, name: &str, options: &str) -> (Arc<dyn LockBackend>, String) {
    let table = format!("sem_{name}_{:08x}", rand::random::<u32>());
    (
        backend_at(db, &db.url(&table, options)).await.unwrap(),
        table,
    )
}

async fn backend_at(db: Db, url: &str) -> Result<Arc<dyn LockBackend>, LockError> {
    Ok(match db {
        #[cfg(feature = "postgres")]
        Db::Postgres => Arc::new(dlock_runtime::PostgresBackend::connect(url).await?),
        #[cfg(feature = "mysql")]
        Db::Mysql => Arc::new(dlock_runtime::MysqlBackend::connect(url).await?),
        #[cfg(feature = "sqlite")]
        Db::Sqlite => Arc::new(dlock_runtime::SqliteBackend::connect(url).await?),
    })
}

/// Runs `sql` on `db` directly (`table`'s file on SQLite).
async fn run_sql(db: Db, table: &str, sql: &str) {
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres => {
            let pool = sqlx::PgPool::connect(&SqlDb::Postgres.url()).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&pool)
                .await
                .unwrap();
        }
        #[cfg(feature = "mysql")]
        Db::Mysql => {
            let pool = sqlx::MySqlPool::connect(&SqlDb::Mysql.url()).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&pool)
                .await
                .unwrap();
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite => {
            let url = format!("sqlite://{}", sqlite_path(table).display());
            let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&pool)
                .await
                .unwrap();
        }
    }
    let _ = table;
}

/// Counts `sql`'s rows on `db`.
async fn count(db: Db, table: &str, sql: &str) -> i64 {
    let _ = table;
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres => {
            let pool = sqlx::PgPool::connect(&SqlDb::Postgres.url()).await.unwrap();
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
        #[cfg(feature = "mysql")]
        Db::Mysql => {
            let pool = sqlx::MySqlPool::connect(&SqlDb::Mysql.url()).await.unwrap();
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite => {
            let url = format!("sqlite://{}", sqlite_path(table).display());
            let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    }
}

/// The lease table's name in SQL (always `dlock_leases` on SQLite).
fn sql_name(db: Db, table: &str) -> String {
    if db.names_tables() {
        table.to_owned()
    } else {
        "dlock_leases".to_owned()
    }
}

async fn drop_tables(db: Db, table: &str) {
    if !db.names_tables() {
        #[cfg(feature = "sqlite")]
        for suffix in ["", "-wal", "-shm"] {
            let mut path = sqlite_path(table).into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
        return;
    }
    run_sql(
        db,
        table,
        &format!("DROP TABLE IF EXISTS {table}; DROP TABLE IF EXISTS {table}_holders"),
    )
    .await;
}

fn permits(n: u32) -> HoldMode {
    HoldMode::Permit { permits: n }
}

async fn attempt(b: &Arc<dyn LockBackend>, key: &str, owner: &str, mode: HoldMode) -> Attempt {
    b.try_acquire(&AcquireRequest::new(key, owner, LEASE).with_mode(mode))
        .await
        .unwrap()
}

async fn held(b: &Arc<dyn LockBackend>, key: &str, owner: &str, mode: HoldMode) -> Lease {
    match attempt(b, key, owner, mode).await {
        Attempt::Held(lease) => lease,
        other => panic!("{owner} in {mode:?}: {other:?}"),
    }
}

async fn is_busy(b: &Arc<dyn LockBackend>, key: &str, owner: &str, mode: HoldMode) -> bool {
    matches!(attempt(b, key, owner, mode).await, Attempt::Busy { .. })
}

async fn is_mismatch(b: &Arc<dyn LockBackend>, key: &str, owner: &str, mode: HoldMode) -> bool {
    let asked = b
        .try_acquire(&AcquireRequest::new(key, owner, LEASE).with_mode(mode))
        .await;
    matches!(asked, Err(e) if e.to_string().contains("every holder"))
}

fn token(lease: &Lease) -> u64 {
    lease.token.unwrap().get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_take_the_lowest_free_slot_with_tokens_rising_per_slot() {
    for db in dbs() {
        let (b, table) = own_table(db, "slots", "").await;
        let key = unique_key("sem-slots");
        let a = held(&b, &key, "a", permits(3)).await;
        let bb = held(&b, &key, "b", permits(3)).await;
        let c = held(&b, &key, "c", permits(3)).await;
        assert_eq!(
            (a.slot, bb.slot, c.slot),
            (Some(0), Some(1), Some(2)),
            "{db:?}"
        );
        assert!(
            is_busy(&b, &key, "d", permits(3)).await,
            "{db:?}: a 4th permit"
        );
        b.release(&bb).await.unwrap();
        let d = held(&b, &key, "d", permits(3)).await;
        assert_eq!(d.slot, Some(1), "{db:?}");
        assert!(token(&d) > token(&bb), "{db:?}: slot 1's token rises");
        // The runtime's undo (no slot) frees whatever permit the owner holds.
        let mut undo = Lease::new(&AcquireRequest::new(&key, "c", LEASE), None);
        undo.mode = permits(3);
        b.release(&undo).await.unwrap();
        let e = held(&b, &key, "e", permits(3)).await;
        assert_eq!(e.slot, Some(2), "{db:?}");
        for lease in [&a, &d, &e] {
            b.release(lease).await.unwrap();
        }
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_kind_of_lock_on_a_held_key_is_a_mismatch_until_it_is_free() {
    for db in dbs() {
        let (b, table) = own_table(db, "mismatch", "").await;
        let key = unique_key("sem-mismatch");
        let a = held(&b, &key, "a", permits(3)).await;
        assert!(is_mismatch(&b, &key, "x", permits(4)).await, "{db:?}: N");
        assert!(
            is_mismatch(&b, &key, "x", HoldMode::Exclusive).await,
            "{db:?}: plain"
        );
        assert!(
            is_mismatch(&b, &key, "x", HoldMode::Shared).await,
            "{db:?}: reader"
        );
        b.release(&a).await.unwrap();
        let r = held(&b, &key, "r", HoldMode::Shared).await;
        assert!(
            is_mismatch(&b, &key, "x", permits(2)).await,
            "{db:?}: permit on readers"
        );
        b.release(&r).await.unwrap();
        let w = held(&b, &key, "w", HoldMode::Exclusive).await;
        assert!(
            is_mismatch(&b, &key, "x", permits(2)).await,
            "{db:?}: permit on a lock"
        );
        assert!(
            is_busy(&b, &key, "x", HoldMode::Shared).await,
            "{db:?}: reader on a lock"
        );
        b.release(&w).await.unwrap();
        let p = held(&b, &key, "p", permits(4)).await;
        b.release(&p).await.unwrap();
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_holds_new_readers_back_and_tokens_share_one_sequence() {
    for db in dbs() {
        let (b, table) = own_table(db, "rw", "").await;
        let key = unique_key("rw-writer-preferred");
        let r1 = held(&b, &key, "r1", HoldMode::Shared).await;
        let r2 = held(&b, &key, "r2", HoldMode::Shared).await;
        assert!(token(&r2) > token(&r1), "{db:?}");
        let writer = AcquireRequest::new(&key, "w", LEASE).with_wait(Duration::from_secs(5));
        assert!(
            matches!(b.try_acquire(&writer).await.unwrap(), Attempt::Busy { .. }),
            "{db:?}: a writer beside readers"
        );
        assert!(
            is_busy(&b, &key, "r3", HoldMode::Shared).await,
            "{db:?}: behind the writer"
        );
        b.release(&r1).await.unwrap();
        b.release(&r2).await.unwrap();
        let Attempt::Held(w) = b.try_acquire(&writer).await.unwrap() else {
            panic!("{db:?}: the writer after the readers left");
        };
        assert!(token(&w) > token(&r2), "{db:?}");
        b.release(&w).await.unwrap();
        // The grant voided the mark: readers enter again.
        let r3 = held(&b, &key, "r3", HoldMode::Shared).await;
        assert!(token(&r3) > token(&w), "{db:?}");
        // A writer that gives up leaves no mark.
        assert!(matches!(
            b.try_acquire(&writer).await.unwrap(),
            Attempt::Busy { .. }
        ));
        b.abandon(&writer).await;
        let r4 = held(&b, &key, "r4", HoldMode::Shared).await;
        for lease in [&r3, &r4] {
            b.release(lease).await.unwrap();
        }
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_renew_by_owner_and_slot_and_revoked_ones_say_so() {
    for db in dbs() {
        let (b, table) = own_table(db, "renew", "").await;
        let key = unique_key("sem-renew");
        let a = held(&b, &key, "a", permits(2)).await;
        let r_key = unique_key("rw-renew");
        let r = held(&b, &r_key, "r", HoldMode::Shared).await;
        let mut stranger = Lease::new(&AcquireRequest::new(&key, "a", LEASE), None);
        stranger.mode = permits(2);
        stranger.slot = Some(1);
        let batch = [(&a, LEASE), (&r, LEASE), (&stranger, LEASE)];
        let answers: Vec<Renewal> = b
            .renew_all(&batch)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            answers,
            vec![Renewal::Renewed, Renewal::Renewed, Renewal::Lost],
            "{db:?}"
        );
        let entry = b.inspect(&key).await.unwrap().unwrap();
        assert_eq!(entry.holders.len(), 1);
        assert_eq!(entry.holders[0].slot, Some(0));
        assert_eq!(entry.holders[0].mode, permits(2));
        let removed = b.revoke(&key).await.unwrap();
        assert_eq!(removed.len(), 1, "{db:?}");
        assert_eq!(
            b.renew(&a, LEASE).await.unwrap(),
            Renewal::Revoked,
            "{db:?}"
        );
        let next = held(&b, &key, "n", permits(2)).await;
        assert!(token(&next) > token(&a), "{db:?}");
        let listed = b.list(&r_key, 10).await.unwrap();
        assert_eq!(listed.len(), 1, "{db:?}");
        assert_eq!(listed[0].holders[0].mode, HoldMode::Shared);
        b.release(&next).await.unwrap();
        b.release(&r).await.unwrap();
        assert!(b.inspect(&key).await.unwrap().is_none(), "{db:?}");
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_of_six_tasks_never_exceed_the_permits() {
    for db in dbs() {
        let table = format!("sem_crowd_{:08x}", rand::random::<u32>());
        let key = unique_key("sem-crowd");
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let backend = backend_at(db, &db.url(&table, "")).await.unwrap();
            let registry = Registry::builder().default_backend(backend).build();
            for _ in 0..6 {
                let (registry, key) = (registry.clone(), key.clone());
                let (inside, most) = (inside.clone(), most.clone());
                tasks.push(tokio::spawn(async move {
                    for _ in 0..3 {
                        let guard = registry
                            .lock(&key)
                            .permits(3)
                            .wait(Duration::from_secs(60))
                            .acquire()
                            .await
                            .unwrap();
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                        guard.release().await.unwrap();
                    }
                }));
            }
        }
        for task in tasks {
            task.await.unwrap();
        }
        let most = most.load(Ordering::SeqCst);
        assert!((1..=3).contains(&most), "{db:?}: {most} holders at once");
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_lease_table_gains_the_new_columns_at_connect() {
    for db in dbs().into_iter().filter(|db| db.names_tables()) {
        let table = format!("sem_old_{:08x}", rand::random::<u32>());
        let old = match db {
            #[cfg(feature = "postgres")]
            Db::Postgres => format!(
                "CREATE TABLE {table} (key text COLLATE \"C\" PRIMARY KEY, owner text, \
                 token bigint NOT NULL, expires_at timestamptz NOT NULL, \
                 wanted boolean NOT NULL DEFAULT false)"
            ),
            #[cfg(feature = "mysql")]
            Db::Mysql => format!(
                "CREATE TABLE {table} (k VARBINARY(1024) NOT NULL PRIMARY KEY, \
                 owner VARBINARY(255), token BIGINT UNSIGNED NOT NULL, \
                 expires_us BIGINT NOT NULL) ENGINE = InnoDB"
            ),
            #[allow(unreachable_patterns)]
            _ => unreachable!(),
        };
        run_sql(db, &table, &old).await;
        let b = backend_at(db, &db.url(&table, "")).await.unwrap();
        let key = unique_key("sem-old-table");
        let plain = held(&b, &key, "p", HoldMode::Exclusive).await;
        b.release(&plain).await.unwrap();
        let a = held(&b, &key, "a", permits(2)).await;
        assert!(
            is_mismatch(&b, &key, "p", HoldMode::Exclusive).await,
            "{db:?}"
        );
        b.release(&a).await.unwrap();
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_create_a_missing_holder_table_names_the_ddl() {
    for db in dbs().into_iter().filter(|db| db.names_tables()) {
        let (b, table) = own_table(db, "nocreate", "").await;
        drop(b);
        run_sql(db, &table, &format!("DROP TABLE {table}_holders")).await;
        let url = db.url(&table, "&create=false");
        let Err(err) = backend_at(db, &url).await else {
            panic!("{db:?}: connected without the holder table");
        };
        let text = err.to_string();
        assert!(matches!(err, LockError::Config { .. }), "{db:?}: {text}");
        assert!(text.contains("_holders") && text.contains("DDL"), "{text}");
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_rows_of_freed_names_are_collected_after_the_retention() {
    for db in dbs() {
        let (b, table) = own_table(db, "collect", "&retention=1ms").await;
        for i in 0..200 {
            let key = format!("{}-{i}", unique_key("sem-collect"));
            let mode = if i % 2 == 0 {
                permits(3)
            } else {
                HoldMode::Shared
            };
            let lease = held(&b, &key, "o", mode).await;
            b.release(&lease).await.unwrap();
        }
        // With a retention of 1 ms every release collects, in the
        // background: the rows of all but the last names go.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let last = held(&b, &unique_key("sem-collect-last"), "o", permits(3)).await;
        b.release(&last).await.unwrap();
        let mut left = (i64::MAX, i64::MAX);
        for _ in 0..100 {
            let name = sql_name(db, &table);
            left = (
                count(db, &table, &format!("SELECT COUNT(*) FROM {name}_holders")).await,
                count(db, &table, &format!("SELECT COUNT(*) FROM {name}")).await,
            );
            if left.0 <= 1 && left.1 <= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(left.0 <= 1 && left.1 <= 1, "{db:?}: rows left {left:?}");
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_offers_semaphores_and_read_locks_on_postgres_only() {
    for db in dbs().into_iter().filter(|db| db.names_tables()) {
        let table = format!("sem_session_{:08x}", rand::random::<u32>());
        let b = backend_at(db, &db.url(&table, "&mode=session"))
            .await
            .unwrap();
        assert!(b.offers(HoldMode::Exclusive).is_ok(), "{db:?}");
        assert!(b.offers(permits(3)).is_ok(), "{db:?}: semaphores");
        let read = b.offers(HoldMode::Shared);
        #[cfg(feature = "postgres")]
        let postgres = matches!(db, Db::Postgres);
        #[cfg(not(feature = "postgres"))]
        let postgres = false;
        if postgres {
            assert!(read.is_ok(), "PostgreSQL's session mode offers read locks");
        } else {
            let Err(why) = read else {
                panic!("{db:?}: session mode offered read locks");
            };
            assert!(
                why.contains("session mode") && why.contains("lease mode"),
                "{why}"
            );
        }
        let lease = backend_at(db, &db.url(&table, "")).await.unwrap();
        assert!(lease.offers(HoldMode::Shared).is_ok(), "{db:?}");
        assert!(lease.offers(permits(3)).is_ok(), "{db:?}");
        run_sql(
            db,
            &table,
            &format!(
                "DROP TABLE IF EXISTS {table}_fence; DROP TABLE IF EXISTS {table}; \
                 DROP TABLE IF EXISTS {table}_holders"
            ),
        )
        .await;
    }
}

/// PostgreSQL reads a key's holder rows in the statement that locks the
/// key's row, in a snapshot taken before it waits for that lock: a permit
/// granted while an attempt waits must still count for it.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_granted_while_an_attempt_waits_for_the_key_row_counts() {
    let db = Db::Postgres;
    let (b, table) = own_table(db, "lockwait", "").await;
    let key = unique_key("sem-lockwait");
    // The key's row and its slot row exist, both free.
    let first = held(&b, &key, "first", permits(1)).await;
    b.release(&first).await.unwrap();
    let pool = sqlx::PgPool::connect(&SqlDb::Postgres.url()).await.unwrap();
    let mut grant = pool.begin().await.unwrap();
    let locked = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT key FROM {table} WHERE key = $1 FOR UPDATE"
    )))
    .bind(&key)
    .fetch_all(&mut *grant)
    .await
    .unwrap();
    assert_eq!(locked.len(), 1, "the key's row is stored under its name");
    let waiting = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { attempt(&b, &key, "second", permits(1)).await })
    };
    let waits = format!(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%FOR UPDATE%' AND query LIKE '%{table}%'"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while count(db, &table, &waits).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the attempt never waited for the key's row"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Another process's grant, as dlock writes one: the slot row and the
    // key's row, in the transaction that holds the key's row.
    for sql in [
        format!(
            "UPDATE {table}_holders SET owner = 'third', token = token + 1, \
             expires_at = clock_timestamp() + interval '60 seconds' WHERE key = $1 AND slot = 0"
        ),
        format!(
            "UPDATE {table} SET shared_until = clock_timestamp() + interval '60 seconds' \
             WHERE key = $1"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&key)
            .execute(&mut *grant)
            .await
            .unwrap();
    }
    grant.commit().await.unwrap();
    let answer = waiting.await.unwrap();
    assert!(
        matches!(answer, Attempt::Busy { .. }),
        "a second holder of 1 permit: {answer:?}"
    );
    drop_tables(db, &table).await;
}
