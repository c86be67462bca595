//! PostgreSQL's session flavour: advisory locks on dedicated connections
//! (see [session mode](super::super#session-mode)), each a `PgListener` whose
//! idle socket is watched, so that `pg_terminate_backend` or a restart are
//! noticed at once.
//!
//! **Read-write locks.** A plain lock is the exclusive advisory lock of the
//! key, waited for on the server (as before): it is the write mode. Every
//! share (reader or permit) holds the key's advisory lock in *shared* mode
//! besides its slot, so a writer and a share exclude each other in the
//! server's own lock manager, and a share's connection dying frees both.
//! The shares take the key's lock only by trying, under the key's gate (see
//! [the session engine](crate::backend::sql::session#semaphores-and-readers)):
//! first exclusively (success: no holder and no waiting writer — the share
//! converts it to shared and records its mode), else shared (success:
//! other shares hold it, and the recorded mode decides), else a writer
//! holds it or waits: busy for a reader (the writer's key), a mismatch for a
//! permit. Writers are preferred in two ways: PostgreSQL's lock queue is
//! fair — a shared request that conflicts with a *queued* exclusive request
//! fails, so new readers are busy while a writer waits on the server — and a
//! writer's wait is cut into slices, between which it is not queued; for
//! those gaps the writer holds its key's *waiting-writer mark*
//! ([`writer_mark_hash`], shared) from its first wait until its connection is
//! unlocked (granted writers keep it harmlessly until their release), and a
//! reader that may enter first tries the mark exclusively and is busy if a
//! writer holds it. A cancelled or timed-out writer's connection is
//! unlocked, so no mark outlives its wait; and a writer whose client stalls
//! between two slices (frozen, or cut off with its sockets left open) has
//! its session ended by the server a lease after its last statement, mark
//! included: on PostgreSQL ≥ 14 a wait's first try, finding the key busy,
//! sets the session's idle limit to the lease before the waits (see
//! [`PgSessions::first_wait_sql`]), since a wait that runs out rolls back
//! what its own statement set. Readers poll (the engine's
//! back-off) rather than wait on the server: their answer also depends on
//! the recorded mode, read under the gate.
//!
//! **Semaphores.** Permits are exclusive advisory locks of slot keys,
//! lowest free first, beside the key's shared lock. A plain lock on a key
//! whose row records a semaphore only tries (it does not queue behind the
//! permits) and, busy, answers the mismatch; a permit on a key a plain lock
//! holds finds the key's lock taken and the row naming a plain lock: a
//! mismatch. `inspect` shows the exclusive advisory locks joined with their
//! counter rows: a writer is its key's row, a reader or a permit holder its
//! slot's row (mode and slot from the row), never a name of its own.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection as _};

use super::{NOW_US, pg_error, sqlstate};
use crate::backend::sql::admin::{Row, prefix_successor};
use crate::backend::sql::pool::Checked;
use crate::backend::sql::session::{
    Entry, Locked, MARK_LIFE_US, MarkKind, SessionDb, SlotKind, end_mark, gate_hash, session_hash,
    slot_hash, writer_mark_hash,
};
use crate::backend::sql::upkeep::millis;
use crate::backend::{HeldEntry, HoldMode, KeyEntry};
use crate::error::BackendError;

/// The most session connections one backend opens.
const MAX_SESSIONS: u32 = 1024;
/// How many clean session connections are kept for reuse.
const IDLE_SESSIONS: usize = 128;
/// How many cancels (or session ends) one backend sends at once: a storm of
/// callers hanging up is cancelled in parallel.
const CONTROL_CONNECTIONS: u32 = 4;
/// How long a clean session connection is kept unused before it is closed.
const IDLE_SESSION_FOR: Duration = Duration::from_secs(60);

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
pub struct PgSessions {
    /// Makes connections; a connection given back to it is closed.
    pool: PgPool,
    /// See [`PgSessions::lock_sql`].
    lock_sql: Arc<str>,
    /// See [`PgSessions::first_wait_sql`] (`None`: the server has no idle
    /// limit to set, and a wait's first slice is the lock statement's).
    first_wait_sql: Option<Arc<str>>,
    /// See [`PgSessions::held_sql`]: one key's holder, and the held keys of a range.
    inspect_sql: Arc<str>,
    list_sql: Arc<str>,
    /// See [`PgSessions::mark_sql`], and the kind of a mark already there.
    mark_sql: Arc<str>,
    mark_kind_sql: Arc<str>,
    /// See [`PgSessions::grant_sql`], and the mode recorded with a key.
    grant_sql: Arc<str>,
    mode_sql: Arc<str>,
    /// `<table>_fence`.
    fence: String,
    /// Whether the server has `idle_session_timeout` (PostgreSQL ≥ 14).
    idle_limit: bool,
    /// Whether the connections' `application_name` is dlock's own (the
    /// URL names none), so that it may carry the holder record.
    record_in_name: bool,
    /// Clean connections kept for reuse, oldest first, with when each was
    /// given back.
    idle: Mutex<Vec<(PgSession, std::time::Instant)>>,
    /// A few connections of the backend's own for `pg_cancel_backend` and
    /// `pg_terminate_backend`, opened when first needed (see
    /// [`PgSessions::control`]).
    control: PgPool,
}

