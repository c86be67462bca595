//! MySQL's session flavour: `GET_LOCK` on dedicated connections (see
//! [session mode](super::super#session-mode)).
//!
//! **Semaphores.** A permit is `GET_LOCK('dlock:<16 hex digits>', 0)` of its
//! slot key ([`slot_hash`]), lowest free first, under the key's gate (a
//! `GET_LOCK` of its own, see
//! [the session engine](crate::backend::sql::session#semaphores-and-readers)).
//! `GET_LOCK` has no shared mode, so a permit holder does not hold its
//! key's own lock, and a plain lock and a permit meet through the key's
//! counter row instead, each *taking its own lock first and looking at the
//! other's after*: the permit takes its slot, records the semaphore in the
//! key's row, then looks whether a plain lock holds the key (and gives its
//! slot back with a mismatch if so); the plain lock takes the key, then
//! reads the key's row (in the same round trip as its grant) and, where it
//! records a semaphore, looks at its slots (and gives the key back with a
//! mismatch if one is held). Whichever looks second sees the other: never
//! both. A plain key's row records no semaphore, so the plain lock's hot
//! path only gains one primary-key read in its round trip.
//!
//! **Read locks** are refused before any attempt (`offers`), with a
//! `Config` error naming lease mode: without a shared `GET_LOCK`, readers
//! could not exclude a writer in the server.

use std::time::Duration;

use futures_util::TryStreamExt as _;
use futures_util::future::BoxFuture;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::{AssertSqlSafe, Connection as _, Either, Row as _};

use super::{N, my_error, pool_options};
use crate::backend::sql::admin::{Row, prefix_successor};
use crate::backend::sql::pool::Checked;
use crate::backend::sql::session::{
    Entry, Locked, MARK_LIFE_US, MarkKind, SessionDb, SlotKind, end_mark, gate_hash, session_hash,
    slot_hash,
};
use crate::backend::{HeldEntry, HoldMode, KeyEntry};
use crate::error::BackendError;

/// The most session connections one backend opens.
const MAX_SESSIONS: u32 = 1024;
/// How many cancels (or session ends) one backend sends at once: a storm of
/// callers hanging up is cancelled in parallel.
const CONTROL_CONNECTIONS: u32 = 4;

/// `GET_LOCK` on dedicated connections.
pub struct MySessions {
    pool: MySqlPool,
    fence: String,
    /// A few connections of the backend's own for `KILL QUERY` and `KILL`,
    /// opened when first needed (see [`MySessions::control`]).
    control: MySqlPool,
}

/// A session connection and its server-side id (`CONNECTION_ID()`, read by
/// each lock statement before it waits), for a cancel from another
/// connection.
pub struct MySession {
    conn: Checked<sqlx::MySql>,
    /// 0 until a lock statement has reported it.
    id: u64,
}

impl MySessions {
    /// The session locks, their counters in `<table>_fence`. Connections
    /// are opened lazily.
    pub(super) async fn new(options: MySqlConnectOptions, table: &str, timeout: Duration) -> Self {
        let (pool, control) = crate::driver::run(async move {
            (
                pool_options(MAX_SESSIONS, timeout)
                    .idle_timeout(Duration::from_secs(60))
                    .connect_lazy_with(options.clone()),
                pool_options(CONTROL_CONNECTIONS, timeout)
                    .idle_timeout(Duration::from_secs(60))
                    .connect_lazy_with(options),
            )
        })
        .await;
        MySessions {
            pool,
            fence: format!("{table}_fence"),
            control,
        }
    }

    /// Runs `KILL {what}{id}` on one of the backend's own control
    /// connections. One cut off (a timeout) or failing is closed, never
    /// reused; a failure is tried once more on another connection. A session
    /// that has ended already counts as done.
    fn control<'a>(&'a self, what: &'static str, id: u64) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            if id == 0 {
                return false;
            }
            for _ in 0..2 {
                let Ok(conn) = self.control.acquire().await else {
                    return false;
                };
                let mut conn = Checked::new(conn);
                let sql = format!("KILL {what}{id}");
                match sqlx::raw_sql(AssertSqlSafe(sql)).execute(conn.conn()).await {
                    Ok(_) => {
                        conn.keep();
                        return true;
                    }
                    // ER_NO_SUCH_THREAD: its session has ended already.
                    Err(sqlx::Error::Database(e))
                        if e.code().as_deref() == Some("HY000")
                            && e.message().contains("Unknown thread") =>
                    {
                        conn.keep();
                        return true;
                    }
                    Err(_) => {}
                }
            }
            false
        })
    }
}

