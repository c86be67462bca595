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
//! INSERT INTO dlock_leases AS l (key, owner, token, expires_at)
//! VALUES ($1, $2, <now µs>, clock_timestamp() + $3 ms)
//! ON CONFLICT (key) DO UPDATE SET owner = excluded.owner,
//!     token = GREATEST(l.token + 1, excluded.token), expires_at = excluded.expires_at, wanted = false
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
//! **PgBouncer** in transaction mode works for everything but `LISTEN`
//! (PgBouncer ≥ 1.21 with `max_prepared_statements`, and
//! `ignore_startup_parameters = options`): give a direct connection for the
//! listener with `?listen_url=`, or the backend finds at connect that its
//! probe notification does not come back, says so in a `warn` event, and its
//! waiters poll with back-off instead.
//!
//! **Session mode** (`?mode=session`): `pg_advisory_lock` on a dedicated
//! connection per held lock (see [session mode](super#session-mode)). The key is the
//! first 64 bits of the stored key's SHA-256; the fencing token comes from the
//! hybrid counter row of `<table>_fence`, bumped in the same round trip as
//! the grant. Advisory locks are not replicated: session mode is unsafe across
//! a failover and behind transaction-pooling proxies (use lease mode there).
//!
//! **URL**: `postgres://user:pass@host:port/db?…` with dlock's options
//! `mode=lease|session`, `table=dlock_leases`, `create=true` (with `false`
//! the table is checked, never created — see [`PostgresBackend::DDL`]),
//! `channel=dlock`, `listen_url=postgres://…` (percent-encoded), `poll=1s`,
//! `retention=10m` (free rows older than this are deleted), `timeout=3s`
//! (bounds every statement); the others (`sslmode`, `application_name`, …)
//! go to the driver.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Executor as _};

use super::common::{
    Collector, Contenders, DEFAULT_RETENTION, Mode, Pooled, UrlOptions, batch_failed,
    check_table_name, is_connection_error, millis, session_hash,
};
use super::pg_listener::Listener;
use super::session::{Locked, SessionDb, Sessions};
use crate::backend::wait::Waiters;
use crate::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal, WakeSource};
use crate::error::{BackendError, LockError, redact_url};
use crate::token::FencingToken;

/// The database clock in microseconds, in SQL.
const NOW_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);
const DEFAULT_POLL: Duration = Duration::from_secs(1);
/// The longest back-off of a waiter while the listener is down.
const POLL_WHILE_DEAF: Duration = Duration::from_millis(50);
/// A constant advisory-lock key that serializes dlock's `CREATE TABLE`s.
const SCHEMA_LOCK: i64 = 0x646c_6f63_6b5f_7363; // "dlock_sc"
/// The lease table's connections.
const POOL_SIZE: u32 = 10;
/// The most session connections one backend opens.
const MAX_SESSIONS: u32 = 1024;
/// How many clean session connections are kept for reuse.
const IDLE_SESSIONS: usize = 128;
/// How long a clean session connection is kept unused before it is closed.
const IDLE_SESSION_FOR: Duration = Duration::from_secs(60);

/// The statements of one table.
#[derive(Debug, Clone)]
struct Statements {
    acquire: Arc<str>,
    mark: Arc<str>,
    renew: Arc<str>,
    release: Arc<str>,
    collect: Arc<str>,
    collect_fence: Arc<str>,
}