/// A session connection: a `PgListener`, whose idle socket can be watched
/// (`pg_terminate_backend` or a restart are noticed at once), and its server
/// process, for a cancel from another connection.
pub struct PgSession {
    listener: PgListener,
    pid: i32,
    /// The holder record its `application_name` carries, once set.
    record: Option<String>,
    /// The key (its hash) this connection waits for between the slices of
    /// a wait: it holds the key's waiting-writer mark and the server's idle
    /// limit is set (see [`PgSessions::first_wait_sql`]). Cleared by an
    /// unlock.
    waits_for: Option<i64>,
}

/// The prefix of a session connection's `application_name` that carries a
/// holder record: `dlock ` then the record's text.
const RECORD_NAME_PREFIX: &str = "dlock ";

/// The longest `application_name` the server keeps (`NAMEDATALEN - 1`).
const APPLICATION_NAME_MAX: usize = 63;

/// The `application_name` that carries `holder`, if the server keeps it
/// unchanged: short enough, and printable ASCII only (the server replaces
/// any other byte).
fn record_name(holder: &str) -> Option<String> {
    let name = format!("{RECORD_NAME_PREFIX}{holder}");
    (name.len() <= APPLICATION_NAME_MAX && name.bytes().all(|b| (b' '..=b'~').contains(&b)))
        .then_some(name)
}

impl PgSessions {
    /// The session locks of a server of `version` (`server_version_num`),
    /// their counters in `<table>_fence`. Connections are opened lazily.
    pub(super) async fn new(
        options: PgConnectOptions,
        version: i64,
        table: &str,
        timeout: Duration,
    ) -> Result<Self, sqlx::Error> {
        let record_in_name = options.get_application_name() == Some("dlock");
        let session_options = session_settings(options, version);
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
        let control = PgPoolOptions::new()
            .max_connections(CONTROL_CONNECTIONS)
            .min_connections(0)
            .acquire_timeout(timeout)
            .test_before_acquire(false)
            .idle_timeout(Duration::from_secs(60));
        let control_options = session_options.clone();
        let (pool, control) = crate::driver::run(async move {
            (
                pool.connect_lazy_with(session_options),
                control.connect_lazy_with(control_options),
            )
        })
        .await;
        Ok(PgSessions {
            pool,
            lock_sql: PgSessions::lock_sql(&format!("{table}_fence"), version >= 140_000),
            first_wait_sql: (version >= 140_000)
                .then(|| PgSessions::first_wait_sql(&format!("{table}_fence"))),
            inspect_sql: PgSessions::held_sql(&format!("{table}_fence"), "f.name = $1").into(),
            list_sql: PgSessions::held_sql(
                &format!("{table}_fence"),
                "f.name >= $1 AND ($2::text IS NULL OR f.name < $2) ORDER BY f.name LIMIT $3",
            )
            .into(),
            mark_sql: PgSessions::mark_sql(&format!("{table}_fence")),
            mark_kind_sql: format!("SELECT holder FROM {table}_fence WHERE k = $1").into(),
            grant_sql: PgSessions::grant_sql(&format!("{table}_fence"), version >= 140_000),
            mode_sql: format!("SELECT permits FROM {table}_fence WHERE k = $1").into(),
            fence: format!("{table}_fence"),
            idle_limit: version >= 140_000,
            record_in_name,
            idle: Mutex::default(),
            control,
        })
    }

