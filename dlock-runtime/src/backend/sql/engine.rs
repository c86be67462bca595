//! The one SQL engine of the server databases: [`SqlBackend<D>`], generic
//! over a [`Dialect`] (PostgreSQL, MySQL/MariaDB).
//!
//! **Shape.** The engine holds what every server database shares and the
//! one `impl LockBackend`: the lease-table pool (bounded calls, see
//! `pool`), the waiters of this process, the registered contenders, the
//! collection of old free rows, the session locks (`?mode=session`, see
//! `session`), the URL options every database takes, and the connect
//! skeleton (open the pool within the timeout, inspect the server, create
//! or check the tables, start the dialect). Each call is dispatched to the
//! session locks or to the lease table. A dialect holds only what is its
//! own: its statements, its URL options, how it opens its pools and creates
//! its tables, its lease-table acquire, renewal and release, and its session
//! flavour. The public backends are aliases (`PostgresBackend =
//! SqlBackend<Postgres>`), so a dialect's own public items (`DDL`,
//! `is_listening`) are inherent items of its alias.
//!
//! SQLite is not a dialect of this engine: it has no session mode, no
//! server to lose a connection to (no per-call timeout, no retry on another
//! connection), and its waiters are woken by doorbells; it shares the URL
//! options and the collection (see `sqlite`).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::admin::{REVOKE_ATTEMPTS, Row, prefix_successor};
use super::pool::{Pooled, batch_failed, timed_out};
use super::session::{SessionDb, Sessions};
pub(super) use super::shared::holder_text;
use super::shared::{Marks, SharedSql, SharedStore};
use super::upkeep::{Collector, Contenders, DEFAULT_RETENTION};
use super::url::{Mode, UrlOptions};
use crate::backend::wait::Waiters;
use crate::backend::{
    AcquireRequest, Attempt, AttemptAll, HeldEntry, HoldMode, KeyEntry, Lease, LockBackend,
    Renewal, WakeSource,
};
use crate::error::{BackendError, LockError, redact_url};

/// How long a call may take by default (`?timeout=`).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// A started dialect, with its session locks in session mode.
pub(super) type Started<D> = (D, Option<<D as Dialect>::Sessions>);

/// The connection of a dialect's database.
pub(super) type Conn<D> = <<D as Dialect>::Db as sqlx::Database>::Connection;

