//! etcd (`etcd://`): etcd's own mutex recipe, on one etcd lease per backend session.
//!
//! **Layout**: each acquisition of a plain lock puts an entry `{prefix}/{key}/{owner}`
//! (the stored key escaped, the owner token of the acquisition) with a
//! transaction that writes only if the entry does not exist
//! (`create_revision == 0`), under the session's etcd lease, and reads the
//! key's first entry in the same round trip. The entry with the lowest
//! create revision under `{prefix}/{key}/` holds the key; every other one
//! watches only the deletion of the entry created just before it, so a
//! release wakes exactly one waiter (no herd) and waiters are served in
//! arrival order. A woken waiter rewrites its own entry (same value, same
//! lease: the grant's revision, see the token below) and reads the holder
//! and its predecessor in one transaction, at one revision: it holds the key if it
//! is first, queues again if its entry is gone (deleted behind its back:
//! etcd's own recipe waits for ever there), or watches the new predecessor
//! from the revision of that read, so a deletion in between is not missed.
//! Each waiter's watch is its own gRPC stream, opened again at the next
//! attempt when it breaks (etcd-client's streams do not reconnect). Nothing
//! else is stored per key: entries are deleted on release, and expire with
//! their etcd lease — except a permit's slot claim (which goes with its
//! entry) and a revoked entry's mark, below.
//!
//! **Read-write locks** follow etcd's own recipe (`recipes/rwmutex.go`: a
//! reader waits for the last writer before it, a writer for the last key
//! before it) in the plain lock's queue: a reader's entry is named
//! `{prefix}/{key}/%R{owner}` (`%` then `R` starts no escaped owner, so the
//! readers are exactly the names from `%R` to `%S`), and a plain lock *is*
//! the write mode — its entry, its put and its one-transaction hot path are
//! unchanged. A reader holds when no entry created before it is a writer
//! (two range reads, below `%R` and from `%S`, sorted by create revision,
//! give the nearest one), and watches only that writer's deletion; a
//! writer holds when its entry is the first of all. One create-revision
//! order for both gives writers preference the fair way: a reader queued
//! after a waiting writer waits behind it, the waiting writer's entry being
//! its mark (gone with its grant, its abandonment or its session). This was
//! chosen over separate prefixes per mode (etcd's recipe) so that versions
//! of dlock that know only plain locks still count readers as writers and
//! never hold beside them.
//!
//! **Semaphores** are a queue too: a permit's entry is
//! `{prefix}/{key}/%P{permits}:{owner}` — the number of permits in its name,
//! so a read of names alone tells a plain lock, a reader or another number
//! of permits (a mismatch: our entry is deleted and the caller gets
//! [`LockError::Config`] naming both), and so versions that know only plain
//! locks wait behind permits. A permit holds when fewer than `permits`
//! entries were created before it; it then claims the lowest slot no holder
//! has, in one transaction that creates `{prefix}/%slots/{key}/{slot}` (if
//! absent) under the session's lease and writes the slot into its entry
//! (both only while the entry is there). A waiter with exactly `permits`
//! entries before it watches their deletions (one watch of the queue,
//! filtered to deletions of earlier entries); a waiter further back watches
//! only the entry just before it — its deletion or its grant. So a release
//! wakes the first waiter, and its grant the next one (two wake-ups per
//! release, whatever the queue's length). Waiting for "the `n`-th entry
//! before it" alone would miss releases out of order (holders of a
//! semaphore release in any order). Each permit is its own entry with its
//! own expiry (the session's lease; dlock's lease, renewed with the entry
//! and its claim checked in one read), and a crashed holder frees only its
//! own slot. Slot claims are outside every queue, like revocation marks.
//!
//! **Revocation** (`Registry::revoke`) deletes the holder's entry and, in
//! the same transaction, puts a mark `{prefix}/%revoked/{key}/{owner}`
//! under the holder's own etcd lease, outside every queue. The holder's next
//! renewal reads its entry gone and the mark there, deletes the mark, and
//! answers "revoked": its loss is reported with
//! [`LossReason::Revoked`](crate::LossReason::Revoked). An entry gone
//! without a mark (expired, deleted by hand, its session ended) is reported
//! gone. A mark goes with the holder's session at the latest, and is
//! deleted earlier by that renewal or by the holder's release (see
//! `admin.rs`).
//!
//! **Fencing token**: a revision of etcd's one cluster-wide counter, which
//! only grows (a compaction or a leader change keeps it): the revision at
//! which the grant was decided — the put's own revision for an entry that
//! holds as soon as it is put (so an uncontended plain lock's token is its
//! entry's create revision, as before), and for an entry that waited, the
//! revision of the transaction that writes it (a writer's or a reader's
//! entry rewritten with its own value and lease; a permit's slot claim)
//! while reading, at that revision, that it may hold. That revision is
//! above every deletion the grant read, and below the holder's own
//! release; so a holder granted after another's release has the larger
//! token, per key for writers and readers together, per (key, slot) for
//! permits — with no clock involved. The create revision alone would not
//! do once readers share a queue: a reader queued before a waiting writer
//! can be granted after that writer's entry was created, and two readers
//! eligible at once can be granted in either order. `inspect` shows it as
//! the entry's mod revision.
//!
//! **One etcd lease per backend session, not one per hold.** With a lease
//! per hold every acquisition costs a lease grant (a Raft write) before its
//! put, every release a revoke, and every held lease a keep-alive of its
//! own. With one lease per session an uncontended acquisition is one
//! transaction, a release one delete, and one keep-alive stream renews
//! every entry of the process at once (renewal is batched by construction).
//! Measured on the three-member test cluster (etcd 3.4, loopback, 2 shared
//! cores, 400 sequential pairs): an acquire + release pair took 3.5–3.9 ms
//! with the session's lease and 6.2–6.5 ms with a lease per hold. So, as
//! with ZooKeeper's session:
//!
//! - While this process runs, `lease` behaves as on every backend: the
//!   watchdog renews it (each renewal batch is one read transaction that
//!   checks every held entry still exists, is ours and is under the
//!   session's lease, plus one keep-alive of the session's lease when that
//!   could end before the renewed lease does), time-driven loss is the runtime's (a lease not
//!   renewed by its give-up instant is lost at that instant), and an entry
//!   whose lease is not renewed by its end — a forgotten guard,
//!   `watchdog = false`, `hold_at_least` — is deleted by the backend then.
//!   **Sub-second leases are accepted**: etcd leases are whole seconds of at
//!   least 2 s, but the session lease is not the lock's lease; the lock's
//!   lease is dlock's, and the loss is signalled at dlock's own give-up instant.
//! - **A crashed holder's key frees when the session's etcd lease expires**:
//!   `session_ttl` (default 10 s) after its last keep-alive, plus up to
//!   ~0.5 s (etcd checks expiry twice a second) — and a leader change
//!   restarts every lease's full TTL, so it can take up to about twice that.
//!   A shorter `lease` does not shorten crash recovery.
//! - The session's lease is kept alive by one task: a keep-alive every
//!   sixth of the TTL on one stream, reopened when it breaks. Every lease
//!   of the session is declared **lost at once** when etcd answers that the
//!   lease is gone (expired, revoked), and when no keep-alive was answered
//!   for ⅔ of the TTL since the last answered one was sent — before etcd can
//!   expire it (it expires a lease no earlier than a TTL after receiving a
//!   keep-alive), so the holder hears of the loss before anyone else can
//!   be granted the key. The session's lease is then revoked (which deletes
//!   every entry of it, held or queued) and the next acquisition opens a
//!   new session.
//!
//! **Lost put answers**: a put is sent when it is called, and its answer can
//! be lost. The entry's key is the owner token of the acquisition, so the
//! next attempt's transaction finds it (its `Else` branch reads it) and
//! adopts it if it is under the current session's lease; an entry of ours
//! under an ended session's lease is deleted first (guarded by its create
//! revision). Release deletes only the entry with our create revision, so a
//! delete retried late never removes a newer entry of the same name.
//!
//! **Release** deletes our entry (already gone counts as released); a delete
//! that fails is retried within the request bound, then in the background
//! until it succeeds or the session ends. An acquisition given up or
//! cancelled at any point leaves no entry: its entry is deleted by name (the
//! name holds the acquisition's own owner token). A put is sent from a task
//! of its own that finishes even when its attempt is dropped, and the
//! delete waits until that put is answered (or cut at its request bound):
//! etcd serves the requests of one connection concurrently, so a delete
//! sent while the put is on the wire could be applied first and leave the
//! entry the put creates after it. A put cut at its bound without an answer
//! may still be applied later; the runtime's second, later release of a
//! dropped acquisition deletes the entry it creates.
//!
//! **Keys** are the stored key with `%` and `/` percent-encoded, so no two
//! keys share a queue and `{prefix}/{key}/{owner}` splits one way only.
//! No key is refused.
//!
//! **Nested prefixes**: a queue is every etcd key under `{prefix}/{key}/`,
//! and another backend's prefix may be that very path (or lie below it):
//! its entries, `{prefix}/{key}/{its key}/{its owner}`, are then under the
//! queue too. Only the queue's own entries count — those one segment below
//! it (an owner token is escaped: it holds no `/`); the reads of the
//! queue's head and of an entry's predecessor skip the others, reading a
//! further page at the same revision when a whole page held only those.
//! So a key is never held up by a nested backend's keys. Versions of dlock
//! that counted every key under the queue still exclude this one on a
//! shared prefix (their entries are one segment below it, as ours are);
//! they may only wait, needlessly, behind a nested backend's entries.
//!
//! **URL**: `etcd://[user:pass@]h1:p1,h2:p2[/prefix][?session_ttl=10s]`
//! (port 2379 by default). `user:pass` (percent-encoded) logs in with etcd's
//! authentication. The prefix (the URL's path, default none) is where the
//! entries live. `session_ttl` is the session lease's TTL: whole seconds,
//! 2 s to 1 h. Every request is bounded by a quarter of it (500 ms to 2 s),
//! so an unreachable cluster is an error within `wait` plus one bound.
//!
//! **Files**: this one holds the backend, its counters and its
//! [`LockBackend`] impl; `connect` opens the client and a session,
//! `session` keeps a session's lease alive and its leases (and declares
//! them lost), `acquire` runs an acquisition's attempts (its entry, its
//! watch, the grant, its abandonment), `renew` and `release` do what they
//! say and `url` reads the URL and escapes keys.

