//! What every process of a run records: one JSON object per line, stamped with
//! [`now_ns`](crate::clock::now_ns).
//!
//! Workers write [`WorkerEvent`]s (their own steps) and [`TraceEvent`]s (what
//! dlock's runtime traced about their leases) to their standard output and the
//! orchestrator appends them, with the nemesis' [`FaultEvent`]s, to
//! `history.jsonl`; the fenced store writes its [`StoreOp`]s to `store.jsonl`. The
//! checker reads both.

use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// A line of `history.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "src", rename_all = "snake_case")]
pub(crate) enum Record {
    /// From a worker process.
    Worker(WorkerEvent),
    /// From the nemesis.
    Fault(FaultEvent),
    /// From a worker process: an event dlock's runtime traced.
    Trace(TraceEvent),
    /// From the nemesis: what a `revoke` fault took, and from whom.
    Revocation(RevocationEvent),
    /// From the nemesis: whose connection a `session_kill` fault ended.
    SessionKill(SessionKillEvent),
}

/// A line a worker prints: one of its steps or one of the runtime's events.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum WorkerLine {
    /// A step of the worker (has `ev`).
    Step(WorkerEvent),
    /// A runtime event about one of its leases (has `event`).
    Trace(TraceEvent),
}

/// One step of a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct WorkerEvent {
    /// When, on the shared clock.
    pub(crate) t: u64,
    /// Worker slot (stays the same across restarts).
    pub(crate) w: usize,
    /// Which process of that slot (0, then 1 after the first restart, …).
    pub(crate) inc: u32,
    /// The user key (transfer workload: the account debited).
    pub(crate) key: String,
    /// Transfer workload: every key of the hold, the account debited first,
    /// then the one credited (empty for a hold of one key).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) keys: Vec<String>,
    /// What happened.
    pub(crate) ev: Step,
}

impl WorkerEvent {
    /// Every key the event is about: `keys`, or `key` alone.
    pub(crate) fn all_keys(&self) -> Vec<String> {
        if self.keys.is_empty() {
            vec![self.key.clone()]
        } else {
            self.keys.clone()
        }
    }
}

/// What a worker did or saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub(crate) enum Step {
    /// About to take the lock (through the annotated function, or through
    /// `Registry::lock` when the caller is to give up somewhere).
    Attempt {
        /// The lease asked for, in ms (absent in runs before mixed leases:
        /// the run's `lease_ms` then).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_ms: Option<u64>,
        /// Whether a lock on the side backend is held across this attempt.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        side: bool,
        /// Where the caller will give up (a short timeout there), if it does.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        give_up: Option<GaveUpAt>,
    },
    /// Inside the lock.
    Acquired {
        /// The fencing token, where the backend has one.
        token: Option<u64>,
        /// Semaphore workload: the permit's slot (`0..permits`); the store
        /// key of the hold is `{key}#{slot}`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slot: Option<u32>,
        /// Read-write workload: a reader's hold (shared with other readers).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        shared: bool,
    },
    /// The fenced read went through.
    Read {
        /// Value read.
        value: u64,
        /// Version read.
        version: u64,
        /// How long the worker will stay before writing.
        hold_ms: u64,
    },
    /// Transfer workload: both balances read through the fenced store, in
    /// the order of the event's `keys` (debited, credited).
    ReadBoth {
        /// The balances read.
        balances: Vec<u64>,
        /// Their versions.
        versions: Vec<u64>,
        /// Each key's own fencing token, where the backend has one.
        tokens: Vec<Option<u64>>,
        /// How much moves from the first account to the second.
        amount: u64,
        /// How long the worker will stay before writing.
        hold_ms: u64,
    },
    /// The store answered the write (transfer workload: both writes).
    Wrote {
        /// Whether the store took it.
        accepted: bool,
    },
    /// The store refused the read or the write: a newer holder had been there.
    Fenced,
    /// The body's last step: from here on the worker no longer believes it holds.
    Leaving,
    /// The function returned normally and released the lock.
    Released,
    /// The lease was lost: the body was stopped (`on_lost = "cancel"`), or it
    /// noticed at its end (`on_lost = "continue"`).
    Lost {
        /// Whether the runtime stopped the body.
        cancelled: bool,
    },
    /// The lock was busy for the whole wait.
    Busy,
    /// Any other error (backend unreachable, store unreachable, …).
    Error {
        /// The error's text.
        message: String,
    },
    /// The caller gave up: its timeout fired and the future was dropped there
    /// (the guard's `Drop` or the cancel-safe release then frees the key). From
    /// here on the worker no longer believes it holds.
    GaveUp {
        /// Where the future was dropped.
        at: GaveUpAt,
    },
    /// A lock on the side backend (key `side:{key}`) is held from here on,
    /// across the main lock's attempt and body.
    SideAcquired {
        /// Its fencing token.
        token: Option<u64>,
        /// Its lease, in ms.
        lease_ms: u64,
    },
    /// The side lock was released; `lost` if its lease had been lost meanwhile
    /// (a stalled side backend).
    SideReleased {
        /// Whether the release answered `Lost`.
        lost: bool,
    },
    /// The side lock could not be taken or released (busy, stalled, error).
    SideFailed {
        /// The error's text.
        message: String,
    },
}

