//! Acquisition: an attempt's state across attempts, creating (or finding
//! again) our node, watching the node ahead of it, and the grant.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use zookeeper_client::{Acls, CreateMode, Error as ZkError, EventType};

use super::connect::mkdir;
use super::path::{self, Position};
use super::release::{delete_by_guid, delete_node};
use super::semaphore::{LeaseNode, Refusal};
use super::session::{Session, delete_until_gone};
use super::{Inner, MAX_STEPS, RETRY, backend_error, lock};
use crate::backend::{AcquireRequest, Attempt, HoldMode, Lease};
use crate::error::BackendError;
use crate::token::FencingToken;

/// Where an acquisition stands in its queue after one look.
pub(super) enum Turn {
    /// Nothing our node waits for is ahead of it, as read on the key's
    /// node whose `pzxid` (the last change to its children) was `pzxid`.
    Head { node: OurNode, pzxid: i64 },
    /// The attempt's answer: busy behind a watch, or a failure.
    Answer(Result<Attempt, BackendError>),
}

/// Our node, as created (or recovered).
#[derive(Debug, Clone)]
pub(super) struct OurNode {
    pub(super) name: String,
    pub(super) czxid: i64,
}

/// A watch on our predecessor. Dropping it removes the watch.
struct Watch {
    path: String,
    fired: Arc<AtomicBool>,
    stop: CancellationToken,
    /// When the queue was last read: the watch is trusted for a session
    /// timeout after that, then the queue is read again.
    checked_at: Instant,
    /// A first permit waiter's watches on the key's leases: the leases as
    /// read when the watches were set, and the one whose deletion fired.
    leases: Option<LeaseWatch>,
}

/// The leases a first permit waiter watches (a data watch on each).
struct LeaseWatch {
    known: Vec<LeaseNode>,
    freed: Arc<Mutex<Option<String>>>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One acquisition in progress, from its first attempt to its grant,
/// abandonment or release: its queued node survives across attempts.
pub(super) struct Pending {
    /// The node's data: the owner and the holder's record.
    pub(super) data: Vec<u8>,
    /// Where the node is queued: the key's node, or for a permit its
    /// `locks` child (Curator's semaphore mutex).
    pub(super) container: String,
    /// A permit's `leases` child of the key's node.
    pub(super) leases: Option<String>,
    /// The key's node.
    pub(super) key_container: String,
    /// A reader's acquisition (else a writer's: a plain lock).
    reader: bool,
    pub(super) guid: String,
    pub(super) notify: Arc<Notify>,
    state: Mutex<PendingState>,
}

#[derive(Default)]
pub(super) struct PendingState {
    /// The session of the latest create.
    pub(super) session: Option<Arc<Session>>,
    /// Our node on that session, when known.
    pub(super) node: Option<OurNode>,
    /// A create was sent on that session and its answer not seen.
    pub(super) maybe_created: bool,
    /// A permit's lease on that session, not granted yet (deleted before
    /// the attempt answers, unless the attempt was cancelled first).
    pub(super) lease: Option<OurNode>,
    /// A lease create was sent on that session and its answer not seen.
    pub(super) lease_maybe_created: bool,
    watch: Option<Watch>,
}

impl Pending {
    pub(super) fn state(&self) -> MutexGuard<'_, PendingState> {
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

    pub(super) fn forget_node(&self) {
        let mut st = self.state();
        st.node = None;
        st.watch = None;
    }

    /// Starts over on `session` if our nodes were created on another one
    /// (they are gone with it).
    pub(super) fn on_session(&self, session: &Arc<Session>) {
        let mut st = self.state();
        if !st.session.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *st = PendingState {
                session: Some(session.clone()),
                ..PendingState::default()
            };
        }
    }

