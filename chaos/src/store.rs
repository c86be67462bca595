//! The fenced store: a small TCP server, separate from the lock service, holding a
//! counter per key. Workers read-modify-write it inside the lock.
//!
//! - **fence** mode (backends with a fencing token): a read or write carrying a
//!   token lower than the highest the key has seen is refused; reads register
//!   their token too, so a stale holder cannot overwrite what a newer holder read.
//!   The decision is dlock's fencing kit's ([`dlock_runtime::fence`]), on a
//!   database of the store's own that no fault touches: a SQLite file
//!   (`--sqlite`; the counter row written in the transaction of
//!   `fence::check`) or a Redis server (`--redis`; the counter written by
//!   `fence::redis::set`, a read registering its token by writing back the
//!   value it read; a call whose answer is lost, which may or may not have
//!   written, is sent again with the same value and token until it
//!   answers, so the log has every request's true outcome). The checker
//!   replays the log on its own, so a stale
//!   operation the kit let through is still caught.
//! - **version** mode (Redlock, which has no safe token): a write is taken only if
//!   the version it read is still current (compare-and-set).
//!
//! The transfer workload reads and writes two accounts in one request, each
//! with its own key's token, decided together:
//!
//! - SQLite: one transaction, two `fence::check` calls, then both rows; a
//!   refusal of either key rolls both back, so a transfer is all or nothing.
//! - Redis: the kit fences one key per call, so the store first writes the
//!   credited account's current value back under its token (a refusal there
//!   changes nothing), then the debited account's new balance, then the
//!   credited one's. No other request runs in between (requests are answered
//!   one at a time), so once the first call passed the last cannot be refused;
//!   if it were, the transfer is half-applied: answered `HALF`, logged as such
//!   (one half taken, the other refused) and reported by the checker.
//! - version mode: both versions compared, both cells written, or neither.
//!
//! The read-write workload's readers read with `S` (a shared read), which
//! the store decides itself beside the kit: it is refused when a writer's
//! read or write with a newer token was taken (the kit's fence of the key,
//! mirrored here), and it raises the key's *reader fence*, which refuses
//! any later writer's read or write with an older token (before the kit is
//! asked). Readers never refuse each other, so readers that share the lock
//! all pass, while a reader and a writer that overlapped cannot both have
//! all their operations taken: the checker rebuilds every hold from the
//! operations the store took, in the store's order, and a writer's hold
//! overlapping a reader's there is a violation.
//!
//! Every decision is appended to the store's log, in order, for the checker:
//! requests are answered one at a time, each committed before the next starts.
//! A transfer's two halves are two entries sharing a transfer number.
//!
//! Protocol, one line each way:
//! `R <worker> <key> <token|->` → `OK <value> <version>` | `STALE`;
//! `W <worker> <key> <token|-> <base_version> <value>` → `OK` | `STALE`;
//! `RT <worker> <key> <token|-> <key> <token|->` →
//! `OK <value> <version> <value> <version>` | `STALE`;
//! `WT <worker> (<key> <token|-> <base_version> <value>){2}` → `OK` | `STALE` | `HALF`;
//! `S <worker> <key> <token|->` → `OK <value> <version>` | `STALE`;
//! `DUMP` → `<key> <value> <version>` lines, then `END`.
//!
//! A key never written holds `--initial` (0 by default; the transfer
//! workload's opening balance) at version 0; `--accounts N` makes `acct:0` …
//! `acct:{N-1}` known from the start, so that the dump lists every account.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

use dlock_runtime::{FencingToken, LockError, fence};

use crate::clock::now_ns;
use crate::history::{OpKind, StoreOp};

/// How the store decides whether to take a write.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Mode {
    /// Fencing tokens: refuse anything older than the newest token seen.
    Fence,
    /// Compare-and-set on the version read (for backends without a token).
    Version,
}

struct Cell {
    value: u64,
    version: u64,
}

/// Where fence mode keeps its counters and fences: the kit decides.
pub(crate) enum Kit {
    /// No kit: the store's own table (version mode).
    None,
    /// `fence::check` on a SQLite file.
    Sqlite(sqlx::SqlitePool),
    /// `fence::redis::set` on a Redis server.
    Redis(redis::aio::MultiplexedConnection),
}

