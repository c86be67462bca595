//! The lease table on SQLite (`sqlite://path`): the embedded default.
//!
//! Works between processes on one machine (the database file is the shared
//! state; WAL mode, a busy timeout). SQLite has no server to push a release
//! to other processes, so dlock rings a doorbell instead: waiters in *this*
//! process are woken at once by the releasing call, and waiters in other
//! processes by a file-change notification on the key's bell file in
//! `<database>.dlock-bells/` (at most 256 files; inotify on Linux), which the
//! releasing process writes after its commit — a handoff between processes
//! takes about a millisecond, not a polling interval (the protocol is in
//! `doorbell.rs`).
//!
//! Waiters still look again every `poll` (25 ms by default,
//! `sqlite://path?poll=10ms`) and when the holder's lease runs out. The poll
//! is the fallback for a ring that does not arrive — a process whose watcher
//! could not be set up (no inotify, its watch limit reached, a read-only
//! directory), a release by an older dlock, a filesystem that does not report
//! writes made elsewhere — so it stays at 25 ms: a missed ring costs at most
//! what every cross-process handoff cost before the doorbells, and a poll is
//! one indexed read per waiter. Set `?poll=1s` or longer where every process
//! is known to hear the bells.
//!
//! Several keys of one hold (`lock_all`) are taken in one statement (one
//! transaction, under the database's write lock), in the runtime's canonical
//! order: every row, or none when one is held elsewhere (the waiter then
//! waits on that key's release and its holder's remaining lease).
//!
//! Tokens are hybrid — the larger of the row's token + 1 and the database
//! clock in microseconds — so they keep growing when a row is deleted (by an
//! operator, or by the collection of free rows older than `retention`, 10
//! minutes by default: `sqlite://path?retention=1m`).
//!
//! Semaphores and read-write locks use the same layout and algorithm as
//! the server databases (see `sql::shared`): holder rows in
//! `dlock_leases_holders` with their own expiry, the key's lease row as the
//! writer with `shared_until` and the waiting-writer mark, each share or
//! permit decided in one `BEGIN IMMEDIATE` transaction (SQLite's single
//! writer orders every decision), the release ringing the key's doorbell.
//! A table created by an earlier version gets the new columns added at open.
//!
//! Each grant stores its holder record (`holder`, and `granted_at` in
//! milliseconds on the database's clock); a revocation frees the row as a
//! release does, keeps the revoked owner in `revoked`, and rings the key's
//! doorbell. A table created by an earlier version gets the three columns
//! added (`ALTER TABLE … ADD COLUMN`) when a backend opens it; see
//! `sql::admin`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use self::doorbell::Doorbells;
use super::admin::{REVOKE_ATTEMPTS, Row, prefix_successor};
use super::ordered::Unanswered;
use super::shared::{self, Marks, SharedSql, SharedStore, Stmt, rows_and_exec};
use super::upkeep::{Collector, DEFAULT_RETENTION, millis};
use super::url::UrlOptions;
use crate::backend::wait::Waiters;
use crate::backend::{
    AcquireRequest, Attempt, AttemptAll, HeldEntry, HoldMode, KeyEntry, Lease, LockBackend,
    Renewal, WakeSource,
};
use crate::error::{BackendError, LockError};
use crate::token::FencingToken;

mod doorbell;

/// How long a statement waits for the database's write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long after its busy timeout a statement whose caller went away is
/// surely over (it ran, or gave up), generous for a loaded machine.
const ABANDONED_MARGIN: Duration = Duration::from_secs(2);

const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS dlock_leases (
    key        TEXT    PRIMARY KEY NOT NULL,
    owner      TEXT,
    token      INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    holder     TEXT,
    granted_at INTEGER,
    revoked    TEXT,
    shared_until INTEGER NOT NULL DEFAULT 0,
    wwait_owner  TEXT,
    wwait_until  INTEGER NOT NULL DEFAULT 0,
    wwait_token  INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID";

/// The holder rows of semaphores and read-write locks (see `sql::shared`).
const CREATE_HOLDERS: &str = "CREATE TABLE IF NOT EXISTS dlock_leases_holders (
    key        TEXT    NOT NULL,
    slot       INTEGER NOT NULL,
    permits    INTEGER NOT NULL,
    owner      TEXT,
    token      INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    holder     TEXT,
    granted_at INTEGER,
    revoked    TEXT,
    PRIMARY KEY (key, slot)
) WITHOUT ROWID";

/// The holder-record columns, added to a table created without them (see
/// `sql::admin`).
const HOLDER_COLUMNS: [(&str, &str); 7] = [
    ("holder", "TEXT"),
    ("granted_at", "INTEGER"),
    ("revoked", "TEXT"),
    ("shared_until", "INTEGER NOT NULL DEFAULT 0"),
    ("wwait_owner", "TEXT"),
    ("wwait_until", "INTEGER NOT NULL DEFAULT 0"),
    ("wwait_token", "INTEGER NOT NULL DEFAULT 0"),
];

