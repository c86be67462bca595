//! MySQL 8 and MariaDB ≥ 10.5 (`mysql://`, `mariadb://`): the lease table;
//! or `GET_LOCK` (`?mode=session`).
//!
//! **Lease mode** (the default). One row per key, every decision on the
//! database's clock in microseconds (`N` below, `UTC_TIMESTAMP(6)` since the
//! epoch: independent of time zones), one statement each, autocommit at
//! READ COMMITTED (set on dlock's own connections). Neither server has
//! `UPDATE … RETURNING`, and sqlx always sends `CLIENT_FOUND_ROWS`, so the
//! affected-row count cannot tell "took it" from "busy": the acquire reports
//! its outcome through `LAST_INSERT_ID(expr)`, whose value the server sends
//! back in the statement's OK packet:
//!
//! ```sql
//! -- F = (expires_us <= N OR owner = VALUES(owner)): free, expired, or ours (a retry)
//! INSERT INTO dlock_leases (k, owner, token, expires_us, granted_us)
//!   VALUES (?, ?, LAST_INSERT_ID(N), N + ?, N)
//! ON DUPLICATE KEY UPDATE
//!   token      = IF(F, LAST_INSERT_ID(GREATEST(token + 1, N)),
//!                  token + 0 * LAST_INSERT_ID(LEAST(GREATEST(expires_us - N, 0), 2^40 - 1) + 1)),
//!   granted_us = IF(F, IF(owner <=> VALUES(owner), granted_us, N), granted_us),
//!   owner      = IF(F, VALUES(owner), owner),
//!   expires_us = IF(F, VALUES(expires_us), expires_us);    -- assigned last: F reads it
//! ```
//!
//! `VALUES(col)` is the value the statement would have inserted (the
//! same `N` throughout one statement), so the three values are bound once:
//! the key, the owner and the lease.
//!
//! **The holder record** (host, pid, `holder_name`) is the registry's, not
//! the grant's: it is written once into `<table>_procs`, under the holder id
//! every owner token of the registry starts with (its first 16 hex digits,
//! see [`holder_id`]), and the lease row keeps only what is per grant (the
//! owner, the token, `granted_us`); `inspect` and `list` join the two. Each
//! expression of the upsert costs the server on every execution (MariaDB
//! prepares all of `ON DUPLICATE KEY UPDATE` even for an insert), so one
//! `holder = IF(F, …)` per grant cost as much server CPU as the grant time's.
//! The `_procs` row says until when (`until_us`, the database's clock) it
//! covers the grants and renewals of its registry: a grant that would
//! outlast it first extends it to twice (lease + `timeout`) from now, and a
//! renewal that would extends it in the background (the row still covers
//! that renewal, so a slow or locked row never holds a renewal up), so in
//! steady state one upsert per registry every lease or so. Collection
//! deletes rows whose `until_us` passed the retention ago: a registry that
//! holds nothing is forgotten a retention after its last grant's lease
//! would have ended, at most twice (lease + `timeout`) later. Owners of
//! another form (a caller of the backend chose them) and tables without
//! `_procs` (`create=false` on a schema made before it) keep the record in
//! the lease row's `holder` column, written by the upsert as above with
//! `holder = IF(F, VALUES(holder), holder)`; `inspect` reads that column
//! when no `_procs` row matches. A grant that leaves the column alone
//! stores its time negated (`-N` for `N` above, no added expression), so
//! that a grant whose `_procs` row is gone (deleted by hand, or collected
//! while its extensions failed) is shown without a record, never with the
//! one an earlier grant left in the column (a holder of another form, or a
//! version before `_procs`, during a rolling deploy); `inspect` reads the
//! time back with `ABS`. Such grants carry their registry's record, and
//! their renewals write the row again whenever it would not cover them,
//! whether or not this process still remembers writing it.
//!
//! The id is the new token (the clock in µs, above 2^40) when the key was
//! taken, or the holder's remaining time in µs + 1 (at most 2^40) when busy.
//! MySQL and MariaDB evaluate single-table `SET` assignments left to right,
//! later ones seeing the new values: the test `F` reads only `expires_us`
//! (assigned last) and `owner` (which `F` keeps true when it changes it).
//! The statement is pinned by tests on MariaDB 10.11 and targets MySQL 8 too.
//!
//! A watchdog batch is renewed by one `UPDATE … WHERE (k, owner) IN (…)`
//! (batches padded to 1, 2, 4 … 64 entries, so the statements stay cached);
//! when fewer rows matched than were asked for, one `SELECT` says which.
//!
//! Several keys of one hold (`lock_all`) are taken in one transaction: the
//! acquire statement for each key in the runtime's canonical order, rolled
//! back at the first busy one (a deadlock the server still reports is
//! tried again). Session mode takes them one by one.
//!
//! **Semaphores and read-write locks** (lease mode; session mode offers
//! semaphores over `GET_LOCK` slot names, and no read locks: see
//! `session.rs`). A reader's share and each permit are rows of
//! `<table>_holders` (key, slot, permits, owner, token, expiry, holder
//! record), each with its own expiry on the database's clock; the key's
//! lease-table row stays the writer (a plain lock is the write mode) and
//! carries `shared_until` (the latest expiry of its holder rows, which the
//! plain acquire's `WHERE` also requires to have passed) and the
//! waiting-writer mark. A reader or a permit is decided in one short
//! transaction at READ COMMITTED (MySQL has no `RETURNING`, so several statements) that first locks the key's lease-table row
//! (`SELECT … FOR UPDATE`): one statement could not do it, since its
//! snapshot predates its wait for the row lock and it would not see the
//! holder rows the previous transaction committed. The semaphore takes the
//! lowest free slot below `permits` with the slot row's hybrid token
//! (per key and slot); `permits` is stored with the rows and another count,
//! a reader or a plain lock while they live is a `Config` error. A reader
//! takes the key's one token sequence (the lease row's hybrid token) and is
//! busy while the plain lock is held or another writer's mark stands; a
//! writer that finds readers marks the key (writers are preferred) and its
//! grant voids the mark. Waiters poll as for plain locks; renewals of shares go in one transaction per batch.
//!
//! **Wake-ups.** There is no `NOTIFY`: waiters in the releasing process are
//! woken at once; waiters elsewhere poll a lock-free read with back-off —
//! 5 ms doubling up to `poll` (50 ms), and never later than the holder's
//! expiry. For handoff pushed by the server, use session mode.
//!
//! **Session mode** (`?mode=session`): `GET_LOCK('dlock:<16 hex digits>', t)`
//! (64 bits of the stored key's SHA-256) on a dedicated connection per held
//! lock (see [session mode](super#session-mode)); the fencing token is bumped in the
//! same statement in `<table>_fence`. The server's idle limit (`wait_timeout`,
//! whole seconds) follows the lease, so a frozen holder loses the lock within
//! the lease rounded up to a second. `GET_LOCK` locks are not replicated:
//! unsafe across a failover, and refused on Galera clusters (`wsrep_on`).
//!
//! **URL**: `mysql://user:pass@host:port/db?…` with dlock's options
//! `mode=lease|session`, `table=dlock_leases`, `create=true` (with `false`
//! the table is checked, never created — see `MysqlBackend::DDL`),
//! `poll=50ms`, `retention=10m`, `timeout=3s`; the others (`ssl-mode`, …) go
//! to the driver.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Connection as _};