impl Step {
    /// An exclusive hold's entry (a plain lock, a writer, a transfer).
    pub(crate) fn acquired(token: Option<u64>) -> Step {
        Step::Acquired {
            token,
            slot: None,
            shared: false,
        }
    }
}

/// Where a caller gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum GaveUpAt {
    /// While `acquire()` was in flight.
    Acquire,
    /// While the body ran (between read and write, or before either).
    Body,
    /// While `guard.release()` was in flight.
    Release,
}

impl GaveUpAt {
    /// Every place, in order.
    pub(crate) const ALL: [GaveUpAt; 3] = [GaveUpAt::Acquire, GaveUpAt::Body, GaveUpAt::Release];

    /// Its name in histories and summaries.
    pub(crate) fn name(self) -> &'static str {
        match self {
            GaveUpAt::Acquire => "acquire",
            GaveUpAt::Body => "body",
            GaveUpAt::Release => "release",
        }
    }
}

/// An event dlock's runtime traced about a lease of a worker, captured by the
/// worker's [`TraceLayer`](crate::trace::TraceLayer).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TraceEvent {
    /// When, on the shared clock.
    pub(crate) t: u64,
    /// Worker slot.
    pub(crate) w: usize,
    /// Incarnation of the slot.
    pub(crate) inc: u32,
    /// What the runtime traced.
    pub(crate) event: TraceKind,
    /// The user key (no prefix).
    pub(crate) key: String,
    /// The fencing token, where the backend has one.
    pub(crate) token: Option<u64>,
    /// Which acquisition of this process (one `dlock.lock` span each): tells
    /// two leases of one key apart when there is no token (Redlock).
    pub(crate) lease: u64,
    /// The lease asked for, in ms, when the worker said so.
    #[serde(default)]
    pub(crate) lease_ms: Option<u64>,
    /// The registry's name of the backend (`default` or `side`).
    pub(crate) backend: String,
    /// Why, for a loss: the runtime's description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<String>,
    /// Why, for a loss: the reason's short name (`expired`, `gone`,
    /// `revoked`, `session_ended`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) loss_reason: Option<String>,
}

/// The runtime events the harness follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TraceKind {
    /// `dlock acquired` (DEBUG).
    Acquired,
    /// `dlock renewal sent`: a renewal batch with this lease is about to go out.
    RenewalSent,
    /// `dlock lease renewed`.
    Renewed,
    /// `dlock release requested` (by `release()`, `Drop`, the attribute, shutdown).
    ReleaseRequested,
    /// `dlock lease lost` (WARN).
    Lost,
}

impl TraceKind {
    /// The kind of the runtime's event with this message, if it is one we follow.
    pub(crate) fn from_message(message: &str) -> Option<TraceKind> {
        Some(match message {
            "dlock acquired" => TraceKind::Acquired,
            "dlock renewal sent" => TraceKind::RenewalSent,
            "dlock lease renewed" => TraceKind::Renewed,
            "dlock release requested" => TraceKind::ReleaseRequested,
            "dlock lease lost" => TraceKind::Lost,
            _ => return None,
        })
    }
}

