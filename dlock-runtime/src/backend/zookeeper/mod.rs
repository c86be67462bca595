//! ZooKeeper (`zk://`): Apache Curator's lock recipe, on one session per backend.
//!
//! **Layout** (the same as Curator's `InterProcessMutex`, so both can lock the
//! same keys): each stored key is a *container* node `{chroot}/{escaped key}`;
//! each acquisition creates an `EPHEMERAL_SEQUENTIAL` child
//! `_c_{guid}-lock-{sequence}` holding the owner token, where the GUID is
//! drawn at random when the acquisition starts (and again if it gives a
//! grant back and tries again: see below). The earliest-created child
//! holds the key; every other one watches only the child just ahead
//! of it, so a release wakes exactly one waiter (no herd) and waiters are
//! served in arrival order. Uncontended, an acquisition is one round trip:
//! the create and the listing of the key's children go out together, and the
//! server answers them in order. A waiter whose predecessor was the only
//! child ahead of it holds the key as soon as that child's deletion is
//! notified, without reading the queue again (children created later come
//! after it; a queued node deleted behind the waiter's back is found by the
//! first renewal, as for a revoked holder). The backend never deletes a
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
//! **Fencing token**: the child's `czxid`, the 64-bit id of the transaction
//! that created it, from the create's reply. Transaction ids are totally
//! ordered across the ensemble and later holders are created later, so the
//! token strictly increases per key even when the container is reaped and
//! its sequence counter starts again (the sequence is not a token).
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
//! **URL**: `zk://[user:pass@]h1:p1,h2:p2[/chroot][?session_timeout=10s&loss=session|disconnect]`.
//! `user:pass` (percent-encoded) authenticates with the `digest` scheme.
//! The chroot (default `/`) is created if missing. Nodes are created with the
//! open ACL, as Curator does by default. Every request is bounded by half the
//! session timeout.

mod path;
mod session;
mod url;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use zookeeper_client::{Acls, Client, CreateMode, Error as ZkError, EventType, MultiReadResult};

use crate::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal, WakeSource};
use crate::error::{BackendError, LockError, redact_url};
use crate::token::FencingToken;
use path::Position;
use session::{HeldNode, Session};
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
    /// Watches set on a predecessor by a waiter.
    pub watches_set: u64,
    /// Watch events received by waiters (one per wake-up).
    pub watch_events: u64,
    /// Leases declared lost by the session monitor (expiry, long disconnection).
    pub leases_lost: u64,
}

/// Our node, as created (or recovered).
#[derive(Debug, Clone)]
struct OurNode {
    name: String,
    czxid: i64,
}

/// A watch on our predecessor. Dropping it removes the watch.
struct Watch {
    path: String,
    /// It was the only lock node ahead of ours when the queue was read.
    alone: bool,
    fired: Arc<AtomicBool>,
    /// The event was the predecessor's deletion.
    deleted: Arc<AtomicBool>,
    stop: CancellationToken,
    /// When the queue was last read: the watch is trusted for a session
    /// timeout after that, then the queue is read again.
    checked_at: Instant,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One acquisition in progress, from its first attempt to its grant,
/// abandonment or release: its queued node survives across attempts.
struct Pending {
    owner: String,
    container: String,
    guid: String,
    notify: Arc<Notify>,
    state: Mutex<PendingState>,
}

#[derive(Default)]
struct PendingState {
    /// The session of the latest create.
    session: Option<Arc<Session>>,
    /// Our node on that session, when known.
    node: Option<OurNode>,
    /// A create was sent on that session and its answer not seen.
    maybe_created: bool,
    watch: Option<Watch>,
}

impl Pending {
    fn state(&self) -> MutexGuard<'_, PendingState> {
        lock(&self.state)
    }

    /// Our node, if it was created on `session` (a node of an ended session
    /// is gone with it).
    fn node_on(&self, session: &Arc<Session>) -> Option<OurNode> {
        let st = self.state();
        match &st.session {
            Some(s) if Arc::ptr_eq(s, session) => st.node.clone(),
            _ => None,
        }
    }

