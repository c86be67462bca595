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
//!   value it read). The checker replays the log on its own, so a stale
//!   operation the kit let through is still caught.
//! - **version** mode (Redlock, which has no safe token): a write is taken only if
//!   the version it read is still current (compare-and-set).
//!
//! Every decision is appended to the store's log, in order, for the checker:
//! requests are answered one at a time, each committed before the next starts.
//!
//! Protocol, one line each way:
//! `R <worker> <key> <token|->` → `OK <value> <version>` | `STALE`;
//! `W <worker> <key> <token|-> <base_version> <value>` → `OK` | `STALE`;
//! `DUMP` → `<key> <value> <version>` lines, then `END`.

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

#[derive(Default)]
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
    async fn read(&mut self, key: &str, token: u64) -> anyhow::Result<Option<(u64, u64)>> {
        let token = FencingToken::new(token);
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                if refused(fence::check(&mut tx, key, token).await)? {
                    return Ok(None);
                }
                let cell: Option<(i64, i64)> =
                    sqlx::query_as("SELECT value, version FROM chaos_cells WHERE key = ?")
                        .bind(key)
                        .fetch_optional(&mut *tx)
                        .await?;
                tx.commit().await?;
                let (value, version) = cell.unwrap_or((0, 0));
                Ok(Some((value as u64, version as u64)))
            }
            Kit::Redis(conn) => {
                let (value, version) = redis_cell(conn, key).await?;
                let same = format!("{value} {version}");
                if refused(fence::redis::set(conn, &redis_key(key), same, token).await)? {
                    return Ok(None);
                }
                Ok(Some((value, version)))
            }
        }
    }

    /// A fenced write of `value`: `true` when taken (the version goes up).
    async fn write(&mut self, key: &str, token: u64, value: u64) -> anyhow::Result<bool> {
        let token = FencingToken::new(token);
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                if refused(fence::check(&mut tx, key, token).await)? {
                    return Ok(false);
                }
                sqlx::query(
                    "INSERT INTO chaos_cells (key, value, version) VALUES (?, ?, 1) \
                     ON CONFLICT (key) DO UPDATE \
                     SET value = excluded.value, version = chaos_cells.version + 1",
                )
                .bind(key)
                .bind(value as i64)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(true)
            }
            Kit::Redis(conn) => {
                let (_, version) = redis_cell(conn, key).await?;
                let cell = format!("{value} {}", version + 1);
                Ok(!refused(
                    fence::redis::set(conn, &redis_key(key), cell, token).await,
                )?)
            }
        }
    }

    /// Every counter as the database has it.
    async fn dump(&mut self, keys: Vec<String>) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
        let mut out = BTreeMap::new();
        match self {
            Kit::None => bail!("fence mode needs the kit"),
            Kit::Sqlite(pool) => {
                let rows: Vec<(String, i64, i64)> =
                    sqlx::query_as("SELECT key, value, version FROM chaos_cells")
                        .fetch_all(&*pool)
                        .await?;
                // Keys only read (or refused) so far are zeros, as in Redis.
                out.extend(keys.into_iter().map(|k| (k, (0, 0))));
                for (key, value, version) in rows {
                    out.insert(key, (value as u64, version as u64));
                }
            }
            Kit::Redis(conn) => {
                for key in keys {
                    out.insert(key.clone(), redis_cell(conn, &key).await?);
                }
            }
        }
        Ok(out)
    }
}