// How a row is taken: the acquire's, and each row's of the acquire of
// several keys. A retry by the same owner keeps the first grant's time.
macro_rules! take_row {
    () => {
        "ON CONFLICT (key) DO UPDATE SET
        granted_at = CASE WHEN dlock_leases.owner IS excluded.owner
                          THEN dlock_leases.granted_at ELSE excluded.granted_at END,
        owner = excluded.owner,
        token = MAX(dlock_leases.token + 1, excluded.token),
        expires_at = excluded.expires_at,
        holder = excluded.holder
    WHERE (dlock_leases.owner IS NULL
       OR dlock_leases.owner = excluded.owner
       OR dlock_leases.expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER))
      AND dlock_leases.shared_until <= CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

// Held by another owner: the busy rows among the keys of `?1` (a JSON
// array) for owner `?2`.
macro_rules! held_elsewhere {
    () => {
        "SELECT key FROM dlock_leases
    WHERE key IN (SELECT value FROM json_each(?1))
      AND (owner IS NOT NULL AND owner <> ?2
           AND expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)
           OR shared_until > CAST(unixepoch('subsec') * 1000 AS INTEGER))"
    };
}

// `now` is the database's clock in milliseconds; every statement reads it once.
// A fresh row's token is the clock in µs; a taken-over row's the larger of
// its token + 1 and the clock in µs (hybrid: never lower after a deleted row).
// A retry by the same owner (an answer lost on the way) takes it again. The
// holder record (?4) goes with the grant.
const ACQUIRE: &str = concat!(
    "INSERT INTO dlock_leases (key, owner, token, expires_at, holder, granted_at)
    VALUES (?1, ?2, CAST(unixepoch('subsec') * 1000000 AS INTEGER),
            CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3,
            ?4, CAST(unixepoch('subsec') * 1000 AS INTEGER)) ",
    take_row!(),
    " RETURNING token"
);

// Several keys (`?1`, a JSON array) in one statement: SQLite runs a write
// statement under the database's write lock, so no other writer comes
// between the check that none is held elsewhere and the rows taken: every
// row comes back, or none.
const ACQUIRE_ALL: &str = concat!(
    "INSERT INTO dlock_leases (key, owner, token, expires_at, holder, granted_at)
    SELECT value, ?2, CAST(unixepoch('subsec') * 1000000 AS INTEGER),
           CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3,
           ?4, CAST(unixepoch('subsec') * 1000 AS INTEGER)
    FROM json_each(?1) WHERE NOT EXISTS (",
    held_elsewhere!(),
    ") ORDER BY value ",
    take_row!(),
    " RETURNING key, token"
);

const BUSY_OF: &str = concat!(held_elsewhere!(), " ORDER BY key LIMIT 1");

const REMAINING: &str =
    "SELECT MAX(CASE WHEN owner IS NULL THEN 0 ELSE expires_at END, shared_until)
        - CAST(unixepoch('subsec') * 1000 AS INTEGER)
    FROM dlock_leases WHERE key = ?1";

const RENEW: &str = "UPDATE dlock_leases
    SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3
    WHERE key = ?1 AND owner = ?2
      AND expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)";

// The row stays, free, with its token; `expires_at` records when it was freed.
const RELEASE: &str = "UPDATE dlock_leases
    SET owner = NULL, expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)
    WHERE key = ?1 AND owner = ?2";

// The held rows (an owner, an unexpired lease): one key (?1), or the keys
// from ?1 up to ?2 (NULL: no end) in key order, at most ?3.
const INSPECT: &str = "SELECT key, owner, holder, token, granted_at,
        expires_at - CAST(unixepoch('subsec') * 1000 AS INTEGER)
    FROM dlock_leases
    WHERE key = ?1 AND owner IS NOT NULL
      AND expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)";

const LIST: &str = "SELECT key, owner, holder, token, granted_at,
        expires_at - CAST(unixepoch('subsec') * 1000 AS INTEGER)
    FROM dlock_leases
    WHERE key >= ?1 AND (?2 IS NULL OR key < ?2) AND owner IS NOT NULL
      AND expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)
    ORDER BY key LIMIT ?3";

// Frees the row like a release, for the owner that was read (?2), and keeps
// who was revoked: that owner's next renewal answers `Revoked`.
const REVOKE: &str = "UPDATE dlock_leases
    SET owner = NULL, expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER), revoked = owner
    WHERE key = ?1 AND owner = ?2";

const WAS_REVOKED: &str = "SELECT 1 FROM dlock_leases WHERE key = ?1 AND revoked = ?2";

// Rows free (or expired) for longer than the retention (?1 ms). Safe with
// hybrid tokens: a key locked again later gets a token above every old one.
const COLLECT: &str = "DELETE FROM dlock_leases
    WHERE expires_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1
      AND shared_until < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1";

const COLLECT_HOLDERS: &str = "DELETE FROM dlock_leases_holders
    WHERE expires_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1";

/// `granted_at` is in milliseconds.
const GRANTED_UNIT: Duration = Duration::from_millis(1);

/// How often waiters look again by default, doorbell or not: the fallback
/// for a ring that does not arrive (see the [module docs](self)).
const DEFAULT_POLL: Duration = Duration::from_millis(25);

/// The lease table in a SQLite file (`sqlite://path`): the embedded default.
///
/// Works between processes on one machine (WAL mode, a busy timeout). Waiters
/// in this process are woken by the releasing call; waiters in other processes
/// by the doorbell the release rings (a file-change notification on
/// `<database>.dlock-bells/`, about a millisecond). All of them also look
/// again every `poll` (25 ms by default, `sqlite://path?poll=10ms`), the
/// fallback for a ring that does not arrive, and when the holder's lease runs
/// out. See [the SQL backends](super) for the table.
#[derive(Clone)]
pub struct SqliteBackend {
    pool: SqlitePool,
    path: PathBuf,
    poll: Duration,
    local_waiters: Arc<Waiters>,
    /// Wakes waiters in other processes (and hears their releases).
    doorbells: Arc<Doorbells>,
    /// When and which free rows are collected.
    collector: Arc<Collector>,
    /// The statements of semaphores and read-write locks.
    shared: Arc<SharedSql>,
    /// The owners whose waiting-writer marks may stand.
    marks: Arc<Marks>,
    /// The owners' work that their later statements wait for (see
    /// `ordered`): the marks sent from dlock's I/O runtime.
    unanswered: Arc<Unanswered>,
}