impl Statements {
    fn new(table: &str) -> Self {
        let s = |sql: String| Arc::<str>::from(sql);
        Statements {
            acquire: s(format!(
                "INSERT INTO {table} AS l (key, owner, token, expires_at) \
                 VALUES ($1, $2, {NOW_US}, clock_timestamp() + $3 * interval '1 millisecond') \
                 ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, \
                     token = GREATEST(l.token + 1, excluded.token), \
                     expires_at = excluded.expires_at, wanted = false \
                 WHERE l.owner IS NULL OR l.owner = excluded.owner \
                    OR l.expires_at <= clock_timestamp() \
                 RETURNING token"
            )),
            // Marks the key as wanted (a write only when it was not marked
            // yet: the row lock orders it against a release, which then
            // notifies) and answers whether it is free and for how long the
            // holder's lease runs.
            mark: s(format!(
                "WITH m AS (UPDATE {table} SET wanted = true WHERE key = $1 AND NOT wanted \
                            RETURNING owner, expires_at), \
                      r AS (SELECT owner, expires_at FROM m \
                            UNION ALL \
                            SELECT owner, expires_at FROM {table} \
                            WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM m)) \
                 SELECT owner IS NULL OR expires_at <= clock_timestamp(), \
                        GREATEST(0, ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000))::bigint \
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
            collect: s(format!(
                "DELETE FROM {table} \
                 WHERE expires_at < clock_timestamp() - $1 * interval '1 millisecond'"
            )),
            // A fence row's token is at least the clock (µs) of its last
            // grant: rows untouched for the retention go.
            collect_fence: s(format!(
                "DELETE FROM {table}_fence WHERE token < {NOW_US} - $1 * 1000"
            )),
        }
    }
}

/// PostgreSQL: the lease table or advisory locks. See the [module docs](self).
/// Clones share the connections, the listener and the held session locks.
#[derive(Clone)]
pub struct PostgresBackend {
    shown_url: String,
    table: String,
    mode: Mode,
    db: Pooled<sqlx::Postgres>,
    sql: Statements,
    channel: String,
    poll: Duration,
    waiters: Arc<Waiters>,
    contenders: Arc<Contenders>,
    listener: Option<Arc<Listener>>,
    collector: Arc<Collector>,
    sessions: Option<Arc<Sessions<PgSessions>>>,
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("url", &self.shown_url)
            .field("mode", &self.mode)
            .field("table", &self.table)
            .field("listening", &self.is_listening())
            .field(
                "listener_connects",
                &self.listener.as_ref().map(|l| l.connects()),
            )
            .field("sessions", &self.sessions.as_ref().map(|s| s.len()))
            .finish_non_exhaustive()
    }
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

/// What a URL says.
struct Target {
    mode: Mode,
    table: String,
    create: bool,
    channel: String,
    listen: Option<PgConnectOptions>,
    poll: Duration,
    retention: Duration,
    timeout: Duration,
    options: PgConnectOptions,
}

fn parse_url(url: &str) -> Result<Target, LockError> {
    let shown = redact_url(url);
    let (scheme, rest) = url
        .split_once("://")
        .filter(|(s, _)| matches!(s.to_ascii_lowercase().as_str(), "postgres" | "postgresql"))
        .ok_or_else(|| LockError::config(format!("`{shown}` is not a postgres:// URL")))?;
    let _ = scheme;
    let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut o = UrlOptions::parse("postgres://", query)?;
    let mode = o.mode()?;
    let table = o.table()?;
    let create = o.flag("create", true)?;
    let channel = o.take("channel").unwrap_or_else(|| "dlock".to_owned());
    if check_table_name(&channel).is_err() || channel.contains('.') {
        return Err(LockError::config(format!(
            "bad `channel={channel}` in `{shown}`: a plain identifier is expected"
        )));
    }
    let listen_url = o.take("listen_url");
    let poll = o.duration("poll", DEFAULT_POLL, false)?;
    let retention = o.duration("retention", DEFAULT_RETENTION, true)?;
    let timeout = o.duration("timeout", DEFAULT_TIMEOUT, false)?;
    let rest = o.rest();
    let driver_url = if rest.is_empty() {
        format!("postgres://{base}")
    } else {
        format!("postgres://{base}?{rest}")
    };
    let options = driver_options(&driver_url)?;
    let listen = match listen_url {
        Some(url) => {
            if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
                return Err(LockError::config(format!(
                    "`listen_url` in `{shown}` must be a postgres:// URL"
                )));
            }
            Some(driver_options(&url)?)
        }
        None => None,
    };
    Ok(Target {
        mode,
        table,
        create,
        channel,
        listen,
        poll,
        retention,
        timeout,
        options,
    })
}

fn driver_options(url: &str) -> Result<PgConnectOptions, LockError> {
    let options = PgConnectOptions::from_str(url).map_err(|e| {
        LockError::config(format!(
            "bad PostgreSQL URL `{}`: {}",
            redact_url(url),
            // The driver's message may quote the URL: keep only its kind.
            match e {
                sqlx::Error::Configuration(c) => c.to_string(),
                other => other.to_string(),
            }
            .replace(url, &redact_url(url))
        ))
    })?;
    let named = options.get_application_name().is_some();
    Ok(if named {
        options
    } else {
        options.application_name("dlock")
    })
}

/// The session settings of dlock's lease-table connections.
fn lease_settings(options: PgConnectOptions, timeout: Duration) -> PgConnectOptions {
    let ms = millis(timeout).to_string();
    options.options([
        ("default_transaction_isolation", "read committed"),
        ("statement_timeout", ms.as_str()),
        ("lock_timeout", ms.as_str()),
    ])
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
        wanted     boolean     NOT NULL DEFAULT false\n) WITH (fillfactor = 80);\n\
        CREATE TABLE IF NOT EXISTS dlock_leases_fence (k bigint PRIMARY KEY, token bigint NOT NULL);";

