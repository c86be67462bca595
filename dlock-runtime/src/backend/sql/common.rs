//! What the SQL backends share: URL options, the collection of old free rows,
//! lease lengths in milliseconds, key hashing for session mode, table names,
//! and which `sqlx` errors are worth retrying.

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::collections::HashMap;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::ceil_millis;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::error::BackendError;
use crate::error::LockError;

/// How long free rows are kept by default before they are collected.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(600);

/// How often, at most, a backend collects free rows.
const COLLECT_EVERY: Duration = Duration::from_secs(60);

/// A lease (or a retention) in whole milliseconds for a statement: rounded up
/// ([`ceil_millis`]), and small enough that the server's date arithmetic
/// cannot overflow.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(ceil_millis(d))
        .unwrap_or(i64::MAX)
        .min(MAX_SQL_MILLIS)
}

/// About 1,000 years: the longest lease a SQL backend stores (a
/// `timestamptz` ends in the year 294276, MySQL's microseconds at 2^63).
const MAX_SQL_MILLIS: i64 = 1000 * 365 * 24 * 3600 * 1000;

/// The same in microseconds (MySQL stores microseconds).
#[cfg(feature = "mysql")]
pub(crate) fn micros(d: Duration) -> i64 {
    millis(d) * 1000
}

/// The option pairs of a URL's query string, percent-decoded, for the
/// backend to take its own options from.
pub(crate) struct UrlOptions {
    scheme: &'static str,
    pairs: Vec<(String, String)>,
}

impl UrlOptions {
    /// Splits `query` (what follows `?`, without it) into pairs.
    pub(crate) fn parse(scheme: &'static str, query: &str) -> Result<Self, LockError> {
        let mut pairs = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            pairs.push((percent_decode(name)?, percent_decode(value)?));
        }
        Ok(UrlOptions { scheme, pairs })
    }

    /// Takes option `name` out (the last one given wins), if present.
    pub(crate) fn take(&mut self, name: &str) -> Option<String> {
        let mut found = None;
        self.pairs.retain(|(n, v)| {
            if n == name {
                found = Some(v.clone());
                false
            } else {
                true
            }
        });
        found
    }

    /// Takes a duration option (`250ms`, `1m 30s`); zero is refused unless `zero_ok`.
    pub(crate) fn duration(
        &mut self,
        name: &str,
        default: Duration,
        zero_ok: bool,
    ) -> Result<Duration, LockError> {
        let Some(value) = self.take(name) else {
            return Ok(default);
        };
        let parsed = humantime::parse_duration(&value).map_err(|e| {
            LockError::config(format!(
                "bad `{name}={value}` in a {} URL: {e}",
                self.scheme
            ))
        })?;
        if parsed.is_zero() && !zero_ok {
            return Err(LockError::config(format!(
                "`{name}` in a {} URL must be more than zero",
                self.scheme
            )));
        }
        Ok(parsed)
    }

    /// Takes a boolean option (`true`/`false`, `on`/`off`, `1`/`0`, `yes`/`no`).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn flag(&mut self, name: &str, default: bool) -> Result<bool, LockError> {
        let Some(value) = self.take(name) else {
            return Ok(default);
        };
        match value.to_ascii_lowercase().as_str() {
            "true" | "on" | "1" | "yes" => Ok(true),
            "false" | "off" | "0" | "no" => Ok(false),
            _ => Err(LockError::config(format!(
                "bad `{name}={value}` in a {} URL: expected true or false",
                self.scheme
            ))),
        }
    }

    /// Takes `mode=lease|session`.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn mode(&mut self) -> Result<Mode, LockError> {
        match self.take("mode").as_deref() {
            None | Some("lease") => Ok(Mode::Lease),
            Some("session") => Ok(Mode::Session),
            Some(other) => Err(LockError::config(format!(
                "bad `mode={other}` in a {} URL: expected `lease` (the default) or `session`",
                self.scheme
            ))),
        }
    }

    /// Takes `table=` (default `dlock_leases`), checked to be a plain identifier.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn table(&mut self) -> Result<String, LockError> {
        let table = self
            .take("table")
            .unwrap_or_else(|| "dlock_leases".to_owned());
        check_table_name(&table).map_err(|why| {
            LockError::config(format!(
                "bad `table={table}` in a {} URL: {why}",
                self.scheme
            ))
        })?;
        Ok(table)
    }

    /// Refuses options nobody took (for URLs with no driver to hand them
    /// to); `known` lists the options there are.
    #[cfg(feature = "sqlite")]
    pub(crate) fn refuse_rest(&self, known: &str) -> Result<(), LockError> {
        match self.pairs.first() {
            None => Ok(()),
            Some((name, _)) => Err(LockError::config(format!(
                "unknown option `{name}` in a {} URL; known: {known}",
                self.scheme
            ))),
        }
    }

    /// The pairs nobody took, to hand on to the driver (`sslmode=require`, …),
    /// as a query string (percent-encoded again), empty if none.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn rest(&self) -> String {
        self.pairs
            .iter()
            .map(|(n, v)| format!("{}={}", percent_encode(n), percent_encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// How a SQL backend holds its locks.
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// A row per key in a lease table (the default).
    Lease,
    /// A server-side lock on a dedicated connection per held lock.
    Session,
}

/// Table names go into statements as written: letters, digits and `_`, not
/// starting with a digit, optionally after a schema (`locks.dlock_leases`).
/// Short enough that `<table>_fence` fits PostgreSQL's 63-byte identifiers.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn check_table_name(name: &str) -> Result<(), &'static str> {
    let mut parts = name.split('.');
    let (Some(first), second, None) = (parts.next(), parts.next(), parts.next()) else {
        return Err("at most one `.` (schema.table)");
    };
    for part in [Some(first), second].into_iter().flatten() {
        let mut chars = part.chars();
        let Some(head) = chars.next() else {
            return Err("an empty name");
        };
        if !(head.is_ascii_alphabetic() || head == '_')
            || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err("only ASCII letters, digits and `_`, not starting with a digit");
        }
        if part.len() > 50 {
            return Err("at most 50 characters");
        }
    }
    Ok(())
}

