//! ZooKeeper (`zk://`): Apache Curator's lock recipe, on one session per backend.
//!
//! **Layout** (the same as Curator's `InterProcessMutex`, so both can lock the
//! same keys): each stored key is a *container* node `{chroot}/{escaped key}`;
//! each acquisition creates an `EPHEMERAL_SEQUENTIAL` child
//! `_c_{guid}-lock-{sequence}` holding the owner token, where the GUID is
//! drawn at random when the acquisition starts (and again if it gives a
//! grant back and tries again: see below). For a plain lock, the earliest-created child
//! holds the key; every other one watches only the child just ahead
//! of it, so a release wakes exactly one waiter (no herd) and waiters are
//! served in arrival order. Uncontended, an acquisition is one round trip:
//! the create and the listing of the key's children go out together, and the
//! server answers them in order. A waiter woken by its predecessor's
//! deletion reads the queue once more: that read decides the grant and
//! gives its token (below). The backend never deletes a
//! container (the server reaps empty ones; deleting would race other
//! creators) and creates it again when a create finds it reaped.
//!
//! **Queue order is creation order, up to and past the sequence counter's
//! end.** The suffix is a signed 32-bit counter per container. Below its
//! end (every lock child's suffix in `0..2147483647`) the suffixes are in
//! creation order, and the queue is ordered by them, as Curator orders it.
//! At the end they are not: ZooKeeper 3.8 hands `2147483647` to every later
//! child (so several children share it), a create pipelined behind another
//! gets `-2147483648` and up, and other versions wrap for good — where
//! equal suffixes, or serial or string order, would grant the key twice.
//! So as soon as a listing holds a suffix outside `0..2147483647`, the queue
//! is ordered by each child's `czxid` instead, read in one multi-read: the
//! id of the transaction that created it, a total order over the ensemble
//! that agrees with the suffixes wherever those are in order, so holders
//! and waiters reading the queue at different moments, one way or the
//! other, agree on it. This was chosen over moving a key to a fresh node
//! before its counter ends, which every client would have to agree on —
//! Curator would not follow — and which still needs an order for the
//! nodes already queued. A reaped container's counter starts again from 0
//! with no child left from before. Curator's `InterProcessMutex` orders by
//! suffix as a string, so it excludes dlock (and itself) while every suffix
//! is below `2147483647`; past that, Curator may grant the key twice — even
//! among Curator clients alone — while dlock clients still exclude each
//! other. A key locked by Curator too should not reach its counter's end
//! (2³¹ − 1 acquisitions while its container is never empty long enough to
//! be reaped).
//!
//! **Read-write locks** use Curator's `InterProcessReadWriteLock` names in
//! the same queue: a reader's child is `_c_{guid}-__READ__{sequence}`, and a
//! plain lock *is* the write mode (`LockBuilder::write` asks for the same
//! thing). A writer holds the key when no child is ahead of it; a reader
//! when no writer's child is ahead of it, so readers share, and a reader
//! that queued after a waiting writer waits behind it: writers are
//! preferred in the fairest way, first come first served, and the waiting
//! writer's child is its mark (it leaves with the writer's grant,
//! abandonment or session). Each waiter watches only the nearest child it
//! waits for (a writer: the child just ahead; a reader: the nearest writer
//! ahead), so a release wakes only the waiters it may let in. Every grant,
//! read or write, takes its token from the key's one sequence (see
//! **Fencing token**). This was chosen over separate nodes per mode because one queue gives
//! the order and the fairness for free, and it is the layout Curator reads.
//!
//! **Curator interop of writers.** Curator's own `InterProcessMutex`
//! (`lock-`) and its read-write lock (`__READ__`/`__WRIT__`) do not see each
//! other on one path: each sorts the other's children by their whole name,
//! after all of its own. dlock counts all three names (`lock-`, `__WRIT__`:
//! writers; `__READ__`: readers), so dlock clients exclude each other and
//! wait for Curator's holders whichever names they use. Which Curator recipe
//! sees dlock's writers depends on their name, set by the URL: with
//! `writers=mutex` (the default) a plain lock is named `lock-`, as it
//! always was, and excludes Curator's `InterProcessMutex` both ways, while
//! Curator's read-write lock does not see it; with `writers=rw` it is named
//! `__WRIT__`, and dlock's readers and writers keep the read-write
//! invariant with Curator's readers and writers both ways, while Curator's
//! `InterProcessMutex` does not see it. dlock's readers are seen by
//! Curator's read-write lock, never by its `InterProcessMutex`. So on a key
//! Curator also locks: use the default with Curator's mutex, `writers=rw`
//! with Curator's read-write lock (on every dlock client of the key, all of
//! a version that reads `__WRIT__`).
//!
//! **Semaphores** use Curator's `InterProcessSemaphoreV2` layout: one
//! `EPHEMERAL_SEQUENTIAL` lease `_c_{guid}-lease-{sequence}` per holder
//! under the key's `leases` child, holding the owner, the record, the
//! number of permits and the slot (the lowest no live lease carries). A
//! lease holds when at most `permits` leases exist after it was created and
//! no earlier lease carries its slot; otherwise it is deleted before the
//! attempt answers. Waiters queue in the key's `locks` child — Curator's
//! semaphore mutex, first come first served — and only the first of them
//! watches the leases, so a release wakes one waiter (see `semaphore` for
//! why dlock's first waiter holds no lease while it waits: so that
//! Curator's and dlock's acquirers never wait for each other forever).
//! Token: the lease's `czxid` (per key, so per slot). A
//! different number of permits among dlock's leases, lock children beside
//! leases, or leases beside a plain lock or reader are refused as a
//! mismatch while they exist.
//!
//! **Fencing token** of a plain lock, writer or reader: taken when the
//! grant is decided, from the read of the queue that found our node first:
//! the key node's `pzxid` in that read, the id of the latest transaction
//! that created or deleted one of its children (never below our node's
//! `czxid`: the read follows our create). Transaction ids are totally
//! ordered across the ensemble. Why it is the key's one sequence:
//!
//! - A holder's own grant read saw its node, so it came before that node's
//!   deletion: its token is below its deletion's id.
//! - A grant decided after a holder finished reads a state that includes
//!   that deletion, so its `pzxid` is at or above the deletion's id, hence
//!   strictly above the finished holder's token — readers included: a
//!   reader queued early but granted after another reader came and went
//!   still gets the larger token, which the node's `czxid` (fixed when it
//!   queued) would not give.
//! - Two readers granted on reads of the same state share a token; they
//!   hold together, and neither was granted after the other finished.
//! - A reaped container is created again by a later transaction, and its
//!   `pzxid` starts at that id, so tokens never go back (the sequence
//!   number is not a token).
//!
//! Uncontended, the read sent with the create finds nothing changed since
//! it: the token is the node's `czxid`. Otherwise (a waiter's grant) the
//! token is written after the holder's record in the node's data, where
//! `inspect` reads it; the write is sent before the grant is answered, so
//! later reads of this session see it, and a waiter behind that node,
//! whose data watch it fires, sets the watch again without waking. So a
//! waiter woken by its predecessor's deletion reads the queue before it
//! holds (one round trip per handoff): the event does not carry the
//! deletion's id on ZooKeeper 3.8, and without a read there is no token
//! above the predecessor's.
//!
//! **Lost create replies**: a create is sent when it is called, and its
//! reply can be lost with the connection. The next attempt lists the key's
//! children and adopts the child carrying its GUID, only if that child's
//! `ephemeralOwner` is the current session; otherwise it creates again with
//! the same GUID. A child of ours found beside the one we use (a create that
//! surfaced late) is deleted: never two live nodes of one acquisition. A
//! grant given back and tried again (one that came too late to use) queues
//! under a new GUID: at the counter's end a node of the old GUID would get
//! the very path of the one given back, which a delete still retried in the
//! background (by path) would remove, or which the create would find and
//! adopt just before it goes.
//!
//! **What `lease` means here: the lease is the session.** A ZooKeeper node
//! cannot expire by itself; it lives as long as the session that created it.
//! So:
//!
//! - While this process runs, the lease behaves as on every backend: the
//!   watchdog renews it (each renewal batch is **one multi-read** that checks
//!   every held node still exists and belongs to our session), and a lease
//!   that is not renewed by its end — a forgotten guard, `watchdog = false`,
//!   `hold_at_least` — has its node deleted by the backend at that instant.
//! - **A crashed holder's key frees only when its session expires**: after
//!   the session timeout (`session_timeout`, default 10 s, as negotiated with
//!   the server), whatever `lease` says. A `lease` shorter than the session
//!   timeout does not shorten crash recovery; a longer one does not lengthen it.
//! - Every lease of the session is declared lost **at once** when the session
//!   expires, is closed, or its credentials are refused. While the client is
//!   **disconnected** the session may still be alive on the server, which
//!   cannot expire it before `last heard + session timeout`, where "last
//!   heard" is when the latest request the server answered was sent (the
//!   backend sends a read every sixth of the timeout while it holds leases,
//!   to keep it fresh). The leases are declared lost at `last heard + ⅔ ·
//!   session timeout` unless the client reconnects first — so the holder
//!   hears of the loss *before* anyone else can be granted the key. With
//!   `?loss=disconnect` they are declared lost at the first disconnection
//!   (Curator's default policy). Nodes of a lease declared lost whose session
//!   survives are deleted once the server is reachable again.
//!
//! **Release** deletes our node (already gone counts as released); a delete
//! that fails with the connection is retried — in the background after half
//! a session timeout, the call then answering a retryable error — until it
//! succeeds or the session ends (which deletes the node too). An acquisition
//! given up or cancelled at any point leaves no node: its queued node is
//! deleted, found by its GUID when the create's answer was not seen.
//!
//! **Keys** are stored escaped, injectively: `%`, `/` and every character
//! ZooKeeper refuses in a path (control characters, U+D800–U+F8FF,
//! U+FFF0–U+FFFF, and everything outside the Basic Multilingual Plane, such
//! as emoji, which the Java server sees as surrogates) are percent-encoded
//! (UTF-8 bytes), and the names `.`, `..` and `zookeeper` get their first
//! character encoded. No key is refused and no two keys share a node.
//!
//! **URL**: `zk://[user:pass@]h1:p1,h2:p2[/chroot][?session_timeout=10s&loss=session|disconnect&writers=mutex|rw]`.
//! `user:pass` (percent-encoded) authenticates with the `digest` scheme.
//! The chroot (default `/`) is created if missing. Nodes are created with the
//! open ACL, as Curator does by default. Every request is bounded by half the
//! session timeout.
//!
//! **Files**: this one holds the backend, its counters and its
//! [`LockBackend`] impl; `connect` opens a session, `session` keeps it and
//! its leases (and declares them lost), `acquire` runs an acquisition's
//! attempts (its node, its watch, the grant, its abandonment), `semaphore`
//! runs a permit's, `queue`
//! orders a key's queue, `renew` and `release` do what they say, `path`
//! names the nodes and `url` reads the URL.

