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
//! -- F = (expires_us <= N OR owner = ?): free, expired, or ours (a retry)
//! INSERT INTO dlock_leases (k, owner, token, expires_us) VALUES (?, ?, LAST_INSERT_ID(N), N + ?)
//! ON DUPLICATE KEY UPDATE
//!   token      = IF(F, LAST_INSERT_ID(GREATEST(token + 1, N)),
//!                  token + 0 * LAST_INSERT_ID(LEAST(GREATEST(expires_us - N, 0), 2^40 - 1) + 1)),
//!   owner      = IF(F, ?, owner),
//!   expires_us = IF(F, N + ?, expires_us);    -- assigned last: F reads it
//! ```
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
//! the table is checked, never created — see [`MysqlBackend::DDL`]),
//! `poll=50ms`, `retention=10m`, `timeout=3s`; the others (`ssl-mode`, …) go
//! to the driver.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt as _;
use futures_util::future::BoxFuture;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Either};

use super::common::{
    Checked, Collector, Contenders, DEFAULT_RETENTION, Mode, Pooled, UrlOptions, batch_failed,
    is_connection_error, micros, session_hash,
};
use super::session::{Locked, SessionDb, Sessions};
use crate::backend::wait::Waiters;
use crate::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal, WakeSource};
use crate::error::{BackendError, LockError, redact_url};
use crate::token::FencingToken;

/// The database clock in microseconds since the epoch, in SQL.
const N: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// Busy answers are at most this (µs + 1); tokens are above it (the clock
/// in µs passed it 13 days after 1970).
const BUSY_MAX: u64 = 1 << 40;

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);
const DEFAULT_POLL: Duration = Duration::from_millis(50);
const POOL_SIZE: u32 = 10;
const MAX_SESSIONS: u32 = 1024;
/// The largest renewal statement; bigger batches are split.
const MAX_BATCH: usize = 64;

#[derive(Debug, Clone)]
struct Statements {
    acquire: Arc<str>,
    peek: Arc<str>,
    /// By size: 1, 2, 4 … 64 entries.
    renew: Vec<Arc<str>>,
    still_held: Vec<Arc<str>>,
    release: Arc<str>,
    collect: Arc<str>,
    collect_fence: Arc<str>,
}

