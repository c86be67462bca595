//! Session mode (`?mode=session`), shared by PostgreSQL and MySQL: a
//! server-side lock (`pg_advisory_lock`, `GET_LOCK`) on a **dedicated
//! connection per held lock**.
//!
//! - **Acquire**: one round trip on a connection of the session pool takes
//!   the lock — waiting server-side, so the server hands the key over the
//!   moment it is free — and bumps the key's fencing counter row in the same
//!   statement (a hybrid token, like the lease table's). A wait is cut into
//!   slices of at most a third of the lease, so that a grant always comes
//!   back early enough to be used; the slices of one acquisition share its
//!   `wait` budget (the first attempt's instant is kept per owner). The
//!   server's wait ends [`answer_margin`] before that budget does, so its
//!   busy answer is back in time and the wait loop's last look at the key,
//!   at its deadline, is a quick try.
//! - **Held**: a task owns the connection. The watchdog's renewal is a ping
//!   of it that also moves the server's idle limit (PostgreSQL
//!   `idle_session_timeout`, MySQL `wait_timeout`) to the new lease end, so a
//!   frozen holder loses the lock on the server too. A ping that fails or
//!   times out, or (PostgreSQL) the connection closing under it —
//!   `pg_terminate_backend`, a restart — closes the connection and cancels
//!   the lease's `lost` token at once. A lease not renewed by its end
//!   (`watchdog = false`, the end of `hold_at_least`) is unlocked there.
//! - **Release**: unlock everything the connection holds; only then does it
//!   go back for reuse. Any failure, timeout or cancellation on the way
//!   closes it instead: a connection whose lock state is unknown is never
//!   reused, and closing it ends the server session, which drops its locks.
//! - **Revocation** ends the holder's connection from another one, in a
//!   transaction that first inserts the grant's *end mark*: a row of the
//!   counter table under a key of its own ([`end_mark`]: the key and the
//!   grant's token), with no stored key (so never listed) and a token a
//!   [`MARK_LIFE`] ahead of the clock (so collected with the other old rows
//!   that much later). The mark is committed only if the connection was
//!   ended: a revocation refused (the role may not end it) leaves none.
//!   The holder whose connection ends inserts the same mark itself, over
//!   another connection: if a revocation's mark is there — or still being
//!   written, as the insert waits for the revocation's transaction — its
//!   insert adds nothing, and its renewals answer
//!   [`Revoked`](Renewal::Revoked); otherwise the connection ended for
//!   another reason (a restart, a network reset, a session killed by
//!   something else), and the loss is reported at once. The mark
//!   is also what makes two revocations at once revoke the holder once:
//!   only the one whose insert added it ends the connection and names the
//!   holder.
//!
//! # Semaphores and readers
//!
//! A *share* (a permit of a semaphore; on PostgreSQL also a reader) is
//! decided here once for both databases, each bringing its statements
//! ([`SessionDb::enter`], [`SessionDb::try_slots`], [`SessionDb::grant`]),
//! on a dedicated connection like a plain lock's:
//!
//! - **Gate**: the share first takes its key's *gate* ([`gate_hash`]: a
//!   session lock of its own, held for the few statements of the attempt),
//!   so the shares of one key are decided one at a time; the gate is left
//!   only after the grant's rows are committed, so the next share reads
//!   them. Under the gate, the share reads the mode recorded with the key
//!   (the `permits` column of the key's counter row: `NULL` a plain lock,
//!   `0` readers, `N` a semaphore) and checks it against the holders the
//!   server shows: another mode while the key has holders is
//!   [`HoldMode::mismatch`]; a key without holders takes the share's mode.
//!   Two sessions asking for 2 and 3 permits at once are therefore never
//!   both granted: the second through the gate finds the first's holder and
//!   its recorded count.
//! - **Slots**: a permit is the session lock of a *slot key*
//!   ([`slot_hash`] of the key, the kind and the slot: never the name of any
//!   key, nor of another kind's slot); the walk tries `0..N` in order,
//!   [`SLOTS_PER_TRY`] slots a round trip, each round trip taking at most
//!   one (`CASE` stops at the first lock taken), so a grant holds the
//!   lowest free slot. A reader takes a free *reader slot* the same way
//!   (uncounted): the slot's counter row keeps each reader's own token and
//!   holder record, for `inspect` and `revoke`.
//! - **Tokens**: the slot's counter row is bumped with the hybrid rule
//!   (`max(token + 1, clock µs)`), so permits' tokens increase per (key,
//!   slot); a reader's token is the key's row bumped (the one sequence
//!   plain locks — the write mode — bump too), copied to its slot's row.
//!   The rows are collected like the plain counters, after the retention.
//! - **Waiting**: a share never waits on the server (it could wait on one
//!   slot only): a busy answer is tried again after a back-off of 5 ms
//!   doubling up to `poll` (at most 250 ms), and a release in this process
//!   wakes the waiters of the key at once.
//! - **Held, lost, released, revoked**: as a plain lock: the connection is
//!   the hold (its death loses the share, and only this share), the ping
//!   renews it, the release unlocks everything it holds (the share's key
//!   lock, its slot, a gate left by a cancelled attempt), the revocation
//!   ends the connection of every holder of the key, each with its own end
//!   mark. An attempt dropped at any `.await` leaves its connection to
//!   [`Abandoned`], which unlocks it (or ends it) before any reuse: no slot,
//!   gate or key lock stays behind.
//!
//! PostgreSQL and MySQL differ in how a share meets plain locks; see
//! `postgres/session.rs` and `mysql/session.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::engine::holder_text;
use super::pool::{DeadConnections, is_connection_error, timed_out};
use crate::backend::{AcquireRequest, Attempt, HeldEntry, HoldMode, KeyEntry, Lease, Renewal};
use crate::error::BackendError;
use crate::token::FencingToken;