mod acquire;
mod admin;
mod connect;
mod release;
mod renew;
mod session;
mod url;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::{Client, Error as EtcdError};
use futures_util::future::BoxFuture;

use crate::backend::{
    AcquireRequest, Attempt, HeldEntry, HoldMode, KeyEntry, Lease, LockBackend, Renewal, WakeSource,
};
use crate::error::{BackendError, LockError, redact_url};
use acquire::Pending;
use renew::held_entry;
use session::Session;
use url::Target;

/// How soon an attempt that could not reach the cluster is tried again.
const RETRY: Duration = Duration::from_millis(100);

/// How many times one attempt puts or reads again when the queue changes
/// under it.
const MAX_STEPS: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the error says etcd no longer knows the lease.
fn lease_gone(err: &EtcdError) -> bool {
    match err {
        EtcdError::GRpcStatus(status) => {
            status.code() == tonic::Code::NotFound && status.message().contains("lease not found")
        }
        _ => false,
    }
}

/// Whether trying again later may succeed.
fn transient(err: &EtcdError) -> bool {
    match err {
        EtcdError::GRpcStatus(status) => !matches!(
            status.code(),
            tonic::Code::InvalidArgument
                | tonic::Code::PermissionDenied
                | tonic::Code::Unauthenticated
                | tonic::Code::Unimplemented
                | tonic::Code::OutOfRange
        ),
        EtcdError::InvalidArgs(_)
        | EtcdError::InvalidUri(_)
        | EtcdError::InvalidMetadataValue(_)
        | EtcdError::Utf8Error(_)
        | EtcdError::EndpointsNotManaged => false,
        _ => true,
    }
}

