//! PostgreSQL behind a pooler: dlock's lease-table connections carry a mark
//! in their startup `options`; read back at connect, it tells whether those
//! options reached the server. If not, a pooler dropped them: in session
//! pooling (each client connection keeps its server connection) the
//! settings are set on each connection instead; in transaction pooling (a
//! server connection per transaction) the backend is refused, since the
//! driver's prepared statements, dlock's session settings and session mode's
//! advisory locks all need a server connection per connection. See
//! `Postgres::inspect`.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{AssertSqlSafe, Row as _};

use crate::backend::sql::upkeep::millis;
use crate::error::LockError;

/// The setting dlock's lease-table connections carry in their startup
/// `options`, with a value of their own: read back, it tells whether those
/// options reached the server (see `Postgres::inspect`).
const STARTUP_MARK: &str = "dlock.startup";

/// The session settings of dlock's lease-table connections, and the
/// [`STARTUP_MARK`] that tells whether they arrived.
pub(super) fn lease_settings(options: PgConnectOptions, timeout: Duration) -> PgConnectOptions {
    let ms = millis(timeout).to_string();
    let mark = format!(
        "{:016x}",
        RandomState::new().hash_one(std::time::SystemTime::now())
    );
    options.options([
        ("default_transaction_isolation", "read committed"),
        ("statement_timeout", ms.as_str()),
        ("lock_timeout", ms.as_str()),
        (STARTUP_MARK, mark.as_str()),
    ])
}

/// The `-c name=value` settings of a startup `options` string as the driver
/// writes it (`\` escapes a space or a backslash), in order.
fn startup_settings(options: &str) -> Vec<(String, String)> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => word.extend(chars.next()),
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut settings = Vec::new();
    let mut words = words.into_iter();
    while let Some(w) = words.next() {
        let setting = match w.as_str() {
            "-c" => words.next(),
            w => w
                .strip_prefix("--")
                .or_else(|| w.strip_prefix("-c"))
                .map(str::to_owned),
        };
        if let Some((name, value)) = setting.as_deref().and_then(|s| s.split_once('=')) {
            settings.push((name.replace('-', "_"), value.to_owned()));
        }
    }
    settings
}

/// The mark a connection's startup `options` carry, if any.
pub(super) fn startup_mark(options: &PgConnectOptions) -> Option<String> {
    startup_settings(options.get_options()?)
        .into_iter()
        .find_map(|(name, value)| (name == STARTUP_MARK).then_some(value))
}

/// One statement that sets, for the session, what the startup `options`
/// set (but the mark).
pub(super) fn settings_sql(options: &PgConnectOptions) -> Option<String> {
    let quote = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let sets: Vec<String> = startup_settings(options.get_options()?)
        .into_iter()
        .filter(|(name, _)| name != STARTUP_MARK)
        .map(|(name, value)| format!("set_config({}, {}, false)", quote(&name), quote(&value)))
        .collect();
    (!sets.is_empty()).then(|| format!("SELECT {}", sets.join(", ")))
}

/// The marks of the lease-table pools found behind a pooler in session
/// pooling: their new connections set what their startup `options` would
/// have set. One entry per such backend connected in this process.
static SESSION_POOLED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

pub(super) fn is_session_pooled(mark: &str) -> bool {
    SESSION_POOLED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .is_some_and(|marks| marks.contains(mark))
}

pub(super) fn set_session_pooled(mark: String) {
    SESSION_POOLED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashSet::new)
        .insert(mark);
}

/// `pg_backend_pid()` and the text columns that follow it, from the last
/// row `sql` returns (simple protocol: no prepared statement).
async fn backend_pid(
    conn: &mut PgConnection,
    sql: String,
) -> Result<(i32, Vec<Option<String>>), sqlx::Error> {
    let rows = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await?;
    let row = rows.last().ok_or(sqlx::Error::RowNotFound)?;
    let texts = (1..row.len())
        .map(|i| row.try_get::<Option<String>, _>(i))
        .collect::<Result<_, _>>()?;
    Ok((row.try_get::<i32, _>(0)?, texts))
}

/// How many times `keeps_its_server` watches the two connections.
const POOLER_CHECK_ROUNDS: usize = 4;