fn percent_decode(s: &str) -> Result<String, LockError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| LockError::config("bad percent-escape in a URL option"))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| LockError::config("a URL option is not UTF-8"))
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/' | b':') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Deletes free rows now and then: at most once a minute (or once a
/// retention, if shorter), rows free or expired for longer than the
/// retention. Safe with hybrid tokens: a key locked again after its row was
/// deleted gets a token above every old one (the clock has moved on).
#[derive(Debug)]
pub(crate) struct Collector {
    pub(crate) retention: Duration,
    last: Mutex<Instant>,
}

impl Collector {
    pub(crate) fn new(retention: Duration) -> Self {
        Collector {
            retention,
            last: Mutex::new(Instant::now()),
        }
    }

    /// Whether it is time to collect; if so, the next time is a period away.
    pub(crate) fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() < COLLECT_EVERY.min(self.retention) {
            return false;
        }
        *last = Instant::now();
        true
    }
}

/// The 64-bit name of a key in session mode: the first 8 bytes of its
/// SHA-256, big-endian, as a signed integer (a PostgreSQL advisory-lock key;
/// MySQL names are built from it). Two keys share a name with probability
/// 2^-64 per pair: they would then exclude each other, never share a lock
/// unknowingly — and tokens still grow, as they share one counter row.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn session_hash(key: &str) -> i64 {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(key.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// Whether a `sqlx` error says the connection (or the pool) failed, not the
/// statement: worth trying again, and the connection is not to be reused.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn is_connection_error(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // The server ended the session with a message (PostgreSQL sends a
        // FATAL before closing: terminated, shut down, idle-session
        // timeout; SQLSTATE class 08: connection exception): the
        // connection is dead like any other.
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02" | "57P03" | "57P05")
        }),
        _ => false,
    }
}

/// The waiters of this backend that registered a wake-up source (the wait
/// loop does so after their first busy answer), with how many times each has
/// looked since: for the back-off of backends that poll, and for the marks
/// PostgreSQL waiters set on a key. An entry lives as long as its waiter's
/// wake-up source, so the map holds O(current waiters).
#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(Debug, Default)]
pub(crate) struct Contenders {
    map: Mutex<HashMap<String, u32>>,
}

