//! Semaphores and read-write locks on the lease tables of PostgreSQL and
//! MySQL/MariaDB: slots, per-slot tokens, mismatched modes, writer
//! preference, renewal and release by slot, admin views, concurrency across
//! processes, old tables altered, `?create=false`, collection of holder rows;
//! the grant and the release of a share: `shared_until` against the live
//! shares, tokens across modes, waiting-writer marks, calls dropped at any
//! moment, waiters of another process woken by the release.
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

// Only the server databases name their lease tables.
#[cfg(any(feature = "postgres", feature = "mysql"))]
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
    waits_for_the_key_row(db, &table, "the attempt").await;
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

/// Returns once a statement on `table` waits for a row lock (`what`, in the
/// failure message, is the statement expected to).
#[cfg(feature = "postgres")]
async fn waits_for_the_key_row(db: Db, table: &str, what: &str) {
    let waits = format!(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%FOR UPDATE%' AND query LIKE '%{table}%'"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while count(db, table, &waits).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} never waited for the key's row"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_granted_while_a_release_waits_for_the_key_row_keeps_writers_out() {
    let db = Db::Postgres;
    let (b, table) = own_table(db, "relwait", "").await;
    let key = unique_key("rw-relwait");
    let first = held(&b, &key, "first", HoldMode::Shared).await;
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
    let releasing = {
        let b = b.clone();
        tokio::spawn(async move { b.release(&first).await })
    };
    waits_for_the_key_row(db, &table, "the release").await;
    // Another process's reader, granted as dlock grants one: its holder row
    // and the key's row, in the transaction that holds the key's row.
    for sql in [
        format!(
            "INSERT INTO {table}_holders (key, slot, permits, owner, token, expires_at) \
             VALUES ($1, 1, 0, 'second', 1, clock_timestamp() + interval '60 seconds')"
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
    releasing.await.unwrap().unwrap();
    assert!(
        !writer_gets_it(&b, &key, "writer").await,
        "a writer beside the reader granted while the release waited"
    );
    drop_tables(db, &table).await;
}

/// Whether a plain lock by `owner` is granted at once: it is then released.
async fn writer_gets_it(b: &Arc<dyn LockBackend>, key: &str, owner: &str) -> bool {
    match b.try_acquire(&AcquireRequest::new(key, owner, LEASE)).await {
        Ok(Attempt::Held(w)) => {
            b.release(&w).await.unwrap();
            true
        }
        _ => false,
    }
}

/// A lease of `owner` on `key` in `mode` at `slot`, as the runtime would
/// release it.
fn lease_of(key: &str, owner: &str, mode: HoldMode, slot: Option<u32>) -> Lease {
    let mut lease = Lease::new(&AcquireRequest::new(key, owner, LEASE), None);
    lease.mode = mode;
    lease.slot = slot;
    lease
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_gets_the_key_at_the_last_shares_release_and_not_before() {
    for db in dbs() {
        let (b, table) = own_table(db, "last", "").await;
        let key = unique_key("rw-last-share");
        let r1 = held(&b, &key, "r1", HoldMode::Shared).await;
        let r2 = held(&b, &key, "r2", HoldMode::Shared).await;
        b.release(&r1).await.unwrap();
        assert!(!writer_gets_it(&b, &key, "w").await, "{db:?}: r2 reads");
        // Releases that free nothing leave r2's share counted: another
        // owner's, and r2's own with a slot it does not hold.
        b.release(&lease_of(&key, "x", HoldMode::Shared, None))
            .await
            .unwrap();
        b.release(&lease_of(&key, "r2", permits(2), Some(5)))
            .await
            .unwrap();
        assert!(
            !writer_gets_it(&b, &key, "w").await,
            "{db:?}: r2 still reads"
        );
        assert_eq!(b.inspect(&key).await.unwrap().unwrap().holders.len(), 1);
        b.release(&r2).await.unwrap();
        assert!(writer_gets_it(&b, &key, "w").await, "{db:?}: the last left");

        let sem = unique_key("sem-last-permit");
        let p1 = held(&b, &sem, "p1", permits(2)).await;
        let p2 = held(&b, &sem, "p2", permits(2)).await;
        b.release(&lease_of(&sem, "p1", permits(2), Some(1)))
            .await
            .unwrap();
        b.release(&lease_of(&sem, "p2", permits(2), Some(0)))
            .await
            .unwrap();
        assert_eq!(
            b.inspect(&sem).await.unwrap().unwrap().holders.len(),
            2,
            "{db:?}: a release of another slot frees nothing"
        );
        b.release(&p1).await.unwrap();
        assert!(
            is_mismatch(&b, &sem, "w", HoldMode::Exclusive).await,
            "{db:?}: p2 holds a permit"
        );
        // The runtime's undo (no slot) frees the owner's permit.
        b.release(&lease_of(&sem, "p2", permits(2), None))
            .await
            .unwrap();
        assert!(
            writer_gets_it(&b, &sem, "w").await,
            "{db:?}: no permit left"
        );
        b.release(&p2).await.unwrap();
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_rise_across_readers_writers_permits_and_re_entries() {
    for db in dbs() {
        let (b, table) = own_table(db, "seq", "").await;
        let key = unique_key("rw-seq");
        let r1 = held(&b, &key, "r1", HoldMode::Shared).await;
        let again = held(&b, &key, "r1", HoldMode::Shared).await;
        assert!(token(&again) > token(&r1), "{db:?}: a reader's re-entry");
        let entry = b.inspect(&key).await.unwrap().unwrap();
        assert_eq!(entry.holders.len(), 1, "{db:?}");
        assert_eq!(entry.holders[0].token.map(|t| t.get()), Some(token(&again)));
        b.release(&again).await.unwrap();
        let w = held(&b, &key, "w", HoldMode::Exclusive).await;
        assert!(token(&w) > token(&again), "{db:?}: a writer after a reader");
        b.release(&w).await.unwrap();
        let r2 = held(&b, &key, "r2", HoldMode::Shared).await;
        assert!(token(&r2) > token(&w), "{db:?}: a reader after a writer");
        b.release(&r2).await.unwrap();
        // Permits on the key its readers left: slot 0's token rises at
        // every grant, the same owner's re-entry included.
        let p = held(&b, &key, "p", permits(2)).await;
        let p_again = held(&b, &key, "p", permits(2)).await;
        assert_eq!(p_again.slot, Some(0), "{db:?}");
        assert!(token(&p_again) > token(&p), "{db:?}: a permit's re-entry");
        b.release(&p_again).await.unwrap();
        let q = held(&b, &key, "q", permits(2)).await;
        assert_eq!(q.slot, Some(0), "{db:?}");
        assert!(token(&q) > token(&p_again), "{db:?}: slot 0 reused");
        b.release(&q).await.unwrap();
        // Readers again: the key's sequence goes on from the writer's.
        let r3 = held(&b, &key, "r3", HoldMode::Shared).await;
        assert!(token(&r3) > token(&r2), "{db:?}: a reader after permits");
        b.release(&r3).await.unwrap();
        let w2 = held(&b, &key, "w2", HoldMode::Exclusive).await;
        assert!(token(&w2) > token(&r3), "{db:?}");
        b.release(&w2).await.unwrap();
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writers_mark_outlives_the_releases_of_other_owners() {
    for db in dbs() {
        let (b, table) = own_table(db, "mark", "").await;
        let key = unique_key("rw-mark-stands");
        let r1 = held(&b, &key, "r1", HoldMode::Shared).await;
        let r2 = held(&b, &key, "r2", HoldMode::Shared).await;
        let writer = AcquireRequest::new(&key, "w", LEASE).with_wait(Duration::from_secs(30));
        assert!(matches!(
            b.try_acquire(&writer).await.unwrap(),
            Attempt::Busy { .. }
        ));
        b.release(&r1).await.unwrap();
        b.release(&lease_of(&key, "x", HoldMode::Shared, None))
            .await
            .unwrap();
        assert!(
            is_busy(&b, &key, "r3", HoldMode::Shared).await,
            "{db:?}: the writer's mark stands after another owner's release"
        );
        b.release(&r2).await.unwrap();
        let Attempt::Held(w) = b.try_acquire(&writer).await.unwrap() else {
            panic!("{db:?}: the writer at the last reader's release");
        };
        b.release(&w).await.unwrap();
        let r3 = held(&b, &key, "r3", HoldMode::Shared).await;
        b.release(&r3).await.unwrap();
        drop_tables(db, &table).await;
    }
}

/// Polls `work` until it is done or `budget` has passed, then drops it:
/// whether it finished.
async fn drop_after<F: std::future::Future>(work: F, budget: Duration) -> bool {
    let started = std::time::Instant::now();
    let mut work = std::pin::pin!(work);
    loop {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(work.as_mut().poll(cx)));
        if polled.await.is_ready() {
            return true;
        }
        if started.elapsed() >= budget {
            return false;
        }
        tokio::task::yield_now().await;
    }
}

/// The key's state is whole: a writer is refused exactly while a share
/// stands (a share's row without `shared_until`, or `shared_until` without
/// a row, would answer otherwise, and for good). A dropped call may still
/// land after a look (it runs on dlock's I/O runtime, as the runtime's undo
/// expects): the look is taken again until it agrees, for at most 10 s.
/// Frees the key: every share left is released.
async fn whole(b: &Arc<dyn LockBackend>, key: &str, db: Db, at: Duration) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = writer_gets_it(b, key, "w").await;
        let owners: Vec<String> = b
            .inspect(key)
            .await
            .unwrap()
            .map(|e| e.holders.into_iter().map(|h| h.owner).collect())
            .unwrap_or_default();
        if got && owners.is_empty() {
            return;
        }
        if !got && !owners.is_empty() {
            for owner in owners {
                b.release(&lease_of(key, &owner, HoldMode::Shared, None))
                    .await
                    .unwrap();
            }
            continue;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{db:?} dropped after {at:?}: writer granted {got}, shares of {owners:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_or_release_of_a_share_dropped_at_any_moment_leaves_the_key_whole() {
    for db in dbs() {
        let (b, table) = own_table(db, "drop", "").await;
        let key = unique_key("rw-dropped");
        let (mut done, mut dropped) = (0, 0);
        for step in 0..80u64 {
            let at = Duration::from_micros(step * 60);
            let reader = format!("r{step}");
            let request = AcquireRequest::new(&key, &reader, LEASE).with_mode(HoldMode::Shared);
            let finished = drop_after(b.try_acquire(&request), at).await;
            whole(&b, &key, db, at).await;
            let lease = held(&b, &key, &reader, HoldMode::Shared).await;
            let finished_release = drop_after(b.release(&lease), at).await;
            whole(&b, &key, db, at).await;
            for f in [finished, finished_release] {
                if f {
                    done += 1;
                } else {
                    dropped += 1;
                }
            }
        }
        assert!(
            dropped > 0 && done > 0,
            "{db:?}: {dropped} dropped, {done} done"
        );
        drop_tables(db, &table).await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_of_another_process_without_its_poll() {
    let db = Db::Postgres;
    // The waiters look again only every 30 s, and the shares' leases run
    // longer: only the release's NOTIFY wakes them in time.
    let table = format!("sem_wake_{:08x}", rand::random::<u32>());
    let holding = backend_at(db, &db.url(&table, "&poll=30s")).await.unwrap();
    let waiting = backend_at(db, &db.url(&table, "&poll=30s")).await.unwrap();
    let registry = Registry::builder().default_backend(waiting).build();
    let lease = Duration::from_secs(60);
    let grant = |owner: &str, key: &str, mode: HoldMode| {
        let request = AcquireRequest::new(key, owner, lease).with_mode(mode);
        let holding = holding.clone();
        async move {
            match holding.try_acquire(&request).await.unwrap() {
                Attempt::Held(l) => l,
                other => panic!("{other:?}"),
            }
        }
    };
    // A writer behind two readers, woken by the second release; a permit
    // seeker behind two permits, woken by the first.
    for (case, mode) in [("writer", HoldMode::Shared), ("permit", permits(2))] {
        let name = unique_key(&format!("wake-{case}"));
        let key = format!("{}{name}", registry.key_prefix());
        let first = grant("h1", &key, mode).await;
        let second = grant("h2", &key, mode).await;
        let (registry, k) = (registry.clone(), name.clone());
        let waiter = tokio::spawn(async move {
            let lock = registry.lock(&k).wait(Duration::from_secs(120));
            let lock = match mode {
                HoldMode::Permit { permits } => lock.permits(permits),
                _ => lock,
            };
            let guard = lock.acquire().await.unwrap();
            let at = std::time::Instant::now();
            guard.release().await.unwrap();
            at
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiter.is_finished(), "{case}: granted beside two holders");
        // The release that frees the key: the second reader's, the first
        // permit's.
        let (freeing, last) = if mode == HoldMode::Shared {
            holding.release(&first).await.unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(!waiter.is_finished(), "{case}: granted beside a reader");
            (second, None)
        } else {
            (first, Some(second))
        };
        let released = std::time::Instant::now();
        holding.release(&freeing).await.unwrap();
        let at = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap_or_else(|_| panic!("{case}: not woken by the release"))
            .unwrap();
        assert!(at >= released, "{case}: granted before the release");
        if let Some(left) = last {
            holding.release(&left).await.unwrap();
        }
    }
    drop_tables(db, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_writers_of_two_processes_never_overlap() {
    for db in dbs() {
        let table = format!("sem_rwmix_{:08x}", rand::random::<u32>());
        let key = unique_key("rw-mix");
        // (readers inside, writers inside), and the most readers seen.
        let inside = Arc::new(std::sync::Mutex::new((0usize, 0usize)));
        let most = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..2 {
            let backend = backend_at(db, &db.url(&table, "")).await.unwrap();
            let registry = Registry::builder().default_backend(backend).build();
            for t in 0..4usize {
                let (registry, key) = (registry.clone(), key.clone());
                let (inside, most) = (inside.clone(), most.clone());
                tasks.push(tokio::spawn(async move {
                    for i in 0..5usize {
                        let write = (t + i) % 3 == 0;
                        let lock = registry.lock(&key).wait(Duration::from_secs(90));
                        let lock = if write { lock } else { lock.read() };
                        let guard = lock.acquire().await.unwrap();
                        {
                            let mut now = inside.lock().unwrap();
                            if write {
                                now.1 += 1;
                            } else {
                                now.0 += 1;
                            }
                            assert!(
                                now.1 <= 1 && (now.1 == 0 || now.0 == 0),
                                "{db:?}: {} readers and {} writers inside",
                                now.0,
                                now.1
                            );
                            most.fetch_max(now.0, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_millis(15)).await;
                        {
                            let mut now = inside.lock().unwrap();
                            if write {
                                now.1 -= 1;
                            } else {
                                now.0 -= 1;
                            }
                        }
                        guard.release().await.unwrap();
                    }
                }));
            }
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert!(most.load(Ordering::SeqCst) >= 1, "{db:?}: no reader got in");
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_raced_by_two_processes_hold_distinct_slots_with_rising_tokens() {
    for db in dbs() {
        let table = format!("sem_slotrace_{:08x}", rand::random::<u32>());
        let key = unique_key("sem-slot-race");
        // The slots held now, and each slot's last token.
        let slots = Arc::new(std::sync::Mutex::new((
            std::collections::BTreeSet::<u32>::new(),
            std::collections::BTreeMap::<u32, u64>::new(),
        )));
        let mut tasks = Vec::new();
        for p in 0..2 {
            let backend = backend_at(db, &db.url(&table, "")).await.unwrap();
            for t in 0..4 {
                let (backend, key, slots) = (backend.clone(), key.clone(), slots.clone());
                tasks.push(tokio::spawn(async move {
                    let owner = format!("p{p}t{t}");
                    let request = AcquireRequest::new(&key, &owner, LEASE).with_mode(permits(3));
                    let mut grants = 0;
                    let deadline = std::time::Instant::now() + Duration::from_secs(90);
                    while grants < 5 {
                        assert!(std::time::Instant::now() < deadline, "{db:?}: starved");
                        let lease = match backend.try_acquire(&request).await.unwrap() {
                            Attempt::Held(lease) => lease,
                            _ => {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                                continue;
                            }
                        };
                        let slot = lease.slot.unwrap();
                        {
                            let mut now = slots.lock().unwrap();
                            assert!(slot < 3, "{db:?}: slot {slot}");
                            assert!(now.0.insert(slot), "{db:?}: slot {slot} held twice");
                            let last = now.1.insert(slot, token(&lease));
                            assert!(
                                last.is_none_or(|last| last < token(&lease)),
                                "{db:?}: slot {slot}'s token {} after {last:?}",
                                token(&lease)
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        slots.lock().unwrap().0.remove(&slot);
                        backend.release(&lease).await.unwrap();
                        grants += 1;
                    }
                }));
            }
        }
        for task in tasks {
            task.await.unwrap();
        }
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_holders_late_release_frees_nothing_of_its_successor() {
    for db in dbs() {
        let (b, table) = own_table(db, "revoked", "").await;
        for (case, mode) in [("reader", HoldMode::Shared), ("permit", permits(2))] {
            let key = unique_key(&format!("revoked-{case}"));
            let a = held(&b, &key, "a", mode).await;
            assert_eq!(b.revoke(&key).await.unwrap().len(), 1, "{db:?} {case}");
            // The successor takes the slot the revoked holder had.
            let s = held(&b, &key, "s", mode).await;
            assert_eq!(s.slot, a.slot, "{db:?} {case}");
            b.release(&a).await.unwrap();
            let entry = b.inspect(&key).await.unwrap();
            let owners: Vec<String> = entry
                .map(|e| e.holders.into_iter().map(|h| h.owner).collect())
                .unwrap_or_default();
            assert_eq!(owners, vec!["s".to_owned()], "{db:?} {case}");
            if mode == HoldMode::Shared {
                assert!(
                    !writer_gets_it(&b, &key, "w").await,
                    "{db:?}: a writer beside the successor"
                );
            } else {
                assert!(
                    is_mismatch(&b, &key, "w", HoldMode::Exclusive).await,
                    "{db:?}: a plain lock beside the successor"
                );
            }
            b.release(&s).await.unwrap();
            assert!(writer_gets_it(&b, &key, "w").await, "{db:?} {case}");
        }
        drop_tables(db, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keys_shared_until_covers_every_share_it_grants() {
    let mut failed = Vec::new();
    for db in dbs() {
        let (b, table) = own_table(db, "covers", "").await;
        let name = sql_name(db, &table);
        let mut late = Vec::new();
        for i in 0..40 {
            let (key, mode) = if i % 2 == 0 {
                (unique_key("covers-reader"), HoldMode::Shared)
            } else {
                (unique_key("covers-permit"), permits(50))
            };
            let lease = held(&b, &key, &format!("o{i}"), mode).await;
            // A share's row outliving the key's `shared_until` is a share a
            // writer does not wait for (and that its holder can renew).
            let beyond = count(
                db,
                &table,
                &if db_is_mysql(db) {
                    format!(
                        "SELECT COUNT(*) FROM {name}_holders h JOIN {name} l ON l.k = h.k \
                         WHERE h.k = '{key}' AND h.owner IS NOT NULL \
                         AND h.expires_us > l.shared_us"
                    )
                } else {
                    format!(
                        "SELECT COUNT(*) FROM {name}_holders h JOIN {name} l ON l.key = h.key \
                         WHERE h.key = '{key}' AND h.owner IS NOT NULL \
                         AND h.expires_at > l.shared_until"
                    )
                },
            )
            .await;
            if beyond > 0 {
                late.push(i);
            }
            b.release(&lease).await.unwrap();
        }
        if !late.is_empty() {
            failed.push(format!("{db:?}: {late:?}"));
        }
        drop_tables(db, &table).await;
    }
    assert!(
        failed.is_empty(),
        "grants (of 40) whose share ends after the key's shared_until: {failed:?}"
    );
}

/// Whether `db` is MySQL/MariaDB.
fn db_is_mysql(db: Db) -> bool {
    match db {
        #[cfg(feature = "mysql")]
        Db::Mysql => true,
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shares_release_notifies_only_when_the_key_is_wanted() {
    let db = Db::Postgres;
    let table = format!("sem_notify_{:08x}", rand::random::<u32>());
    let channel = table.clone();
    let options = format!("&channel={channel}");
    let holding = backend_at(db, &db.url(&table, &options)).await.unwrap();
    let waiting = backend_at(db, &db.url(&table, &options)).await.unwrap();
    let registry = Registry::builder().default_backend(waiting).build();
    let mut listener = sqlx::postgres::PgListener::connect(&SqlDb::Postgres.url())
        .await
        .unwrap();
    listener.listen(&channel).await.unwrap();
    let quiet = unique_key("notify-quiet");
    for mode in [HoldMode::Shared, permits(2), HoldMode::Shared] {
        let lease = held(&holding, &quiet, "q", mode).await;
        holding.release(&lease).await.unwrap();
    }
    let name = unique_key("notify-wanted");
    let wanted = format!("{}{name}", registry.key_prefix());
    let r1 = held(&holding, &wanted, "r1", HoldMode::Shared).await;
    let r2 = held(&holding, &wanted, "r2", HoldMode::Shared).await;
    let waiter = tokio::spawn(async move {
        let guard = registry
            .lock(&name)
            .wait(Duration::from_secs(60))
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
    });
    // The waiting writer marks the key wanted.
    let marked = format!("SELECT COUNT(*) FROM {table} WHERE key = '{wanted}' AND wanted");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while count(db, &table, &marked).await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holding.release(&r1).await.unwrap();
    holding.release(&r2).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the writer woken")
        .unwrap();
    let mut heard = Vec::new();
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await {
        heard.push(n.payload().to_owned());
    }
    assert!(
        !heard.contains(&quiet),
        "unwanted releases notified: {heard:?}"
    );
    let from_releases = heard.iter().filter(|k| **k == wanted).count();
    assert!(
        from_releases >= 2,
        "both readers' releases of a wanted key notify: {heard:?}"
    );
    drop_tables(db, &table).await;
}

/// Releases (one autocommitted statement when the key's row did not
/// change while they waited for it) raced for seconds by grants of other
/// readers and permits, renewals, admin revokes and plain locks of the same
/// keys, from two processes: every release, renewal and revoke answers
/// (none lost to a deadlock), no committed state has a live share beyond
/// its key's `shared_until`, and a plain lock never holds the readers' key
/// beside a live share.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_raced_by_grants_renewals_revokes_and_plain_locks_keep_every_share_covered() {
    const RUN: Duration = Duration::from_secs(6);
    let db = Db::Postgres;
    let (b1, table) = own_table(db, "relrace", "").await;
    let b2 = backend_at(db, &db.url(&table, "")).await.unwrap();
    let readers = unique_key("relrace-readers");
    let sem = unique_key("relrace-permits");
    let pool = sqlx::PgPool::connect(&SqlDb::Postgres.url()).await.unwrap();
    let stop = tokio::time::Instant::now() + RUN;
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let released = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..6usize {
        let b = if t % 2 == 0 { b1.clone() } else { b2.clone() };
        let (key, mode) = if t < 4 {
            (readers.clone(), HoldMode::Shared)
        } else {
            (sem.clone(), permits(2))
        };
        let (errors, released) = (errors.clone(), released.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while tokio::time::Instant::now() < stop {
                i += 1;
                let owner = format!("r{t}-{i}");
                let request =
                    AcquireRequest::new(&key, &owner, Duration::from_secs(2)).with_mode(mode);
                let lease = match b.try_acquire(&request).await {
                    Ok(Attempt::Held(lease)) => lease,
                    Ok(_) => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    Err(e) => {
                        errors.lock().unwrap().push(format!("{owner} acquire: {e}"));
                        continue;
                    }
                };
                for ttl in [Duration::from_secs(3), Duration::from_millis(800)] {
                    if let Err(e) = b.renew(&lease, ttl).await {
                        errors.lock().unwrap().push(format!("{owner} renew: {e}"));
                    }
                }
                match b.release(&lease).await {
                    Ok(()) => {
                        released.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => errors.lock().unwrap().push(format!("{owner} release: {e}")),
                }
            }
        }));
    }
    // An admin revoking the readers now and then.
    {
        let (b, key, errors) = (b1.clone(), readers.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < stop {
                tokio::time::sleep(Duration::from_millis(150)).await;
                if let Err(e) = b.revoke(&key).await {
                    errors.lock().unwrap().push(format!("revoke: {e}"));
                }
            }
        }));
    }
    // A plain lock of the readers' key, checked against the live shares.
    let beside = format!(
        "SELECT COUNT(*) FROM {table}_holders WHERE key = $1 AND owner IS NOT NULL \
         AND expires_at > clock_timestamp()"
    );
    {
        let (b, key, errors, pool) = (b2.clone(), readers.clone(), errors.clone(), pool.clone());
        let beside = beside.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while tokio::time::Instant::now() < stop {
                i += 1;
                let owner = format!("w{i}");
                match b
                    .try_acquire(&AcquireRequest::new(&key, &owner, LEASE))
                    .await
                {
                    Ok(Attempt::Held(lease)) => {
                        let live: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(beside.clone()))
                            .bind(&key)
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                        if live > 0 {
                            errors
                                .lock()
                                .unwrap()
                                .push(format!("{owner} holds the key beside {live} shares"));
                        }
                        if let Err(e) = b.release(&lease).await {
                            errors.lock().unwrap().push(format!("{owner} release: {e}"));
                        }
                    }
                    Ok(_) => {}
                    Err(e) => errors.lock().unwrap().push(format!("{owner} acquire: {e}")),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    // Every committed state: no live share beyond its key's `shared_until`.
    let uncovered = format!(
        "SELECT COUNT(*) FROM {table}_holders h JOIN {table} l ON l.key = h.key \
         WHERE h.key IN ($1, $2) AND h.owner IS NOT NULL \
         AND h.expires_at > clock_timestamp() \
         AND (l.shared_until IS NULL OR h.expires_at > l.shared_until)"
    );
    let mut looks = 0;
    while tokio::time::Instant::now() < stop {
        looks += 1;
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(uncovered.clone()))
            .bind(&readers)
            .bind(&sem)
            .fetch_one(&pool)
            .await
            .unwrap();
        if n > 0 {
            errors
                .lock()
                .unwrap()
                .push(format!("{n} live shares beyond shared_until"));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    let errors = errors.lock().unwrap().clone();
    let released = released.load(Ordering::SeqCst);
    drop_tables(db, &table).await;
    assert!(errors.is_empty(), "{} failures: {errors:?}", errors.len());
    assert!(
        released >= 20,
        "only {released} releases raced ({looks} looks)"
    );
}
