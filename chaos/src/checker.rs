//! Reads a run's histories and says what happened and what went wrong.
//!
//! The checker does not trust the store's decisions: it replays the store's log
//! in order and recomputes, per key, the newest token seen and the current version,
//! so a store (or lock) that let a stale write through shows up here.
//!
//! From the runtime's own trace of each lease (see [`trace`](crate::trace)) it
//! also checks that no renewal went out after a release was asked for, that
//! every loss was signalled before the server's expiry (measured from the last
//! renewal the server answered, with each lease's own length — on ZooKeeper,
//! with the session timeout: see [`check_traces`]), that the main
//! backend went on renewing while the side backend was stalled, and that
//! every holder the nemesis revoked was told of its loss, for the right
//! reason, and the key's next grant got a larger token (see
//! [`check_revocations`]).
//!
//! **Semaphores and read-write locks** are judged on the same evidence as
//! "two holders at once": the operations the store took, in the store's
//! order, never the workers' clocks (a paused process cannot fool them). Each
//! hold (a worker's grant: key and token) spans, there, from its first
//! operation taken to its last. A permit's operations go to its slot's cell
//! (`{key}#{slot}`), fenced per (key, slot); a reader's are shared reads.
//! The checker then counts, per key, the most holds spanning one moment of
//! the store's order (at most the run's permits), holds of one cell
//! overlapping where one of them is exclusive (two holders of one (key,
//! slot), or a writer beside any other holder: none), and the holds that
//! overlapped as readers only (readers really shared). Tokens after a
//! revocation are compared per slot for permits (they grow per (key, slot)).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::history::{
    self, FaultEvent, OpKind, Phase, Record, RevocationEvent, SessionKillEvent, Step, StoreOp,
    TraceEvent, TraceKind, WorkerEvent,
};
use crate::nemesis::{SESSION_EXPIRY, SIDE_STALL, revocation_bound};
use crate::store::Mode;
use crate::worker::Workload;

/// How far a signal's effect may be from the moment the nemesis logged it: a
/// SIGSTOP lands a moment after `kill` returns, and a continued worker may write
/// before the nemesis' own record of the SIGCONT (runs before that was logged
/// first).
const SIGNAL_GRACE: u64 = 2_000_000;

/// How much later than the server's expiry (as bounded from the worker's side) a
/// loss may be recorded: the time between the runtime's event and the layer
/// reading the clock.
const EXPIRY_GRACE: u64 = 2_000_000;

/// The reason the runtime gives when shutdown ends the leases (not a fault).
const SHUTDOWN_REASON: &str = "the registry is shutting down";

/// The backends whose revoked holders are told `revoked` as the reason of
/// their loss, by the name a run's meta gives them (`--backend`, with
/// `-session` for the SQL session modes, or a `--url`'s scheme). On the
/// others a revoked holder must still be told of its loss, for any reason.
pub(crate) const TELLS_REVOKED: &[&str] = &[
    "memory",
    "sqlite",
    "postgres",
    "postgresql",
    "mysql",
    "mariadb",
    "redis",
    "rediss",
    "redis+cluster",
    "rediss+cluster",
    "redis+sentinel",
    "rediss+sentinel",
    "zk",
    "etcd",
    "redlock",
    "postgres-session",
    "postgresql-session",
    "mysql-session",
    "mariadb-session",
];

/// The backends whose holders can also be told `session_ended` (their
/// session or connection ended): a revoked holder there that could not learn
/// the revocation in time (its session's end found before the revocation's
/// mark could be read) is told so, or its loss may be the backend's own,
/// untraced signal.
const HAS_SESSIONS: &[&str] = &[
    "zk",
    "etcd",
    "postgres-session",
    "postgresql-session",
    "mysql-session",
    "mariadb-session",
];

/// Whether `reason`, told a revoked holder on `backend` (one of
/// [`TELLS_REVOKED`]), names another cause than the revocation. `expired`
/// is never one: a holder whose renewal got no answer in time (a stalled
/// machine, a concurrent fault) gives up on its own clock, truthfully.
fn misreports_revocation(backend: &str, reason: &str) -> bool {
    match reason {
        "revoked" | "expired" | "max_hold" | "hard_cap" | "shutdown" => false,
        "session_ended" | UNTRACED => !HAS_SESSIONS.contains(&backend),
        _ => true,
    }
}

/// How long before a revoked holder's release a renewal must have gone out
/// for its answer (the key revoked) to be due before the release: a
/// renewal still in flight when the holder lets go may go unsignalled.
const RENEWAL_ANSWER_GRACE: u64 = 1_000_000_000;

/// What the orchestrator measured at the end of a run, saved as `meta.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RunMeta {
    /// Backend name as given (`sqlite`, `redis`, `redlock`, or the URL's scheme).
    pub(crate) backend: String,
    /// Seed of the nemesis and the workers.
    pub(crate) seed: u64,
    /// Worker processes at a time.
    pub(crate) workers: usize,
    /// How the store decided.
    pub(crate) mode: Mode,
    /// The longest lease of the workers' locks, in ms: the lease of entries that
    /// do not record theirs (runs before mixed leases had one lease), and how long
    /// a fault's effects may outlast its heal.
    pub(crate) lease_ms: u64,
    /// The session timeout of the workers' ZooKeeper sessions, in ms (ZooKeeper
    /// runs only): how long the server keeps a session, and its nodes, after
    /// it last heard from the client.
    #[serde(default)]
    pub(crate) session_timeout_ms: Option<u64>,
    /// Lock keys (not fence counters) still on the server(s) once idle; `None`
    /// when the backend could not be inspected (a plain URL).
    pub(crate) keys_left: Option<usize>,
    /// The same on the side backend; `None` without one.
    #[serde(default)]
    pub(crate) side_keys_left: Option<usize>,
    /// Whether the workers recorded the runtime's lease events.
    #[serde(default)]
    pub(crate) traced: bool,
    /// Workers that did not stop within 20 s of being told to.
    pub(crate) hung_workers: usize,
    /// Whether the run reached its acquisitions and faults before `--max-duration`.
    pub(crate) finished: bool,
    /// What the workers did inside the lock.
    #[serde(default)]
    pub(crate) workload: Workload,
    /// What a key never written holds: each account's opening balance
    /// (transfer workload), 0 otherwise.
    #[serde(default)]
    pub(crate) initial_balance: u64,
    /// Accounts `acct:0` … of the transfer workload (0 otherwise).
    #[serde(default)]
    pub(crate) accounts: usize,
    /// Semaphore workload: the permits of every key.
    #[serde(default)]
    pub(crate) permits: Option<u32>,
    /// The store's final state: key → (value, version).
    pub(crate) dump: BTreeMap<String, (u64, u64)>,
}

/// min / p50 / p99 / max of a set of durations, in milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Spread {
    /// How many.
    pub(crate) n: usize,
    /// Smallest.
    pub(crate) min: f64,
    /// Median.
    pub(crate) p50: f64,
    /// 99th percentile.
    pub(crate) p99: f64,
    /// Largest.
    pub(crate) max: f64,
}