impl Kit {
    /// Opens the store's database: `--sqlite` path or `--redis` URL.
    pub(crate) async fn open(sqlite: Option<&Path>, redis: Option<&str>) -> anyhow::Result<Kit> {
        if let Some(path) = sqlite {
            let options = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(std::time::Duration::from_secs(30));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .connect_with(options)
                .await?;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS chaos_cells \
                 (key TEXT PRIMARY KEY, value INTEGER NOT NULL, version INTEGER NOT NULL)",
            )
            .execute(&pool)
            .await?;
            return Ok(Kit::Sqlite(pool));
        }
        if let Some(url) = redis {
            let conn = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            return Ok(Kit::Redis(conn));
        }
        Ok(Kit::None)
    }

    /// A fenced read: `Some((value, version))`, or `None` when refused.
    async fn read(
        &mut self,
        key: &str,
        token: u64,
        initial: u64,
    ) -> anyhow::Result<Option<(u64, u64)>> {
        let token = FencingToken::new(token);
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                if refused(fence::check(&mut tx, key, token).await)? {
                    return Ok(None);
                }
                let cell = sqlite_cell(&mut tx, key, initial).await?;
                tx.commit().await?;
                Ok(Some(cell))
            }
            Kit::Redis(conn) => {
                let (value, version) = redis_cell(conn, key, initial).await?;
                let same = format!("{value} {version}");
                if refused(redis_set(conn, key, &same, token).await)? {
                    return Ok(None);
                }
                Ok(Some((value, version)))
            }
        }
    }

    /// The cell of `key` as it stands, without fencing.
    async fn peek(&mut self, key: &str, initial: u64) -> anyhow::Result<(u64, u64)> {
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                let cell = sqlite_cell(&mut tx, key, initial).await?;
                tx.commit().await?;
                Ok(cell)
            }
            Kit::Redis(conn) => redis_cell(conn, key, initial).await,
        }
    }

    /// Fenced reads of two keys, decided together where the database allows:
    /// per key, `Some((value, version))` when its token passed, `None` when
    /// refused. SQLite answers both or neither (one transaction); Redis checks
    /// the second key only once the first passed.
    async fn read_pair(
        &mut self,
        keys: [(&str, u64); 2],
        initial: u64,
    ) -> anyhow::Result<[Option<(u64, u64)>; 2]> {
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                for (key, token) in keys {
                    if refused(fence::check(&mut tx, key, FencingToken::new(token)).await)? {
                        return Ok([None, None]);
                    }
                }
                let first = sqlite_cell(&mut tx, keys[0].0, initial).await?;
                let second = sqlite_cell(&mut tx, keys[1].0, initial).await?;
                tx.commit().await?;
                Ok([Some(first), Some(second)])
            }
            Kit::Redis(_) => {
                let Some(first) = self.read(keys[0].0, keys[0].1, initial).await? else {
                    return Ok([None, None]);
                };
                let second = self.read(keys[1].0, keys[1].1, initial).await?;
                Ok([Some(first), second])
            }
        }
    }

    /// A fenced write of `value`: `true` when taken (the version goes up).
    async fn write(
        &mut self,
        key: &str,
        token: u64,
        value: u64,
        initial: u64,
    ) -> anyhow::Result<bool> {
        let token = FencingToken::new(token);
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                if refused(fence::check(&mut tx, key, token).await)? {
                    return Ok(false);
                }
                sqlite_write(&mut tx, key, value).await?;
                tx.commit().await?;
                Ok(true)
            }
            Kit::Redis(conn) => {
                let (_, version) = redis_cell(conn, key, initial).await?;
                let cell = format!("{value} {}", version + 1);
                Ok(!refused(redis_set(conn, key, &cell, token).await)?)
            }
        }
    }

    /// Fenced writes of two keys (`(key, token, value)`), taken together or
    /// not at all: per key, whether it was taken. Only a broken fence could
    /// answer `[true, false]` on Redis (see the [module docs](self)).
    async fn write_pair(
        &mut self,
        writes: [(&str, u64, u64); 2],
        initial: u64,
    ) -> anyhow::Result<[bool; 2]> {
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                for (key, token, _) in writes {
                    if refused(fence::check(&mut tx, key, FencingToken::new(token)).await)? {
                        return Ok([false, false]);
                    }
                }
                for (key, _, value) in writes {
                    sqlite_write(&mut tx, key, value).await?;
                }
                tx.commit().await?;
                Ok([true, true])
            }
            Kit::Redis(conn) => {
                // The credited account's current value, under its token: a
                // refusal here changes nothing.
                let (key, token, _) = writes[1];
                let (value, version) = redis_cell(conn, key, initial).await?;
                let same = format!("{value} {version}");
                let passed = !refused(redis_set(conn, key, &same, FencingToken::new(token)).await)?;
                if !passed {
                    return Ok([false, false]);
                }
                let (key, token, value) = writes[0];
                if !self.write(key, token, value, initial).await? {
                    return Ok([false, false]);
                }
                let (key, token, value) = writes[1];
                let second = self.write(key, token, value, initial).await?;
                Ok([true, second])
            }
        }
    }

    /// Every counter as the database has it.
    async fn dump(
        &mut self,
        keys: Vec<String>,
        initial: u64,
    ) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
        let mut out = BTreeMap::new();
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let rows: Vec<(String, i64, i64)> =
                    sqlx::query_as("SELECT key, value, version FROM chaos_cells")
                        .fetch_all(&*pool)
                        .await?;
                // Keys only read (or refused) so far hold their opening value,
                // as in Redis.
                out.extend(keys.into_iter().map(|k| (k, (initial, 0))));
                for (key, value, version) in rows {
                    out.insert(key, (value as u64, version as u64));
                }
            }
            Kit::Redis(conn) => {
                for key in keys {
                    out.insert(key.clone(), redis_cell(conn, &key, initial).await?);
                }
            }
        }
        Ok(out)
    }
}