use self::session::MySessions;
use super::admin::Row;
use super::engine::{
    Dialect, Pick, Setup, SqlBackend, Started, busy_at, ensure_table, failed,
    fetch_i64_by_query_scalar, holder_text,
};
use super::pool::is_connection_error;
use super::shared::{SharedSql, Stmt, rows_and_exec};
use super::upkeep::micros;
use super::url::{Mode, UrlOptions};
use crate::backend::{
    AcquireRequest, Attempt, AttemptAll, HOLDER_ID_LEN, HolderRecord, Lease, Renewal, WakeSource,
    holder_id,
};
use crate::error::{BackendError, LockError};
use crate::token::FencingToken;

mod session;

/// The database clock in microseconds since the epoch, in SQL.
const N: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// Busy answers are at most this (µs + 1); tokens are above it (the clock
/// in µs passed it 13 days after 1970).
const BUSY_MAX: u64 = 1 << 40;

const DEFAULT_POLL: Duration = Duration::from_millis(50);
const POOL_SIZE: u32 = 10;
/// The largest renewal statement; bigger batches are split.
const MAX_BATCH: usize = 64;

#[derive(Debug, Clone)]
struct Statements {
    /// The grant without the holder record (it is in `<table>_procs`).
    acquire: Arc<str>,
    /// The grant with the holder record in the row.
    acquire_with_holder: Arc<str>,
    /// Writes a registry's record into `<table>_procs`, extending its cover.
    record: Arc<str>,
    peek: Arc<str>,
    /// By size: 1, 2, 4 … 64 entries.
    renew: Vec<Arc<str>>,
    still_held: Vec<Arc<str>>,
    release: Arc<str>,
    inspect: Arc<str>,
    list: Arc<str>,
    list_to_end: Arc<str>,
    revoke: Arc<str>,
    was_revoked: Arc<str>,
}

impl Statements {
    /// The statements on `table`; `procs`: whether `<table>_procs` holds
    /// the records (else only the rows' `holder` column does).
    fn new(table: &str, procs: bool) -> Self {
        let s = |sql: String| Arc::<str>::from(sql);
        let free = format!("((expires_us <= {N} OR owner = VALUES(owner)) AND shared_us <= {N})");
        let sizes = (0..).map(|p| 1usize << p).take_while(|n| *n <= MAX_BATCH);
        // `k IN (…)` lets the server use the primary key: MariaDB does not
        // for the row constructor alone (a full scan of a big table).
        let keys = |n: usize| vec!["?"; n].join(", ");
        let pairs = |n: usize| vec!["(?, ?)"; n].join(", ");
        // A row's record: its registry's `_procs` row, else its own column
        // when the grant wrote it (a grant that did not stored its time
        // negated: the column is an earlier grant's).
        let own = "IF(l.granted_us < 0, NULL, l.holder)";
        let held = if procs {
            format!(
                "SELECT l.k, l.owner, COALESCE(p.holder, {own}), l.token, ABS(l.granted_us), \
                 CAST(GREATEST(l.expires_us - {N}, 0) DIV 1000 AS SIGNED) \
                 FROM {table} l LEFT JOIN {table}_procs p \
                 ON p.id = LEFT(l.owner, {HOLDER_ID_LEN}) AND LENGTH(l.owner) = {}",
                2 * HOLDER_ID_LEN
            )
        } else {
            format!(
                "SELECT l.k, l.owner, {own}, l.token, ABS(l.granted_us), \
                 CAST(GREATEST(l.expires_us - {N}, 0) DIV 1000 AS SIGNED) FROM {table} l"
            )
        };
        let is_held = format!("l.owner IS NOT NULL AND l.expires_us > {N}");
        // The grant's time (and the record) are assigned before `owner` (F
        // reads it), the time kept for a retry by the owner. A grant that
        // leaves the row's record alone stores its time negated, so that
        // `inspect` does not take an earlier grant's record for its own.
        let acquire = |holder: bool| {
            let (column, value, set, granted) = if holder {
                (
                    ", holder",
                    ", ?",
                    format!("holder = IF({free}, VALUES(holder), holder), "),
                    N.to_owned(),
                )
            } else {
                ("", "", String::new(), format!("-{N}"))
            };
            s(format!(
                "INSERT INTO {table} (k, owner, token, expires_us{column}, granted_us) \
                 VALUES (?, ?, LAST_INSERT_ID({N}), {N} + ?{value}, {granted}) \
                 ON DUPLICATE KEY UPDATE \
                 token = IF({free}, LAST_INSERT_ID(GREATEST(token + 1, {N})), \
                            token + 0 * LAST_INSERT_ID(LEAST(GREATEST(expires_us - {N}, shared_us - {N}, 0), {}) + 1)), \
                 {set}\
                 granted_us = IF({free}, IF(owner <=> VALUES(owner), granted_us, {granted}), granted_us), \
                 owner = IF({free}, VALUES(owner), owner), \
                 expires_us = IF({free}, VALUES(expires_us), expires_us)",
                BUSY_MAX - 1
            ))
        };
        Statements {
            acquire: acquire(false),
            acquire_with_holder: acquire(true),
            record: s(format!(
                "INSERT INTO {table}_procs (id, holder, until_us) VALUES (?, ?, {N} + ?) \
                 ON DUPLICATE KEY UPDATE holder = VALUES(holder), \
                 until_us = GREATEST(until_us, VALUES(until_us))"
            )),
            peek: s(format!(
                "SELECT GREATEST(IF(owner IS NULL, 0, expires_us - {N}), shared_us - {N}, 0) \
                 FROM {table} WHERE k = ?"
            )),
            renew: sizes
                .clone()
                .map(|n| {
                    s(format!(
                        "UPDATE {table} SET expires_us = {N} + CASE {} END \
                         WHERE k IN ({}) AND (k, owner) IN ({}) AND expires_us > {N}",
                        "WHEN k = ? AND owner = ? THEN ? ".repeat(n),
                        keys(n),
                        pairs(n)
                    ))
                })
                .collect(),
            still_held: sizes
                .map(|n| {
                    s(format!(
                        "SELECT k, owner FROM {table} \
                         WHERE k IN ({}) AND (k, owner) IN ({}) AND expires_us > {N}",
                        keys(n),
                        pairs(n)
                    ))
                })
                .collect(),
            release: s(format!(
                "UPDATE {table} SET owner = NULL, expires_us = {N} WHERE k = ? AND owner = ?"
            )),
            inspect: s(format!("{held} WHERE l.k = ? AND {is_held}")),
            list: s(format!(
                "{held} WHERE l.k >= ? AND l.k < ? AND {is_held} ORDER BY l.k LIMIT ?"
            )),
            list_to_end: s(format!(
                "{held} WHERE l.k >= ? AND {is_held} ORDER BY l.k LIMIT ?"
            )),
            // `revoked` first: assignments run left to right.
            revoke: s(format!(
                "UPDATE {table} SET revoked = owner, owner = NULL, expires_us = {N} \
                 WHERE k = ? AND owner = ?"
            )),
            was_revoked: s(format!("SELECT 1 FROM {table} WHERE k = ? AND revoked = ?")),
        }
    }
}

