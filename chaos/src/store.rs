//! The fenced store: a small TCP server, separate from the lock service, holding a
//! counter per key. Workers read-modify-write it inside the lock.
//!
//! - **fence** mode (backends with a fencing token): a read or write carrying a
//!   token lower than the highest the key has seen is refused; reads register
//!   their token too, so a stale holder cannot overwrite what a newer holder read.
//! - **version** mode (Redlock, which has no safe token): a write is taken only if
//!   the version it read is still current (compare-and-set).
//!
//! Every decision is appended to the store's log, in order, for the checker.
//!
//! Protocol, one line each way:
//! `R <worker> <key> <token|->` → `OK <value> <version>` | `STALE`;
//! `W <worker> <key> <token|-> <base_version> <value>` → `OK` | `STALE`;
//! `DUMP` → `<key> <value> <version>` lines, then `END`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

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
    last_token: u64,
}

struct State {
    mode: Mode,
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

    fn answer(&mut self, line: &str) -> anyhow::Result<String> {
        let parts: Vec<&str> = line.split(' ').collect();
        let token = |s: &str| -> anyhow::Result<Option<u64>> {
            Ok(if s == "-" { None } else { Some(s.parse()?) })
        };
        let mode = self.mode;
        match parts.as_slice() {
            ["R", w, key, tok] => {
                let token = token(tok)?;
                let cell = self.cells.entry((*key).to_owned()).or_default();
                let accepted = match (mode, token) {
                    (Mode::Fence, Some(t)) if t >= cell.last_token => {
                        cell.last_token = t;
                        true
                    }
                    (Mode::Fence, Some(_)) => false,
                    (Mode::Fence, None) => bail!("fence mode needs a token: {line}"),
                    (Mode::Version, _) => true,
                };
                let reply = if accepted {
                    format!("OK {} {}", cell.value, cell.version)
                } else {
                    "STALE".to_owned()
                };
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
                let cell = self.cells.entry((*key).to_owned()).or_default();
                let accepted = match (mode, token) {
                    (Mode::Fence, Some(t)) => t >= cell.last_token,
                    (Mode::Fence, None) => bail!("fence mode needs a token: {line}"),
                    (Mode::Version, _) => base == cell.version,
                };
                if accepted {
                    cell.value = value;
                    cell.version += 1;
                }
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
                let mut out = String::new();
                for (key, cell) in &self.cells {
                    out.push_str(&format!("{key} {} {}\n", cell.value, cell.version));
                }
                out.push_str("END");
                Ok(out)
            }
            _ => bail!("unknown request {line:?}"),
        }
    }
}

/// Runs the store until killed: binds a loopback port, prints `LISTENING <port>`.
pub(crate) async fn serve(mode: Mode, log: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let state = Arc::new(Mutex::new(State {
        mode,
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
                let reply = state.lock().expect("store state").answer(&line);
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
