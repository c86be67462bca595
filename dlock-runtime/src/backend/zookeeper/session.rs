//! One ZooKeeper session, the leases held through it, and the task that
//! declares them lost when the session ends or the connection stays down.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use zookeeper_client::{
    Client, Error as ZkError, MultiReadResult, SessionState, Stat, StateWatcher,
};

use super::url::LossPolicy;
use super::{Counters, session_over, transient};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a few field updates: poisoning is ignored.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the server answered (an error code of the request itself; not a
/// connection, session or client failure).
fn answered(err: &ZkError) -> bool {
    matches!(
        err,
        ZkError::NoNode
            | ZkError::NodeExists
            | ZkError::NotEmpty
            | ZkError::BadVersion
            | ZkError::NoAuth
            | ZkError::NoChildrenForEphemerals
            | ZkError::InvalidAcl
            | ZkError::QuotaExceeded
            | ZkError::Unimplemented
            | ZkError::NotReadOnly
            | ZkError::MarshallingError
            | ZkError::UnexpectedErrorCode(_)
    )
}

/// A session of the backend: its client, and every lease held through it.
pub(super) struct Session {
    /// The client, chrooted to the URL's chroot.
    pub(super) client: Client,
    /// The same session at the root (to create the chroot again if it is deleted).
    pub(super) root: Client,
    /// The session id: nodes whose `ephemeralOwner` is this are ours.
    pub(super) id: i64,
    /// The negotiated session timeout.
    pub(super) timeout: Duration,
    /// The bound on one request: half the session timeout.
    pub(super) op_timeout: Duration,
    base: Instant,
    /// When the latest request the server answered was sent (ns after `base`):
    /// the server cannot expire the session before this + `timeout`.
    last_heard: AtomicU64,
    /// The held leases, under the end of their lease (and an id): the
    /// reaper deletes a node whose lease ran out unrenewed.
    held: Mutex<Held>,
    next_id: AtomicU64,
    /// Wakes the reaper when a lease ends earlier than it planned to look.
    reaper: Arc<tokio::sync::Notify>,
    /// Cancelled when the session has ended (expired, closed, auth failed)
    /// or is dropped.
    pub(super) ended: CancellationToken,
    /// Every lease of the session was declared lost while disconnected, and
    /// the client has not been connected since: a grant made now (a waiter
    /// answered from what it had already read) would escape that
    /// declaration, so it is lost at once too.
    losing: AtomicBool,
}

/// The held leases by the end of their lease, and when the reaper looks next.
#[derive(Default)]
struct Held {
    by_end: BTreeMap<(Instant, u64), Arc<HeldNode>>,
    /// The reaper's next look (`None`: before its first). A lease ending
    /// later needs no wake-up: acquiring a lease of a few seconds or more
    /// never wakes the reaper.
    next_look: Option<Instant>,
}

/// The reaper looks at least this often, even with nothing due.
const IDLE_LOOK: Duration = Duration::from_secs(1);

impl Drop for Session {
    fn drop(&mut self) {
        self.ended.cancel();
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &format_args!("{:#x}", self.id))
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Session {
    pub(super) fn new(client: Client, root: Client, connected_at: Instant) -> Arc<Self> {
        let timeout = client.session_timeout();
        Arc::new(Session {
            id: client.session_id().0,
            root,
            client,
            timeout,
            op_timeout: (timeout / 2).max(Duration::from_millis(50)),
            base: connected_at,
            last_heard: AtomicU64::new(0),
            held: Mutex::new(Held::default()),
            next_id: AtomicU64::new(1),
            reaper: Arc::new(tokio::sync::Notify::new()),
            ended: CancellationToken::new(),
            losing: AtomicBool::new(false),
        })
    }

    /// Whether the session can still be used (not expired, closed or refused).
    pub(super) fn is_alive(&self) -> bool {
        !self.ended.is_cancelled() && !self.client.state().is_terminated()
    }

    /// Whether a lease granted now must be lost at once: the session ended,
    /// or its leases were declared lost and it has not reconnected since.
    /// Asked after [`register`](Self::register): a declaration that took the
    /// held leases before the registration is seen here (the flag is set
    /// before the held list is taken, under the same lock as the insert).
    pub(super) fn refuses_grants(&self) -> bool {
        !self.is_alive() || self.losing.load(Ordering::SeqCst)
    }

    fn heard(&self, sent: Instant) {
        let ns = sent.saturating_duration_since(self.base).as_nanos();
        self.last_heard
            .fetch_max(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::AcqRel);
    }

    /// The send instant of the latest request the server answered.
    pub(super) fn last_heard(&self) -> Instant {
        self.base + Duration::from_nanos(self.last_heard.load(Ordering::Acquire))
    }

    /// The children of `parent` whose names `keep` accepts, each with its
    /// data and stat, in creation order (`czxid`), read in one multi-read;
    /// empty for a missing parent, and without children deleted meanwhile.
    pub(super) async fn read_children(
        &self,
        parent: &str,
        keep: fn(&str) -> bool,
    ) -> Result<Vec<(String, Vec<u8>, Stat)>, ZkError> {
        let names = match self.call(|c| c.list_children(parent)).await {
            Ok(names) => names,
            Err(ZkError::NoNode) => return Ok(Vec::new()),
            Err(err) => return Err(err),
        };
        let names: Vec<String> = names.into_iter().filter(|n| keep(n)).collect();
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut reader = self.client.new_multi_reader();
        for name in &names {
            reader.add_get_data(&format!("{parent}/{name}"))?;
        }
        let sent = Instant::now();
        let request = reader.commit();
        let results = self.finish(sent, request).await?;
        let mut children = Vec::with_capacity(names.len());
        for (name, result) in names.into_iter().zip(results) {
            match result {
                MultiReadResult::Data { data, stat } => children.push((name, data, stat)),
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
        children.sort_by_key(|(_, _, stat)| stat.czxid);
        Ok(children)
    }

    /// Waits for a request sent at `sent`, at most [`op_timeout`](Self::op_timeout)
    /// (`Timeout` then; a request sent is carried out even if its answer is
    /// not awaited), and records when the server was last heard from.
    pub(super) async fn finish<T>(
        &self,
        sent: Instant,
        request: impl Future<Output = Result<T, ZkError>>,
    ) -> Result<T, ZkError> {
        match tokio::time::timeout(self.op_timeout, request).await {
            Ok(Ok(value)) => {
                self.heard(sent);
                Ok(value)
            }
            Ok(Err(err)) => {
                if answered(&err) {
                    self.heard(sent);
                }
                Err(err)
            }
            Err(_) => Err(ZkError::Timeout),
        }
    }

    /// One request: `send` is called (which sends it) and its answer awaited
    /// as in [`finish`](Self::finish).
    pub(super) async fn call<'a, T, F>(
        &'a self,
        send: impl FnOnce(&'a Client) -> F,
    ) -> Result<T, ZkError>
    where
        F: Future<Output = Result<T, ZkError>> + 'a,
    {
        let sent = Instant::now();
        let request = send(&self.client);
        self.finish(sent, request).await
    }

    /// A granted node, whose lease ends at `expires_at` unless renewed.
    pub(super) fn register(
        self: &Arc<Self>,
        path: String,
        lost: CancellationToken,
        expires_at: Instant,
    ) -> Arc<HeldNode> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let node = Arc::new(HeldNode {
            path,
            id,
            session: Arc::downgrade(self),
            lost,
            state: Mutex::new(HeldState {
                expires_at,
                ended: false,
            }),
        });
        let wake = {
            let mut held = lock(&self.held);
            held.by_end.insert((expires_at, id), node.clone());
            held.next_look.is_some_and(|next| expires_at < next)
        };
        if wake {
            self.reaper.notify_one();
        }
        node
    }

    /// Ends the lease here (released, lost) and forgets the node.
    pub(super) fn unregister(&self, node: &HeldNode) {
        let mut held = lock(&self.held);
        let mut state = lock(&node.state);
        state.ended = true;
        held.by_end.remove(&(state.expires_at, node.id));
    }

    /// A renewal sent at `sent` found the node ours: the lease now ends at
    /// `sent + ttl` (set, not extended: `hold_at_least` shortens it). False
    /// if the lease had ended meanwhile.
    pub(super) fn extend(&self, node: &HeldNode, sent: Instant, ttl: Duration) -> bool {
        let at = crate::time::saturating_add(sent, ttl);
        let wake = {
            let mut held = lock(&self.held);
            let mut state = lock(&node.state);
            if state.ended {
                return false;
            }
            let Some(entry) = held.by_end.remove(&(state.expires_at, node.id)) else {
                return false;
            };
            state.expires_at = at;
            held.by_end.insert((at, node.id), entry);
            held.next_look.is_some_and(|next| at < next)
        };
        if wake {
            self.reaper.notify_one();
        }
        true
    }

    pub(super) fn held_count(&self) -> usize {
        lock(&self.held).by_end.len()
    }

    /// The leases whose end is past (ended here, off the list), and when
    /// to look next.
    fn take_expired(&self, now: Instant) -> (Vec<Arc<HeldNode>>, Instant) {
        let mut held = lock(&self.held);
        let mut due = Vec::new();
        while let Some(entry) = held.by_end.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let node = entry.remove();
            lock(&node.state).ended = true;
            due.push(node);
        }
        let idle = now + IDLE_LOOK;
        let next = held
            .by_end
            .keys()
            .next()
            .map_or(idle, |(at, _)| (*at).min(idle));
        held.next_look = Some(next);
        (due, next)
    }

    /// Declares every lease held through this session lost, at once.
    /// `ended`: the session is over (its nodes are gone with it); otherwise
    /// the nodes may still exist and are deleted once the server is reachable.
    fn lose_all(self: &Arc<Self>, why: &'static str, ended: bool, counters: &Counters) {
        self.losing.store(true, Ordering::SeqCst);
        let nodes: Vec<Arc<HeldNode>> = std::mem::take(&mut lock(&self.held).by_end)
            .into_values()
            .collect();
        if nodes.is_empty() {
            return;
        }
        counters
            .losses
            .fetch_add(nodes.len() as u64, Ordering::Relaxed);
        tracing::warn!(
            session = %format_args!("{:#x}", self.id),
            leases = nodes.len(),
            reason = why,
            "dlock zookeeper: every lease of the session is lost"
        );
        for node in nodes {
            lock(&node.state).ended = true;
            node.lost.cancel();
            if !ended {
                let session = self.clone();
                crate::driver::handle().spawn(async move {
                    let _ = delete_until_gone(&session, &node.path, None).await;
                });
            }
        }
    }
}

/// A node we hold: what a lease's `extra` carries.
#[derive(Debug)]
pub(super) struct HeldNode {
    /// Its path under the chroot.
    pub(super) path: String,
    id: u64,
    /// The session that created it (gone: so is the node).
    pub(super) session: Weak<Session>,
    /// The acquisition's loss signal.
    pub(super) lost: CancellationToken,
    state: Mutex<HeldState>,
}

#[derive(Debug)]
struct HeldState {
    /// The end of the lease unless renewed. The backend deletes the node
    /// then, so that a holder that stops renewing (gone, `watchdog = false`,
    /// `hold_at_least`) frees the key as on every other backend.
    expires_at: Instant,
    /// Released, expired or lost: renewals answer `Lost`.
    ended: bool,
}

impl HeldNode {
    pub(super) fn is_ended(&self) -> bool {
        lock(&self.state).ended
    }
}

/// Deletes the nodes of the session's leases that ran out unrenewed (their
/// holder is gone or stopped renewing), each at the end of its lease. One
/// task per session; it sleeps until the earliest end.
pub(super) async fn reaper(session: Weak<Session>) {
    let Some(strong) = session.upgrade() else {
        return;
    };
    let (wake, ended) = (strong.reaper.clone(), strong.ended.clone());
    drop(strong);
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let Some(strong) = session.upgrade() else {
            return;
        };
        let (due, next) = strong.take_expired(Instant::now());
        for node in due {
            tracing::debug!(path = %node.path, "dlock zookeeper: lease ran out unrenewed; node deleted");
            let session = strong.clone();
            crate::driver::handle().spawn(async move {
                let _ = delete_until_gone(&session, &node.path, None).await;
            });
        }
        drop(strong);
        tokio::select! {
            () = ended.cancelled() => return,
            () = &mut notified => {}
            () = tokio::time::sleep_until(next.into()) => {}
        }
    }
}

/// Watches the session's state for its whole life: declares every lease lost
/// at once when the session ends, or when the connection stays down past the
/// policy's deadline; while leases are held, keeps "last heard" fresh with a
/// read every sixth of the session timeout.
pub(super) async fn monitor(
    session: Weak<Session>,
    mut states: StateWatcher,
    policy: LossPolicy,
    counters: Arc<Counters>,
) {
    let mut state = states.state();
    loop {
        let Some(strong) = session.upgrade() else {
            return;
        };
        match state {
            SessionState::SyncConnected => {
                // Connected: the server vouches for the session again, and
                // grants are safe.
                strong.losing.store(false, Ordering::SeqCst);
                drop(strong);
                tokio::select! {
                    next = states.changed() => state = next,
                    () = heartbeat(session.clone()) => return,
                }
            }
            SessionState::Disconnected | SessionState::ConnectedReadOnly => {
                if policy == LossPolicy::Session {
                    let deadline = strong.last_heard() + strong.timeout * 2 / 3;
                    drop(strong);
                    tokio::select! {
                        next = states.changed() => { state = next; continue; }
                        () = tokio::time::sleep_until(deadline.into()) => {}
                    }
                } else {
                    // At once: a reconnection already reported must not
                    // win a race against a deadline that has passed.
                    drop(strong);
                }
                if let Some(strong) = session.upgrade() {
                    let why = match policy {
                        LossPolicy::Disconnect => "disconnected from ZooKeeper (loss=disconnect)",
                        LossPolicy::Session => {
                            "disconnected from ZooKeeper for 2/3 of the session timeout since the \
                             server was last heard from: the session may expire"
                        }
                    };
                    strong.lose_all(why, false, &counters);
                }
                state = states.changed().await;
            }
            SessionState::Expired | SessionState::Closed | SessionState::AuthFailed => {
                let why = match state {
                    SessionState::Expired => "the ZooKeeper session expired",
                    SessionState::Closed => "the ZooKeeper session was closed",
                    _ => "ZooKeeper refused the session's credentials",
                };
                strong.ended.cancel();
                strong.lose_all(why, true, &counters);
                return;
            }
        }
    }
}

/// Sends a read whenever leases are held and nothing was heard from the
/// server for a sixth of the session timeout. Never returns while the
/// session lives.
async fn heartbeat(session: Weak<Session>) {
    loop {
        let Some(strong) = session.upgrade() else {
            return;
        };
        let every = strong.timeout / 6;
        let due = strong.last_heard() + every;
        let now = Instant::now();
        if now >= due && strong.held_count() > 0 {
            if strong.call(|c| c.check_stat("/")).await.is_err() {
                // The connection is going down: the state change ends this.
                drop(strong);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            continue;
        }
        let wake = if now >= due { now + every } else { due };
        drop(strong);
        tokio::time::sleep_until(wake.into()).await;
    }
}

/// `request`, cut short at `deadline` (a `Timeout` then).
pub(super) async fn within<T>(
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
pub(super) async fn delete_until_gone(
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