/// What one attempt to lock found.
pub enum Locked {
    /// The lock is ours; the fencing token.
    Yes(u64),
    /// Busy. `clean`: the connection holds nothing (a try that failed);
    /// otherwise it must be unlocked before reuse (a timed-out wait may
    /// have been granted in the same instant).
    Busy { clean: bool },
    /// The key's holders hold it in another mode (a semaphore's permits):
    /// the connection holds nothing.
    Mismatch(HoldMode),
}

/// What a share (a reader, a permit) found on entering its key's gate.
pub enum Entry {
    /// The key may be shared in the mode asked: the slots are walked next.
    Open,
    /// A writer holds or waits for the key (or a plain lock holds it where
    /// the mode asked is compatible).
    Busy,
    /// The key's holders hold it in this other mode.
    Mismatch(HoldMode),
}

/// Which kind of slot a share takes: a semaphore's permit (`0..permits`),
/// or a reader's own number (the lowest free one; readers are not counted,
/// the slot only gives each reader a row of its own for its token and
/// holder record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// One permit of a semaphore.
    Permit,
    /// A reader's share.
    Reader,
}

impl SlotKind {
    /// The kind of slot `mode` takes (`None`: a plain lock takes the key).
    pub fn of(mode: HoldMode) -> Option<SlotKind> {
        match mode {
            HoldMode::Exclusive => None,
            HoldMode::Shared => Some(SlotKind::Reader),
            HoldMode::Permit { .. } => Some(SlotKind::Permit),
        }
    }

    fn byte(self) -> u8 {
        match self {
            SlotKind::Permit => b'p',
            SlotKind::Reader => b'r',
        }
    }
}

/// One database's session locks.
pub trait SessionDb: Send + Sync + 'static {
    /// A dedicated connection. Dropping it closes it (never reused).
    type Conn: Send + 'static;

    /// A connection for a new attempt: a clean one kept for reuse, unless
    /// `fresh`, or a new one.
    fn open(&self, fresh: bool) -> BoxFuture<'_, Result<Self::Conn, sqlx::Error>>;

    /// How many connections [`open`](Self::open) may hand out that were
    /// opened earlier (and may have died since).
    fn pooled(&self) -> usize;

    /// Locks `key` within `wait` (zero: try once), and on success bumps its
    /// fencing counter, stores the key and its `holder` record (text) in the
    /// counter's row (or the record where the server shows it with the
    /// connection, for [`inspect`](Self::inspect) to join), and sets the
    /// server's idle limit to `ttl` — on PostgreSQL already before it waits,
    /// so that a client stalled between two slices of a wait has its
    /// session, and whatever it holds meanwhile, ended by the server.
    fn lock<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        holder: &'a str,
        wait: Duration,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Locked, sqlx::Error>>;

    /// Enters `key`'s gate for a share in mode `asked` (see
    /// [the shared slots](self#semaphores-and-readers)): serialises the
    /// shares of the key and checks the mode recorded with its holders.
    /// Whatever the answer, the connection may hold locks afterwards: the
    /// caller unlocks it unless the share is granted. Before the gate is
    /// taken, the server's idle limit is set to `idle` (the attempt's own
    /// bound): a client that stalls while it holds the gate — frozen, or
    /// cut off with its sockets left open — has given its attempt up by
    /// then, and the server ends its session, freeing the gate for the
    /// key's other shares. The grant sets the holder's limit; an unlock
    /// clears it.
    fn enter<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        asked: HoldMode,
        idle: Duration,
    ) -> BoxFuture<'a, Result<Entry, sqlx::Error>>;

    /// Tries the slots `from..to` of `kind` of `key` in order, without
    /// waiting, and takes the first free one (and no other): its number.
    fn try_slots<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        kind: SlotKind,
        from: u32,
        to: u32,
    ) -> BoxFuture<'a, Result<Option<u32>, sqlx::Error>>;

    /// Completes a share holding `slot`: records the mode with the key,
    /// bumps the token (the slot's own for a permit, the key's one sequence
    /// for a reader) into the slot's counter row with the key and the
    /// `holder` record, sets the server's idle limit to `ttl` and leaves the
    /// gate. `Err(held)` where the key turned out held in another mode
    /// (the connection must then be unlocked).
    fn grant<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a str,
        asked: HoldMode,
        slot: u32,
        holder: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Result<u64, HoldMode>, sqlx::Error>>;

    /// A round trip that also sets the server's idle limit to `ttl`.
    fn ping<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Unlocks everything the connection holds and clears its idle limit.
    fn unlock<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Ends, from another connection, the statement `conn` runs (a lock
    /// wait whose caller went away), so the server grants it nothing later;
    /// answers whether it did. Afterwards `conn`'s next statement first reads
    /// the ended one's answer. Where it answers `false`, the connection is
    /// closed instead.
    fn cancel<'a>(&'a self, conn: &'a Self::Conn) -> BoxFuture<'a, bool>;

    /// Ends `conn`'s server session from another connection (whatever it
    /// runs or holds ends with it); answers whether it did.
    fn terminate<'a>(&'a self, conn: &'a Self::Conn) -> BoxFuture<'a, bool>;

    /// Resolves when the idle connection is found closed (never, where the
    /// driver cannot watch an idle connection).
    fn watch<'a>(&'a self, conn: &'a mut Self::Conn) -> BoxFuture<'a, String>;

    /// Keeps a clean connection (no lock, no idle limit) for reuse.
    fn recycle(&self, conn: Self::Conn);

    /// The backend error for a failed statement.
    fn classify(&self, err: sqlx::Error) -> BackendError;

    /// Who holds `key` on the server (its holder record from the counter's
    /// row), and how many wait for it where the server shows it.
    fn inspect<'a>(&'a self, key: &'a str)
    -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>>;

    /// The held keys whose counter row names a key under `prefix`.
    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>>;

    /// Ends the server session that holds `key`, or answers why it may not:
    /// in one transaction, inserts the grant's [`end_mark`] (of kind
    /// [`MarkKind::Revoked`]) and ends the session, committing only if it
    /// did. Names the holder only if its insert added the mark.
    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>>;

    /// Inserts, from another connection, the [`end_mark`] of the grant
    /// `mark` (of kind [`MarkKind::Ended`]), waiting for a revocation still
    /// writing the same mark: answers whether a revocation's mark was there
    /// (the insert added nothing).
    fn ended(&self, mark: i64) -> BoxFuture<'_, Result<bool, sqlx::Error>>;
}