    /// Runs `sql` (a function of a server process id) for `pid` on one of
    /// the backend's own control connections. One cut off (a timeout) or
    /// failing is closed, never reused; a failure is tried once more on
    /// another connection.
    fn control<'a>(&'a self, sql: &'static str, pid: i32) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            for _ in 0..2 {
                let Ok(conn) = self.control.acquire().await else {
                    return false;
                };
                let mut conn = Checked::new(conn);
                if sqlx::query(sql)
                    .bind(pid)
                    .execute(conn.conn())
                    .await
                    .is_ok()
                {
                    conn.keep();
                    return true;
                }
            }
            false
        })
    }

    /// The kept connections, without those unused for too long (closed as
    /// they are dropped).
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<(PgSession, std::time::Instant)>> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let stale = idle
            .iter()
            .take_while(|(_, since)| since.elapsed() > IDLE_SESSION_FOR)
            .count();
        idle.drain(..stale);
        idle
    }

    /// The lock statement: `$1` the key's hash, `$2` the idle limit (ms,
    /// as text), `$3` how long to wait (ms as text; `0`: try once), `$4` the
    /// stored key and `$5` the holder record (`NULL` when the connection's
    /// `application_name` carries it), kept in the counter's row, `$6` the
    /// key's waiting-writer mark. The wait's limit is local to the
    /// statement's transaction; the idle limit is set for the session only
    /// when the lock is ours (while it waits, by
    /// [`first_wait_sql`](Self::first_wait_sql) before). A free key is taken by a try, as before; a
    /// writer that has to wait holds the mark (shared) from its first wait
    /// until its connection is unlocked: readers that try in the gaps
    /// between its waits find it. A key whose row records a
    /// semaphore is only tried (its permit holders answer a mismatch, not a
    /// wait); a grant records the key as a plain lock's.
    fn lock_sql(fence: &str, idle_limit: bool) -> Arc<str> {
        let limit = if idle_limit {
            "set_config('idle_session_timeout', $2, false)"
        } else {
            "$2::text"
        };
        format!(
            "WITH t AS (SELECT set_config('lock_timeout', $3, true) AS lt), \
                  l AS (SELECT CASE WHEN $3 = '0' \
                                      OR EXISTS (SELECT 1 FROM {fence} s WHERE s.k = $1 AND s.permits > 1) \
                                    THEN pg_try_advisory_lock($1) \
                                    WHEN pg_try_advisory_lock($1) THEN true \
                                    WHEN pg_try_advisory_lock_shared($6) \
                                    THEN pg_advisory_lock($1) IS NOT NULL \
                                    ELSE pg_advisory_lock($1) IS NOT NULL END AS got FROM t) \
             INSERT INTO {fence} AS f (k, token, name, holder, granted_at) \
             SELECT $1, {NOW_US}, $4, $5, clock_timestamp() FROM l \
             WHERE CASE WHEN got THEN {limit} IS NOT NULL ELSE false END \
             ON CONFLICT (k) DO UPDATE SET token = GREATEST(f.token + 1, excluded.token), \
                 name = excluded.name, holder = excluded.holder, granted_at = excluded.granted_at, \
                 permits = NULL, slot = NULL \
             RETURNING token"
        )
        .into()
    }

    /// The first try of a wait, on a server with an idle limit: `$1` the
    /// key's hash, `$2` the idle limit (ms, as text), `$3` the stored key,
    /// `$4` the holder record (as [`lock_sql`](Self::lock_sql)'s), `$5` the
    /// key's waiting-writer mark. A free key is taken as by the lock
    /// statement (the token in the answer's first column, `got` in its
    /// second). A key whose row records a semaphore is only tried (`busy`;
    /// the third column is the recorded mode). Otherwise the writer is to
    /// wait: the statement takes the waiting-writer mark (shared) and sets
    /// the session's idle limit to the lease (`marked`, or `waits` where a
    /// reader was looking at the mark), and the waits follow in statements
    /// of their own. The limit is set here because a wait that runs out
    /// (55P03) rolls back whatever its own statement set: so a waiting
    /// writer whose client stalls between two slices — frozen, or cut off
    /// with its sockets left open — has its session ended by the server a
    /// lease after its last statement, and its mark with it, instead of
    /// keeping new readers out until its socket dies. Only a contended
    /// acquisition pays this round trip; a free key is one statement, as
    /// before.
    fn first_wait_sql(fence: &str) -> Arc<str> {
        format!(
            "WITH l AS (SELECT CASE WHEN pg_try_advisory_lock($1) THEN 'got' \
                                    WHEN EXISTS (SELECT 1 FROM {fence} s WHERE s.k = $1 AND s.permits > 1) \
                                    THEN 'busy' \
                                    WHEN pg_try_advisory_lock_shared($5) \
                                    THEN CASE WHEN set_config('idle_session_timeout', $2, false) IS NOT NULL \
                                              THEN 'marked' END \
                                    ELSE CASE WHEN set_config('idle_session_timeout', $2, false) IS NOT NULL \
                                              THEN 'waits' END END AS got), \
                  i AS (INSERT INTO {fence} AS f (k, token, name, holder, granted_at) \
                        SELECT $1, {NOW_US}, $3, $4, clock_timestamp() FROM l \
                        WHERE CASE WHEN l.got = 'got' \
                                   THEN set_config('idle_session_timeout', $2, false) IS NOT NULL \
                                   ELSE false END \
                        ON CONFLICT (k) DO UPDATE SET token = GREATEST(f.token + 1, excluded.token), \
                            name = excluded.name, holder = excluded.holder, \
                            granted_at = excluded.granted_at, permits = NULL, slot = NULL \
                        RETURNING token) \
             SELECT (SELECT token FROM i), l.got, (SELECT permits FROM {fence} WHERE k = $1) FROM l"
        )
        .into()
    }

    /// The grant of a share, one statement: `$1` the key's hash, `$2` the
    /// slot's, `$3` the stored key, `$4` the holder record, `$5` the mode
    /// (`0` a reader, else the permits), `$6` the slot, `$7` the idle limit
    /// (ms, as text). The key's row records the mode; a reader's token is
    /// the key's one sequence bumped (so readers and writers share it), a
    /// permit's its slot row's own; the slot's row keeps the token, the key
    /// and the holder record for `inspect` and `revoke`.
    fn grant_sql(fence: &str, idle_limit: bool) -> Arc<str> {
        let limit = if idle_limit {
            "set_config('idle_session_timeout', $7, false)"
        } else {
            "$7::text"
        };
        format!(
            "WITH kr AS (INSERT INTO {fence} AS f (k, token, name, holder, granted_at, permits) \
                         VALUES ($1, {NOW_US}, $3, NULL, clock_timestamp(), $5) \
                         ON CONFLICT (k) DO UPDATE SET permits = excluded.permits, \
                             name = excluded.name, \
                             token = CASE WHEN excluded.permits = 0 \
                                          THEN GREATEST(f.token + 1, excluded.token) \
                                          ELSE f.token END \
                         RETURNING token) \
             INSERT INTO {fence} AS f (k, token, name, holder, granted_at, permits, slot) \
             SELECT $2, CASE WHEN $5 = 0 THEN kr.token ELSE {NOW_US} END, $3, $4, \
                    clock_timestamp(), $5, $6 \
             FROM kr WHERE {limit} IS NOT NULL \
             ON CONFLICT (k) DO UPDATE SET \
                 token = CASE WHEN excluded.permits = 0 THEN excluded.token \
                              ELSE GREATEST(f.token + 1, excluded.token) END, \
                 name = excluded.name, holder = excluded.holder, \
                 granted_at = excluded.granted_at, permits = excluded.permits, \
                 slot = excluded.slot \
             RETURNING token"
        )
        .into()
    }
}