    /// Connects to the database a `postgres://` URL names, creating (or
    /// checking) the table. See the [module docs](self) for the options.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let shown_url = redact_url(url);
        let target = parse_url(url)?;
        let timeout = target.timeout;
        let failed = |what: &str, e: sqlx::Error| LockError::Backend {
            backend: "postgres",
            source: {
                let message = format!("{what} {shown_url}: {e}");
                if pg_error(e).is_retryable() {
                    BackendError::transient(message)
                } else {
                    BackendError::permanent(message)
                }
            },
        };
        let lease_options = lease_settings(target.options.clone(), timeout);
        let pool = crate::driver::run(async move {
            PgPoolOptions::new()
                .max_connections(POOL_SIZE)
                .min_connections(0)
                .acquire_timeout(timeout)
                .test_before_acquire(false)
                .connect_with(lease_options)
                .await
        });
        let pool = tokio::time::timeout(timeout, pool)
            .await
            .map_err(|_| LockError::Backend {
                backend: "postgres",
                source: super::common::timed_out(&format!("connecting to {shown_url}"), timeout),
            })?
            .map_err(|e| failed("cannot connect to", e))?;
        let version: i64 = {
            let pool = pool.clone();
            crate::driver::run(async move {
                sqlx::query_scalar::<_, String>("SHOW server_version_num")
                    .fetch_one(&pool)
                    .await
                    .map(|v| v.parse().unwrap_or(0))
            })
            .await
            .map_err(|e| failed("cannot query", e))?
        };
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
        let waiters = Arc::<Waiters>::default();
        let listener = match target.mode {
            Mode::Lease => {
                let listen_options = target.listen.clone().unwrap_or(target.options.clone());
                let listener = Listener::start(
                    listen_options,
                    target.channel.clone(),
                    waiters.clone(),
                    timeout,
                );
                let listener = Arc::new(listener);
                let probed = crate::driver::run({
                    let (pool, listener) = (pool.clone(), listener.clone());
                    async move { listener.probe(&pool, timeout).await }
                })
                .await;
                if probed {
                    Some(listener)
                } else {
                    tracing::warn!(
                        url = %shown_url,
                        listen_url = target.listen.is_some(),
                        "dlock postgres: a test notification did not come back through LISTEN \
                         (a transaction-pooling proxy such as PgBouncer, or LISTEN refused): \
                         waiters poll with back-off instead. Give a direct connection for \
                         LISTEN with `?listen_url=`"
                    );
                    None
                }
            }
            Mode::Session => None,
        };
        let sessions = match target.mode {
            Mode::Lease => None,
            Mode::Session => {
                let session_options = session_settings(target.options.clone(), version);
                let pool = PgPoolOptions::new()
                    .max_connections(MAX_SESSIONS)
                    .min_connections(0)
                    .acquire_timeout(timeout)
                    .test_before_acquire(false)
                    .idle_timeout(None)
                    .max_lifetime(None)
                    // A connection given up is closed, never reused: the
                    // clean ones are kept by `PgSessions` itself.
                    .after_release(|_, _| Box::pin(async { Ok(false) }));
                let pool = crate::driver::run(async move {
                    Ok::<_, sqlx::Error>(pool.connect_lazy_with(session_options))
                })
                .await
                .map_err(|e| failed("cannot connect to", e))?;
                Some(Arc::new(Sessions::new(
                    PgSessions {
                        pool,
                        lock_sql: PgSessions::lock_sql(
                            &format!("{}_fence", target.table),
                            version >= 140_000,
                        ),
                        idle_limit: version >= 140_000,
                        idle: Mutex::default(),
                    },
                    timeout,
                )))
            }
        };
        Ok(PostgresBackend {
            shown_url,
            sql: Statements::new(&target.table),
            table: target.table,
            mode: target.mode,
            db: Pooled {
                pool,
                timeout,
                classify: pg_error,
            },
            channel: target.channel,
            poll: target.poll,
            waiters,
            contenders: Arc::default(),
            listener,
            collector: Arc::new(Collector::new(target.retention)),
            sessions,
        })
    }

    /// Whether waiters are woken by `NOTIFY` now (lease mode, listener up).
    pub fn is_listening(&self) -> bool {
        self.listener.as_ref().is_some_and(|l| l.is_up())
    }

    /// Rows in the lease table (held and free), for tests of bounded state.
    pub async fn row_count(&self) -> Result<u64, LockError> {
        let sql = Arc::<str>::from(format!("SELECT count(*) FROM {}", self.table));
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
            .map_err(|e| e.into_lock_error("postgres"))
    }

    async fn try_lease(&self, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        // A registered waiter (not its first attempt) looks before it writes:
        // woken together, the waiters of a key read instead of queueing on
        // its row lock, and only those that find it free try to take it.
        let waiting = self.contenders.is_registered(&request.owner) && self.is_listening();
        if waiting && let Some(busy) = self.mark_and_peek(request).await? {
            return Ok(busy);
        }
        let token: Option<i64> = self
            .db
            .call("acquire", |c| {
                let sql = self.sql.acquire.clone();
                let (key, owner) = (request.key.clone(), request.owner.clone());
                let ms = millis(request.lease);
                Box::pin(async move {
                    sqlx::query_scalar(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .bind(ms)
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

    /// Marks the key as wanted and peeks at it: `Busy` until the holder's
    /// lease ends, or `None` when it is free (or its row is gone).
    async fn mark_and_peek(
        &self,
        request: &AcquireRequest,
    ) -> Result<Option<Attempt>, BackendError> {
        let peek: Option<(bool, i64)> = self
            .db
            .call("mark", |c| {
                let sql = self.sql.mark.clone();
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

    async fn renew_leases(
        &self,
        batch: &[(&Lease, Duration)],
    ) -> Result<Vec<Renewal>, BackendError> {
        let keys: Vec<String> = batch.iter().map(|(l, _)| l.key.clone()).collect();
        let owners: Vec<String> = batch.iter().map(|(l, _)| l.owner.clone()).collect();
        let ttls: Vec<i64> = batch.iter().map(|(_, ttl)| millis(*ttl)).collect();
        let renewed: Vec<(String, String)> = self
            .db
            .call("renew", |c| {
                let sql = self.sql.renew.clone();
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

    async fn release_lease(&self, lease: &Lease) -> Result<(), BackendError> {
        self.db
            .call("release", |c| {
                let sql = self.sql.release.clone();
                let (key, owner, channel) =
                    (lease.key.clone(), lease.owner.clone(), self.channel.clone());
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(key)
                        .bind(owner)
                        .bind(channel)
                        .execute(c)
                        .await
                })
            })
            .await?;
        self.waiters.wake(&lease.key);
        self.collect_if_due();
        Ok(())
    }

    /// Deletes old free rows (and old fence rows) in the background, at most
    /// once a minute.
    fn collect_if_due(&self) {
        if !self.collector.due() {
            return;
        }
        let pool = self.db.pool.clone();
        let retention = millis(self.collector.retention);
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
                tracing::debug!(error = %err, "dlock postgres: collecting free rows failed; next time");
            }
        });
    }
}

/// Creates the tables (unless `create` is false) and checks that they have
/// the columns dlock uses.
async fn ensure_schema(
    pool: &PgPool,
    table: &str,
    create: bool,
    mode: Mode,
) -> Result<(), LockError> {
    let check = match mode {
        Mode::Lease => format!("SELECT key, owner, token, expires_at, wanted FROM {table} LIMIT 0"),
        Mode::Session => format!("SELECT k, token FROM {table}_fence LIMIT 0"),
    };
    let checked = sqlx::query(AssertSqlSafe(check.clone()))
        .execute(pool)
        .await;
    let missing = match checked {
        Ok(_) => return Ok(()),
        // 42P01: no such table (42703: a column is missing).
        Err(e) if sqlstate(&e).as_deref() == Some("42P01") && create => e,
        Err(e) => {
            return Err(
                if matches!(sqlstate(&e).as_deref(), Some("42P01" | "42703")) {
                    LockError::config(format!(
                        "the lock table `{table}` is missing or lacks dlock's columns ({e}); \
                     create it (see PostgresBackend::DDL, with your table name) or connect \
                     with `?create=true`"
                    ))
                } else {
                    LockError::Backend {
                        backend: "postgres",
                        source: pg_error(e),
                    }
                },
            );
        }
    };
    tracing::debug!(table, error = %missing, "dlock postgres: creating the lock table");
    let ddl = PostgresBackend::DDL
        .replace("dlock_leases_fence", &format!("{table}_fence"))
        .replace("dlock_leases ", &format!("{table} "));
    let ddl = match mode {
        Mode::Lease => ddl
            .split_inclusive(';')
            .next()
            .unwrap_or_default()
            .to_owned(),
        Mode::Session => ddl
            .split_inclusive(';')
            .nth(1)
            .unwrap_or_default()
            .to_owned(),
    };
    // Concurrent `CREATE TABLE IF NOT EXISTS` can fail with a unique
    // violation on the catalog: dlock's creators take turns under an
    // advisory lock, and a duplicate table (or type) still counts as done.
    let created: Result<(), sqlx::Error> = async {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(SCHEMA_LOCK)
            .execute(&mut *tx)
            .await?;
        (&mut *tx).execute(AssertSqlSafe(ddl)).await?;
        tx.commit().await
    }
    .await;
    match created {
        Ok(()) => {}
        Err(e) if matches!(sqlstate(&e).as_deref(), Some("42P07" | "23505")) => {}
        Err(e) => {
            return Err(LockError::Backend {
                backend: "postgres",
                source: {
                    let message = format!("cannot create the lock table `{table}`: {e}");
                    if pg_error(e).is_retryable() {
                        BackendError::transient(message)
                    } else {
                        BackendError::permanent(message)
                    }
                },
            });
        }
    }
    sqlx::query(AssertSqlSafe(check))
        .execute(pool)
        .await
        .map(|_| ())
        .map_err(|e| LockError::Backend {
            backend: "postgres",
            source: pg_error(e),
        })
}

impl LockBackend for PostgresBackend {
    fn kind(&self) -> &'static str {
        "postgres"
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
            Mode::Lease => self
                .waiters
                .source(&request.key)
                .keep_alive(self.contenders.register(&request.owner))
                .poll_every(self.poll),
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
                    Err(err) => batch_failed("postgres", err, batch.len()),
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

/// The session settings of session-mode connections: no statement timeout
/// (the client bounds each call), and on PostgreSQL ≥ 14 a check for a
/// vanished client every second while a lock is waited for.
fn session_settings(options: PgConnectOptions, version: i64) -> PgConnectOptions {
    let options = options.options([
        ("default_transaction_isolation", "read committed"),
        ("statement_timeout", "0"),
    ]);
    if version >= 140_000 {
        options.options([("client_connection_check_interval", "1000")])
    } else {
        options
    }
}

/// PostgreSQL advisory locks.
struct PgSessions {
    /// Makes connections; a connection given back to it is closed.
    pool: PgPool,
    /// See [`PgSessions::lock_sql`].
    lock_sql: Arc<str>,
    /// Whether the server has `idle_session_timeout` (PostgreSQL ≥ 14).
    idle_limit: bool,
    /// Clean connections kept for reuse, oldest first, with when each was
    /// given back.
    idle: Mutex<Vec<(PgListener, std::time::Instant)>>,
}

impl PgSessions {
    /// The kept connections, without those unused for too long (closed as
    /// they are dropped).
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<(PgListener, std::time::Instant)>> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let stale = idle
            .iter()
            .take_while(|(_, since)| since.elapsed() > IDLE_SESSION_FOR)
            .count();
        idle.drain(..stale);
        idle
    }

    /// The lock statement: `$1` the key's hash, `$2` the idle limit (ms,
    /// as text), `$3` how long to wait (ms as text; `0`: try once). The wait's
    /// limit is local to the statement's transaction; the idle limit is set
    /// for the session only when the lock is ours.
    fn lock_sql(fence: &str, idle_limit: bool) -> Arc<str> {
        let limit = if idle_limit {
            "set_config('idle_session_timeout', $2, false)"
        } else {
            "$2::text"
        };
        format!(
            "WITH t AS (SELECT set_config('lock_timeout', $3, true) AS lt), \
                  l AS (SELECT CASE WHEN $3 = '0' THEN pg_try_advisory_lock($1) \
                                    ELSE pg_advisory_lock($1) IS NOT NULL END AS got FROM t) \
             INSERT INTO {fence} AS f (k, token) SELECT $1, {NOW_US} FROM l \
             WHERE CASE WHEN got THEN {limit} IS NOT NULL ELSE false END \
             ON CONFLICT (k) DO UPDATE SET token = GREATEST(f.token + 1, excluded.token) \
             RETURNING token"
        )
        .into()
    }
}

impl SessionDb for PgSessions {
    // A `PgListener` is a connection whose idle socket can be watched:
    // `pg_terminate_backend` or a restart are noticed at once.
    type Conn = PgListener;

    fn open(&self, fresh: bool) -> BoxFuture<'_, Result<PgListener, sqlx::Error>> {
        Box::pin(async move {
            if !fresh && let Some((conn, _)) = self.idle().pop() {
                return Ok(conn);
            }
            let mut conn = PgListener::connect_with(&self.pool).await?;
            conn.eager_reconnect(false);
            conn.ignore_pool_close_event(true);
            Ok(conn)
        })
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut PgListener,
        key: &'a str,
        wait: Duration,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Locked, sqlx::Error>> {
        Box::pin(async move {
            // One round trip, one cached statement: the wait's limit, the
            // lock, the idle limit and the token.
            let wait = if wait.is_zero() {
                "0".to_owned()
            } else {
                millis(wait).to_string()
            };
            let token: Option<i64> = match sqlx::query_scalar(AssertSqlSafe(self.lock_sql.clone()))
                .bind(session_hash(key))
                .bind(idle_limit(ttl))
                .bind(wait)
                .fetch_optional(&mut *conn)
                .await
            {
                Ok(token) => token,
                // 55P03: the wait ran out (the lock may still have been
                // granted in the same instant: the connection is unlocked
                // before it is reused).
                Err(e) if sqlstate(&e).as_deref() == Some("55P03") => {
                    return Ok(Locked::Busy { clean: false });
                }
                Err(e) => return Err(e),
            };
            Ok(match token {
                Some(token) => Locked::Yes(token as u64),
                // Only a try (`wait` zero) answers no row: nothing is held.
                None => Locked::Busy { clean: true },
            })
        })
    }

    fn ping<'a>(
        &'a self,
        conn: &'a mut PgListener,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            if self.idle_limit {
                sqlx::query("SELECT set_config('idle_session_timeout', $1, false)")
                    .bind(idle_limit(ttl))
                    .execute(&mut *conn)
                    .await?;
            } else {
                sqlx::query("SELECT 1").execute(&mut *conn).await?;
            }
            Ok(())
        })
    }

    fn unlock<'a>(&'a self, conn: &'a mut PgListener) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = if self.idle_limit {
                "SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false)"
            } else {
                "SELECT pg_advisory_unlock_all()"
            };
            sqlx::query(sql).execute(&mut *conn).await?;
            Ok(())
        })
    }

    fn watch<'a>(&'a self, conn: &'a mut PgListener) -> BoxFuture<'a, String> {
        Box::pin(async move {
            loop {
                match conn.try_recv().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return "the server closed the connection".to_owned(),
                    Err(e) => return e.to_string(),
                }
            }
        })
    }

    fn recycle(&self, conn: PgListener) {
        let mut idle = self.idle();
        if idle.len() == IDLE_SESSIONS {
            idle.remove(0);
        }
        idle.push((conn, std::time::Instant::now()));
    }

    fn classify(&self, err: sqlx::Error) -> BackendError {
        pg_error(err)
    }
}