fn backend_error(what: &str, err: EtcdError) -> BackendError {
    let message = format!("etcd: {what}: {err}");
    if transient(&err) {
        BackendError::transient(message)
    } else {
        BackendError::permanent(message)
    }
}

/// Counters of one backend ([`EtcdBackend::stats`]).
#[derive(Debug, Default)]
struct Counters {
    sessions: AtomicU64,
    sessions_ended: AtomicU64,
    streams_opened: AtomicU64,
    entries_put: AtomicU64,
    creates_recovered: AtomicU64,
    watches_set: AtomicU64,
    watch_events: AtomicU64,
    losses: AtomicU64,
}

/// What an [`EtcdBackend`] has done since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdStats {
    /// Sessions (etcd leases) opened.
    pub sessions: u64,
    /// Sessions ended: their lease expired, was revoked, or went unanswered.
    pub sessions_ended: u64,
    /// Keep-alive streams opened (one per session, plus one per reopening).
    pub keep_alive_streams: u64,
    /// Lock entries put.
    pub entries_put: u64,
    /// Entries whose put answer was lost, found again by their key.
    pub creates_recovered: u64,
    /// Watches set on a predecessor by a waiter.
    pub watches_set: u64,
    /// Watches that fired (a deletion, or a broken stream).
    pub watch_events: u64,
    /// Leases declared lost with their session.
    pub leases_lost: u64,
}