/// MySQL or MariaDB: the lease table or `GET_LOCK`. See the [module docs](self).
/// Clones share the connections and the held session locks.
pub type MysqlBackend = SqlBackend<Mysql>;

/// MySQL's part of a [`MysqlBackend`]: its statements, and which holder
/// records this process has written into `<table>_procs`.
pub struct Mysql {
    sql: Statements,
    /// `None` without `<table>_procs` (and in session mode).
    records: Option<Records>,
    /// The URL's `timeout`: how late a statement sent now may still run.
    timeout: Duration,
}

/// The holder records this process wrote into `<table>_procs`, by holder
/// id: the record and until when (this process's clock, from before the
/// write was sent) the row covers the id's grants. Entries whose cover
/// ended are dropped when another is written, so it holds about the
/// registries that acquired within the last leases.
#[derive(Debug, Default)]
struct Records {
    covered: Mutex<HashMap<String, (Arc<HolderRecord>, Instant)>>,
    /// The ids whose rows a renewal is extending in the background.
    extending: Mutex<HashSet<String>>,
}

/// An extension of the row of `id` in flight: clears its mark when it
/// ends, however it ends.
struct Extending {
    backend: MysqlBackend,
    id: String,
}

impl Drop for Extending {
    fn drop(&mut self) {
        if let Some(records) = &self.backend.dialect.records {
            records.extending().remove(&self.id);
        }
    }
}

impl Records {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Arc<HolderRecord>, Instant)>> {
        self.covered.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn extending(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.extending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the row of `id` holds `holder` and covers until `until`.
    fn covers(&self, id: &str, holder: &HolderRecord, until: Instant) -> bool {
        self.map()
            .get(id)
            .is_some_and(|(h, covered)| **h == *holder && *covered >= until)
    }

    fn written(&self, id: &str, holder: Arc<HolderRecord>, until: Instant) {
        let mut map = self.map();
        let now = Instant::now();
        map.retain(|_, (_, covered)| *covered > now);
        let entry = map.entry(id.to_owned()).or_insert((holder.clone(), until));
        if entry.0 != holder {
            *entry = (holder, until);
        } else {
            entry.1 = entry.1.max(until);
        }
    }
}

fn error_number(err: &sqlx::Error) -> Option<u16> {
    match err {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

/// Transient: deadlock (1213), lock wait timeout (1205), too many
/// connections (1040), shutdown (1053), killed or interrupted (1317, 1927),
/// read-only during a failover (1290, 1836), idle disconnect (4031).
fn my_error(err: sqlx::Error) -> BackendError {
    let transient = is_connection_error(&err)
        || matches!(
            error_number(&err),
            Some(1213 | 1205 | 1040 | 1053 | 1317 | 1927 | 1290 | 1836 | 4031)
        );
    if transient {
        BackendError::transient(err)
    } else {
        BackendError::permanent(err)
    }
}

fn pool_options(max: u32, timeout: Duration) -> MySqlPoolOptions {
    let lock_wait = timeout.as_secs().max(1);
    MySqlPoolOptions::new()
        .max_connections(max)
        .min_connections(0)
        .acquire_timeout(timeout)
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                // READ COMMITTED (stricter levels fail the upsert with
                // deadlocks on gaps), and row-lock waits bounded like calls.
                // (`SET TRANSACTION` takes no other assignment; MySQL 8 and
                // MariaDB name the isolation variable differently.)
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; \
                     SET SESSION innodb_lock_wait_timeout = {lock_wait}"
                )))
                .execute(&mut *conn)
                .await?;
                Ok(())
            })
        })
}