impl MySessions {
    /// Inserts an end mark (see [session mode](crate::backend::sql::session)):
    /// its key and kind bound; nothing if it is there already (or being
    /// inserted by a transaction not yet ended, which it waits for).
    fn mark_sql(&self) -> String {
        format!(
            "INSERT IGNORE INTO {} (k, token, name, holder, granted_us) \
             VALUES (?, {N} + {MARK_LIFE_US}, NULL, ?, {N})",
            self.fence
        )
    }

    /// Revokes the grant of `key` whose end mark is `mark`, held by
    /// connection `id`: in one transaction, its end mark inserted, then the
    /// connection killed.
    /// Answers whether this call ended it: not if another revocation or the
    /// holder marked the grant's end first (a holder's mark whose
    /// connection the server still shows is killed anyway, to free the
    /// key, but not named), nor if the connection was gone already.
    async fn revoke_grant(&self, key: &str, id: u64, mark: i64) -> Result<bool, BackendError> {
        let mut conn = Checked::new(self.control.acquire().await.map_err(my_error)?);
        let mut tx = conn.conn().begin().await.map_err(my_error)?;
        let marked = sqlx::query(AssertSqlSafe(self.mark_sql()))
            .bind(mark)
            .bind(MarkKind::Revoked.as_str())
            .execute(&mut *tx)
            .await;
        match marked {
            Ok(done) if done.rows_affected() == 0 => {
                tx.rollback().await.map_err(my_error)?;
                let sql = format!("SELECT holder FROM {} WHERE k = ?", self.fence);
                let kind: Option<Option<Vec<u8>>> = sqlx::query_scalar(AssertSqlSafe(sql))
                    .bind(mark)
                    .fetch_optional(conn.conn())
                    .await
                    .map_err(my_error)?;
                if kind.flatten().as_deref() == Some(MarkKind::Ended.as_str().as_bytes()) {
                    let _ = kill(conn.conn(), id).await;
                }
                conn.keep();
                return Ok(false);
            }
            Ok(_) => {}
            // ER_TABLEACCESS_DENIED_ERROR: this user may not write the
            // counter table. The connection is killed without a mark: its
            // holder is told that its connection ended.
            Err(e) if super::error_number(&e) == Some(1142) => {
                tx.rollback().await.map_err(my_error)?;
                let killed = kill(conn.conn(), id).await;
                conn.keep();
                return killed.map_err(|e| denied(key, id, e));
            }
            Err(e) => return Err(my_error(e)),
        }
        match kill(&mut tx, id).await {
            Ok(true) => {
                tx.commit().await.map_err(my_error)?;
                conn.keep();
                Ok(true)
            }
            // Gone already: its holder is not told it was revoked.
            Ok(false) => {
                tx.rollback().await.map_err(my_error)?;
                conn.keep();
                Ok(false)
            }
            Err(e) => {
                // The mark goes with the transaction.
                tx.rollback().await.map_err(my_error)?;
                conn.keep();
                Err(denied(key, id, e))
            }
        }
    }
}

/// Kills connection `id` (`KILL CONNECTION`): whether it was there to kill.
async fn kill(conn: &mut sqlx::MySqlConnection, id: u64) -> Result<bool, sqlx::Error> {
    match sqlx::raw_sql(AssertSqlSafe(format!("KILL CONNECTION {id}")))
        .execute(conn)
        .await
    {
        Ok(_) => Ok(true),
        // ER_NO_SUCH_THREAD: its session has ended already.
        Err(sqlx::Error::Database(e)) if e.message().contains("Unknown thread") => Ok(false),
        Err(e) => Err(e),
    }
}

/// The error of a revocation `KILL` refused: ER_KILL_DENIED_ERROR said
/// clearly.
fn denied(key: &str, id: u64, e: sqlx::Error) -> BackendError {
    if super::error_number(&e) != Some(1095) {
        return my_error(e);
    }
    BackendError::permanent(format!(
        "mysql: revoking `{key}` in session mode ends the holder's \
         connection (id {id}) with KILL CONNECTION, which this user may \
         not ({e}): connect as the holder's user, or grant this user \
         CONNECTION_ADMIN (MySQL 8) or CONNECTION ADMIN (MariaDB), or SUPER"
    ))
}

/// The `GET_LOCK` name of the key hashed to `k`.
fn lock_name(k: i64) -> String {
    format!("dlock:{:016x}", k as u64)
}

