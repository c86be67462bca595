//! A worker process: loops over locked read-modify-writes until its standard
//! input closes, printing one [`WorkerEvent`] per step (and, through
//! [`trace`], the runtime's events about its leases) on standard
//! output.
//!
//! Even-numbered workers use `on_lost = "cancel"` (the body stops when the lease
//! is lost: the lost-signal path); odd-numbered ones use `on_lost = "continue"`,
//! so a holder that was paused past its lease really sends its stale write and the
//! store's fencing has to refuse it.
//!
//! Each iteration picks its lease from [`LEASES`]. Most go through the annotated
//! functions below (one per lease and policy); an iteration whose caller is to
//! give up goes through `Registry::lock` instead, with a short timeout around
//! the acquisition, the body or the release, so that its future is dropped
//! there, as an HTTP server drops a handler whose client disconnected. A
//! fraction of iterations also hold a lock on the registry's second backend
//! (`side`, key `side:{key}`) across the whole attempt and body.
//!
//! With `--workload transfer` an iteration picks two distinct accounts out of
//! `--accounts`, takes both in one hold (`keys = [..]` in the attribute,
//! `Registry::lock_all` when the caller gives up somewhere), reads both
//! balances from the store with each key's own token (`fencing_token_of`),
//! and writes the debited and the credited balance in one request that the
//! store decides as a whole (see [`store`](crate::store)).
//!
//! With `--workload semaphore` every hold is one of [`PERMITS`] permits of
//! its key (`permits = 3` in the attribute, `LockBuilder::permits` when the
//! caller gives up somewhere), and the body read-modify-writes the counter
//! of its permit's slot, store key `{key}#{slot}`, with the permit's token:
//! the store fences each (key, slot) on its own.
//!
//! With `--workload rw` an iteration is a reader (`mode = "read"`, or
//! `LockBuilder::read`), a writer (`mode = "write"`, or
//! `LockBuilder::write`) or a plain lock of the same keys. Writers and plain
//! locks read-modify-write the key's counter with their token; a reader
//! reads it with the store's shared read twice, on entering and before
//! leaving, so that its hold spans its stay in the store's order (see
//! [`store`](crate::store)).

use std::sync::Mutex as SyncMutex;
use std::time::Duration;

use dlock_runtime::{LockError, LockGuard, Registry, ZooKeeperBackend, distributed_lock};
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
use tokio::io::AsyncBufReadExt as _;
use tokio::sync::Mutex;

use crate::clock::now_ns;
use crate::history::{GaveUpAt, Step, WorkerEvent};
use crate::store::{PairReply, ReadReply, StoreClient};
use crate::trace::{self, with_lease};

/// The leases iterations choose from (each iteration picks one; the annotated
/// functions below have one variant per lease).
pub(crate) const LEASES: [Duration; 3] = [
    Duration::from_millis(400),
    Duration::from_secs(1),
    Duration::from_millis(2500),
];

/// The longest of [`LEASES`]: how long a killed holder can keep a key.
pub(crate) const MAX_LEASE: Duration = Duration::from_millis(2500);

/// How long the main lock is waited for (the annotated functions' `wait = "2s"`).
const WAIT: Duration = Duration::from_secs(2);

/// How long a side lock is waited for.
const SIDE_WAIT: Duration = Duration::from_secs(1);

/// The registry's name of the second backend.
pub(crate) const SIDE: &str = "side";

/// A stay inside the lock the nemesis asks for, to strike while the body runs.
pub(crate) const LONG_HOLD: Duration = Duration::from_millis(2500);

/// What the workers do inside the lock.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Workload {
    /// One key per hold: increment its counter.
    #[default]
    Counter,
    /// Two accounts per hold: move an amount from one to the other.
    Transfer,
    /// One of [`PERMITS`] permits per hold: increment the counter of the
    /// permit's slot.
    Semaphore,
    /// Readers, writers and plain locks of the same keys: readers read the
    /// key's counter, writers and plain locks increment it.
    Rw,
}

/// The permits of the semaphore workload's keys (the `permits = 3` of its
/// annotated functions).
pub(crate) const PERMITS: u32 = 3;

/// Of the read-write workload's iterations: the share of readers, then of
/// writers (`mode = "write"`); the rest are plain locks.
const READERS: f64 = 0.55;
const WRITERS: f64 = 0.25;

/// Every account's balance before the first transfer.
pub(crate) const INITIAL_BALANCE: u64 = 1000;

/// The largest amount one transfer moves (never more than the debited
/// account holds).
const MAX_AMOUNT: u64 = 50;