impl MysqlBackend {
    /// The tables dlock creates (with `?create=true`, the default), for DBAs
    /// who create them themselves (`?create=false`): the lease table
    /// (`?table=`, default `dlock_leases`), session mode's counters
    /// (`<table>_fence`), the semaphores' and readers' rows
    /// (`<table>_holders`) and the registries' holder records
    /// (`<table>_procs`; without it, lease rows keep their own). Keys are
    /// binary: no collation folds case or trailing spaces.
    pub const DDL: &'static str = "CREATE TABLE IF NOT EXISTS dlock_leases (\n    \
        k          VARBINARY(1024) NOT NULL PRIMARY KEY,\n    \
        owner      VARBINARY(255),\n    \
        token      BIGINT UNSIGNED NOT NULL,\n    \
        expires_us BIGINT          NOT NULL,\n    \
        holder     VARBINARY(1024),\n    \
        granted_us BIGINT,\n    \
        revoked    VARBINARY(255),\n    \
        shared_us  BIGINT          NOT NULL DEFAULT 0,\n    \
        wwait_owner VARBINARY(255),\n    \
        wwait_us   BIGINT          NOT NULL DEFAULT 0,\n    \
        wwait_token BIGINT UNSIGNED NOT NULL DEFAULT 0\n) ENGINE = InnoDB;\n\
        CREATE TABLE IF NOT EXISTS dlock_leases_fence (\n    \
        k          BIGINT          NOT NULL PRIMARY KEY,\n    \
        token      BIGINT UNSIGNED NOT NULL,\n    \
        name       VARBINARY(1024),\n    \
        holder     VARBINARY(1024),\n    \
        granted_us BIGINT,\n    \
        permits    INT,\n    \
        slot       INT\n) ENGINE = InnoDB;\n\
        CREATE TABLE IF NOT EXISTS dlock_leases_holders (\n    \
        k          VARBINARY(1024) NOT NULL,\n    \
        slot       BIGINT          NOT NULL,\n    \
        permits    BIGINT          NOT NULL,\n    \
        owner      VARBINARY(255),\n    \
        token      BIGINT          NOT NULL,\n    \
        expires_us BIGINT          NOT NULL,\n    \
        holder     VARBINARY(1024),\n    \
        granted_us BIGINT,\n    \
        revoked    VARBINARY(255),\n    \
        PRIMARY KEY (k, slot)\n) ENGINE = InnoDB;\n\
        CREATE TABLE IF NOT EXISTS dlock_leases_procs (\n    \
        id         VARBINARY(16)   NOT NULL PRIMARY KEY,\n    \
        holder     VARBINARY(1024),\n    \
        until_us   BIGINT          NOT NULL\n) ENGINE = InnoDB;";

    /// Connects to the database a `mysql://` URL names, creating (or
    /// checking) the table. See the [module docs](self) for the options.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::open(url).await
    }

    async fn renew_chunk(
        &self,
        chunk: &[(&Lease, Duration)],
    ) -> Result<Vec<Renewal>, BackendError> {
        let size = chunk.len().next_power_of_two();
        let slot = size.trailing_zeros() as usize;
        // Padded with the last entry again: the same row, the same answer.
        let entries: Vec<(String, String, i64)> = (0..size)
            .map(|i| {
                let (lease, ttl) = chunk[i.min(chunk.len() - 1)];
                (lease.key.clone(), lease.owner.clone(), micros(ttl))
            })
            .collect();
        let matched = self
            .db
            .call("renew", |c| {
                let sql = self.dialect.sql.renew[slot].clone();
                let entries = entries.clone();
                Box::pin(async move {
                    let mut query = sqlx::query(AssertSqlSafe(sql));
                    for (key, owner, ttl) in &entries {
                        query = query.bind(key.clone()).bind(owner.clone()).bind(*ttl);
                    }
                    for (key, _, _) in &entries {
                        query = query.bind(key.clone());
                    }
                    for (key, owner, _) in &entries {
                        query = query.bind(key.clone()).bind(owner.clone());
                    }
                    query.execute(c).await.map(|done| done.rows_affected())
                })
            })
            .await?;
        if matched as usize >= chunk.len() {
            return Ok(vec![Renewal::Renewed; chunk.len()]);
        }
        let held: Vec<(Vec<u8>, Vec<u8>)> = self
            .db
            .call("renew", |c| {
                let sql = self.dialect.sql.still_held[slot].clone();
                let entries = entries.clone();
                Box::pin(async move {
                    let mut query = sqlx::query_as(AssertSqlSafe(sql));
                    for (key, _, _) in &entries {
                        query = query.bind(key.clone());
                    }
                    for (key, owner, _) in &entries {
                        query = query.bind(key.clone()).bind(owner.clone());
                    }
                    query.fetch_all(c).await
                })
            })
            .await?;
        Ok(chunk
            .iter()
            .map(|(lease, _)| {
                if held
                    .iter()
                    .any(|(k, o)| k == lease.key.as_bytes() && o == lease.owner.as_bytes())
                {
                    Renewal::Renewed
                } else {
                    Renewal::Lost
                }
            })
            .collect())
    }
}

/// The acquire statement with its arguments bound: the holder record when
/// the row keeps it.
fn acquire_query(
    sql: Arc<str>,
    key: String,
    owner: String,
    lease_us: i64,
    holder: Option<String>,
) -> sqlx::query::Query<'static, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    let query = sqlx::query(AssertSqlSafe(sql))
        .bind(key)
        .bind(owner)
        .bind(lease_us);
    match holder {
        Some(holder) => query.bind(holder),
        None => query,
    }
}

/// The holder record a grant whose record is in `<table>_procs` carries
/// (its registry's), so that its renewals write the row again whenever it
/// would not cover them — also after this process forgot it, its cover
/// having ended while writes failed, or after the row was deleted.
fn lease_record(lease: &Lease) -> Option<Arc<HolderRecord>> {
    lease.extra.clone()?.downcast::<HolderRecord>().ok()
}

/// A grant of `request`, carrying the registry's record when the grant's
/// row does not (`holder` is `None`: the record is in `<table>_procs`).
fn granted(request: &AcquireRequest, token: u64, holder: &Option<String>) -> Lease {
    let lease = Lease::new(request, Some(FencingToken::new(token)));
    match holder {
        None => lease.with_extra(request.holder.clone()),
        Some(_) => lease,
    }
}

/// How long a `_procs` row written now covers grants and renewals of
/// `lease`: twice (lease + timeout), so that it is extended about once a
/// lease.
fn record_cover(lease: Duration, timeout: Duration) -> Duration {
    lease.saturating_add(timeout).saturating_mul(2)
}

impl MysqlBackend {
    /// Makes sure `<table>_procs` holds `holder` under the holder id `owner`
    /// starts with, covering a grant of `lease` sent now: answers the
    /// acquire statement to send and the record to bind with it (`None`:
    /// the row's column is left alone). Writes the row only when this
    /// process has not written it or its cover would end too soon.
    async fn record_for_grant(
        &self,
        owner: &str,
        holder: &Arc<HolderRecord>,
        lease: Duration,
    ) -> Result<(Arc<str>, Option<String>), BackendError> {
        let sql = &self.dialect.sql;
        let (Some(records), Some(id)) = (&self.dialect.records, holder_id(owner)) else {
            return Ok((
                sql.acquire_with_holder.clone(),
                Some(holder_text(holder, Mysql::HOLDER_MAX)),
            ));
        };
        let timeout = self.dialect.timeout;
        let needed = crate::time::saturating_add(Instant::now(), lease.saturating_add(timeout));
        if !records.covers(id, holder, needed) {
            self.write_record(owner, id, holder.clone(), record_cover(lease, timeout))
                .await?;
        }
        Ok((sql.acquire.clone(), None))
    }