/// The mode a key's row records (`permits`: `NULL` a plain lock or writer,
/// `0` readers, else a semaphore's permits).
fn recorded(permits: Option<i32>) -> HoldMode {
    match permits.and_then(|n| u32::try_from(n).ok()) {
        None | Some(1) => HoldMode::Exclusive,
        Some(0) => HoldMode::Shared,
        Some(permits) => HoldMode::Permit { permits },
    }
}

/// What a try of a plain lock that took nothing means, by the mode the
/// key's row records: a mismatch with a semaphore's permits, else busy
/// (`clean`: the connection holds nothing).
fn busy_or_mismatch(permits: Option<i32>, clean: bool) -> Locked {
    match recorded(permits) {
        held @ HoldMode::Permit { .. } => Locked::Mismatch(held),
        _ => Locked::Busy { clean },
    }
}

/// Whether holders of `held` may share a key with `asked` (a reader with
/// a writer's key: busy, not a mismatch).
fn compatible(asked: HoldMode, held: HoldMode) -> bool {
    asked == held || (asked == HoldMode::Shared && held == HoldMode::Exclusive)
}

impl PgSessions {
    /// Inserts an end mark (see [session mode](crate::backend::sql::session)):
    /// `$1` its key, `$2` its kind; nothing if it is there already (or being
    /// inserted by a transaction not yet ended, which it waits for).
    fn mark_sql(fence: &str) -> Arc<str> {
        format!(
            "INSERT INTO {fence} (k, token, name, holder, granted_at) \
             VALUES ($1, {NOW_US} + {MARK_LIFE_US}, NULL, $2, clock_timestamp()) \
             ON CONFLICT (k) DO NOTHING"
        )
        .into()
    }

