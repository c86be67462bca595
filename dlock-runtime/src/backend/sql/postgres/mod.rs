//! PostgreSQL (`postgres://`, `postgresql://`): the lease table, woken by
//! `LISTEN`/`NOTIFY`; or advisory locks (`?mode=session`).
//!
//! **Lease mode** (the default). One row per key in `dlock_leases`, every
//! decision on the database's clock (`clock_timestamp()`), one statement
//! each, autocommit at READ COMMITTED (set on dlock's own connections: the
//! stricter levels turn races into serialization failures):
//!
//! ```sql
//! -- acquire: no row back = busy; a retry by the same owner takes it again
//! INSERT INTO dlock_leases AS l (key, owner, token, expires_at, holder, granted_at)
//! VALUES ($1, $2, <now µs>, clock_timestamp() + $3 ms, $4, clock_timestamp())
//! ON CONFLICT (key) DO UPDATE SET owner = excluded.owner,
//!     token = GREATEST(l.token + 1, excluded.token), expires_at = excluded.expires_at, wanted = false,
//!     holder = excluded.holder, granted_at = <the old one for a retry by the owner, else excluded's>
//! WHERE l.owner IS NULL OR l.owner = excluded.owner OR l.expires_at <= clock_timestamp()
//! RETURNING token;
//! -- renew a whole watchdog batch: the keys not returned are lost
//! UPDATE dlock_leases l SET expires_at = clock_timestamp() + b.ttl ms
//! FROM unnest($1::text[], $2::text[], $3::int8[]) AS b(key, owner, ttl)
//! WHERE l.key = b.key AND l.owner = b.owner AND l.expires_at > clock_timestamp()
//! RETURNING l.key, l.owner;
//! -- release, and wake the waiters if one marked the key as wanted
//! WITH r AS (UPDATE dlock_leases SET owner = NULL, expires_at = clock_timestamp()
//!            WHERE key = $1 AND owner = $2 RETURNING key, wanted)
//! SELECT pg_notify($3, key) FROM r WHERE wanted;
//! ```
//!
//! Several keys of one hold (`lock_all`) are taken in one statement, so one
//! transaction and one round trip: the acquire's upsert over
//! `unnest($1::text[])` in key order (the runtime's canonical order: two
//! such statements never wait on each other in a cycle), whose rows all
//! come back, or none: when only some were taken, a cast of a text to `int`
//! fails on purpose and the statement is rolled back. A busy answer then
//! reads which key is held, and the waiter marks it and waits on it as for a
//! single key. Session mode takes the keys one by one.
//!
//! **Semaphores and read-write locks** (lease mode; for session mode —
//! shared advisory locks and slot keys — see `session.rs`). A reader's share and each permit are rows of
//! `<table>_holders` (key, slot, permits, owner, token, expiry, holder
//! record), each with its own expiry on the database's clock; the key's
//! lease-table row stays the writer (a plain lock is the write mode) and
//! carries `shared_until` (the latest expiry of its holder rows, which the
//! plain acquire's `WHERE` also requires to have passed) and the
//! waiting-writer mark. A reader or a permit is decided in one short
//! transaction at READ COMMITTED that first locks the key's lease-table row
//! (`SELECT … FOR UPDATE`): one statement could not do it, since its
//! snapshot predates its wait for the row lock and it would not see the
//! holder rows the previous transaction committed. The semaphore takes the
//! lowest free slot below `permits` with the slot row's hybrid token
//! (per key and slot); `permits` is stored with the rows and another count,
//! a reader or a plain lock while they live is a `Config` error. A reader
//! takes the key's one token sequence (the lease row's hybrid token) and is
//! busy while the plain lock is held or another writer's mark stands; a
//! writer that finds readers marks the key (writers are preferred) and its
//! grant voids the mark. Releases notify as a plain release does (when the
//! key is wanted); renewals of shares go in one transaction per batch.
//!
//! **Wake-ups.** `NOTIFY` takes a cluster-wide lock at commit, so a release
//! notifies only when a waiter marked the key as `wanted`. A waiter marks it
//! (once per wait, and only when unmarked) after its first busy answer; the
//! same statement tells it the holder's remaining time, so it also looks
//! again when that lease runs out. One `LISTEN` connection per backend hears
//! every key; it is rebuilt on any error, pinged every few seconds, and after
//! each reconnect every waiter looks again.
//! Waiters also look again every `poll` (1 s) in case a notification was lost,
//! and with a back-off of 5 ms up to 50 ms while the listener is down.
//! Waiters in the releasing process are woken at once.
//!
//! **Poolers.** Behind a pooler in session pooling (PgBouncer's
//! `pool_mode = session`, with `ignore_startup_parameters =
//! extra_float_digits,options`) both modes work: the backend finds at
//! connect that the pooler dropped its startup `options` and sets them on
//! each connection instead. A pooler in transaction pooling is refused at
//! connect with a [`LockError::Config`]: the driver's prepared statements,
//! dlock's session settings and session mode's advisory locks all need a
//! server connection per connection (see `Postgres::inspect` for how it
//! is found out). If the listener's probe notification does not come back
//! (`LISTEN` refused), the backend says so in a `warn` event and its waiters
//! poll with back-off instead; `?listen_url=` gives the listener its own URL.
//!
//! **Session mode** (`?mode=session`): `pg_advisory_lock` on a dedicated
//! connection per held lock (see [session mode](super#session-mode)). The key is the
//! first 64 bits of the stored key's SHA-256; the fencing token comes from the
//! hybrid counter row of `<table>_fence`, bumped in the same round trip as
//! the grant. Advisory locks are not replicated: session mode is unsafe across
//! a failover.
//!
//! **URL**: `postgres://user:pass@host:port/db?…` with dlock's options
//! `mode=lease|session`, `table=dlock_leases`, `create=true` (with `false`
//! the table is checked, never created — see `PostgresBackend::DDL`),
//! `channel=dlock`, `listen_url=postgres://…` (percent-encoded), `poll=1s`,
//! `retention=10m` (free rows older than this are deleted), `timeout=3s`
//! (bounds every statement); the others (`sslmode`, `application_name`, …)
//! go to the driver.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection as _, Executor as _, Row as _};

use self::listener::Listener;
use self::session::PgSessions;
use super::admin::Row;
use super::engine::{
    Dialect, Pick, Setup, SqlBackend, Started, busy_at, failed, fetch_i64_by_query_scalar,
    holder_text,
};
use super::pool::is_connection_error;
use super::shared::{SharedSql, Stmt, rows_and_exec};
use super::upkeep::millis;
use super::url::{Mode, UrlOptions, check_table_name};
use crate::backend::{AcquireRequest, Attempt, AttemptAll, Lease, Renewal, WakeSource};
use crate::error::{BackendError, LockError, redact_url};
use crate::token::FencingToken;