/// Who wrote a grant's [`end_mark`], stored as its holder text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MarkKind {
    /// A revocation, before it ended the holder's connection.
    Revoked,
    /// The holder, after its connection ended otherwise.
    Ended,
}

impl MarkKind {
    /// The mark's holder text.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            MarkKind::Revoked => "dlock: revoked",
            MarkKind::Ended => "dlock: ended",
        }
    }
}

/// How much longer than the counter rows an end mark is kept: a holder
/// learns that its connection ended at its next renewal at the latest
/// (MySQL cannot watch an idle connection), so its mark must outlast a
/// third of the longest lease in use, plus the collector's retention.
pub(super) const MARK_LIFE: Duration = Duration::from_secs(3600);

/// [`MARK_LIFE`] in microseconds.
pub(super) const MARK_LIFE_US: i64 = MARK_LIFE.as_micros() as i64;

/// The counter-table key of the end mark of `key`'s grant with `token`
/// (of `slot`, for a share): the first 8 bytes of the SHA-256 of `0xFF`,
/// the key and the token (big-endian) — for a share, `0xFF`, the key,
/// `0xFF`, the slot's kind and number, and the token. `0xFF` never occurs
/// in UTF-8, so no key's own name ([`session_hash`]) nor a slot's
/// ([`slot_hash`]) is built from the same bytes, and the two forms never
/// meet (a key cannot contain the second `0xFF`).
pub(crate) fn end_mark(key: &str, slot: Option<(SlotKind, u32)>, token: u64) -> i64 {
    let mut bytes = vec![0xFF];
    bytes.extend_from_slice(key.as_bytes());
    if let Some((kind, slot)) = slot {
        bytes.extend_from_slice(&[0xFF, kind.byte()]);
        bytes.extend_from_slice(&slot.to_be_bytes());
    }
    bytes.extend_from_slice(&token.to_be_bytes());
    first_64_bits(&bytes)
}