/// The counter of `key` in the transaction: `(value, version)`, or the
/// opening value at version 0.
async fn sqlite_cell(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    key: &str,
    initial: u64,
) -> anyhow::Result<(u64, u64)> {
    let cell: Option<(i64, i64)> =
        sqlx::query_as("SELECT value, version FROM chaos_cells WHERE key = ?")
            .bind(key)
            .fetch_optional(&mut **tx)
            .await?;
    Ok(cell.map_or((initial, 0), |(value, version)| {
        (value as u64, version as u64)
    }))
}

/// Writes `value` to `key` in the transaction (the version goes up).
async fn sqlite_write(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    key: &str,
    value: u64,
) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO chaos_cells (key, value, version) VALUES (?, ?, 1) \
         ON CONFLICT (key) DO UPDATE \
         SET value = excluded.value, version = chaos_cells.version + 1",
    )
    .bind(key)
    .bind(value as i64)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Whether the kit refused (a stale token); other errors are the store's.
fn refused(checked: Result<(), LockError>) -> anyhow::Result<bool> {
    match checked {
        Ok(()) => Ok(false),
        Err(LockError::Fenced { .. }) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

/// How often [`redis_set`] sends a call again whose answer was lost.
const REDIS_SET_TRIES: usize = 50;

/// `fence::redis::set` of the cell of `key`, sent again with the same value
/// and token while the call fails: a failed call (a lost answer) may or may
/// not have written, and writing again with the same token is safe (the
/// kit's docs), so the store learns — and logs — every request's true
/// outcome.
async fn redis_set(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    value: &str,
    token: FencingToken,
) -> Result<(), LockError> {
    let mut tries = 1;
    loop {
        match fence::redis::set(conn, &redis_key(key), value, token).await {
            Err(e) if !matches!(e, LockError::Fenced { .. }) && tries < REDIS_SET_TRIES => {
                eprintln!("store: {key}: {e}; sending the same write again");
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            done => return done,
        }
    }
}

fn redis_key(key: &str) -> String {
    format!("chaos-store:{key}")
}

/// The counter of `key` in Redis: `"<value> <version>"`, or the opening
/// value at version 0.
async fn redis_cell(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    initial: u64,
) -> anyhow::Result<(u64, u64)> {
    let cell: Option<String> = redis::cmd("GET")
        .arg(redis_key(key))
        .query_async(conn)
        .await?;
    let Some(cell) = cell else {
        return Ok((initial, 0));
    };
    let (value, version) = cell.split_once(' ').context("bad counter")?;
    Ok((value.parse()?, version.parse()?))
}

struct State {
    mode: Mode,
    kit: Kit,
    cells: BTreeMap<String, Cell>,
    /// What a key never written holds.
    initial: u64,
    seq: u64,
    /// Transfers (reads and writes of two keys) answered so far.
    transfers: u64,
    /// Per key, the newest token of a writer's read or write the kit took
    /// (the kit's own fence of the key, as the store passed it).
    writers: BTreeMap<String, u64>,
    /// Per key, the newest token of a reader's shared read taken.
    readers: BTreeMap<String, u64>,
    log: std::io::BufWriter<std::fs::File>,
}

/// `-` or a token.
fn parse_token(s: &str) -> anyhow::Result<Option<u64>> {
    Ok(if s == "-" { None } else { Some(s.parse()?) })
}

impl State {
    fn record(&mut self, op: StoreOp) -> anyhow::Result<()> {
        serde_json::to_writer(&mut self.log, &op)?;
        self.log.write_all(b"\n")?;
        Ok(())
    }

    /// Whether a writer's `token` is older than a reader's the store took
    /// on `key` (refused before the kit is asked).
    fn behind_readers(&self, key: &str, token: u64) -> bool {
        self.readers.get(key).is_some_and(|&newest| token < newest)
    }

    /// Records that the kit took a writer's `token` on `key`.
    fn passed_writer(&mut self, key: &str, token: u64) {
        let newest = self.writers.entry(key.to_owned()).or_default();
        *newest = (*newest).max(token);
    }

    /// The cell of `key` in version mode (and a known key in fence mode).
    fn cell(&mut self, key: &str) -> &mut Cell {
        let initial = self.initial;
        self.cells.entry(key.to_owned()).or_insert(Cell {
            value: initial,
            version: 0,
        })
    }

    /// Logs one decision.
    #[allow(clippy::too_many_arguments)]
    fn log_op(
        &mut self,
        w: usize,
        op: OpKind,
        key: &str,
        token: Option<u64>,
        write: Option<(u64, u64)>,
        accepted: bool,
        transfer: Option<u64>,
    ) -> anyhow::Result<()> {
        self.seq += 1;
        self.record(StoreOp {
            seq: self.seq,
            t: now_ns(),
            op,
            key: key.to_owned(),
            transfer,
            token,
            base_version: write.map(|(base, _)| base),
            value: write.map(|(_, value)| value),
            accepted,
            w,
        })
    }

    async fn answer(&mut self, line: &str) -> anyhow::Result<String> {
        let parts: Vec<&str> = line.split(' ').collect();
        let (mode, initial) = (self.mode, self.initial);
        match parts.as_slice() {
            ["R", w, key, tok] => {
                let token = parse_token(tok)?;
                let reply = match (mode, token) {
                    (Mode::Fence, Some(t)) if self.behind_readers(key, t) => None,
                    (Mode::Fence, Some(t)) => {
                        let cell = self.kit.read(key, t, initial).await?;
                        if cell.is_some() {
                            self.passed_writer(key, t);
                        }
                        cell.map(|(value, version)| format!("OK {value} {version}"))
                    }
                    (Mode::Fence, None) => bail!("fence mode needs a token: {line}"),
                    (Mode::Version, _) => {
                        let cell = self.cell(key);
                        Some(format!("OK {} {}", cell.value, cell.version))
                    }
                };
                // Known keys, for the dump.
                self.cell(key);
                let accepted = reply.is_some();
                self.log_op(w.parse()?, OpKind::Read, key, token, None, accepted, None)?;
                Ok(reply.unwrap_or_else(|| "STALE".to_owned()))
            }
            ["W", w, key, tok, base, value] => {
                let token = parse_token(tok)?;
                let base: u64 = base.parse()?;
                let value: u64 = value.parse()?;
                let accepted = match (mode, token) {
                    (Mode::Fence, Some(t)) if self.behind_readers(key, t) => false,
                    (Mode::Fence, Some(t)) => {
                        let taken = self.kit.write(key, t, value, initial).await?;
                        if taken {
                            self.passed_writer(key, t);
                        }
                        taken
                    }
                    (Mode::Fence, None) => bail!("fence mode needs a token: {line}"),
                    (Mode::Version, _) => {
                        let cell = self.cell(key);
                        let taken = base == cell.version;
                        if taken {
                            cell.value = value;
                            cell.version += 1;
                        }
                        taken
                    }
                };
                self.cell(key);
                let write = Some((base, value));
                self.log_op(w.parse()?, OpKind::Write, key, token, write, accepted, None)?;
                Ok(if accepted { "OK" } else { "STALE" }.to_owned())
            }
            ["S", w, key, tok] => {
                let token = parse_token(tok)?;
                let reply = match (mode, token) {
                    (Mode::Fence, Some(t)) => {
                        if self.writers.get(*key).is_some_and(|&newest| t < newest) {
                            None
                        } else {
                            let newest = self.readers.entry((*key).to_owned()).or_default();
                            *newest = (*newest).max(t);
                            Some(self.kit.peek(key, initial).await?)
                        }
                    }
                    (Mode::Fence, None) => bail!("fence mode needs a token: {line}"),
                    (Mode::Version, _) => {
                        let cell = self.cell(key);
                        Some((cell.value, cell.version))
                    }
                };
                self.cell(key);
                let accepted = reply.is_some();
                self.log_op(w.parse()?, OpKind::Shared, key, token, None, accepted, None)?;
                Ok(reply.map_or_else(
                    || "STALE".to_owned(),
                    |(value, version)| format!("OK {value} {version}"),
                ))
            }
            ["RT", w, k0, t0, k1, t1] => {
                let w: usize = w.parse()?;
                let keys = [*k0, *k1];
                let tokens = [parse_token(t0)?, parse_token(t1)?];
                if keys[0] == keys[1] {
                    bail!("a transfer needs two keys: {line}");
                }
                let cells = match (mode, tokens) {
                    (Mode::Fence, [Some(a), Some(b)]) => {
                        self.kit
                            .read_pair([(keys[0], a), (keys[1], b)], initial)
                            .await?
                    }
                    (Mode::Fence, _) => bail!("fence mode needs a token per key: {line}"),
                    (Mode::Version, _) => keys.map(|key| {
                        let cell = self.cell(key);
                        Some((cell.value, cell.version))
                    }),
                };
                self.transfers += 1;
                let transfer = Some(self.transfers);
                for (i, key) in keys.into_iter().enumerate() {
                    self.cell(key);
                    let accepted = cells[i].is_some();
                    if let (true, Mode::Fence, Some(t)) = (accepted, mode, tokens[i]) {
                        self.passed_writer(key, t);
                    }
                    self.log_op(w, OpKind::Read, key, tokens[i], None, accepted, transfer)?;
                }
                Ok(match cells {
                    [Some((v0, ver0)), Some((v1, ver1))] => format!("OK {v0} {ver0} {v1} {ver1}"),
                    _ => "STALE".to_owned(),
                })
            }
            ["WT", w, k0, t0, b0, v0, k1, t1, b1, v1] => {
                let w: usize = w.parse()?;
                let keys = [*k0, *k1];
                let tokens = [parse_token(t0)?, parse_token(t1)?];
                let bases: [u64; 2] = [b0.parse()?, b1.parse()?];
                let values: [u64; 2] = [v0.parse()?, v1.parse()?];
                if keys[0] == keys[1] {
                    bail!("a transfer needs two keys: {line}");
                }
                let taken = match (mode, tokens) {
                    (Mode::Fence, [Some(a), Some(b)]) => {
                        self.kit
                            .write_pair([(keys[0], a, values[0]), (keys[1], b, values[1])], initial)
                            .await?
                    }
                    (Mode::Fence, _) => bail!("fence mode needs a token per key: {line}"),
                    (Mode::Version, _) => {
                        let current = keys.map(|key| self.cell(key).version);
                        let both = current == bases;
                        if both {
                            for (key, value) in keys.into_iter().zip(values) {
                                let cell = self.cell(key);
                                cell.value = value;
                                cell.version += 1;
                            }
                        }
                        [both, both]
                    }
                };
                self.transfers += 1;
                let transfer = Some(self.transfers);
                for (i, key) in keys.into_iter().enumerate() {
                    self.cell(key);
                    let write = Some((bases[i], values[i]));
                    if let (true, Mode::Fence, Some(t)) = (taken[i], mode, tokens[i]) {
                        self.passed_writer(key, t);
                    }
                    self.log_op(w, OpKind::Write, key, tokens[i], write, taken[i], transfer)?;
                }
                Ok(match taken {
                    [true, true] => "OK",
                    [false, false] => "STALE",
                    _ => "HALF",
                }
                .to_owned())
            }
            ["DUMP"] => {
                self.log.flush()?;
                let cells = match mode {
                    Mode::Fence => {
                        self.kit
                            .dump(self.cells.keys().cloned().collect(), initial)
                            .await?
                    }
                    Mode::Version => self
                        .cells
                        .iter()
                        .map(|(k, c)| (k.clone(), (c.value, c.version)))
                        .collect(),
                };
                let mut out = String::new();
                for (key, (value, version)) in cells {
                    out.push_str(&format!("{key} {value} {version}\n"));
                }
                out.push_str("END");
                Ok(out)
            }
            _ => bail!("unknown request {line:?}"),
        }
    }
}

/// The transfer workload's account keys: `acct:0` … `acct:{n-1}`.
pub(crate) fn account_keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("acct:{i}")).collect()
}

/// Runs the store until killed: binds a loopback port, prints `LISTENING
/// <port>`. Keys never written hold `initial`; the `accounts` keys are known
/// from the start (the dump lists them).
pub(crate) async fn serve(
    mode: Mode,
    kit: Kit,
    log: &Path,
    initial: u64,
    accounts: usize,
) -> anyhow::Result<()> {
    if mode == Mode::Fence && matches!(kit, Kit::None) {
        bail!("fence mode needs --sqlite or --redis");
    }
    let file = std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let cells = account_keys(accounts)
        .into_iter()
        .map(|key| {
            (
                key,
                Cell {
                    value: initial,
                    version: 0,
                },
            )
        })
        .collect();
    let state = Arc::new(Mutex::new(State {
        mode,
        kit,
        cells,
        initial,
        seq: 0,
        transfers: 0,
        writers: BTreeMap::new(),
        readers: BTreeMap::new(),
        log: std::io::BufWriter::new(file),
    }));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("LISTENING {}", listener.local_addr()?.port());
    loop {
        let (socket, _) = listener.accept().await?;
        let state = state.clone();
        tokio::spawn(async move {
            let (read, mut write) = socket.into_split();
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = state.lock().await.answer(&line).await;
                let reply = match reply {
                    Ok(r) => r,
                    Err(e) => format!("ERR {e}"),
                };
                if write
                    .write_all(format!("{reply}\n").as_bytes())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
    }
}

/// What a read answered.
pub(crate) enum ReadReply {
    /// Value and version.
    Ok { value: u64, version: u64 },
    /// A newer token had been there.
    Stale,
}

/// What a write of two keys answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PairReply {
    /// Both writes taken.
    Taken,
    /// Neither: a newer holder had been at one of the keys (or a version moved).
    Refused,
    /// One write taken and the other refused: a broken transfer (the
    /// checker reports it from the store's log).
    Half,
}

/// One connection to the store.
pub(crate) struct StoreClient {
    lines: tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    write: tokio::net::tcp::OwnedWriteHalf,
}

fn tok(token: Option<u64>) -> String {
    token.map_or_else(|| "-".to_owned(), |t| t.to_string())
}

impl StoreClient {
    /// Connects to the store on a loopback port.
    pub(crate) async fn connect(port: u16) -> anyhow::Result<Self> {
        let (read, write) = TcpStream::connect(("127.0.0.1", port)).await?.into_split();
        Ok(Self {
            lines: BufReader::new(read).lines(),
            write,
        })
    }

    async fn call(&mut self, request: String) -> anyhow::Result<String> {
        self.write
            .write_all(format!("{request}\n").as_bytes())
            .await?;
        let line = self.lines.next_line().await?.context("the store hung up")?;
        if let Some(err) = line.strip_prefix("ERR ") {
            bail!("store: {err}");
        }
        Ok(line)
    }

    /// Fenced read.
    pub(crate) async fn read(
        &mut self,
        w: usize,
        key: &str,
        token: Option<u64>,
    ) -> anyhow::Result<ReadReply> {
        let line = self.call(format!("R {w} {key} {}", tok(token))).await?;
        if line == "STALE" {
            return Ok(ReadReply::Stale);
        }
        let mut it = line.split(' ').skip(1).map(str::parse::<u64>);
        match (it.next(), it.next()) {
            (Some(Ok(value)), Some(Ok(version))) => Ok(ReadReply::Ok { value, version }),
            _ => bail!("bad store reply {line:?}"),
        }
    }

    /// A reader's fenced read (see the [module docs](self)).
    pub(crate) async fn shared_read(
        &mut self,
        w: usize,
        key: &str,
        token: Option<u64>,
    ) -> anyhow::Result<ReadReply> {
        let line = self.call(format!("S {w} {key} {}", tok(token))).await?;
        if line == "STALE" {
            return Ok(ReadReply::Stale);
        }
        let mut it = line.split(' ').skip(1).map(str::parse::<u64>);
        match (it.next(), it.next()) {
            (Some(Ok(value)), Some(Ok(version))) => Ok(ReadReply::Ok { value, version }),
            _ => bail!("bad store reply {line:?}"),
        }
    }

    /// Fenced (or version-checked) write; `true` when taken.
    pub(crate) async fn write(
        &mut self,
        w: usize,
        key: &str,
        token: Option<u64>,
        base_version: u64,
        value: u64,
    ) -> anyhow::Result<bool> {
        let line = self
            .call(format!("W {w} {key} {} {base_version} {value}", tok(token)))
            .await?;
        Ok(line == "OK")
    }

    /// Fenced reads of two keys (`(key, token)`), decided together: both
    /// `(value, version)`s, or `None` when refused.
    pub(crate) async fn read_pair(
        &mut self,
        w: usize,
        keys: [(&str, Option<u64>); 2],
    ) -> anyhow::Result<Option<[(u64, u64); 2]>> {
        let [(k0, t0), (k1, t1)] = keys;
        let line = self
            .call(format!("RT {w} {k0} {} {k1} {}", tok(t0), tok(t1)))
            .await?;
        if line == "STALE" {
            return Ok(None);
        }
        let numbers: Vec<u64> = line
            .split(' ')
            .skip(1)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("bad store reply {line:?}"))?;
        match numbers.as_slice() {
            [v0, ver0, v1, ver1] => Ok(Some([(*v0, *ver0), (*v1, *ver1)])),
            _ => bail!("bad store reply {line:?}"),
        }
    }

    /// Fenced (or version-checked) writes of two keys (`(key, token,
    /// base_version, value)`), taken together or not at all.
    pub(crate) async fn write_pair(
        &mut self,
        w: usize,
        writes: [(&str, Option<u64>, u64, u64); 2],
    ) -> anyhow::Result<PairReply> {
        let [(k0, t0, b0, v0), (k1, t1, b1, v1)] = writes;
        let line = self
            .call(format!(
                "WT {w} {k0} {} {b0} {v0} {k1} {} {b1} {v1}",
                tok(t0),
                tok(t1)
            ))
            .await?;
        match line.as_str() {
            "OK" => Ok(PairReply::Taken),
            "STALE" => Ok(PairReply::Refused),
            "HALF" => Ok(PairReply::Half),
            _ => bail!("bad store reply {line:?}"),
        }
    }

    /// The store's final state: key → (value, version). Flushes the store's log.
    pub(crate) async fn dump(&mut self) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
        self.write.write_all(b"DUMP\n").await?;
        let mut out = BTreeMap::new();
        loop {
            let line = self.lines.next_line().await?.context("the store hung up")?;
            if line == "END" {
                return Ok(out);
            }
            let parts: Vec<&str> = line.split(' ').collect();
            let [key, value, version] = parts.as_slice() else {
                bail!("bad dump line {line:?}");
            };
            out.insert((*key).to_owned(), (value.parse()?, version.parse()?));
        }
    }
}