/// `text` as a MySQL hex literal (`X'…'`; `''` for the empty string).
fn hex_literal(text: &str) -> String {
    let mut literal = String::with_capacity(3 + 2 * text.len());
    literal.push_str("X'");
    for byte in text.bytes() {
        literal.push_str(&format!("{byte:02x}"));
    }
    literal.push('\'');
    literal
}

/// A held lock as the admin statements read it: the holder's connection id,
/// the counter row's key, holder record, token, grant time (µs), mode and
/// slot. The holder's connection id is `None` when the lock was released
/// between the query's two looks at it (MariaDB may evaluate `IS_USED_LOCK`
/// again for the outer filter): such a row is free.
type HeldLock = (
    Option<u64>,
    Vec<u8>,
    Option<Vec<u8>>,
    u64,
    Option<i64>,
    Option<i32>,
    Option<i32>,
);

/// One holder as [`MySessions::held`] reads it.
struct Holding {
    id: u64,
    key: String,
    held: HeldEntry,
    /// The grant's end mark.
    mark: i64,
}

/// The holders of each key, in the order first met.
fn by_key(holdings: Vec<Holding>) -> Vec<KeyEntry> {
    let mut entries: Vec<KeyEntry> = Vec::new();
    for holding in holdings {
        match entries.iter_mut().find(|e| e.key == holding.key) {
            Some(entry) => entry.holders.push(holding.held),
            None => entries.push(KeyEntry::new(holding.key, vec![holding.held])),
        }
    }
    for entry in &mut entries {
        entry.holders.sort_by_key(|h| (h.slot, h.token));
    }
    entries
}

/// The mode a key's row records (`permits`: `NULL` a plain lock, else a
/// semaphore's permits).
fn recorded(permits: Option<i32>) -> HoldMode {
    match permits.and_then(|n| u32::try_from(n).ok()) {
        Some(permits) if permits > 1 => HoldMode::Permit { permits },
        _ => HoldMode::Exclusive,
    }
}

/// A statement answering whether any slot `0..permits` of `key` is held
/// (by anyone).
fn any_slot_held_sql(key: &str, permits: u32) -> String {
    let mut sql = String::from("SELECT 0");
    for slot in 0..permits {
        let name = lock_name(slot_hash(key, SlotKind::Permit, slot));
        sql.push_str(&format!(" OR IS_USED_LOCK('{name}') IS NOT NULL"));
    }
    sql
}

impl MySessions {
    /// The held rows `query` reads (`?`s bound by `bind`): each holder's
    /// connection id, key, entry and end mark.
    async fn held(
        &self,
        query: String,
        bind: impl FnOnce(
            sqlx::query::QueryAs<'_, sqlx::MySql, HeldLock, sqlx::mysql::MySqlArguments>,
        ) -> sqlx::query::QueryAs<
            '_,
            sqlx::MySql,
            HeldLock,
            sqlx::mysql::MySqlArguments,
        >,
    ) -> Result<Vec<Holding>, BackendError> {
        let rows: Vec<HeldLock> = bind(sqlx::query_as(AssertSqlSafe(query)))
            .fetch_all(&self.control)
            .await
            .map_err(my_error)?;
        let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
        Ok(rows
            .into_iter()
            .filter_map(|(id, key, holder, token, granted_us, permits, slot)| {
                Some((id?, key, holder, token, granted_us, permits, slot))
            })
            .map(|(id, key, holder, token, granted_us, permits, slot)| {
                let key = text(key);
                let row = Row {
                    key: key.clone(),
                    owner: format!("connection {id}"),
                    holder: holder.map(text),
                    token: i64::try_from(token).unwrap_or(i64::MAX),
                    granted_at: granted_us,
                    expires_in_ms: 0,
                };
                let mut held = row.entry(Duration::from_micros(1));
                // The hold ends with its connection, not at a lease's end.
                held.expires_in = None;
                let slot = slot.and_then(|s| u32::try_from(s).ok());
                let share = slot.map(|slot| {
                    held.mode = recorded(permits);
                    held.slot = Some(slot);
                    (SlotKind::Permit, slot)
                });
                let mark = end_mark(&key, share, token);
                Holding {
                    id,
                    key,
                    held,
                    mark,
                }
            })
            .collect())
    }