impl fmt::Debug for SqliteBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteBackend")
            .field("path", &self.path)
            .field("poll", &self.poll)
            .field("retention", &self.collector.retention)
            .finish_non_exhaustive()
    }
}

/// SQLITE_BUSY (5) or SQLITE_LOCKED (6), with their extended codes (low
/// byte): another connection holds the file a moment longer.
fn is_busy(err: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = err else {
        return false;
    };
    let code = db
        .code()
        .and_then(|c| c.parse::<i64>().ok())
        .map(|c| c & 0xff);
    matches!(code, Some(5 | 6))
}

fn sql_error(err: sqlx::Error) -> BackendError {
    match &err {
        sqlx::Error::Database(_) => {
            if is_busy(&err) {
                BackendError::transient(err)
            } else {
                BackendError::permanent(err)
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => BackendError::transient(err),
        _ => BackendError::permanent(err),
    }
}

impl SqliteBackend {
    /// Opens (creating if needed) the database a `sqlite://path` URL names and
    /// the lease table in it. `sqlite://relative/file.db`, `sqlite:///abs/file.db`;
    /// options `?poll=25ms` (how often waiters in other processes look again)
    /// and `retention=10m` (how long free rows are kept). The parent directory
    /// is created if missing.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let rest = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
            .ok_or_else(|| LockError::config(format!("`{url}` is not a sqlite:// URL")))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if path.is_empty() || path.contains(":memory:") {
            return Err(LockError::config(
                "sqlite:// needs a file path (`sqlite://target/locks.db`); an in-memory \
                 database cannot be shared between processes — use memory:// instead",
            ));
        }
        let mut options = UrlOptions::parse("sqlite://", query)?;
        let poll = options.duration("poll", DEFAULT_POLL, false)?;
        let retention = options.duration("retention", DEFAULT_RETENTION, true)?;
        options.refuse_rest("poll=<duration>, retention=<duration>")?;
        let mut backend = Self::open(PathBuf::from(path), poll).await?;
        backend.collector = Arc::new(Collector::new(retention));
        Ok(backend)
    }

    /// Opens (creating if needed) the database file at `path`.
    pub async fn open(path: impl Into<PathBuf>, poll: Duration) -> Result<Self, LockError> {
        let path = path.into();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                LockError::config(format!("cannot create {}: {e}", parent.display()))
            })?;
        }
        let options = SqliteConnectOptions::from_str("sqlite://")
            .map_err(|e| LockError::config(e.to_string()))?
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT);
        let shown = path.display().to_string();
        // The pool's connections belong to the runtime that opens them: open
        // them on dlock's own (see `driver`).
        let pool = crate::driver::run(async move {
            // Opening is answered SQLITE_BUSY at once, whatever the busy
            // timeout, while another process opens the file too (a new
            // file switched to WAL, a WAL recovery): tried again for as
            // long as a statement would wait.
            let deadline = tokio::time::Instant::now() + BUSY_TIMEOUT;
            loop {
                match open_pool(options.clone()).await {
                    Err(err) if is_busy(&err) && tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    opened => return opened,
                }
            }
        })
        .await
        .map_err(|e| LockError::Backend {
            backend: "sqlite",
            source: BackendError::permanent(format!("cannot open {shown}: {e}")),
        })?;
        Ok(SqliteBackend {
            pool,
            poll,
            local_waiters: Arc::default(),
            doorbells: Arc::new(Doorbells::new(&path)),
            collector: Arc::new(Collector::new(DEFAULT_RETENTION)),
            shared: Arc::new(shared_sql()),
            marks: Arc::default(),
            unanswered: Arc::default(),
            path,
        })
    }

    /// Rows in the lease table (held and free), for tests of bounded state.
    pub async fn row_count(&self) -> Result<u64, LockError> {
        let pool = self.pool.clone();
        crate::driver::run(async move {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM dlock_leases")
                .fetch_one(&pool)
                .await
        })
        .await
        .map(|n| n as u64)
        .map_err(|e| sql_error(e).into_lock_error("sqlite"))
    }

    /// Whether this backend hears other processes' releases through the
    /// doorbells: false until one of its waiters first waits, and when the
    /// watcher could not be set up (then its waiters poll).
    pub fn hears_doorbells(&self) -> bool {
        self.doorbells.watching()
    }

    /// Doorbell buckets this backend's waiters listen on right now (at most
    /// one per bucket with waiters), for tests of bounded state.
    pub fn doorbell_waits(&self) -> usize {
        self.doorbells.waited_buckets()
    }

    /// Deletes rows free (or expired) for longer than the retention, at most
    /// once a minute (or once a retention, if shorter).
    async fn collect_free_rows(&self) {
        if !self.collector.due() {
            return;
        }
        let retention = millis(self.collector.retention);
        let collected = async {
            sqlx::query(COLLECT_HOLDERS)
                .bind(retention)
                .execute(&self.pool)
                .await?;
            sqlx::query(COLLECT)
                .bind(retention)
                .execute(&self.pool)
                .await
        };
        if let Err(err) = collected.await {
            tracing::debug!(error = %err, "dlock sqlite: collecting free rows failed; next time");
        }
    }
}