    /// Revokes the grant of `key` whose end mark is `mark`, held by server
    /// process `pid`: in one transaction, its end mark inserted, then the
    /// process ended. Answers whether this call ended it: not if another
    /// revocation or the holder marked the grant's end first (a holder's
    /// mark whose connection the server still shows is ended anyway, to
    /// free the key, but not named), nor if the process was gone already.
    async fn revoke_grant(&self, key: &str, pid: i32, mark: i64) -> Result<bool, BackendError> {
        let mut conn = Checked::new(self.control.acquire().await.map_err(pg_error)?);
        let mut tx = conn.conn().begin().await.map_err(pg_error)?;
        let marked = sqlx::query(AssertSqlSafe(self.mark_sql.clone()))
            .bind(mark)
            .bind(MarkKind::Revoked.as_str())
            .execute(&mut *tx)
            .await;
        match marked {
            Ok(done) if done.rows_affected() == 0 => {
                tx.rollback().await.map_err(pg_error)?;
                let kind: Option<Option<String>> =
                    sqlx::query_scalar(AssertSqlSafe(self.mark_kind_sql.clone()))
                        .bind(mark)
                        .fetch_optional(conn.conn())
                        .await
                        .map_err(pg_error)?;
                if kind.flatten().as_deref() == Some(MarkKind::Ended.as_str()) {
                    let _ = terminate(conn.conn(), pid).await;
                }
                conn.keep();
                return Ok(false);
            }
            Ok(_) => {}
            // 42501: this role may not write the counter table. The
            // session is ended without a mark: its holder is told that its
            // connection ended.
            Err(e) if sqlstate(&e).as_deref() == Some("42501") => {
                tx.rollback().await.map_err(pg_error)?;
                let ended = terminate(conn.conn(), pid).await;
                conn.keep();
                return ended.map_err(|e| denied(key, pid, e));
            }
            Err(e) => return Err(pg_error(e)),
        }
        match terminate(&mut tx, pid).await {
            Ok(true) => {
                tx.commit().await.map_err(pg_error)?;
                conn.keep();
                Ok(true)
            }
            // Gone already: its holder is not told it was revoked.
            Ok(false) => {
                tx.rollback().await.map_err(pg_error)?;
                conn.keep();
                Ok(false)
            }
            Err(e) => {
                // The mark goes with the transaction.
                tx.rollback().await.map_err(pg_error)?;
                conn.keep();
                Err(denied(key, pid, e))
            }
        }
    }

    /// The held advisory locks of this database (`pg_locks`: granted,
    /// exclusive, on a bigint key, whose two halves are `classid` and
    /// `objid`) joined with the counter rows `filter` picks: the server
    /// process holding each, the row's key, holder record (the row's, else
    /// the one the holding connection's `application_name` carries), token
    /// and grant time (ms), how many sessions wait for the same lock, and
    /// the row's mode and slot. A plain lock or writer is its key's row; a
    /// reader or a permit holder is its slot's row (the shared locks of the
    /// key's row that shares hold beside are not shown twice).
    fn held_sql(fence: &str, filter: &str) -> String {
        let prefix = RECORD_NAME_PREFIX;
        let (len, from) = (prefix.len(), prefix.len() + 1);
        format!(
            "SELECT l.pid, f.name, \
                    COALESCE(f.holder, \
                             (SELECT substr(a.application_name, {from}) FROM pg_stat_activity a \
                              WHERE a.pid = l.pid AND left(a.application_name, {len}) = '{prefix}')), \
                    f.token, \
                    (extract(epoch FROM f.granted_at) * 1000)::bigint, \
                    (SELECT count(*) FROM pg_locks w \
                     WHERE w.locktype = 'advisory' AND NOT w.granted \
                       AND w.database = l.database AND w.classid = l.classid \
                       AND w.objid = l.objid AND w.objsubid = l.objsubid), \
                    f.permits, f.slot \
             FROM {fence} f JOIN pg_locks l \
               ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
              AND l.mode = 'ExclusiveLock' \
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
              AND ((l.classid::bigint << 32) | l.objid::bigint) = f.k \
             WHERE f.name IS NOT NULL AND {filter}"
        )
    }

    /// The held rows `query` reads: each holder's server process, key,
    /// entry and end mark.
    async fn held(
        &self,
        query: Arc<str>,
        bind: impl FnOnce(
            sqlx::query::QueryAs<'_, sqlx::Postgres, HeldLock, sqlx::postgres::PgArguments>,
        ) -> sqlx::query::QueryAs<
            '_,
            sqlx::Postgres,
            HeldLock,
            sqlx::postgres::PgArguments,
        >,
    ) -> Result<Vec<Holding>, BackendError> {
        let rows: Vec<HeldLock> = bind(sqlx::query_as(AssertSqlSafe(query)))
            .fetch_all(&self.control)
            .await
            .map_err(pg_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(pid, key, holder, token, granted_ms, waiting, permits, slot)| {
                    let row = Row {
                        key: key.clone(),
                        owner: format!("pid {pid}"),
                        holder,
                        token,
                        granted_at: granted_ms,
                        expires_in_ms: 0,
                    };
                    let mut held = row.entry(Duration::from_millis(1));
                    // The hold ends with its connection, not at a lease's end.
                    held.expires_in = None;
                    let slot = slot.and_then(|s| u32::try_from(s).ok());
                    let share = match (slot, recorded(permits)) {
                        (Some(slot), HoldMode::Shared) => Some((SlotKind::Reader, slot)),
                        (Some(slot), mode) => {
                            held.mode = mode;
                            held.slot = Some(slot);
                            Some((SlotKind::Permit, slot))
                        }
                        (None, _) => None,
                    };
                    if share.is_some_and(|(kind, _)| kind == SlotKind::Reader) {
                        held.mode = HoldMode::Shared;
                    }
                    let mark = end_mark(&key, share, token as u64);
                    Holding {
                        pid,
                        key,
                        held,
                        waiting: usize::try_from(waiting).ok(),
                        mark,
                    }
                },
            )
            .collect())
    }
}