/// What one server database brings to the [engine](self).
pub trait Dialect: Sized + Send + Sync + 'static {
    /// The `sqlx` database.
    type Db: sqlx::Database;
    /// What the URL says for the driver and for the dialect alone.
    type Options: Clone + Send + Sync + 'static;
    /// What the dialect learns from the server at connect (its version).
    type Facts: Send + 'static;
    /// The session-mode flavour.
    type Sessions: SessionDb;

    /// The backend's kind, in errors and traces.
    const KIND: &'static str;
    /// The public type's name, in `Debug` and in errors that point to `DDL`.
    const NAME: &'static str;
    /// The URL scheme the driver takes, and the one named in errors
    /// (`postgres://`).
    const SCHEME: &'static str;
    /// The URL schemes accepted (lowercase).
    const SCHEMES: &'static [&'static str];
    /// How often a waiter looks again by default (`?poll=`).
    const DEFAULT_POLL: Duration;
    /// The lease table, the session counters' table and the holder rows'
    /// table (`<table>_holders`), in this order.
    const DDL: &'static str;
    /// The lease table's columns, as the schema check selects them.
    const LEASE_COLUMNS: &'static str;
    /// The holder rows' columns (`<table>_holders`), as the schema check
    /// selects them.
    const HOLDERS_COLUMNS: &'static str;

    /// The backend error for a failed statement: transient or not.
    fn classify(err: sqlx::Error) -> BackendError;

    /// Takes the dialect's own options out of the URL's, and builds the
    /// driver's options from `base` (what follows `scheme://`) and the rest.
    fn options(o: &mut UrlOptions, shown: &str, base: &str) -> Result<Self::Options, LockError>;

    /// Opens the lease-table pool (run on dlock's I/O runtime).
    fn lease_pool(
        options: Self::Options,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<sqlx::Pool<Self::Db>, sqlx::Error>>;

    /// Asks the server what the dialect needs to know, or refuses it (run on
    /// dlock's I/O runtime, before the tables are checked).
    fn inspect(
        pool: sqlx::Pool<Self::Db>,
        mode: Mode,
        shown_url: String,
    ) -> BoxFuture<'static, Result<Self::Facts, LockError>>;

    /// Whether `err` says a table is missing (`Some(true)`) or lacks a
    /// column (`Some(false)`).
    fn schema_missing(err: &sqlx::Error) -> Option<bool>;

    /// Runs one `CREATE TABLE IF NOT EXISTS`.
    fn create_table(
        pool: sqlx::Pool<Self::Db>,
        ddl: String,
    ) -> BoxFuture<'static, Result<(), sqlx::Error>>;

    /// Whether a failed create means another process created it meanwhile.
    fn created_meanwhile(err: &sqlx::Error) -> bool;

    /// Starts the dialect: its lease-table state, and in session mode its
    /// session locks.
    fn start(setup: Setup<'_, Self>) -> BoxFuture<'_, Result<Started<Self>, LockError>>;

    /// Runs one of the engine's own statements (a check, a collection, a
    /// count) with `arg` bound if given: the first column of the first row.
    fn fetch_i64(
        conn: &mut Conn<Self>,
        sql: Arc<str>,
        arg: Option<i64>,
    ) -> BoxFuture<'_, Result<Option<i64>, sqlx::Error>>;

    /// One attempt on the lease table.
    fn try_lease(
        backend: &SqlBackend<Self>,
        request: &AcquireRequest,
    ) -> impl Future<Output = Result<Attempt, BackendError>> + Send;

    /// One transaction on the lease table that takes every key of
    /// `requests` (the runtime's canonical order, one owner) or none: rolled
    /// back at the first busy row, whose index and busy answer (as
    /// [`try_lease`](Self::try_lease) gives it) are the answer; else each
    /// key's token as `try_lease` issues it.
    fn try_leases(
        backend: &SqlBackend<Self>,
        requests: &[AcquireRequest],
    ) -> impl Future<Output = Result<AttemptAll, BackendError>> + Send;

    /// The lease-table waiter's wake-up source, given the one every dialect
    /// has (this process's releases, the contender's registration).
    fn lease_wake(backend: &SqlBackend<Self>, source: WakeSource) -> WakeSource;

    /// Renews a watchdog batch on the lease table.
    fn renew_leases(
        backend: &SqlBackend<Self>,
        batch: &[(&Lease, Duration)],
    ) -> impl Future<Output = Result<Vec<Renewal>, BackendError>> + Send;

    /// Frees the lease's row (the engine then wakes this process's waiters).
    fn release_lease(
        backend: &SqlBackend<Self>,
        lease: &Lease,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// The statement that deletes old free rows (lease mode) or old counters
    /// (session mode); it takes the retention as [`retention`](Self::retention).
    fn collect_sql(table: &str, mode: Mode) -> String;

    /// The retention as the collection statement takes it.
    fn retention(retention: Duration) -> i64;

    /// The dialect's own fields in `Debug`.
    fn debug_fields(backend: &SqlBackend<Self>, d: &mut fmt::DebugStruct<'_, '_>);

    /// The holder-record columns of the lease table (see `sql::admin`), as
    /// the check selects them.
    const HOLDER_COLUMNS: &'static str;
    /// The length of one unit of the `granted_at` column.
    const GRANTED_UNIT: Duration;
    /// The longest holder record the table stores, in bytes (a longer one
    /// is cut at a character boundary).
    const HOLDER_MAX: usize;

    /// The statements that add the holder-record columns to `table`, one per
    /// column.
    fn add_holder_columns(table: &str) -> Vec<String>;

    /// The columns session mode adds to `<table>_fence` (the stored key,
    /// the holder record of the last grant, the mode recorded with a key's
    /// holders and a share's slot), as the check selects them.
    const FENCE_COLUMNS: &'static str;

    /// Whether session mode offers read locks (PostgreSQL's shared
    /// advisory locks; MySQL's `GET_LOCK` has no shared mode).
    const SESSION_READERS: bool;

    /// The statements that add [`FENCE_COLUMNS`](Self::FENCE_COLUMNS) to
    /// `<table>_fence`, one per column.
    fn add_fence_columns(table: &str) -> Vec<String>;

    /// The lease-table columns of semaphores and read-write locks (see
    /// `shared`), as the check selects them.
    const SHARED_COLUMNS: &'static str;

    /// The statements that add [`SHARED_COLUMNS`](Self::SHARED_COLUMNS) to
    /// `table`, one per column.
    fn add_shared_columns(table: &str) -> Vec<String>;

    /// The statements of semaphores and read-write locks on `table` and
    /// `<table>_holders` (see `shared`).
    fn shared_sql(&self, table: &str) -> SharedSql;

    /// The statement that deletes old free holder rows; it takes the
    /// retention as [`retention`](Self::retention).
    fn collect_holders_sql(table: &str) -> String;

    /// The statement that deletes the holder records of registries that
    /// held nothing for longer than the retention (it takes the retention
    /// as [`retention`](Self::retention)), for a started dialect that keeps
    /// them apart from the rows (lease mode).
    fn collect_records_sql(&self, _table: &str) -> Option<String> {
        None
    }

    /// Runs `stmt` with `args`: its rows, each column read as `cols` says.
    fn rows<'c>(
        conn: &'c mut Conn<Self>,
        stmt: &super::shared::Stmt,
        args: Vec<super::shared::Arg>,
        cols: &'static [super::shared::Col],
    ) -> BoxFuture<'c, Result<Vec<Vec<super::shared::Val>>, sqlx::Error>>;

    /// Runs `stmt` with `args`: the rows it matched.
    fn exec<'c>(
        conn: &'c mut Conn<Self>,
        stmt: &super::shared::Stmt,
        args: Vec<super::shared::Arg>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Whether a failed column addition means the column is there already
    /// (another process added it meanwhile).
    fn column_exists(err: &sqlx::Error) -> bool;

    /// The held rows (an owner, an unexpired lease) `pick` names, in key order.
    fn held_rows(
        backend: &SqlBackend<Self>,
        pick: Pick,
    ) -> impl Future<Output = Result<Vec<Row>, BackendError>> + Send;

    /// Frees `key`'s row if `owner` still holds it, recording `owner` as
    /// revoked, and wakes the waiters in other processes as a release
    /// does; answers whether it did.
    fn revoke_row(
        backend: &SqlBackend<Self>,
        key: &str,
        owner: &str,
    ) -> impl Future<Output = Result<bool, BackendError>> + Send;

    /// Whether `owner`'s grant of `key` was the last one revoked.
    fn was_revoked(
        backend: &SqlBackend<Self>,
        key: &str,
        owner: &str,
    ) -> impl Future<Output = Result<bool, BackendError>> + Send;
}

/// Which held rows [`Dialect::held_rows`] reads.
#[derive(Debug, Clone)]
pub enum Pick {
    /// One key's.
    Key(String),
    /// Keys from `from` (inclusive) up to `to` (exclusive; `None`: no end),
    /// at most `limit` of them.
    Range {
        /// The first key.
        from: String,
        /// The end of the range.
        to: Option<String>,
        /// How many rows at most.
        limit: i64,
    },
}

/// The [`Dialect::fetch_i64`] of a database whose connections run
/// `sqlx::query_scalar` (all of them: the generic form would need bounds on
/// every use of the engine).
macro_rules! fetch_i64_by_query_scalar {
    () => {
        fn fetch_i64(
            conn: &mut $crate::backend::sql::engine::Conn<Self>,
            sql: std::sync::Arc<str>,
            arg: Option<i64>,
        ) -> futures_util::future::BoxFuture<'_, Result<Option<i64>, sqlx::Error>> {
            Box::pin(async move {
                let query = sqlx::query_scalar(sqlx::AssertSqlSafe(sql));
                match arg {
                    Some(arg) => query.bind(arg).fetch_optional(conn).await,
                    None => query.fetch_optional(conn).await,
                }
            })
        }
    };
}
pub(super) use fetch_i64_by_query_scalar;

