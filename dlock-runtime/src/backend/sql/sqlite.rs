//! The lease table on SQLite (`sqlite://path`): the embedded default.
//!
//! Works between processes on one machine (the database file is the shared
//! state; WAL mode, a busy timeout). SQLite has no server to push a release to
//! other processes, so waiters in *this* process are woken at once by the
//! releasing call, and waiters elsewhere look again every `poll` (25 ms by
//! default, `sqlite://path?poll=10ms`) and when the holder's lease runs out.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use tokio::sync::Notify;

use crate::backend::{AcquireRequest, Acquired, Lease, LockBackend, Renewal};
use crate::error::{BackendError, LockError};
use crate::token::FencingToken;

const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS dlock_leases (
    key        TEXT    PRIMARY KEY NOT NULL,
    owner      TEXT,
    token      INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID";

// `now` is the database's clock in milliseconds; every statement reads it once.
const ACQUIRE: &str = "INSERT INTO dlock_leases (key, owner, token, expires_at)
    VALUES (?1, ?2, 1, CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3)
    ON CONFLICT (key) DO UPDATE SET
        owner = excluded.owner,
        token = dlock_leases.token + 1,
        expires_at = excluded.expires_at
    WHERE dlock_leases.owner IS NULL
       OR dlock_leases.expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER)
    RETURNING token";

const REMAINING: &str = "SELECT expires_at - CAST(unixepoch('subsec') * 1000 AS INTEGER)
    FROM dlock_leases WHERE key = ?1 AND owner IS NOT NULL";

const RENEW: &str = "UPDATE dlock_leases
    SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3
    WHERE key = ?1 AND owner = ?2
      AND expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)";

const RELEASE: &str = "UPDATE dlock_leases SET owner = NULL, expires_at = 0
    WHERE key = ?1 AND owner = ?2";

/// How often waiters in other processes look again by default.
const DEFAULT_POLL: Duration = Duration::from_millis(25);

/// The lease table in a SQLite file (`sqlite://path`): the embedded default.
///
/// Works between processes on one machine (WAL mode, a busy timeout). Waiters
/// in this process are woken by the releasing call; waiters in other processes
/// look again every `poll` (25 ms by default, `sqlite://path?poll=10ms`) and
/// when the holder's lease runs out. See [the SQL backends](super) for the table.
#[derive(Clone)]
pub struct SqliteBackend {
    pool: SqlitePool,
    path: PathBuf,
    poll: Duration,
    local_waiters: Arc<Mutex<HashMap<String, Arc<Notify>>>>,
}

impl fmt::Debug for SqliteBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteBackend")
            .field("path", &self.path)
            .field("poll", &self.poll)
            .finish_non_exhaustive()
    }
}

fn sql_error(err: sqlx::Error) -> BackendError {
    match &err {
        sqlx::Error::Database(db) => {
            // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes
            // (low byte): another process holds the write lock a moment longer.
            let code = db
                .code()
                .and_then(|c| c.parse::<i64>().ok())
                .map(|c| c & 0xff);
            if matches!(code, Some(5 | 6)) {
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

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

impl SqliteBackend {
    /// Opens (creating if needed) the database a `sqlite://path` URL names and
    /// the lease table in it. `sqlite://relative/file.db`, `sqlite:///abs/file.db`;
    /// option `?poll=25ms`. The parent directory is created if missing.
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
        let mut poll = DEFAULT_POLL;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("poll", value)) => {
                    poll = humantime::parse_duration(value).map_err(|e| {
                        LockError::config(format!("bad `poll` in sqlite URL: `{value}`: {e}"))
                    })?;
                    if poll.is_zero() {
                        return Err(LockError::config("`poll` in a sqlite URL must be > 0"));
                    }
                }
                _ => {
                    return Err(LockError::config(format!(
                        "unknown option `{pair}` in sqlite URL; known: poll=<duration>"
                    )));
                }
            }
        }
        Self::open(PathBuf::from(path), poll).await
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
            .busy_timeout(Duration::from_secs(5));
        let shown = path.display().to_string();
        // The pool's connections belong to the runtime that opens them: open
        // them on dlock's own (see `driver`).
        let pool = crate::driver::run(async move {
            let pool = SqlitePoolOptions::new()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(options)
                .await?;
            sqlx::query(CREATE_TABLE).execute(&pool).await?;
            Ok::<_, sqlx::Error>(pool)
        })
        .await
        .map_err(|e| LockError::Backend {
            backend: "sqlite",
            source: BackendError::permanent(format!("cannot open {shown}: {e}")),
        })?;
        Ok(SqliteBackend {
            pool,
            path,
            poll,
            local_waiters: Arc::default(),
        })
    }

    fn waiters(&self) -> MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        self.local_waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn try_take(&self, request: &AcquireRequest) -> Result<Option<Lease>, BackendError> {
        let started = Instant::now();
        let token: Option<i64> = sqlx::query_scalar(ACQUIRE)
            .bind(&request.key)
            .bind(&request.owner)
            .bind(millis(request.lease))
            .fetch_optional(&self.pool)
            .await
            .map_err(sql_error)?;
        Ok(token.map(|token| Lease {
            key: request.key.clone(),
            owner: request.owner.clone(),
            token: Some(FencingToken::new(token as u64)),
            valid_until: started + request.lease,
            extra: None,
        }))
    }
}

impl LockBackend for SqliteBackend {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Acquired, BackendError>> {
        Box::pin(async move {
            let deadline = Instant::now() + request.wait;
            loop {
                // Listen for local releases before looking (no missed wake-up).
                let notify = self
                    .waiters()
                    .entry(request.key.clone())
                    .or_default()
                    .clone();
                let released = notify.notified();
                tokio::pin!(released);
                released.as_mut().enable();
                if let Some(lease) = self.try_take(request).await? {
                    return Ok(Acquired::Held(lease));
                }
                let now = Instant::now();
                if now >= deadline {
                    return Ok(Acquired::Busy);
                }
                let remaining: Option<i64> = sqlx::query_scalar(REMAINING)
                    .bind(&request.key)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(sql_error)?;
                let until_expiry = Duration::from_millis(remaining.unwrap_or(0).max(0) as u64 + 1);
                let wake_at = deadline.min(now + until_expiry.min(self.poll));
                tokio::select! {
                    () = released => {}
                    () = tokio::time::sleep_until(wake_at.into()) => {}
                }
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        Box::pin(async move {
            let started = Instant::now();
            let done = sqlx::query(RENEW)
                .bind(&lease.key)
                .bind(&lease.owner)
                .bind(millis(ttl))
                .execute(&self.pool)
                .await
                .map_err(sql_error)?;
            Ok(if done.rows_affected() == 1 {
                Renewal::Renewed {
                    valid_until: started + ttl,
                }
            } else {
                Renewal::Lost
            })
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            sqlx::query(RELEASE)
                .bind(&lease.key)
                .bind(&lease.owner)
                .execute(&self.pool)
                .await
                .map_err(sql_error)?;
            let mut waiters = self.waiters();
            if let Some(notify) = waiters.get(&lease.key) {
                notify.notify_waiters();
                if Arc::strong_count(notify) == 1 {
                    waiters.remove(&lease.key);
                }
            }
            Ok(())
        })
    }
}