/// The first 8 bytes of the SHA-256 of `bytes`, big-endian, signed.
fn first_64_bits(bytes: &[u8]) -> i64 {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(bytes);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The 64-bit name of slot `slot` of `kind` of `key` (its advisory lock,
/// its `GET_LOCK` name, its counter row): the first 8 bytes of the SHA-256
/// of `0xFE`, the key, `0xFF`, the kind's byte and the slot (big-endian).
/// `0xFE` and `0xFF` never occur in UTF-8: no key's own name
/// ([`session_hash`]) is built from the same bytes.
pub(crate) fn slot_hash(key: &str, kind: SlotKind, slot: u32) -> i64 {
    let mut bytes = vec![0xFE];
    bytes.extend_from_slice(key.as_bytes());
    bytes.extend_from_slice(&[0xFF, kind.byte()]);
    bytes.extend_from_slice(&slot.to_be_bytes());
    first_64_bits(&bytes)
}

/// The 64-bit name of `key`'s gate: the lock that orders the shares of a
/// key while each checks the mode and takes its slot (the SHA-256 of
/// `0xFD` and the key).
pub(crate) fn gate_hash(key: &str) -> i64 {
    let mut bytes = vec![0xFD];
    bytes.extend_from_slice(key.as_bytes());
    first_64_bits(&bytes)
}

/// The 64-bit name of `key`'s waiting-writer mark (PostgreSQL): held in
/// shared mode by each writer waiting for the key, tried by readers (the
/// SHA-256 of `0xFC` and the key).
pub(crate) fn writer_mark_hash(key: &str) -> i64 {
    let mut bytes = vec![0xFC];
    bytes.extend_from_slice(key.as_bytes());
    first_64_bits(&bytes)
}

/// The longest holder record a counter row stores, in bytes.
pub(super) const HOLDER_MAX: usize = 1024;

/// The longest server-side wait of one attempt.
const MAX_SLICE: Duration = Duration::from_secs(30);

/// How long before the end of a wait budget with `remaining` left the
/// server stops waiting: a quarter of it, at most 100 ms. The busy answer
/// then comes back before the caller's deadline even on a loaded machine,
/// and the wait loop looks at the key once more at the deadline.
fn answer_margin(remaining: Duration) -> Duration {
    (remaining / 4).min(Duration::from_millis(100))
}

/// The longest pause of a waiting share (a reader, a permit) between its
/// attempts: its first pause is [`FIRST_SHARE_POLL`], doubled at each.
const MAX_SHARE_POLL: Duration = Duration::from_millis(250);

/// The first pause of a waiting share.
const FIRST_SHARE_POLL: Duration = Duration::from_millis(5);

/// How many slots one round trip of the slot walk tries.
const SLOTS_PER_TRY: u32 = 64;

enum Owner<C> {
    /// Between the attempts of one acquisition: when it began, and the
    /// connection it waits on (kept so that a grant racing a timeout is
    /// never lost track of). `polls`: how many busy attempts of a share
    /// came before (its back-off).
    Waiting {
        since: Instant,
        conn: Option<C>,
        polls: u32,
    },
    /// Held: the task that owns the connection.
    Held(Hold),
    /// Revoked: the connection was ended by a revocation; kept until the
    /// holder's release, for its renewals to answer
    /// [`Revoked`](Renewal::Revoked).
    Revoked,
}

struct Hold {
    id: u64,
    token: u64,
    /// The permit's slot (`None` for a plain lock and a reader).
    permit: Option<u32>,
    commands: mpsc::UnboundedSender<Command>,
}

enum Command {
    Ping {
        ttl: Duration,
        reply: oneshot::Sender<Renewal>,
    },
    Release {
        reply: oneshot::Sender<()>,
    },
}

type Owners<C> = Mutex<HashMap<String, Owner<C>>>;

/// The session locks of one backend, by owner.
pub(super) struct Sessions<S: SessionDb> {
    db: Arc<S>,
    owners: Arc<Owners<S::Conn>>,
    timeout: Duration,
    /// The longest pause of a waiting share between its attempts.
    poll: Duration,
    next_id: AtomicU64,
}

fn lock_owners<C>(owners: &Owners<C>) -> MutexGuard<'_, HashMap<String, Owner<C>>> {
    owners.lock().unwrap_or_else(|p| p.into_inner())
}

impl<S: SessionDb> Sessions<S> {
    pub(super) fn new(db: S, timeout: Duration, poll: Duration) -> Self {
        Sessions {
            db: Arc::new(db),
            owners: Arc::default(),
            timeout,
            poll: poll.min(MAX_SHARE_POLL),
            next_id: AtomicU64::new(0),
        }
    }

    /// Who holds `key` on the server, within the timeout.
    pub(super) async fn inspect(&self, key: &str) -> Result<Option<KeyEntry>, BackendError> {
        tokio::time::timeout(self.timeout, self.db.inspect(key))
            .await
            .unwrap_or_else(|_| Err(timed_out("inspect", self.timeout)))
    }

    /// The held keys under `prefix`, within the timeout.
    pub(super) async fn list(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<KeyEntry>, BackendError> {
        tokio::time::timeout(self.timeout, self.db.list(prefix, limit))
            .await
            .unwrap_or_else(|_| Err(timed_out("list", self.timeout)))
    }

    /// Takes `key` from its holder, within the timeout.
    pub(super) async fn revoke(&self, key: &str) -> Result<Vec<HeldEntry>, BackendError> {
        tokio::time::timeout(self.timeout, self.db.revoke(key))
            .await
            .unwrap_or_else(|_| Err(timed_out("revoke", self.timeout)))
    }

    /// Locks held or waited for through this backend right now.
    pub(super) fn len(&self) -> usize {
        lock_owners(&self.owners).len()
    }

    /// One attempt (see the module docs).
    pub(super) async fn try_acquire(
        &self,
        request: &AcquireRequest,
    ) -> Result<Attempt, BackendError> {
        let (since, conn, polls) = {
            let mut owners = lock_owners(&self.owners);
            match owners.remove(&request.owner) {
                Some(Owner::Held(hold)) => {
                    // A retry of an attempt whose answer was lost: the same grant.
                    let lease = granted(request, hold.token, hold.permit);
                    owners.insert(request.owner.clone(), Owner::Held(hold));
                    return Ok(Attempt::Held(lease));
                }
                Some(Owner::Waiting { since, conn, polls }) => (since, conn, polls),
                Some(Owner::Revoked) | None => (Instant::now(), None, 0),
            }
        };
        if let Some(kind) = SlotKind::of(request.mode) {
            return self.try_share(request, kind, since, conn, polls).await;
        }
        // From here, `conn` is a local: if this future is dropped, it is
        // closed, and the server drops whatever it held.
        let remaining = request.wait.saturating_sub(since.elapsed());
        let server_wait = remaining.saturating_sub(answer_margin(remaining));
        let slice = if server_wait < Duration::from_millis(1) {
            Duration::ZERO
        } else {
            server_wait.min(request.lease / 3).min(MAX_SLICE)
        };
        let mut conn = conn;
        let mut fresh = false;
        let mut dead = DeadConnections::new(self.db.pooled() + usize::from(conn.is_some()));
        let outcome = loop {
            let c = match conn.take() {
                Some(c) => c,
                None => match tokio::time::timeout(self.timeout, self.db.open(fresh)).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => break Err(self.db.classify(e)),
                    Err(_) => break Err(timed_out("opening a session connection", self.timeout)),
                },
            };
            // Dropped while the server runs the lock: see `Abandoned`.
            let mut running = Abandoned {
                db: self.db.clone(),
                conn: Some(c),
                timeout: self.timeout,
            };
            let locked = tokio::time::timeout(
                slice + self.timeout,
                self.db.lock(
                    running.conn(),
                    &request.key,
                    &holder_text(&request.holder, HOLDER_MAX),
                    slice,
                    request.lease,
                ),
            )
            .await;
            let Ok(locked) = locked else {
                // No answer in time: given up like a dropped attempt.
                drop(running);
                break Err(timed_out(
                    "a session lock",
                    slice.saturating_add(self.timeout),
                ));
            };
            let c = running.finished();
            match locked {
                Ok(locked) => break Ok((locked, c)),
                Err(e) if dead.try_another(&e) => {
                    // A kept connection died meanwhile (a server restart, a
                    // `KILL`): on another one.
                    drop(c);
                    fresh = true;
                }
                Err(e) => break Err(self.db.classify(e)),
            }
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                // The wait loop may try again (a transient failure): the
                // wait's budget still counts from its start.
                self.waiting(&request.owner, since, None, 0);
                return Err(error);
            }
        };
        match outcome {
            (Locked::Yes(token), conn) => Ok(Attempt::Held(self.hold(request, conn, token, None))),
            (Locked::Mismatch(held), conn) => {
                self.db.recycle(conn);
                Err(BackendError::config(HoldMode::mismatch(
                    &request.key,
                    held,
                    request.mode,
                )))
            }
            (Locked::Busy { clean }, conn) => {
                if remaining > slice {
                    // More to wait: keep the connection for the next slice
                    // at once, or for the wait loop's last look at its
                    // deadline once the server has waited all it may.
                    self.waiting(&request.owner, since, Some(conn), 0);
                    return Ok(Attempt::Busy {
                        retry_in: (server_wait > slice).then_some(Duration::ZERO),
                    });
                }
                if clean {
                    self.db.recycle(conn);
                } else {
                    let (db, timeout) = (self.db.clone(), self.timeout);
                    crate::driver::handle().spawn(unlock_and_recycle(db, conn, timeout));
                }
                Ok(Attempt::Busy { retry_in: None })
            }
        }
    }

    /// Remembers `owner` as waiting since `since` (on `conn`, if kept).
    fn waiting(&self, owner: &str, since: Instant, conn: Option<S::Conn>, polls: u32) {
        lock_owners(&self.owners).insert(owner.to_owned(), Owner::Waiting { since, conn, polls });
    }

    /// Hands a granted connection to the task that holds it: the lease.
    fn hold(
        &self,
        request: &AcquireRequest,
        conn: S::Conn,
        token: u64,
        slot: Option<(SlotKind, u32)>,
    ) -> Lease {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (commands, receiver) = mpsc::unbounded_channel();
        let permit = slot
            .filter(|(kind, _)| *kind == SlotKind::Permit)
            .map(|(_, s)| s);
        lock_owners(&self.owners).insert(
            request.owner.clone(),
            Owner::Held(Hold {
                id,
                token,
                permit,
                commands,
            }),
        );
        crate::driver::handle().spawn(hold(HoldTask {
            db: self.db.clone(),
            conn,
            mark: end_mark(&request.key, slot, token),
            expires: Instant::now() + request.lease,
            lost: request.lost.clone(),
            commands: receiver,
            owners: Arc::downgrade(&self.owners),
            owner: request.owner.clone(),
            id,
            timeout: self.timeout,
        }));
        granted(request, token, permit)
    }

    /// One attempt of a share (a reader, a permit): see
    /// [the shared slots](self#semaphores-and-readers). Never waits on the
    /// server: a busy answer is tried again after a back-off (or at once when
    /// a share of the key is released in this process).
    async fn try_share(
        &self,
        request: &AcquireRequest,
        kind: SlotKind,
        since: Instant,
        conn: Option<S::Conn>,
        polls: u32,
    ) -> Result<Attempt, BackendError> {
        if let Some(conn) = conn {
            // A plain lock's connection left by an earlier attempt of this
            // owner: nothing of it may stay.
            unlock_and_recycle(self.db.clone(), conn, self.timeout).await;
        }
        let holder = holder_text(&request.holder, HOLDER_MAX);
        let mut dead = DeadConnections::new(self.db.pooled());
        let mut fresh = false;
        let outcome = loop {
            let c = match tokio::time::timeout(self.timeout, self.db.open(fresh)).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => break Err(self.db.classify(e)),
                Err(_) => break Err(timed_out("opening a session connection", self.timeout)),
            };
            // Dropped on the way (its caller went away, a timeout): see
            // `Abandoned`; whatever the connection took is unlocked.
            let mut running = Abandoned {
                db: self.db.clone(),
                conn: Some(c),
                timeout: self.timeout,
            };
            let shared = tokio::time::timeout(
                self.timeout,
                share(
                    &*self.db,
                    running.conn(),
                    request,
                    kind,
                    &holder,
                    self.timeout,
                ),
            )
            .await;
            let Ok(shared) = shared else {
                drop(running);
                break Err(timed_out("a session share", self.timeout));
            };
            match shared {
                Ok(shared) => break Ok((shared, running.finished())),
                Err(e) if dead.try_another(&e) => {
                    drop(running.finished());
                    fresh = true;
                }
                Err(e) => {
                    drop(running);
                    break Err(self.db.classify(e));
                }
            }
        };
        let (shared, conn) = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                self.waiting(&request.owner, since, None, polls);
                return Err(error);
            }
        };
        match shared {
            Shared::Granted { token, slot } => Ok(Attempt::Held(self.hold(
                request,
                conn,
                token,
                Some((kind, slot)),
            ))),
            Shared::Busy | Shared::Mismatch(_) => {
                let (db, timeout) = (self.db.clone(), self.timeout);
                crate::driver::handle().spawn(unlock_and_recycle(db, conn, timeout));
                if let Shared::Mismatch(held) = shared {
                    return Err(BackendError::config(HoldMode::mismatch(
                        &request.key,
                        held,
                        request.mode,
                    )));
                }
                let pause = FIRST_SHARE_POLL
                    .saturating_mul(1 << polls.min(16))
                    .min(self.poll);
                if request.wait.saturating_sub(since.elapsed()) > Duration::ZERO {
                    self.waiting(&request.owner, since, None, polls.saturating_add(1));
                }
                Ok(Attempt::Busy {
                    retry_in: Some(pause),
                })
            }
        }
    }

    /// Renews by a ping of the lease's connection; `Lost` if it is gone,
    /// `Revoked` if a revocation ended it.
    pub(super) async fn renew(&self, lease: &Lease, ttl: Duration) -> Renewal {
        let commands = match lock_owners(&self.owners).get(&lease.owner) {
            Some(Owner::Held(hold)) => hold.commands.clone(),
            Some(Owner::Revoked) => return Renewal::Revoked,
            _ => return Renewal::Lost,
        };
        let (reply, answer) = oneshot::channel();
        if commands.send(Command::Ping { ttl, reply }).is_ok()
            && let Ok(renewal) = answer.await
        {
            // The task answers within its timeout (and the time it takes
            // to tell a revocation), or ends.
            return renewal;
        }
        // The task ended meanwhile: it left its verdict before it did.
        match lock_owners(&self.owners).get(&lease.owner) {
            Some(Owner::Revoked) => Renewal::Revoked,
            _ => Renewal::Lost,
        }
    }

    /// Unlocks what `owner` holds or waits on, if anything.
    pub(super) async fn release(&self, owner: &str) {
        let entry = lock_owners(&self.owners).remove(owner);
        match entry {
            Some(Owner::Held(hold)) => {
                let (reply, answer) = oneshot::channel();
                if hold.commands.send(Command::Release { reply }).is_ok() {
                    let _ = answer.await;
                }
            }
            Some(Owner::Waiting {
                conn: Some(conn), ..
            }) => unlock_and_recycle(self.db.clone(), conn, self.timeout).await,
            Some(Owner::Waiting { conn: None, .. } | Owner::Revoked) | None => {}
        }
    }
}