    fn forget_node(&self) {
        let mut st = self.state();
        st.node = None;
        st.watch = None;
    }

    /// Our node, if it holds the key without reading the queue again: the
    /// only node ahead of it is deleted (nodes created later come after
    /// ours, so none can have come ahead), and its session lives.
    fn promoted(&self) -> Option<(Arc<Session>, OurNode)> {
        let st = self.state();
        let watch = st.watch.as_ref()?;
        if !watch.alone || !watch.deleted.load(Ordering::Acquire) {
            return None;
        }
        let session = st.session.as_ref().filter(|s| s.is_alive())?.clone();
        Some((session, st.node.clone()?))
    }

    /// Busy without a round trip: our predecessor's watch has not fired, so
    /// it is still there, ahead of us.
    fn still_behind(&self) -> Option<Attempt> {
        let st = self.state();
        let watch = st.watch.as_ref()?;
        let session = st.session.as_ref()?;
        if st.node.is_none() || !session.is_alive() || watch.fired.load(Ordering::Acquire) {
            return None;
        }
        let since = watch.checked_at.elapsed();
        (since < session.timeout).then(|| Attempt::Busy {
            retry_in: Some(session.timeout - since),
        })
    }
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

impl Inner {
    fn current_alive(&self) -> Option<Arc<Session>> {
        lock(&self.current)
            .as_ref()
            .filter(|s| s.is_alive())
            .cloned()
    }

    /// The live session, opening a new one if there is none (the first
    /// call, or the previous one ended).
    async fn session(self: &Arc<Self>) -> Result<Arc<Session>, BackendError> {
        if let Some(s) = self.current_alive() {
            return Ok(s);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(s) = self.current_alive() {
            return Ok(s);
        }
        let inner = self.clone();
        // The client's tasks live on the runtime that connects: dlock's own.
        let session = crate::driver::run(async move { inner.open().await }).await?;
        *lock(&self.current) = Some(session.clone());
        Ok(session)
    }

    async fn open(self: Arc<Self>) -> Result<Arc<Session>, BackendError> {
        let t = &self.target;
        let mut connector = Client::connector()
            .with_session_timeout(t.session_timeout)
            .with_fail_eagerly();
        if let Some(digest) = &t.digest {
            connector = connector.with_auth("digest", digest.as_bytes());
        }
        let started = Instant::now();
        let bound = t.session_timeout.max(Duration::from_secs(1));
        let root = match tokio::time::timeout(bound, connector.connect(&t.hosts)).await {
            Ok(Ok(client)) => client,
            Ok(Err(err)) => {
                return Err(backend_error(
                    &format!("cannot connect to {}", self.shown_url),
                    err,
                ));
            }
            Err(_) => {
                return Err(BackendError::transient(format!(
                    "zookeeper: no session with {} within {bound:?}",
                    self.shown_url
                )));
            }
        };
        if t.chroot != "/" {
            let exists = tokio::time::timeout(bound, root.check_stat(&t.chroot)).await;
            match exists {
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => {
                    let made = tokio::time::timeout(bound, mkdir(&root, &t.chroot)).await;
                    match made {
                        Ok(Ok(())) => {}
                        Ok(Err(err)) => {
                            return Err(backend_error(
                                &format!("cannot create the chroot {}", t.chroot),
                                err,
                            ));
                        }
                        Err(_) => {
                            return Err(BackendError::transient(format!(
                                "zookeeper: creating the chroot {} timed out",
                                t.chroot
                            )));
                        }
                    }
                }
                Ok(Err(err)) => {
                    return Err(backend_error(
                        &format!("cannot read the chroot {}", t.chroot),
                        err,
                    ));
                }
                Err(_) => {
                    return Err(BackendError::transient(format!(
                        "zookeeper: reading the chroot {} timed out",
                        t.chroot
                    )));
                }
            }
        }
        let client = root
            .clone()
            .chroot(t.chroot.clone())
            .map_err(|_| BackendError::permanent(format!("zookeeper: bad chroot {}", t.chroot)))?;
        let states = client.state_watcher();
        let session = Session::new(client, root, started);
        self.counters.sessions.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            url = %self.shown_url,
            session = %format_args!("{:#x}", session.id),
            timeout_ms = session.timeout.as_millis() as u64,
            "dlock zookeeper: session opened"
        );
        crate::driver::handle().spawn(session::reaper(Arc::downgrade(&session)));
        crate::driver::handle().spawn(session::monitor(
            Arc::downgrade(&session),
            states,
            t.loss,
            self.counters.clone(),
        ));
        Ok(session)
    }