/// What a worker is started with.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct WorkerArgs {
    /// Worker slot.
    #[arg(long)]
    pub(crate) id: usize,
    /// Incarnation of the slot (restarts count up).
    #[arg(long, default_value_t = 0)]
    pub(crate) inc: u32,
    /// Lock backend URL.
    #[arg(long)]
    pub(crate) url: String,
    /// URL of the second backend, registered as `side`.
    #[arg(long)]
    pub(crate) side_url: Option<String>,
    /// Loopback port of the fenced store.
    #[arg(long)]
    pub(crate) store_port: u16,
    /// Run id, part of every lock key.
    #[arg(long)]
    pub(crate) run: String,
    /// How many keys the workers share (counter workload).
    #[arg(long, default_value_t = 3)]
    pub(crate) keys: usize,
    /// What to do inside the lock.
    #[arg(long, value_enum, default_value_t = Workload::Counter)]
    pub(crate) workload: Workload,
    /// How many accounts transfers pick from (transfer workload).
    #[arg(long, default_value_t = 16)]
    pub(crate) accounts: usize,
    /// Longest time spent inside the lock between read and write.
    #[arg(long, default_value_t = 20)]
    pub(crate) hold_max_ms: u64,
    /// Share of iterations whose caller gives up somewhere (0–1).
    #[arg(long, default_value_t = 0.06)]
    pub(crate) give_up_rate: f64,
    /// Share of iterations that also hold a side lock (0–1; with `--side-url`).
    #[arg(long, default_value_t = 0.15)]
    pub(crate) side_rate: f64,
    /// Seed of this worker's choices.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// `host:port` of the ZooKeeper server itself (not the proxy), where a
    /// second client takes over this worker's session to close it.
    #[arg(long)]
    pub(crate) zk_server: Option<String>,
}

/// The line on a worker's standard input that asks it to have its ZooKeeper
/// session expire: a second client connects with the session's id and password
/// and closes it. (The client library does not hand the password out, so the
/// worker does this itself rather than report it to the nemesis.)
pub(crate) const EXPIRE_REQUEST: &str = "expire\n";

/// Whether worker `id` runs with `on_lost = "cancel"` (even ids) or `"continue"`.
pub(crate) fn cancels_on_loss(id: usize) -> bool {
    id.is_multiple_of(2)
}

/// A long stay the nemesis asks for, with the lease to use and, if any, a side
/// lock to hold across it. On the worker's standard input it is the line
/// `long <lease_ms> <side_lease_ms or 0>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LongRequest {
    /// Lease of the main lock.
    pub(crate) lease: Duration,
    /// Lease of a side lock held across it.
    pub(crate) side: Option<Duration>,
}

impl LongRequest {
    /// The line that asks for it.
    pub(crate) fn line(&self) -> String {
        format!(
            "long {} {}\n",
            self.lease.as_millis(),
            self.side.map_or(0, |s| s.as_millis())
        )
    }

    fn parse(line: &str) -> Option<LongRequest> {
        let mut words = line.split_whitespace();
        if words.next()? != "long" {
            return None;
        }
        let ms = |w: Option<&str>| w.and_then(|w| w.parse::<u64>().ok());
        let lease = ms(words.next()).unwrap_or(1000);
        let side = ms(words.next()).unwrap_or(0);
        Some(LongRequest {
            lease: Duration::from_millis(lease),
            side: (side > 0).then(|| Duration::from_millis(side)),
        })
    }
}

/// Why a step did not finish.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("store: {0}")]
    Store(anyhow::Error),
}

/// What one iteration locks and changes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// One key's counter.
    Counter(String),
    /// A transfer between two distinct accounts, both held in one hold.
    Transfer {
        /// The account debited.
        from: String,
        /// The account credited.
        to: String,
    },
    /// A permit of a key's semaphore: the counter of its slot.
    Permit(String),
    /// A reader of a key: reads its counter.
    Reader(String),
    /// A writer of a key (`mode = "write"`): increments its counter.
    Writer(String),
}

impl Target {
    /// The key events name first: the counter's, or the debited account.
    fn key(&self) -> &str {
        match self {
            Target::Counter(key)
            | Target::Permit(key)
            | Target::Reader(key)
            | Target::Writer(key) => key,
            Target::Transfer { from, .. } => from,
        }
    }

    /// Every key of a several-key hold, in the events' order (none for one key).
    fn keys(&self) -> Vec<String> {
        match self {
            Target::Transfer { from, to } => vec![from.clone(), to.clone()],
            _ => Vec::new(),
        }
    }
}

/// One iteration's choices.
#[derive(Debug, Clone, Copy)]
struct Plan {
    lease: Duration,
    /// Lease of a side lock held across the attempt.
    side: Option<Duration>,
    /// Where to give up, and the timeout there.
    give_up: Option<(GaveUpAt, Duration)>,
    /// The nemesis asked for a long stay.
    long: bool,
}

impl Plan {
    /// The timeout to put around `at`, if this iteration gives up there.
    fn cut(&self, at: GaveUpAt) -> Option<Duration> {
        self.give_up.filter(|(g, _)| *g == at).map(|(_, d)| d)
    }
}

struct Worker {
    args: WorkerArgs,
    registry: Registry,
    /// `None` after a call was cut short (its reply would be read by the next one).
    store: Mutex<Option<StoreClient>>,
    hold: Mutex<StdRng>,
    /// The nemesis' pending request, taken by the body that makes the long stay.
    long: std::sync::Arc<SyncMutex<Option<LongRequest>>>,
}