    /// Extends the `_procs` rows of a renewal batch's holder ids where the
    /// renewals would outlast them, in the background: a row still covers
    /// the renewal's lease when its extension starts (it is extended once
    /// less than a lease and `timeout` is left), so the renewal does not
    /// wait for it — a slow or locked row would otherwise hold up every
    /// renewal of its registry by up to `timeout`, enough to lose a short
    /// lease. One extension per id at a time; a failure is only logged,
    /// and the next renewal tries again.
    fn extend_records(&self, chunk: &[(&Lease, Duration)]) {
        let Some(records) = &self.dialect.records else {
            return;
        };
        let timeout = self.dialect.timeout;
        let now = Instant::now();
        let mut stale: HashMap<&str, (Arc<HolderRecord>, Duration)> = HashMap::new();
        for (lease, ttl) in chunk {
            // Grants whose record is in `_procs` carry it (see `try_lease`).
            let (Some(id), Some(holder)) = (holder_id(&lease.owner), lease_record(lease)) else {
                continue;
            };
            let needed = crate::time::saturating_add(now, ttl.saturating_add(timeout));
            if !records.covers(id, &holder, needed) {
                let cover = stale.entry(id).or_insert((holder, Duration::ZERO));
                cover.1 = cover.1.max(record_cover(*ttl, timeout));
            }
        }
        for (id, (holder, cover)) in stale {
            if !records.extending().insert(id.to_owned()) {
                continue;
            }
            let extending = Extending {
                backend: self.clone(),
                id: id.to_owned(),
            };
            let owner = chunk
                .iter()
                .map(|(lease, _)| lease.owner.clone())
                .find(|owner| owner.starts_with(id))
                .unwrap_or_else(|| id.to_owned());
            crate::driver::handle().spawn(async move {
                let Extending { backend, id } = &extending;
                if let Err(err) = backend.write_record(&owner, id, holder, cover).await {
                    tracing::debug!(error = %err, "dlock: mysql: extending a holder record failed");
                }
            });
        }
    }

    /// Writes `holder` as the `_procs` row of `id`, covering `cover` from now.
    async fn write_record(
        &self,
        owner: &str,
        id: &str,
        holder: Arc<HolderRecord>,
        cover: Duration,
    ) -> Result<(), BackendError> {
        let Some(records) = &self.dialect.records else {
            return Ok(());
        };
        let sent = Instant::now();
        let text = holder_text(&holder, Mysql::HOLDER_MAX);
        self.db
            .call_for(owner, "record", |c| {
                let sql = self.dialect.sql.record.clone();
                let (id, text) = (id.to_owned(), text.clone());
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(id)
                        .bind(text)
                        .bind(micros(cover))
                        .execute(c)
                        .await
                })
            })
            .await?;
        records.written(id, holder, crate::time::saturating_add(sent, cover));
        Ok(())
    }
}

/// Whether `<table>_procs` is there to hold the registries' holder records:
/// created when missing (with `create`). Without it (a schema made before
/// it, with `create=false`, or a role that may not create it) the lease
/// rows keep their records, as dlock did before the table.
async fn procs_table(pool: &MySqlPool, table: &str, create: bool) -> Result<bool, LockError> {
    let procs = format!("{table}_procs");
    let check = format!("SELECT id, holder, until_us FROM {procs} LIMIT 0");
    let (pool, table) = (pool.clone(), table.to_owned());
    let ensured = crate::driver::run(async move {
        ensure_table::<Mysql>(pool, &table, &procs, create, &check, 3).await
    })
    .await;
    match ensured {
        Ok(()) => Ok(true),
        Err(err) if err.is_retryable() => Err(err),
        Err(err) => {
            tracing::info!(
                error = %err,
                "dlock: mysql: no holder-record table; lease rows keep their holder records"
            );
            Ok(false)
        }
    }
}

impl Dialect for Mysql {
    type Db = sqlx::MySql;
    type Options = MySqlConnectOptions;
    type Facts = ();
    type Sessions = MySessions;