mod listener;
mod pooler;
mod session;

use self::pooler::{
    is_session_pooled, keeps_its_server, lease_settings, set_session_pooled, settings_sql,
    startup_mark, transaction_pooler,
};

/// The database clock in microseconds, in SQL.
/// The text whose failed cast to `int` rolls back an acquisition of several
/// keys that found one of them busy.
const BUSY_CAST: &str = "dlock: a key is busy";
const NOW_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

/// What the admin statements read of a held row (`sql::admin::Row`).
const HELD: &str = "SELECT key, owner, holder, token, \
    (extract(epoch FROM granted_at) * 1000)::bigint, \
    GREATEST(0, ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000))::bigint";
/// A held row: an owner, an unexpired lease.
const IS_HELD: &str = "owner IS NOT NULL AND expires_at > clock_timestamp()";

const DEFAULT_POLL: Duration = Duration::from_secs(1);
/// The longest back-off of a waiter while the listener is down.
const POLL_WHILE_DEAF: Duration = Duration::from_millis(50);
/// A constant advisory-lock key that serializes dlock's `CREATE TABLE`s.
const SCHEMA_LOCK: i64 = 0x646c_6f63_6b5f_7363; // "dlock_sc"
/// The lease table's connections.
const POOL_SIZE: u32 = 10;
/// The statements of one table.
#[derive(Debug, Clone)]
struct Statements {
    acquire: Arc<str>,
    acquire_all: Arc<str>,
    busy_of: Arc<str>,
    mark: Arc<str>,
    renew: Arc<str>,
    release: Arc<str>,
    inspect: Arc<str>,
    list: Arc<str>,
    list_to_end: Arc<str>,
    revoke: Arc<str>,
    was_revoked: Arc<str>,
}

impl Statements {
    fn new(table: &str) -> Self {
        let s = |sql: String| Arc::<str>::from(sql);
        // How a row is taken: the acquire's, and each row's of the acquire
        // of several keys.
        let take = "ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, \
                     token = GREATEST(l.token + 1, excluded.token), \
                     expires_at = excluded.expires_at, wanted = false, \
                     holder = excluded.holder, \
                     granted_at = CASE WHEN l.owner = excluded.owner THEN l.granted_at \
                                       ELSE excluded.granted_at END \
                 WHERE (l.owner IS NULL OR l.owner = excluded.owner \
                    OR l.expires_at <= clock_timestamp()) \
                   AND (l.shared_until IS NULL OR l.shared_until <= clock_timestamp())";
        Statements {
            acquire: s(format!(
                "INSERT INTO {table} AS l (key, owner, token, expires_at, holder, granted_at) \
                 VALUES ($1, $2, {NOW_US}, clock_timestamp() + $3 * interval '1 millisecond', \
                         $4, clock_timestamp()) \
                 {take} \
                 RETURNING token"
            )),
            // Every key of $1 or none, in one statement (one transaction):
            // the rows are taken in key order; if some but not all were
            // taken, the cast fails and the statement is rolled back
            // (`BUSY_CAST`). No row back: none was taken.
            acquire_all: s(format!(
                "WITH taken AS ( \
                   INSERT INTO {table} AS l (key, owner, token, expires_at, holder, granted_at) \
                   SELECT k, $2, {NOW_US}, clock_timestamp() + $3 * interval '1 millisecond', \
                          $4, clock_timestamp() \
                   FROM unnest($1::text[]) AS k ORDER BY k \
                   {take} \
                   RETURNING key, token) \
                 SELECT key, token FROM taken \
                 WHERE (CASE WHEN (SELECT count(*) FROM taken) = cardinality($1::text[]) \
                        THEN '1' ELSE '{BUSY_CAST}' END)::int = 1"
            )),
            // The first key of $1 held by another owner.
            busy_of: s(format!(
                "SELECT key FROM {table} WHERE key = ANY($1::text[]) \
                 AND (owner IS NOT NULL AND owner <> $2 AND expires_at > clock_timestamp() \
                      OR shared_until > clock_timestamp()) \
                 ORDER BY key LIMIT 1"
            )),
            // Marks the key as wanted (a write only when it was not marked
            // yet: the row lock orders it against a release, which then
            // notifies) and answers whether it is free and for how long the
            // holder's lease runs.
            mark: s(format!(
                "WITH m AS (UPDATE {table} SET wanted = true WHERE key = $1 AND NOT wanted \
                            RETURNING owner, expires_at, shared_until), \
                      r AS (SELECT owner, expires_at, shared_until FROM m \
                            UNION ALL \
                            SELECT owner, expires_at, shared_until FROM {table} \
                            WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM m)) \
                 SELECT (owner IS NULL OR expires_at <= clock_timestamp()) \
                        AND (shared_until IS NULL OR shared_until <= clock_timestamp()), \
                        GREATEST(0, ceil(extract(epoch FROM \
                            GREATEST(CASE WHEN owner IS NULL THEN NULL ELSE expires_at END, shared_until) \
                            - clock_timestamp()) * 1000))::bigint \
                 FROM r"
            )),
            renew: s(format!(
                "UPDATE {table} AS l \
                 SET expires_at = clock_timestamp() + b.ttl * interval '1 millisecond' \
                 FROM unnest($1::text[], $2::text[], $3::int8[]) AS b(key, owner, ttl) \
                 WHERE l.key = b.key AND l.owner = b.owner AND l.expires_at > clock_timestamp() \
                 RETURNING l.key, l.owner"
            )),
            release: s(format!(
                "WITH r AS (UPDATE {table} SET owner = NULL, expires_at = clock_timestamp() \
                            WHERE key = $1 AND owner = $2 RETURNING key, wanted) \
                 SELECT pg_notify($3, key) FROM r WHERE wanted"
            )),
            inspect: s(format!("{HELD} FROM {table} WHERE key = $1 AND {IS_HELD}")),
            list: s(format!(
                "{HELD} FROM {table} WHERE key >= $1 AND key < $2 AND {IS_HELD} \
                 ORDER BY key LIMIT $3"
            )),
            list_to_end: s(format!(
                "{HELD} FROM {table} WHERE key >= $1 AND {IS_HELD} ORDER BY key LIMIT $2"
            )),
            // Frees the row like a release, and always notifies: waiters
            // look again as after a release.
            revoke: s(format!(
                "WITH r AS (UPDATE {table} \
                            SET owner = NULL, expires_at = clock_timestamp(), revoked = owner \
                            WHERE key = $1 AND owner = $2 RETURNING key) \
                 SELECT pg_notify($3, key)::text FROM r"
            )),
            was_revoked: s(format!(
                "SELECT 1 FROM {table} WHERE key = $1 AND revoked = $2"
            )),
        }
    }
}