impl Spread {
    fn of(mut ms: Vec<f64>) -> Self {
        if ms.is_empty() {
            return Self::default();
        }
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| ms[((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
        Self {
            n: ms.len(),
            min: ms[0],
            p50: at(0.5),
            p99: at(0.99),
            max: ms[ms.len() - 1],
        }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.n == 0 {
            return f.write_str("none");
        }
        write!(
            f,
            "min {:.0} ms, p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms (n={})",
            self.min, self.p50, self.p99, self.max, self.n
        )
    }
}

/// The one summary of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Summary {
    /// Backend.
    pub(crate) backend: String,
    /// Seed.
    pub(crate) seed: u64,
    /// What the workers did inside the lock.
    pub(crate) workload: Workload,
    /// Wall time from the first to the last record, in seconds.
    pub(crate) seconds: f64,
    /// Entries into the lock.
    pub(crate) acquisitions: u64,
    /// Attempts that found the lock busy for the whole wait.
    pub(crate) busy: u64,
    /// Attempts that ended in another error (server down, …).
    pub(crate) errors: u64,
    /// Faults injected, by kind.
    pub(crate) faults: BTreeMap<String, u32>,
    /// Entries into the lock, by the lease (ms) they asked for.
    pub(crate) acquisitions_by_lease_ms: BTreeMap<u64, u64>,
    /// Callers that gave up, by where (`acquire`, `body`, `release`).
    pub(crate) gave_up: BTreeMap<String, u64>,
    /// Side locks taken (held across a main attempt and body).
    pub(crate) side_acquired: u64,
    /// Side locks whose release answered `Lost` (their backend was stalled).
    pub(crate) side_lost: u64,
    /// Side locks that could not be taken or released.
    pub(crate) side_failed: u64,
    /// Holders that still believed they held a key when another worker entered it.
    pub(crate) belief_overlaps: u64,
    /// Entries into a key while some earlier holder still believed it held it.
    pub(crate) overlapped_acquisitions: u64,
    /// Writes the store took.
    pub(crate) writes_accepted: u64,
    /// Stale reads and writes the store refused.
    pub(crate) stale_refused: u64,
    /// Writes the store took although a newer holder had been there. Must be 0.
    pub(crate) stale_writes_accepted: u64,
    /// Reads the store answered although a newer holder had been there. Must be 0.
    pub(crate) stale_reads_accepted: u64,
    /// Writes based on a version that was no longer current. Must be 0.
    pub(crate) lost_updates: u64,
    /// Stale writes accepted, by key (keys with none left out).
    pub(crate) stale_writes_by_key: BTreeMap<String, u64>,
    /// Lost updates, by key (keys with none left out).
    pub(crate) lost_updates_by_key: BTreeMap<String, u64>,
    /// Semaphore workload: the permits of every key.
    pub(crate) permits: Option<u32>,
    /// Semaphore workload: the most holds of one key spanning one moment of
    /// the store's order (at most `permits`).
    pub(crate) max_permit_holders: u64,
    /// Semaphore workload: entries whose permit's slot was not below
    /// `permits`, or that had none (must be 0).
    pub(crate) permit_slots_out_of_range: u64,
    /// Holds of one cell (a key, or a permit's slot) that overlapped in the
    /// store's order, both exclusive: two holders at once (must be 0).
    pub(crate) holders_at_once: u64,
    /// Read-write workload: reader holds a writer's hold overlapped in the
    /// store's order (must be 0).
    pub(crate) readers_beside_writers: u64,
    /// Read-write workload: readers' shared reads the store took.
    pub(crate) shared_reads_taken: u64,
    /// Read-write workload: the most reader holds of one key spanning one
    /// moment of the store's order (readers shared the key when above 1).
    pub(crate) max_readers_at_once: u64,
    /// Transfer workload: transfers whose two writes the store took.
    pub(crate) transfers_taken: u64,
    /// Transfer workload: transfers the store refused as a whole (a stale
    /// token or version at one of the accounts): a correct outcome.
    pub(crate) transfers_refused: u64,
    /// Transfer workload: transfers of which one write was taken and the
    /// other refused. Must be 0.
    pub(crate) half_applied_transfers: u64,
    /// Transfer workload: the sum of the opening balances.
    pub(crate) total_initial: Option<u64>,
    /// Transfer workload: the sum of the balances read back from the store
    /// at the end. Must equal `total_initial`.
    pub(crate) total_final: Option<u64>,
    /// Lost-lease signals the workers got (body stopped, or noticed at its end).
    pub(crate) lost_signals: u64,
    /// Time from the fault (or the paused worker's resumption) to the signal.
    pub(crate) lost_latency: Spread,
    /// Signals later than one lease after their fault.
    pub(crate) lost_late: u64,
    /// Signals with no fault touching that worker before them.
    pub(crate) lost_unattributed: u64,
    /// Time from each fault's heal to the next entry into the lock.
    pub(crate) handoff_after_heal: Spread,
    /// Pauses during which the paused worker still recorded something (must be 0).
    pub(crate) pause_breaches: u64,
    /// Renewals the runtime sent (`dlock renewal sent`).
    pub(crate) renewals_sent: u64,
    /// Releases the runtime was asked for (`dlock release requested`).
    pub(crate) releases_requested: u64,
    /// Renewals sent for a lease after its release was requested (must be 0).
    pub(crate) renewals_after_release: u64,
    /// Losses the runtime signalled (`dlock lease lost`, shutdown aside).
    pub(crate) losses_traced: u64,
    /// How long before the server's expiry at the latest each loss of a running
    /// worker was signalled: the last answered renewal (or the acquisition) plus
    /// the lease, minus the signal.
    pub(crate) loss_margin: Spread,
    /// Losses signalled after that bound, by a worker that was not paused (must be 0).
    pub(crate) losses_after_expiry: u64,
    /// Main-backend renewals answered while the side backend was stalled.
    pub(crate) side_stall_main_renewals: u64,
    /// Side-backend leases lost while it was stalled (expected).
    pub(crate) side_stall_side_losses: u64,
    /// Main-backend leases lost during a side stall with no main fault to
    /// explain it (must be 0).
    pub(crate) main_lost_in_side_stall: u64,
    /// Losses the runtime signalled (shutdown aside), by the reason it gave
    /// (`unknown` where the trace has none).
    pub(crate) losses_by_reason: BTreeMap<String, u64>,
    /// Revocations the nemesis made through the admin API.
    pub(crate) revocations: u64,
    /// Holders those revocations reported.
    pub(crate) holders_revoked: u64,
    /// Revoked holders whose runtime signalled the loss within
    /// [`revocation_bound`] of the revocation.
    pub(crate) revoked_signalled: u64,
    /// Revoked holders whose hold had ended before they could be told: lost
    /// or released before the revocation, released before a renewal went
    /// out after it, or their process gone.
    pub(crate) revoked_ended_first: u64,
    /// Revoked holders still holding that were not told within the bound
    /// (must be 0).
    pub(crate) revoked_unsignalled: u64,
    /// The reasons the signalled revoked holders were given (`untraced`:
    /// the worker saw the signal, the runtime traced no loss).
    pub(crate) revoked_loss_reasons: BTreeMap<String, u64>,
    /// Revoked holders told another reason than `revoked` on a backend of
    /// [`TELLS_REVOKED`] (must be 0).
    pub(crate) revoked_misreported: u64,
    /// Losses reported as `revoked` of leases no revocation took (must be 0).
    pub(crate) revoked_unexplained: u64,
    /// Writes revoked holders sent after the revocation that the store
    /// refused (a newer holder had been there).
    pub(crate) revoked_writes_refused: u64,
    /// Writes revoked holders sent after the revocation that the store
    /// took: before any newer holder had read (the stale-write check
    /// counts any other).
    pub(crate) revoked_writes_taken: u64,
    /// Time from each revocation's answer to its holder's loss signal.
    pub(crate) revoke_signal_latency: Spread,
    /// Revoked keys granted again with a token, whose token was compared.
    pub(crate) tokens_after_revoke: u64,
    /// Of those, grants whose token was not larger than every revoked one
    /// (must be 0).
    pub(crate) tokens_not_above_revoked: u64,
    /// Holders whose connection a `session_kill` ended.
    pub(crate) session_killed_holders: u64,
    /// Of those, holders of a permit's or a reader's slot.
    pub(crate) session_killed_slot_holders: u64,
    /// Killed holders whose runtime signalled the loss within
    /// [`revocation_bound`] of the kill.
    pub(crate) session_killed_signalled: u64,
    /// Killed holders whose hold had ended before they could be told (as
    /// for revoked holders).
    pub(crate) session_killed_ended_first: u64,
    /// Killed holders still holding that were not told within the bound
    /// (must be 0).
    pub(crate) session_killed_unsignalled: u64,
    /// Time from each kill to its holder's loss signal.
    pub(crate) session_kill_signal_latency: Spread,
    /// Lock keys left on the server once idle (must be 0).
    pub(crate) keys_left: Option<usize>,
    /// Lock keys left on the side backend once idle (must be 0).
    pub(crate) side_keys_left: Option<usize>,
    /// What must not have happened, and did.
    pub(crate) violations: Vec<String>,
}

/// Reads `dir` (history.jsonl, store.jsonl, meta.json) and checks it.
pub(crate) fn check_dir(dir: &Path) -> anyhow::Result<Summary> {
    let records: Vec<Record> = history::read_lines(&dir.join("history.jsonl"))?;
    let ops: Vec<StoreOp> = history::read_lines(&dir.join("store.jsonl"))?;
    let meta: RunMeta = serde_json::from_slice(&std::fs::read(dir.join("meta.json"))?)?;
    Ok(check(&records, &ops, &meta))
}

/// The checks themselves.
pub(crate) fn check(records: &[Record], ops: &[StoreOp], meta: &RunMeta) -> Summary {
    let default_lease = Duration::from_millis(meta.lease_ms);
    let mut s = Summary {
        backend: meta.backend.clone(),
        seed: meta.seed,
        workload: meta.workload,
        keys_left: meta.keys_left,
        side_keys_left: meta.side_keys_left,
        permits: meta.permits,
        ..Summary::default()
    };
    let mut events: Vec<&WorkerEvent> = Vec::new();
    let mut faults: Vec<&FaultEvent> = Vec::new();
    let mut traces: Vec<&TraceEvent> = Vec::new();
    let mut revocations: Vec<&RevocationEvent> = Vec::new();
    let mut kills: Vec<&SessionKillEvent> = Vec::new();
    for r in records {
        match r {
            Record::Worker(e) => events.push(e),
            Record::Fault(f) => faults.push(f),
            Record::Trace(e) => traces.push(e),
            Record::Revocation(r) => revocations.push(r),
            Record::SessionKill(k) => kills.push(k),
        }
    }
    kills.sort_by_key(|k| k.t);
    revocations.sort_by_key(|r| r.t);
    events.sort_by_key(|e| e.t);
    faults.sort_by_key(|f| f.t);
    traces.sort_by_key(|e| e.t);
    let (first, last) = records
        .iter()
        .map(|r| match r {
            Record::Worker(e) => e.t,
            Record::Fault(f) => f.t,
            Record::Trace(e) => e.t,
            Record::Revocation(r) => r.t,
            Record::SessionKill(k) => k.t,
        })
        .fold((u64::MAX, 0), |(lo, hi), t| (lo.min(t), hi.max(t)));
    s.seconds = last.saturating_sub(first) as f64 / 1e9;
    for f in faults.iter().filter(|f| f.phase == Phase::Start) {
        *s.faults.entry(f.fault.clone()).or_default() += 1;
    }

    // Counts, belief intervals and lost signals, from the workers' own records.
    // A hold's keys (a permit's: its slot's cell), when it began, and
    // whether it was a reader's.
    let mut open: HashMap<(usize, u32), (Vec<String>, u64, bool)> = HashMap::new();
    let mut intervals: Vec<Belief> = Vec::new();
    let mut latencies = Vec::new();
    let mut acked_writes = 0u64;
    // Each worker's lease for its current attempt.
    let mut lease_of: HashMap<(usize, u32), Duration> = HashMap::new();
    for e in &events {
        let who = (e.w, e.inc);
        let lease = lease_of.get(&who).copied().unwrap_or(default_lease);
        match &e.ev {
            Step::Attempt { lease_ms, .. } => {
                lease_of.insert(who, lease_ms.map_or(default_lease, Duration::from_millis));
            }
            Step::Acquired { slot, shared, .. } => {
                s.acquisitions += 1;
                *s.acquisitions_by_lease_ms
                    .entry(lease.as_millis() as u64)
                    .or_default() += 1;
                let keys = match (meta.permits, slot) {
                    (Some(permits), Some(slot)) if *slot < permits => {
                        vec![format!("{}#{slot}", e.key)]
                    }
                    (Some(_), _) => {
                        s.permit_slots_out_of_range += 1;
                        e.all_keys()
                    }
                    (None, _) => e.all_keys(),
                };
                open.insert(who, (keys, e.t, *shared));
            }
            Step::Busy => s.busy += 1,
            Step::Error { .. } => s.errors += 1,
            Step::Wrote { accepted: true } => acked_writes += 1,
            Step::Lost { .. } => {
                s.lost_signals += 1;
                match lost_reference(&faults, e) {
                    Some(reference) => {
                        let ms = e.t.saturating_sub(reference) as f64 / 1e6;
                        if ms > lease.as_secs_f64() * 1e3 {
                            s.lost_late += 1;
                        }
                        latencies.push(ms);
                    }
                    None => s.lost_unattributed += 1,
                }
            }
            Step::GaveUp { at } => *s.gave_up.entry(at.name().to_owned()).or_default() += 1,
            Step::SideAcquired { .. } => s.side_acquired += 1,
            Step::SideReleased { lost } => s.side_lost += u64::from(*lost),
            Step::SideFailed { .. } => s.side_failed += 1,
            _ => {}
        }
        if matches!(
            e.ev,
            Step::Leaving | Step::Lost { .. } | Step::Error { .. } | Step::GaveUp { .. }
        ) && let Some((keys, start, shared)) = open.remove(&who)
        {
            // One interval per key: a hold of several keys overlaps any
            // holder of any of them.
            for key in keys {
                intervals.push((key, start, e.t, who, shared));
            }
        }
    }
    // A worker killed inside the lock believed it held until the kill.
    for (who, (keys, start, shared)) in open {
        let end = faults
            .iter()
            .find(|f| f.t >= start && f.fault == "sigkill_worker" && f.workers.contains(&who.0))
            .map_or(last, |f| f.t);
        for key in keys {
            intervals.push((key, start, end, who, shared));
        }
    }
    intervals.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    for (i, a) in intervals.iter().enumerate() {
        // Readers beside readers share the key as they should.
        let overlapped = intervals[i + 1..]
            .iter()
            .take_while(|b| b.0 == a.0 && b.1 < a.2)
            .filter(|b| b.3 != a.3 && !(a.4 && b.4))
            .count() as u64;
        if overlapped > 0 {
            s.belief_overlaps += 1;
            s.overlapped_acquisitions += overlapped;
        }
    }
    s.lost_latency = Spread::of(latencies);

    // A paused worker must be silent until it is continued; if not, the fault did
    // not happen as logged and the figures above would lie.
    for start in faults
        .iter()
        .filter(|f| f.fault == "sigstop" && f.phase == Phase::Start)
    {
        let Some(heal) = faults
            .iter()
            .find(|f| f.id == start.id && f.phase == Phase::Heal)
        else {
            continue;
        };
        let (from, to) = (start.t + SIGNAL_GRACE, heal.t.saturating_sub(SIGNAL_GRACE));
        let ran = |w: usize, t: u64| start.workers.contains(&w) && t > from && t < to;
        if events.iter().any(|e| ran(e.w, e.t)) || traces.iter().any(|e| ran(e.w, e.t)) {
            s.pause_breaches += 1;
        }
    }

    check_traces(&mut s, &traces, &faults, meta);
    check_revocations(&mut s, &revocations, &traces, &events, &faults, meta);
    check_session_kills(&mut s, &kills, &traces, &events, &faults, meta);

    // Time from each heal to the next entry into the lock.
    let acquired: Vec<u64> = events
        .iter()
        .filter(|e| matches!(e.ev, Step::Acquired { .. }))
        .map(|e| e.t)
        .collect();
    let handoffs = faults
        .iter()
        .filter(|f| f.phase == Phase::Heal)
        .filter_map(|f| {
            let i = acquired.partition_point(|&t| t < f.t);
            acquired.get(i).map(|&t| (t - f.t) as f64 / 1e6)
        })
        .collect();
    s.handoff_after_heal = Spread::of(handoffs);

    // Replay the store's log. The two halves of a transfer (consecutive
    // entries sharing a transfer number) were decided together: each is
    // judged against the state before both, and a refusal is right when
    // either half was stale.
    let mut ops: Vec<&StoreOp> = ops.iter().collect();
    ops.sort_by_key(|o| o.seq);
    struct Cell {
        value: u64,
        version: u64,
        /// The newest token of a taken read or write (a writer's).
        newest: u64,
        /// The newest token of a taken shared read (a reader's).
        readers: u64,
    }
    let fresh = || Cell {
        value: meta.initial_balance,
        version: 0,
        newest: 0,
        readers: 0,
    };
    let accounts = crate::store::account_keys(meta.accounts);
    let mut cells: BTreeMap<&str, Cell> = accounts.iter().map(|k| (k.as_str(), fresh())).collect();
    let mut wrong_refusals = 0u64;
    let mut i = 0;
    while i < ops.len() {
        let n = match ops[i].transfer {
            Some(t) => ops[i..]
                .iter()
                .take_while(|o| o.transfer == Some(t))
                .count(),
            None => 1,
        };
        let group = &ops[i..i + n];
        i += n;
        let stale: Vec<bool> = group
            .iter()
            .map(|op| {
                let cell = cells.get(op.key.as_str());
                let (newest, readers, version) =
                    cell.map_or((0, 0, 0), |c| (c.newest, c.readers, c.version));
                match (meta.mode, op.op, op.token) {
                    // A reader is stale behind a newer writer only.
                    (Mode::Fence, OpKind::Shared, Some(t)) => t < newest,
                    (Mode::Fence, _, Some(t)) => t < newest.max(readers),
                    (Mode::Version, OpKind::Write, _) => op.base_version != Some(version),
                    _ => false,
                }
            })
            .collect();
        let any_stale = stale.iter().any(|&x| x);
        for (op, &stale) in group.iter().zip(&stale) {
            let cell = cells.entry(op.key.as_str()).or_insert_with(fresh);
            match (op.op, op.accepted) {
                (OpKind::Read, true) => {
                    s.stale_reads_accepted += u64::from(stale);
                    cell.newest = cell.newest.max(op.token.unwrap_or(0));
                }
                (OpKind::Shared, true) => {
                    s.stale_reads_accepted += u64::from(stale);
                    s.shared_reads_taken += 1;
                    cell.readers = cell.readers.max(op.token.unwrap_or(0));
                }
                (OpKind::Write, true) => {
                    s.writes_accepted += 1;
                    if stale {
                        s.stale_writes_accepted += 1;
                        *s.stale_writes_by_key.entry(op.key.clone()).or_default() += 1;
                    }
                    if op.base_version != Some(cell.version) {
                        s.lost_updates += 1;
                        *s.lost_updates_by_key.entry(op.key.clone()).or_default() += 1;
                    }
                    cell.newest = cell.newest.max(op.token.unwrap_or(0));
                    cell.version += 1;
                    cell.value = op.value.unwrap_or(0);
                }
                (_, false) => {
                    s.stale_refused += 1;
                    wrong_refusals += u64::from(!any_stale);
                }
            }
        }
        if group.len() > 1 && group[0].op == OpKind::Write {
            match group.iter().filter(|op| op.accepted).count() {
                0 => s.transfers_refused += 1,
                taken if taken == group.len() => s.transfers_taken += 1,
                _ => s.half_applied_transfers += 1,
            }
        }
    }
    if meta.mode == Mode::Fence {
        check_holds(&mut s, &ops, meta);
    }
    if meta.workload == Workload::Transfer {
        s.total_initial = Some(meta.initial_balance * meta.accounts as u64);
        s.total_final = Some(meta.dump.values().map(|(value, _)| value).sum());
    }

    let v = &mut s.violations;
    if s.stale_writes_accepted > 0 {
        v.push(format!("{} stale writes accepted", s.stale_writes_accepted));
    }
    if s.stale_reads_accepted > 0 {
        v.push(format!("{} stale reads answered", s.stale_reads_accepted));
    }
    if s.lost_updates > 0 {
        v.push(format!("{} lost updates", s.lost_updates));
    }
    if let Some(permits) = meta.permits
        && s.max_permit_holders > u64::from(permits)
    {
        v.push(format!(
            "{} holders of one semaphore at once, of {permits} permits",
            s.max_permit_holders
        ));
    }
    if s.permit_slots_out_of_range > 0 {
        v.push(format!(
            "{} permits granted without a slot below the permits",
            s.permit_slots_out_of_range
        ));
    }
    if s.holders_at_once > 0 {
        v.push(format!(
            "{} holds overlapped another exclusive hold of their key or slot",
            s.holders_at_once
        ));
    }
    if s.readers_beside_writers > 0 {
        v.push(format!(
            "{} reader holds overlapped a writer's",
            s.readers_beside_writers
        ));
    }
    if s.half_applied_transfers > 0 {
        v.push(format!(
            "{} transfers half-applied (one write taken, the other refused)",
            s.half_applied_transfers
        ));
    }
    if s.total_final != s.total_initial {
        v.push(format!(
            "the total is not conserved: {:?} at the end, {:?} at the start",
            s.total_final, s.total_initial
        ));
    }
    if meta.workload == Workload::Transfer && meta.dump.len() != meta.accounts {
        v.push(format!(
            "the store holds {} keys, the run has {} accounts",
            meta.dump.len(),
            meta.accounts
        ));
    }
    if wrong_refusals > 0 {
        v.push(format!(
            "the store refused {wrong_refusals} current operations"
        ));
    }
    let replayed: BTreeMap<String, (u64, u64)> = cells
        .iter()
        .map(|(k, c)| ((*k).to_owned(), (c.value, c.version)))
        .collect();
    if replayed != meta.dump {
        v.push(format!(
            "the store's state {:?} is not its log replayed {replayed:?}",
            meta.dump
        ));
    }
    if acked_writes > s.writes_accepted {
        v.push(format!(
            "workers saw {acked_writes} writes taken, the store's log has {}",
            s.writes_accepted
        ));
    }
    if let Some(left) = meta.keys_left.filter(|&n| n > 0) {
        v.push(format!("{left} lock keys left on the server once idle"));
    }
    if let Some(left) = meta.side_keys_left.filter(|&n| n > 0) {
        v.push(format!(
            "{left} lock keys left on the side backend once idle"
        ));
    }
    if s.renewals_after_release > 0 {
        v.push(format!(
            "{} renewals sent after their lease's release was requested",
            s.renewals_after_release
        ));
    }
    if s.losses_after_expiry > 0 {
        v.push(format!(
            "{} losses signalled after the server's expiry",
            s.losses_after_expiry
        ));
    }
    if s.main_lost_in_side_stall > 0 {
        v.push(format!(
            "{} main-backend leases lost while only the side backend was stalled",
            s.main_lost_in_side_stall
        ));
    }
    if s.revoked_unsignalled > 0 {
        v.push(format!(
            "{} revoked holders were not told of their loss within their lease, a renewal period and 2 s of the revocation",
            s.revoked_unsignalled
        ));
    }
    if s.session_killed_unsignalled > 0 {
        v.push(format!(
            "{} holders whose connection was ended were not told of their loss within their lease, a renewal period and 2 s of the kill",
            s.session_killed_unsignalled
        ));
    }
    if s.revoked_misreported > 0 {
        v.push(format!(
            "{} revoked holders were told another reason than `revoked` ({:?})",
            s.revoked_misreported, s.revoked_loss_reasons
        ));
    }
    if s.revoked_unexplained > 0 {
        v.push(format!(
            "{} losses reported as `revoked` with no revocation of that holder",
            s.revoked_unexplained
        ));
    }
    if s.tokens_not_above_revoked > 0 {
        v.push(format!(
            "{} grants after a revocation had a token not larger than every revoked one",
            s.tokens_not_above_revoked
        ));
    }
    if meta.traced && s.acquisitions > 0 && s.releases_requested == 0 {
        v.push("the workers recorded none of the runtime's lease events".to_owned());
    }
    if s.pause_breaches > 0 {
        v.push(format!(
            "{} paused workers ran during their pause",
            s.pause_breaches
        ));
    }
    if meta.hung_workers > 0 {
        v.push(format!(
            "{} workers did not stop when told to",
            meta.hung_workers
        ));
    }
    if !meta.finished {
        v.push(
            "the run did not reach its acquisitions and faults within --max-duration".to_owned(),
        );
    }
    if s.acquisitions == 0 {
        v.push("no acquisitions at all".to_owned());
    }
    s
}

/// The holds as the store's order shows them (see the [module docs](self)):
/// per cell, each grant's span from its first taken operation to its last.
fn check_holds(s: &mut Summary, ops: &[&StoreOp], meta: &RunMeta) {
    /// A grant's span in the store's order.
    struct Hold {
        first: u64,
        last: u64,
        shared: bool,
    }
    // (cell, worker, token) → its span. A transfer's operations are holds
    // of each account like any other.
    let mut holds: BTreeMap<(&str, usize, u64), Hold> = BTreeMap::new();
    for op in ops.iter().filter(|op| op.accepted) {
        let Some(token) = op.token else { continue };
        let hold = holds.entry((op.key.as_str(), op.w, token)).or_insert(Hold {
            first: op.seq,
            last: op.seq,
            shared: op.op == OpKind::Shared,
        });
        hold.last = op.seq;
    }
    // Per cell: exclusive holds overlapping any other hold.
    let mut by_cell: BTreeMap<&str, Vec<&Hold>> = BTreeMap::new();
    for ((cell, ..), hold) in &holds {
        by_cell.entry(cell).or_default().push(hold);
    }
    for spans in by_cell.values_mut() {
        spans.sort_by_key(|h| h.first);
        for (i, a) in spans.iter().enumerate() {
            for b in spans[i + 1..].iter().take_while(|b| b.first <= a.last) {
                match (a.shared, b.shared) {
                    (true, true) => {}
                    (false, false) => s.holders_at_once += 1,
                    _ => s.readers_beside_writers += 1,
                }
            }
        }
        s.max_readers_at_once = s
            .max_readers_at_once
            .max(most_at_once(spans.iter().copied().filter(|h| h.shared)));
    }
    // Per semaphore key: the holds of all its slots at once.
    if meta.permits.is_some() {
        let mut by_key: BTreeMap<&str, Vec<&Hold>> = BTreeMap::new();
        for ((cell, ..), hold) in &holds {
            let key = cell.rsplit_once('#').map_or(*cell, |(key, _)| key);
            by_key.entry(key).or_default().push(hold);
        }
        for spans in by_key.values() {
            s.max_permit_holders = s
                .max_permit_holders
                .max(most_at_once(spans.iter().copied()));
        }
    }

    /// The most spans covering one point.
    fn most_at_once<'a>(spans: impl Iterator<Item = &'a Hold>) -> u64 {
        // +1 at the first operation, -1 just after the last.
        let mut edges: Vec<(u64, i64)> = Vec::new();
        for h in spans {
            edges.push((h.first, 1));
            edges.push((h.last + 1, -1));
        }
        // At one point, an end (after a last operation) before a start.
        edges.sort_unstable();
        let (mut now, mut most) = (0i64, 0i64);
        for (_, d) in edges {
            now += d;
            most = most.max(now);
        }
        most as u64
    }
}

/// A hold as its worker believed it: the key (a permit's: its slot's
/// cell), from, to, the worker process, and whether it was a reader's.
type Belief = (String, u64, u64, (usize, u32), bool);

/// The checks on the runtime's own events (see the [module docs](self)).
/// Checks the runtime's traces of every lease: no renewal after a release was
/// asked for, every loss signalled before the server's expiry, the main
/// backend renewing through the side backend's stalls.
///
/// **When the server expires a lease.** On Redis and SQLite a key expires a
/// lease after the server last renewed it: at the latest answered acquisition
/// or renewal plus the lease's length. On ZooKeeper a node cannot expire by
/// itself: it goes with its session, which the server expires no sooner than
/// the session timeout after it last heard from the client (or the holder's own
/// backend deletes it when the lease ran out unrenewed — a loss it signals at
/// that moment). So on ZooKeeper (`session_timeout_ms` in the run's meta) the
/// expiry is the session timeout after the send of the latest renewal the server
/// answered (the server heard it after it was sent), or after the acquisition
/// when none was. Losses of a worker that was stopped (SIGSTOP), or whose
/// session the nemesis closed (`session_expiry`: the server ended the session
/// at once, not at a timeout), between that contact and the loss are not
/// measured.
fn check_traces(s: &mut Summary, traces: &[&TraceEvent], faults: &[&FaultEvent], meta: &RunMeta) {
    let ms = |ms: u64| ms * 1_000_000;
    let default_lease = ms(meta.lease_ms);
    // One lease = one `dlock.lock` span of one process.
    let mut leases: BTreeMap<(usize, u32, u64), Vec<&TraceEvent>> = BTreeMap::new();
    for e in traces {
        leases.entry((e.w, e.inc, e.lease)).or_default().push(e);
        match e.event {
            TraceKind::RenewalSent => s.renewals_sent += 1,
            TraceKind::ReleaseRequested => s.releases_requested += 1,
            _ => {}
        }
    }
    // Was worker `w` stopped (SIGSTOP), or its session closed, at some time in
    // `from..=to`?
    let paused = |w: usize, from: u64, to: u64| {
        faults
            .iter()
            .filter(|f| {
                (f.fault == "sigstop" || f.fault == SESSION_EXPIRY)
                    && f.phase == Phase::Start
                    && f.workers.contains(&w)
            })
            .any(|start| {
                let heal = faults
                    .iter()
                    .find(|f| f.id == start.id && f.phase == Phase::Heal)
                    .map_or(u64::MAX, |f| f.t);
                start.t <= to && heal + SIGNAL_GRACE >= from
            })
    };
    let mut margins = Vec::new();
    let mut main_losses = Vec::new();
    for events in leases.values() {
        let released = events
            .iter()
            .find(|e| e.event == TraceKind::ReleaseRequested)
            .map(|e| e.t);
        if let Some(released) = released {
            s.renewals_after_release += events
                .iter()
                .filter(|e| e.event == TraceKind::RenewalSent && e.t > released)
                .count() as u64;
        }
        let Some(lost) = events
            .iter()
            .find(|e| e.event == TraceKind::Lost && e.reason.as_deref() != Some(SHUTDOWN_REASON))
        else {
            continue;
        };
        s.losses_traced += 1;
        *s.losses_by_reason
            .entry(
                lost.loss_reason
                    .clone()
                    .unwrap_or_else(|| "unknown".to_owned()),
            )
            .or_default() += 1;
        if lost.backend != crate::worker::SIDE {
            main_losses.push(*lost);
        }
        // The server's expiry is at most a lease after it answered last (the
        // acquisition or a renewal): a loss signalled later came too late.
        let Some(answered) = events
            .iter()
            .filter(|e| {
                matches!(e.event, TraceKind::Acquired | TraceKind::Renewed) && e.t <= lost.t
            })
            .map(|e| e.t)
            .max()
        else {
            continue;
        };
        if paused(lost.w, answered, lost.t) {
            continue;
        }
        let expiry = match meta.session_timeout_ms {
            // ZooKeeper: from the send of the renewal answered last (the
            // latest one sent before that answer), or from the acquisition.
            Some(session_timeout) => {
                let heard = events
                    .iter()
                    .filter(|e| e.event == TraceKind::RenewalSent && e.t <= answered)
                    .map(|e| e.t)
                    .max()
                    .filter(|_| {
                        events
                            .iter()
                            .any(|e| e.event == TraceKind::Renewed && e.t == answered)
                    })
                    .unwrap_or(answered);
                heard + ms(session_timeout)
            }
            None => answered + lost.lease_ms.map_or(default_lease, ms),
        };
        margins.push((expiry as f64 - lost.t as f64) / 1e6);
        if lost.t > expiry + EXPIRY_GRACE {
            s.losses_after_expiry += 1;
        }
    }
    s.loss_margin = Spread::of(margins);

    // The side backend's stalls, and what the main backend did meanwhile.
    let stalls: Vec<(u64, u64)> = faults
        .iter()
        .filter(|f| f.fault == SIDE_STALL && f.phase == Phase::Start)
        .map(|start| {
            let heal = faults
                .iter()
                .find(|f| f.id == start.id && f.phase == Phase::Heal)
                .map_or(u64::MAX, |f| f.t);
            (start.t, heal)
        })
        .collect();
    let in_stall = |t: u64, after: u64| {
        stalls
            .iter()
            .any(|&(from, to)| t >= from && t <= to.saturating_add(after))
    };
    s.side_stall_main_renewals = traces
        .iter()
        .filter(|e| e.event == TraceKind::Renewed && e.backend != crate::worker::SIDE)
        .filter(|e| in_stall(e.t, 0))
        .count() as u64;
    s.side_stall_side_losses = traces
        .iter()
        .filter(|e| e.event == TraceKind::Lost && e.backend == crate::worker::SIDE)
        .filter(|e| in_stall(e.t, 0))
        .count() as u64;
    // A main lease lost during a stall, or within its own lease after (a renewal
    // the stall held up would give up by then), is a violation unless another
    // fault touching that worker (or every worker) was active, or had healed
    // less than the longest lease before.
    for lost in main_losses {
        let lease = lost.lease_ms.map_or(default_lease, ms);
        if !in_stall(lost.t, lease) {
            continue;
        }
        // A fault touches the workers its start names, and those its heal
        // names (a revocation's heal: every holder it took, as a
        // semaphore's or a read lock's several holders).
        let excused = faults
            .iter()
            .filter(|f| f.fault != SIDE_STALL && f.phase == Phase::Start)
            .any(|start| {
                let heal = faults
                    .iter()
                    .find(|f| f.id == start.id && f.phase == Phase::Heal);
                let touched = start.workers.is_empty()
                    || start.workers.contains(&lost.w)
                    || heal.is_some_and(|h| h.workers.contains(&lost.w));
                let heal = heal.map_or(u64::MAX, |f| f.t);
                touched && start.t <= lost.t && lost.t <= heal.saturating_add(default_lease)
            });
        if !excused {
            s.main_lost_in_side_stall += 1;
        }
    }
}

/// A lease a revoked holder may be: when it was acquired, its id
/// (worker slot, incarnation, lease number) and its trace events.
type LeaseCandidate<'a> = (u64, (usize, u32, u64), &'a Vec<&'a TraceEvent>);

/// Checks every revocation the nemesis made: each holder it reported was
/// told of its loss within [`revocation_bound`] of its lease after
/// `revoke` answered (the bound restarts when a pause of that worker
/// ends), unless its hold had ended first (see
/// [`Summary::revoked_ended_first`]); on a backend of [`TELLS_REVOKED`],
/// with the reason `revoked`. No lease is told `revoked` unless a
/// revocation took it, and the first grant of a revoked key after the
/// revocation carries a token larger than every revoked one.
///
/// A holder is matched to its lease by the runtime's trace: the latest
/// `dlock.lock` span of that worker process on that key (main backend)
/// acquired before `revoke` answered, with the revoked token where the
/// backend has one; without such a span, where the backend has a token,
/// the first span with that token acquired after the revocation began (a
/// grant `revoke` took while the grant's answer was on its way).
fn check_revocations(
    s: &mut Summary,
    revocations: &[&RevocationEvent],
    traces: &[&TraceEvent],
    steps: &[&WorkerEvent],
    faults: &[&FaultEvent],
    meta: &RunMeta,
) {
    let default_lease = Duration::from_millis(meta.lease_ms);
    let tells = TELLS_REVOKED.contains(&meta.backend.as_str());
    let mut leases: BTreeMap<(usize, u32, u64), Vec<&TraceEvent>> = BTreeMap::new();
    for e in traces.iter().filter(|e| e.backend != crate::worker::SIDE) {
        leases.entry((e.w, e.inc, e.lease)).or_default().push(e);
    }
    let spans = |kind: &str, w: usize| fault_spans(faults, kind, w);
    let mut matched: HashSet<(usize, u32, u64)> = HashSet::new();
    let mut latencies = Vec::new();
    for r in revocations {
        s.revocations += 1;
        // Permits' highest revoked token per slot.
        let mut revoked_slots: BTreeMap<u32, u64> = BTreeMap::new();
        s.holders_revoked += r.holders.len() as u64;
        let mut revoked_tokens: Vec<u64> = Vec::new();
        for h in &r.holders {
            revoked_tokens.extend(h.token);
            if let (Some(slot), Some(token)) = (h.slot, h.token) {
                let highest = revoked_slots.entry(slot).or_default();
                *highest = (*highest).max(token);
            }
            // Its lease: that worker process's (or, without one, any
            // process's lease with that token) latest on the key.
            let process = h.w.zip(h.inc);
            let candidates: Vec<LeaseCandidate<'_>> = leases
                .iter()
                .filter(|((lw, linc, _), _)| process.is_none_or(|p| p == (*lw, *linc)))
                .filter_map(|(id, events)| {
                    let acquired = events
                        .iter()
                        .find(|e| e.event == TraceKind::Acquired && e.key == r.lock_key)?;
                    let same = match (process, h.token) {
                        (_, Some(token)) => acquired.token == Some(token),
                        (Some(_), None) => true,
                        (None, None) => false,
                    };
                    same.then_some((acquired.t, *id, events))
                })
                .collect();
            // A grant `revoke` took while its answer was on its way traces
            // its acquisition after `revoke` answered: with the revoked
            // token, the first such grant after the revocation began.
            let lease = candidates
                .iter()
                .filter(|(t, ..)| *t <= r.answered)
                .max_by_key(|(t, ..)| *t)
                .or_else(|| {
                    candidates
                        .iter()
                        .filter(|(t, ..)| h.token.is_some() && *t >= r.t)
                        .min_by_key(|(t, ..)| *t)
                })
                .copied();
            let Some((acquired_at, id, events)) = lease else {
                // A live worker process leaves a trace of its lease, unless
                // killed; a pid no worker had any more was a process gone.
                let gone = match process {
                    Some((w, _)) => spans("sigkill_worker", w)
                        .iter()
                        .any(|&(start, _)| start >= r.t),
                    None => h.pid.is_some(),
                };
                // A live process that never traced a grant with the revoked
                // token was never granted it: `revoke` deleted the lease of
                // an attempt between its create and the read that would
                // have granted it (a semaphore's lease looks held before its
                // attempt has read the others), and the attempt went on.
                let never_granted = process.is_some() && h.token.is_some();
                if gone || never_granted {
                    s.revoked_ended_first += 1;
                } else {
                    s.revoked_unsignalled += 1;
                }
                continue;
            };
            let w = id.0;
            if h.token.is_none() {
                revoked_tokens.extend(events.iter().find_map(|e| e.token));
            }
            matched.insert(id);
            let lease_len = events
                .iter()
                .find_map(|e| e.lease_ms)
                .map_or(default_lease, Duration::from_millis);
            let bound = revocation_bound(lease_len).as_nanos() as u64;
            let mut deadline = r.answered + bound;
            for (start, heal) in spans("sigstop", w) {
                if start <= deadline && heal >= r.t {
                    deadline = deadline.max(heal.saturating_add(bound));
                }
            }
            // The first kill of that worker after the grant ended this
            // process.
            let killed = spans("sigkill_worker", w)
                .iter()
                .any(|&(start, _)| start >= acquired_at && start <= deadline);
            let traced = events.iter().find(|e| e.event == TraceKind::Lost);
            if traced.is_some_and(|lost| lost.t < r.t) {
                s.revoked_ended_first += 1;
                continue;
            }
            // The signal as the runtime traced it, or as the worker saw it
            // (`lost()` fired; a loss the backend learned of by itself may
            // not be traced).
            let hold = hold_steps(steps, (w, id.1), &r.key, acquired_at);
            let seen = hold
                .iter()
                .find(|e| e.t >= r.t && matches!(e.ev, Step::Lost { .. }))
                .map(|e| e.t);
            // Its writes after the revocation: the fence must refuse them
            // once a newer holder has read (the stale-write check).
            for e in hold.iter().filter(|e| e.t >= r.t) {
                if let Step::Wrote { accepted } = e.ev {
                    if accepted {
                        s.revoked_writes_taken += 1;
                    } else {
                        s.revoked_writes_refused += 1;
                    }
                }
            }
            let signal = traced.map(|e| e.t).into_iter().chain(seen).min();
            let released = events
                .iter()
                .find(|e| e.event == TraceKind::ReleaseRequested)
                .map(|e| e.t);
            match signal {
                Some(t) if t <= deadline => {
                    s.revoked_signalled += 1;
                    latencies.push(t.saturating_sub(r.answered) as f64 / 1e6);
                    let reason = match traced {
                        Some(lost) => lost
                            .loss_reason
                            .clone()
                            .unwrap_or_else(|| "unknown".to_owned()),
                        None => UNTRACED.to_owned(),
                    };
                    if tells && misreports_revocation(&meta.backend, &reason) {
                        s.revoked_misreported += 1;
                    }
                    *s.revoked_loss_reasons.entry(reason).or_default() += 1;
                }
                Some(_) => s.revoked_unsignalled += 1,
                None => match released {
                    Some(released) if released < r.t => s.revoked_ended_first += 1,
                    Some(released) => {
                        // Released before a renewal could find the key revoked?
                        let renewed = events.iter().any(|e| {
                            e.event == TraceKind::RenewalSent
                                && e.t > r.answered
                                && e.t.saturating_add(RENEWAL_ANSWER_GRACE) < released
                        });
                        if renewed {
                            s.revoked_unsignalled += 1;
                        } else {
                            s.revoked_ended_first += 1;
                        }
                    }
                    None if killed => s.revoked_ended_first += 1,
                    None => s.revoked_unsignalled += 1,
                },
            }
        }

        // Permits: the first grant of each revoked slot after the
        // revocation (tokens grow per (key, slot)) — after the revoked
        // grant itself: the slot may change hands while `revoke` runs,
        // before the grant it ends.
        if !revoked_slots.is_empty() {
            for (&slot, &highest) in &revoked_slots {
                let since = steps
                    .iter()
                    .find(|e| {
                        e.key == r.key
                            && matches!(e.ev, Step::Acquired {
                                token: Some(token),
                                slot: Some(granted),
                                ..
                            } if token == highest && granted == slot)
                    })
                    .map_or(r.t, |e| e.t.max(r.t));
                let next = steps.iter().find_map(|e| match e.ev {
                    Step::Acquired {
                        token: Some(token),
                        slot: Some(granted),
                        ..
                    } if granted == slot
                        && e.key == r.key
                        && e.t > since
                        && !revoked_tokens.contains(&token) =>
                    {
                        Some(token)
                    }
                    _ => None,
                });
                if let Some(token) = next {
                    s.tokens_after_revoke += 1;
                    if token <= highest {
                        s.tokens_not_above_revoked += 1;
                    }
                }
            }
            continue;
        }
        // The first grant of the key after the revocation.
        let revoked = revoked_tokens;
        let Some(&highest) = revoked.iter().max() else {
            continue;
        };
        // After the revoked grant itself (the key may change hands while
        // `revoke` runs, before the grant it ends).
        let main_grant = |e: &&&TraceEvent| {
            e.event == TraceKind::Acquired
                && e.backend != crate::worker::SIDE
                && e.key == r.lock_key
        };
        let since = traces
            .iter()
            .filter(main_grant)
            .find(|e| e.token == Some(highest))
            .map_or(r.t, |e| e.t.max(r.t));
        let next = traces
            .iter()
            .filter(main_grant)
            .find(|e| e.t > since && !e.token.is_some_and(|t| revoked.contains(&t)));
        if let Some(token) = next.and_then(|e| e.token) {
            s.tokens_after_revoke += 1;
            if token <= highest {
                s.tokens_not_above_revoked += 1;
            }
        }
    }
    s.revoke_signal_latency = Spread::of(latencies);

    // A loss told `revoked` must have been one.
    let mut told: HashSet<(usize, u32, u64)> = HashSet::new();
    for e in traces {
        if e.event == TraceKind::Lost
            && e.loss_reason.as_deref() == Some("revoked")
            && told.insert((e.w, e.inc, e.lease))
            && (e.backend == crate::worker::SIDE || !matched.contains(&(e.w, e.inc, e.lease)))
        {
            s.revoked_unexplained += 1;
        }
    }
}

/// Every holder whose connection a `session_kill` ended (see the
/// nemesis) must be told of its loss within [`revocation_bound`] of its
/// lease after the kill (later by any pause of its worker), unless its
/// hold had ended first — as for a revoked holder: lost or released before
/// the kill, released before a renewal could find the connection gone, or
/// its process killed. The holder's lease is the latest `dlock.lock` span
/// of its worker process on the key acquired before the kill with the
/// killed grant's token (a permit's: its slot's).
fn check_session_kills(
    s: &mut Summary,
    kills: &[&SessionKillEvent],
    traces: &[&TraceEvent],
    steps: &[&WorkerEvent],
    faults: &[&FaultEvent],
    meta: &RunMeta,
) {
    let default_lease = Duration::from_millis(meta.lease_ms);
    let mut latencies = Vec::new();
    for k in kills {
        let h = &k.holder;
        s.session_killed_holders += 1;
        s.session_killed_slot_holders += u64::from(h.slot.is_some());
        let Some((w, inc)) = h.w.zip(h.inc) else {
            // No worker process had that pid any more: its process was gone.
            s.session_killed_ended_first += 1;
            continue;
        };
        let mut leases: BTreeMap<u64, Vec<&TraceEvent>> = BTreeMap::new();
        for e in traces
            .iter()
            .filter(|e| (e.w, e.inc) == (w, inc) && e.backend != crate::worker::SIDE)
        {
            leases.entry(e.lease).or_default().push(e);
        }
        let lease = leases
            .values()
            .filter_map(|events| {
                let acquired = events.iter().find(|e| {
                    e.event == TraceKind::Acquired
                        && e.key == k.lock_key
                        && e.t <= k.answered
                        && (h.token.is_none() || e.token == h.token)
                })?;
                Some((acquired.t, events))
            })
            .max_by_key(|(t, _)| *t);
        let killed_worker = |from: u64, to: u64| {
            fault_spans(faults, "sigkill_worker", w)
                .iter()
                .any(|&(start, _)| start >= from && start <= to)
        };
        let Some((acquired_at, events)) = lease else {
            // A live worker process leaves a trace of its lease, unless
            // killed.
            if killed_worker(k.t, u64::MAX) {
                s.session_killed_ended_first += 1;
            } else {
                s.session_killed_unsignalled += 1;
            }
            continue;
        };
        let lease_len = events
            .iter()
            .find_map(|e| e.lease_ms)
            .map_or(default_lease, Duration::from_millis);
        let bound = revocation_bound(lease_len).as_nanos() as u64;
        let mut deadline = k.answered + bound;
        for (start, heal) in fault_spans(faults, "sigstop", w) {
            if start <= deadline && heal >= k.t {
                deadline = deadline.max(heal.saturating_add(bound));
            }
        }
        let traced = events.iter().find(|e| e.event == TraceKind::Lost);
        if traced.is_some_and(|lost| lost.t < k.t) {
            s.session_killed_ended_first += 1;
            continue;
        }
        let hold = hold_steps(steps, (w, inc), &k.key, acquired_at);
        let seen = hold
            .iter()
            .find(|e| e.t >= k.t && matches!(e.ev, Step::Lost { .. }))
            .map(|e| e.t);
        let signal = traced.map(|e| e.t).into_iter().chain(seen).min();
        let released = events
            .iter()
            .find(|e| e.event == TraceKind::ReleaseRequested)
            .map(|e| e.t);
        match signal {
            Some(t) if t <= deadline => {
                s.session_killed_signalled += 1;
                latencies.push(t.saturating_sub(k.answered) as f64 / 1e6);
            }
            Some(_) => s.session_killed_unsignalled += 1,
            None => match released {
                Some(released) if released < k.t => s.session_killed_ended_first += 1,
                Some(released) => {
                    let renewed = events.iter().any(|e| {
                        e.event == TraceKind::RenewalSent
                            && e.t > k.answered
                            && e.t.saturating_add(RENEWAL_ANSWER_GRACE) < released
                    });
                    if renewed {
                        s.session_killed_unsignalled += 1;
                    } else {
                        s.session_killed_ended_first += 1;
                    }
                }
                None if killed_worker(acquired_at, deadline) => s.session_killed_ended_first += 1,
                None => s.session_killed_unsignalled += 1,
            },
        }
    }
    s.session_kill_signal_latency = Spread::of(latencies);
}

/// The faults of one kind touching worker `w`, as (start, heal).
fn fault_spans(faults: &[&FaultEvent], kind: &str, w: usize) -> Vec<(u64, u64)> {
    faults
        .iter()
        .filter(|f| f.fault == kind && f.phase == Phase::Start && f.workers.contains(&w))
        .map(|start| {
            let heal = faults
                .iter()
                .find(|f| f.id == start.id && f.phase == Phase::Heal)
                .map_or(u64::MAX, |f| f.t);
            (start.t, heal)
        })
        .collect()
}

/// The reason counted for a revoked holder whose worker saw the loss
/// signal but whose runtime traced no `dlock lease lost` event for it.
const UNTRACED: &str = "untraced";

/// The steps of worker process `who` in its hold of `key` granted at
/// `granted` (the runtime's trace): from its first `Acquired` step of that
/// key from then on to its next `Acquired` step.
fn hold_steps<'a>(
    steps: &[&'a WorkerEvent],
    who: (usize, u32),
    key: &str,
    granted: u64,
) -> Vec<&'a WorkerEvent> {
    let mut mine = steps.iter().copied().filter(|e| (e.w, e.inc) == who);
    let Some(start) = mine.find(|e| {
        e.t >= granted
            && matches!(e.ev, Step::Acquired { .. })
            && e.all_keys().iter().any(|k| k == key)
    }) else {
        return Vec::new();
    };
    let mut hold = vec![start];
    hold.extend(mine.take_while(|e| !matches!(e.ev, Step::Acquired { .. })));
    hold
}