/// What a URL says: the options every server database takes, and the
/// dialect's own.
pub(super) struct Target<O> {
    pub(super) mode: Mode,
    pub(super) table: String,
    pub(super) create: bool,
    pub(super) poll: Duration,
    pub(super) retention: Duration,
    pub(super) timeout: Duration,
    pub(super) options: O,
}

impl<O> Target<O> {
    /// Reads a URL of dialect `D`.
    pub(super) fn parse<D: Dialect<Options = O>>(url: &str) -> Result<Self, LockError> {
        let shown = redact_url(url);
        let (_, rest) = url
            .split_once("://")
            .filter(|(s, _)| D::SCHEMES.contains(&s.to_ascii_lowercase().as_str()))
            .ok_or_else(|| LockError::config(format!("`{shown}` is not a {} URL", D::SCHEME)))?;
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut o = UrlOptions::parse(D::SCHEME, query)?;
        Ok(Target {
            mode: o.mode()?,
            table: o.table()?,
            create: o.flag("create", true)?,
            poll: o.duration("poll", D::DEFAULT_POLL, false)?,
            retention: o.duration("retention", DEFAULT_RETENTION, true)?,
            timeout: o.duration("timeout", DEFAULT_TIMEOUT, false)?,
            options: D::options(&mut o, &shown, base)?,
        })
    }
}

/// What a dialect starts from: the lease-table pool, the URL, what the
/// server said, this process's waiters. (MySQL needs only the URL.)
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub struct Setup<'a, D: Dialect> {
    pub(super) pool: &'a sqlx::Pool<D::Db>,
    pub(super) target: &'a Target<D::Options>,
    pub(super) facts: D::Facts,
    pub(super) waiters: &'a Arc<Waiters>,
    pub(super) shown_url: &'a str,
}

/// A server database: the lease table, or session locks with
/// `?mode=session`. See [the SQL backends](super). Clones share the
/// connections, the waiters and the held session locks.
pub struct SqlBackend<D: Dialect> {
    pub(super) shown_url: String,
    pub(super) table: String,
    pub(super) mode: Mode,
    pub(super) poll: Duration,
    pub(super) db: Pooled<D::Db>,
    pub(super) waiters: Arc<Waiters>,
    pub(super) contenders: Arc<Contenders>,
    collector: Arc<Collector>,
    /// See [`Dialect::collect_sql`].
    collect_sql: Arc<str>,
    /// See [`Dialect::collect_holders_sql`] (lease mode).
    collect_holders_sql: Option<Arc<str>>,
    /// See [`Dialect::collect_records_sql`].
    collect_records_sql: Option<Arc<str>>,
    /// See [`Dialect::shared_sql`].
    pub(super) shared: Arc<SharedSql>,
    /// The owners whose waiting-writer marks may stand.
    marks: Arc<Marks>,
    sessions: Option<Arc<Sessions<D::Sessions>>>,
    pub(super) dialect: Arc<D>,
}

impl<D: Dialect> Clone for SqlBackend<D> {
    fn clone(&self) -> Self {
        SqlBackend {
            shown_url: self.shown_url.clone(),
            table: self.table.clone(),
            mode: self.mode,
            poll: self.poll,
            db: self.db.clone(),
            waiters: self.waiters.clone(),
            contenders: self.contenders.clone(),
            collector: self.collector.clone(),
            collect_sql: self.collect_sql.clone(),
            collect_holders_sql: self.collect_holders_sql.clone(),
            collect_records_sql: self.collect_records_sql.clone(),
            shared: self.shared.clone(),
            marks: self.marks.clone(),
            sessions: self.sessions.clone(),
            dialect: self.dialect.clone(),
        }
    }
}