/// Whether `a` (whose server process was `pid` a moment ago, outside any
/// transaction) keeps its server connection while `b`, another connection
/// through the same pooler, opens and ends transactions; `false` when the
/// pooler hands server connections out per transaction. See
/// `Postgres::inspect`.
pub(super) async fn keeps_its_server(
    a: &mut PgConnection,
    b: &mut PgConnection,
    pid: i32,
) -> Result<bool, sqlx::Error> {
    let nonce = RandomState::new().hash_one(std::time::SystemTime::now());
    let mut step = 0;
    let mut a_reads = async |a: &mut PgConnection| {
        step += 1;
        let sql = format!("SELECT pg_backend_pid() /* dlock pooler check {nonce:016x} {step} */");
        Ok::<_, sqlx::Error>((backend_pid(a, sql.clone()).await?.0, sql))
    };
    let (a_pid, mut last) = a_reads(&mut *a).await?;
    if a_pid != pid {
        return Ok(false);
    }
    for _ in 0..POOLER_CHECK_ROUNDS {
        // `b` in a transaction: its server connection is its own until the
        // end. `a`'s server process must be idle after `a`'s statement
        // (`disabled` without `track_activities`: nothing to see then).
        let (b_pid, on_a) = backend_pid(
            b,
            format!(
                "BEGIN; SELECT pg_backend_pid(), \
                 (SELECT state FROM pg_stat_activity WHERE pid = {pid}), \
                 (SELECT query FROM pg_stat_activity WHERE pid = {pid})"
            ),
        )
        .await?;
        let used_by_another = match (on_a[0].as_deref(), on_a[1].as_deref()) {
            (Some("idle"), Some(query)) => query != last,
            (Some(state), _) => state.starts_with("active") || state.starts_with("idle in"),
            (None, _) => false,
        };
        if b_pid == pid || used_by_another {
            return Ok(false);
        }
        let (a_pid, _) = a_reads(&mut *a).await?;
        sqlx::raw_sql("ROLLBACK").execute(&mut *b).await?;
        // `b`'s server connection is free again (and first in line).
        let (a_pid_after, sql) = a_reads(&mut *a).await?;
        if a_pid != pid || a_pid_after != pid {
            return Ok(false);
        }
        last = sql;
    }
    Ok(true)
}

/// The refusal of a URL that leads to a pooler in transaction pooling.
pub(super) fn transaction_pooler(shown_url: &str) -> LockError {
    LockError::config(format!(
        "`{shown_url}` leads to a connection pooler in transaction pooling mode (such as \
         PgBouncer with `pool_mode = transaction`), which hands each transaction any \
         server connection: the driver's prepared statements, dlock's session settings \
         and session mode's advisory locks need one server connection per connection. \
         Use a direct URL to PostgreSQL, or a pooler in session pooling mode (PgBouncer's \
         `pool_mode = session`, with `ignore_startup_parameters = extra_float_digits,options`)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startup_options_are_read_back_as_settings() {
        let options = lease_settings(
            PgConnectOptions::new().options([("search_path", "a b\\c")]),
            Duration::from_millis(1500),
        );
        let settings = startup_settings(options.get_options().unwrap());
        let names: Vec<&str> = settings.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "search_path",
                "default_transaction_isolation",
                "statement_timeout",
                "lock_timeout",
                STARTUP_MARK
            ]
        );
        assert_eq!(settings[0].1, "a b\\c");
        assert_eq!(settings[1].1, "read committed");
        assert_eq!(settings[2].1, "1500");
        let mark = startup_mark(&options).unwrap();
        assert_eq!(mark.len(), 16);
        let other = lease_settings(PgConnectOptions::new(), Duration::from_secs(1));
        assert_ne!(startup_mark(&other), Some(mark.clone()), "a mark per pool");
        let sql = settings_sql(&options).unwrap();
        assert_eq!(
            sql,
            "SELECT set_config('search_path', 'a b\\c', false), \
             set_config('default_transaction_isolation', 'read committed', false), \
             set_config('statement_timeout', '1500', false), \
             set_config('lock_timeout', '1500', false)"
        );
        assert!(!sql.contains(&mark));
        assert_eq!(
            startup_settings("--work-mem=4MB -cstatement_timeout=5 -c a.b='x''y' junk"),
            [
                ("work_mem".to_owned(), "4MB".to_owned()),
                ("statement_timeout".to_owned(), "5".to_owned()),
                ("a.b".to_owned(), "'x''y'".to_owned()),
            ]
        );
        assert_eq!(
            settings_sql(&PgConnectOptions::new().options([("x.y", "it's")])).unwrap(),
            "SELECT set_config('x.y', 'it''s', false)"
        );
        assert_eq!(settings_sql(&PgConnectOptions::new()), None);
    }
}