    /// The leases our watches saw, the one whose deletion woke us among
    /// them, when we wait first in the queue on `session` and that woke us:
    /// we are still first (nodes queue behind ours), and the freed lease
    /// names its slot. The watches are removed.
    pub(super) fn take_freed(&self, session: &Arc<Session>) -> Option<(Vec<LeaseNode>, String)> {
        let mut st = self.state();
        if !st.session.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) || st.node.is_none() {
            return None;
        }
        let watch = st.watch.as_ref()?;
        let leases = watch.leases.as_ref()?;
        if !watch.fired.load(Ordering::Acquire) {
            return None;
        }
        let freed = lock(&leases.freed).take()?;
        let known = std::mem::take(&mut st.watch.as_mut()?.leases.as_mut()?.known);
        st.watch = None;
        Some((known, freed))
    }

    /// Busy without a round trip: our predecessor's watch has not fired, so
    /// it is still there, ahead of us.
    pub(super) fn still_behind(&self) -> Option<Attempt> {
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

impl Inner {
    /// The in-progress state of `request`'s acquisition (created at its
    /// first attempt, before anything is sent).
    pub(super) fn pending_for(&self, request: &AcquireRequest) -> Arc<Pending> {
        lock(&self.pending)
            .entry(request.owner.clone())
            .or_insert_with(|| {
                let key_container = format!("/{}", path::escape_key(&request.key));
                let (container, leases) = match request.mode {
                    HoldMode::Permit { .. } => (
                        format!("{key_container}/{}", path::LOCKS),
                        Some(format!("{key_container}/{}", path::LEASES)),
                    ),
                    _ => (key_container.clone(), None),
                };
                Arc::new(Pending {
                    data: super::admin::node_data(&request.owner, &request.holder),
                    guid: path::new_guid(),
                    reader: request.mode == HoldMode::Shared,
                    container,
                    leases,
                    key_container,
                    notify: Arc::new(Notify::new()),
                    state: Mutex::new(PendingState::default()),
                })
            })
            .clone()
    }

    /// One attempt: see
    /// [`LockBackend::try_acquire`](crate::backend::LockBackend::try_acquire).
    pub(super) async fn attempt(
        self: &Arc<Self>,
        request: &AcquireRequest,
    ) -> Result<Attempt, BackendError> {
        let started = Instant::now();
        let pending = self.pending_for(request);
        if let Some(busy) = pending.still_behind() {
            return Ok(busy);
        }
        let session = match self.session().await {
            Ok(session) => session,
            Err(error) => return unavailable_or_failed(error),
        };
        match self.take_turn(&session, &pending, request).await {
            Turn::Head { node, pzxid } => {
                let path = format!("{}/{}", pending.container, node.name);
                let token = node.czxid.max(pzxid);
                Ok(Attempt::Held(
                    self.grant(request, &session, path, &node, token, started),
                ))
            }
            Turn::Answer(answer) => answer,
        }
    }

    /// Queues our node in `pending.container` (or finds it there) and reads
    /// the queue: [`Turn::Head`] when nothing it waits for is ahead of it,
    /// else the attempt's answer (busy, with a watch on what it waits for).
    pub(super) async fn take_turn(
        self: &Arc<Self>,
        session: &Arc<Session>,
        pending: &Pending,
        request: &AcquireRequest,
    ) -> Turn {
        for _ in 0..MAX_STEPS {
            let (node, listed) = match pending.node_on(session) {
                Some(node) => (node, None),
                None => match self.create_node(session, pending).await {
                    Ok(created) => created,
                    Err(err) => return Turn::Answer(unavailable("creating the lock node", err)),
                },
            };
            let fresh = listed.is_some();
            let (children, pzxid) = match listed {
                Some(listed) => listed,
                None => match session.call(|c| c.get_children(&pending.container)).await {
                    Ok((children, stat)) => (children, stat.pzxid),
                    Err(ZkError::NoNode) => {
                        pending.forget_node();
                        continue;
                    }
                    Err(err) => return Turn::Answer(unavailable("listing the lock's queue", err)),
                },
            };
            // Read after our node was created: a semaphore's leases there
            // (a rare, mixed key) make this a mismatch; a permit created
            // later finds our node the same way.
            if children.iter().any(|c| c == path::LEASES)
                && let Err(err) = self
                    .refuse_beside_leases(session, pending, &node, request)
                    .await
            {
                return Turn::Answer(match err {
                    Refusal::Config(error) => Err(error),
                    Refusal::Zk(err) => unavailable("reading the semaphore's leases", err),
                });
            }
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
                    if let Err(err) = delete_until_gone(session, &ghost, deadline).await {
                        return Turn::Answer(unavailable("deleting a duplicate lock node", err));
                    }
                }
                continue;
            }
            let queue = match self
                .queue(session, &pending.container, &children, &node)
                .await
            {
                Ok(queue) => queue,
                Err(err) => return Turn::Answer(unavailable("reading the lock's queue", err)),
            };
            match path::position(&queue, &node.name, pending.reader) {
                // The listing sent with the create is read after it on the
                // server, so it shows our node; should it not, read again
                // rather than forget a node that exists.
                Position::Missing if fresh => {}
                Position::Missing => {
                    // Deleted behind our back while queued: queue again.
                    pending.forget_node();
                }
                Position::Holder => return Turn::Head { node, pzxid },
                Position::Behind(ahead) => {
                    if request.wait.is_zero() {
                        // Tried once: the wait loop abandons, deleting our node.
                        return Turn::Answer(Ok(Attempt::Busy { retry_in: None }));
                    }
                    let ahead = format!("{}/{ahead}", pending.container);
                    match self.watch(session, pending, ahead).await {
                        Ok(true) => {
                            return Turn::Answer(Ok(Attempt::Busy {
                                retry_in: Some(session.timeout),
                            }));
                        }
                        Ok(false) => {}
                        Err(err) => {
                            return Turn::Answer(unavailable("watching the lock's queue", err));
                        }
                    }
                }
            }
        }
        // The queue kept changing under this attempt: look again at once.
        Turn::Answer(Ok(Attempt::Busy {
            retry_in: Some(Duration::ZERO),
        }))
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
    ) -> Result<(OurNode, Option<(Vec<String>, i64)>), ZkError> {
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
        // A permit's queue node is named as Curator's semaphore names its
        // mutex's nodes, whatever `writers` says.
        let prefix = path::child_prefix(
            &pending.container,
            &pending.guid,
            pending.reader,
            pending.leases.is_none() && self.target.writers == super::url::Writers::ReadWrite,
        );
        let options = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        for _ in 0..MAX_STEPS {
            // Sent when called: from here on the node may exist.
            pending.state().maybe_created = true;
            let sent = Instant::now();
            let create = session.client.create(&prefix, &pending.data, &options);
            let list = session.client.get_children(&pending.container);
            let created = session.finish(sent, create).await;
            let listed = match &created {
                Ok(_) => session
                    .finish(sent, list)
                    .await
                    .ok()
                    .map(|(children, stat)| (children, stat.pzxid)),
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
                    if pending.container != pending.key_container {
                        self.create_container(session, &pending.key_container)
                            .await?;
                    }
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
                Ok((data, stat)) if stat.ephemeral_owner == session.id && data == pending.data => {
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
    pub(super) async fn create_container(
        &self,
        session: &Session,
        container: &str,
    ) -> Result<(), ZkError> {
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

    /// Keeps the watches a first permit waiter set on each of the key's
    /// leases `known` (`watchers`, by lease name, under `path`): the first
    /// event on any wakes it, and a deletion names the lease freed. One task
    /// per lease; all end, removing their watches, when the watch is
    /// dropped (at the next look at the queue, the grant or the abandonment).
    pub(super) fn keep_lease_watches(
        &self,
        pending: &Pending,
        path: String,
        known: Vec<LeaseNode>,
        watchers: Vec<(String, zookeeper_client::OneshotWatcher)>,
    ) {
        let fired = Arc::new(AtomicBool::new(false));
        let freed = Arc::new(Mutex::new(None));
        let stop = CancellationToken::new();
        for (name, watcher) in watchers {
            self.counters.watches_set.fetch_add(1, Ordering::Relaxed);
            let (fired, freed, stop) = (fired.clone(), freed.clone(), stop.clone());
            let (notify, counters) = (pending.notify.clone(), self.counters.clone());
            crate::driver::handle().spawn(async move {
                tokio::select! {
                    event = watcher.changed() => {
                        if event.event_type == EventType::NodeDeleted {
                            lock(&freed).get_or_insert(name);
                        }
                        fired.store(true, Ordering::Release);
                        counters.watch_events.fetch_add(1, Ordering::Relaxed);
                        tracing::trace!(path = %event.path, event = %event.event_type, "dlock zookeeper: a lease changed");
                        notify.notify_waiters();
                    }
                    // Dropping the watcher removes the watch.
                    () = stop.cancelled() => {}
                }
            });
        }
        pending.state().watch = Some(Watch {
            path,
            fired,
            stop,
            checked_at: Instant::now(),
            leases: Some(LeaseWatch { known, freed }),
        });
    }

    /// Waits for `watcher` in a task of its own, which wakes the waiter.
    /// With `data_of` (a data watch on that node), a change of the node's
    /// data — a grant recording its token — sets the watch again without
    /// waking the waiter: only the node's deletion (or the session's end)
    /// can let it in.
    fn spawn_watch(
        &self,
        pending: &Pending,
        watcher: zookeeper_client::OneshotWatcher,
        data_of: Option<(Arc<Session>, String)>,
    ) -> (Arc<AtomicBool>, CancellationToken) {
        let fired = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let task = {
            let (fired, stop) = (fired.clone(), stop.clone());
            let (notify, counters) = (pending.notify.clone(), self.counters.clone());
            async move {
                let mut watcher = watcher;
                loop {
                    tokio::select! {
                        event = watcher.changed() => {
                            if event.event_type == EventType::NodeDataChanged
                                && let Some((session, path)) = &data_of
                            {
                                let sent = Instant::now();
                                let again = session.client.get_and_watch_data(path);
                                if let Ok((_, _, next)) = session.finish(sent, again).await {
                                    watcher = next;
                                    continue;
                                }
                            }
                            fired.store(true, Ordering::Release);
                            counters.watch_events.fetch_add(1, Ordering::Relaxed);
                            tracing::trace!(path = %event.path, event = %event.event_type, "dlock zookeeper: predecessor changed");
                            notify.notify_waiters();
                        }
                        // Dropping the watcher removes the watch.
                        () = stop.cancelled() => {}
                    }
                    break;
                }
            }
        };
        crate::driver::handle().spawn(task);
        (fired, stop)
    }

    /// Watches our predecessor; false if it is already gone.
    async fn watch(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
        ahead: String,
    ) -> Result<bool, ZkError> {
        {
            let mut st = pending.state();
            if let Some(watch) = &mut st.watch
                && watch.path == ahead
                && !watch.fired.load(Ordering::Acquire)
            {
                watch.checked_at = Instant::now();
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
        let (fired, stop) =
            self.spawn_watch(pending, watcher, Some((session.clone(), ahead.clone())));
        pending.state().watch = Some(Watch {
            path: ahead,
            fired,
            stop,
            checked_at: Instant::now(),
            leases: None,
        });
        Ok(true)
    }

    /// Our node at `path` holds the key with fencing token `token`: the
    /// lease, registered with its session. A token other than the node's
    /// `czxid` is written into the node's data (after the holder's record),
    /// where `inspect` reads it; the write is sent before the grant is
    /// answered, so this session's later reads see it.
    pub(super) fn grant(
        &self,
        request: &AcquireRequest,
        session: &Arc<Session>,
        path: String,
        node: &OurNode,
        token: i64,
        started: Instant,
    ) -> Lease {
        if let Some(done) = lock(&self.pending).remove(&request.owner) {
            done.state().watch = None;
        }
        if token != node.czxid {
            let data = super::admin::with_token(
                &super::admin::node_data(&request.owner, &request.holder),
                token,
            );
            let write = session.client.set_data(&path, &data, None);
            let session = session.clone();
            crate::driver::handle().spawn(async move {
                let sent = Instant::now();
                if let Err(err) = session.finish(sent, write).await {
                    tracing::debug!(%err, "dlock zookeeper: the grant's token was not recorded");
                }
            });
        }
        let held = session.register(
            path,
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
        Lease::new(request, Some(FencingToken::new(token as u64))).with_extra(held)
    }

    /// Ends an acquisition that did not end with a grant: deletes its node
    /// (by GUID when the create's answer was not seen).
    pub(super) async fn drop_pending(&self, owner: &str) -> Result<(), BackendError> {
        let Some(pending) = lock(&self.pending).remove(owner) else {
            return Ok(());
        };
        let (session, node, maybe_created, lease, lease_maybe_created) = {
            let mut st = pending.state();
            st.watch = None;
            (
                st.session.clone(),
                st.node.clone(),
                st.maybe_created,
                st.lease.clone(),
                st.lease_maybe_created,
            )
        };
        let Some(session) = session else {
            return Ok(());
        };
        // A permit's lease not granted yet, then its place in the queue.
        let mut outcome = Ok(());
        if let Some(leases) = &pending.leases {
            if let Some(lease) = lease {
                outcome = delete_node(session.clone(), format!("{leases}/{}", lease.name)).await;
            } else if lease_maybe_created {
                outcome =
                    delete_by_guid(session.clone(), leases.clone(), pending.guid.clone()).await;
            }
        }
        let queued = if let Some(node) = node {
            delete_node(session, format!("{}/{}", pending.container, node.name)).await
        } else if maybe_created {
            delete_by_guid(session, pending.container.clone(), pending.guid.clone()).await
        } else {
            Ok(())
        };
        outcome.and(queued)
    }
}

/// The answer of an attempt whose step failed: tried again while `wait`
/// lasts when the failure is transient, else the error.
pub(super) fn unavailable_or_failed(error: BackendError) -> Result<Attempt, BackendError> {
    if error.is_retryable() {
        Ok(Attempt::Unavailable {
            error,
            retry_in: RETRY,
        })
    } else {
        Err(error)
    }
}

/// [`unavailable_or_failed`] for a ZooKeeper call's error while `what`.
pub(super) fn unavailable(what: &str, err: ZkError) -> Result<Attempt, BackendError> {
    unavailable_or_failed(backend_error(what, err))
}