impl Worker {
    fn emit(&self, key: &str, ev: Step) {
        trace::line(&WorkerEvent {
            t: now_ns(),
            w: self.args.id,
            inc: self.args.inc,
            key: key.to_owned(),
            keys: Vec::new(),
            ev,
        });
    }

    /// An event about every key of `target`.
    fn emit_for(&self, target: &Target, ev: Step) {
        trace::line(&WorkerEvent {
            t: now_ns(),
            w: self.args.id,
            inc: self.args.inc,
            key: target.key().to_owned(),
            keys: target.keys(),
            ev,
        });
    }

    /// The lock key of a user key of the store.
    fn lock_key(&self, key: &str) -> String {
        format!("chaos:{}:{key}", self.args.run)
    }

    /// The body for `target`.
    async fn body(&self, target: &Target, long: bool) -> Result<(), StepError> {
        match target {
            Target::Counter(key) | Target::Writer(key) => self.read_modify_write(key, long).await,
            Target::Transfer { from, to } => self.transfer(target, from, to, long).await,
            Target::Permit(key) => self.permit_write(key, long).await,
            Target::Reader(key) => self.read_shared(key, long).await,
        }
    }

    /// How long to stay between read and write: a long stay the nemesis
    /// asked for (taken), or a short random one.
    async fn stay(&self, long: bool) -> Duration {
        if long {
            self.long.lock().unwrap_or_else(|p| p.into_inner()).take();
            LONG_HOLD
        } else {
            Duration::from_millis(
                self.hold
                    .lock()
                    .await
                    .random_range(0..=self.args.hold_max_ms),
            )
        }
    }

    /// Sleeps `hold` inside the lock; with `on_lost = "continue"`, records
    /// the loss signal if it comes meanwhile (and stays anyway). Whether it
    /// was recorded.
    async fn hold_for(&self, target: &Target, hold: Duration) -> bool {
        let held = dlock_runtime::current().expect("called inside the lock");
        let stay = tokio::time::sleep(hold);
        tokio::pin!(stay);
        if cancels_on_loss(self.args.id) {
            stay.await;
            return false;
        }
        tokio::select! {
            () = &mut stay => false,
            () = held.lost() => {
                self.emit_for(target, Step::Lost { cancelled: false });
                stay.await;
                true
            }
        }
    }

    /// The transfer body: fenced reads of both accounts (each with its own
    /// key's token), a stay, then both writes in one request.
    async fn transfer(
        &self,
        target: &Target,
        from: &str,
        to: &str,
        long: bool,
    ) -> Result<(), StepError> {
        let held = dlock_runtime::current().expect("called inside the lock");
        let tokens =
            [from, to].map(|key| held.fencing_token_of(&self.lock_key(key)).map(u64::from));
        self.emit_for(target, Step::acquired(tokens[0]));

        let mut slot = self.store.lock().await;
        let mut store = match slot.take() {
            Some(store) => store,
            None => StoreClient::connect(self.args.store_port)
                .await
                .map_err(StepError::Store)?,
        };
        let w = self.args.id;
        let read = store
            .read_pair(w, [(from, tokens[0]), (to, tokens[1])])
            .await
            .map_err(StepError::Store)?;
        let Some([(from_balance, from_version), (to_balance, to_version)]) = read else {
            *slot = Some(store);
            self.emit_for(target, Step::Fenced);
            return Ok(());
        };
        let hold = self.stay(long).await;
        let amount = self
            .hold
            .lock()
            .await
            .random_range(1..=MAX_AMOUNT)
            .min(from_balance);
        self.emit_for(
            target,
            Step::ReadBoth {
                balances: vec![from_balance, to_balance],
                versions: vec![from_version, to_version],
                tokens: tokens.to_vec(),
                amount,
                hold_ms: hold.as_millis() as u64,
            },
        );
        let noticed = self.hold_for(target, hold).await;
        let reply = store
            .write_pair(
                w,
                [
                    (from, tokens[0], from_version, from_balance - amount),
                    (to, tokens[1], to_version, to_balance + amount),
                ],
            )
            .await
            .map_err(StepError::Store)?;
        *slot = Some(store);
        let accepted = reply == PairReply::Taken;
        self.emit_for(target, Step::Wrote { accepted });
        if !accepted {
            self.emit_for(target, Step::Fenced);
        }
        if held.is_lost() && !noticed {
            // Only reached with `on_lost = "continue"`.
            self.emit_for(target, Step::Lost { cancelled: false });
        }
        self.emit_for(target, Step::Leaving);
        Ok(())
    }

    /// The body of a hold of one key: fenced read, a short stay, fenced write.
    async fn read_modify_write(&self, key: &str, long: bool) -> Result<(), StepError> {
        let held = dlock_runtime::current().expect("called inside the lock");
        let token = held.fencing_token().map(u64::from);
        self.emit(key, Step::acquired(token));
        self.increment(key, key, token, long).await
    }