/// PostgreSQL: the lease table or advisory locks. See the [module docs](self).
/// Clones share the connections, the listener and the held session locks.
pub type PostgresBackend = SqlBackend<Postgres>;

/// PostgreSQL's part of a [`PostgresBackend`]: its statements and its
/// `LISTEN` connection.
pub struct Postgres {
    sql: Statements,
    channel: String,
    listener: Option<Arc<Listener>>,
}

/// Transient SQLSTATEs: serialization failure, deadlock, lock or statement
/// timeout, shutdown and startup, too many connections, read-only (a
/// failover in progress); and the classes 08 (connection) and 53 (resources).
fn pg_error(err: sqlx::Error) -> BackendError {
    let transient = is_connection_error(&err)
        || matches!(&err, sqlx::Error::Database(db) if db.code().is_some_and(|c| {
            c.starts_with("08")
                || c.starts_with("53")
                || matches!(
                    c.as_ref(),
                    "40001" | "40P01" | "55P03" | "57014" | "57P01" | "57P02" | "57P03" | "25006"
                )
        }));
    if transient {
        BackendError::transient(err)
    } else {
        BackendError::permanent(err)
    }
}

fn sqlstate(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// What a `postgres://` URL says for the driver and for PostgreSQL alone.
#[derive(Clone)]
pub struct PgOptions {
    driver: PgConnectOptions,
    channel: String,
    listen: Option<PgConnectOptions>,
}

/// The driver's options from `url`; errors name the URL as `shown` (the
/// user's URL, redacted: `url` may be a re-encoded form of it, in which a
/// malformed password no longer looks like one).
fn driver_options(url: &str, shown: &str) -> Result<PgConnectOptions, LockError> {
    let options = PgConnectOptions::from_str(url).map_err(|e| {
        LockError::config(format!(
            "bad PostgreSQL URL `{shown}`: {}",
            // The driver's message may quote the URL: keep only its kind.
            match e {
                sqlx::Error::Configuration(c) => c.to_string(),
                other => other.to_string(),
            }
            .replace(url, shown)
        ))
    })?;
    let named = options.get_application_name().is_some();
    Ok(if named {
        options
    } else {
        options.application_name("dlock")
    })
}

impl PostgresBackend {
    /// The lease table dlock creates (with `?create=true`, the default), for
    /// DBAs who create it themselves (`?create=false`). `dlock_leases` is the
    /// default `?table=`; the session mode's counter table is `<table>_fence`.
    pub const DDL: &'static str = "CREATE TABLE IF NOT EXISTS dlock_leases (\n    \
        key        text COLLATE \"C\" PRIMARY KEY,\n    \
        owner      text,\n    \
        token      bigint      NOT NULL,\n    \
        expires_at timestamptz NOT NULL,\n    \
        wanted     boolean     NOT NULL DEFAULT false,\n    \
        holder     text,\n    \
        granted_at timestamptz,\n    \
        revoked    text,\n    \
        shared_until timestamptz,\n    \
        wwait_owner  text,\n    \
        wwait_until  timestamptz,\n    \
        wwait_token  bigint\n) WITH (fillfactor = 80);\n\
        CREATE TABLE IF NOT EXISTS dlock_leases_fence (\n    \
        k          bigint PRIMARY KEY,\n    \
        token      bigint NOT NULL,\n    \
        name       text COLLATE \"C\",\n    \
        holder     text,\n    \
        granted_at timestamptz,\n    \
        permits    integer,\n    \
        slot       integer\n);\n\
        CREATE TABLE IF NOT EXISTS dlock_leases_holders (\n    \
        key        text COLLATE \"C\" NOT NULL,\n    \
        slot       bigint      NOT NULL,\n    \
        permits    bigint      NOT NULL,\n    \
        owner      text,\n    \
        token      bigint      NOT NULL,\n    \
        expires_at timestamptz NOT NULL,\n    \
        holder     text,\n    \
        granted_at timestamptz,\n    \
        revoked    text,\n    \
        PRIMARY KEY (key, slot)\n);";

    /// Connects to the database a `postgres://` URL names, creating (or
    /// checking) the table. See the [module docs](self) for the options.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::open(url).await
    }

    /// Whether waiters are woken by `NOTIFY` now (lease mode, listener up).
    pub fn is_listening(&self) -> bool {
        self.dialect.listener.as_ref().is_some_and(|l| l.is_up())
    }

    /// Marks the key as wanted and peeks at it: `Busy` until the holder's
    /// lease ends, or `None` when it is free (or its row is gone).
    async fn mark_and_peek(
        &self,
        request: &AcquireRequest,
    ) -> Result<Option<Attempt>, BackendError> {
        let peek: Option<(bool, i64)> = self
            .db
            .call("mark", |c| {
                let sql = self.dialect.sql.mark.clone();
                let key = request.key.clone();
                Box::pin(async move {
                    sqlx::query_as(AssertSqlSafe(sql))
                        .bind(key)
                        .fetch_optional(c)
                        .await
                })
            })
            .await?;
        Ok(match peek {
            None | Some((true, _)) => None,
            Some((false, remaining_ms)) => Some(Attempt::Busy {
                retry_in: Some(Duration::from_millis(remaining_ms.max(0) as u64)),
            }),
        })
    }

    /// The answer for `request`'s key found busy: for a registered waiter,
    /// the key marked as wanted (its release then notifies) and its holder's
    /// remaining lease; a back-off while the listener is down.
    async fn busy_answer(&self, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        if !self.contenders.is_registered(&request.owner) {
            // The first attempt (the wait loop registers and tries again at
            // once), or one that does not wait at all: no mark.
            return Ok(Attempt::Busy { retry_in: None });
        }
        if !self.is_listening() {
            let backoff = self
                .contenders
                .next_backoff(&request.owner, POLL_WHILE_DEAF.min(self.poll));
            return Ok(Attempt::Busy { retry_in: backoff });
        }
        // Another waiter took it (and cleared the mark): mark it again, so
        // that its release notifies.
        Ok(self.mark_and_peek(request).await?.unwrap_or(Attempt::Busy {
            retry_in: Some(Duration::ZERO),
        }))
    }
}