/// `idle_session_timeout` for a session lock of `ttl` (ms, as text): the
/// server ends the session of a holder that goes quiet for its whole lease.
/// PostgreSQL takes at most 2³¹−1 ms (about 24.8 days); a longer lease gets no
/// server-side limit (`0`) rather than a shorter one, which could free the
/// key while its holder still counts on it (`watchdog = false` sends no
/// ping). Such a holder's key is then freed when its connection closes.
fn idle_limit(ttl: Duration) -> String {
    let ms = millis(ttl);
    if ms > i64::from(i32::MAX) {
        "0".to_owned()
    } else {
        ms.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_limits_fit_postgres() {
        assert_eq!(idle_limit(Duration::from_millis(1500)), "1500");
        assert_eq!(
            idle_limit(Duration::from_millis(i32::MAX as u64)),
            "2147483647"
        );
        assert_eq!(idle_limit(Duration::from_secs(30 * 86_400)), "0");
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
        assert_eq!(t.options.get_host(), "h");
        assert_eq!(t.options.get_database(), Some("db"));
        assert_eq!(t.options.get_application_name(), Some("dlock"));
        let t =
            parse_url("postgresql://h/db?listen_url=postgres%3A%2F%2Fdirect%3A6432%2Fdb").unwrap();
        assert_eq!(t.listen.unwrap().get_port(), 6432);
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
        assert!(s.collect_fence.contains("locks.my_leases_fence"));
        let ddl = PostgresBackend::DDL;
        assert!(ddl.contains("dlock_leases ("));
        assert!(ddl.contains("dlock_leases_fence ("));
    }
}