impl Statements {
    fn new(table: &str) -> Self {
        let s = |sql: String| Arc::<str>::from(sql);
        let free = format!("(expires_us <= {N} OR owner = ?)");
        let sizes = (0..).map(|p| 1usize << p).take_while(|n| *n <= MAX_BATCH);
        // `k IN (…)` lets the server use the primary key: MariaDB does not
        // for the row constructor alone (a full scan of a big table).
        let keys = |n: usize| vec!["?"; n].join(", ");
        let pairs = |n: usize| vec!["(?, ?)"; n].join(", ");
        Statements {
            acquire: s(format!(
                "INSERT INTO {table} (k, owner, token, expires_us) \
                 VALUES (?, ?, LAST_INSERT_ID({N}), {N} + ?) \
                 ON DUPLICATE KEY UPDATE \
                 token = IF({free}, LAST_INSERT_ID(GREATEST(token + 1, {N})), \
                            token + 0 * LAST_INSERT_ID(LEAST(GREATEST(expires_us - {N}, 0), {}) + 1)), \
                 owner = IF({free}, ?, owner), \
                 expires_us = IF({free}, {N} + ?, expires_us)",
                BUSY_MAX - 1
            )),
            peek: s(format!(
                "SELECT IF(owner IS NULL, 0, GREATEST(expires_us - {N}, 0)) FROM {table} WHERE k = ?"
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
            collect: s(format!(
                "DELETE FROM {table} WHERE expires_us < {N} - ? LIMIT 10000"
            )),
            collect_fence: s(format!(
                "DELETE FROM {table}_fence WHERE token < {N} - ? LIMIT 10000"
            )),
        }
    }
}

/// MySQL or MariaDB: the lease table or `GET_LOCK`. See the [module docs](self).
/// Clones share the connections and the held session locks.
#[derive(Clone)]
pub struct MysqlBackend {
    shown_url: String,
    table: String,
    mode: Mode,
    db: Pooled<sqlx::MySql>,
    sql: Statements,
    poll: Duration,
    waiters: Arc<Waiters>,
    contenders: Arc<Contenders>,
    collector: Arc<Collector>,
    sessions: Option<Arc<Sessions<MySessions>>>,
}

impl fmt::Debug for MysqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlBackend")
            .field("url", &self.shown_url)
            .field("mode", &self.mode)
            .field("table", &self.table)
            .field("poll", &self.poll)
            .field("sessions", &self.sessions.as_ref().map(|s| s.len()))
            .finish_non_exhaustive()
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

struct Target {
    mode: Mode,
    table: String,
    create: bool,
    poll: Duration,
    retention: Duration,
    timeout: Duration,
    options: MySqlConnectOptions,
}

fn parse_url(url: &str) -> Result<Target, LockError> {
    let shown = redact_url(url);
    let (_, rest) = url
        .split_once("://")
        .filter(|(s, _)| matches!(s.to_ascii_lowercase().as_str(), "mysql" | "mariadb"))
        .ok_or_else(|| LockError::config(format!("`{shown}` is not a mysql:// URL")))?;
    let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut o = UrlOptions::parse("mysql://", query)?;
    let mode = o.mode()?;
    let table = o.table()?;
    let create = o.flag("create", true)?;
    let poll = o.duration("poll", DEFAULT_POLL, false)?;
    let retention = o.duration("retention", DEFAULT_RETENTION, true)?;
    let timeout = o.duration("timeout", DEFAULT_TIMEOUT, false)?;
    let rest = o.rest();
    let driver_url = if rest.is_empty() {
        format!("mysql://{base}")
    } else {
        format!("mysql://{base}?{rest}")
    };
    let options = MySqlConnectOptions::from_str(&driver_url).map_err(|e| {
        LockError::config(format!(
            "bad MySQL URL `{shown}`: {}",
            e.to_string().replace(&driver_url, &redact_url(&driver_url))
        ))
    })?;
    Ok(Target {
        mode,
        table,
        create,
        poll,
        retention,
        timeout,
        options,
    })
}

/// Wraps a connect-time failure.
fn connect_error(shown_url: &str, what: &str, e: sqlx::Error) -> LockError {
    let message = format!("{what} {shown_url}: {e}");
    LockError::Backend {
        backend: "mysql",
        source: if my_error(e).is_retryable() {
            BackendError::transient(message)
        } else {
            BackendError::permanent(message)
        },
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
    /// (`?table=`, default `dlock_leases`) and session mode's counters
    /// (`<table>_fence`). Keys are binary: no collation folds case or
    /// trailing spaces.
    pub const DDL: &'static str = "CREATE TABLE IF NOT EXISTS dlock_leases (\n    \
        k          VARBINARY(1024) NOT NULL PRIMARY KEY,\n    \
        owner      VARBINARY(255),\n    \
        token      BIGINT UNSIGNED NOT NULL,\n    \
        expires_us BIGINT          NOT NULL\n) ENGINE = InnoDB;\n\
        CREATE TABLE IF NOT EXISTS dlock_leases_fence (\n    \
        k     BIGINT          NOT NULL PRIMARY KEY,\n    \
        token BIGINT UNSIGNED NOT NULL\n) ENGINE = InnoDB;";

    /// Connects to the database a `mysql://` URL names, creating (or
    /// checking) the table. See the [module docs](self) for the options.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let shown_url = redact_url(url);
        let target = parse_url(url)?;
        let timeout = target.timeout;
        let options = target.options.clone();
        let pool = tokio::time::timeout(
            timeout,
            crate::driver::run(async move {
                pool_options(POOL_SIZE, timeout).connect_with(options).await
            }),
        )
        .await
        .map_err(|_| LockError::Backend {
            backend: "mysql",
            source: super::common::timed_out(&format!("connecting to {shown_url}"), timeout),
        })?
        .map_err(|e| connect_error(&shown_url, "cannot connect to", e))?;
        if target.mode == Mode::Session {
            let galera: Option<(String, String)> = {
                let pool = pool.clone();
                crate::driver::run(async move {
                    sqlx::query_as("SHOW VARIABLES LIKE 'wsrep_on'")
                        .fetch_optional(&pool)
                        .await
                })
                .await
                .map_err(|e| connect_error(&shown_url, "cannot query", e))?
            };
            if galera.is_some_and(|(_, on)| on.eq_ignore_ascii_case("on")) {
                return Err(LockError::config(format!(
                    "`{shown_url}` is a Galera cluster node (wsrep_on = ON): GET_LOCK is not \
                     replicated there; use lease mode (no `mode=session`)"
                )));
            }
        }
        {
            let (pool, table, create, mode) = (
                pool.clone(),
                target.table.clone(),
                target.create,
                target.mode,
            );
            crate::driver::run(async move { ensure_schema(&pool, &table, create, mode).await })
                .await?;
        }
        let sessions = match target.mode {
            Mode::Lease => None,
            Mode::Session => {
                let options = target.options.clone();
                let pool = crate::driver::run(async move {
                    pool_options(MAX_SESSIONS, timeout)
                        .idle_timeout(Duration::from_secs(60))
                        .connect_lazy_with(options)
                })
                .await;
                Some(Arc::new(Sessions::new(
                    MySessions {
                        pool,
                        fence: format!("{}_fence", target.table),
                    },
                    timeout,
                )))
            }
        };
        Ok(MysqlBackend {
            shown_url,
            sql: Statements::new(&target.table),
            table: target.table,
            mode: target.mode,
            db: Pooled {
                pool,
                timeout,
                classify: my_error,
            },
            poll: target.poll,
            waiters: Arc::default(),
            contenders: Arc::default(),
            collector: Arc::new(Collector::new(target.retention)),
            sessions,
        })
    }

    /// Rows in the lease table (held and free), for tests of bounded state.
    pub async fn row_count(&self) -> Result<u64, LockError> {
        let sql = Arc::<str>::from(format!("SELECT COUNT(*) FROM {}", self.table));
        self.db
            .call("count", |c| {
                let sql = sql.clone();
                Box::pin(async move {
                    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
                        .fetch_one(c)
                        .await
                })
            })
            .await
            .map(|n| n as u64)
            .map_err(|e| e.into_lock_error("mysql"))
    }

    async fn try_lease(&self, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        let backoff = self.contenders.next_backoff(&request.owner, self.poll);
        if let Some(backoff) = backoff {
            // A waiter polls a lock-free read, and writes only when the key
            // looks free.
            let remaining: Option<i64> = self
                .db
                .call("peek", |c| {
                    let sql = self.sql.peek.clone();
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
        let id = self
            .db
            .call("acquire", |c| {
                let sql = self.sql.acquire.clone();
                let (key, owner) = (request.key.clone(), request.owner.clone());
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner.clone())
                        .bind(lease_us)
                        // F, then F and the new owner, then F and the lease.
                        .bind(owner.clone())
                        .bind(owner.clone())
                        .bind(owner.clone())
                        .bind(owner)
                        .bind(lease_us)
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
            token => Ok(Attempt::Held(Lease::new(
                request,
                Some(FencingToken::new(token)),
            ))),
        }
    }

    async fn renew_leases(
        &self,
        batch: &[(&Lease, Duration)],
    ) -> Result<Vec<Renewal>, BackendError> {
        let mut answers = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(MAX_BATCH) {
            answers.extend(self.renew_chunk(chunk).await?);
        }
        Ok(answers)
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
                let sql = self.sql.renew[slot].clone();
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
                let sql = self.sql.still_held[slot].clone();
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

    async fn release_lease(&self, lease: &Lease) -> Result<(), BackendError> {
        self.db
            .call("release", |c| {
                let sql = self.sql.release.clone();
                let (key, owner) = (lease.key.clone(), lease.owner.clone());
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .execute(c)
                        .await
                })
            })
            .await?;
        self.waiters.wake(&lease.key);
        self.collect_if_due();
        Ok(())
    }

    fn collect_if_due(&self) {
        if !self.collector.due() {
            return;
        }
        let pool = self.db.pool.clone();
        let retention = micros(self.collector.retention);
        let sql = match self.mode {
            Mode::Lease => self.sql.collect.clone(),
            Mode::Session => self.sql.collect_fence.clone(),
        };
        crate::driver::handle().spawn(async move {
            if let Err(err) = sqlx::query(AssertSqlSafe(sql))
                .bind(retention)
                .execute(&pool)
                .await
            {
                tracing::debug!(error = %err, "dlock mysql: collecting free rows failed; next time");
            }
        });
    }
}

async fn ensure_schema(
    pool: &MySqlPool,
    table: &str,
    create: bool,
    mode: Mode,
) -> Result<(), LockError> {
    let check = match mode {
        Mode::Lease => format!("SELECT k, owner, token, expires_us FROM {table} LIMIT 0"),
        Mode::Session => format!("SELECT k, token FROM {table}_fence LIMIT 0"),
    };
    let missing = match sqlx::query(AssertSqlSafe(check.clone()))
        .execute(pool)
        .await
    {
        Ok(_) => return Ok(()),
        // 1146: no such table (1054: no such column).
        Err(e) if error_number(&e) == Some(1146) && create => e,
        Err(e) => {
            return Err(if matches!(error_number(&e), Some(1146 | 1054)) {
                LockError::config(format!(
                    "the lock table `{table}` is missing or lacks dlock's columns ({e}); \
                     create it (see MysqlBackend::DDL, with your table name) or connect with \
                     `?create=true`"
                ))
            } else {
                LockError::Backend {
                    backend: "mysql",
                    source: my_error(e),
                }
            });
        }
    };
    tracing::debug!(table, error = %missing, "dlock mysql: creating the lock table");
    let ddl = MysqlBackend::DDL
        .replace("dlock_leases_fence", &format!("{table}_fence"))
        .replace("dlock_leases ", &format!("{table} "));
    let ddl = match mode {
        Mode::Lease => ddl.split_inclusive(';').next(),
        Mode::Session => ddl.split_inclusive(';').nth(1),
    }
    .unwrap_or_default()
    .to_owned();
    match sqlx::raw_sql(AssertSqlSafe(ddl)).execute(pool).await {
        // 1050: created by another process in between.
        Err(e) if error_number(&e) != Some(1050) => {
            let message = format!("cannot create the lock table `{table}`: {e}");
            return Err(LockError::Backend {
                backend: "mysql",
                source: if my_error(e).is_retryable() {
                    BackendError::transient(message)
                } else {
                    BackendError::permanent(message)
                },
            });
        }
        _ => {}
    }
    sqlx::query(AssertSqlSafe(check))
        .execute(pool)
        .await
        .map(|_| ())
        .map_err(|e| LockError::Backend {
            backend: "mysql",
            source: my_error(e),
        })
}

impl LockBackend for MysqlBackend {
    fn kind(&self) -> &'static str {
        "mysql"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => sessions.try_acquire(request).await,
                None => self.try_lease(request).await,
            }
        })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let source = match self.mode {
            // The server hands the key over: attempts wait on it.
            Mode::Session => WakeSource::none(),
            // Releases in this process wake at once; the others are polled
            // with back-off (see `try_lease`).
            Mode::Lease => self
                .waiters
                .source(&request.key)
                .keep_alive(self.contenders.register(&request.owner)),
        };
        Box::pin(std::future::ready(source))
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Some(sessions) = &self.sessions {
                sessions.release(&request.owner).await;
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => Ok(sessions.renew(lease, ttl).await),
                None => Ok(self.renew_leases(&[(lease, ttl)]).await?[0]),
            }
        })
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => {
                    futures_util::future::join_all(
                        batch.iter().map(|(lease, ttl)| async move {
                            Ok(sessions.renew(lease, *ttl).await)
                        }),
                    )
                    .await
                }
                None => match self.renew_leases(batch).await {
                    Ok(answers) => answers.into_iter().map(Ok).collect(),
                    Err(err) => batch_failed("mysql", err, batch.len()),
                },
            }
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => {
                    sessions.release(&lease.owner).await;
                    self.collect_if_due();
                    Ok(())
                }
                None => self.release_lease(lease).await,
            }
        })
    }
}