    /// The body of a permit: the read-modify-write of its slot's counter.
    async fn permit_write(&self, key: &str, long: bool) -> Result<(), StepError> {
        let held = dlock_runtime::current().expect("called inside the lock");
        let token = held.fencing_token().map(u64::from);
        let slot = held.permit();
        self.emit(
            key,
            Step::Acquired {
                token,
                slot,
                shared: false,
            },
        );
        let cell = match slot {
            Some(slot) => format!("{key}#{slot}"),
            None => key.to_owned(),
        };
        self.increment(key, &cell, token, long).await
    }

    /// The body of a reader: a shared read, a short stay, a shared read again.
    async fn read_shared(&self, key: &str, long: bool) -> Result<(), StepError> {
        let held = dlock_runtime::current().expect("called inside the lock");
        let token = held.fencing_token().map(u64::from);
        self.emit(
            key,
            Step::Acquired {
                token,
                slot: None,
                shared: true,
            },
        );
        let mut slot = self.store.lock().await;
        let mut store = match slot.take() {
            Some(store) => store,
            None => StoreClient::connect(self.args.store_port)
                .await
                .map_err(StepError::Store)?,
        };
        let w = self.args.id;
        let read = store.shared_read(w, key, token).await;
        let (value, version) = match read.map_err(StepError::Store)? {
            ReadReply::Ok { value, version } => (value, version),
            ReadReply::Stale => {
                *slot = Some(store);
                self.emit(key, Step::Fenced);
                return Ok(());
            }
        };
        let hold = self.stay(long).await;
        self.emit(
            key,
            Step::Read {
                value,
                version,
                hold_ms: hold.as_millis() as u64,
            },
        );
        let noticed = self.hold_for(&Target::Reader(key.to_owned()), hold).await;
        let again = store.shared_read(w, key, token).await;
        let again = again.map_err(StepError::Store)?;
        *slot = Some(store);
        if matches!(again, ReadReply::Stale) {
            self.emit(key, Step::Fenced);
        }
        if held.is_lost() && !noticed {
            // Only reached with `on_lost = "continue"`.
            self.emit(key, Step::Lost { cancelled: false });
        }
        self.emit(key, Step::Leaving);
        Ok(())
    }

    /// Fenced read of `cell`, a short stay, fenced write of the value read
    /// plus one; events name `key`.
    async fn increment(
        &self,
        key: &str,
        cell: &str,
        token: Option<u64>,
        long: bool,
    ) -> Result<(), StepError> {
        let held = dlock_runtime::current().expect("called inside the lock");
        let mut slot = self.store.lock().await;
        let mut store = match slot.take() {
            Some(store) => store,
            None => StoreClient::connect(self.args.store_port)
                .await
                .map_err(StepError::Store)?,
        };
        let w = self.args.id;
        let (value, version) = match store.read(w, cell, token).await.map_err(StepError::Store)? {
            ReadReply::Ok { value, version } => (value, version),
            ReadReply::Stale => {
                *slot = Some(store);
                self.emit(key, Step::Fenced);
                return Ok(());
            }
        };
        let hold = self.stay(long).await;
        self.emit(
            key,
            Step::Read {
                value,
                version,
                hold_ms: hold.as_millis() as u64,
            },
        );
        let noticed = self.hold_for(&Target::Counter(key.to_owned()), hold).await;
        let accepted = store
            .write(w, cell, token, version, value + 1)
            .await
            .map_err(StepError::Store)?;
        *slot = Some(store);
        self.emit(key, Step::Wrote { accepted });
        if !accepted {
            self.emit(key, Step::Fenced);
        }
        if held.is_lost() && !noticed {
            // Only reached with `on_lost = "continue"`.
            self.emit(key, Step::Lost { cancelled: false });
        }
        self.emit(key, Step::Leaving);
        Ok(())
    }

