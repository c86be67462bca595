//! The fence table on PostgreSQL, MySQL/MariaDB and SQLite: one
//! implementation ([`Fence::check`]) over a small dialect per database
//! ([`FenceDatabase`]).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::{BackendError, FencingToken, LockError};

/// The longest resource name the fence table stores, in bytes (the
/// primary-key limits of the three databases, with room to spare).
pub const MAX_RESOURCE_LEN: usize = 512;

/// The fence table on PostgreSQL (in the connection's default schema).
pub const POSTGRES_DDL: &str = "CREATE TABLE IF NOT EXISTS dlock_fences (\n    \
    resource text PRIMARY KEY,\n    \
    token bigint NOT NULL,\n    \
    updated_at timestamptz NOT NULL DEFAULT now()\n)";

/// The fence table on MySQL 8 and MariaDB (binary names: `A` and `a` are two
/// resources, whatever the schema's collation).
pub const MYSQL_DDL: &str = "CREATE TABLE IF NOT EXISTS dlock_fences (\n    \
    resource varbinary(512) NOT NULL PRIMARY KEY,\n    \
    token bigint NOT NULL,\n    \
    updated_at datetime(6) NOT NULL\n) ENGINE = InnoDB";

/// The fence table on SQLite (`updated_at` in milliseconds since the epoch).
pub const SQLITE_DDL: &str = "CREATE TABLE IF NOT EXISTS dlock_fences (\n    \
    resource TEXT PRIMARY KEY NOT NULL,\n    \
    token INTEGER NOT NULL,\n    \
    updated_at INTEGER NOT NULL\n) WITHOUT ROWID";

mod sealed {
    pub trait Sealed {}
}

/// A database the fence table runs on: `sqlx::Postgres`, `sqlx::MySql` or
/// `sqlx::Sqlite` (sealed: the statements are written per database).
pub trait FenceDatabase: sqlx::Database + sealed::Sealed {
    /// The `CREATE TABLE` of `dlock_fences` on this database.
    const DDL: &'static str;

    /// The database's name in errors (`"postgres"`, `"mysql"`, `"sqlite"`).
    #[doc(hidden)]
    const STORE: &'static str;

    /// Whether `CREATE TABLE` can run inside the caller's transaction (and
    /// goes away with its rollback); MySQL's commits the transaction.
    #[doc(hidden)]
    const TRANSACTIONAL_DDL: bool;

    /// Whether this process has seen the table committed on this kind of
    /// database (reset when a check finds it missing).
    #[doc(hidden)]
    fn seen_table() -> &'static AtomicBool;