    /// The in-progress state of `request`'s acquisition (created at its
    /// first attempt, before anything is sent).
    fn pending_for(&self, request: &AcquireRequest) -> Arc<Pending> {
        lock(&self.pending)
            .entry(request.owner.clone())
            .or_insert_with(|| {
                let container = format!("/{}", path::escape_key(&request.key));
                Arc::new(Pending {
                    owner: request.owner.clone(),
                    guid: path::new_guid(),
                    container,
                    notify: Arc::new(Notify::new()),
                    state: Mutex::new(PendingState::default()),
                })
            })
            .clone()
    }

    /// One attempt: see [`LockBackend::try_acquire`].
    async fn attempt(self: &Arc<Self>, request: &AcquireRequest) -> Result<Attempt, BackendError> {
        let started = Instant::now();
        let pending = self.pending_for(request);
        if let Some((session, node)) = pending.promoted() {
            return Ok(Attempt::Held(
                self.grant(request, &pending, &session, &node, started),
            ));
        }
        if let Some(busy) = pending.still_behind() {
            return Ok(busy);
        }
        let session = match self.session().await {
            Ok(session) => session,
            Err(error) if error.is_retryable() => {
                return Ok(Attempt::Unavailable {
                    error,
                    retry_in: RETRY,
                });
            }
            Err(error) => return Err(error),
        };
        let unavailable = |what: &str, err: ZkError| {
            let error = backend_error(what, err);
            if error.is_retryable() {
                Ok(Attempt::Unavailable {
                    error,
                    retry_in: RETRY,
                })
            } else {
                Err(error)
            }
        };
        for _ in 0..MAX_STEPS {
            let (node, listed) = match pending.node_on(&session) {
                Some(node) => (node, None),
                None => match self.create_node(&session, &pending).await {
                    Ok(created) => created,
                    Err(err) => return unavailable("creating the lock node", err),
                },
            };
            let fresh = listed.is_some();
            let children = match listed {
                Some(children) => children,
                None => match session.call(|c| c.list_children(&pending.container)).await {
                    Ok(children) => children,
                    Err(ZkError::NoNode) => {
                        pending.forget_node();
                        continue;
                    }
                    Err(err) => return unavailable("listing the lock's queue", err),
                },
            };
            // A create of ours that surfaced late, beside the node we use.
            let mine = path::guid_prefix(&pending.guid);
            let ghosts: Vec<String> = children
                .iter()
                .filter(|c| c.starts_with(&mine) && **c != node.name)
                .map(|c| format!("{}/{c}", pending.container))
                .collect();
            if !ghosts.is_empty() {
                for ghost in ghosts {
                    let deadline = Some(Instant::now() + session.op_timeout);
                    if let Err(err) = delete_until_gone(&session, &ghost, deadline).await {
                        return unavailable("deleting a duplicate lock node", err);
                    }
                }
                continue;
            }
            let queue = match self
                .queue(&session, &pending.container, &children, &node)
                .await
            {
                Ok(queue) => queue,
                Err(err) => return unavailable("reading the lock's queue", err),
            };
            match path::position(&queue, &node.name) {
                // The listing sent with the create is read after it on the
                // server, so it shows our node; should it not, read again
                // rather than forget a node that exists.
                Position::Missing if fresh => {}
                Position::Missing => {
                    // Deleted behind our back while queued: queue again.
                    pending.forget_node();
                }
                Position::Holder => {
                    return Ok(Attempt::Held(
                        self.grant(request, &pending, &session, &node, started),
                    ));
                }
                Position::Behind(ahead) => {
                    if request.wait.is_zero() {
                        // Tried once: the wait loop abandons, deleting our node.
                        return Ok(Attempt::Busy { retry_in: None });
                    }
                    let alone = path::ahead_of(&queue, &node.name) == 1;
                    let ahead = format!("{}/{ahead}", pending.container);
                    match self.watch(&session, &pending, ahead, alone).await {
                        Ok(true) => {
                            return Ok(Attempt::Busy {
                                retry_in: Some(session.timeout),
                            });
                        }
                        Ok(false) => {}
                        Err(err) => return unavailable("watching the lock's queue", err),
                    }
                }
            }
        }
        // The queue kept changing under this attempt: look again at once.
        Ok(Attempt::Busy {
            retry_in: Some(Duration::ZERO),
        })
    }