    /// One attempt through the annotated function of the plan's lease.
    async fn annotated(&self, target: &Target, plan: Plan) -> Step {
        let (run, long) = (self.args.run.as_str(), plan.long);
        let lease = LEASES
            .iter()
            .position(|l| *l == plan.lease)
            .expect("leases come from LEASES");
        let call = async {
            let cancel = cancels_on_loss(self.args.id);
            match target {
                Target::Counter(key) => match (cancel, lease) {
                    (true, 0) => cancel_400ms(run, key, self, long).await,
                    (true, 1) => cancel_1s(run, key, self, long).await,
                    (true, _) => cancel_2500ms(run, key, self, long).await,
                    (false, 0) => continue_400ms(run, key, self, long).await,
                    (false, 1) => continue_1s(run, key, self, long).await,
                    (false, _) => continue_2500ms(run, key, self, long).await,
                },
                Target::Transfer { from, to } => match (cancel, lease) {
                    (true, 0) => transfer_cancel_400ms(run, from, to, target, self, long).await,
                    (true, 1) => transfer_cancel_1s(run, from, to, target, self, long).await,
                    (true, _) => transfer_cancel_2500ms(run, from, to, target, self, long).await,
                    (false, 0) => transfer_continue_400ms(run, from, to, target, self, long).await,
                    (false, 1) => transfer_continue_1s(run, from, to, target, self, long).await,
                    (false, _) => transfer_continue_2500ms(run, from, to, target, self, long).await,
                },
                Target::Permit(key) => match (cancel, lease) {
                    (true, 0) => permit_cancel_400ms(run, key, self, long).await,
                    (true, 1) => permit_cancel_1s(run, key, self, long).await,
                    (true, _) => permit_cancel_2500ms(run, key, self, long).await,
                    (false, 0) => permit_continue_400ms(run, key, self, long).await,
                    (false, 1) => permit_continue_1s(run, key, self, long).await,
                    (false, _) => permit_continue_2500ms(run, key, self, long).await,
                },
                Target::Reader(key) => match (cancel, lease) {
                    (true, 0) => read_cancel_400ms(run, key, self, long).await,
                    (true, 1) => read_cancel_1s(run, key, self, long).await,
                    (true, _) => read_cancel_2500ms(run, key, self, long).await,
                    (false, 0) => read_continue_400ms(run, key, self, long).await,
                    (false, 1) => read_continue_1s(run, key, self, long).await,
                    (false, _) => read_continue_2500ms(run, key, self, long).await,
                },
                Target::Writer(key) => match (cancel, lease) {
                    (true, 0) => write_cancel_400ms(run, key, self, long).await,
                    (true, 1) => write_cancel_1s(run, key, self, long).await,
                    (true, _) => write_cancel_2500ms(run, key, self, long).await,
                    (false, 0) => write_continue_400ms(run, key, self, long).await,
                    (false, 1) => write_continue_1s(run, key, self, long).await,
                    (false, _) => write_continue_2500ms(run, key, self, long).await,
                },
            }
        };
        match with_lease(plan.lease, call).await {
            Ok(()) => Step::Released,
            Err(StepError::Lock(LockError::Busy { .. })) => Step::Busy,
            // A store call cut short by the cancellation took its connection with it
            // (the slot stays empty), so no reply is ever read by the wrong call.
            Err(StepError::Lock(LockError::Lost { .. })) => Step::Lost { cancelled: true },
            Err(e) => Step::Error {
                message: e.to_string(),
            },
        }
    }

    /// One attempt through `Registry::lock`, as the annotated function does it,
    /// with the plan's timeout (if any) around the acquisition, the body or the
    /// release: when it fires, the future is dropped right there.
    /// For a transfer, both accounts through `Registry::lock_all`.
    async fn programmatic(&self, target: &Target, plan: Plan) -> Step {
        let builder = match target {
            Target::Counter(key) => self.registry.lock(self.lock_key(key)),
            Target::Transfer { from, to } => self
                .registry
                .lock_all([self.lock_key(from), self.lock_key(to)]),
            Target::Permit(key) => self.registry.lock(self.lock_key(key)).permits(PERMITS),
            Target::Reader(key) => self.registry.lock(self.lock_key(key)).read(),
            Target::Writer(key) => self.registry.lock(self.lock_key(key)).write(),
        };
        let acquire = with_lease(plan.lease, builder.wait(WAIT).lease(plan.lease).acquire());
        let acquired = match plan.cut(GaveUpAt::Acquire) {
            Some(limit) => match tokio::time::timeout(limit, acquire).await {
                Ok(acquired) => acquired,
                Err(_) => {
                    return Step::GaveUp {
                        at: GaveUpAt::Acquire,
                    };
                }
            },
            None => acquire.await,
        };
        let guard = match acquired {
            Ok(guard) => guard,
            Err(LockError::Busy { .. }) => return Step::Busy,
            Err(e) => {
                return Step::Error {
                    message: e.to_string(),
                };
            }
        };
        let body = async {
            let body = guard.scope(self.body(target, plan.long));
            if cancels_on_loss(self.args.id) {
                let lost = guard.lost();
                tokio::select! {
                    biased;
                    out = body => Some(out),
                    () = lost => None,
                }
            } else {
                Some(body.await)
            }
        };
        let finished = match plan.cut(GaveUpAt::Body) {
            Some(limit) => match tokio::time::timeout(limit, body).await {
                Ok(finished) => finished,
                Err(_) => {
                    // What a dropped handler does: the guard's Drop releases.
                    drop(guard);
                    return Step::GaveUp { at: GaveUpAt::Body };
                }
            },
            None => body.await,
        };
        let Some(out) = finished else {
            drop(guard);
            return Step::Lost { cancelled: true };
        };
        let release = guard.release();
        let released = match plan.cut(GaveUpAt::Release) {
            Some(limit) => match tokio::time::timeout(limit, release).await {
                Ok(released) => released,
                Err(_) => {
                    return Step::GaveUp {
                        at: GaveUpAt::Release,
                    };
                }
            },
            None => release.await,
        };
        match (out, released) {
            (Err(e), _) => Step::Error {
                message: e.to_string(),
            },
            // As the attribute does: a loss the body already saw (or one after its
            // end) is only logged; a failed release leaves the key to its lease.
            (Ok(()), Ok(()) | Err(LockError::Lost { .. })) => Step::Released,
            (Ok(()), Err(e)) => Step::Error {
                message: format!("release: {e}"),
            },
        }
    }