/// Adds the holder-record columns to a table created without them. Another
/// process may add them meanwhile: a duplicate column counts as added.
/// The pool on `options`, with dlock's tables in its file.
async fn open_pool(options: SqliteConnectOptions) -> Result<SqlitePool, sqlx::Error> {
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        // A connection is a thread of this process: a ping before each call
        // (a round trip to that thread) would test nothing the call itself
        // does not.
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await?;
    sqlx::query(CREATE_TABLE).execute(&pool).await?;
    sqlx::query(CREATE_HOLDERS).execute(&pool).await?;
    add_holder_columns(&pool).await?;
    Ok(pool)
}

async fn add_holder_columns(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    let present: Vec<String> =
        sqlx::query_scalar("SELECT name FROM pragma_table_info('dlock_leases')")
            .fetch_all(pool)
            .await?;
    for (column, kind) in HOLDER_COLUMNS {
        if present.iter().any(|c| c == column) {
            continue;
        }
        let added = sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE dlock_leases ADD COLUMN {column} {kind}"
        )))
        .execute(pool)
        .await;
        match added {
            Err(sqlx::Error::Database(db)) if db.message().contains("duplicate column") => {}
            other => {
                other?;
            }
        }
    }
    Ok(())
}

/// A held row as `INSPECT` and `LIST` read it.
type HeldRow = (String, String, Option<String>, i64, Option<i64>, i64);

fn held_row((key, owner, holder, token, granted_at, expires_in_ms): HeldRow) -> Row {
    Row {
        key,
        owner,
        holder,
        token,
        granted_at,
        expires_in_ms,
    }
}

/// A connection running a statement of `owner`'s. Dropped before the
/// statement answered (a caller that went away), the statement goes on on
/// the connection's worker thread and may still take a key: a task on
/// dlock's I/O runtime waits behind it on the same connection (the worker
/// runs its commands in order, a dropped transaction's rollback first),
/// and until then the owner's later statements — the clean-up release of
/// the abandoned attempt first — wait (see `ordered`). So that release
/// frees what the late statement took, within a round trip of it. The
/// task's statement is a `ROLLBACK`, which also ends a transaction the
/// statement left open (see `SharedSql::open`).
struct Following<'a> {
    conn: Option<PoolConnection<sqlx::Sqlite>>,
    owner: &'a str,
    unanswered: &'a Arc<Unanswered>,
}

impl Following<'_> {
    fn conn(&mut self) -> &mut sqlx::SqliteConnection {
        self.conn.as_mut().expect("present until answered")
    }

    /// The statement answered.
    fn answered(mut self) {
        self.conn = None;
    }
}

impl Drop for Following<'_> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let done = self.unanswered.register(self.owner, None);
        crate::driver::handle().spawn(async move {
            // Bounded like the runtime's backstop: the late statement
            // waits for the write lock up to the busy timeout, then runs.
            let behind =
                tokio::time::timeout(BUSY_TIMEOUT + ABANDONED_MARGIN, roll_back_open(&mut conn))
                    .await;
            if !matches!(behind, Ok(true)) {
                conn.close_on_drop();
            }
            drop(conn);
            drop(done);
        });
    }
}

/// Ends the transaction a failed or abandoned statement may have left open
/// on `conn` (a folded `BEGIN`, see `SharedSql::open`: the driver knows
/// nothing of it): `ROLLBACK`, which SQLite refuses with "no transaction is
/// active" when there is none. Whether the connection is fit to be used
/// again.
async fn roll_back_open(conn: &mut sqlx::SqliteConnection) -> bool {
    match sqlx::query("ROLLBACK").execute(conn).await {
        Ok(_) => true,
        Err(sqlx::Error::Database(db)) => db.message().contains("no transaction is active"),
        Err(_) => false,
    }
}