/// The lease of a grant.
fn granted(request: &AcquireRequest, token: u64, permit: Option<u32>) -> Lease {
    let lease = Lease::new(request, Some(FencingToken::new(token)));
    match permit {
        Some(slot) => lease.with_slot(slot),
        None => lease,
    }
}

/// What one share attempt found.
enum Shared {
    /// Granted: the token and the slot taken.
    Granted { token: u64, slot: u32 },
    /// Every slot taken, or a writer holds or waits for the key.
    Busy,
    /// The key's holders hold it in this other mode.
    Mismatch(HoldMode),
}

/// One share attempt on `conn`: the gate, the slot walk (lowest free slot
/// first, [`SLOTS_PER_TRY`] per round trip), the grant. Unless granted,
/// the connection may hold locks: the caller unlocks it. `idle`: the
/// server's idle limit while the gate is held (the attempt's bound).
async fn share<S: SessionDb>(
    db: &S,
    conn: &mut S::Conn,
    request: &AcquireRequest,
    kind: SlotKind,
    holder: &str,
    idle: Duration,
) -> Result<Shared, sqlx::Error> {
    let key = &request.key;
    match db.enter(conn, key, request.mode, idle).await? {
        Entry::Open => {}
        Entry::Busy => return Ok(Shared::Busy),
        Entry::Mismatch(held) => return Ok(Shared::Mismatch(held)),
    }
    // Readers are not counted: their walk ends at a free number.
    let end = match request.mode {
        HoldMode::Permit { permits } => permits,
        _ => u32::MAX,
    };
    let mut from = 0;
    let slot = loop {
        if from >= end {
            return Ok(Shared::Busy);
        }
        let to = from.saturating_add(SLOTS_PER_TRY).min(end);
        if let Some(slot) = db.try_slots(conn, key, kind, from, to).await? {
            break slot;
        }
        from = to;
    };
    Ok(
        match db
            .grant(conn, key, request.mode, slot, holder, request.lease)
            .await?
        {
            Ok(token) => Shared::Granted { token, slot },
            Err(held) => Shared::Mismatch(held),
        },
    )
}