    /// Takes the side lock for `key`, held until [`Worker::release_side`].
    async fn take_side(&self, key: &str, lease: Duration) -> Option<LockGuard> {
        let label = format!("side:{key}");
        let acquired = with_lease(
            lease,
            self.registry
                .lock(format!("chaos:{}:{label}", self.args.run))
                .backend(SIDE)
                .wait(SIDE_WAIT)
                .lease(lease)
                .acquire(),
        )
        .await;
        match acquired {
            Ok(guard) => {
                self.emit(
                    &label,
                    Step::SideAcquired {
                        token: guard.fencing_token().map(u64::from),
                        lease_ms: lease.as_millis() as u64,
                    },
                );
                Some(guard)
            }
            Err(e) => {
                self.emit(
                    &label,
                    Step::SideFailed {
                        message: e.to_string(),
                    },
                );
                None
            }
        }
    }

    async fn release_side(&self, key: &str, guard: LockGuard) {
        let label = format!("side:{key}");
        let step = match guard.release().await {
            Ok(()) => Step::SideReleased { lost: false },
            Err(LockError::Lost { .. }) => Step::SideReleased { lost: true },
            Err(e) => Step::SideFailed {
                message: format!("release: {e}"),
            },
        };
        self.emit(&label, step);
    }
}

/// The annotated functions: one per lease of [`LEASES`] and `on_lost` policy.
macro_rules! annotated {
    ($($name:ident: lease = $lease:tt, on_lost = $on_lost:tt;)*) => {$(
        #[distributed_lock(
            key = "chaos:{run}:{key}",
            wait = "2s",
            lease = $lease,
            on_lost = $on_lost
        )]
        async fn $name(run: &str, key: &str, worker: &Worker, long: bool) -> Result<(), StepError> {
            worker.read_modify_write(key, long).await
        }
    )*};
}

annotated! {
    cancel_400ms: lease = "400ms", on_lost = "cancel";
    cancel_1s: lease = "1s", on_lost = "cancel";
    cancel_2500ms: lease = "2500ms", on_lost = "cancel";
    continue_400ms: lease = "400ms", on_lost = "continue";
    continue_1s: lease = "1s", on_lost = "continue";
    continue_2500ms: lease = "2500ms", on_lost = "continue";
}

/// The transfer workload's annotated functions: both accounts in one hold.
macro_rules! annotated_transfers {
    ($($name:ident: lease = $lease:tt, on_lost = $on_lost:tt;)*) => {$(
        #[distributed_lock(
            keys = ["chaos:{run}:{from}", "chaos:{run}:{to}"],
            wait = "2s",
            lease = $lease,
            on_lost = $on_lost
        )]
        async fn $name(
            run: &str,
            from: &str,
            to: &str,
            target: &Target,
            worker: &Worker,
            long: bool,
        ) -> Result<(), StepError> {
            worker.transfer(target, from, to, long).await
        }
    )*};
}

annotated_transfers! {
    transfer_cancel_400ms: lease = "400ms", on_lost = "cancel";
    transfer_cancel_1s: lease = "1s", on_lost = "cancel";
    transfer_cancel_2500ms: lease = "2500ms", on_lost = "cancel";
    transfer_continue_400ms: lease = "400ms", on_lost = "continue";
    transfer_continue_1s: lease = "1s", on_lost = "continue";
    transfer_continue_2500ms: lease = "2500ms", on_lost = "continue";
}

/// The semaphore workload's annotated functions: one permit of [`PERMITS`].
macro_rules! annotated_permits {
    ($($name:ident: lease = $lease:tt, on_lost = $on_lost:tt;)*) => {$(
        #[distributed_lock(
            key = "chaos:{run}:{key}",
            permits = 3,
            wait = "2s",
            lease = $lease,
            on_lost = $on_lost
        )]
        async fn $name(run: &str, key: &str, worker: &Worker, long: bool) -> Result<(), StepError> {
            worker.permit_write(key, long).await
        }
    )*};
}

annotated_permits! {
    permit_cancel_400ms: lease = "400ms", on_lost = "cancel";
    permit_cancel_1s: lease = "1s", on_lost = "cancel";
    permit_cancel_2500ms: lease = "2500ms", on_lost = "cancel";
    permit_continue_400ms: lease = "400ms", on_lost = "continue";
    permit_continue_1s: lease = "1s", on_lost = "continue";
    permit_continue_2500ms: lease = "2500ms", on_lost = "continue";
}