    /// Creates our node on `session` — or finds it again, if the answer of
    /// an earlier create on this session was lost. A fresh create is sent
    /// together with the listing of the key's children: the server reads
    /// them after the create (one session's requests are served in order),
    /// so an uncontended acquisition costs one round trip, not two.
    async fn create_node(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
    ) -> Result<(OurNode, Option<Vec<String>>), ZkError> {
        let recovering = {
            let mut st = pending.state();
            if !st.session.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
                // A node of an ended session is gone with it.
                st.session = Some(session.clone());
                st.node = None;
                st.maybe_created = false;
            }
            st.watch = None;
            st.maybe_created
        };
        if recovering && let Some(node) = self.find_ours(session, pending).await? {
            self.counters
                .creates_recovered
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(node = %node.name, "dlock zookeeper: lost create reply; node recovered by its GUID");
            let mut st = pending.state();
            st.node = Some(node.clone());
            st.maybe_created = false;
            return Ok((node, None));
        }
        let prefix = path::child_prefix(&pending.container, &pending.guid);
        let options = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        for _ in 0..MAX_STEPS {
            // Sent when called: from here on the node may exist.
            pending.state().maybe_created = true;
            let sent = Instant::now();
            let create = session
                .client
                .create(&prefix, pending.owner.as_bytes(), &options);
            let list = session.client.list_children(&pending.container);
            let created = session.finish(sent, create).await;
            let listed = match &created {
                Ok(_) => session.finish(sent, list).await.ok(),
                Err(_) => None,
            };
            match created {
                Ok((stat, sequence)) => {
                    let name = format!("{}{sequence}", &prefix[pending.container.len() + 1..]);
                    if path::sequence_of(&name).is_none() {
                        return Err(ZkError::UnexpectedError(format!(
                            "lock node without a sequence: {name}"
                        )));
                    }
                    let node = OurNode {
                        name,
                        czxid: stat.czxid,
                    };
                    self.counters.nodes_created.fetch_add(1, Ordering::Relaxed);
                    let mut st = pending.state();
                    st.node = Some(node.clone());
                    st.maybe_created = false;
                    return Ok((node, listed));
                }
                Err(ZkError::NoNode) => {
                    pending.state().maybe_created = false;
                    self.create_container(session, &pending.container).await?;
                }
                // At the counter's end every child gets the same sequence:
                // a node of ours, created earlier, has this very name.
                Err(ZkError::NodeExists) => {
                    let Some(node) = self.find_ours(session, pending).await? else {
                        return Err(ZkError::NodeExists);
                    };
                    let mut st = pending.state();
                    st.node = Some(node.clone());
                    st.maybe_created = false;
                    return Ok((node, None));
                }
                Err(err) => return Err(err),
            }
        }
        Err(ZkError::UnexpectedError(format!(
            "the container {} kept disappearing",
            pending.container
        )))
    }