async fn unlock_and_recycle<S: SessionDb>(db: Arc<S>, mut conn: S::Conn, timeout: Duration) {
    if let Ok(Ok(())) = tokio::time::timeout(timeout, db.unlock(&mut conn)).await {
        db.recycle(conn);
    }
    // Otherwise `conn` is dropped here: closed, and its locks with it.
}

/// A connection whose lock statement is running on the server. If the
/// attempt is dropped meanwhile (its caller went away), the server would
/// still wait up to the statement's slice, and grant the key to nobody when
/// it is released: so the statement is cancelled from another connection,
/// then everything the connection holds is unlocked (a grant in the same
/// instant included) and the connection goes back for reuse — or, where the
/// database cannot cancel, it is closed, which ends its server session.
struct Abandoned<S: SessionDb> {
    db: Arc<S>,
    conn: Option<S::Conn>,
    timeout: Duration,
}

impl<S: SessionDb> Abandoned<S> {
    fn conn(&mut self) -> &mut S::Conn {
        self.conn.as_mut().expect("present until finished")
    }

    /// The statement answered (or timed out): the connection, back.
    fn finished(mut self) -> S::Conn {
        self.conn.take().expect("present until finished")
    }
}

impl<S: SessionDb> Drop for Abandoned<S> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        crate::driver::handle().spawn(end_abandoned(self.db.clone(), conn, self.timeout));
    }
}