/// The read-write workload's annotated functions: readers and writers (its
/// plain locks are the counter workload's functions).
macro_rules! annotated_rw {
    ($($name:ident: mode = $mode:tt, lease = $lease:tt, on_lost = $on_lost:tt, body = $body:ident;)*) => {$(
        #[distributed_lock(
            key = "chaos:{run}:{key}",
            mode = $mode,
            wait = "2s",
            lease = $lease,
            on_lost = $on_lost
        )]
        async fn $name(run: &str, key: &str, worker: &Worker, long: bool) -> Result<(), StepError> {
            worker.$body(key, long).await
        }
    )*};
}

annotated_rw! {
    read_cancel_400ms: mode = "read", lease = "400ms", on_lost = "cancel", body = read_shared;
    read_cancel_1s: mode = "read", lease = "1s", on_lost = "cancel", body = read_shared;
    read_cancel_2500ms: mode = "read", lease = "2500ms", on_lost = "cancel", body = read_shared;
    read_continue_400ms: mode = "read", lease = "400ms", on_lost = "continue", body = read_shared;
    read_continue_1s: mode = "read", lease = "1s", on_lost = "continue", body = read_shared;
    read_continue_2500ms: mode = "read", lease = "2500ms", on_lost = "continue", body = read_shared;
    write_cancel_400ms: mode = "write", lease = "400ms", on_lost = "cancel", body = read_modify_write;
    write_cancel_1s: mode = "write", lease = "1s", on_lost = "cancel", body = read_modify_write;
    write_cancel_2500ms: mode = "write", lease = "2500ms", on_lost = "cancel", body = read_modify_write;
    write_continue_400ms: mode = "write", lease = "400ms", on_lost = "continue", body = read_modify_write;
    write_continue_1s: mode = "write", lease = "1s", on_lost = "continue", body = read_modify_write;
    write_continue_2500ms: mode = "write", lease = "2500ms", on_lost = "continue", body = read_modify_write;
}