/// `GET_LOCK` on dedicated connections.
struct MySessions {
    pool: MySqlPool,
    fence: String,
}

/// `wait_timeout` is whole seconds, at least 1: rounded up, so the server
/// never frees a lock before the holder's lease ends.
fn idle_seconds(ttl: Duration) -> u64 {
    (ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).max(1)
}

impl SessionDb for MySessions {
    type Conn = Checked<sqlx::MySql>;

    fn open(&self, fresh: bool) -> BoxFuture<'_, Result<Self::Conn, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = Checked::new(self.pool.acquire().await?);
            if fresh {
                // After a failure: make sure this one is alive.
                use sqlx::Connection as _;
                conn.conn().ping().await?;
            }
            Ok(conn)
        })
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        wait: Duration,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Locked, sqlx::Error>> {
        Box::pin(async move {
            let k = session_hash(key);
            let name = format!("dlock:{:016x}", k as u64);
            let fence = &self.fence;
            let wait = format!("{}.{:03}", wait.as_secs(), wait.subsec_millis());
            // One round trip: the lock (waiting up to `wait`), the token in
            // the same statement, and the idle limit only if the lock is ours.
            let sql = format!(
                "INSERT INTO {fence} (k, token) SELECT {k}, LAST_INSERT_ID({N}) FROM DUAL \
                 WHERE GET_LOCK('{name}', {wait}) = 1 \
                 ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(GREATEST(token + 1, {N})); \
                 SET SESSION wait_timeout = \
                 IF(IS_USED_LOCK('{name}') = CONNECTION_ID(), {}, @@GLOBAL.wait_timeout)",
                idle_seconds(ttl)
            );
            let results: Vec<Either<sqlx::mysql::MySqlQueryResult, sqlx::mysql::MySqlRow>> =
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .fetch_many(conn.conn())
                    .try_collect()
                    .await?;
            let inserted = results.iter().find_map(|r| match r {
                Either::Left(done) => Some((done.rows_affected(), done.last_insert_id())),
                Either::Right(_) => None,
            });
            match inserted {
                Some((rows, token)) if rows > 0 => Ok(Locked::Yes(token)),
                // GET_LOCK answered 0 (timeout) or NULL: nothing is held,
                // and the idle limit is the server's default again.
                Some(_) => Ok(Locked::Busy { clean: true }),
                None => Err(sqlx::Error::Protocol(
                    "the session lock statement answered nothing".into(),
                )),
            }
        })
    }

    fn ping<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = format!("SET SESSION wait_timeout = {}", idle_seconds(ttl));
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(conn.conn())
                .await?;
            Ok(())
        })
    }

    fn unlock<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::raw_sql(
                "DO RELEASE_ALL_LOCKS(); SET SESSION wait_timeout = @@GLOBAL.wait_timeout",
            )
            .execute(conn.conn())
            .await?;
            Ok(())
        })
    }

    fn watch<'a>(&'a self, _conn: &'a mut Self::Conn) -> BoxFuture<'a, String> {
        // sqlx cannot watch an idle MySQL connection: a killed one is
        // noticed by the next ping (a third of the lease).
        Box::pin(std::future::pending())
    }

    fn recycle(&self, conn: Self::Conn) {
        conn.keep();
    }

    fn classify(&self, err: sqlx::Error) -> BackendError {
        my_error(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn idle_limits_round_up_to_seconds() {
        assert_eq!(idle_seconds(Duration::from_millis(600)), 1);
        assert_eq!(idle_seconds(Duration::from_secs(2)), 2);
        assert_eq!(idle_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(idle_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn renewal_statements_come_in_powers_of_two() {
        let s = Statements::new("t");
        assert_eq!(s.renew.len(), 7);
        assert_eq!(s.renew[2].matches("WHEN k = ?").count(), 4);
        assert_eq!(s.still_held[6].matches("(?, ?)").count(), 64);
        // The expiry is assigned last: the test of the others reads it.
        let a = &s.acquire;
        assert!(a.rfind("expires_us = IF") > a.rfind("owner = IF"));
        assert!(a.rfind("owner = IF") > a.rfind("token = IF"));
    }
}