impl SqliteBackend {
    /// Runs `statement` of `owner`'s on a connection, after the owner's
    /// statements still running, and followed if its caller leaves before
    /// the answer ([`Following`]).
    async fn owned<T, F>(&self, owner: &str, statement: F) -> Result<T, BackendError>
    where
        F: for<'c> FnOnce(&'c mut sqlx::SqliteConnection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        self.unanswered.wait_for(owner).await;
        let conn = self.pool.acquire().await.map_err(sql_error)?;
        let mut running = Following {
            conn: Some(conn),
            owner,
            unanswered: &self.unanswered,
        };
        let answer = statement(running.conn()).await;
        if answer.is_err()
            && !roll_back_open(running.conn()).await
            && let Some(conn) = running.conn.as_mut()
        {
            conn.close_on_drop();
        }
        running.answered();
        answer.map_err(sql_error)
    }

    /// How long the holder of the busy `key` has left (the waiter's next
    /// look); a lost doorbell listener is started again first.
    async fn remaining(&self, key: &str) -> Result<Duration, BackendError> {
        self.doorbells.relisten_if_lost();
        let remaining: Option<i64> = sqlx::query_scalar(REMAINING)
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(sql_error)?;
        Ok(Duration::from_millis(remaining.unwrap_or(0).max(0) as u64))
    }

    /// One attempt at a plain lock.
    async fn try_plain(&self, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        let (key, owner) = (request.key.clone(), request.owner.clone());
        let (ms, holder) = (millis(request.lease), request.holder.encode());
        let token: Option<i64> = self
            .owned(&request.owner, |c| {
                Box::pin(
                    sqlx::query_scalar(ACQUIRE)
                        .bind(key)
                        .bind(owner)
                        .bind(ms)
                        .bind(holder)
                        .fetch_optional(c),
                )
            })
            .await?;
        if let Some(token) = token {
            return Ok(Attempt::Held(Lease::new(
                request,
                Some(FencingToken::new(token as u64)),
            )));
        }
        Ok(Attempt::Busy {
            retry_in: Some(self.remaining(&request.key).await?),
        })
    }

    /// Renews one plain lease.
    async fn renew_plain(&self, lease: &Lease, ttl: Duration) -> Result<Renewal, BackendError> {
        let done = sqlx::query(RENEW)
            .bind(&lease.key)
            .bind(&lease.owner)
            .bind(millis(ttl))
            .execute(&self.pool)
            .await
            .map_err(sql_error)?;
        if done.rows_affected() == 1 {
            return Ok(Renewal::Renewed);
        }
        let revoked: Option<i64> = sqlx::query_scalar(WAS_REVOKED)
            .bind(&lease.key)
            .bind(&lease.owner)
            .fetch_optional(&self.pool)
            .await
            .map_err(sql_error)?;
        Ok(if revoked.is_some() {
            Renewal::Revoked
        } else {
            Renewal::Lost
        })
    }

    /// The held row of `key`, if any.
    async fn held(&self, key: &str) -> Result<Option<Row>, BackendError> {
        let row: Option<HeldRow> = sqlx::query_as(INSPECT)
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(sql_error)?;
        Ok(row.map(held_row))
    }
}

impl LockBackend for SqliteBackend {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn offers(&self, _mode: HoldMode) -> Result<(), String> {
        Ok(())
    }

    fn needs_io_runtime(&self) -> bool {
        // A connection is a thread of this process that answers calls from
        // any runtime (no socket tied to the runtime that opened it): calls
        // run where they are made, without a hop to dlock's I/O runtime.
        // A call dropped there goes on on that thread; the backstop release
        // comes after it (`abandoned_command_bound`).
        false
    }