/// The first back-off of a polling waiter; it doubles up to the backend's cap.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const FIRST_BACKOFF: Duration = Duration::from_millis(5);

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl Contenders {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `owner` until the returned guard is dropped (keep it in the
    /// waiter's [`WakeSource`](crate::backend::WakeSource)).
    pub(crate) fn register(self: &Arc<Self>, owner: &str) -> Contender {
        self.map().insert(owner.to_owned(), 0);
        Contender {
            contenders: self.clone(),
            owner: owner.to_owned(),
        }
    }

    /// Whether `owner` waits with a registered wake-up source.
    #[cfg(feature = "postgres")]
    pub(crate) fn is_registered(&self, owner: &str) -> bool {
        self.map().contains_key(owner)
    }

    /// The next back-off of `owner`: 5 ms, doubling up to `cap`; `None` if it
    /// has not registered (its first attempt, or it does not wait at all).
    pub(crate) fn next_backoff(&self, owner: &str, cap: Duration) -> Option<Duration> {
        let mut map = self.map();
        let looked = map.get_mut(owner)?;
        let backoff = FIRST_BACKOFF
            .saturating_mul(1 << (*looked).min(16))
            .min(cap);
        *looked = looked.saturating_add(1);
        Some(backoff)
    }

    /// Registered waiters right now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

/// A registered waiter; dropping it unregisters.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct Contender {
    contenders: Arc<Contenders>,
    owner: String,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl Drop for Contender {
    fn drop(&mut self) {
        self.contenders.map().remove(&self.owner);
    }
}

/// A pooled connection that is **closed** when dropped, unless it was handed
/// back with [`keep`](Checked::keep): a statement dropped halfway (a
/// timeout, a caller that went away) or a broken connection never goes back
/// to the pool in an unknown state.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct Checked<DB: sqlx::Database>(Option<sqlx::pool::PoolConnection<DB>>);

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Checked<DB> {
    pub(crate) fn new(conn: sqlx::pool::PoolConnection<DB>) -> Self {
        Checked(Some(conn))
    }

    pub(crate) fn conn(&mut self) -> &mut DB::Connection {
        self.0.as_mut().expect("present until dropped or kept")
    }

    /// Returns the connection to its pool (it is in a known state).
    pub(crate) fn keep(mut self) {
        drop(self.0.take());
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Drop for Checked<DB> {
    fn drop(&mut self) {
        if let Some(mut conn) = self.0.take() {
            conn.close_on_drop();
        }
    }
}

/// A pool and how its calls are bounded: one timeout for the whole call, a
/// connection that failed is closed (never reused) and the statement tried
/// again on another — a server restart leaves dead connections in the pool,
/// each failing at once, and every dlock statement may be sent twice (each
/// is owner-checked).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) struct Pooled<DB: sqlx::Database> {
    pub(crate) pool: sqlx::Pool<DB>,
    pub(crate) timeout: Duration,
    pub(crate) classify: fn(sqlx::Error) -> BackendError,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Clone for Pooled<DB> {
    fn clone(&self) -> Self {
        Pooled {
            pool: self.pool.clone(),
            timeout: self.timeout,
            classify: self.classify,
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl<DB: sqlx::Database> Pooled<DB> {
    /// Runs `statement` on a connection of the pool. `what` names it in a
    /// timeout error.
    pub(crate) async fn call<T, F>(&self, what: &str, mut statement: F) -> Result<T, BackendError>
    where
        F: for<'c> FnMut(
            &'c mut DB::Connection,
        ) -> futures_util::future::BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        let attempts = async {
            let mut tries = 0;
            loop {
                tries += 1;
                let answer = async {
                    let mut conn = Checked::new(self.pool.acquire().await?);
                    let answer = statement(conn.conn()).await;
                    match &answer {
                        Err(err) if is_connection_error(err) => drop(conn),
                        _ => conn.keep(),
                    }
                    answer
                }
                .await;
                match answer {
                    Err(err)
                        if tries < CONNECTION_TRIES
                            && is_connection_error(&err)
                            && !matches!(err, sqlx::Error::PoolTimedOut) => {}
                    answer => return answer,
                }
            }
        };
        match tokio::time::timeout(self.timeout, attempts).await {
            Ok(answer) => answer.map_err(self.classify),
            Err(_) => Err(timed_out(what, self.timeout)),
        }
    }
}

/// One batch statement's error, as the answer of each lease of the batch.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn batch_failed<T>(
    kind: &str,
    err: BackendError,
    n: usize,
) -> Vec<Result<T, BackendError>> {
    let (transient, message) = (err.is_retryable(), err.to_string());
    (0..n)
        .map(|_| {
            let message = format!("{kind}: batch renewal failed: {message}");
            Err(if transient {
                BackendError::transient(message)
            } else {
                BackendError::permanent(message)
            })
        })
        .collect()
}

/// How many connections one call tries: a pool holds at most this many
/// dead ones after a restart.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const CONNECTION_TRIES: u32 = 11;

/// The error of a call that did not answer in time.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn timed_out(what: &str, after: Duration) -> BackendError {
    BackendError::transient(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} did not answer within {after:?}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn options_are_taken_and_the_rest_handed_on() {
        let mut o = UrlOptions::parse(
            "postgres://",
            "mode=session&table=locks.my_leases&sslmode=require&listen_url=postgres%3A%2F%2Fh%2Fdb%3Fa%3D1&poll=250ms&create=false",
        )
        .unwrap();
        assert_eq!(o.mode().unwrap(), Mode::Session);
        assert_eq!(o.table().unwrap(), "locks.my_leases");
        assert_eq!(o.take("listen_url").unwrap(), "postgres://h/db?a=1");
        assert_eq!(
            o.duration("poll", Duration::from_secs(1), false).unwrap(),
            Duration::from_millis(250)
        );
        assert!(!o.flag("create", true).unwrap());
        assert_eq!(o.rest(), "sslmode=require");
        let mut o = UrlOptions::parse("mysql://", "").unwrap();
        assert_eq!(o.mode().unwrap(), Mode::Lease);
        assert_eq!(o.table().unwrap(), "dlock_leases");
        assert!(o.flag("create", true).unwrap());
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn bad_options_are_config_errors() {
        for query in [
            "mode=sessions",
            "table=a;drop",
            "table=1abc",
            "table=a.b.c",
            "poll=0s",
            "poll=soon",
            "create=maybe",
            "x=%zz",
        ] {
            let mut o = match UrlOptions::parse("postgres://", query) {
                Ok(o) => o,
                Err(LockError::Config { .. }) => continue,
                Err(e) => panic!("{query}: {e}"),
            };
            let result = o
                .mode()
                .and_then(|_| o.table())
                .and_then(|_| o.duration("poll", Duration::from_secs(1), false))
                .and_then(|_| o.flag("create", true));
            assert!(
                matches!(result, Err(LockError::Config { .. })),
                "{query}: {:?}",
                result.err()
            );
        }
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn table_names() {
        assert!(check_table_name("dlock_leases").is_ok());
        assert!(check_table_name("_x1.y_2").is_ok());
        assert!(check_table_name("").is_err());
        assert!(check_table_name("a b").is_err());
        assert!(check_table_name("a\"b").is_err());
        assert!(check_table_name(&"x".repeat(51)).is_err());
    }

    #[test]
    fn sql_millis_round_up_and_stay_in_range() {
        assert_eq!(millis(Duration::from_micros(1500)), 2);
        assert_eq!(millis(Duration::MAX), MAX_SQL_MILLIS);
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn contenders_back_off_and_leave_with_their_wake_source() {
        let contenders = Arc::new(Contenders::default());
        let cap = Duration::from_millis(50);
        assert_eq!(contenders.next_backoff("a", cap), None, "not registered");
        let a = contenders.register("a");
        let b = contenders.register("b");
        let backoffs: Vec<_> = (0..6)
            .map(|_| contenders.next_backoff("a", cap).unwrap().as_millis())
            .collect();
        assert_eq!(backoffs, [5, 10, 20, 40, 50, 50]);
        assert_eq!(contenders.len(), 2);
        drop(a);
        assert_eq!(contenders.next_backoff("a", cap), None);
        drop(b);
        assert_eq!(contenders.len(), 0);
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn session_hash_is_the_first_8_bytes_of_sha256() {
        // SHA-256("abc") = ba7816bf8f01cfea…
        assert_eq!(session_hash("abc"), 0xba78_16bf_8f01_cfea_u64 as i64);
        assert_ne!(session_hash("a"), session_hash("A"));
    }
}