impl<D: Dialect> fmt::Debug for SqlBackend<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct(D::NAME);
        d.field("url", &self.shown_url)
            .field("mode", &self.mode)
            .field("table", &self.table);
        D::debug_fields(self, &mut d);
        d.field("sessions", &self.sessions.as_ref().map(|s| s.len()))
            .finish_non_exhaustive()
    }
}

/// A failed statement as the backend's error.
pub(super) fn backend_error<D: Dialect>(err: sqlx::Error) -> LockError {
    LockError::Backend {
        backend: D::KIND,
        source: D::classify(err),
    }
}

/// A failed statement as the backend's error, with `message` for its text.
pub(super) fn failed<D: Dialect>(message: String, err: sqlx::Error) -> LockError {
    LockError::Backend {
        backend: D::KIND,
        source: if D::classify(err).is_retryable() {
            BackendError::transient(message)
        } else {
            BackendError::permanent(message)
        },
    }
}

impl<D: Dialect> SqlBackend<D> {
    /// Connects to the database `url` names: the lease-table pool within the
    /// timeout, the server inspected, the tables created (or checked), the
    /// dialect started.
    pub(super) async fn open(url: &str) -> Result<Self, LockError> {
        let shown_url = redact_url(url);
        let target = Target::parse::<D>(url)?;
        let timeout = target.timeout;
        let pool = crate::driver::run(D::lease_pool(target.options.clone(), timeout));
        let pool = tokio::time::timeout(timeout, pool)
            .await
            .map_err(|_| LockError::Backend {
                backend: D::KIND,
                source: timed_out(&format!("connecting to {shown_url}"), timeout),
            })?
            .map_err(|e| failed::<D>(format!("cannot connect to {shown_url}: {e}"), e))?;
        let facts =
            crate::driver::run(D::inspect(pool.clone(), target.mode, shown_url.clone())).await?;
        {
            let (pool, table, create, mode) = (
                pool.clone(),
                target.table.clone(),
                target.create,
                target.mode,
            );
            crate::driver::run(async move {
                ensure_schema::<D>(pool.clone(), &table, create, mode).await?;
                match mode {
                    Mode::Lease => {
                        let statements = D::add_holder_columns(&table);
                        ensure_columns::<D>(
                            pool.clone(),
                            &table,
                            D::HOLDER_COLUMNS,
                            &statements,
                            "holder-record",
                        )
                        .await?;
                        let statements = D::add_shared_columns(&table);
                        ensure_columns::<D>(
                            pool,
                            &table,
                            D::SHARED_COLUMNS,
                            &statements,
                            "semaphore and read-write",
                        )
                        .await?;
                    }
                    Mode::Session => {
                        let statements = D::add_fence_columns(&table);
                        let fence = format!("{table}_fence");
                        ensure_columns::<D>(
                            pool,
                            &fence,
                            D::FENCE_COLUMNS,
                            &statements,
                            "holder-record and share",
                        )
                        .await?;
                    }
                }
                Ok::<_, LockError>(())
            })
            .await?;
        }
        let waiters = Arc::<Waiters>::default();
        let (dialect, sessions) = D::start(Setup {
            pool: &pool,
            target: &target,
            facts,
            waiters: &waiters,
            shown_url: &shown_url,
        })
        .await?;
        Ok(SqlBackend {
            collect_sql: D::collect_sql(&target.table, target.mode).into(),
            collect_holders_sql: (target.mode == Mode::Lease)
                .then(|| D::collect_holders_sql(&target.table).into()),
            collect_records_sql: dialect.collect_records_sql(&target.table).map(Arc::from),
            shared: Arc::new(dialect.shared_sql(&target.table)),
            marks: Arc::default(),
            shown_url,
            table: target.table,
            mode: target.mode,
            poll: target.poll,
            db: Pooled::new(pool, timeout, D::classify, {
                let options = target.options.clone();
                Arc::new(move || D::lease_pool(options.clone(), timeout))
            }),
            waiters,
            contenders: Arc::default(),
            collector: Arc::new(Collector::new(target.retention)),
            sessions: sessions.map(|s| Arc::new(Sessions::new(s, timeout, target.poll))),
            dialect: Arc::new(dialect),
        })
    }

    /// Rows in the lease table (held and free), for tests of bounded state.
    pub async fn row_count(&self) -> Result<u64, LockError> {
        let sql = Arc::<str>::from(format!("SELECT COUNT(*) FROM {}", self.table));
        let count = move |db: Pooled<D::Db>| async move {
            db.call("count", |c| D::fetch_i64(c, sql.clone(), None))
                .await
        };
        let counted = if self.db.is_near() {
            count(self.db.clone()).await
        } else {
            crate::driver::run(count(self.db.clone())).await
        };
        counted
            .map(|n| n.unwrap_or(0) as u64)
            .map_err(|e| e.into_lock_error(D::KIND))
    }

    /// Renews a batch on the lease table, from a pool near this thread.
    async fn renew_leases(
        &self,
        batch: &[(&Lease, Duration)],
    ) -> Result<Vec<Renewal>, BackendError> {
        if self.db.is_near() {
            return self.renew_in_modes(batch).await;
        }
        let this = self.clone();
        let batch: Vec<(Lease, Duration)> = batch
            .iter()
            .map(|(lease, ttl)| (copy_lease(lease), *ttl))
            .collect();
        crate::driver::run(async move {
            let batch: Vec<(&Lease, Duration)> =
                batch.iter().map(|(lease, ttl)| (lease, *ttl)).collect();
            this.renew_in_modes(&batch).await
        })
        .await
    }