    /// The lock children of `children` in creation order (see
    /// [`path::position`]): ranked by sequence number while those give the
    /// order, else by `czxid`, read for every other child in one multi-read
    /// (children gone meanwhile are left out).
    async fn queue(
        &self,
        session: &Arc<Session>,
        container: &str,
        children: &[String],
        ours: &OurNode,
    ) -> Result<Vec<(String, i64)>, ZkError> {
        let locks: Vec<(&String, i32)> = children
            .iter()
            .filter_map(|name| Some((name, path::sequence_of(name)?)))
            .collect();
        if path::in_sequence_order(locks.iter().map(|(_, seq)| *seq)) {
            return Ok(locks
                .into_iter()
                .map(|(name, seq)| (name.clone(), i64::from(seq)))
                .collect());
        }
        let others: Vec<&String> = locks
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| **name != ours.name)
            .collect();
        let mut queue = Vec::with_capacity(locks.len());
        if others.len() < locks.len() {
            queue.push((ours.name.clone(), ours.czxid));
        }
        if others.is_empty() {
            return Ok(queue);
        }
        let mut reader = session.client.new_multi_reader();
        for name in &others {
            reader.add_get_data(&format!("{container}/{name}"))?;
        }
        let sent = Instant::now();
        let request = reader.commit();
        let results = session.finish(sent, request).await?;
        if results.len() != others.len() {
            return Err(ZkError::UnexpectedError(
                "short multi-read answer".to_owned(),
            ));
        }
        for (name, result) in others.into_iter().zip(results) {
            match result {
                MultiReadResult::Data { stat, .. } => queue.push((name.clone(), stat.czxid)),
                MultiReadResult::Error {
                    err: ZkError::NoNode,
                } => {}
                MultiReadResult::Error { err } => return Err(err),
                other => {
                    return Err(ZkError::UnexpectedError(format!(
                        "unexpected multi-read answer {other:?}"
                    )));
                }
            }
        }
        Ok(queue)
    }

    /// Our node among the key's children, by GUID, if it belongs to
    /// `session`. Any other node of ours on it is deleted.
    async fn find_ours(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
    ) -> Result<Option<OurNode>, ZkError> {
        let children = match session.call(|c| c.list_children(&pending.container)).await {
            Ok(children) => children,
            Err(ZkError::NoNode) => return Ok(None),
            Err(err) => return Err(err),
        };
        let mine = path::guid_prefix(&pending.guid);
        let mut found = Vec::new();
        for name in children.iter().filter(|c| c.starts_with(&mine)) {
            let node_path = format!("{}/{name}", pending.container);
            match session.call(|c| c.get_data(&node_path)).await {
                Ok((data, stat))
                    if stat.ephemeral_owner == session.id && data == pending.owner.as_bytes() =>
                {
                    if path::sequence_of(name).is_some() {
                        found.push(OurNode {
                            name: name.clone(),
                            czxid: stat.czxid,
                        });
                    }
                }
                // A node of an earlier session: it goes with that session.
                Ok(_) | Err(ZkError::NoNode) => {}
                Err(err) => return Err(err),
            }
        }
        found.sort_by_key(|node| node.czxid);
        let mut found = found.into_iter();
        let keep = found.next();
        for extra in found {
            let extra = format!("{}/{}", pending.container, extra.name);
            delete_until_gone(session, &extra, Some(Instant::now() + session.op_timeout)).await?;
        }
        Ok(keep)
    }

    /// Creates the key's container (again, if the server reaped it).
    async fn create_container(&self, session: &Session, container: &str) -> Result<(), ZkError> {
        let options = CreateMode::Container.with_acls(Acls::anyone_all());
        for _ in 0..2 {
            match session.call(|c| c.create(container, &[], &options)).await {
                Ok(_) | Err(ZkError::NodeExists) => return Ok(()),
                Err(ZkError::NoNode) if self.target.chroot != "/" => {
                    // The chroot itself was deleted: create it again.
                    let sent = Instant::now();
                    let made = mkdir(&session.root, &self.target.chroot);
                    session.finish(sent, made).await?;
                }
                Err(err) => return Err(err),
            }
        }
        Err(ZkError::NoNode)
    }

    /// Watches our predecessor; false if it is already gone.
    async fn watch(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
        ahead: String,
        alone: bool,
    ) -> Result<bool, ZkError> {
        {
            let mut st = pending.state();
            if let Some(watch) = &mut st.watch
                && watch.path == ahead
                && !watch.fired.load(Ordering::Acquire)
            {
                watch.checked_at = Instant::now();
                watch.alone = alone;
                return Ok(true);
            }
            st.watch = None;
        }
        // A data watch, as Curator sets: on a node already gone it fails
        // with NoNode and leaves no watch behind (an exists-watch would).
        let sent = Instant::now();
        let request = session.client.get_and_watch_data(&ahead);
        let watcher = match session.finish(sent, request).await {
            Ok((_, _, watcher)) => watcher,
            Err(ZkError::NoNode) => return Ok(false),
            Err(err) => return Err(err),
        };
        self.counters.watches_set.fetch_add(1, Ordering::Relaxed);
        let fired = Arc::new(AtomicBool::new(false));
        let deleted = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let task = {
            let (fired, deleted, stop) = (fired.clone(), deleted.clone(), stop.clone());
            let (notify, counters) = (pending.notify.clone(), self.counters.clone());
            async move {
                tokio::select! {
                    event = watcher.changed() => {
                        deleted.store(event.event_type == EventType::NodeDeleted, Ordering::Release);
                        fired.store(true, Ordering::Release);
                        counters.watch_events.fetch_add(1, Ordering::Relaxed);
                        tracing::trace!(path = %event.path, event = %event.event_type, "dlock zookeeper: predecessor changed");
                        notify.notify_waiters();
                    }
                    // Dropping the watcher removes the watch.
                    () = stop.cancelled() => {}
                }
            }
        };
        crate::driver::handle().spawn(task);
        pending.state().watch = Some(Watch {
            path: ahead,
            alone,
            fired,
            deleted,
            stop,
            checked_at: Instant::now(),
        });
        Ok(true)
    }

    /// Our node holds the key: the lease, registered with its session.
    fn grant(
        &self,
        request: &AcquireRequest,
        pending: &Pending,
        session: &Arc<Session>,
        node: &OurNode,
        started: Instant,
    ) -> Lease {
        if let Some(done) = lock(&self.pending).remove(&request.owner) {
            done.state().watch = None;
        }
        let held = session.register(
            format!("{}/{}", pending.container, node.name),
            request.lost.clone(),
            crate::time::saturating_add(started, request.lease),
        );
        if session.refuses_grants() {
            // The session ended, or its leases were declared lost while
            // disconnected, between the read and the registration: this
            // grant is lost with them. A node that may still exist is
            // deleted once the server is reachable, as theirs are.
            session.unregister(&held);
            request.lost.cancel();
            if session.is_alive() {
                let (session, path) = (session.clone(), held.path.clone());
                crate::driver::handle().spawn(async move {
                    let _ = delete_until_gone(&session, &path, None).await;
                });
            }
        }
        Lease::new(request, Some(FencingToken::new(node.czxid as u64))).with_extra(held)
    }

    /// Ends an acquisition that did not end with a grant: deletes its node
    /// (by GUID when the create's answer was not seen).
    async fn drop_pending(&self, owner: &str) -> Result<(), BackendError> {
        let Some(pending) = lock(&self.pending).remove(owner) else {
            return Ok(());
        };
        let (session, node, maybe_created) = {
            let mut st = pending.state();
            st.watch = None;
            (st.session.clone(), st.node.clone(), st.maybe_created)
        };
        let Some(session) = session else {
            return Ok(());
        };
        if let Some(node) = node {
            return delete_node(session, format!("{}/{}", pending.container, node.name)).await;
        }
        if maybe_created {
            return delete_by_guid(session, pending.container.clone(), pending.guid.clone()).await;
        }
        Ok(())
    }

    async fn release_held(&self, node: Arc<HeldNode>) -> Result<(), BackendError> {
        let Some(session) = node.session.upgrade() else {
            // The session is gone, and its ephemeral nodes with it.
            return Ok(());
        };
        session.unregister(&node);
        delete_node(session, node.path.clone()).await
    }

    async fn renew_batch(
        &self,
        batch: &[(&Lease, Duration)],
    ) -> Vec<Result<Renewal, BackendError>> {
        type Group = (Arc<Session>, Vec<(usize, Arc<HeldNode>, Duration)>);
        let mut answers: Vec<Option<Result<Renewal, BackendError>>> =
            batch.iter().map(|_| None).collect();
        let mut groups: Vec<Group> = Vec::new();
        for (i, (lease, ttl)) in batch.iter().enumerate() {
            let Some(node) = held_node(lease) else {
                answers[i] = Some(Err(BackendError::permanent(
                    "zookeeper: not a lease granted by this backend",
                )));
                continue;
            };
            let session = node.session.upgrade().filter(|s| s.is_alive());
            let Some(session) = session.filter(|_| !node.is_ended() && !node.lost.is_cancelled())
            else {
                answers[i] = Some(Ok(Renewal::Lost));
                continue;
            };
            match groups.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &session)) {
                Some((_, items)) => items.push((i, node, *ttl)),
                None => groups.push((session, vec![(i, node, *ttl)])),
            }
        }
        // One multi-read per session (one in practice): every node, its owner.
        for (session, items) in groups {
            let mut reader = session.client.new_multi_reader();
            let added = items
                .iter()
                .try_for_each(|(_, node, _)| reader.add_get_data(&node.path));
            if let Err(err) = added {
                for (i, _, _) in &items {
                    answers[*i] = Some(Err(backend_error("renewal", err.clone())));
                }
                continue;
            }
            let sent = Instant::now();
            let request = reader.commit();
            match session.finish(sent, request).await {
                Ok(results) if results.len() == items.len() => {
                    for ((i, node, ttl), result) in items.into_iter().zip(results) {
                        answers[i] = Some(match result {
                            MultiReadResult::Data { stat, .. }
                                if stat.ephemeral_owner == session.id =>
                            {
                                Ok(if session.extend(&node, sent, ttl) {
                                    Renewal::Renewed
                                } else {
                                    Renewal::Lost
                                })
                            }
                            MultiReadResult::Data { .. }
                            | MultiReadResult::Error {
                                err: ZkError::NoNode,
                            } => {
                                session.unregister(&node);
                                Ok(Renewal::Lost)
                            }
                            MultiReadResult::Error { err } => Err(backend_error("renewal", err)),
                            other => Err(BackendError::permanent(format!(
                                "zookeeper: unexpected renewal answer {other:?}"
                            ))),
                        });
                    }
                }
                Ok(_) => {
                    for (i, _, _) in &items {
                        answers[*i] = Some(Err(BackendError::permanent(
                            "zookeeper: short multi-read answer",
                        )));
                    }
                }
                Err(err) if session_over(&err) => {
                    for (i, _, _) in &items {
                        answers[*i] = Some(Ok(Renewal::Lost));
                    }
                }
                Err(err) => {
                    for (i, _, _) in &items {
                        answers[*i] = Some(Err(backend_error("renewal", err.clone())));
                    }
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(BackendError::permanent("zookeeper: no answer"))))
            .collect()
    }
}