mod acquire;
mod admin;
mod connect;
mod path;
mod queue;
mod release;
mod renew;
mod semaphore;
mod session;
mod url;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use zookeeper_client::Error as ZkError;

use crate::backend::{
    AcquireRequest, Attempt, HeldEntry, HoldMode, KeyEntry, Lease, LockBackend, Renewal, WakeSource,
};
use crate::error::{BackendError, LockError, redact_url};
use acquire::Pending;
use renew::held_node;
use session::Session;
use url::Target;

/// How soon an attempt that could not reach the server is tried again.
const RETRY: Duration = Duration::from_millis(100);

/// How many times one attempt creates, lists or watches again when the
/// queue changes under it (a reaped container, a predecessor that left).
const MAX_STEPS: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether trying again later may succeed. Requests in flight when a
/// connection fails get the connection's own error (`Custom`: an I/O error,
/// "no response from connection"), like `ConnectionLoss`.
fn transient(err: &ZkError) -> bool {
    matches!(
        err,
        ZkError::ConnectionLoss
            | ZkError::Timeout
            | ZkError::SessionExpired
            | ZkError::SessionMoved
            | ZkError::ClientClosed
            | ZkError::NoHosts
            | ZkError::Throttled
            | ZkError::Custom(_)
    )
}

/// Whether the error says the session is over (its ephemeral nodes with it).
fn session_over(err: &ZkError) -> bool {
    matches!(
        err,
        ZkError::SessionExpired
            | ZkError::SessionMoved
            | ZkError::ClientClosed
            | ZkError::AuthFailed
    )
}