    /// One attempt on the lease table in the request's mode: a plain lock
    /// by the dialect's statement (then, when busy, what readers or permits
    /// on the key make of it), a share or a permit by `shared`.
    async fn try_lease_in_mode(&self, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        match request.mode {
            HoldMode::Exclusive => match D::try_lease(self, request).await? {
                busy @ Attempt::Busy { .. } => {
                    super::shared::exclusive_busy(self, request, busy).await
                }
                attempt => {
                    // A grant voids the attempt's mark.
                    self.marks.forget(&request.owner);
                    Ok(attempt)
                }
            },
            _ => super::shared::try_shared(self, request).await,
        }
    }

    /// Releases a lease of any mode on the lease table. The runtime's undo
    /// of an abandoned plain attempt also removes the attempt's
    /// waiting-writer mark, if it left one.
    async fn release_in_mode(&self, lease: &Lease) -> Result<(), BackendError> {
        match lease.mode {
            HoldMode::Exclusive => {
                D::release_lease(self, lease).await?;
                super::shared::unmark_writer(self, &lease.key, &lease.owner).await
            }
            _ => super::shared::release_shared(self, lease).await,
        }
    }

    /// Renews a batch of any modes: plain leases by the dialect's batch,
    /// shares and permits by `shared`'s; the answers in the batch's order.
    async fn renew_in_modes(
        &self,
        batch: &[(&Lease, Duration)],
    ) -> Result<Vec<Renewal>, BackendError> {
        if batch.iter().all(|(l, _)| l.mode == HoldMode::Exclusive) {
            return D::renew_leases(self, batch).await;
        }
        let (plain, shared): (Vec<_>, Vec<_>) = batch
            .iter()
            .enumerate()
            .partition(|(_, (l, _))| l.mode == HoldMode::Exclusive);
        let mut answers = vec![Renewal::Lost; batch.len()];
        if !plain.is_empty() {
            let sub: Vec<(&Lease, Duration)> = plain.iter().map(|(_, e)| **e).collect();
            for ((i, _), answer) in plain.iter().zip(D::renew_leases(self, &sub).await?) {
                answers[*i] = answer;
            }
        }
        let sub: Vec<(&Lease, Duration)> = shared.iter().map(|(_, e)| **e).collect();
        for ((i, _), answer) in shared
            .iter()
            .zip(super::shared::renew_shared(self, &sub).await?)
        {
            answers[*i] = answer;
        }
        Ok(answers)
    }

    /// Runs `call` on a pool near this thread: here, or on dlock's I/O runtime.
    async fn near<T, F, Fut>(&self, call: F) -> Result<T, BackendError>
    where
        T: Send + 'static,
        F: FnOnce(Self) -> Fut,
        Fut: Future<Output = Result<T, BackendError>> + Send + 'static,
    {
        if self.db.is_near() {
            call(self.clone()).await
        } else {
            crate::driver::run(call(self.clone())).await
        }
    }

    /// The lease table's holder of `key`.
    async fn inspect_lease(&self, key: &str) -> Result<Option<KeyEntry>, BackendError> {
        let pick = Pick::Key(key.to_owned());
        let shared_key = key.to_owned();
        let (rows, shares) = self
            .near(|this| async move {
                let rows = D::held_rows(&this, pick).await?;
                let shares = super::shared::shared_entries(&this, &shared_key).await?;
                Ok((rows, shares))
            })
            .await?;
        // Waiters in other processes are not known: none are counted.
        let mut holders: Vec<HeldEntry> = rows
            .into_iter()
            .take(1)
            .map(|row| row.entry(D::GRANTED_UNIT))
            .collect();
        holders.extend(shares);
        Ok((!holders.is_empty()).then(|| KeyEntry::new(key, holders)))
    }

    /// The lease table's held keys under `prefix`.
    async fn list_leases(&self, prefix: &str, limit: usize) -> Result<Vec<KeyEntry>, BackendError> {
        let pick = Pick::Range {
            from: prefix.to_owned(),
            to: prefix_successor(prefix),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
        };
        let (from, to) = (prefix.to_owned(), prefix_successor(prefix));
        let max = i64::try_from(limit).unwrap_or(i64::MAX);
        let (rows, shares) = self
            .near(|this| async move {
                let rows = D::held_rows(&this, pick).await?;
                let shares = super::shared::shared_keys(&this, &from, to.as_deref(), max).await?;
                Ok((rows, shares))
            })
            .await?;
        let mut keys: Vec<KeyEntry> = rows
            .into_iter()
            .map(|row| KeyEntry::new(row.key.clone(), vec![row.entry(D::GRANTED_UNIT)]))
            .collect();
        for (key, entries) in shares {
            match keys.iter_mut().find(|k| k.key == key) {
                Some(held) => held.holders.extend(entries),
                None => keys.push(KeyEntry::new(key, entries)),
            }
        }
        keys.sort_by(|a, b| a.key.cmp(&b.key));
        keys.truncate(limit);
        Ok(keys)
    }