impl Dialect for Postgres {
    type Db = sqlx::Postgres;
    type Options = PgOptions;
    /// `server_version_num`.
    type Facts = i64;
    type Sessions = PgSessions;

    const KIND: &'static str = "postgres";
    const NAME: &'static str = "PostgresBackend";
    const SCHEME: &'static str = "postgres://";
    const SCHEMES: &'static [&'static str] = &["postgres", "postgresql"];
    const DEFAULT_POLL: Duration = DEFAULT_POLL;
    const DDL: &'static str = PostgresBackend::DDL;
    const LEASE_COLUMNS: &'static str = "key, owner, token, expires_at, wanted";
    const HOLDERS_COLUMNS: &'static str =
        "key, slot, permits, owner, token, expires_at, holder, granted_at, revoked";

    fn classify(err: sqlx::Error) -> BackendError {
        pg_error(err)
    }

    fn options(o: &mut UrlOptions, shown: &str, base: &str) -> Result<PgOptions, LockError> {
        let channel = o.take("channel").unwrap_or_else(|| "dlock".to_owned());
        if check_table_name(&channel).is_err() || channel.contains('.') {
            return Err(LockError::config(format!(
                "bad `channel={channel}` in `{shown}`: a plain identifier is expected"
            )));
        }
        let listen = match o.take("listen_url") {
            Some(url) => {
                if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
                    return Err(LockError::config(format!(
                        "`listen_url` in `{shown}` must be a postgres:// URL"
                    )));
                }
                Some(driver_options(&url, &redact_url(&url))?)
            }
            None => None,
        };
        Ok(PgOptions {
            driver: driver_options(&o.driver_url(Self::SCHEME, base), shown)?,
            channel,
            listen,
        })
    }

    fn lease_pool(
        options: PgOptions,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<PgPool, sqlx::Error>> {
        let lease_options = lease_settings(options.driver, timeout);
        let mark = startup_mark(&lease_options).unwrap_or_default();
        let settings: Option<Arc<str>> = settings_sql(&lease_options).map(Arc::from);
        Box::pin(async move {
            PgPoolOptions::new()
                .max_connections(POOL_SIZE)
                .min_connections(0)
                .acquire_timeout(timeout)
                .test_before_acquire(false)
                // Behind a session pooler that dropped the startup options
                // (found out by `inspect`), each new connection sets them.
                // Nothing is sent on a direct connection.
                .after_connect(move |conn, _| {
                    let settings = settings.clone().filter(|_| is_session_pooled(&mark));
                    Box::pin(async move {
                        if let Some(sql) = settings {
                            sqlx::raw_sql(AssertSqlSafe(sql)).execute(conn).await?;
                        }
                        Ok(())
                    })
                })
                .connect_with(lease_options)
                .await
        })
    }

    /// Reads `server_version_num`, and finds out whether a pooler stands in
    /// between and how it pools; refuses transaction pooling.
    ///
    /// The lease-table connections carry a mark of their own in their
    /// startup `options` (`pooler::STARTUP_MARK`). Read back with the version (no
    /// extra round trip), it says that the server session was started from
    /// this very connection's startup message: a direct connection, or a
    /// proxy that forwards the startup message and then the bytes, one
    /// server connection per connection. Nothing more is done then. Poolers
    /// start their server connections themselves: PgBouncer refuses
    /// `options` or, told to ignore them, drops them; no pooler can forward
    /// one client's mark to a server session it shares with others unless it
    /// is configured with this setting's name.
    ///
    /// Without the mark, connection `a` (just read on server process `P`,
    /// outside any transaction) and a second connection `b` are watched for
    /// a few rounds: `b` opens a transaction and reads its server process
    /// and the last statement `P` ran (`pg_stat_activity`), `a` reads its
    /// server process, `b` rolls back, `a` reads its own again. A connection
    /// direct or through a session pooler keeps one server connection from
    /// its first statement to its end, used by no other connection: there
    /// `b` never reads `P`, `P`'s last statement is always `a`'s (each
    /// carries a nonce), and `a` always reads `P`; so the check cannot
    /// refuse such a path. A transaction pooler gives a server connection
    /// back to its pool after each transaction and, by default (PgBouncer's
    /// `server_round_robin = 0`), hands out the one given back last: `b`
    /// then gets `P`; when another client took `P` meanwhile, `P` ran its
    /// statement, or it still runs it and `a` gets another; once `b` rolls
    /// back, `a` gets `b`'s. Without other clients this is certain. With
    /// clients running transactions without pause, each of `a`'s reads may
    /// still find `P` free again: measured through PgBouncer 1.18 with a
    /// pool of 4 and three pgbench clients, with one round (pids only), 1
    /// connect in 60 took the pooler for a session pooler; with these four
    /// rounds and `pg_stat_activity`, none in 600 connects. A pooler that
    /// kept every idle client on the same server connection whatever the
    /// others do would pass, and behave as a session pooler. Found behind a
    /// session pooler, the dropped settings are set on `a` and on every
    /// later connection of the pool.
    ///
    /// Every statement here runs with the simple protocol (no prepared
    /// statement), so nothing is left on a pooler's server connections. The
    /// settings dlock relies on (isolation level, statement and lock
    /// timeouts) are session state; they hold on every path this check lets
    /// through.
    fn inspect(
        pool: PgPool,
        _mode: Mode,
        shown_url: String,
    ) -> BoxFuture<'static, Result<i64, LockError>> {
        Box::pin(async move {
            let query_failed =
                |e: sqlx::Error| failed::<Self>(format!("cannot query {shown_url}: {e}"), e);
            let options = pool.connect_options();
            let mark = startup_mark(&options);
            let mut a = pool.acquire().await.map_err(query_failed)?;
            let row = sqlx::raw_sql(
                "SELECT current_setting('server_version_num'), \
                        current_setting('dlock.startup', true), pg_backend_pid()",
            )
            .fetch_one(&mut *a)
            .await
            .map_err(query_failed)?;
            let facts = (|| {
                let version = row.try_get::<String, _>(0)?.parse().unwrap_or(0);
                Ok::<_, sqlx::Error>((
                    version,
                    row.try_get::<Option<String>, _>(1)?,
                    row.try_get::<i32, _>(2)?,
                ))
            })();
            let (version, seen, pid) = facts.map_err(query_failed)?;
            let Some(mark) = mark.filter(|mark| seen.as_deref() != Some(mark.as_str())) else {
                return Ok(version);
            };
            let mut b = PgConnection::connect_with(&options)
                .await
                .map_err(|e| failed::<Self>(format!("cannot connect to {shown_url}: {e}"), e))?;
            let kept = keeps_its_server(&mut a, &mut b, pid).await;
            let _ = b.close().await;
            if !kept.map_err(query_failed)? {
                return Err(transaction_pooler(&shown_url));
            }
            if let Some(sql) = settings_sql(&options) {
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .execute(&mut *a)
                    .await
                    .map_err(query_failed)?;
            }
            set_session_pooled(mark);
            Ok(version)
        })
    }

    fn schema_missing(err: &sqlx::Error) -> Option<bool> {
        // 42P01: no such table (42703: a column is missing).
        match sqlstate(err).as_deref() {
            Some("42P01") => Some(true),
            Some("42703") => Some(false),
            _ => None,
        }
    }

    fn create_table(pool: PgPool, ddl: String) -> BoxFuture<'static, Result<(), sqlx::Error>> {
        // Concurrent `CREATE TABLE IF NOT EXISTS` can fail with a unique
        // violation on the catalog: dlock's creators take turns under an
        // advisory lock, and a duplicate table (or type) still counts as done.
        Box::pin(async move {
            let mut tx = pool.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(SCHEMA_LOCK)
                .execute(&mut *tx)
                .await?;
            (&mut *tx).execute(AssertSqlSafe(ddl)).await?;
            tx.commit().await
        })
    }

    fn created_meanwhile(err: &sqlx::Error) -> bool {
        matches!(sqlstate(err).as_deref(), Some("42P07" | "23505"))
    }

    fn start(setup: Setup<'_, Self>) -> BoxFuture<'_, Result<Started<Self>, LockError>> {
        let Setup {
            pool,
            target,
            facts: version,
            waiters,
            shown_url,
        } = setup;
        Box::pin(async move {
            let options = &target.options;
            let timeout = target.timeout;
            let (listener, sessions) = match target.mode {
                Mode::Lease => {
                    let listen_options = options.listen.clone().unwrap_or(options.driver.clone());
                    let listener = Arc::new(Listener::start(
                        listen_options,
                        options.channel.clone(),
                        waiters.clone(),
                        timeout,
                    ));
                    let probed = crate::driver::run({
                        let (pool, listener) = (pool.clone(), listener.clone());
                        async move { listener.probe(&pool, timeout).await }
                    })
                    .await;
                    if probed {
                        (Some(listener), None)
                    } else {
                        tracing::warn!(
                            url = %shown_url,
                            listen_url = options.listen.is_some(),
                            "dlock postgres: a test notification did not come back through LISTEN \
                             (a transaction-pooling proxy such as PgBouncer, or LISTEN refused): \
                             waiters poll with back-off instead. Give a direct connection for \
                             LISTEN with `?listen_url=`"
                        );
                        (None, None)
                    }
                }
                Mode::Session => {
                    let sessions =
                        PgSessions::new(options.driver.clone(), version, &target.table, timeout)
                            .await
                            .map_err(|e| {
                                failed::<Self>(format!("cannot connect to {shown_url}: {e}"), e)
                            })?;
                    (None, Some(sessions))
                }
            };
            let dialect = Postgres {
                sql: Statements::new(&target.table),
                channel: options.channel.clone(),
                listener,
            };
            Ok((dialect, sessions))
        })
    }

    fetch_i64_by_query_scalar!();
    rows_and_exec!(String, sqlx::PgConnection);

    const SHARED_COLUMNS: &'static str = "shared_until, wwait_owner, wwait_until, wwait_token";

    fn add_shared_columns(table: &str) -> Vec<String> {
        [
            "shared_until timestamptz",
            "wwait_owner text",
            "wwait_until timestamptz",
            "wwait_token bigint",
        ]
        .iter()
        .map(|column| format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column}"))
        .collect()
    }

    fn collect_holders_sql(table: &str) -> String {
        format!(
            "DELETE FROM {table}_holders \
             WHERE expires_at < clock_timestamp() - $1 * interval '1 millisecond'"
        )
    }

    fn shared_sql(&self, table: &str) -> SharedSql {
        let h = format!("{table}_holders");
        let left = |at: &str| {
            format!(
                "GREATEST(0, ceil(extract(epoch FROM {at} - clock_timestamp()) * 1000))::bigint"
            )
        };
        let live = "owner IS NOT NULL AND expires_at > clock_timestamp()";
        let entry = format!(
            "SELECT key, owner, holder, token, (extract(epoch FROM granted_at) * 1000)::bigint, \
             {}, slot, permits FROM {h}",
            left("expires_at")
        );
        let until = |arg: &str| format!("clock_timestamp() + {arg} * interval '1 millisecond'");
        SharedSql {
            ensure: Stmt::new(
                format!(
                    "INSERT INTO {table} (key, owner, token, expires_at) \
                     VALUES ($1, NULL, 0, clock_timestamp()) ON CONFLICT (key) DO NOTHING"
                ),
                &[0],
            ),
            lock: Stmt::new(
                format!(
                    "SELECT CASE WHEN owner IS NOT NULL AND expires_at > clock_timestamp() \
                                 THEN {} END, \
                            CASE WHEN wwait_owner IS NOT NULL AND wwait_owner <> $2 \
                                      AND wwait_until > clock_timestamp() AND wwait_token = token \
                                 THEN {} END \
                     FROM {table} WHERE key = $1 FOR UPDATE",
                    left("expires_at"),
                    left("wwait_until")
                ),
                &[0, 1],
            ),
            holders: Stmt::new(
                format!(
                    "SELECT slot, permits, owner, {} FROM {h} WHERE key = $1 AND {live} \
                     ORDER BY slot",
                    left("expires_at")
                ),
                &[0],
            ),
            // The holder rows are read in the statement's snapshot, which
            // predates any wait for the key's row lock. Every change of a
            // key's live holder rows updates the key's row in the same
            // transaction, so they are the rows the lock found when the
            // row's version (`xmin`) is the one of that snapshot.
            lock_holders: Some(Stmt::new(
                format!(
                    "SELECT CASE WHEN t.owner IS NOT NULL AND t.expires_at > clock_timestamp() \
                                 THEN {} END, \
                            CASE WHEN t.wwait_owner IS NOT NULL AND t.wwait_owner <> $2 \
                                      AND t.wwait_until > clock_timestamp() \
                                      AND t.wwait_token = t.token \
                                 THEN {} END, \
                            (CASE WHEN t.xmin = (SELECT s.xmin FROM {table} s WHERE s.key = $1) \
                                  THEN 1 ELSE 0 END)::bigint, \
                            h.slot, h.permits, h.owner, {} \
                     FROM {table} t LEFT JOIN {h} h ON h.key = t.key \
                          AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp() \
                     WHERE t.key = $1 ORDER BY h.slot FOR UPDATE OF t",
                    left("t.expires_at"),
                    left("t.wwait_until"),
                    left("h.expires_at")
                ),
                &[0, 1],
            )),
            take: Stmt::new(
                format!(
                    "INSERT INTO {h} AS h (key, slot, permits, owner, token, expires_at, holder, granted_at) \
                     VALUES ($1, $2, $3, $4, CASE WHEN $7 >= 0 THEN $7 ELSE {NOW_US} END, {}, $6, \
                             clock_timestamp()) \
                     ON CONFLICT (key, slot) DO UPDATE SET permits = excluded.permits, \
                         owner = excluded.owner, \
                         token = CASE WHEN $7 >= 0 THEN $7 ELSE GREATEST(h.token + 1, excluded.token) END, \
                         expires_at = excluded.expires_at, holder = excluded.holder, \
                         granted_at = CASE WHEN h.owner = excluded.owner THEN h.granted_at \
                                           ELSE excluded.granted_at END \
                     RETURNING token",
                    until("$5")
                ),
                &[0, 1, 2, 3, 4, 5, 6],
            ),
            slot_token: None,
            share: Stmt::new(
                format!(
                    "UPDATE {table} SET shared_until = GREATEST(shared_until, {}), \
                     token = CASE WHEN $3 = 1 THEN GREATEST(token + 1, {NOW_US}) ELSE token END \
                     WHERE key = $1 RETURNING token",
                    until("$2")
                ),
                &[0, 1, 2],
            ),
            key_token: None,
            // The share ends no later than the `shared_until` it raised
            // (each `clock_timestamp()` is later than the one before): a
            // writer never finds the key free beside a live share.
            grant: Some(Stmt::new(
                format!(
                    "WITH s AS (UPDATE {table} SET shared_until = GREATEST(shared_until, {}), \
                         token = CASE WHEN $7 = 1 THEN GREATEST(token + 1, {NOW_US}) ELSE token END \
                         WHERE key = $1 RETURNING token, shared_until) \
                     INSERT INTO {h} AS h (key, slot, permits, owner, token, expires_at, holder, granted_at) \
                     SELECT $1, $2, $3, $4, CASE WHEN $7 = 1 THEN s.token ELSE {NOW_US} END, \
                            LEAST({}, s.shared_until), $6, clock_timestamp() FROM s \
                     ON CONFLICT (key, slot) DO UPDATE SET permits = excluded.permits, \
                         owner = excluded.owner, \
                         token = CASE WHEN $7 = 1 THEN excluded.token \
                                      ELSE GREATEST(h.token + 1, excluded.token) END, \
                         expires_at = excluded.expires_at, holder = excluded.holder, \
                         granted_at = CASE WHEN h.owner = excluded.owner THEN h.granted_at \
                                           ELSE excluded.granted_at END \
                     RETURNING token",
                    until("$5"),
                    until("$5")
                ),
                &[0, 1, 2, 3, 4, 5, 6],
            )),
            open: None,
            grant_commit: None,
            wanted: Some(Stmt::new(
                format!("UPDATE {table} SET wanted = true WHERE key = $1 AND NOT wanted"),
                &[0],
            )),
            mark_writer: Stmt::new(
                format!(
                    "UPDATE {table} SET wwait_owner = $2, wwait_until = {}, \
                     wwait_token = token, wanted = true \
                     WHERE key = $1 AND (wwait_owner IS NULL OR wwait_owner = $2 \
                        OR wwait_until <= clock_timestamp() OR wwait_token IS DISTINCT FROM token)",
                    until("$3")
                ),
                &[0, 1, 2],
            ),
            unmark_writer: Stmt::new(
                format!(
                    "UPDATE {table} SET wwait_owner = NULL WHERE key = $1 AND wwait_owner = $2"
                ),
                &[0, 1],
            ),
            renew_holder: Stmt::new(
                format!(
                    "UPDATE {h} SET expires_at = {} \
                     WHERE key = $1 AND owner = $3 AND ($2 < 0 OR slot = $2) \
                       AND expires_at > clock_timestamp()",
                    until("$4")
                ),
                &[0, 1, 2, 3],
            ),
            free_holder: Stmt::new(
                format!(
                    "UPDATE {h} SET owner = NULL, expires_at = clock_timestamp() \
                     WHERE key = $1 AND owner = $3 AND ($2 < 0 OR slot = $2)"
                ),
                &[0, 1, 2],
            ),
            reshare: Stmt::new(
                format!(
                    "UPDATE {table} SET shared_until = \
                       (SELECT max(h.expires_at) FROM {h} h WHERE h.key = $1 \
                        AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp()), \
                     wwait_owner = NULLIF(wwait_owner, $2) \
                     WHERE key = $1"
                ),
                &[0, 1],
            ),
            notify: Some(Stmt::new(
                format!(
                    "SELECT pg_notify('{}', key)::text FROM {table} WHERE key = $1 AND wanted",
                    self.channel
                ),
                &[0],
            )),
            // The key's holder rows are read in the statement's snapshot,
            // before its own freeing: the freed rows are left out by the
            // freeing's own condition.
            release: Some(Stmt::new(
                format!(
                    "WITH f AS (UPDATE {h} SET owner = NULL, expires_at = clock_timestamp() \
                         WHERE key = $1 AND owner = $3 AND ($2 < 0 OR slot = $2)), \
                     r AS (UPDATE {table} SET shared_until = \
                           (SELECT max(h.expires_at) FROM {h} h WHERE h.key = $1 \
                            AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp() \
                            AND NOT (h.owner = $3 AND ($2 < 0 OR h.slot = $2))), \
                         wwait_owner = NULLIF(wwait_owner, $3) \
                         WHERE key = $1 RETURNING key, wanted) \
                     SELECT pg_notify('{}', key)::text FROM r WHERE wanted",
                    self.channel
                ),
                &[0, 1, 2],
            )),
            // The release of `release` in one autocommitted statement. `t`
            // locks the key's row before any holder row is touched (both
            // writes wait on `t`'s one-time filter), the order every
            // transaction of the key keeps. The holder rows are read in the
            // statement's snapshot, which is current exactly when the
            // locked row's version is the snapshot's (see `lock_holders`);
            // otherwise nothing is written and 0 sends the release to its
            // transaction.
            release_now: Some(Stmt::new(
                format!(
                    "WITH t AS (SELECT t.key, \
                         t.xmin = (SELECT s.xmin FROM {table} s WHERE s.key = $1) AS fresh \
                         FROM {table} t WHERE t.key = $1 FOR UPDATE), \
                     f AS (UPDATE {h} SET owner = NULL, expires_at = clock_timestamp() \
                         WHERE key = $1 AND owner = $3 AND ($2 < 0 OR slot = $2) \
                         AND (SELECT fresh FROM t)), \
                     r AS (UPDATE {table} SET shared_until = \
                           (SELECT max(h.expires_at) FROM {h} h WHERE h.key = $1 \
                            AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp() \
                            AND NOT (h.owner = $3 AND ($2 < 0 OR h.slot = $2))), \
                         wwait_owner = NULLIF(wwait_owner, $3) \
                         WHERE key = $1 AND (SELECT fresh FROM t) RETURNING key, wanted) \
                     SELECT (CASE WHEN (SELECT fresh FROM t) THEN 1 \
                                  WHEN EXISTS (SELECT 1 FROM t) THEN 0 ELSE -1 END)::bigint, \
                            (SELECT count(pg_notify('{}', key)) FROM r WHERE wanted)",
                    self.channel
                ),
                &[0, 1, 2],
            )),
            was_revoked: Stmt::new(
                format!(
                    "SELECT 1::bigint FROM {h} WHERE key = $1 AND ($2 < 0 OR slot = $2) \
                     AND revoked = $3"
                ),
                &[0, 1, 2],
            ),
            inspect: Stmt::new(
                format!("{entry} WHERE key = $1 AND {live} ORDER BY slot"),
                &[0],
            ),
            inspect_range: Stmt::new(
                format!("{entry} WHERE key >= $1 AND key <= $2 AND {live} ORDER BY key, slot"),
                &[0, 1],
            ),
            list: Stmt::new(
                format!(
                    "SELECT key FROM {table} WHERE key >= $1 AND key < $2 \
                     AND shared_until > clock_timestamp() ORDER BY key LIMIT $3"
                ),
                &[0, 1, 2],
            ),
            list_to_end: Stmt::new(
                format!(
                    "SELECT key FROM {table} WHERE key >= $1 \
                     AND shared_until > clock_timestamp() ORDER BY key LIMIT $2"
                ),
                &[0, 1],
            ),
            revoke: Stmt::new(
                format!(
                    "UPDATE {h} SET revoked = owner, owner = NULL, expires_at = clock_timestamp() \
                     WHERE key = $1 AND {live}"
                ),
                &[0],
            ),
        }
    }

    async fn try_lease(
        backend: &PostgresBackend,
        request: &AcquireRequest,
    ) -> Result<Attempt, BackendError> {
        // A registered waiter (not its first attempt) looks before it writes:
        // woken together, the waiters of a key read instead of queueing on
        // its row lock, and only those that find it free try to take it.
        let waiting = backend.contenders.is_registered(&request.owner) && backend.is_listening();
        if waiting && let Some(busy) = backend.mark_and_peek(request).await? {
            return Ok(busy);
        }
        let token: Option<i64> = backend
            .db
            .call_for(&request.owner, "acquire", |c| {
                let sql = backend.dialect.sql.acquire.clone();
                let (key, owner) = (request.key.clone(), request.owner.clone());
                let ms = millis(request.lease);
                let holder = holder_text(&request.holder, Self::HOLDER_MAX);
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .bind(ms)
                        .bind(holder)
                        .fetch_optional(c)
                        .await
                })
            })
            .await?;
        if let Some(token) = token {
            return Ok(Attempt::Held(Lease::new(
                request,
                Some(FencingToken::new(token as u64)),
            )));
        }
        backend.busy_answer(request).await
    }

    async fn try_leases(
        backend: &PostgresBackend,
        requests: &[AcquireRequest],
    ) -> Result<AttemptAll, BackendError> {
        let Some(first) = requests.first() else {
            return Ok(AttemptAll::Held(Vec::new()));
        };
        let keys: Vec<String> = requests.iter().map(|r| r.key.clone()).collect();
        let ms = millis(first.lease);
        let taken: Vec<(String, i64)> = backend
            .db
            .call_for(&first.owner, "acquire several", |c| {
                let sql = backend.dialect.sql.acquire_all.clone();
                let (keys, owner) = (keys.clone(), first.owner.clone());
                let holder = holder_text(&first.holder, Self::HOLDER_MAX);
                Box::pin(async move {
                    let taken = sqlx::query_as(AssertSqlSafe(sql))
                        .bind(keys)
                        .bind(owner)
                        .bind(ms)
                        .bind(holder)
                        .fetch_all(c)
                        .await;
                    match taken {
                        Err(sqlx::Error::Database(e))
                            if e.code().as_deref() == Some("22P02")
                                && e.message().contains(BUSY_CAST) =>
                        {
                            Ok(Vec::new())
                        }
                        taken => taken,
                    }
                })
            })
            .await?;
        if taken.len() == requests.len() {
            let token_of = |key: &str| {
                taken
                    .iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, token)| FencingToken::new(*token as u64))
            };
            return Ok(AttemptAll::Held(
                requests
                    .iter()
                    .map(|r| Lease::new(r, token_of(&r.key)))
                    .collect(),
            ));
        }
        // Busy: nothing was taken. Which key, and its busy answer.
        let busy: Option<String> = backend
            .db
            .call("busy key", |c| {
                let sql = backend.dialect.sql.busy_of.clone();
                let (keys, owner) = (keys.clone(), first.owner.clone());
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(keys)
                        .bind(owner)
                        .fetch_optional(c)
                        .await
                })
            })
            .await?;
        match busy.and_then(|key| requests.iter().position(|r| r.key == key)) {
            Some(i) => busy_at(i, backend.busy_answer(&requests[i]).await?),
            // Free again since: look again at once.
            None => Ok(AttemptAll::Busy {
                key: 0,
                retry_in: Some(Duration::ZERO),
            }),
        }
    }

    fn lease_wake(backend: &PostgresBackend, source: WakeSource) -> WakeSource {
        // Notified releases wake the others; the poll catches a lost one.
        source.poll_every(backend.poll)
    }

    async fn renew_leases(
        backend: &PostgresBackend,
        batch: &[(&Lease, Duration)],
    ) -> Result<Vec<Renewal>, BackendError> {
        let keys: Vec<String> = batch.iter().map(|(l, _)| l.key.clone()).collect();
        let owners: Vec<String> = batch.iter().map(|(l, _)| l.owner.clone()).collect();
        let ttls: Vec<i64> = batch.iter().map(|(_, ttl)| millis(*ttl)).collect();
        let renewed: Vec<(String, String)> = backend
            .db
            .call("renew", |c| {
                let sql = backend.dialect.sql.renew.clone();
                let (keys, owners, ttls) = (keys.clone(), owners.clone(), ttls.clone());
                Box::pin(async move {
                    sqlx::query_as(AssertSqlSafe(sql))
                        .bind(keys)
                        .bind(owners)
                        .bind(ttls)
                        .fetch_all(c)
                        .await
                })
            })
            .await?;
        Ok(batch
            .iter()
            .map(|(lease, _)| {
                if renewed
                    .iter()
                    .any(|(k, o)| *k == lease.key && *o == lease.owner)
                {
                    Renewal::Renewed
                } else {
                    Renewal::Lost
                }
            })
            .collect())
    }

    async fn release_lease(backend: &PostgresBackend, lease: &Lease) -> Result<(), BackendError> {
        backend
            .db
            .call_for(&lease.owner, "release", |c| {
                let sql = backend.dialect.sql.release.clone();
                let (key, owner, channel) = (
                    lease.key.clone(),
                    lease.owner.clone(),
                    backend.dialect.channel.clone(),
                );
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .bind(channel)
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
                "DELETE FROM {table} \
                 WHERE expires_at < clock_timestamp() - $1 * interval '1 millisecond' \
                   AND (shared_until IS NULL \
                        OR shared_until < clock_timestamp() - $1 * interval '1 millisecond')"
            ),
            // A fence row's token is at least the clock (µs) of its last
            // grant: rows untouched for the retention go.
            Mode::Session => {
                format!("DELETE FROM {table}_fence WHERE token < {NOW_US} - $1 * 1000")
            }
        }
    }

    fn retention(retention: Duration) -> i64 {
        millis(retention)
    }

    fn debug_fields(backend: &PostgresBackend, d: &mut fmt::DebugStruct<'_, '_>) {
        d.field("listening", &backend.is_listening()).field(
            "listener_connects",
            &backend.dialect.listener.as_ref().map(|l| l.connects()),
        );
    }

    const HOLDER_COLUMNS: &'static str = "holder, granted_at, revoked";
    const GRANTED_UNIT: Duration = Duration::from_millis(1);
    const HOLDER_MAX: usize = 1024;

    fn add_holder_columns(table: &str) -> Vec<String> {
        ["holder text", "granted_at timestamptz", "revoked text"]
            .iter()
            .map(|column| format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column}"))
            .collect()
    }

    const FENCE_COLUMNS: &'static str = "name, holder, granted_at, permits, slot";

    const SESSION_READERS: bool = true;

    fn add_fence_columns(table: &str) -> Vec<String> {
        [
            "name text COLLATE \"C\"",
            "holder text",
            "granted_at timestamptz",
            "permits integer",
            "slot integer",
        ]
        .iter()
        .map(|column| format!("ALTER TABLE {table}_fence ADD COLUMN IF NOT EXISTS {column}"))
        .collect()
    }

    fn column_exists(err: &sqlx::Error) -> bool {
        // 42701: duplicate column (a race past `IF NOT EXISTS`).
        sqlstate(err).as_deref() == Some("42701")
    }

    async fn held_rows(backend: &PostgresBackend, pick: Pick) -> Result<Vec<Row>, BackendError> {
        type Held = (String, String, Option<String>, i64, Option<i64>, i64);
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
        Ok(rows
            .into_iter()
            .map(
                |(key, owner, holder, token, granted_at, expires_in_ms)| Row {
                    key,
                    owner,
                    holder,
                    token,
                    granted_at,
                    expires_in_ms,
                },
            )
            .collect())
    }

    async fn revoke_row(
        backend: &PostgresBackend,
        key: &str,
        owner: &str,
    ) -> Result<bool, BackendError> {
        let freed = backend
            .db
            .call("revoke", |c| {
                let sql = backend.dialect.sql.revoke.clone();
                let (key, owner, channel) = (
                    key.to_owned(),
                    owner.to_owned(),
                    backend.dialect.channel.clone(),
                );
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .bind(channel)
                        .fetch_all(c)
                        .await
                })
            })
            .await?;
        Ok(!freed.is_empty())
    }

    async fn was_revoked(
        backend: &PostgresBackend,
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

    fn parse_url(url: &str) -> Result<Target<PgOptions>, LockError> {
        Target::parse::<Postgres>(url)
    }

    #[test]
    fn urls() {
        let t = parse_url(
            "postgres://u:p@h:5432/db?mode=session&table=locks&sslmode=disable&poll=250ms&timeout=1s",
        )
        .unwrap();
        assert_eq!(t.mode, Mode::Session);
        assert_eq!(t.table, "locks");
        assert_eq!(t.poll, Duration::from_millis(250));
        assert_eq!(t.timeout, Duration::from_secs(1));
        assert_eq!(t.options.driver.get_host(), "h");
        assert_eq!(t.options.driver.get_database(), Some("db"));
        assert_eq!(t.options.driver.get_application_name(), Some("dlock"));
        let t =
            parse_url("postgresql://h/db?listen_url=postgres%3A%2F%2Fdirect%3A6432%2Fdb").unwrap();
        assert_eq!(t.options.listen.unwrap().get_port(), 6432);
        for bad in [
            "postgres://h/db?mode=advisory",
            "postgres://h/db?table=x;y",
            "postgres://h/db?channel=a.b",
            "postgres://h/db?listen_url=redis://x",
            "postgres://h/db?poll=0s",
        ] {
            assert!(
                matches!(parse_url(bad), Err(LockError::Config { .. })),
                "{bad}"
            );
        }
        let Err(err) = parse_url("postgres://u:hunter2@h/db?mode=nope") else {
            panic!("bad mode accepted")
        };
        assert!(!err.to_string().contains("hunter2"));
    }

    #[test]
    fn statements_name_the_table() {
        let s = Statements::new("locks.my_leases");
        assert!(s.acquire.contains("INSERT INTO locks.my_leases AS l"));
        assert!(
            Postgres::collect_sql("locks.my_leases", Mode::Session)
                .contains("locks.my_leases_fence")
        );
        let ddl = PostgresBackend::DDL;
        assert!(ddl.contains("dlock_leases ("));
        assert!(ddl.contains("dlock_leases_fence ("));
    }
}