struct Inner {
    target: Target,
    shown_url: String,
    client: Mutex<Option<Client>>,
    current: Mutex<Option<Arc<Session>>>,
    connecting: tokio::sync::Mutex<()>,
    pending: Mutex<HashMap<String, Arc<Pending>>>,
    counters: Arc<Counters>,
}

impl Inner {
    /// `{prefix}/{escaped key}/`: where a stored key's entries are.
    fn queue_of(&self, stored_key: &str) -> String {
        format!("{}/{}/", self.target.prefix, url::escape(stored_key))
    }

    /// `{prefix}/%slots/{escaped key}/`: where a stored key's slot claims are.
    fn slots_of(&self, stored_key: &str) -> String {
        url::slots_of(&self.target.prefix, &url::escape(stored_key))
    }
}

/// The etcd backend. See the [module docs](self).
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("url", &self.inner.shown_url)
            .field("session_ttl", &self.inner.target.session_ttl)
            .finish_non_exhaustive()
    }
}

impl EtcdBackend {
    /// Connects to the cluster an `etcd://` URL names (see the [module
    /// docs](self)) and opens the backend's session (grants its etcd
    /// lease): an unreachable cluster is an error here. The client and the
    /// session live on dlock's I/O runtime.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let target = url::parse(url)?;
        let inner = Arc::new(Inner {
            target,
            shown_url: redact_url(url),
            client: Mutex::new(None),
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            pending: Mutex::new(HashMap::new()),
            counters: Arc::new(Counters::default()),
        });
        inner
            .session()
            .await
            .map_err(|e| e.into_lock_error("etcd"))?;
        Ok(EtcdBackend { inner })
    }

    /// What the backend has done so far.
    pub fn stats(&self) -> EtcdStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EtcdStats {
            sessions: get(&c.sessions),
            sessions_ended: get(&c.sessions_ended),
            keep_alive_streams: get(&c.streams_opened),
            entries_put: get(&c.entries_put),
            creates_recovered: get(&c.creates_recovered),
            watches_set: get(&c.watches_set),
            watch_events: get(&c.watch_events),
            leases_lost: get(&c.losses),
        }
    }

    /// The etcd key prefix under which a stored key's entries (its holder
    /// and its waiters) are: `{prefix}/{escaped key}/`.
    pub fn queue_prefix(&self, stored_key: &str) -> String {
        self.inner.queue_of(stored_key)
    }

    /// The id of the current session's etcd lease (to revoke it in a test).
    #[doc(hidden)]
    pub fn session_lease_for_tests(&self) -> Option<i64> {
        lock(&self.inner.current)
            .as_ref()
            .filter(|s| s.is_alive())
            .map(|s| s.lease_id)
    }
}

impl LockBackend for EtcdBackend {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        // Writers, readers and permits share one queue per key (see the
        // module docs).
        let _ = mode;
        Ok(())
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(self.inner.attempt(request))
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let pending = self.inner.pending_for(request);
        Box::pin(std::future::ready(WakeSource::notify(
            pending.notify.clone(),
        )))
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let inner = &self.inner;
            if let Err(err) = inner
                .drop_pending(&request.key, &request.owner, request.mode)
                .await
            {
                tracing::warn!(key = %request.key, error = %err, "dlock etcd: abandoned entry not deleted yet");
            }
        })
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(self.inner.renew_batch(batch))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match held_entry(lease) {
                Some(entry) => self.inner.release_held(entry).await,
                // An acquisition that ended without a grant (dropped, failed).
                None => {
                    self.inner
                        .drop_pending(&lease.key, &lease.owner, lease.mode)
                        .await
                }
            }
        })
    }

    fn needs_io_runtime(&self) -> bool {
        // The client's channel, the keeper, the reaper and the waiters'
        // watches live on dlock's runtime.
        true
    }

    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        Box::pin(self.inner.inspect_key(key))
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        Box::pin(self.inner.list_keys(prefix, limit))
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        Box::pin(self.inner.revoke_key(key))
    }
}