    /// Revokes `key`'s lease: read its holder, free the row if the same
    /// holder still has it (see `sql::admin`), wake the waiters.
    async fn revoke_lease(&self, key: &str) -> Result<Vec<HeldEntry>, BackendError> {
        let key = key.to_owned();
        self.near(|this| async move {
            let shares = super::shared::revoke_shared(&this, &key).await?;
            if !shares.is_empty() {
                this.waiters.wake(&key);
            }
            for _ in 0..REVOKE_ATTEMPTS {
                let rows = D::held_rows(&this, Pick::Key(key.clone())).await?;
                let Some(row) = rows.into_iter().next() else {
                    return Ok(shares);
                };
                if D::revoke_row(&this, &key, &row.owner).await? {
                    this.waiters.wake(&key);
                    let mut removed = vec![row.entry(D::GRANTED_UNIT)];
                    removed.extend(shares);
                    return Ok(removed);
                }
            }
            Err(BackendError::transient(format!(
                "{}: `{key}` changed hands {REVOKE_ATTEMPTS} times while being revoked",
                D::KIND
            )))
        })
        .await
    }

    /// Tells the revoked among the lost leases of a renewed batch.
    async fn tell_revoked(
        &self,
        batch: &[(&Lease, Duration)],
        answers: Vec<Renewal>,
    ) -> Result<Vec<Renewal>, BackendError> {
        if !answers.contains(&Renewal::Lost) {
            return Ok(answers);
        }
        let lost: Vec<(String, String)> = batch
            .iter()
            .zip(&answers)
            .filter(|(_, answer)| **answer == Renewal::Lost)
            .map(|((lease, _), _)| (lease.key.clone(), lease.owner.clone()))
            .collect();
        let revoked = self
            .near(|this| async move {
                let mut revoked = Vec::new();
                for (key, owner) in lost {
                    if D::was_revoked(&this, &key, &owner).await? {
                        revoked.push((key, owner));
                    }
                }
                Ok(revoked)
            })
            .await?;
        Ok(batch
            .iter()
            .zip(answers)
            .map(|((lease, _), answer)| {
                let was = revoked
                    .iter()
                    .any(|(k, o)| *k == lease.key && *o == lease.owner);
                if answer == Renewal::Lost && was {
                    Renewal::Revoked
                } else {
                    answer
                }
            })
            .collect())
    }

    /// Deletes old free rows (and old counter rows) in the background, at
    /// most once a minute.
    fn collect_if_due(&self) {
        if !self.collector.due() {
            return;
        }
        let pool = self.db.pool.clone();
        let retention = D::retention(self.collector.retention);
        let sql = self.collect_sql.clone();
        let holders = self.collect_holders_sql.clone();
        let records = self.collect_records_sql.clone();
        crate::driver::handle().spawn(async move {
            let collected = async {
                let mut conn = pool.acquire().await?;
                if let Some(holders) = holders {
                    D::fetch_i64(&mut conn, holders, Some(retention)).await?;
                }
                if let Some(records) = records {
                    D::fetch_i64(&mut conn, records, Some(retention)).await?;
                }
                D::fetch_i64(&mut conn, sql, Some(retention)).await
            };
            if let Err(err) = collected.await {
                tracing::debug!(
                    backend = D::KIND,
                    error = %err,
                    "dlock: collecting free rows failed; next time"
                );
            }
        });
    }
}

/// Runs a check statement on a connection of `pool`.
async fn check<D: Dialect>(pool: &sqlx::Pool<D::Db>, sql: &Arc<str>) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    D::fetch_i64(&mut conn, sql.clone(), None).await.map(|_| ())
}

/// Creates the tables the mode uses (unless `create` is false) and checks
/// that they have the columns dlock uses: the lease table and its holder
/// rows (`<table>_holders`), or session mode's counters.
async fn ensure_schema<D: Dialect>(
    pool: sqlx::Pool<D::Db>,
    table: &str,
    create: bool,
    mode: Mode,
) -> Result<(), LockError> {
    match mode {
        Mode::Lease => {
            let lease = format!("SELECT {} FROM {table} LIMIT 0", D::LEASE_COLUMNS);
            ensure_table::<D>(pool.clone(), table, table, create, &lease, 0).await?;
            let holders = format!("{table}_holders");
            let check = format!("SELECT {} FROM {holders} LIMIT 0", D::HOLDERS_COLUMNS);
            ensure_table::<D>(pool, table, &holders, create, &check, 2).await
        }
        Mode::Session => {
            let fence = format!("{table}_fence");
            let check = format!("SELECT k, token FROM {fence} LIMIT 0");
            ensure_table::<D>(pool, table, &fence, create, &check, 1).await
        }
    }
}

/// Creates `name` (unless `create` is false) from the statement `nth` of
/// [`Dialect::DDL`], and checks it with `check`.
pub(super) async fn ensure_table<D: Dialect>(
    pool: sqlx::Pool<D::Db>,
    table: &str,
    name: &str,
    create: bool,
    check_sql: &str,
    nth: usize,
) -> Result<(), LockError> {
    let sql: Arc<str> = check_sql.into();
    let missing = match check::<D>(&pool, &sql).await {
        Ok(()) => return Ok(()),
        Err(e) if D::schema_missing(&e) == Some(true) && create => e,
        Err(e) => {
            return Err(if D::schema_missing(&e).is_some() {
                LockError::config(format!(
                    "the lock table `{name}` is missing or lacks dlock's columns ({e}); \
                     create it (see {}::DDL, with your table name) or connect with \
                     `?create=true`",
                    D::NAME
                ))
            } else {
                backend_error::<D>(e)
            });
        }
    };
    tracing::debug!(backend = D::KIND, table = name, error = %missing, "dlock: creating the lock table");
    let ddl = D::DDL
        .replace("dlock_leases_fence", &format!("{table}_fence"))
        .replace("dlock_leases_holders", &format!("{table}_holders"))
        .replace("dlock_leases_procs", &format!("{table}_procs"))
        .replace("dlock_leases ", &format!("{table} "));
    let ddl = ddl
        .split_inclusive(';')
        .nth(nth)
        .unwrap_or_default()
        .to_owned();
    match D::create_table(pool.clone(), ddl).await {
        Err(e) if !D::created_meanwhile(&e) => {
            return Err(failed::<D>(
                format!("cannot create the lock table `{name}`: {e}"),
                e,
            ));
        }
        _ => {}
    }
    check::<D>(&pool, &sql).await.map_err(backend_error::<D>)
}

