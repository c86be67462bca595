//! MySQL's session flavour: `GET_LOCK` on dedicated connections (see
//! [session mode](super::super#session-mode)).

use std::time::Duration;

use futures_util::TryStreamExt as _;
use futures_util::future::BoxFuture;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::{AssertSqlSafe, Connection as _, Either, Row as _};

use super::{N, my_error, pool_options};
use crate::backend::sql::admin::{Row, prefix_successor};
use crate::backend::sql::pool::Checked;
use crate::backend::sql::session::{
    Locked, MARK_LIFE_US, MarkKind, SessionDb, end_mark, session_hash,
};
use crate::backend::{HeldEntry, KeyEntry};
use crate::error::BackendError;
use crate::token::FencingToken;

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

    /// Revokes the grant of `key` with `token` held by connection `id`: in
    /// one transaction, its end mark inserted, then the connection killed.
    /// Answers whether this call ended it: not if another revocation or the
    /// holder marked the grant's end first (a holder's mark whose
    /// connection the server still shows is killed anyway, to free the
    /// key, but not named), nor if the connection was gone already.
    async fn revoke_grant(&self, key: &str, id: u64, token: u64) -> Result<bool, BackendError> {
        let mark = end_mark(key, token);
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
/// the counter row's key, holder record, token and grant time (µs).
/// The holder's connection id is `None` when the lock was released between
/// the query's two looks at it (MariaDB may evaluate `IS_USED_LOCK` again for
/// the outer filter): such a row is free.
type HeldLock = (Option<u64>, Vec<u8>, Option<Vec<u8>>, u64, Option<i64>);

impl MySessions {
    /// The held rows `query` reads (`?`s bound by `bind`), as key entries
    /// with the holder's connection id.
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
    ) -> Result<Vec<(u64, KeyEntry)>, BackendError> {
        let rows: Vec<HeldLock> = bind(sqlx::query_as(AssertSqlSafe(query)))
            .fetch_all(&self.control)
            .await
            .map_err(my_error)?;
        let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
        Ok(rows
            .into_iter()
            .filter_map(|(id, key, holder, token, granted_us)| {
                Some((id?, key, holder, token, granted_us))
            })
            .map(|(id, key, holder, token, granted_us)| {
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
                (id, KeyEntry::new(key, vec![held]))
            })
            .collect())
    }

    /// The counter rows `filter` picks whose lock is held, with the id of
    /// the connection holding it (`IS_USED_LOCK`).
    fn held_sql(&self, filter: &str) -> String {
        format!(
            "SELECT * FROM (SELECT CAST(IS_USED_LOCK(CONCAT('dlock:', LPAD(LOWER(HEX(k)), 16, '0'))) \
                                   AS UNSIGNED) AS id, \
                                   name, holder, token, granted_us \
                            FROM {} WHERE name IS NOT NULL AND {filter}) AS h \
             WHERE id IS NOT NULL",
            self.fence
        )
    }
}

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
                 IF(IS_USED_LOCK('{name}') = CONNECTION_ID(), {}, @@GLOBAL.wait_timeout)",
                idle_seconds(ttl)
            );
            let MySession { conn, id } = conn;
            let mut answers = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_many(conn.conn());
            // The statements' outcomes in order: the SELECT's, the INSERT's…
            let mut outcomes = Vec::with_capacity(3);
            while let Some(answer) = answers.try_next().await? {
                match answer {
                    Either::Right(row) => *id = row.try_get::<u64, _>(0)?,
                    Either::Left(done) => {
                        outcomes.push((done.rows_affected(), done.last_insert_id()))
                    }
                }
            }
            let inserted = outcomes.get(1).copied();
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
                .held(self.held_sql("k = ?"), |q| q.bind(session_hash(key)))
                .await?;
            // Waiters are not counted: `GET_LOCK` waits are not shown
            // without `performance_schema`'s metadata locks.
            Ok(held
                .into_iter()
                .map(|(_, entry)| entry)
                .find(|entry| entry.key == key))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        Box::pin(async move {
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let held = match prefix_successor(prefix) {
                Some(to) => {
                    let sql = self.held_sql("name >= ? AND name < ?");
                    self.held(format!("{sql} ORDER BY name LIMIT ?"), |q| {
                        q.bind(prefix.to_owned()).bind(to).bind(limit)
                    })
                    .await?
                }
                None => {
                    let sql = self.held_sql("name >= ?");
                    self.held(format!("{sql} ORDER BY name LIMIT ?"), |q| {
                        q.bind(prefix.to_owned()).bind(limit)
                    })
                    .await?
                }
            };
            Ok(held.into_iter().map(|(_, entry)| entry).collect())
        })
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        Box::pin(async move {
            let held = self
                .held(self.held_sql("k = ?"), |q| q.bind(session_hash(key)))
                .await?;
            let mut revoked = Vec::new();
            for (id, entry) in held.into_iter().filter(|(_, e)| e.key == key) {
                let token = entry
                    .holders
                    .first()
                    .and_then(|h| h.token)
                    .map_or(0, FencingToken::get);
                if self.revoke_grant(key, id, token).await? {
                    revoked.extend(entry.holders);
                }
            }
            Ok(revoked)
        })
    }

    fn ended<'a>(&'a self, key: &'a str, token: u64) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(self.mark_sql()))
                .bind(end_mark(key, token))
                .bind(MarkKind::Ended.as_str())
                .execute(&self.control)
                .await?;
            Ok(done.rows_affected() == 0)
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