    fn abandoned_command_bound(&self) -> Duration {
        // A statement whose caller went away goes on on its connection's
        // thread, waiting for the database's write lock up to the busy
        // timeout, then runs: the backstop release must come after it.
        BUSY_TIMEOUT + ABANDONED_MARGIN
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            match request.mode {
                HoldMode::Exclusive => match self.try_plain(request).await? {
                    busy @ Attempt::Busy { .. } => {
                        shared::exclusive_busy(self, request, busy).await
                    }
                    held => {
                        // A grant voids the attempt's mark.
                        self.marks.forget(&request.owner);
                        Ok(held)
                    }
                },
                _ => shared::try_shared(self, request).await,
            }
        })
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if request.mode == HoldMode::Exclusive
                && let Err(err) = shared::unmark_writer(self, &request.key, &request.owner).await
            {
                tracing::debug!(error = %err, "dlock sqlite: removing a writer mark failed; it expires");
            }
        })
    }

    fn try_acquire_all<'a>(
        &'a self,
        requests: &'a [AcquireRequest],
    ) -> Option<BoxFuture<'a, Result<AttemptAll, BackendError>>> {
        let first = requests.first()?;
        Some(Box::pin(async move {
            let keys = json_array(requests.iter().map(|r| r.key.as_str()));
            let (all, owner) = (keys.clone(), first.owner.clone());
            let (ms, holder) = (millis(first.lease), first.holder.encode());
            let taken: Vec<(String, i64)> = self
                .owned(&first.owner, |c| {
                    Box::pin(
                        sqlx::query_as(ACQUIRE_ALL)
                            .bind(all)
                            .bind(owner)
                            .bind(ms)
                            .bind(holder)
                            .fetch_all(c),
                    )
                })
                .await?;
            let token_of = |key: &str| {
                taken
                    .iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, token)| FencingToken::new(*token as u64))
            };
            let leases: Vec<Lease> = requests
                .iter()
                .map(|r| Lease::new(r, token_of(&r.key)))
                .collect();
            if leases.iter().all(|l| l.token.is_some()) {
                return Ok(AttemptAll::Held(leases));
            }
            for lease in leases.iter().filter(|l| l.token.is_some()) {
                // Not expected (one statement under the write lock): undone.
                self.release(lease).await?;
            }
            let busy: Option<String> = sqlx::query_scalar(BUSY_OF)
                .bind(&keys)
                .bind(&first.owner)
                .fetch_optional(&self.pool)
                .await
                .map_err(sql_error)?;
            Ok(
                match busy.and_then(|k| requests.iter().position(|r| r.key == k)) {
                    Some(i) => AttemptAll::Busy {
                        key: i,
                        retry_in: Some(self.remaining(&requests[i].key).await?),
                    },
                    // Free again since: look again at once.
                    None => AttemptAll::Busy {
                        key: 0,
                        retry_in: Some(Duration::ZERO),
                    },
                },
            )
        }))
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let key = &request.key;
        // Releases in this process wake at once, other processes' ring the
        // key's doorbell; the poll catches a ring that does not arrive.
        let mut source = self.local_waiters.source(key).poll_every(self.poll);
        if let Some(bell) = self.doorbells.source(key) {
            source = source.merge(bell);
        }
        Box::pin(std::future::ready(source))
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(async move {
            let shares: Vec<(&Lease, Duration)> = batch
                .iter()
                .filter(|(l, _)| l.mode != HoldMode::Exclusive)
                .copied()
                .collect();
            let mut shared_answers = if shares.is_empty() {
                Vec::new()
            } else {
                match shared::renew_shared(self, &shares).await {
                    Ok(answers) => answers.into_iter().map(Ok).collect(),
                    Err(err) => {
                        let text = err.to_string();
                        let retryable = err.is_retryable();
                        shares
                            .iter()
                            .map(|_| {
                                Err(if retryable {
                                    BackendError::transient(text.clone())
                                } else {
                                    BackendError::permanent(text.clone())
                                })
                            })
                            .collect()
                    }
                }
            }
            .into_iter();
            let plain = futures_util::future::join_all(
                batch
                    .iter()
                    .filter(|(l, _)| l.mode == HoldMode::Exclusive)
                    .map(|(lease, ttl)| self.renew_plain(lease, *ttl)),
            )
            .await;
            let mut plain = plain.into_iter();
            batch
                .iter()
                .map(|(l, _)| {
                    let next = if l.mode == HoldMode::Exclusive {
                        plain.next()
                    } else {
                        shared_answers.next()
                    };
                    next.unwrap_or_else(|| Err(BackendError::permanent("sqlite: no answer")))
                })
                .collect()
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let freed = match lease.mode {
                HoldMode::Exclusive => {
                    let done = self
                        .owned(&lease.owner, |c| {
                            Box::pin(
                                sqlx::query(RELEASE)
                                    .bind(lease.key.clone())
                                    .bind(lease.owner.clone())
                                    .execute(c),
                            )
                        })
                        .await?;
                    shared::unmark_writer(self, &lease.key, &lease.owner).await?;
                    done.rows_affected() > 0
                }
                _ => {
                    shared::release_shared(self, lease).await?;
                    true
                }
            };
            self.local_waiters.wake(&lease.key);
            if freed {
                // Committed: waiters elsewhere may look now.
                self.doorbells.ring(&lease.key);
            }
            self.collect_free_rows().await;
            Ok(())
        })
    }

    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        Box::pin(async move {
            // Waiters in other processes are not known: none are counted.
            let mut holders: Vec<HeldEntry> = self
                .held(key)
                .await?
                .map(|row| row.entry(GRANTED_UNIT))
                .into_iter()
                .collect();
            holders.extend(shared::shared_entries(self, key).await?);
            Ok((!holders.is_empty()).then(|| KeyEntry::new(key, holders)))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        Box::pin(async move {
            let rows: Vec<HeldRow> = sqlx::query_as(LIST)
                .bind(prefix)
                .bind(prefix_successor(prefix))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.pool)
                .await
                .map_err(sql_error)?;
            let mut keys: Vec<KeyEntry> = rows
                .into_iter()
                .map(held_row)
                .map(|row| KeyEntry::new(row.key.clone(), vec![row.entry(GRANTED_UNIT)]))
                .collect();
            let max = i64::try_from(limit).unwrap_or(i64::MAX);
            let to = prefix_successor(prefix);
            for (key, entries) in shared::shared_keys(self, prefix, to.as_deref(), max).await? {
                match keys.iter_mut().find(|k| k.key == key) {
                    Some(held) => held.holders.extend(entries),
                    None => keys.push(KeyEntry::new(key, entries)),
                }
            }
            keys.sort_by(|a, b| a.key.cmp(&b.key));
            keys.truncate(limit);
            Ok(keys)
        })
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        Box::pin(async move {
            let shares = shared::revoke_shared(self, key).await?;
            if !shares.is_empty() {
                self.local_waiters.wake(key);
                self.doorbells.ring(key);
            }
            for _ in 0..REVOKE_ATTEMPTS {
                let Some(row) = self.held(key).await? else {
                    return Ok(shares);
                };
                let done = sqlx::query(REVOKE)
                    .bind(key)
                    .bind(&row.owner)
                    .execute(&self.pool)
                    .await
                    .map_err(sql_error)?;
                if done.rows_affected() > 0 {
                    // Woken as by a release.
                    self.local_waiters.wake(key);
                    self.doorbells.ring(key);
                    let mut removed = vec![row.entry(GRANTED_UNIT)];
                    removed.extend(shares);
                    return Ok(removed);
                }
            }
            Err(BackendError::transient(format!(
                "sqlite: `{key}` changed hands {REVOKE_ATTEMPTS} times while being revoked"
            )))
        })
    }
}

/// `keys` as a JSON array of strings (for `json_each`).
fn json_array<'a>(keys: impl Iterator<Item = &'a str>) -> String {
    let mut out = String::from("[");
    for (i, key) in keys.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('"');
        for c in key.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push(']');
    out
}