    const KIND: &'static str = "mysql";
    const NAME: &'static str = "MysqlBackend";
    const SCHEME: &'static str = "mysql://";
    const SCHEMES: &'static [&'static str] = &["mysql", "mariadb"];
    const DEFAULT_POLL: Duration = DEFAULT_POLL;
    const DDL: &'static str = MysqlBackend::DDL;
    const LEASE_COLUMNS: &'static str = "k, owner, token, expires_us";
    const HOLDERS_COLUMNS: &'static str =
        "k, slot, permits, owner, token, expires_us, holder, granted_us, revoked";

    fn classify(err: sqlx::Error) -> BackendError {
        my_error(err)
    }

    fn options(
        o: &mut UrlOptions,
        shown: &str,
        base: &str,
    ) -> Result<MySqlConnectOptions, LockError> {
        let driver_url = o.driver_url(Self::SCHEME, base);
        MySqlConnectOptions::from_str(&driver_url).map_err(|e| {
            LockError::config(format!(
                "bad MySQL URL `{shown}`: {}",
                e.to_string().replace(&driver_url, shown)
            ))
        })
    }

    fn lease_pool(
        options: MySqlConnectOptions,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<MySqlPool, sqlx::Error>> {
        Box::pin(async move { pool_options(POOL_SIZE, timeout).connect_with(options).await })
    }

    fn inspect(
        pool: MySqlPool,
        mode: Mode,
        shown_url: String,
    ) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(async move {
            if mode != Mode::Session {
                return Ok(());
            }
            let galera: Option<(String, String)> = sqlx::query_as("SHOW VARIABLES LIKE 'wsrep_on'")
                .fetch_optional(&pool)
                .await
                .map_err(|e| failed::<Self>(format!("cannot query {shown_url}: {e}"), e))?;
            if galera.is_some_and(|(_, on)| on.eq_ignore_ascii_case("on")) {
                return Err(LockError::config(format!(
                    "`{shown_url}` is a Galera cluster node (wsrep_on = ON): GET_LOCK is not \
                     replicated there; use lease mode (no `mode=session`)"
                )));
            }
            Ok(())
        })
    }

    fn schema_missing(err: &sqlx::Error) -> Option<bool> {
        // 1146: no such table (1054: no such column).
        match error_number(err) {
            Some(1146) => Some(true),
            Some(1054) => Some(false),
            _ => None,
        }
    }

    fn create_table(pool: MySqlPool, ddl: String) -> BoxFuture<'static, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::raw_sql(AssertSqlSafe(ddl))
                .execute(&pool)
                .await
                .map(|_| ())
        })
    }

    fn created_meanwhile(err: &sqlx::Error) -> bool {
        // 1050: created by another process in between.
        error_number(err) == Some(1050)
    }

    fn start(setup: Setup<'_, Self>) -> BoxFuture<'_, Result<Started<Self>, LockError>> {
        let target = setup.target;
        Box::pin(async move {
            let sessions = match target.mode {
                Mode::Lease => None,
                Mode::Session => Some(
                    MySessions::new(target.options.clone(), &target.table, target.timeout).await,
                ),
            };
            let records = match target.mode {
                Mode::Lease => procs_table(setup.pool, &target.table, target.create).await?,
                Mode::Session => false,
            };
            let dialect = Mysql {
                sql: Statements::new(&target.table, records),
                records: records.then(Records::default),
                timeout: target.timeout,
            };
            Ok((dialect, sessions))
        })
    }

    fetch_i64_by_query_scalar!();
    rows_and_exec!(Vec<u8>, sqlx::MySqlConnection);

    const SHARED_COLUMNS: &'static str = "shared_us, wwait_owner, wwait_us, wwait_token";

    fn add_shared_columns(table: &str) -> Vec<String> {
        [
            "shared_us BIGINT NOT NULL DEFAULT 0",
            "wwait_owner VARBINARY(255)",
            "wwait_us BIGINT NOT NULL DEFAULT 0",
            "wwait_token BIGINT UNSIGNED NOT NULL DEFAULT 0",
        ]
        .iter()
        .map(|column| format!("ALTER TABLE {table} ADD COLUMN {column}"))
        .collect()
    }

    fn collect_holders_sql(table: &str) -> String {
        format!("DELETE FROM {table}_holders WHERE expires_us < {N} - ? LIMIT 10000")
    }

    fn collect_records_sql(&self, table: &str) -> Option<String> {
        self.records
            .as_ref()
            .map(|_| format!("DELETE FROM {table}_procs WHERE until_us < {N} - ? LIMIT 10000"))
    }

    fn shared_sql(&self, table: &str) -> SharedSql {
        let h = format!("{table}_holders");
        let left = |at: &str| format!("CAST(CEIL(GREATEST({at} - {N}, 0) / 1000) AS SIGNED)");
        let live = format!("owner IS NOT NULL AND expires_us > {N}");
        let entry = format!(
            "SELECT k, owner, holder, token, granted_us, {}, slot, permits FROM {h}",
            left("expires_us")
        );
        SharedSql {
            ensure: Stmt::new(
                format!(
                    "INSERT INTO {table} (k, owner, token, expires_us) \
                     VALUES (?, NULL, 0, {N}) ON DUPLICATE KEY UPDATE token = token"
                ),
                &[0],
            ),
            lock: Stmt::new(
                format!(
                    "SELECT CASE WHEN owner IS NOT NULL AND expires_us > {N} THEN {} END, \
                            CASE WHEN wwait_owner IS NOT NULL AND wwait_owner <> ? \
                                      AND wwait_us > {N} AND wwait_token = token THEN {} END \
                     FROM {table} WHERE k = ? FOR UPDATE",
                    left("expires_us"),
                    left("wwait_us")
                ),
                &[1, 0],
            ),
            holders: Stmt::new(
                format!(
                    "SELECT slot, permits, owner, {} FROM {h} WHERE k = ? AND {live} ORDER BY slot",
                    left("expires_us")
                ),
                &[0],
            ),
            // `granted_us` before `owner`: assignments run left to right.
            // The share ends no later than the `shared_us` that `share`
            // raised just before (`{N}` is read again by each statement).
            take: Stmt::new(
                format!(
                    "INSERT INTO {h} (k, slot, permits, owner, token, expires_us, holder, granted_us) \
                     VALUES (?, ?, ?, ?, IF(? >= 0, ?, {N}), \
                             LEAST({N} + ? * 1000, (SELECT shared_us FROM {table} WHERE k = ?)), ?, {N}) \
                     ON DUPLICATE KEY UPDATE \
                     token = IF(? >= 0, ?, GREATEST(token + 1, {N})), \
                     granted_us = IF(owner <=> ?, granted_us, {N}), \
                     permits = VALUES(permits), owner = VALUES(owner), \
                     expires_us = VALUES(expires_us), holder = VALUES(holder)"
                ),
                &[0, 1, 2, 3, 6, 6, 4, 0, 5, 6, 6, 3],
            ),
            lock_holders: None,
            slot_token: Some(Stmt::new(
                format!("SELECT token FROM {h} WHERE k = ? AND slot = ?"),
                &[0, 1],
            )),
            share: Stmt::new(
                format!(
                    "UPDATE {table} SET shared_us = GREATEST(shared_us, {N} + ? * 1000), \
                     token = IF(? = 1, GREATEST(token + 1, {N}), token) WHERE k = ?"
                ),
                &[1, 2, 0],
            ),
            key_token: Some(Stmt::new(
                format!("SELECT CAST(token AS SIGNED) FROM {table} WHERE k = ?"),
                &[0],
            )),
            grant: None,
            open: None,
            grant_commit: None,
            wanted: None,
            mark_writer: Stmt::new(
                format!(
                    "UPDATE {table} SET wwait_token = token, wwait_us = {N} + ? * 1000, \
                     wwait_owner = ? \
                     WHERE k = ? AND (wwait_owner IS NULL OR wwait_owner = ? \
                        OR wwait_us <= {N} OR wwait_token <> token)"
                ),
                &[2, 1, 0, 1],
            ),
            unmark_writer: Stmt::new(
                format!("UPDATE {table} SET wwait_owner = NULL WHERE k = ? AND wwait_owner = ?"),
                &[0, 1],
            ),
            renew_holder: Stmt::new(
                format!(
                    "UPDATE {h} SET expires_us = {N} + ? * 1000 \
                     WHERE k = ? AND owner = ? AND (? < 0 OR slot = ?) AND expires_us > {N}"
                ),
                &[3, 0, 2, 1, 1],
            ),
            free_holder: Stmt::new(
                format!(
                    "UPDATE {h} SET owner = NULL, expires_us = {N} \
                     WHERE k = ? AND owner = ? AND (? < 0 OR slot = ?)"
                ),
                &[0, 2, 1, 1],
            ),
            reshare: Stmt::new(
                format!(
                    "UPDATE {table} SET shared_us = COALESCE((SELECT MAX(h.expires_us) FROM {h} h \
                       WHERE h.k = ? AND h.owner IS NOT NULL AND h.expires_us > {N}), 0), \
                     wwait_owner = IF(wwait_owner <=> ?, NULL, wwait_owner) WHERE k = ?"
                ),
                &[0, 1, 0],
            ),
            notify: None,
            release: None,
            release_now: None,
            was_revoked: Stmt::new(
                format!(
                    "SELECT CAST(1 AS SIGNED) FROM {h} WHERE k = ? AND (? < 0 OR slot = ?) \
                     AND revoked = ?"
                ),
                &[0, 1, 1, 2],
            ),
            inspect: Stmt::new(
                format!("{entry} WHERE k = ? AND {live} ORDER BY slot"),
                &[0],
            ),
            inspect_range: Stmt::new(
                format!("{entry} WHERE k >= ? AND k <= ? AND {live} ORDER BY k, slot"),
                &[0, 1],
            ),
            list: Stmt::new(
                format!(
                    "SELECT k FROM {table} WHERE k >= ? AND k < ? AND shared_us > {N} \
                     ORDER BY k LIMIT ?"
                ),
                &[0, 1, 2],
            ),
            list_to_end: Stmt::new(
                format!(
                    "SELECT k FROM {table} WHERE k >= ? AND shared_us > {N} ORDER BY k LIMIT ?"
                ),
                &[0, 1],
            ),
            // `revoked` first: assignments run left to right.
            revoke: Stmt::new(
                format!(
                    "UPDATE {h} SET revoked = owner, owner = NULL, expires_us = {N} \
                     WHERE k = ? AND {live}"
                ),
                &[0],
            ),
        }
    }

    async fn try_lease(
        backend: &MysqlBackend,
        request: &AcquireRequest,
    ) -> Result<Attempt, BackendError> {
        let backoff = backend
            .contenders
            .next_backoff(&request.owner, backend.poll);
        if let Some(backoff) = backoff {
            // A waiter polls a lock-free read, and writes only when the key
            // looks free.
            let remaining: Option<i64> = backend
                .db
                .call("peek", |c| {
                    let sql = backend.dialect.sql.peek.clone();
                    let key = request.key.clone();
                    Box::pin(async move {
                        sqlx::query_scalar(AssertSqlSafe(sql))
                            .bind(key)
                            .fetch_optional(c)
                            .await
                    })
                })
                .await?;
            if let Some(us) = remaining.filter(|us| *us > 0) {
                return Ok(Attempt::Busy {
                    retry_in: Some(backoff.min(Duration::from_micros(us as u64))),
                });
            }
        }
        let lease_us = micros(request.lease);
        let (sql, holder) = backend
            .record_for_grant(&request.owner, &request.holder, request.lease)
            .await?;
        let id = backend
            .db
            .call_for(&request.owner, "acquire", |c| {
                let sql = sql.clone();
                let (key, owner) = (request.key.clone(), request.owner.clone());
                let holder = holder.clone();
                Box::pin(async move {
                    acquire_query(sql, key, owner, lease_us, holder)
                        .execute(c)
                        .await
                        .map(|done| done.last_insert_id())
                })
            })
            .await?;
        match id {
            0 => Err(BackendError::permanent(
                "mysql: the acquire statement reported no outcome (LAST_INSERT_ID = 0)",
            )),
            busy if busy <= BUSY_MAX => {
                let remaining = Duration::from_micros(busy - 1);
                Ok(Attempt::Busy {
                    retry_in: Some(backoff.map_or(remaining, |b| b.min(remaining))),
                })
            }
            token => Ok(Attempt::Held(granted(request, token, &holder))),
        }
    }

    async fn try_leases(
        backend: &MysqlBackend,
        requests: &[AcquireRequest],
    ) -> Result<AttemptAll, BackendError> {
        let Some(first) = requests.first() else {
            return Ok(AttemptAll::Held(Vec::new()));
        };
        let keys: Vec<String> = requests.iter().map(|r| r.key.clone()).collect();
        let lease_us = micros(first.lease);
        let (sql, holder) = backend
            .record_for_grant(&first.owner, &first.holder, first.lease)
            .await?;
        // Each id as `try_lease` reads it; the first busy one ends it.
        let ids: Vec<u64> = backend
            .db
            .call_for(&first.owner, "acquire several", |c| {
                let sql = sql.clone();
                let (keys, owner) = (keys.clone(), first.owner.clone());
                let holder = holder.clone();
                Box::pin(async move {
                    let mut tx = c.begin().await?;
                    let mut ids = Vec::with_capacity(keys.len());
                    for key in keys {
                        let id = acquire_query(
                            sql.clone(),
                            key,
                            owner.clone(),
                            lease_us,
                            holder.clone(),
                        )
                        .execute(&mut *tx)
                        .await?
                        .last_insert_id();
                        ids.push(id);
                        if id <= BUSY_MAX {
                            tx.rollback().await?;
                            return Ok(ids);
                        }
                    }
                    tx.commit().await?;
                    Ok(ids)
                })
            })
            .await?;
        match ids.iter().position(|&id| id <= BUSY_MAX) {
            None => Ok(AttemptAll::Held(
                requests
                    .iter()
                    .zip(ids)
                    .map(|(r, token)| granted(r, token, &holder))
                    .collect(),
            )),
            Some(i) if ids[i] == 0 => Err(BackendError::permanent(
                "mysql: the acquire statement reported no outcome (LAST_INSERT_ID = 0)",
            )),
            Some(i) => {
                let remaining = Duration::from_micros(ids[i] - 1);
                let backoff = backend.contenders.next_backoff(&first.owner, backend.poll);
                busy_at(
                    i,
                    Attempt::Busy {
                        retry_in: Some(backoff.map_or(remaining, |b| b.min(remaining))),
                    },
                )
            }
        }
    }

    fn lease_wake(_backend: &MysqlBackend, source: WakeSource) -> WakeSource {
        // The others are polled with back-off (see `try_lease`).
        source
    }

    async fn renew_leases(
        backend: &MysqlBackend,
        batch: &[(&Lease, Duration)],
    ) -> Result<Vec<Renewal>, BackendError> {
        let mut answers = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(MAX_BATCH) {
            backend.extend_records(chunk);
            answers.extend(backend.renew_chunk(chunk).await?);
        }
        Ok(answers)
    }

    async fn release_lease(backend: &MysqlBackend, lease: &Lease) -> Result<(), BackendError> {
        backend
            .db
            .call_for(&lease.owner, "release", |c| {
                let sql = backend.dialect.sql.release.clone();
                let (key, owner) = (lease.key.clone(), lease.owner.clone());
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .execute(c)
                        .await
                })
            })
            .await
            .map(|_| ())
    }

    fn collect_sql(table: &str, mode: Mode) -> String {
        match mode {
            Mode::Lease => format!(
                "DELETE FROM {table} WHERE GREATEST(expires_us, shared_us) < {N} - ? LIMIT 10000"
            ),
            Mode::Session => {
                format!("DELETE FROM {table}_fence WHERE token < {N} - ? LIMIT 10000")
            }
        }
    }

    fn retention(retention: Duration) -> i64 {
        micros(retention)
    }

    fn debug_fields(backend: &MysqlBackend, d: &mut fmt::DebugStruct<'_, '_>) {
        d.field("poll", &backend.poll);
    }

    const HOLDER_COLUMNS: &'static str = "holder, granted_us, revoked";
    const GRANTED_UNIT: Duration = Duration::from_micros(1);
    const HOLDER_MAX: usize = 1024;

    fn add_holder_columns(table: &str) -> Vec<String> {
        [
            "holder VARBINARY(1024)",
            "granted_us BIGINT",
            "revoked VARBINARY(255)",
        ]
        .iter()
        .map(|column| format!("ALTER TABLE {table} ADD COLUMN {column}"))
        .collect()
    }

    const FENCE_COLUMNS: &'static str = "name, holder, granted_us, permits, slot";

    const SESSION_READERS: bool = false;

    fn add_fence_columns(table: &str) -> Vec<String> {
        [
            "name VARBINARY(1024)",
            "holder VARBINARY(1024)",
            "granted_us BIGINT",
            "permits INT",
            "slot INT",
        ]
        .iter()
        .map(|column| format!("ALTER TABLE {table}_fence ADD COLUMN {column}"))
        .collect()
    }

    fn column_exists(err: &sqlx::Error) -> bool {
        // 1060: duplicate column name.
        error_number(err) == Some(1060)
    }

    async fn held_rows(backend: &MysqlBackend, pick: Pick) -> Result<Vec<Row>, BackendError> {
        type Held = (Vec<u8>, Vec<u8>, Option<Vec<u8>>, u64, Option<i64>, i64);
        let rows: Vec<Held> = backend
            .db
            .call("inspect", |c| {
                let sql = &backend.dialect.sql;
                let pick = pick.clone();
                let query = match &pick {
                    Pick::Key(_) => sql.inspect.clone(),
                    Pick::Range { to: Some(_), .. } => sql.list.clone(),
                    Pick::Range { to: None, .. } => sql.list_to_end.clone(),
                };
                Box::pin(async move {
                    let query = sqlx::query_as(AssertSqlSafe(query));
                    match pick {
                        Pick::Key(key) => query.bind(key),
                        Pick::Range { from, to, limit } => match to {
                            Some(to) => query.bind(from).bind(to).bind(limit),
                            None => query.bind(from).bind(limit),
                        },
                    }
                    .fetch_all(c)
                    .await
                })
            })
            .await?;
        let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
        Ok(rows
            .into_iter()
            .map(
                |(key, owner, holder, token, granted_at, expires_in_ms)| Row {
                    key: text(key),
                    owner: text(owner),
                    holder: holder.map(text),
                    token: i64::try_from(token).unwrap_or(i64::MAX),
                    granted_at,
                    expires_in_ms,
                },
            )
            .collect())
    }

    async fn revoke_row(
        backend: &MysqlBackend,
        key: &str,
        owner: &str,
    ) -> Result<bool, BackendError> {
        let freed = backend
            .db
            .call("revoke", |c| {
                let sql = backend.dialect.sql.revoke.clone();
                let (key, owner) = (key.to_owned(), owner.to_owned());
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .execute(c)
                        .await
                        .map(|done| done.rows_affected())
                })
            })
            .await?;
        // Waiters elsewhere poll: they find the row free.
        Ok(freed > 0)
    }

    async fn was_revoked(
        backend: &MysqlBackend,
        key: &str,
        owner: &str,
    ) -> Result<bool, BackendError> {
        let found: Option<i32> = backend
            .db
            .call("renew", |c| {
                let sql = backend.dialect.sql.was_revoked.clone();
                let (key, owner) = (key.to_owned(), owner.to_owned());
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .fetch_optional(c)
                        .await
                })
            })
            .await?;
        Ok(found.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::backend::sql::engine::Target;

    fn parse_url(url: &str) -> Result<Target<MySqlConnectOptions>, LockError> {
        Target::parse::<Mysql>(url)
    }

    #[test]
    fn urls() {
        let t = parse_url("mysql://u:p@h:3306/db?mode=session&table=locks&poll=20ms").unwrap();
        assert_eq!(t.mode, Mode::Session);
        assert_eq!(t.table, "locks");
        assert_eq!(t.poll, Duration::from_millis(20));
        assert_eq!(t.options.get_host(), "h");
        assert_eq!(t.options.get_database(), Some("db"));
        for bad in [
            "mysql://h/db?mode=x",
            "mysql://h/db?table=a-b",
            "mysql://h/db?timeout=0s",
            "redis://h/db",
        ] {
            assert!(
                matches!(parse_url(bad), Err(LockError::Config { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn renewal_statements_come_in_powers_of_two() {
        let s = Statements::new("t", true);
        assert_eq!(s.renew.len(), 7);
        assert_eq!(s.renew[2].matches("WHEN k = ?").count(), 4);
        assert_eq!(s.still_held[6].matches("(?, ?)").count(), 64);
        // The expiry is assigned last: the test of the others reads it.
        let a = &s.acquire;
        assert!(a.rfind("expires_us = IF") > a.rfind("owner = IF"));
        assert!(a.rfind("owner = IF") > a.rfind("token = IF"));
    }
}