/// Adds the holder-record `columns` to `table` (the lease table, or session
/// mode's counters) when it was created without them, by `statements` (see
/// `sql::admin`). A role that may not alter the table gets an error naming
/// the statements to run.
async fn ensure_columns<D: Dialect>(
    pool: sqlx::Pool<D::Db>,
    table: &str,
    columns: &str,
    statements: &[String],
    what: &str,
) -> Result<(), LockError> {
    let sql: Arc<str> = format!("SELECT {columns} FROM {table} LIMIT 0").into();
    match check::<D>(&pool, &sql).await {
        Ok(()) => return Ok(()),
        Err(e) if D::schema_missing(&e) == Some(false) => {}
        Err(e) => return Err(backend_error::<D>(e)),
    }
    for add in statements {
        let mut conn = pool.acquire().await.map_err(backend_error::<D>)?;
        match D::fetch_i64(&mut conn, add.as_str().into(), None).await {
            Err(e) if !D::column_exists(&e) => {
                return Err(LockError::config(format!(
                    "the lock table `{table}` lacks the {what} columns and they cannot \
                     be added ({e}); run `{}` (see {}::DDL)",
                    statements.join("; "),
                    D::NAME
                )));
            }
            _ => {}
        }
    }
    check::<D>(&pool, &sql).await.map_err(backend_error::<D>)
}

/// How soon an attempt that met a transient failure is tried again (doubled
/// while the failures go on, see [`Attempt::Unavailable`]).
const OUTAGE_RETRY: Duration = Duration::from_millis(25);

impl<D: Dialect> LockBackend for SqlBackend<D> {
    fn kind(&self) -> &'static str {
        D::KIND
    }

    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        match (mode, self.mode) {
            (HoldMode::Shared, Mode::Session) if !D::SESSION_READERS => Err(format!(
                "{}'s session mode (`?mode=session`) does not offer {mode}: its session locks \
                 (`GET_LOCK`) have no shared mode; lease mode (the default) does",
                D::KIND
            )),
            _ => Ok(()),
        }
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            let attempt = match &self.sessions {
                Some(sessions) => sessions.try_acquire(request).await,
                None if self.db.is_near() => self.try_lease_in_mode(request).await,
                None => {
                    let (this, copy) = (self.clone(), copy_request(request));
                    self.db
                        .at_home_for(&request.owner, async move {
                            this.try_lease_in_mode(&copy).await
                        })
                        .await
                }
            };
            match attempt {
                // The server restarting, a connection it ended with no other
                // to go on with, a timeout: tried again while `wait` lasts.
                Err(error) if error.is_retryable() => Ok(Attempt::Unavailable {
                    error,
                    retry_in: OUTAGE_RETRY,
                }),
                attempt => attempt,
            }
        })
    }

    fn try_acquire_all<'a>(
        &'a self,
        requests: &'a [AcquireRequest],
    ) -> Option<BoxFuture<'a, Result<AttemptAll, BackendError>>> {
        if self.sessions.is_some() {
            // Session locks are one connection each: taken one by one.
            return None;
        }
        let owner = &requests.first()?.owner;
        Some(Box::pin(async move {
            let attempt = if self.db.is_near() {
                D::try_leases(self, requests).await
            } else {
                let this = self.clone();
                let copies: Vec<AcquireRequest> = requests.iter().map(copy_request).collect();
                self.db
                    .at_home_for(owner, async move { D::try_leases(&this, &copies).await })
                    .await
            };
            match attempt {
                Err(error) if error.is_retryable() => Ok(AttemptAll::Unavailable {
                    error,
                    retry_in: OUTAGE_RETRY,
                }),
                attempt => attempt,
            }
        }))
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let source = match self.mode {
            // The server hands the key over: attempts wait on it.
            Mode::Session if request.mode == HoldMode::Exclusive => WakeSource::none(),
            // Shares try without waiting on the server: a release in this
            // process wakes them at once, the others are polled.
            Mode::Session => self.waiters.source(&request.key),
            // Releases in this process wake at once; the dialect adds how
            // the others are heard.
            Mode::Lease => D::lease_wake(
                self,
                self.waiters
                    .source(&request.key)
                    .keep_alive(self.contenders.register(&request.owner)),
            ),
        };
        Box::pin(std::future::ready(source))
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => sessions.release(&request.owner).await,
                // A writer that gave up leaves no mark behind.
                None if request.mode == HoldMode::Exclusive => {
                    let (key, owner) = (request.key.clone(), request.owner.clone());
                    let unmarked = self
                        .near(|this| async move {
                            super::shared::unmark_writer(&this, &key, &owner).await
                        })
                        .await;
                    if let Err(err) = unmarked {
                        tracing::debug!(backend = D::KIND, error = %err, "dlock: removing a writer mark failed; it expires");
                    }
                }
                None => {}
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
                    Ok(answers) => match self.tell_revoked(batch, answers.clone()).await {
                        Ok(told) => told.into_iter().map(Ok).collect(),
                        // Lost either way: an expiry it is, then.
                        Err(_) => answers.into_iter().map(Ok).collect(),
                    },
                    // One lease's error is its own answer.
                    Err(err) if batch.len() == 1 => vec![Err(err)],
                    Err(err) => batch_failed(D::KIND, err, batch.len()),
                },
            }
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => {
                    sessions.release(&lease.owner).await;
                    // Shares of the key wait in this process without a
                    // server-side queue: a freed permit wakes one, a freed
                    // key (a writer, the last reader) every reader.
                    if let HoldMode::Permit { .. } = lease.mode {
                        self.waiters.wake_one(&lease.key);
                    } else {
                        self.waiters.wake(&lease.key);
                    }
                }
                None if self.db.is_near() => {
                    self.release_in_mode(lease).await?;
                    self.waiters.wake(&lease.key);
                }
                None => {
                    let (this, lease) = (self.clone(), copy_lease(lease));
                    crate::driver::run(async move {
                        this.release_in_mode(&lease).await?;
                        this.waiters.wake(&lease.key);
                        Ok::<_, BackendError>(())
                    })
                    .await?;
                }
            }
            self.collect_if_due();
            Ok(())
        })
    }

    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => sessions.inspect(key).await,
                None => self.inspect_lease(key).await,
            }
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => sessions.list(prefix, limit).await,
                None => self.list_leases(prefix, limit).await,
            }
        })
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        Box::pin(async move {
            match &self.sessions {
                Some(sessions) => sessions.revoke(key).await,
                None => self.revoke_lease(key).await,
            }
        })
    }

    fn needs_io_runtime(&self) -> bool {
        // Session locks keep their connections on dlock's I/O runtime; the
        // lease table's calls go to a pool near the caller, or hop there
        // themselves (see `pool`).
        self.sessions.is_some()
    }
}