    /// The counter rows `filter` picks whose lock is held, with the id of
    /// the connection holding it (`IS_USED_LOCK`): a plain lock's is its
    /// key's row, a permit's its slot's row (a semaphore's key row is held
    /// by nobody).
    fn held_sql(&self, filter: &str) -> String {
        format!(
            "SELECT * FROM (SELECT CAST(IS_USED_LOCK(CONCAT('dlock:', LPAD(LOWER(HEX(k)), 16, '0'))) \
                                   AS UNSIGNED) AS id, \
                                   name, holder, token, granted_us, permits, slot \
                            FROM {} WHERE name IS NOT NULL AND {filter}) AS h \
             WHERE id IS NOT NULL",
            self.fence
        )
    }

    /// Runs `sql` on `conn`: the first column of its last row, if any.
    async fn last_value(
        conn: &mut Checked<sqlx::MySql>,
        sql: String,
    ) -> Result<Option<sqlx::mysql::MySqlRow>, sqlx::Error> {
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(conn.conn())
            .await?;
        Ok(rows.into_iter().last())
    }
}

/// How long a share waits for its key's gate (held for a few statements
/// by each share of the key), in seconds.
const GATE_WAIT_S: u32 = 2;

/// `wait_timeout` is whole seconds, at least 1: rounded up, so the server
/// never frees a lock before the holder's lease ends.
fn idle_seconds(ttl: Duration) -> u64 {
    (ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).max(1)
}

impl SessionDb for MySessions {
    type Conn = MySession;