fn held_node(lease: &Lease) -> Option<Arc<HeldNode>> {
    lease.extra.clone()?.downcast::<HeldNode>().ok()
}

/// `mkdir -p` of persistent nodes with the open ACL.
async fn mkdir(root: &Client, path: &str) -> Result<(), ZkError> {
    root.mkdir(path, &CreateMode::Persistent.with_acls(Acls::anyone_all()))
        .await
}

/// `request`, cut short at `deadline` (a `Timeout` then).
async fn within<T>(
    deadline: Option<Instant>,
    request: impl std::future::Future<Output = Result<T, ZkError>>,
) -> Result<T, ZkError> {
    match deadline {
        Some(at) => tokio::time::timeout_at(at.into(), request)
            .await
            .unwrap_or(Err(ZkError::Timeout)),
        None => request.await,
    }
}

/// Deletes `path` until it is gone or the session has ended (which deletes
/// it too), trying again after connection losses; stops at `deadline` with
/// the last error. Permanent errors end it at once.
async fn delete_until_gone(
    session: &Session,
    path: &str,
    deadline: Option<Instant>,
) -> Result<(), ZkError> {
    let mut backoff = Duration::from_millis(10);
    loop {
        if !session.is_alive() {
            return Ok(());
        }
        match within(deadline, session.call(|c| c.delete(path, None))).await {
            Ok(()) | Err(ZkError::NoNode) => return Ok(()),
            Err(err) if session_over(&err) => return Ok(()),
            Err(err) if transient(&err) => {
                let now = Instant::now();
                if deadline.is_some_and(|d| now + backoff >= d) {
                    return Err(err);
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(err) => return Err(err),
        }
    }
}

/// Deletes the nodes an acquisition with `guid` created, until none is
/// left or the session has ended; stops at `deadline` with the last error.
async fn delete_guid_nodes(
    session: &Session,
    container: &str,
    guid: &str,
    deadline: Option<Instant>,
) -> Result<(), ZkError> {
    let mine = path::guid_prefix(guid);
    let mut backoff = Duration::from_millis(10);
    loop {
        if !session.is_alive() {
            return Ok(());
        }
        match within(deadline, session.call(|c| c.list_children(container))).await {
            Ok(children) => {
                for name in children.iter().filter(|c| c.starts_with(&mine)) {
                    delete_until_gone(session, &format!("{container}/{name}"), deadline).await?;
                }
                return Ok(());
            }
            Err(ZkError::NoNode) => return Ok(()),
            Err(err) if session_over(&err) => return Ok(()),
            Err(err) if transient(&err) => {
                if deadline.is_some_and(|d| Instant::now() + backoff >= d) {
                    return Err(err);
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(err) => return Err(err),
        }
    }
}

/// Deletes our node within half a session timeout, or goes on in the
/// background (until it is gone or the session ends) and says so.
async fn delete_node(session: Arc<Session>, path: String) -> Result<(), BackendError> {
    let deadline = Instant::now() + session.op_timeout;
    match delete_until_gone(&session, &path, Some(deadline)).await {
        Ok(()) => Ok(()),
        Err(err) if transient(&err) => {
            let message = format!(
                "zookeeper: the lock node {path} is not deleted yet ({err}); the delete goes on \
                 in the background until it succeeds or the session ends"
            );
            crate::driver::handle().spawn(async move {
                let _ = delete_until_gone(&session, &path, None).await;
            });
            Err(BackendError::transient(message))
        }
        Err(err) => Err(backend_error(
            &format!("deleting the lock node {path}"),
            err,
        )),
    }
}

/// [`delete_node`] for an acquisition whose node is known only by its GUID.
async fn delete_by_guid(
    session: Arc<Session>,
    container: String,
    guid: String,
) -> Result<(), BackendError> {
    let deadline = Instant::now() + session.op_timeout;
    match delete_guid_nodes(&session, &container, &guid, Some(deadline)).await {
        Ok(()) => Ok(()),
        Err(err) if transient(&err) => {
            let message = format!(
                "zookeeper: the queued nodes under {container} are not deleted yet ({err}); \
                 the delete goes on in the background until it succeeds or the session ends"
            );
            crate::driver::handle().spawn(async move {
                let _ = delete_guid_nodes(&session, &container, &guid, None).await;
            });
            Err(BackendError::transient(message))
        }
        Err(err) => Err(backend_error(
            &format!("deleting the nodes under {container}"),
            err,
        )),
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
}