/// One holder as [`PgSessions::held`] reads it.
struct Holding {
    pid: i32,
    key: String,
    held: HeldEntry,
    /// Sessions waiting for the same lock.
    waiting: Option<usize>,
    /// The grant's end mark.
    mark: i64,
}

/// The holders of each key, in the order first met.
fn by_key(holdings: Vec<Holding>) -> Vec<KeyEntry> {
    let mut entries: Vec<KeyEntry> = Vec::new();
    for holding in holdings {
        match entries.iter_mut().find(|e| e.key == holding.key) {
            Some(entry) => {
                entry.holders.push(holding.held);
                if let (Some(n), Some(w)) = (entry.waiters, holding.waiting) {
                    entry.waiters = Some(n + w);
                }
            }
            None => {
                let mut entry = KeyEntry::new(holding.key, vec![holding.held]);
                entry.waiters = holding.waiting;
                entries.push(entry);
            }
        }
    }
    for entry in &mut entries {
        entry.holders.sort_by_key(|h| (h.slot, h.token));
    }
    entries
}

/// A held advisory lock as [`PgSessions::held_sql`] reads it.
type HeldLock = (
    i32,
    String,
    Option<String>,
    i64,
    Option<i64>,
    i64,
    Option<i32>,
    Option<i32>,
);

impl SessionDb for PgSessions {
    type Conn = PgSession;