/// The clock in milliseconds, in SQL.
const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// The statements of semaphores and read-write locks (see `sql::shared`).
/// One writer at a time (`BEGIN IMMEDIATE`) orders every decision.
fn shared_sql() -> SharedSql {
    let h = "dlock_leases_holders";
    let live = format!("owner IS NOT NULL AND expires_at > {NOW}");
    let entry = format!(
        "SELECT key, owner, holder, token, granted_at, expires_at - {NOW}, slot, permits FROM {h}"
    );
    let now_us = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";
    let ids = |n: usize| (0..n).collect::<Vec<_>>();
    let ensure = format!(
        "INSERT INTO dlock_leases (key, owner, token, expires_at) \
         VALUES (?1, NULL, 0, {NOW}) ON CONFLICT (key) DO NOTHING"
    );
    // No other writer between the lock and the read (`BEGIN IMMEDIATE`):
    // the holder rows are always the current ones.
    let lock_holders = format!(
        "SELECT CASE WHEN t.owner IS NOT NULL AND t.expires_at > {NOW} \
                     THEN t.expires_at - {NOW} END, \
                CASE WHEN t.wwait_owner IS NOT NULL AND t.wwait_owner <> ?2 \
                          AND t.wwait_until > {NOW} AND t.wwait_token = t.token \
                     THEN t.wwait_until - {NOW} END, \
                1, h.slot, h.permits, h.owner, h.expires_at - {NOW} \
         FROM dlock_leases t LEFT JOIN {h} h ON h.key = t.key \
              AND h.owner IS NOT NULL AND h.expires_at > {NOW} \
         WHERE t.key = ?1 ORDER BY h.slot"
    );
    // Two statements in one call to the connection's thread (each binds
    // the numbered arguments it names), in the caller's transaction: the
    // reader's token is the one the first just wrote, and the share ends no
    // later than the `shared_until` it raised (the clock may pass a
    // millisecond between the two).
    let grant = format!(
        "UPDATE dlock_leases SET shared_until = MAX(shared_until, {NOW} + ?5), \
         token = CASE WHEN ?7 = 1 THEN MAX(token + 1, {now_us}) ELSE token END \
         WHERE key = ?1; \
         INSERT INTO {h} (key, slot, permits, owner, token, expires_at, holder, granted_at) \
         VALUES (?1, ?2, ?3, ?4, \
                 CASE WHEN ?7 = 1 THEN (SELECT token FROM dlock_leases WHERE key = ?1) \
                      ELSE {now_us} END, \
                 MIN({NOW} + ?5, (SELECT shared_until FROM dlock_leases WHERE key = ?1)), \
                 ?6, {NOW}) \
         ON CONFLICT (key, slot) DO UPDATE SET \
             granted_at = CASE WHEN {h}.owner IS excluded.owner THEN {h}.granted_at \
                               ELSE excluded.granted_at END, \
             permits = excluded.permits, owner = excluded.owner, \
             token = CASE WHEN ?7 = 1 THEN excluded.token \
                          ELSE MAX({h}.token + 1, excluded.token) END, \
             expires_at = excluded.expires_at, holder = excluded.holder \
         RETURNING token"
    );
    let release = format!(
        "UPDATE {h} SET owner = NULL, expires_at = {NOW} \
         WHERE key = ?1 AND owner = ?3 AND (?2 < 0 OR slot = ?2); \
         UPDATE dlock_leases SET shared_until = COALESCE((SELECT MAX(h.expires_at) \
           FROM {h} h WHERE h.key = ?1 AND h.owner IS NOT NULL \
           AND h.expires_at > {NOW}), 0), \
         wwait_owner = NULLIF(wwait_owner, ?3) WHERE key = ?1"
    );
    SharedSql {
        ensure: Stmt::new(ensure.clone(), &ids(1)),
        lock: Stmt::new(
            format!(
                "SELECT CASE WHEN owner IS NOT NULL AND expires_at > {NOW} \
                             THEN expires_at - {NOW} END, \
                        CASE WHEN wwait_owner IS NOT NULL AND wwait_owner <> ?2 \
                                  AND wwait_until > {NOW} AND wwait_token = token \
                             THEN wwait_until - {NOW} END \
                 FROM dlock_leases WHERE key = ?1"
            ),
            &ids(2),
        ),
        holders: Stmt::new(
            format!(
                "SELECT slot, permits, owner, expires_at - {NOW} FROM {h} \
                 WHERE key = ?1 AND {live} ORDER BY slot"
            ),
            &ids(1),
        ),
        lock_holders: Some(Stmt::new(lock_holders.clone(), &ids(2))),
        take: Stmt::new(
            format!(
                "INSERT INTO {h} (key, slot, permits, owner, token, expires_at, holder, granted_at) \
                 VALUES (?1, ?2, ?3, ?4, CASE WHEN ?7 >= 0 THEN ?7 ELSE {now_us} END, \
                         {NOW} + ?5, ?6, {NOW}) \
                 ON CONFLICT (key, slot) DO UPDATE SET \
                     granted_at = CASE WHEN {h}.owner IS excluded.owner THEN {h}.granted_at \
                                       ELSE excluded.granted_at END, \
                     permits = excluded.permits, owner = excluded.owner, \
                     token = CASE WHEN ?7 >= 0 THEN ?7 ELSE MAX({h}.token + 1, excluded.token) END, \
                     expires_at = excluded.expires_at, holder = excluded.holder \
                 RETURNING token"
            ),
            &ids(7),
        ),
        slot_token: None,
        share: Stmt::new(
            format!(
                "UPDATE dlock_leases SET shared_until = MAX(shared_until, {NOW} + ?2), \
                 token = CASE WHEN ?3 = 1 THEN MAX(token + 1, {now_us}) ELSE token END \
                 WHERE key = ?1 RETURNING token"
            ),
            &ids(3),
        ),
        key_token: None,
        grant: Some(Stmt::new(grant.clone(), &ids(7))),
        // The transaction's ends folded into the statements beside them,
        // rolled back by `owned` (or its `Following`) when a call fails or
        // its caller leaves.
        open: Some(Stmt::new(
            format!("BEGIN IMMEDIATE; {ensure}; {lock_holders}"),
            &ids(2),
        )),
        grant_commit: Some(Stmt::new(format!("{grant}; COMMIT"), &ids(7))),
        wanted: None,
        mark_writer: Stmt::new(
            format!(
                "UPDATE dlock_leases SET wwait_owner = ?2, wwait_until = {NOW} + ?3, \
                 wwait_token = token \
                 WHERE key = ?1 AND (wwait_owner IS NULL OR wwait_owner = ?2 \
                    OR wwait_until <= {NOW} OR wwait_token <> token)"
            ),
            &ids(3),
        ),
        unmark_writer: Stmt::new(
            "UPDATE dlock_leases SET wwait_owner = NULL WHERE key = ?1 AND wwait_owner = ?2".into(),
            &ids(2),
        ),
        renew_holder: Stmt::new(
            format!(
                "UPDATE {h} SET expires_at = {NOW} + ?4 \
                 WHERE key = ?1 AND owner = ?3 AND (?2 < 0 OR slot = ?2) AND expires_at > {NOW}"
            ),
            &ids(4),
        ),
        free_holder: Stmt::new(
            format!(
                "UPDATE {h} SET owner = NULL, expires_at = {NOW} \
                 WHERE key = ?1 AND owner = ?3 AND (?2 < 0 OR slot = ?2)"
            ),
            &ids(3),
        ),
        reshare: Stmt::new(
            format!(
                "UPDATE dlock_leases SET shared_until = COALESCE((SELECT MAX(h.expires_at) \
                   FROM {h} h WHERE h.key = ?1 AND h.owner IS NOT NULL \
                   AND h.expires_at > {NOW}), 0), \
                 wwait_owner = NULLIF(wwait_owner, ?2) WHERE key = ?1"
            ),
            &ids(2),
        ),
        notify: None,
        // `free_holder` and `reshare` in one call, as `grant`.
        release: Some(Stmt::new(release.clone(), &ids(3))),
        release_now: Some(Stmt::new(
            format!("BEGIN IMMEDIATE; {release}; COMMIT"),
            &ids(3),
        )),
        was_revoked: Stmt::new(
            format!("SELECT 1 FROM {h} WHERE key = ?1 AND (?2 < 0 OR slot = ?2) AND revoked = ?3"),
            &ids(3),
        ),
        inspect: Stmt::new(
            format!("{entry} WHERE key = ?1 AND {live} ORDER BY slot"),
            &ids(1),
        ),
        inspect_range: Stmt::new(
            format!("{entry} WHERE key >= ?1 AND key <= ?2 AND {live} ORDER BY key, slot"),
            &ids(2),
        ),
        list: Stmt::new(
            format!(
                "SELECT key FROM dlock_leases WHERE key >= ?1 AND key < ?2 \
                 AND shared_until > {NOW} ORDER BY key LIMIT ?3"
            ),
            &ids(3),
        ),
        list_to_end: Stmt::new(
            format!(
                "SELECT key FROM dlock_leases WHERE key >= ?1 \
                 AND shared_until > {NOW} ORDER BY key LIMIT ?2"
            ),
            &ids(2),
        ),
        revoke: Stmt::new(
            format!(
                "UPDATE {h} SET revoked = owner, owner = NULL, expires_at = {NOW} \
                 WHERE key = ?1 AND {live}"
            ),
            &ids(1),
        ),
    }
}