/// How long an abandoned connection is given to answer after a cancel
/// before it is cancelled again (the statement may have reached the server
/// after the cancel did).
const DRAIN_AFTER_CANCEL: Duration = Duration::from_millis(200);

/// Ends the lock statement an abandoned attempt left running on `conn`
/// (see [`Abandoned`]) and recycles the connection; if that cannot be done
/// within `timeout`, ends its server session, so it is granted nothing.
async fn end_abandoned<S: SessionDb>(db: Arc<S>, mut conn: S::Conn, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut cancel = true;
    while let Some(left) = deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
    {
        if cancel && !matches!(tokio::time::timeout(left, db.cancel(&conn)).await, Ok(true)) {
            break;
        }
        let drain = left.min(DRAIN_AFTER_CANCEL);
        match tokio::time::timeout(drain, db.unlock(&mut conn)).await {
            Ok(Ok(())) => return db.recycle(conn),
            // The cancelled statement's error, read first: unlock again.
            Ok(Err(e)) if !is_connection_error(&e) => cancel = false,
            // Closed: its server session has ended.
            Ok(Err(_)) => return,
            // Still running: the cancel came before the statement.
            Err(_) => cancel = true,
        }
    }
    let _ = tokio::time::timeout(timeout, db.terminate(&conn)).await;
}

struct HoldTask<S: SessionDb> {
    db: Arc<S>,
    conn: S::Conn,
    /// The grant's end mark (see [`end_mark`]).
    mark: i64,
    /// The local end of the lease: at least the holder's own.
    expires: Instant,
    lost: CancellationToken,
    commands: mpsc::UnboundedReceiver<Command>,
    owners: Weak<Owners<S::Conn>>,
    owner: String,
    id: u64,
    timeout: Duration,
}

/// How a hold ended.
enum End {
    /// Released by its holder.
    Released,
    /// Its lease ran out unrenewed.
    Expired,
    /// The connection failed: the server may have let the lock go. With
    /// the renewal that found it, if one did.
    Dead {
        why: String,
        reply: Option<oneshot::Sender<Renewal>>,
    },
    /// The backend is gone.
    Dropped,
}