/// Whether the kit refused (a stale token); other errors are the store's.
fn refused(checked: Result<(), LockError>) -> anyhow::Result<bool> {
    match checked {
        Ok(()) => Ok(false),
        Err(LockError::Fenced { .. }) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

fn redis_key(key: &str) -> String {
    format!("chaos-store:{key}")
}

/// The counter of `key` in Redis: `"<value> <version>"`, or zeros.
async fn redis_cell(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> anyhow::Result<(u64, u64)> {
    let cell: Option<String> = redis::cmd("GET")
        .arg(redis_key(key))
        .query_async(conn)
        .await?;
    let Some(cell) = cell else {
        return Ok((0, 0));
    };
    let (value, version) = cell.split_once(' ').context("bad counter")?;
    Ok((value.parse()?, version.parse()?))
}

struct State {
    mode: Mode,
    kit: Kit,
    cells: BTreeMap<String, Cell>,
    seq: u64,
    log: std::io::BufWriter<std::fs::File>,
}

impl State {
    fn record(&mut self, op: StoreOp) -> anyhow::Result<()> {
        serde_json::to_writer(&mut self.log, &op)?;
        self.log.write_all(b"\n")?;
        Ok(())
    }

    async fn answer(&mut self, line: &str) -> anyhow::Result<String> {
        let parts: Vec<&str> = line.split(' ').collect();
        let token = |s: &str| -> anyhow::Result<Option<u64>> {
            Ok(if s == "-" { None } else { Some(s.parse()?) })
        };
        let mode = self.mode;
        match parts.as_slice() {
            ["R", w, key, tok] => {
                let token = token(tok)?;
                let reply = match (mode, token) {
                    (Mode::Fence, Some(t)) => self
                        .kit
                        .read(key, t)
                        .await?
                        .map(|(value, version)| format!("OK {value} {version}")),
                    (Mode::Fence, None) => bail!("fence mode needs a token: {line}"),
                    (Mode::Version, _) => {
                        let cell = self.cells.entry((*key).to_owned()).or_default();
                        Some(format!("OK {} {}", cell.value, cell.version))
                    }
                };
                // Known keys, for the dump.
                self.cells.entry((*key).to_owned()).or_default();
                let accepted = reply.is_some();
                let reply = reply.unwrap_or_else(|| "STALE".to_owned());
                self.seq += 1;
                self.record(StoreOp {
                    seq: self.seq,
                    t: now_ns(),
                    op: OpKind::Read,
                    key: (*key).to_owned(),
                    token,
                    base_version: None,
                    value: None,
                    accepted,
                    w: w.parse()?,
                })?;
                Ok(reply)
            }
            ["W", w, key, tok, base, value] => {
                let token = token(tok)?;
                let base: u64 = base.parse()?;
                let value: u64 = value.parse()?;
                let accepted = match (mode, token) {
                    (Mode::Fence, Some(t)) => self.kit.write(key, t, value).await?,
                    (Mode::Fence, None) => bail!("fence mode needs a token: {line}"),
                    (Mode::Version, _) => {
                        let cell = self.cells.entry((*key).to_owned()).or_default();
                        let taken = base == cell.version;
                        if taken {
                            cell.value = value;
                            cell.version += 1;
                        }
                        taken
                    }
                };
                self.cells.entry((*key).to_owned()).or_default();
                self.seq += 1;
                self.record(StoreOp {
                    seq: self.seq,
                    t: now_ns(),
                    op: OpKind::Write,
                    key: (*key).to_owned(),
                    token,
                    base_version: Some(base),
                    value: Some(value),
                    accepted,
                    w: w.parse()?,
                })?;
                Ok(if accepted { "OK" } else { "STALE" }.to_owned())
            }
            ["DUMP"] => {
                self.log.flush()?;
                let cells = match mode {
                    Mode::Fence => self.kit.dump(self.cells.keys().cloned().collect()).await?,
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

/// Runs the store until killed: binds a loopback port, prints `LISTENING <port>`.
pub(crate) async fn serve(mode: Mode, kit: Kit, log: &Path) -> anyhow::Result<()> {
    if mode == Mode::Fence && matches!(kit, Kit::None) {
        bail!("fence mode needs --sqlite or --redis");
    }
    let file = std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let state = Arc::new(Mutex::new(State {
        mode,
        kit,
        cells: BTreeMap::new(),
        seq: 0,
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