    fn open(&self, fresh: bool) -> BoxFuture<'_, Result<PgSession, sqlx::Error>> {
        Box::pin(async move {
            if !fresh && let Some((conn, _)) = self.idle().pop() {
                return Ok(conn);
            }
            let mut listener = PgListener::connect_with(&self.pool).await?;
            listener.eager_reconnect(false);
            listener.ignore_pool_close_event(true);
            let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut listener)
                .await?;
            Ok(PgSession {
                listener,
                pid,
                record: None,
                waits_for: None,
            })
        })
    }

    fn pooled(&self) -> usize {
        self.idle().len()
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut PgSession,
        key: &'a str,
        holder: &'a str,
        wait: Duration,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Locked, sqlx::Error>> {
        Box::pin(async move {
            let started = std::time::Instant::now();
            let hash = session_hash(key);
            // The holder record is the process's, not the grant's: where it
            // fits, the connection's `application_name` carries it, set once
            // per connection (and again only for another record), and the
            // counter's row stores none.
            let carried = self.record_in_name
                && (conn.record.as_deref() == Some(holder)
                    || match record_name(holder) {
                        Some(name) => {
                            sqlx::query("SELECT set_config('application_name', $1, false)")
                                .bind(name)
                                .execute(&mut conn.listener)
                                .await?;
                            conn.record = Some(holder.to_owned());
                            true
                        }
                        None => false,
                    });
            let record = (!carried).then_some(holder);
            let mut wait = wait;
            if !wait.is_zero()
                && conn.waits_for != Some(hash)
                && let Some(sql) = &self.first_wait_sql
            {
                // A wait's first slice: a try that, busy, sets the idle
                // limit and the mark before the waits (see `first_wait_sql`).
                let (token, state, permits): (Option<i64>, Option<String>, Option<i32>) =
                    sqlx::query_as(AssertSqlSafe(sql.clone()))
                        .bind(hash)
                        .bind(idle_limit(ttl))
                        .bind(key)
                        .bind(record)
                        .bind(writer_mark_hash(key))
                        .fetch_one(&mut conn.listener)
                        .await?;
                match (token, state.as_deref()) {
                    (Some(token), _) => return Ok(Locked::Yes(token as u64)),
                    (None, Some("busy")) => return Ok(busy_or_mismatch(permits, true)),
                    (None, Some("marked" | "waits")) => conn.waits_for = Some(hash),
                    (None, state) => {
                        return Err(sqlx::Error::Protocol(format!(
                            "the first try of a wait answered {state:?}"
                        )));
                    }
                }
                wait = wait.saturating_sub(started.elapsed());
                if wait.is_zero() {
                    return Ok(Locked::Busy { clean: false });
                }
            }
            if !wait.is_zero() {
                // The wait may take the mark (and, where the first try ran,
                // holds it already): the connection is unlocked before reuse.
                conn.waits_for = Some(hash);
            }
            // One round trip, one cached statement: the wait's limit, the
            // lock, the idle limit and the token.
            let wait_ms = if wait.is_zero() {
                "0".to_owned()
            } else {
                millis(wait).to_string()
            };
            let token: Option<i64> = match sqlx::query_scalar(AssertSqlSafe(self.lock_sql.clone()))
                .bind(hash)
                .bind(idle_limit(ttl))
                .bind(wait_ms)
                .bind(key)
                .bind(record)
                .bind(writer_mark_hash(key))
                .fetch_optional(&mut conn.listener)
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
            if let Some(token) = token {
                return Ok(Locked::Yes(token as u64));
            }
            // Only a try answers no row: it took nothing. The key may be a
            // semaphore's (its holders hold it shared): a mismatch.
            let permits: Option<Option<i32>> =
                sqlx::query_scalar(AssertSqlSafe(self.mode_sql.clone()))
                    .bind(hash)
                    .fetch_optional(&mut conn.listener)
                    .await?;
            let clean = conn.waits_for.is_none();
            Ok(match busy_or_mismatch(permits.flatten(), clean) {
                // A mismatch hands back a connection that holds nothing:
                // the mark of the slices before is let go first.
                mismatch @ Locked::Mismatch(_) if !clean => {
                    self.unlock(conn).await?;
                    mismatch
                }
                locked => locked,
            })
        })
    }

    fn ping<'a>(
        &'a self,
        conn: &'a mut PgSession,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            if self.idle_limit {
                sqlx::query("SELECT set_config('idle_session_timeout', $1, false)")
                    .bind(idle_limit(ttl))
                    .execute(&mut conn.listener)
                    .await?;
            } else {
                sqlx::query("SELECT 1").execute(&mut conn.listener).await?;
            }
            Ok(())
        })
    }

    fn unlock<'a>(&'a self, conn: &'a mut PgSession) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = if self.idle_limit {
                "SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false)"
            } else {
                "SELECT pg_advisory_unlock_all()"
            };
            sqlx::query(sql).execute(&mut conn.listener).await?;
            conn.waits_for = None;
            Ok(())
        })
    }

    fn cancel<'a>(&'a self, conn: &'a PgSession) -> BoxFuture<'a, bool> {
        // Returns once the server process was signalled: a statement it
        // runs ends at once (57014); an idle one ignores it.
        self.control("SELECT pg_cancel_backend($1)", conn.pid)
    }

    fn terminate<'a>(&'a self, conn: &'a PgSession) -> BoxFuture<'a, bool> {
        self.control("SELECT pg_terminate_backend($1)", conn.pid)
    }

    fn watch<'a>(&'a self, conn: &'a mut PgSession) -> BoxFuture<'a, String> {
        Box::pin(async move {
            loop {
                match conn.listener.try_recv().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return "the server closed the connection".to_owned(),
                    Err(e) => return e.to_string(),
                }
            }
        })
    }

    fn recycle(&self, conn: PgSession) {
        let mut idle = self.idle();
        if idle.len() == IDLE_SESSIONS {
            idle.remove(0);
        }
        idle.push((conn, std::time::Instant::now()));
    }

    fn classify(&self, err: sqlx::Error) -> BackendError {
        pg_error(err)
    }

    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        Box::pin(async move {
            let held = self
                .held(self.inspect_sql.clone(), |q| q.bind(key.to_owned()))
                .await?;
            Ok(by_key(held).into_iter().find(|entry| entry.key == key))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        Box::pin(async move {
            // Rows are holders: a key of many holders may take many rows.
            let held = self
                .held(self.list_sql.clone(), |q| {
                    q.bind(prefix.to_owned())
                        .bind(prefix_successor(prefix))
                        .bind(i64::try_from(limit.saturating_mul(8).max(1024)).unwrap_or(i64::MAX))
                })
                .await?;
            let mut entries = by_key(held);
            entries.truncate(limit);
            Ok(entries)
        })
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        Box::pin(async move {
            let held = self
                .held(self.inspect_sql.clone(), |q| q.bind(key.to_owned()))
                .await?;
            let mut revoked = Vec::new();
            for holding in held.into_iter().filter(|h| h.key == key) {
                if self.revoke_grant(key, holding.pid, holding.mark).await? {
                    revoked.push(holding.held);
                }
            }
            Ok(revoked)
        })
    }

    fn ended(&self, mark: i64) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.mark_sql.clone()))
                .bind(mark)
                .bind(MarkKind::Ended.as_str())
                .execute(&self.control)
                .await?;
            Ok(done.rows_affected() == 0)
        })
    }

    fn enter<'a>(
        &'a self,
        conn: &'a mut PgSession,
        key: &'a str,
        asked: HoldMode,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Entry, sqlx::Error>> {
        Box::pin(async move {
            let (k, gate) = (session_hash(key), gate_hash(key));
            // The idle limit before the gate (see `SessionDb::enter`): a
            // stalled client's session is ended, and its gate with it.
            let limit = if self.idle_limit {
                format!(
                    "SELECT set_config('idle_session_timeout', '{}', false); ",
                    idle_limit(idle)
                )
            } else {
                String::new()
            };
            // The gate first, in a statement of its own, so that the next
            // one reads what the previous holder of the gate committed.
            // Then: the key alone (no holder, no waiting writer) is taken
            // shared and its mode is this share's to record; else a shared
            // hold beside other shares, whose mode the key's row records;
            // else a writer holds or waits.
            let sql = format!(
                "{limit}SELECT pg_advisory_lock({gate}); \
                 SELECT CASE WHEN pg_try_advisory_lock({k}) \
                             THEN CASE WHEN pg_advisory_unlock({k}) \
                                       THEN CASE WHEN pg_try_advisory_lock_shared({k}) \
                                                 THEN 'alone' ELSE 'busy' END END \
                             WHEN pg_try_advisory_lock_shared({k}) THEN 'shared' \
                             ELSE 'busy' END, \
                        (SELECT permits FROM {fence} WHERE k = {k})",
                fence = self.fence
            );
            let rows = sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(&mut conn.listener)
                .await?;
            let row = rows.last().ok_or_else(|| {
                sqlx::Error::Protocol("the gate statement answered nothing".into())
            })?;
            let state: String = sqlx::Row::try_get(row, 0)?;
            let held = recorded(sqlx::Row::try_get(row, 1)?);
            let entry = match state.as_str() {
                "alone" => Entry::Open,
                "shared" if compatible(asked, held) => Entry::Open,
                "busy" if compatible(asked, held) => Entry::Busy,
                _ => Entry::Mismatch(held),
            };
            if !matches!(entry, Entry::Open) || asked != HoldMode::Shared {
                return Ok(entry);
            }
            // A reader also yields to a writer waiting between its waits.
            let mark = writer_mark_hash(key);
            let free: bool = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT pg_try_advisory_lock({mark}) AND pg_advisory_unlock({mark})"
            )))
            .fetch_one(&mut conn.listener)
            .await
            .and_then(|row| sqlx::Row::try_get(&row, 0))?;
            Ok(if free { Entry::Open } else { Entry::Busy })
        })
    }

    fn try_slots<'a>(
        &'a self,
        conn: &'a mut PgSession,
        key: &'a str,
        kind: SlotKind,
        from: u32,
        to: u32,
    ) -> BoxFuture<'a, Result<Option<u32>, sqlx::Error>> {
        Box::pin(async move {
            // `CASE` tries its branches in order and stops at the first
            // lock taken: one slot at most, the lowest free one.
            let mut sql = String::from("SELECT CASE");
            for slot in from..to {
                let id = slot_hash(key, kind, slot);
                sql.push_str(&format!(" WHEN pg_try_advisory_lock({id}) THEN {slot}"));
            }
            sql.push_str(" END::bigint");
            let row = sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_one(&mut conn.listener)
                .await?;
            let slot: Option<i64> = sqlx::Row::try_get(&row, 0)?;
            Ok(slot.and_then(|s| u32::try_from(s).ok()))
        })
    }

    fn grant<'a>(
        &'a self,
        conn: &'a mut PgSession,
        key: &'a str,
        asked: HoldMode,
        slot: u32,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Result<u64, HoldMode>, sqlx::Error>> {
        Box::pin(async move {
            let (permits, kind) = match asked {
                HoldMode::Permit { permits } => (permits as i32, SlotKind::Permit),
                _ => (0, SlotKind::Reader),
            };
            let token: i64 = sqlx::query_scalar(AssertSqlSafe(self.grant_sql.clone()))
                .bind(session_hash(key))
                .bind(slot_hash(key, kind, slot))
                .bind(key)
                .bind(holder)
                .bind(permits)
                .bind(slot as i32)
                .bind(idle_limit(ttl))
                .fetch_one(&mut conn.listener)
                .await?;
            // Committed: the next share through the gate reads it.
            sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(gate_hash(key))
                .execute(&mut conn.listener)
                .await?;
            Ok(Ok(token as u64))
        })
    }
}

/// Ends server process `pid` (`pg_terminate_backend`): whether it was
/// there to end.
async fn terminate(conn: &mut sqlx::PgConnection, pid: i32) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(conn)
        .await
}

/// The error of a revocation `pg_terminate_backend` refused: 42501
/// (insufficient privilege) said clearly.
fn denied(key: &str, pid: i32, e: sqlx::Error) -> BackendError {
    if sqlstate(&e).as_deref() != Some("42501") {
        return pg_error(e);
    }
    BackendError::permanent(format!(
        "postgres: revoking `{key}` in session mode ends the holder's \
         connection (server process {pid}) with pg_terminate_backend, \
         which this role may not ({e}): connect as the holder's role or \
         a superuser, or `GRANT pg_signal_backend TO <this role>`"
    ))
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
}