fn backend_error(what: &str, err: ZkError) -> BackendError {
    let message = format!("zookeeper: {what}: {err}");
    if transient(&err) {
        BackendError::transient(message)
    } else {
        BackendError::permanent(message)
    }
}

/// Counters of one backend, for tests and operators ([`ZooKeeperBackend::stats`]).
#[derive(Debug, Default)]
struct Counters {
    sessions: AtomicU64,
    nodes_created: AtomicU64,
    creates_recovered: AtomicU64,
    watches_set: AtomicU64,
    watch_events: AtomicU64,
    losses: AtomicU64,
}

/// What a [`ZooKeeperBackend`] has done since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZooKeeperStats {
    /// Sessions opened (one, plus one after each session that ended).
    pub sessions: u64,
    /// Lock nodes created.
    pub nodes_created: u64,
    /// Lock nodes whose create reply was lost, found again by their GUID.
    pub creates_recovered: u64,
    /// Watches set by waiters: on a predecessor, or by a semaphore's first
    /// waiter on each lease.
    pub watches_set: u64,
    /// Watch events received by waiters (one per wake-up).
    pub watch_events: u64,
    /// Leases declared lost by the session monitor (expiry, long disconnection).
    pub leases_lost: u64,
}

struct Inner {
    target: Target,
    shown_url: String,
    current: Mutex<Option<Arc<Session>>>,
    connecting: tokio::sync::Mutex<()>,
    pending: Mutex<HashMap<String, Arc<Pending>>>,
    counters: Arc<Counters>,
}