impl SharedStore for SqliteBackend {
    type Db = sqlx::Sqlite;
    const GRANTED_UNIT: Duration = GRANTED_UNIT;
    const HOLDER_MAX: usize = usize::MAX;
    // One writer at a time from the start: a deferred transaction that
    // reads and then writes could not take the write lock.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const BEGIN_ORDERS: bool = true;

    fn sql(&self) -> Arc<SharedSql> {
        self.shared.clone()
    }

    fn poll(&self) -> Duration {
        self.poll
    }

    fn marks(&self) -> &Marks {
        &self.marks
    }

    fn unanswered(&self) -> &Unanswered {
        &self.unanswered
    }

    async fn call<T, F>(
        &self,
        owner: Option<&str>,
        _what: &str,
        mut statement: F,
    ) -> Result<T, BackendError>
    where
        T: Send,
        F: for<'c> FnMut(&'c mut sqlx::SqliteConnection) -> BoxFuture<'c, Result<T, sqlx::Error>>
            + Send,
    {
        // After the owner's work still running on dlock's I/O runtime (a
        // mark): a statement whose caller left still runs on its
        // connection's worker thread, and this one may take another.
        match owner {
            Some(owner) => self.owned(owner, statement).await,
            None => {
                let mut conn = self.pool.acquire().await.map_err(sql_error)?;
                statement(&mut conn).await.map_err(sql_error)
            }
        }
    }

    rows_and_exec!(String, sqlx::SqliteConnection);
}

#[cfg(test)]
mod json_tests {
    use super::json_array;

    #[test]
    fn keys_are_escaped_as_json_strings() {
        assert_eq!(json_array(["a", "b"].into_iter()), r#"["a","b"]"#);
        assert_eq!(json_array([r#"q"u\o"#].into_iter()), r#"["q\"u\\o"]"#);
        assert_eq!(json_array(["\u{1}"].into_iter()), r#"["\u0001"]"#);
    }
}