    fn open(&self, _fresh: bool) -> BoxFuture<'_, Result<Self::Conn, sqlx::Error>> {
        // The pool hands out its idle connections first, new ones after: a
        // dead one fails the lock statement at once and is replaced.
        Box::pin(async move {
            Ok(MySession {
                conn: Checked::new(self.pool.acquire().await?),
                id: 0,
            })
        })
    }

    fn pooled(&self) -> usize {
        self.pool.size() as usize
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        holder: &'a str,
        wait: Duration,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Locked, sqlx::Error>> {
        Box::pin(async move {
            let k = session_hash(key);
            let name = lock_name(k);
            // Hex literals: the text goes into the statement, never as SQL.
            let (stored, holder) = (hex_literal(key), hex_literal(holder));
            let fence = &self.fence;
            let wait = format!("{}.{:03}", wait.as_secs(), wait.subsec_millis());
            // One round trip: the connection's id (answered before the
            // wait, for a cancel), the lock (waiting up to `wait`), the token
            // in the same statement, and the idle limit only if the lock is
            // ours.
            let sql = format!(
                "SELECT CONNECTION_ID(); \
                 INSERT INTO {fence} (k, token, name, holder, granted_us) \
                 SELECT {k}, LAST_INSERT_ID({N}), {stored}, {holder}, {N} FROM DUAL \
                 WHERE GET_LOCK('{name}', {wait}) = 1 \
                 ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(GREATEST(token + 1, {N})), \
                 name = {stored}, holder = {holder}, granted_us = {N}; \
                 SET SESSION wait_timeout = \
                 IF(IS_USED_LOCK('{name}') = CONNECTION_ID(), {}, @@GLOBAL.wait_timeout); \
                 SELECT permits FROM {fence} \
                 WHERE k = {k} AND IS_USED_LOCK('{name}') = CONNECTION_ID()",
                idle_seconds(ttl)
            );
            let MySession { conn, id } = conn;
            let mut answers = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_many(conn.conn());
            // The statements' outcomes in order: the SELECT's, the INSERT's…
            let mut outcomes = Vec::with_capacity(4);
            // The mode the key's row records, read once the lock is ours.
            let mut permits = None;
            while let Some(answer) = answers.try_next().await? {
                match answer {
                    Either::Right(row) if outcomes.is_empty() => *id = row.try_get::<u64, _>(0)?,
                    Either::Right(row) => permits = row.try_get::<Option<i32>, _>(0)?,
                    Either::Left(done) => {
                        outcomes.push((done.rows_affected(), done.last_insert_id()))
                    }
                }
            }
            drop(answers);
            let inserted = outcomes.get(1).copied();
            match inserted {
                Some((rows, token)) if rows > 0 => {
                    let HoldMode::Permit { permits } = recorded(permits) else {
                        return Ok(Locked::Yes(token));
                    };
                    // The key's row records a semaphore: a permit holder
                    // takes its slot before it looks at the key, and this
                    // lock took the key before it looked at the slots, so
                    // one of the two sees the other.
                    let held = Self::last_value(conn, any_slot_held_sql(key, permits)).await?;
                    let held: bool = match held {
                        Some(row) => row.try_get::<i64, _>(0)? != 0,
                        None => false,
                    };
                    if held {
                        sqlx::raw_sql(
                            "DO RELEASE_ALL_LOCKS(); \
                             SET SESSION wait_timeout = @@GLOBAL.wait_timeout",
                        )
                        .execute(conn.conn())
                        .await?;
                        return Ok(Locked::Mismatch(HoldMode::Permit { permits }));
                    }
                    sqlx::raw_sql(AssertSqlSafe(format!(
                        "UPDATE {fence} SET permits = NULL WHERE k = {k}"
                    )))
                    .execute(conn.conn())
                    .await?;
                    Ok(Locked::Yes(token))
                }
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
                .execute(conn.conn.conn())
                .await?;
            Ok(())
        })
    }

    fn unlock<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::raw_sql(
                "DO RELEASE_ALL_LOCKS(); SET SESSION wait_timeout = @@GLOBAL.wait_timeout",
            )
            .execute(conn.conn.conn())
            .await?;
            Ok(())
        })
    }

    fn cancel<'a>(&'a self, conn: &'a Self::Conn) -> BoxFuture<'a, bool> {
        // Ends the statement the connection runs (`GET_LOCK` answers NULL);
        // an idle connection is not affected.
        self.control("QUERY ", conn.id)
    }

    fn terminate<'a>(&'a self, conn: &'a Self::Conn) -> BoxFuture<'a, bool> {
        self.control("", conn.id)
    }

    fn watch<'a>(&'a self, _conn: &'a mut Self::Conn) -> BoxFuture<'a, String> {
        // sqlx cannot watch an idle MySQL connection: a killed one is
        // noticed by the next ping (a third of the lease).
        Box::pin(std::future::pending())
    }

    fn recycle(&self, conn: Self::Conn) {
        conn.conn.keep();
    }

    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        Box::pin(async move {
            let held = self
                .held(self.held_sql("name = ?"), |q| {
                    q.bind(key.as_bytes().to_vec())
                })
                .await?;
            // Waiters are not counted: `GET_LOCK` waits are not shown
            // without `performance_schema`'s metadata locks.
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
            let rows = i64::try_from(limit.saturating_mul(8).max(1024)).unwrap_or(i64::MAX);
            let held = match prefix_successor(prefix) {
                Some(to) => {
                    let sql = self.held_sql("name >= ? AND name < ?");
                    self.held(format!("{sql} ORDER BY name LIMIT ?"), |q| {
                        q.bind(prefix.to_owned()).bind(to).bind(rows)
                    })
                    .await?
                }
                None => {
                    let sql = self.held_sql("name >= ?");
                    self.held(format!("{sql} ORDER BY name LIMIT ?"), |q| {
                        q.bind(prefix.to_owned()).bind(rows)
                    })
                    .await?
                }
            };
            let mut entries = by_key(held);
            entries.truncate(limit);
            Ok(entries)
        })
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        Box::pin(async move {
            let held = self
                .held(self.held_sql("name = ?"), |q| {
                    q.bind(key.as_bytes().to_vec())
                })
                .await?;
            let mut revoked = Vec::new();
            for holding in held.into_iter().filter(|h| h.key == key) {
                if self.revoke_grant(key, holding.id, holding.mark).await? {
                    revoked.push(holding.held);
                }
            }
            Ok(revoked)
        })
    }

    fn ended(&self, mark: i64) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.mark_sql()))
                .bind(mark)
                .bind(MarkKind::Ended.as_str())
                .execute(&self.control)
                .await?;
            Ok(done.rows_affected() == 0)
        })
    }

    fn enter<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        asked: HoldMode,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Entry, sqlx::Error>> {
        Box::pin(async move {
            let HoldMode::Permit { permits: asked_n } = asked else {
                // Refused before any attempt (`offers`): no shared GET_LOCK.
                return Ok(Entry::Mismatch(HoldMode::Exclusive));
            };
            let k = session_hash(key);
            let (gate, name) = (lock_name(gate_hash(key)), lock_name(k));
            // The idle limit (see `SessionDb::enter`: a stalled client's
            // session is ended, and its gate with it), the gate (it orders
            // the shares of the key: the mode each reads is the one the
            // previous one recorded), then the key's recorded mode and
            // whether a plain lock holds it.
            let sql = format!(
                "SET SESSION wait_timeout = {idle}; \
                 SELECT CONNECTION_ID(), GET_LOCK('{gate}', {GATE_WAIT_S}); \
                 SELECT (SELECT permits FROM {fence} WHERE k = {k}), \
                        IS_USED_LOCK('{name}') IS NOT NULL",
                fence = self.fence,
                idle = idle_seconds(idle)
            );
            let rows = sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(conn.conn.conn())
                .await?;
            let [first, last] = rows.as_slice() else {
                return Err(sqlx::Error::Protocol(
                    "the gate statements answered no rows".into(),
                ));
            };
            conn.id = first.try_get::<u64, _>(0)?;
            if first.try_get::<Option<i64>, _>(1)? != Some(1) {
                // The gate was not had in time: tried again.
                return Ok(Entry::Busy);
            }
            let held = recorded(last.try_get::<Option<i32>, _>(0)?);
            if last.try_get::<i64, _>(1)? != 0 {
                return Ok(Entry::Mismatch(HoldMode::Exclusive));
            }
            match held {
                HoldMode::Permit { permits } if permits != asked_n => {
                    let row =
                        MySessions::last_value(&mut conn.conn, any_slot_held_sql(key, permits))
                            .await?;
                    let any: i64 = match row {
                        Some(row) => row.try_get(0)?,
                        None => 0,
                    };
                    Ok(if any != 0 {
                        Entry::Mismatch(held)
                    } else {
                        Entry::Open
                    })
                }
                _ => Ok(Entry::Open),
            }
        })
    }

    fn try_slots<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
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
                let name = lock_name(slot_hash(key, kind, slot));
                sql.push_str(&format!(" WHEN GET_LOCK('{name}', 0) = 1 THEN {slot}"));
            }
            sql.push_str(" END");
            let row = MySessions::last_value(&mut conn.conn, sql).await?;
            let slot: Option<i64> = match row {
                Some(row) => row.try_get(0)?,
                None => None,
            };
            Ok(slot.and_then(|s| u32::try_from(s).ok()))
        })
    }

    fn grant<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        asked: HoldMode,
        slot: u32,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Result<u64, HoldMode>, sqlx::Error>> {
        Box::pin(async move {
            let HoldMode::Permit { permits } = asked else {
                return Ok(Err(HoldMode::Exclusive));
            };
            let k = session_hash(key);
            let s = slot_hash(key, SlotKind::Permit, slot);
            let (gate, name) = (lock_name(gate_hash(key)), lock_name(k));
            let (stored, holder) = (hex_literal(key), hex_literal(holder));
            let fence = &self.fence;
            // The key's row records the semaphore before the key is looked
            // at (a plain lock takes the key before it reads the row: one of
            // the two sees the other); the slot's row bumps its token; the
            // gate is left once both are committed.
            let sql = format!(
                "INSERT INTO {fence} (k, token, name, holder, granted_us, permits) \
                 VALUES ({k}, {N}, {stored}, NULL, {N}, {permits}) \
                 ON DUPLICATE KEY UPDATE permits = {permits}, name = {stored}; \
                 INSERT INTO {fence} (k, token, name, holder, granted_us, permits, slot) \
                 VALUES ({s}, LAST_INSERT_ID({N}), {stored}, {holder}, {N}, {permits}, {slot}) \
                 ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(GREATEST(token + 1, {N})), \
                 name = {stored}, holder = {holder}, granted_us = {N}, permits = {permits}, \
                 slot = {slot}; \
                 SET SESSION wait_timeout = {}; \
                 SELECT IS_USED_LOCK('{name}') IS NOT NULL, RELEASE_LOCK('{gate}')",
                idle_seconds(ttl)
            );
            let mut answers = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_many(conn.conn.conn());
            let mut outcomes = Vec::with_capacity(4);
            let mut plain_held = None;
            while let Some(answer) = answers.try_next().await? {
                match answer {
                    Either::Right(row) => plain_held = Some(row.try_get::<i64, _>(0)? != 0),
                    Either::Left(done) => outcomes.push(done.last_insert_id()),
                }
            }
            match (outcomes.get(1), plain_held) {
                (_, Some(true)) => Ok(Err(HoldMode::Exclusive)),
                (Some(&token), Some(false)) => Ok(Ok(token)),
                _ => Err(sqlx::Error::Protocol(
                    "the session grant statements answered nothing".into(),
                )),
            }
        })
    }

    fn classify(&self, err: sqlx::Error) -> BackendError {
        my_error(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_limits_round_up_to_seconds() {
        assert_eq!(idle_seconds(Duration::from_millis(600)), 1);
        assert_eq!(idle_seconds(Duration::from_secs(2)), 2);
        assert_eq!(idle_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(idle_seconds(Duration::ZERO), 1);
    }
}