    /// Keeps the larger of the stored token and `token` for `resource`, in
    /// one statement where the database allows it: `Err(seen)` when a larger
    /// token was already there (`seen` when the database told it).
    #[doc(hidden)]
    fn upsert<'c>(
        conn: &'c mut Self::Connection,
        resource: &'c str,
        token: i64,
    ) -> impl Future<Output = Result<Result<(), Option<i64>>, sqlx::Error>> + Send + 'c;

    /// Inside the caller's transaction: whether the table is there
    /// (committed); if not, creates it in this transaction, serialised
    /// against concurrent creators.
    #[doc(hidden)]
    fn ensure_table(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + '_;

    /// Outside any transaction: creates the table if it is missing.
    #[doc(hidden)]
    fn create_table(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Deletes rows not checked for `retention`; answers how many.
    #[doc(hidden)]
    fn collect(
        conn: &mut Self::Connection,
        retention: Duration,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + '_;

    /// Whether `err` says the table does not exist.
    #[doc(hidden)]
    fn missing_table(err: &sqlx::Error) -> bool;

    /// Whether `err` may go away when the transaction is tried again
    /// (serialization failure, deadlock, lock timeout, busy, lost connection).
    #[doc(hidden)]
    fn transient(err: &sqlx::Error) -> bool;
}

/// How the SQL fence checks: [`check`](crate::fence::check) and
/// [`check_current`](crate::fence::check_current) are [`Fence::new`]'s.
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use dlock_runtime::fence::Fence;
/// // The table is made by migrations: never run DDL at a check.
/// let fence = Fence::new().create_table(false);
/// let mut tx = pool.begin().await?;
/// fence.check(&mut tx, "account:7", dlock_runtime::FencingToken::new(42)).await?;
/// sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 7")
///     .execute(&mut *tx)
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Fence {
    create: bool,
}

impl Default for Fence {
    fn default() -> Self {
        Fence::new()
    }
}

impl Fence {
    /// The default: the table is created on first use where the database
    /// allows it inside a transaction (PostgreSQL, SQLite).
    pub const fn new() -> Self {
        Fence { create: true }
    }

    /// Whether a check may create the table (`true` by default). With
    /// `false` a missing table is a [`LockError::Config`] naming the DDL.
    pub const fn create_table(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Checks `token` against the largest token seen for `resource`, inside
    /// the caller's open transaction, and keeps the larger one.
    ///
    /// `Ok(())` when `token` is at least the stored one (equal passes: the
    /// same holder writing twice); the row stays locked until the
    /// transaction ends, so a concurrent check of `resource` waits for this
    /// one to commit or roll back. [`LockError::Fenced`] when a larger token
    /// was already seen: roll the transaction back, the write must not
    /// commit. [`LockError::Backend`] when the statement failed (retryable
    /// for a serialization failure, a deadlock, a busy database, a lost
    /// connection); [`LockError::Config`] when the table is missing and may
    /// not be created here; [`LockError::InvalidKey`] for a resource longer
    /// than [`MAX_RESOURCE_LEN`].
    pub async fn check<DB: FenceDatabase>(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        resource: &str,
        token: FencingToken,
    ) -> Result<(), LockError> {
        if resource.len() > MAX_RESOURCE_LEN {
            return Err(LockError::invalid_key(
                resource,
                format!("a fenced resource is at most {MAX_RESOURCE_LEN} bytes"),
            ));
        }
        let value = i64::try_from(token.get()).map_err(|_| {
            LockError::config(format!(
                "fencing token {token} does not fit the fence table's signed 64-bit column"
            ))
        })?;
        let conn: &mut DB::Connection = tx;
        let create = self.create && DB::TRANSACTIONAL_DDL;
        if create && !DB::seen_table().load(Ordering::Acquire) {
            let committed = DB::ensure_table(conn)
                .await
                .map_err(|e| backend_error::<DB>(e, false))?;
            if committed {
                DB::seen_table().store(true, Ordering::Release);
            }
        }
        match DB::upsert(conn, resource, value).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(seen)) => Err(LockError::Fenced {
                resource: resource.to_owned(),
                token,
                seen: seen.and_then(|s| u64::try_from(s).ok().map(FencingToken::new)),
            }),
            Err(err) if DB::missing_table(&err) => {
                DB::seen_table().store(false, Ordering::Release);
                if create {
                    // Created by a transaction that rolled back, or dropped:
                    // the next check creates it again.
                    Err(backend_error::<DB>(err, true))
                } else {
                    Err(LockError::config(format!(
                        "the fence table `dlock_fences` does not exist on this {} database: \
                         create it with `dlock_runtime::fence::create_table(&pool)` or its DDL \
                         (`dlock_runtime::fence::{}`)",
                        DB::STORE,
                        ddl_name::<DB>()
                    )))
                }
            }
            Err(err) => Err(backend_error::<DB>(err, false)),
        }
    }

    /// [`check`](Self::check) with the token of the lock the current task
    /// holds: the lock whose key is `resource` if the call chain holds one
    /// (innermost first; one key of a hold of several keys), else the
    /// innermost hold ([`current()`](crate::current); its first key).
    /// [`LockError::Lost`] when another lock the call chain holds is known
    /// lost: a holder whose outer lease ran out must not write with the newer
    /// token of a lock it took inside.
    ///
    /// [`LockError::Config`] outside a held scope (no lock is held by this
    /// task: the write would carry no token at all, which is a programming
    /// error, not a lost race) and when the held lock has no token (Redlock:
    /// fence such writes with a version compare-and-set instead).
    pub async fn check_current<DB: FenceDatabase>(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        resource: &str,
    ) -> Result<(), LockError> {
        let token = super::current_token(resource)?;
        self.check(tx, resource, token).await
    }
}

/// Creates the fence table if it is missing, outside any transaction (at
/// startup, or from a migration): the way to create it on MySQL/MariaDB,
/// where `CREATE TABLE` would commit the caller's transaction. Safe against
/// concurrent callers.
pub async fn create_table<DB: FenceDatabase>(pool: &sqlx::Pool<DB>) -> Result<(), LockError> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| backend_error::<DB>(e, false))?;
    DB::create_table(&mut conn)
        .await
        .map_err(|e| backend_error::<DB>(e, false))?;
    DB::seen_table().store(true, Ordering::Release);
    Ok(())
}