/// The moment a lost signal is measured from: the latest fault touching that
/// worker before the signal — or, for a pause of that worker, the moment it resumed
/// (a stopped process hears nothing).
fn lost_reference(faults: &[&FaultEvent], e: &WorkerEvent) -> Option<u64> {
    let start = faults.iter().rev().find(|f| {
        f.phase == Phase::Start && f.t <= e.t && (f.workers.is_empty() || f.workers.contains(&e.w))
    })?;
    if start.fault == "sigstop" {
        let resumed = faults
            .iter()
            .find(|f| f.id == start.id && f.phase == Phase::Heal && f.t <= e.t + SIGNAL_GRACE);
        return Some(resumed.map_or(start.t, |f| f.t));
    }
    Some(start.t)
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        let workload = match self.workload {
            Workload::Counter => "",
            Workload::Transfer => ", transfers",
            Workload::Semaphore => ", semaphore",
            Workload::Rw => ", read-write",
        };
        writeln!(
            f,
            "chaos summary — {}{workload} (seed {}, {:.0} s)",
            self.backend, self.seed, self.seconds
        )?;
        writeln!(f, "  acquisitions               {}", self.acquisitions)?;
        writeln!(
            f,
            "  busy / errors              {} / {}",
            self.busy, self.errors
        )?;
        writeln!(f, "  faults                     {}", faults.join(", "))?;
        let by_lease: Vec<String> = self
            .acquisitions_by_lease_ms
            .iter()
            .map(|(ms, n)| format!("{ms} ms: {n}"))
            .collect();
        writeln!(f, "  entries by lease           {}", by_lease.join(", "))?;
        let gave_up: Vec<String> = self
            .gave_up
            .iter()
            .map(|(at, n)| format!("{at} {n}"))
            .collect();
        writeln!(f, "  callers that gave up       {}", gave_up.join(", "))?;
        writeln!(
            f,
            "  side locks                 {} taken, {} lost, {} failed",
            self.side_acquired, self.side_lost, self.side_failed
        )?;
        writeln!(
            f,
            "  belief overlaps            {} holders, overlapped by {} later entries (expected under pauses)",
            self.belief_overlaps, self.overlapped_acquisitions
        )?;
        writeln!(f, "  writes accepted            {}", self.writes_accepted)?;
        writeln!(f, "  stale ops refused          {}", self.stale_refused)?;
        writeln!(
            f,
            "  stale writes accepted      {}  (must be 0)",
            self.stale_writes_accepted
        )?;
        writeln!(
            f,
            "  stale reads answered       {}  (must be 0)",
            self.stale_reads_accepted
        )?;
        writeln!(
            f,
            "  lost updates               {}  (must be 0)",
            self.lost_updates
        )?;
        for (what, by_key) in [
            ("stale writes", &self.stale_writes_by_key),
            ("lost updates", &self.lost_updates_by_key),
        ] {
            if !by_key.is_empty() {
                let keys: Vec<String> = by_key.iter().map(|(k, n)| format!("{k} {n}")).collect();
                writeln!(f, "    {what} by key          {}", keys.join(", "))?;
            }
        }
        if let Some(permits) = self.permits {
            writeln!(
                f,
                "  permit holders at once     at most {} of {permits} permits (must not be more); {} without a slot below them  (must be 0)",
                self.max_permit_holders, self.permit_slots_out_of_range
            )?;
        }
        if self.workload == Workload::Rw {
            writeln!(
                f,
                "  readers                    {} shared reads taken, at most {} readers at once; {} beside a writer  (must be 0)",
                self.shared_reads_taken, self.max_readers_at_once, self.readers_beside_writers
            )?;
        }
        writeln!(
            f,
            "  exclusive holds at once    {}  (must be 0)",
            self.holders_at_once
        )?;
        if let (Some(initial), Some(total)) = (self.total_initial, self.total_final) {
            writeln!(
                f,
                "  transfers                  {} taken, {} refused (a stale token or version), {} half-applied  (must be 0)",
                self.transfers_taken, self.transfers_refused, self.half_applied_transfers
            )?;
            writeln!(
                f,
                "  total balance              {total} at the end, {initial} at the start  (must be equal)"
            )?;
        }
        writeln!(
            f,
            "  lost-lease signals         {} ({} later than a lease after the fault, {} with no fault)",
            self.lost_signals, self.lost_late, self.lost_unattributed
        )?;
        writeln!(f, "  lost-signal latency        {}", self.lost_latency)?;
        writeln!(
            f,
            "  renewals / releases        {} sent / {} requested; {} renewals after a release request  (must be 0)",
            self.renewals_sent, self.releases_requested, self.renewals_after_release
        )?;
        writeln!(
            f,
            "  losses traced              {}; {} after the server's expiry  (must be 0)",
            self.losses_traced, self.losses_after_expiry
        )?;
        writeln!(f, "  loss margin before expiry  {}", self.loss_margin)?;
        let reasons: Vec<String> = self
            .losses_by_reason
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        writeln!(f, "  losses by reason           {}", reasons.join(", "))?;
        writeln!(
            f,
            "  revocations                {}, holders revoked {}, signalled {}, reason revoked {}; {} ended first; {} unsignalled  (must be 0)",
            self.revocations,
            self.holders_revoked,
            self.revoked_signalled,
            self.revoked_loss_reasons
                .get("revoked")
                .copied()
                .unwrap_or(0),
            self.revoked_ended_first,
            self.revoked_unsignalled
        )?;
        let revoked_reasons: Vec<String> = self
            .revoked_loss_reasons
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        writeln!(
            f,
            "  revoked holders' reasons   {}; {} other than revoked where it must be, {} revoked with no revocation  (must be 0)",
            revoked_reasons.join(", "),
            self.revoked_misreported,
            self.revoked_unexplained
        )?;
        writeln!(
            f,
            "  revoked holders' writes    {} refused, {} taken before a newer holder read",
            self.revoked_writes_refused, self.revoked_writes_taken
        )?;
        writeln!(
            f,
            "  revocation to signal       {}",
            self.revoke_signal_latency
        )?;
        writeln!(
            f,
            "  session kills              {} holders' connections ended ({} of a slot), signalled {}; {} ended first; {} unsignalled  (must be 0)",
            self.session_killed_holders,
            self.session_killed_slot_holders,
            self.session_killed_signalled,
            self.session_killed_ended_first,
            self.session_killed_unsignalled
        )?;
        writeln!(
            f,
            "  session kill to signal     {}",
            self.session_kill_signal_latency
        )?;
        writeln!(
            f,
            "  next token after revoke    {} compared, {} not larger than the revoked  (must be 0)",
            self.tokens_after_revoke, self.tokens_not_above_revoked
        )?;
        writeln!(
            f,
            "  side stalls                main renewals during them {}, side leases lost {}, main leases lost {}  (must be 0)",
            self.side_stall_main_renewals,
            self.side_stall_side_losses,
            self.main_lost_in_side_stall
        )?;
        writeln!(
            f,
            "  handoff after heal         {}",
            self.handoff_after_heal
        )?;
        match self.keys_left {
            Some(n) => writeln!(f, "  keys left once idle        {n}  (must be 0)")?,
            None => writeln!(f, "  keys left once idle        not inspected (plain URL)")?,
        }
        if let Some(n) = self.side_keys_left {
            writeln!(f, "  side keys left once idle   {n}  (must be 0)")?;
        }
        if self.violations.is_empty() {
            write!(f, "  verdict                    OK")
        } else {
            write!(
                f,
                "  verdict                    FAILED: {}",
                self.violations.join("; ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(mode: Mode, dump: &[(&str, u64, u64)]) -> RunMeta {
        RunMeta {
            backend: "test".into(),
            seed: 0,
            workers: 2,
            mode,
            lease_ms: 1000,
            session_timeout_ms: None,
            keys_left: Some(0),
            side_keys_left: Some(0),
            traced: false,
            hung_workers: 0,
            finished: true,
            workload: Workload::Counter,
            initial_balance: 0,
            accounts: 0,
            permits: None,
            dump: dump
                .iter()
                .map(|(k, v, ver)| ((*k).to_owned(), (*v, *ver)))
                .collect(),
        }
    }

    fn op(seq: u64, op: OpKind, token: Option<u64>, base: Option<u64>, accepted: bool) -> StoreOp {
        StoreOp {
            seq,
            t: seq,
            op,
            key: "k".into(),
            transfer: None,
            token,
            base_version: base,
            value: base.map(|b| b + 1),
            accepted,
            w: 0,
        }
    }

    fn worker(t: u64, w: usize, ev: Step) -> Record {
        Record::Worker(WorkerEvent {
            t,
            w,
            inc: 0,
            key: "k".into(),
            keys: Vec::new(),
            ev,
        })
    }

    /// The meta of a transfer run over `acct:0` and `acct:1` (100 each),
    /// with this final state.
    fn transfer_meta(mode: Mode, dump: [(u64, u64); 2]) -> RunMeta {
        let mut m = meta(mode, &[("acct:0", dump[0].0, dump[0].1)]);
        m.dump.insert("acct:1".into(), dump[1]);
        m.workload = Workload::Transfer;
        m.initial_balance = 100;
        m.accounts = 2;
        m
    }

    /// One half of transfer `n`: `(key, token, base version, value)`; a read
    /// when `write` is `None`.
    fn half(
        seq: u64,
        n: u64,
        key: &str,
        token: Option<u64>,
        write: Option<(u64, u64)>,
        accepted: bool,
    ) -> StoreOp {
        StoreOp {
            seq,
            t: seq,
            op: if write.is_some() {
                OpKind::Write
            } else {
                OpKind::Read
            },
            key: key.into(),
            transfer: Some(n),
            token,
            base_version: write.map(|(base, _)| base),
            value: write.map(|(_, value)| value),
            accepted,
            w: 0,
        }
    }

    /// A hold of both accounts by worker `w`, from `t` to `t + 1`.
    fn transfer_hold(t: u64, w: usize, token: u64) -> [Record; 2] {
        let event = |t, ev| {
            Record::Worker(WorkerEvent {
                t,
                w,
                inc: 0,
                key: "acct:0".into(),
                keys: vec!["acct:0".into(), "acct:1".into()],
                ev,
            })
        };
        [
            event(t, Step::acquired(Some(token))),
            event(t + 1, Step::Leaving),
        ]
    }

    #[test]
    fn a_transfer_refused_for_one_stale_account_keeps_the_total() {
        // Transfers 1 and 2 (tokens 1, 1): read, then move 30. Transfer 3
        // reads with tokens 3 and 2; transfer 4 writes with 3 and 1: refused
        // as a whole for acct:1 alone (its acct:0 half was current).
        let ops = [
            half(1, 1, "acct:0", Some(1), None, true),
            half(2, 1, "acct:1", Some(1), None, true),
            half(3, 2, "acct:0", Some(1), Some((0, 70)), true),
            half(4, 2, "acct:1", Some(1), Some((0, 130)), true),
            half(5, 3, "acct:0", Some(3), None, true),
            half(6, 3, "acct:1", Some(2), None, true),
            half(7, 4, "acct:0", Some(3), Some((1, 60)), false),
            half(8, 4, "acct:1", Some(1), Some((1, 140)), false),
        ];
        let records = transfer_hold(0, 0, 1);
        let s = check(
            &records,
            &ops,
            &transfer_meta(Mode::Fence, [(70, 1), (130, 1)]),
        );
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.transfers_taken, s.transfers_refused), (1, 1));
        assert_eq!((s.total_initial, s.total_final), (Some(200), Some(200)));
        assert_eq!(s.stale_refused, 2);
    }

    #[test]
    fn a_half_applied_transfer_and_a_broken_total_are_caught() {
        let ops = [
            half(1, 1, "acct:0", Some(1), Some((0, 70)), true),
            half(2, 1, "acct:1", Some(1), Some((0, 130)), false),
        ];
        let s = check(
            &transfer_hold(0, 0, 1),
            &ops,
            &transfer_meta(Mode::Fence, [(70, 1), (100, 0)]),
        );
        assert_eq!(s.half_applied_transfers, 1);
        assert_eq!(s.total_final, Some(170));
        for what in ["half-applied", "not conserved"] {
            assert!(
                s.violations.iter().any(|v| v.contains(what)),
                "{what}: {:?}",
                s.violations
            );
        }
    }

    #[test]
    fn a_stale_transfer_write_is_caught_per_account() {
        // Token 2 read acct:1; the holder of token 1 then writes both, and
        // a broken store takes it.
        let ops = [
            half(1, 1, "acct:0", Some(1), None, true),
            half(2, 1, "acct:1", Some(1), None, true),
            half(3, 2, "acct:1", Some(2), None, true),
            half(4, 2, "acct:2", Some(2), None, true),
            half(5, 3, "acct:0", Some(1), Some((0, 90)), true),
            half(6, 3, "acct:1", Some(1), Some((0, 110)), true),
        ];
        let mut m = transfer_meta(Mode::Fence, [(90, 1), (110, 1)]);
        m.accounts = 3;
        m.dump.insert("acct:2".into(), (100, 0));
        let s = check(&transfer_hold(0, 0, 1), &ops, &m);
        assert_eq!(s.stale_writes_accepted, 1);
        assert_eq!(
            s.stale_writes_by_key,
            BTreeMap::from([("acct:1".to_owned(), 1)])
        );
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("stale writes accepted")),
            "{:?}",
            s.violations
        );
        // The total alone would not show it.
        assert_eq!(s.total_final, s.total_initial);
    }

    #[test]
    fn a_transfer_refused_although_current_is_caught() {
        let ops = [
            half(1, 1, "acct:0", Some(1), None, true),
            half(2, 1, "acct:1", Some(1), None, true),
            half(3, 2, "acct:0", Some(1), Some((0, 90)), false),
            half(4, 2, "acct:1", Some(1), Some((0, 110)), false),
        ];
        let s = check(
            &transfer_hold(0, 0, 1),
            &ops,
            &transfer_meta(Mode::Fence, [(100, 0), (100, 0)]),
        );
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("refused 2 current operations")),
            "{:?}",
            s.violations
        );
    }

    #[test]
    fn versioned_transfers_are_all_or_nothing() {
        // Redlock: no tokens; the second transfer read version 0 of acct:1
        // after the first had written it.
        let ops = [
            half(1, 1, "acct:0", None, Some((0, 80)), true),
            half(2, 1, "acct:1", None, Some((0, 120)), true),
            half(3, 2, "acct:0", None, Some((1, 60)), false),
            half(4, 2, "acct:1", None, Some((0, 140)), false),
        ];
        let s = check(
            &transfer_hold(0, 0, 1),
            &ops,
            &transfer_meta(Mode::Version, [(80, 1), (120, 1)]),
        );
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.transfers_taken, s.transfers_refused), (1, 1));
    }

    #[test]
    fn a_hold_of_two_accounts_overlaps_a_holder_of_either() {
        let mut records = transfer_hold(0, 0, 1).to_vec();
        records.push(Record::Worker(WorkerEvent {
            t: 0,
            w: 1,
            inc: 0,
            key: "acct:1".into(),
            keys: Vec::new(),
            ev: Step::acquired(Some(2)),
        }));
        let s = check(
            &records,
            &[],
            &transfer_meta(Mode::Fence, [(100, 0), (100, 0)]),
        );
        assert_eq!(s.belief_overlaps, 1);
    }

    /// An operation of worker `w` on `key`.
    fn op_of(
        seq: u64,
        w: usize,
        key: &str,
        op: OpKind,
        token: u64,
        base: Option<u64>,
        accepted: bool,
    ) -> StoreOp {
        StoreOp {
            key: key.into(),
            w,
            ..self::op(seq, op, Some(token), base, accepted)
        }
    }

    /// The meta of a read-write run.
    fn rw_meta(dump: &[(&str, u64, u64)]) -> RunMeta {
        RunMeta {
            workload: Workload::Rw,
            ..meta(Mode::Fence, dump)
        }
    }

    /// The meta of a semaphore run of `permits` permits.
    fn semaphore_meta(permits: u32, dump: &[(&str, u64, u64)]) -> RunMeta {
        RunMeta {
            workload: Workload::Semaphore,
            permits: Some(permits),
            ..meta(Mode::Fence, dump)
        }
    }

    #[test]
    fn readers_share_and_a_writer_older_than_a_reader_is_refused() {
        use OpKind::{Read, Shared, Write};
        let ops = [
            op_of(1, 1, "k", Shared, 2, None, true),
            op_of(2, 2, "k", Shared, 3, None, true),
            // Readers never refuse each other: the older reader leaves.
            op_of(3, 1, "k", Shared, 2, None, true),
            // A writer granted before the reader of token 3 is stale.
            op_of(4, 0, "k", Read, 1, None, false),
            op_of(5, 2, "k", Shared, 3, None, true),
            op_of(6, 3, "k", Read, 4, None, true),
            op_of(7, 3, "k", Write, 4, Some(0), true),
            // A reader older than that writer is stale.
            op_of(8, 2, "k", Shared, 3, None, false),
        ];
        let s = check(&[], &ops, &rw_meta(&[("k", 1, 1)]));
        let v: Vec<&String> = s
            .violations
            .iter()
            .filter(|v| *v != "no acquisitions at all")
            .collect();
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(s.shared_reads_taken, 4);
        assert_eq!(s.max_readers_at_once, 2);
        assert_eq!((s.readers_beside_writers, s.stale_refused), (0, 2));
    }

    #[test]
    fn a_writer_taken_beside_a_reader_is_caught() {
        use OpKind::{Read, Shared, Write};
        // The store took the writer's operations while the reader of token 2
        // held, and the reader's last read after them.
        let ops = [
            op_of(1, 1, "k", Shared, 2, None, true),
            op_of(2, 2, "k", Read, 3, None, true),
            op_of(3, 2, "k", Write, 3, Some(0), true),
            op_of(4, 1, "k", Shared, 2, None, true),
        ];
        let s = check(&[], &ops, &rw_meta(&[("k", 1, 1)]));
        assert_eq!(s.readers_beside_writers, 1);
        assert_eq!(s.stale_reads_accepted, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("overlapped a writer")),
            "{:?}",
            s.violations
        );
        // A writer older than a reader taken after it: a stale write.
        let ops = [
            op_of(1, 1, "k", Shared, 5, None, true),
            op_of(2, 2, "k", Write, 4, Some(0), true),
        ];
        let s = check(&[], &ops, &rw_meta(&[("k", 1, 1)]));
        assert_eq!(s.stale_writes_accepted, 1);
    }

    #[test]
    fn more_holders_than_permits_and_a_slot_out_of_range_are_caught() {
        use OpKind::{Read, Write};
        let permit = |t: u64, w: usize, slot: u32| {
            Record::Worker(WorkerEvent {
                t,
                w,
                inc: 0,
                key: "k".into(),
                keys: Vec::new(),
                ev: Step::Acquired {
                    token: Some(t),
                    slot: Some(slot),
                    shared: false,
                },
            })
        };
        let records = [permit(1, 0, 0), permit(2, 1, 1), permit(3, 2, 2)];
        let ops = [
            op_of(1, 0, "k#0", Read, 1, None, true),
            op_of(2, 1, "k#1", Read, 2, None, true),
            op_of(3, 2, "k#2", Read, 3, None, true),
            op_of(4, 0, "k#0", Write, 1, Some(0), true),
            op_of(5, 1, "k#1", Write, 2, Some(0), true),
            op_of(6, 2, "k#2", Write, 3, Some(0), true),
        ];
        let dump = [("k#0", 1, 1), ("k#1", 1, 1), ("k#2", 1, 1)];
        let s = check(&records, &ops, &semaphore_meta(3, &dump));
        assert_eq!((s.max_permit_holders, s.permit_slots_out_of_range), (3, 0));
        assert!(!s.violations.iter().any(|v| v.contains("semaphore")));
        let s = check(&records, &ops, &semaphore_meta(2, &dump));
        assert_eq!((s.max_permit_holders, s.permit_slots_out_of_range), (3, 1));
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("3 holders of one semaphore at once, of 2 permits")),
            "{:?}",
            s.violations
        );
    }

    #[test]
    fn two_holders_of_one_slot_at_once_are_caught() {
        use OpKind::{Read, Write};
        // Two grants with one token on one slot: both taken, interleaved.
        let ops = [
            op_of(1, 0, "k#0", Read, 7, None, true),
            op_of(2, 1, "k#0", Read, 7, None, true),
            op_of(3, 0, "k#0", Write, 7, Some(0), true),
            op_of(4, 1, "k#0", Write, 7, Some(0), true),
        ];
        let s = check(&[], &ops, &semaphore_meta(3, &[("k#0", 1, 2)]));
        assert_eq!(s.holders_at_once, 1);
        assert_eq!(s.lost_updates, 1);
        // One after the other: none.
        let ops = [
            op_of(1, 0, "k#0", Read, 7, None, true),
            op_of(2, 0, "k#0", Write, 7, Some(0), true),
            op_of(3, 1, "k#0", Read, 8, None, true),
            op_of(4, 1, "k#0", Write, 8, Some(1), true),
        ];
        let s = check(&[], &ops, &semaphore_meta(3, &[("k#0", 2, 2)]));
        assert_eq!((s.holders_at_once, s.max_permit_holders), (0, 1));
    }

    #[test]
    fn tokens_after_a_revoked_permit_are_compared_per_slot() {
        let holder = |w: usize, token: u64, slot: u32| crate::history::RevokedHolder {
            pid: None,
            w: Some(w),
            inc: Some(0),
            token: Some(token),
            slot: Some(slot),
        };
        let granted = |t: u64, w: usize, token: u64, slot: u32| {
            Record::Worker(WorkerEvent {
                t,
                w,
                inc: 0,
                key: "k".into(),
                keys: Vec::new(),
                ev: Step::Acquired {
                    token: Some(token),
                    slot: Some(slot),
                    shared: false,
                },
            })
        };
        let revocation = Record::Revocation(RevocationEvent {
            t: 10,
            answered: 11,
            id: 1,
            key: "k".into(),
            lock_key: "chaos:r:k".into(),
            holders: vec![holder(0, 10, 0), holder(1, 20, 1)],
        });
        // Slot 0's next token is below slot 1's revoked one: right, per slot.
        let records = [
            revocation.clone(),
            granted(12, 2, 15, 0),
            granted(13, 3, 21, 1),
        ];
        let s = check(&records, &[], &semaphore_meta(3, &[]));
        assert_eq!((s.tokens_after_revoke, s.tokens_not_above_revoked), (2, 0));
        let records = [revocation, granted(12, 2, 15, 0), granted(13, 3, 19, 1)];
        let s = check(&records, &[], &semaphore_meta(3, &[]));
        assert_eq!((s.tokens_after_revoke, s.tokens_not_above_revoked), (2, 1));
    }

    #[test]
    fn a_clean_fenced_history_passes() {
        let records = [
            worker(1, 0, Step::acquired(Some(1))),
            worker(5, 0, Step::Leaving),
        ];
        let ops = [
            op(1, OpKind::Read, Some(1), None, true),
            op(2, OpKind::Write, Some(1), Some(0), true),
            op(3, OpKind::Read, Some(2), None, true),
            op(4, OpKind::Write, Some(1), Some(1), false),
        ];
        let s = check(&records, &ops, &meta(Mode::Fence, &[("k", 1, 1)]));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.writes_accepted, s.stale_refused), (1, 1));
    }

    #[test]
    fn a_stale_write_taken_by_the_store_is_caught() {
        // Token 1 writes after token 2 has read: the store should have refused it.
        let ops = [
            op(1, OpKind::Read, Some(1), None, true),
            op(2, OpKind::Read, Some(2), None, true),
            op(3, OpKind::Write, Some(1), Some(0), true),
        ];
        let s = check(
            &[worker(1, 0, Step::acquired(Some(1)))],
            &ops,
            &meta(Mode::Fence, &[("k", 1, 1)]),
        );
        assert_eq!(s.stale_writes_accepted, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("stale writes accepted")),
            "{:?}",
            s.violations
        );
    }

    #[test]
    fn a_lost_update_is_caught() {
        // Two writes based on version 0 both taken (no fencing would stop it here).
        let ops = [
            op(1, OpKind::Write, None, Some(0), true),
            op(2, OpKind::Write, None, Some(0), true),
        ];
        let s = check(
            &[worker(1, 0, Step::acquired(None))],
            &ops,
            &meta(Mode::Version, &[("k", 1, 2)]),
        );
        assert_eq!(s.lost_updates, 1);
        assert!(!s.violations.is_empty());
    }

    #[test]
    fn state_that_disagrees_with_the_log_and_keys_left_are_caught() {
        let ops = [op(1, OpKind::Write, None, Some(0), true)];
        let mut m = meta(Mode::Version, &[("k", 5, 1)]);
        m.keys_left = Some(2);
        let s = check(&[worker(1, 0, Step::acquired(None))], &ops, &m);
        assert_eq!(s.violations.len(), 2, "{:?}", s.violations);
    }

    #[test]
    fn overlaps_latency_and_handoff_are_measured() {
        let fault = |t, phase| {
            Record::Fault(FaultEvent {
                t,
                id: 1,
                fault: "sigstop".into(),
                phase,
                workers: vec![0],
                detail: String::new(),
            })
        };
        let ms = 1_000_000;
        let records = [
            worker(0, 0, Step::acquired(Some(1))),
            fault(10 * ms, Phase::Start),
            worker(1500 * ms, 1, Step::acquired(Some(2))),
            worker(1510 * ms, 1, Step::Leaving),
            fault(2000 * ms, Phase::Heal),
            worker(2003 * ms, 0, Step::Lost { cancelled: true }),
            worker(2020 * ms, 1, Step::acquired(Some(3))),
            worker(2030 * ms, 1, Step::Leaving),
        ];
        let s = check(&records, &[], &meta(Mode::Fence, &[]));
        assert_eq!((s.belief_overlaps, s.overlapped_acquisitions), (1, 1));
        assert_eq!(s.lost_signals, 1);
        assert_eq!(s.lost_latency.max, 3.0, "measured from the resumption");
        assert_eq!(s.handoff_after_heal.max, 20.0);
    }

    const MS: u64 = 1_000_000;

    fn fault_event(t: u64, id: u32, fault: &str, phase: Phase, workers: Vec<usize>) -> Record {
        Record::Fault(FaultEvent {
            t,
            id,
            fault: fault.into(),
            phase,
            workers,
            detail: String::new(),
        })
    }

    /// A runtime event of lease `lease` of worker `w`, whose lease is `lease_ms`.
    fn traced(t: u64, w: usize, lease: u64, event: TraceKind, backend: &str) -> Record {
        Record::Trace(TraceEvent {
            t,
            w,
            inc: 0,
            event,
            key: "k".into(),
            token: Some(lease),
            lease,
            lease_ms: Some(400),
            backend: backend.into(),
            reason: (event == TraceKind::Lost).then(|| "test".to_owned()),
            loss_reason: None,
        })
    }

    /// The lock key of the revocation tests.
    const LOCK_KEY: &str = "chaos:r:k";

    /// A runtime event of lease `lease` (token `token`, 400 ms) of worker
    /// `w` on [`LOCK_KEY`], a loss with `reason`.
    fn on_key(t: u64, w: usize, lease: u64, token: u64, event: TraceKind) -> TraceEvent {
        TraceEvent {
            t,
            w,
            inc: 0,
            event,
            key: LOCK_KEY.into(),
            token: Some(token),
            lease,
            lease_ms: Some(400),
            backend: "default".into(),
            reason: None,
            loss_reason: None,
        }
    }

    fn lost_as(t: u64, w: usize, lease: u64, token: u64, reason: &str) -> Record {
        let mut e = on_key(t, w, lease, token, TraceKind::Lost);
        e.loss_reason = Some(reason.into());
        Record::Trace(e)
    }

    /// Worker 1 holds token 7 from 0; the nemesis revokes it at 100 ms
    /// (answered at 101 ms); worker 2 is granted the key at 400 ms with
    /// `next_token`.
    fn revoked_history(next_token: u64) -> Vec<Record> {
        vec![
            worker(0, 1, Step::acquired(Some(7))),
            Record::Trace(on_key(0, 1, 1, 7, TraceKind::Acquired)),
            fault_event(90 * MS, 1, "revoke", Phase::Start, vec![1]),
            Record::Revocation(RevocationEvent {
                t: 100 * MS,
                answered: 101 * MS,
                id: 1,
                key: "k".into(),
                lock_key: LOCK_KEY.into(),
                holders: vec![crate::history::RevokedHolder {
                    pid: Some(4242),
                    w: Some(1),
                    inc: Some(0),
                    token: Some(7),
                    slot: None,
                }],
            }),
            fault_event(300 * MS, 1, "revoke", Phase::Heal, vec![1]),
            Record::Trace(on_key(400 * MS, 2, 1, next_token, TraceKind::Acquired)),
        ]
    }

    fn with_backend(backend: &str) -> RunMeta {
        let mut m = meta(Mode::Fence, &[]);
        m.backend = backend.into();
        m
    }

    /// Worker 1 holds slot 2 of the key with token 7 from 0; the nemesis
    /// ends its connection at 100 ms (answered at 101 ms).
    fn session_killed_history() -> Vec<Record> {
        vec![
            worker(
                0,
                1,
                Step::Acquired {
                    token: Some(7),
                    slot: Some(2),
                    shared: false,
                },
            ),
            Record::Trace(on_key(0, 1, 1, 7, TraceKind::Acquired)),
            fault_event(90 * MS, 1, "session_kill", Phase::Start, vec![1]),
            Record::SessionKill(SessionKillEvent {
                t: 100 * MS,
                answered: 101 * MS,
                id: 1,
                key: "k".into(),
                lock_key: LOCK_KEY.into(),
                holder: crate::history::RevokedHolder {
                    pid: Some(4242),
                    w: Some(1),
                    inc: Some(0),
                    token: Some(7),
                    slot: Some(2),
                },
            }),
            fault_event(600 * MS, 1, "session_kill", Phase::Heal, vec![1]),
        ]
    }

    #[test]
    fn a_session_killed_holder_told_in_time_passes() {
        let mut records = session_killed_history();
        records.push(lost_as(130 * MS, 1, 1, 7, "session_ended"));
        let s = check(&records, &[], &with_backend("postgres-session"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!(
            (s.session_killed_holders, s.session_killed_slot_holders),
            (1, 1)
        );
        assert_eq!(
            (s.session_killed_signalled, s.session_killed_unsignalled),
            (1, 0)
        );
        assert_eq!(s.session_kill_signal_latency.max, 29.0);
    }

    #[test]
    fn a_session_killed_holder_never_told_or_told_too_late_is_caught() {
        // 400 ms lease: told by 101 + 400 + 133 + 2000 ms at the latest.
        for lost_at in [None, Some(2700 * MS)] {
            let mut records = session_killed_history();
            records.extend(lost_at.map(|t| lost_as(t, 1, 1, 7, "session_ended")));
            let s = check(&records, &[], &with_backend("mysql-session"));
            assert_eq!(s.session_killed_unsignalled, 1, "{lost_at:?}");
            assert!(
                s.violations
                    .iter()
                    .any(|v| v.contains("connection was ended were not told")),
                "{:?}",
                s.violations
            );
        }
    }

    #[test]
    fn a_session_killed_holder_that_had_released_was_not_due_to_be_told() {
        let mut records = session_killed_history();
        records.push(Record::Trace(on_key(
            50 * MS,
            1,
            1,
            7,
            TraceKind::ReleaseRequested,
        )));
        let s = check(&records, &[], &with_backend("postgres-session"));
        assert_eq!(
            (s.session_killed_ended_first, s.session_killed_unsignalled),
            (1, 0),
            "{:?}",
            s.violations
        );
    }

    #[test]
    fn grants_while_revoke_runs_before_the_revoked_grant_are_not_compared() {
        // `revoke` runs from 100 to 200 ms; worker 2 holds the key from 110
        // ms (token 6), worker 1 from 150 ms (token 7, the one revoked),
        // worker 3 from 300 ms (token 8).
        let records = vec![
            fault_event(90 * MS, 1, "revoke", Phase::Start, vec![1]),
            worker(110 * MS, 2, Step::acquired(Some(6))),
            Record::Trace(on_key(110 * MS, 2, 1, 6, TraceKind::Acquired)),
            worker(140 * MS, 2, Step::Leaving),
            worker(150 * MS, 1, Step::acquired(Some(7))),
            Record::Trace(on_key(150 * MS, 1, 1, 7, TraceKind::Acquired)),
            Record::Revocation(RevocationEvent {
                t: 100 * MS,
                answered: 200 * MS,
                id: 1,
                key: "k".into(),
                lock_key: LOCK_KEY.into(),
                holders: vec![crate::history::RevokedHolder {
                    pid: Some(4242),
                    w: Some(1),
                    inc: Some(0),
                    token: Some(7),
                    slot: None,
                }],
            }),
            lost_as(210 * MS, 1, 1, 7, "revoked"),
            fault_event(250 * MS, 1, "revoke", Phase::Heal, vec![1]),
            Record::Trace(on_key(300 * MS, 3, 1, 8, TraceKind::Acquired)),
        ];
        let s = check(&records, &[], &with_backend("redis"));
        assert_eq!((s.tokens_after_revoke, s.tokens_not_above_revoked), (1, 0));
    }

    #[test]
    fn a_revoked_holder_told_revoked_and_a_larger_next_token_pass() {
        let mut records = revoked_history(8);
        records.push(lost_as(250 * MS, 1, 1, 7, "revoked"));
        records.push(worker(500 * MS, 1, Step::Wrote { accepted: false }));
        let s = check(&records, &[], &with_backend("redis"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.revocations, s.holders_revoked), (1, 1));
        assert_eq!((s.revoked_writes_refused, s.revoked_writes_taken), (1, 0));
        assert_eq!((s.revoked_signalled, s.revoked_unsignalled), (1, 0));
        assert_eq!(s.revoked_loss_reasons.get("revoked"), Some(&1));
        assert_eq!(s.revoke_signal_latency.max, 149.0);
        assert_eq!((s.tokens_after_revoke, s.tokens_not_above_revoked), (1, 0));
        assert_eq!(s.losses_by_reason.get("revoked"), Some(&1));
    }

    #[test]
    fn a_revoked_holder_never_told_or_told_too_late_is_caught() {
        // 400 ms lease: told by 101 + 400 + 133 + 2000 ms at the latest.
        for lost_at in [None, Some(2700 * MS)] {
            let mut records = revoked_history(8);
            records.extend(lost_at.map(|t| lost_as(t, 1, 1, 7, "revoked")));
            let s = check(&records, &[], &with_backend("redis"));
            assert_eq!(s.revoked_unsignalled, 1, "{lost_at:?}");
            assert!(
                s.violations
                    .iter()
                    .any(|v| v.contains("revoked holders were not told")),
                "{:?}",
                s.violations
            );
        }
        // Paused meanwhile: the bound runs from its resumption.
        let mut paused = revoked_history(8);
        paused.push(lost_as(2700 * MS, 1, 1, 7, "revoked"));
        paused.push(fault_event(110 * MS, 2, "sigstop", Phase::Start, vec![1]));
        paused.push(fault_event(1000 * MS, 2, "sigstop", Phase::Heal, vec![1]));
        let s = check(&paused, &[], &with_backend("redis"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
    }

    #[test]
    fn a_revoked_holder_that_released_before_a_renewal_was_not_due_to_be_told() {
        let mut records = revoked_history(8);
        records.push(Record::Trace(on_key(
            150 * MS,
            1,
            1,
            7,
            TraceKind::ReleaseRequested,
        )));
        let s = check(&records, &[], &with_backend("redis"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.revoked_ended_first, s.revoked_signalled), (1, 0));
        // A renewal went out after the revocation, well before the release:
        // its answer should have told the holder.
        let mut renewed = revoked_history(8);
        renewed.push(Record::Trace(on_key(
            200 * MS,
            1,
            1,
            7,
            TraceKind::RenewalSent,
        )));
        renewed.push(Record::Trace(on_key(
            1500 * MS,
            1,
            1,
            7,
            TraceKind::ReleaseRequested,
        )));
        let s = check(&renewed, &[], &with_backend("redis"));
        assert_eq!(s.revoked_unsignalled, 1, "{:?}", s.violations);
    }

    /// Worker 1 is granted token 7 while `revoke` (100 ms, answered at
    /// 101 ms) takes it: the grant's acquisition is traced at 120 ms.
    fn granted_while_revoked_history() -> Vec<Record> {
        let mut records = revoked_history(8);
        records.retain(|r| !matches!(r, Record::Trace(e) if e.w == 1));
        records.retain(|r| !matches!(r, Record::Worker(e) if e.w == 1));
        records.push(worker(119 * MS, 1, Step::acquired(Some(7))));
        records.push(Record::Trace(on_key(
            120 * MS,
            1,
            1,
            7,
            TraceKind::Acquired,
        )));
        records
    }

    #[test]
    fn a_holder_granted_while_revoke_ran_is_matched_by_its_token() {
        // Released before a renewal could find its lease gone.
        let mut released = granted_while_revoked_history();
        released.push(Record::Trace(on_key(
            150 * MS,
            1,
            1,
            7,
            TraceKind::ReleaseRequested,
        )));
        let s = check(&released, &[], &with_backend("zk"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.revoked_ended_first, s.revoked_unsignalled), (1, 0));
        // Told by its first renewal.
        let mut told = granted_while_revoked_history();
        told.push(lost_as(260 * MS, 1, 1, 7, "revoked"));
        let s = check(&told, &[], &with_backend("zk"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.revoked_signalled, s.revoked_unsignalled), (1, 0));
        // Still holding, never told.
        let s = check(&granted_while_revoked_history(), &[], &with_backend("zk"));
        assert_eq!(s.revoked_unsignalled, 1, "{:?}", s.violations);
        // A grant before the revocation answered is the one it took; a later
        // grant with the same token (a permit's tokens grow per slot) is
        // another hold.
        let mut later = revoked_history(8);
        later.push(Record::Trace(on_key(
            120 * MS,
            1,
            2,
            7,
            TraceKind::Acquired,
        )));
        later.push(Record::Trace(on_key(
            150 * MS,
            1,
            2,
            7,
            TraceKind::ReleaseRequested,
        )));
        let s = check(&later, &[], &with_backend("zk"));
        assert_eq!(s.revoked_unsignalled, 1, "{:?}", s.violations);
    }

    #[test]
    fn a_revoked_lease_its_live_process_was_never_granted_needs_no_signal() {
        let mut records = revoked_history(8);
        for r in &mut records {
            if let Record::Revocation(rev) = r {
                rev.holders[0].token = Some(5);
            }
        }
        let s = check(&records, &[], &with_backend("zk"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.revoked_ended_first, s.revoked_unsignalled), (1, 0));
        // Without a token to tell its grants apart, a live holder with no
        // traced lease was not told.
        for r in &mut records {
            if let Record::Revocation(rev) = r {
                rev.holders[0].token = None;
                rev.holders[0].w = Some(3);
            }
        }
        let s = check(&records, &[], &with_backend("zk"));
        assert_eq!(s.revoked_unsignalled, 1, "{:?}", s.violations);
    }

    #[test]
    fn another_reason_for_a_revoked_holder_is_caught_where_the_backend_tells_revoked() {
        let mut records = revoked_history(8);
        records.push(lost_as(250 * MS, 1, 1, 7, "gone"));
        let s = check(&records, &[], &with_backend("zk"));
        assert_eq!(s.revoked_misreported, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("another reason than `revoked`")),
            "{:?}",
            s.violations
        );
        let s = check(&records, &[], &with_backend("etcd"));
        assert_eq!(s.revoked_misreported, 1);
        // A backend not in the list (a URL's unknown scheme): any reason will do.
        let s = check(&records, &[], &with_backend("custom"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!(s.revoked_loss_reasons.get("gone"), Some(&1));
        // A holder that could not hear the revocation in time gave up on its
        // own clock: not another cause.
        let mut stalled = revoked_history(8);
        stalled.push(lost_as(250 * MS, 1, 1, 7, "expired"));
        let s = check(&stalled, &[], &with_backend("zk"));
        assert_eq!(s.revoked_misreported, 0, "{:?}", s.violations);
    }

    #[test]
    fn a_revoked_holder_that_saw_an_untraced_signal_was_told() {
        let mut records = revoked_history(8);
        records.push(worker(260 * MS, 1, Step::Lost { cancelled: false }));
        // Where the backend's sessions end on their own, its own signal may
        // come first.
        let s = check(&records, &[], &with_backend("mysql-session"));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!(s.revoked_signalled, 1);
        assert_eq!(s.revoked_loss_reasons.get("untraced"), Some(&1));
        // Where it does, an untraced loss has not told it.
        let s = check(&records, &[], &with_backend("sqlite"));
        assert_eq!(s.revoked_misreported, 1, "{:?}", s.violations);
        // A loss seen in an earlier hold of the worker does not count.
        let mut earlier = revoked_history(8);
        earlier.insert(0, worker(0, 1, Step::Lost { cancelled: false }));
        let s = check(&earlier, &[], &with_backend("mysql-session"));
        assert_eq!(s.revoked_unsignalled, 1, "{:?}", s.violations);
    }

    #[test]
    fn a_next_token_not_above_the_revoked_one_is_caught() {
        let mut records = revoked_history(6);
        records.push(lost_as(250 * MS, 1, 1, 7, "revoked"));
        let s = check(&records, &[], &with_backend("redis"));
        assert_eq!(s.tokens_not_above_revoked, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("not larger than every revoked one")),
            "{:?}",
            s.violations
        );
    }

    #[test]
    fn a_loss_told_revoked_without_a_revocation_is_caught() {
        let records = [
            worker(0, 2, Step::acquired(Some(3))),
            Record::Trace(on_key(0, 2, 1, 3, TraceKind::Acquired)),
            lost_as(300 * MS, 2, 1, 3, "revoked"),
        ];
        let s = check(&records, &[], &with_backend("redis"));
        assert_eq!(s.revoked_unexplained, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("with no revocation")),
            "{:?}",
            s.violations
        );
    }

    #[test]
    fn a_renewal_after_a_release_request_is_caught() {
        let records = [
            worker(0, 0, Step::acquired(Some(1))),
            traced(0, 0, 1, TraceKind::Acquired, "default"),
            traced(130 * MS, 0, 1, TraceKind::RenewalSent, "default"),
            traced(131 * MS, 0, 1, TraceKind::Renewed, "default"),
            traced(200 * MS, 0, 1, TraceKind::ReleaseRequested, "default"),
            // Another lease of the same worker and key may renew.
            traced(210 * MS, 0, 2, TraceKind::Acquired, "default"),
            traced(340 * MS, 0, 2, TraceKind::RenewalSent, "default"),
            traced(350 * MS, 0, 2, TraceKind::ReleaseRequested, "default"),
        ];
        let s = check(&records, &[], &meta(Mode::Fence, &[]));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!((s.renewals_sent, s.releases_requested), (2, 2));

        let mut late = records.to_vec();
        late.push(traced(201 * MS, 0, 1, TraceKind::RenewalSent, "default"));
        let s = check(&late, &[], &meta(Mode::Fence, &[]));
        assert_eq!(s.renewals_after_release, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("after their lease's release was requested")),
            "{:?}",
            s.violations
        );
    }

    #[test]
    fn a_loss_after_the_servers_expiry_is_caught_with_each_leases_own_length() {
        // Lease 400 ms, last answered at 100 ms: the server lets go by 500 ms.
        let lease = |lost_at: u64| {
            vec![
                worker(0, 1, Step::acquired(Some(7))),
                traced(0, 1, 7, TraceKind::Acquired, "default"),
                traced(100 * MS, 1, 7, TraceKind::Renewed, "default"),
                traced(lost_at, 1, 7, TraceKind::Lost, "default"),
            ]
        };
        // The run's lease (1 s) would hide it: each lease's own length counts.
        let s = check(&lease(460 * MS), &[], &meta(Mode::Fence, &[]));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!(s.loss_margin.min, 40.0);
        let s = check(&lease(600 * MS), &[], &meta(Mode::Fence, &[]));
        assert_eq!(s.losses_after_expiry, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("after the server's expiry")),
            "{:?}",
            s.violations
        );
        // A worker stopped meanwhile hears of it when it runs again: no violation.
        let mut paused = lease(600 * MS);
        paused.push(fault_event(150 * MS, 1, "sigstop", Phase::Start, vec![1]));
        paused.push(fault_event(590 * MS, 1, "sigstop", Phase::Heal, vec![1]));
        let s = check(&paused, &[], &meta(Mode::Fence, &[]));
        assert_eq!(s.losses_after_expiry, 0, "{:?}", s.violations);
    }

    #[test]
    fn on_zookeeper_a_loss_is_measured_against_the_session_timeout() {
        // Session timeout 3 s; the renewal sent at 90 ms was answered at 100 ms:
        // the server cannot expire the session before 3.09 s, whatever the lease.
        let lease = |lost_at: u64| {
            vec![
                worker(0, 1, Step::acquired(Some(7))),
                traced(0, 1, 7, TraceKind::Acquired, "default"),
                traced(90 * MS, 1, 7, TraceKind::RenewalSent, "default"),
                traced(100 * MS, 1, 7, TraceKind::Renewed, "default"),
                traced(lost_at, 1, 7, TraceKind::Lost, "default"),
            ]
        };
        let mut m = meta(Mode::Fence, &[]);
        m.session_timeout_ms = Some(3000);
        let s = check(&lease(2090 * MS), &[], &m);
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!(s.loss_margin.min, 1000.0);
        let s = check(&lease(3200 * MS), &[], &m);
        assert_eq!(s.losses_after_expiry, 1);
        // A session the nemesis closed ended at once: not measured.
        let mut closed = lease(3200 * MS);
        closed.push(fault_event(
            150 * MS,
            1,
            SESSION_EXPIRY,
            Phase::Start,
            vec![1],
        ));
        closed.push(fault_event(
            650 * MS,
            1,
            SESSION_EXPIRY,
            Phase::Heal,
            vec![1],
        ));
        let s = check(&closed, &[], &m);
        assert_eq!(s.losses_after_expiry, 0, "{:?}", s.violations);
    }

    #[test]
    fn a_main_lease_lost_during_a_side_stall_is_caught() {
        let stall = [
            worker(150 * MS, 2, Step::acquired(Some(1))),
            fault_event(100 * MS, 1, SIDE_STALL, Phase::Start, vec![]),
            traced(150 * MS, 2, 1, TraceKind::Acquired, "default"),
            traced(300 * MS, 2, 1, TraceKind::Renewed, "default"),
            traced(200 * MS, 2, 2, TraceKind::Acquired, "side"),
            traced(560 * MS, 2, 2, TraceKind::Lost, "side"),
            fault_event(1100 * MS, 1, SIDE_STALL, Phase::Heal, vec![]),
        ];
        let s = check(&stall, &[], &meta(Mode::Fence, &[]));
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert_eq!(
            (s.side_stall_main_renewals, s.side_stall_side_losses),
            (1, 1)
        );

        // The main lease stops being renewed: lost at its give-up instant.
        let mut lost = stall.to_vec();
        lost.push(traced(660 * MS, 2, 1, TraceKind::Lost, "default"));
        let s = check(&lost, &[], &meta(Mode::Fence, &[]));
        assert_eq!(s.main_lost_in_side_stall, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("while only the side backend was stalled")),
            "{:?}",
            s.violations
        );

        // Unless a fault of the main backend touching that worker explains it.
        let mut excused = lost.clone();
        excused.push(fault_event(
            400 * MS,
            2,
            "proxy_blackhole",
            Phase::Start,
            vec![2],
        ));
        excused.push(fault_event(
            900 * MS,
            2,
            "proxy_blackhole",
            Phase::Heal,
            vec![2],
        ));
        let s = check(&excused, &[], &meta(Mode::Fence, &[]));
        assert_eq!(s.main_lost_in_side_stall, 0, "{:?}", s.violations);
    }

    #[test]
    fn callers_that_gave_up_and_mixed_leases_are_counted() {
        let attempt = |t, w, lease_ms| {
            worker(
                t,
                w,
                Step::Attempt {
                    lease_ms: Some(lease_ms),
                    side: false,
                    give_up: None,
                },
            )
        };
        let records = [
            attempt(0, 0, 400),
            worker(MS, 0, Step::acquired(Some(1))),
            worker(
                2 * MS,
                0,
                Step::GaveUp {
                    at: crate::history::GaveUpAt::Body,
                },
            ),
            // Worker 0 no longer believes it holds: no overlap.
            attempt(3 * MS, 1, 2500),
            worker(4 * MS, 1, Step::acquired(Some(2))),
            fault_event(5 * MS, 1, "kill_server", Phase::Start, vec![]),
            // 600 ms after the fault: later than a 400 ms lease, not a 2.5 s one.
            worker(605 * MS, 1, Step::Lost { cancelled: true }),
            attempt(606 * MS, 0, 400),
            worker(607 * MS, 0, Step::acquired(Some(3))),
            worker(608 * MS, 0, Step::Lost { cancelled: true }),
        ];
        let mut m = meta(Mode::Fence, &[]);
        m.lease_ms = 2500;
        let s = check(&records, &[], &m);
        assert_eq!(s.belief_overlaps, 0);
        assert_eq!(s.gave_up.get("body"), Some(&1));
        assert_eq!(
            s.acquisitions_by_lease_ms,
            BTreeMap::from([(400, 2), (2500, 1)])
        );
        assert_eq!((s.lost_signals, s.lost_late), (2, 1));
    }

    #[test]
    fn a_worker_that_ran_during_its_pause_is_caught() {
        let fault = |t, phase| {
            Record::Fault(FaultEvent {
                t,
                id: 1,
                fault: "sigstop".into(),
                phase,
                workers: vec![0],
                detail: String::new(),
            })
        };
        let records = [
            worker(0, 0, Step::acquired(Some(1))),
            fault(10_000_000, Phase::Start),
            worker(500_000_000, 0, Step::Leaving),
            fault(1_000_000_000, Phase::Heal),
        ];
        let s = check(&records, &[], &meta(Mode::Fence, &[]));
        assert_eq!(s.pause_breaches, 1);
        assert!(
            s.violations
                .iter()
                .any(|v| v.contains("during their pause")),
            "{:?}",
            s.violations
        );
    }
}