/// Owns a held lock's connection until the lock ends.
async fn hold<S: SessionDb>(mut task: HoldTask<S>) {
    let end = loop {
        tokio::select! {
            biased;
            command = task.commands.recv() => match command {
                Some(Command::Ping { ttl, reply }) => {
                    let asked = Instant::now();
                    let pinged = tokio::select! {
                        pinged = tokio::time::timeout(task.timeout, task.db.ping(&mut task.conn, ttl)) => pinged,
                        () = tokio::time::sleep_until(task.expires.into()) => break End::Expired,
                    };
                    match pinged {
                        Ok(Ok(())) => {
                            task.expires = task.expires.max(asked + ttl);
                            let _ = reply.send(Renewal::Renewed);
                        }
                        Ok(Err(e)) => break End::Dead {
                            why: format!("ping failed: {e}"),
                            reply: Some(reply),
                        },
                        Err(_) => break End::Dead {
                            why: format!("ping not answered within {:?}", task.timeout),
                            reply: Some(reply),
                        },
                    }
                }
                Some(Command::Release { reply }) => {
                    let unlocked = tokio::time::timeout(task.timeout, task.db.unlock(&mut task.conn)).await;
                    let _ = reply.send(());
                    match unlocked {
                        Ok(Ok(())) => {
                            forget(&task);
                            task.db.recycle(task.conn);
                            return;
                        }
                        _ => break End::Released,
                    }
                }
                None => break End::Dropped,
            },
            why = task.db.watch(&mut task.conn) => break End::Dead { why, reply: None },
            () = tokio::time::sleep_until(task.expires.into()) => break End::Expired,
        }
    };
    match end {
        End::Expired => {
            forget(&task);
            // The holder stopped renewing (`watchdog = false`, the end of
            // `hold_at_least`): the lease ends here, as on the lease table.
            if let Ok(Ok(())) =
                tokio::time::timeout(task.timeout, task.db.unlock(&mut task.conn)).await
            {
                task.db.recycle(task.conn);
            }
        }
        End::Dead { why, reply } => connection_ended(task, why, reply).await,
        End::Released | End::Dropped => {
            forget(&task);
            drop(task.conn);
        }
    }
}

/// A held lock whose connection ended: tells a revocation from any other
/// end by inserting the grant's end mark (see the module docs), then
/// leaves the verdict where the renewals read it. Lost otherwise: the
/// holder is told at once. Revoked: its renewals answer so (the next one
/// comes within a third of the lease; a holder that does not renew learns
/// at its lease's end, as on the lease table).
async fn connection_ended<S: SessionDb>(
    task: HoldTask<S>,
    why: String,
    reply: Option<oneshot::Sender<Renewal>>,
) {
    let HoldTask {
        db,
        conn,
        mark,
        lost,
        commands,
        owners,
        owner,
        id,
        timeout,
        ..
    } = task;
    drop(conn);
    let revoked = match tokio::time::timeout(timeout, db.ended(mark)).await {
        Ok(Ok(revoked)) => revoked,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "dlock session lock: the end mark could not be written");
            false
        }
        Err(_) => false,
    };
    tracing::debug!(reason = %why, revoked, "dlock session lock: connection lost");
    if let Some(owners) = owners.upgrade() {
        let mut owners = lock_owners(&owners);
        if matches!(owners.get(&owner), Some(Owner::Held(h)) if h.id == id) {
            if revoked {
                owners.insert(owner, Owner::Revoked);
            } else {
                owners.remove(&owner);
            }
        }
    }
    // Renewals sent meanwhile find the task gone, and read the verdict.
    drop(commands);
    if revoked {
        if let Some(reply) = reply {
            let _ = reply.send(Renewal::Revoked);
        }
    } else {
        if let Some(reply) = reply {
            let _ = reply.send(Renewal::Lost);
        }
        lost.cancel();
    }
}

/// Takes the hold out of its backend's map (if it is still this one).
fn forget<S: SessionDb>(task: &HoldTask<S>) {
    if let Some(owners) = task.owners.upgrade() {
        let mut owners = lock_owners(&owners);
        if matches!(owners.get(&task.owner), Some(Owner::Held(h)) if h.id == task.id) {
            owners.remove(&task.owner);
        }
    }
}
/// The 64-bit name of a key in session mode: the first 8 bytes of its
/// SHA-256, big-endian, as a signed integer (a PostgreSQL advisory-lock key;
/// MySQL names are built from it). Two keys share a name with probability
/// 2^-64 per pair: they would then exclude each other, never share a lock
/// unknowingly — and tokens still grow, as they share one counter row.
pub(crate) fn session_hash(key: &str) -> i64 {
    first_64_bits(key.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_marks_differ_by_key_and_token_and_from_key_names() {
        let mark = end_mark("dlock:a", None, 7);
        assert_eq!(mark, end_mark("dlock:a", None, 7));
        assert_ne!(mark, end_mark("dlock:a", None, 8));
        assert_ne!(mark, end_mark("dlock:b", None, 7));
        assert_ne!(mark, session_hash("dlock:a"));
        let slot = Some((SlotKind::Permit, 0));
        assert_ne!(end_mark("dlock:a", slot, 7), mark);
        assert_ne!(
            end_mark("dlock:a", slot, 7),
            end_mark("dlock:a", Some((SlotKind::Permit, 1)), 7)
        );
        assert_ne!(
            end_mark("dlock:a", slot, 7),
            end_mark("dlock:a", Some((SlotKind::Reader, 0)), 7)
        );
    }

    #[test]
    fn session_hash_is_the_first_8_bytes_of_sha256() {
        // SHA-256("abc") = ba7816bf8f01cfea…
        assert_eq!(session_hash("abc"), 0xba78_16bf_8f01_cfea_u64 as i64);
        assert_ne!(session_hash("a"), session_hash("A"));
    }
}