/// A fault the nemesis injected or healed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FaultEvent {
    /// When, on the shared clock.
    pub(crate) t: u64,
    /// Number of the fault in the run; its start and heal share it.
    pub(crate) id: u32,
    /// Which fault (`sigstop`, `sigkill_worker`, `kill_server`, `proxy_delay`, …).
    pub(crate) fault: String,
    /// `start` or `heal`.
    pub(crate) phase: Phase,
    /// The worker slots it touches; empty = all of them (a server fault).
    pub(crate) workers: Vec<usize>,
    /// Free text: which node, how long, with or without persistence.
    pub(crate) detail: String,
}

/// A revocation the nemesis made through the admin API
/// (`Registry::revoke`), between its fault's start and heal.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RevocationEvent {
    /// When the nemesis called `revoke`, on the shared clock.
    pub(crate) t: u64,
    /// When `revoke` answered.
    pub(crate) answered: u64,
    /// Number of the fault in the run.
    pub(crate) id: u32,
    /// The store key (as the workers name it).
    pub(crate) key: String,
    /// The lock key revoked (as the workers lock it, without the registry's
    /// prefix; the runtime's events name it so).
    pub(crate) lock_key: String,
    /// Who held it, as `revoke` answered.
    pub(crate) holders: Vec<RevokedHolder>,
}

/// A holder's server connection the nemesis ended (`session_kill`: a
/// session-mode lock's connection terminated or killed by the server),
/// between its fault's start and heal.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SessionKillEvent {
    /// Just before the nemesis ended the connection, on the shared clock.
    pub(crate) t: u64,
    /// When the server answered that it had ended it.
    pub(crate) answered: u64,
    /// Number of the fault in the run.
    pub(crate) id: u32,
    /// The store key (as the workers name it).
    pub(crate) key: String,
    /// The lock key (as the workers lock it, without the registry's
    /// prefix; the runtime's events name it so).
    pub(crate) lock_key: String,
    /// The holder whose connection was ended, from the counter row of the
    /// lock it held (the key's own, or a permit's or reader's slot).
    pub(crate) holder: RevokedHolder,
}

/// One holder a revocation reported (or a `session_kill` ended).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RevokedHolder {
    /// The holder's process id, from its holder record.
    pub(crate) pid: Option<u32>,
    /// The worker slot running that process when it was revoked, if any.
    pub(crate) w: Option<usize>,
    /// The incarnation of that slot.
    pub(crate) inc: Option<u32>,
    /// The revoked grant's fencing token (none on Redlock).
    pub(crate) token: Option<u64>,
    /// A revoked permit's slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) slot: Option<u32>,
}

/// Start or end of a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Phase {
    /// The fault begins.
    Start,
    /// The fault is over (process continued, server back, proxy passing again).
    Heal,
}

/// One operation the fenced store decided, in the store's order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StoreOp {
    /// The store's sequence number.
    pub(crate) seq: u64,
    /// When, on the shared clock.
    pub(crate) t: u64,
    /// `read`, `write` or `shared` (a reader's read).
    pub(crate) op: OpKind,
    /// Store key (the lock's user key).
    pub(crate) key: String,
    /// Transfer workload: the number of the transfer (its read, or its
    /// write) this operation is one half of; both halves share it and were
    /// decided together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) transfer: Option<u64>,
    /// Token presented (fenced mode) or none (version mode).
    pub(crate) token: Option<u64>,
    /// Writes: the version the writer had read.
    pub(crate) base_version: Option<u64>,
    /// Writes: the value written.
    pub(crate) value: Option<u64>,
    /// Whether the store took it.
    pub(crate) accepted: bool,
    /// Worker slot.
    pub(crate) w: usize,
}

/// Kind of a store operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum OpKind {
    /// A (fenced) read.
    Read,
    /// A (fenced or version-checked) write.
    Write,
    /// A reader's fenced read (read-write workload): refused when a writer
    /// with a newer token had been there, and refusing, from then on,
    /// writers' reads and writes with an older token than its own; readers
    /// do not refuse each other.
    Shared,
}

/// Reads a JSON-lines file; a torn last line (a process killed mid-write) is skipped.
pub(crate) fn read_lines<T: for<'de> Deserialize<'de>>(path: &Path) -> anyhow::Result<Vec<T>> {
    let file = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(&line) {
            Ok(v) => out.push(v),
            Err(e) if e.is_eof() => {}
            Err(e) => anyhow::bail!("{}: bad line {line:?}: {e}", path.display()),
        }
    }
    Ok(out)
}