/// Deletes the rows of resources not checked for `retention` (measured on
/// the database's clock); answers how many went. Run it now and then (a
/// scheduled job); read the module docs of [`fence`](crate::fence) for the
/// retention that keeps it safe.
pub async fn collect<DB: FenceDatabase>(
    pool: &sqlx::Pool<DB>,
    retention: Duration,
) -> Result<u64, LockError> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| backend_error::<DB>(e, false))?;
    DB::collect(&mut conn, retention)
        .await
        .map_err(|e| backend_error::<DB>(e, false))
}

fn backend_error<DB: FenceDatabase>(err: sqlx::Error, transient: bool) -> LockError {
    let source = if transient || DB::transient(&err) {
        BackendError::transient(err)
    } else {
        BackendError::permanent(err)
    };
    source.into_lock_error(DB::STORE)
}

fn ddl_name<DB: FenceDatabase>() -> &'static str {
    match DB::STORE {
        "postgres" => "POSTGRES_DDL",
        "mysql" => "MYSQL_DDL",
        _ => "SQLITE_DDL",
    }
}

/// The retention in whole milliseconds, capped far below overflow.
fn retention_millis(retention: Duration) -> i64 {
    i64::try_from(retention.as_millis())
        .unwrap_or(i64::MAX)
        .min(1000 * 365 * 24 * 3600 * 1000)
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

fn connection_lost(err: &sqlx::Error) -> bool {
    matches!(
        err,
        sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
    )
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    /// Serialises the first users' `CREATE TABLE` (a constant advisory-lock
    /// key, "dlfences" in ASCII).
    const CREATE_LOCK: i64 = 0x646c_6665_6e63_6573;

    static SEEN: AtomicBool = AtomicBool::new(false);

    impl sealed::Sealed for sqlx::Postgres {}

    impl FenceDatabase for sqlx::Postgres {
        const DDL: &'static str = POSTGRES_DDL;
        const STORE: &'static str = "postgres";
        const TRANSACTIONAL_DDL: bool = true;

        fn seen_table() -> &'static AtomicBool {
            &SEEN
        }

        async fn upsert<'c>(
            conn: &'c mut sqlx::PgConnection,
            resource: &'c str,
            token: i64,
        ) -> Result<Result<(), Option<i64>>, sqlx::Error> {
            // Zero rows: the stored token is larger (the conflicting row
            // is locked all the same, until the transaction ends).
            let kept: Option<i64> = sqlx::query_scalar(
                "INSERT INTO dlock_fences (resource, token, updated_at) VALUES ($1, $2, now()) \
                 ON CONFLICT (resource) DO UPDATE \
                 SET token = EXCLUDED.token, updated_at = EXCLUDED.updated_at \
                 WHERE dlock_fences.token <= EXCLUDED.token \
                 RETURNING token",
            )
            .bind(resource)
            .bind(token)
            .fetch_optional(&mut *conn)
            .await?;
            if kept.is_some() {
                return Ok(Ok(()));
            }
            let seen: Option<i64> =
                sqlx::query_scalar("SELECT token FROM dlock_fences WHERE resource = $1")
                    .bind(resource)
                    .fetch_optional(&mut *conn)
                    .await?;
            Ok(Err(seen))
        }

        async fn ensure_table(conn: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
            let exists: bool = sqlx::query_scalar("SELECT to_regclass('dlock_fences') IS NOT NULL")
                .fetch_one(&mut *conn)
                .await?;
            if exists {
                return Ok(true);
            }
            // Held until the caller's transaction ends: a concurrent
            // first user waits here, then finds the committed table.
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(CREATE_LOCK)
                .execute(&mut *conn)
                .await?;
            sqlx::query(POSTGRES_DDL).execute(&mut *conn).await?;
            Ok(false)
        }

        async fn create_table(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
            use sqlx::Connection;
            let mut tx = conn.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(CREATE_LOCK)
                .execute(&mut *tx)
                .await?;
            sqlx::query(POSTGRES_DDL).execute(&mut *tx).await?;
            tx.commit().await
        }

        async fn collect(
            conn: &mut sqlx::PgConnection,
            retention: Duration,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query(
                "DELETE FROM dlock_fences \
                 WHERE updated_at < now() - $1 * interval '1 millisecond'",
            )
            .bind(retention_millis(retention))
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected())
        }

        fn missing_table(err: &sqlx::Error) -> bool {
            sqlstate(err).as_deref() == Some("42P01")
        }

        fn transient(err: &sqlx::Error) -> bool {
            connection_lost(err)
                || sqlstate(err).is_some_and(|c| {
                    c.starts_with("08")
                        || c.starts_with("53")
                        || matches!(
                            c.as_str(),
                            "40001" | "40P01" | "55P03" | "57014" | "57P01" | "57P02" | "57P03"
                        )
                })
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;

    static SEEN: AtomicBool = AtomicBool::new(false);

    impl sealed::Sealed for sqlx::MySql {}

    fn error_number(err: &sqlx::Error) -> Option<u16> {
        match err {
            sqlx::Error::Database(db) => db
                .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .map(|e| e.number()),
            _ => None,
        }
    }

    impl FenceDatabase for sqlx::MySql {
        const DDL: &'static str = MYSQL_DDL;
        const STORE: &'static str = "mysql";
        const TRANSACTIONAL_DDL: bool = false;

        fn seen_table() -> &'static AtomicBool {
            &SEEN
        }

        async fn upsert<'c>(
            conn: &'c mut sqlx::MySqlConnection,
            resource: &'c str,
            token: i64,
        ) -> Result<Result<(), Option<i64>>, sqlx::Error> {
            // Neither server has `UPDATE … RETURNING`: a refusal reports
            // the stored token through `LAST_INSERT_ID(expr)` (sent back
            // in the OK packet; 0 otherwise, as the table has no
            // AUTO_INCREMENT). Assignments run left to right: `updated_at`
            // first, while `token` is still the stored one.
            let done = sqlx::query(
                "INSERT INTO dlock_fences (resource, token, updated_at) \
                 VALUES (?, ?, UTC_TIMESTAMP(6)) \
                 ON DUPLICATE KEY UPDATE \
                 updated_at = IF(token <= ?, UTC_TIMESTAMP(6), updated_at), \
                 token = IF(token <= ?, ?, token + 0 * LAST_INSERT_ID(token))",
            )
            .bind(resource)
            .bind(token)
            .bind(token)
            .bind(token)
            .bind(token)
            .execute(&mut *conn)
            .await?;
            match done.last_insert_id() {
                0 => Ok(Ok(())),
                seen => Ok(Err(i64::try_from(seen).ok())),
            }
        }

        async fn ensure_table(_conn: &mut sqlx::MySqlConnection) -> Result<bool, sqlx::Error> {
            // Never called: `CREATE TABLE` would commit the caller's transaction.
            Ok(false)
        }

        async fn create_table(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
            // Concurrent creators are serialised by the metadata lock;
            // the later ones find the table.
            sqlx::query(MYSQL_DDL).execute(&mut *conn).await?;
            Ok(())
        }

        async fn collect(
            conn: &mut sqlx::MySqlConnection,
            retention: Duration,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query(
                "DELETE FROM dlock_fences \
                 WHERE updated_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
            )
            .bind(retention_millis(retention).saturating_mul(1000))
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected())
        }

        fn missing_table(err: &sqlx::Error) -> bool {
            error_number(err) == Some(1146)
        }

        fn transient(err: &sqlx::Error) -> bool {
            connection_lost(err)
                || matches!(
                    error_number(err),
                    Some(1213 | 1205 | 1040 | 1053 | 1317 | 1927 | 1290 | 1836 | 4031)
                )
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;

    static SEEN: AtomicBool = AtomicBool::new(false);

    impl sealed::Sealed for sqlx::Sqlite {}

    impl FenceDatabase for sqlx::Sqlite {
        const DDL: &'static str = SQLITE_DDL;
        const STORE: &'static str = "sqlite";
        const TRANSACTIONAL_DDL: bool = true;

        fn seen_table() -> &'static AtomicBool {
            &SEEN
        }

        async fn upsert<'c>(
            conn: &'c mut sqlx::SqliteConnection,
            resource: &'c str,
            token: i64,
        ) -> Result<Result<(), Option<i64>>, sqlx::Error> {
            let kept: Option<i64> = sqlx::query_scalar(
                "INSERT INTO dlock_fences (resource, token, updated_at) \
                 VALUES (?1, ?2, CAST(unixepoch('subsec') * 1000 AS INTEGER)) \
                 ON CONFLICT (resource) DO UPDATE \
                 SET token = excluded.token, updated_at = excluded.updated_at \
                 WHERE dlock_fences.token <= excluded.token \
                 RETURNING token",
            )
            .bind(resource)
            .bind(token)
            .fetch_optional(&mut *conn)
            .await?;
            if kept.is_some() {
                return Ok(Ok(()));
            }
            let seen: Option<i64> =
                sqlx::query_scalar("SELECT token FROM dlock_fences WHERE resource = ?1")
                    .bind(resource)
                    .fetch_optional(&mut *conn)
                    .await?;
            Ok(Err(seen))
        }

        async fn ensure_table(conn: &mut sqlx::SqliteConnection) -> Result<bool, sqlx::Error> {
            let exists: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM sqlite_schema \
                 WHERE type = 'table' AND name = 'dlock_fences')",
            )
            .fetch_one(&mut *conn)
            .await?;
            if !exists {
                // Takes the database's write lock: concurrent first users
                // wait for this transaction to end.
                sqlx::query(SQLITE_DDL).execute(&mut *conn).await?;
            }
            Ok(exists)
        }

        async fn create_table(conn: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
            sqlx::query(SQLITE_DDL).execute(&mut *conn).await?;
            Ok(())
        }

        async fn collect(
            conn: &mut sqlx::SqliteConnection,
            retention: Duration,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query(
                "DELETE FROM dlock_fences \
                 WHERE updated_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1",
            )
            .bind(retention_millis(retention))
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected())
        }

        fn missing_table(err: &sqlx::Error) -> bool {
            matches!(err, sqlx::Error::Database(db) if db.message().contains("no such table"))
        }

        fn transient(err: &sqlx::Error) -> bool {
            // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
            connection_lost(err)
                || sqlstate(err)
                    .and_then(|c| c.parse::<i64>().ok())
                    .is_some_and(|c| matches!(c & 0xff, 5 | 6))
        }
    }
}