/// Connects to a `zk://` URL, trying again while it fails, and keeps the
/// backend's own type (for its session).
async fn connect_zk(id: usize, url: &str) -> ZooKeeperBackend {
    loop {
        match ZooKeeperBackend::connect(url).await {
            Ok(backend) => break backend,
            Err(e) => {
                eprintln!("worker {id}: connect: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Has a second client, connected straight to `server`, take over the
/// backend's current session and close it: the server ends the session (its
/// nodes go) as its expiry would.
async fn expire_session(id: usize, zk: &ZooKeeperBackend, server: &str) {
    let Some(session) = zk.session_for_tests() else {
        eprintln!("worker {id}: expire: no session");
        return;
    };
    let started = std::time::Instant::now();
    let thief = zookeeper_client::Client::connector()
        .with_session(session.clone())
        .with_session_timeout(crate::run::ZK_SESSION_TIMEOUT)
        .connect(server)
        .await;
    match thief {
        Ok(thief) => {
            drop(thief); // Closes the session.
            eprintln!(
                "worker {id}: session {} closed by a second client ({:?})",
                session.id(),
                started.elapsed()
            );
        }
        Err(e) => eprintln!("worker {id}: expire: cannot take over the session: {e}"),
    }
}

/// Connects to `url`, trying again while it fails (a restarted worker may come
/// up while the server is down).
async fn connect(id: usize, url: &str) -> std::sync::Arc<dyn dlock_runtime::LockBackend> {
    loop {
        match dlock_runtime::connect(url).await {
            Ok(backend) => break backend,
            Err(e) => {
                eprintln!("worker {id}: connect: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Runs a worker until standard input closes.
pub(crate) async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    trace::start(args.id, args.inc)?;
    let zk = if args.url.starts_with("zk://") {
        Some(connect_zk(args.id, &args.url).await)
    } else {
        None
    };
    let main = match &zk {
        Some(zk) => std::sync::Arc::new(zk.clone()),
        None => connect(args.id, &args.url).await,
    };
    let mut builder = Registry::builder().default_backend(main);
    if let Some(side) = &args.side_url {
        builder = builder.backend(SIDE, connect(args.id, side).await);
    }
    let registry = builder.build();
    dlock_runtime::init(registry.clone())?;

    let long = std::sync::Arc::new(SyncMutex::new(None));
    let expire = zk
        .zip(args.zk_server.clone())
        .map(|(zk, server)| (args.id, zk, server));
    let stop = read_stdin(long.clone(), expire);
    let mut rng = StdRng::seed_from_u64(args.seed ^ ((args.id as u64) << 32) ^ u64::from(args.inc));
    let give_up_rate = args.give_up_rate.clamp(0.0, 1.0);
    let side_rate = if args.side_url.is_some() {
        args.side_rate.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let worker = Worker {
        store: Mutex::new(None),
        hold: Mutex::new(StdRng::seed_from_u64(rng.random())),
        long,
        registry,
        args,
    };
    let keys: Vec<String> = match worker.args.workload {
        Workload::Counter | Workload::Semaphore | Workload::Rw => {
            (0..worker.args.keys).map(|k| format!("k{k}")).collect()
        }
        Workload::Transfer => crate::store::account_keys(worker.args.accounts),
    };
    if worker.args.workload == Workload::Transfer && keys.len() < 2 {
        anyhow::bail!("a transfer needs two accounts at least (--accounts)");
    }
    while !*stop.borrow() {
        let mut one = || keys[rng.random_range(0..keys.len())].clone();
        let target = match worker.args.workload {
            Workload::Counter => Target::Counter(one()),
            Workload::Semaphore => Target::Permit(one()),
            Workload::Rw => {
                let key = one();
                match rng.random::<f64>() {
                    x if x < READERS => Target::Reader(key),
                    x if x < READERS + WRITERS => Target::Writer(key),
                    _ => Target::Counter(key),
                }
            }
            Workload::Transfer => {
                let from = rng.random_range(0..keys.len());
                // Any other account: a draw among the n - 1 others.
                let to = (from + rng.random_range(1..keys.len())) % keys.len();
                Target::Transfer {
                    from: keys[from].clone(),
                    to: keys[to].clone(),
                }
            }
        };
        let key = target.key();
        let plan = match *worker.long.lock().unwrap_or_else(|p| p.into_inner()) {
            // Stays pending until a body makes the stay (a busy key does not).
            Some(long) => Plan {
                lease: long.lease,
                side: long.side.filter(|_| worker.args.side_url.is_some()),
                give_up: None,
                long: true,
            },
            None => Plan {
                lease: LEASES[rng.random_range(0..LEASES.len())],
                side: rng
                    .random_bool(side_rate)
                    .then(|| LEASES[rng.random_range(0..LEASES.len())]),
                give_up: rng.random_bool(give_up_rate).then(|| {
                    let at = GaveUpAt::ALL[rng.random_range(0..GaveUpAt::ALL.len())];
                    let limit = match at {
                        // Acquisitions take a round trip or more (a wait when busy).
                        GaveUpAt::Acquire => Duration::from_micros(rng.random_range(0..20_000)),
                        // Anywhere from before the read to during the write.
                        GaveUpAt::Body => Duration::from_micros(
                            rng.random_range(0..(worker.args.hold_max_ms + 5) * 1000),
                        ),
                        // A release is one round trip (a fast one on SQLite),
                        // often shorter than the timer's millisecond tick: half
                        // of these give up at the release's first await (a zero
                        // limit), the rest within half a millisecond.
                        GaveUpAt::Release => {
                            Duration::from_micros(rng.random_range(0..1000u64).saturating_sub(500))
                        }
                    };
                    (at, limit)
                }),
                long: false,
            },
        };
        worker.emit_for(
            &target,
            Step::Attempt {
                lease_ms: Some(plan.lease.as_millis() as u64),
                side: plan.side.is_some(),
                give_up: plan.give_up.map(|(at, _)| at),
            },
        );
        let side = match plan.side {
            Some(lease) => worker.take_side(key, lease).await,
            None => None,
        };
        let step = if plan.give_up.is_some() {
            worker.programmatic(&target, plan).await
        } else {
            worker.annotated(&target, plan).await
        };
        let error = matches!(step, Step::Error { .. });
        worker.emit_for(&target, step);
        if let Some(guard) = side {
            worker.release_side(key, guard).await;
        }
        if error {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Whatever is still held or being released (a release a caller gave up on).
    let report = dlock_runtime::shutdown(Duration::from_secs(5)).await;
    if report.unfinished > 0 {
        eprintln!(
            "worker {}: shutdown left {} releases unfinished",
            worker.args.id, report.unfinished
        );
    }
    trace::finish();
    Ok(())
}

/// Reads the orchestrator's lines: `long …` asks for a long stay (see
/// [`LongRequest`]), `expire` for the end of the ZooKeeper session (see
/// [`EXPIRE_REQUEST`]; with `expire`: the worker id, its backend, the server);
/// the end of input means stop (the returned flag becomes `true`).
fn read_stdin(
    long: std::sync::Arc<SyncMutex<Option<LongRequest>>>,
    expire: Option<(usize, ZooKeeperBackend, String)>,
) -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if line.trim() == EXPIRE_REQUEST.trim() {
                if let Some((id, zk, server)) = &expire {
                    expire_session(*id, zk, server).await;
                }
            } else if let Some(request) = LongRequest::parse(&line) {
                *long.lock().unwrap_or_else(|p| p.into_inner()) = Some(request);
            }
        }
        let _ = tx.send(true);
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_requests_round_trip() {
        for request in [
            LongRequest {
                lease: Duration::from_millis(400),
                side: None,
            },
            LongRequest {
                lease: Duration::from_secs(1),
                side: Some(Duration::from_millis(2500)),
            },
        ] {
            assert_eq!(LongRequest::parse(request.line().trim()), Some(request));
        }
        assert_eq!(LongRequest::parse("short"), None);
    }
}