/// The ZooKeeper backend. See the [module docs](self).
#[derive(Clone)]
pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

impl fmt::Debug for ZooKeeperBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZooKeeperBackend")
            .field("url", &self.inner.shown_url)
            .field("session_timeout", &self.inner.target.session_timeout)
            .field("loss", &self.inner.target.loss)
            .field("writers", &self.inner.target.writers)
            .finish_non_exhaustive()
    }
}

impl ZooKeeperBackend {
    /// Connects to the ensemble a `zk://` URL names (see the [module
    /// docs](self)) and opens the backend's session, creating the chroot if
    /// it is missing. The session lives on dlock's I/O runtime: the backend
    /// keeps working after the runtime that called `connect` has shut down.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let target = url::parse(url)?;
        let inner = Arc::new(Inner {
            target,
            shown_url: redact_url(url),
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            pending: Mutex::new(HashMap::new()),
            counters: Arc::new(Counters::default()),
        });
        inner
            .session()
            .await
            .map_err(|e| e.into_lock_error("zookeeper"))?;
        Ok(ZooKeeperBackend { inner })
    }

    /// What the backend has done so far (sessions, nodes, watches, losses).
    pub fn stats(&self) -> ZooKeeperStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ZooKeeperStats {
            sessions: get(&c.sessions),
            nodes_created: get(&c.nodes_created),
            creates_recovered: get(&c.creates_recovered),
            watches_set: get(&c.watches_set),
            watch_events: get(&c.watch_events),
            leases_lost: get(&c.losses),
        }
    }

    /// The path of the container node of a stored key (prefix included),
    /// from the ZooKeeper root: where its lock children are.
    pub fn container_path(&self, stored_key: &str) -> String {
        let chroot = &self.inner.target.chroot;
        let escaped = path::escape_key(stored_key);
        if chroot == "/" {
            format!("/{escaped}")
        } else {
            format!("{chroot}/{escaped}")
        }
    }

    /// The current session (to steal it in a test and force its expiry).
    #[doc(hidden)]
    pub fn session_for_tests(&self) -> Option<zookeeper_client::SessionInfo> {
        lock(&self.inner.current)
            .as_ref()
            .map(|s| s.client.session().clone())
    }
}

impl LockBackend for ZooKeeperBackend {
    fn kind(&self) -> &'static str {
        "zookeeper"
    }

    fn check_key(&self, key: &str) -> Result<(), String> {
        // Escaping makes every key a valid node name; this checks it.
        let escaped = path::escape_key(key);
        if path::valid_name(&escaped) {
            Ok(())
        } else {
            Err(format!("`{escaped}` is not a ZooKeeper node name"))
        }
    }

    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        // Plain locks and writers, readers, and permits: every mode.
        let _ = mode;
        Ok(())
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            match request.mode {
                HoldMode::Permit { permits } => self.inner.attempt_permit(request, permits).await,
                _ => self.inner.attempt(request).await,
            }
        })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let pending = self.inner.pending_for(request);
        Box::pin(std::future::ready(WakeSource::notify(
            pending.notify.clone(),
        )))
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(err) = self.inner.drop_pending(&request.owner).await {
                tracing::warn!(key = %request.key, error = %err, "dlock zookeeper: abandoned node not deleted yet");
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
            match held_node(lease) {
                Some(node) => self.inner.release_held(node).await,
                // An acquisition that ended without a grant (dropped, failed).
                None => self.inner.drop_pending(&lease.owner).await,
            }
        })
    }

    fn needs_io_runtime(&self) -> bool {
        // The client's session task lives where it connected (dlock's
        // runtime, which outlives the callers' runtimes), and so do the
        // waiters' watch tasks, the reaper and background deletes: calls
        // made there keep each round trip on the runtime that drives it.
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