/// A copy of `request`, for an attempt on dlock's I/O runtime.
fn copy_request(request: &AcquireRequest) -> AcquireRequest {
    AcquireRequest {
        key: request.key.clone(),
        owner: request.owner.clone(),
        lease: request.lease,
        wait: request.wait,
        lost: request.lost.clone(),
        fencing: request.fencing,
        holder: request.holder.clone(),
        mode: request.mode,
    }
}

/// A copy of `lease`, for a call on dlock's I/O runtime.
fn copy_lease(lease: &Lease) -> Lease {
    Lease {
        key: lease.key.clone(),
        owner: lease.owner.clone(),
        token: lease.token,
        valid_until: lease.valid_until,
        extra: lease.extra.clone(),
        after_unanswered: lease.after_unanswered,
        mode: lease.mode,
        slot: lease.slot,
    }
}

/// The answer of a one-step attempt whose key `index` was busy, from that
/// key's busy answer.
pub(super) fn busy_at(index: usize, busy: Attempt) -> Result<AttemptAll, BackendError> {
    match busy {
        Attempt::Busy { retry_in } => Ok(AttemptAll::Busy {
            key: index,
            retry_in,
        }),
        Attempt::Unavailable { error, retry_in } => Ok(AttemptAll::Unavailable { error, retry_in }),
        Attempt::Held(_) => Err(BackendError::permanent("a busy key's answer was a grant")),
    }
}

impl<D: Dialect> SharedStore for SqlBackend<D> {
    type Db = D::Db;
    const GRANTED_UNIT: Duration = D::GRANTED_UNIT;
    const HOLDER_MAX: usize = D::HOLDER_MAX;
    const BEGIN: &'static str = "BEGIN";
    const BEGIN_ORDERS: bool = false;

    fn sql(&self) -> Arc<SharedSql> {
        self.shared.clone()
    }

    fn poll(&self) -> Duration {
        self.poll
    }

    fn marks(&self) -> &Marks {
        &self.marks
    }

    fn unanswered(&self) -> &super::ordered::Unanswered {
        self.db.unanswered()
    }

    async fn call<T, F>(
        &self,
        owner: Option<&str>,
        what: &str,
        statement: F,
    ) -> Result<T, BackendError>
    where
        T: Send,
        F: for<'c> FnMut(&'c mut Conn<D>) -> BoxFuture<'c, Result<T, sqlx::Error>> + Send,
    {
        match owner {
            Some(owner) => self.db.call_for(owner, what, statement).await,
            None => self.db.call(what, statement).await,
        }
    }

    fn rows<'c>(
        conn: &'c mut Conn<D>,
        stmt: &super::shared::Stmt,
        args: Vec<super::shared::Arg>,
        cols: &'static [super::shared::Col],
    ) -> BoxFuture<'c, Result<Vec<Vec<super::shared::Val>>, sqlx::Error>> {
        D::rows(conn, stmt, args, cols)
    }

    fn exec<'c>(
        conn: &'c mut Conn<D>,
        stmt: &super::shared::Stmt,
        args: Vec<super::shared::Arg>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        D::exec(conn, stmt, args)
    }
}
