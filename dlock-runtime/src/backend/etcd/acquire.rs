//! Acquisition: an attempt's state across attempts, putting (or finding
//! again) our entry, reading what it waits for and watching that, and the
//! grant — for a writer (a plain lock), a reader and a permit.
//!
//! **What each entry waits for.** A writer: every entry before it (it holds
//! when its entry is the queue's first), watching the one just before it.
//! A reader: the writers before it (it holds when no entry before it is
//! a writer), watching the nearest one. A permit of `n`: it holds when
//! fewer than `n` entries are before it, then claims the lowest free slot;
//! with exactly `n` before it (the first waiter) it watches the deletions
//! of the entries before it, and with more it watches the entry just
//! before it — its deletion or its grant, which writes the slot into that
//! entry. So a release wakes the first waiter only, whose grant wakes the
//! next one to take its place (no herd).
//!
//! **Grant and token.** An entry that holds as soon as it is put holds at
//! its create revision (the put's revision, read in the same transaction):
//! the uncontended plain lock is one transaction, as before. An entry that
//! waited is granted by a transaction that *writes* it — a put that keeps
//! its value and lease (writers, readers), or the slot claim (permits) — and
//! reads, at that very revision, that it may hold. The token is that
//! revision (the entry's mod revision, so `inspect` shows it). Why not the
//! create revision: a reader queued before a waiting writer may be granted
//! after the writer's entry was created, so a writer holding after that
//! reader's release would have the smaller token; and two readers eligible
//! at once may be granted in either order. The grant's revision is above
//! every deletion it read, and a holder's own deletion is above its grant:
//! so a holder granted after another's release (the release's delete
//! applied before the grant's transaction) has the larger token — for
//! writers and readers alike (one sequence per key), and for the permits
//! of one slot (whose claim can be created only once the previous claim of
//! that slot was deleted).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, TxnResponse, WatchFilterType, WatchOptions,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::session::{Session, SlotClaim, delete_entry, delete_named};
use super::url::{AFTER_READERS, EntryKind, READER, parse_entry, slot_of};
use super::{Inner, MAX_STEPS, RETRY, backend_error, lock};
use crate::backend::{AcquireRequest, Attempt, HoldMode, Lease};
use crate::error::BackendError;
use crate::token::FencingToken;

/// What a waiter watches.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Watched {
    /// The deletion of this entry.
    Deletion(Vec<u8>),
    /// Any change of this entry: its deletion, or its grant (a permit's
    /// slot written into it).
    Change(Vec<u8>),
    /// The deletion of any entry of `queue` created before `below`.
    DeletionBefore {
        /// The queue.
        queue: String,
        /// Our entry's create revision.
        below: i64,
    },
}

/// A watch of what we wait for. Dropping it ends the watch.
struct Watch {
    on: Watched,
    fired: Arc<AtomicBool>,
    stop: CancellationToken,
    /// When the queue was last read: the watch is trusted for a session TTL
    /// after that, then the queue is read again.
    checked_at: Instant,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One acquisition in progress, from its first attempt to its grant,
/// abandonment or release: its queued entry survives across attempts.
pub(super) struct Pending {
    /// Our entry's key: `{prefix}/{escaped key}/{name}` (see
    /// [`EntryKind::name`]).
    pub(super) key: String,
    /// What the entry holds.
    kind: EntryKind,
    /// The key's queue: `{prefix}/{escaped key}/`.
    queue: String,
    /// Where the key's slot claims are: `{prefix}/%slots/{escaped key}/`.
    slots: String,
    /// The acquisition's owner token (a slot claim's value).
    owner: String,
    /// The holder's record, the entry's value.
    holder: String,
    pub(super) notify: Arc<Notify>,
    /// Held by a put from when it is sent until it is answered or cut at
    /// its request bound, in a task of its own that outlives a dropped
    /// attempt: the clean-up of an abandoned acquisition takes it before
    /// deleting the entry, so a put still on the wire cannot create the
    /// entry after the delete.
    put_on_the_wire: Arc<tokio::sync::Mutex<()>>,
    state: Mutex<PendingState>,
}

#[derive(Default)]
struct PendingState {
    /// The session of the latest put.
    session: Option<Arc<Session>>,
    /// Our entry's create revision on that session, when known.
    revision: Option<i64>,
    watch: Option<Watch>,
}

impl Pending {
    fn state(&self) -> MutexGuard<'_, PendingState> {
        lock(&self.state)
    }

    /// Our entry is gone: the next step puts it again.
    fn forget_entry(&self) {
        let mut st = self.state();
        st.revision = None;
        st.watch = None;
    }

    /// Busy without a round trip: our predecessor's watch has not fired.
    fn still_behind(&self) -> Option<Attempt> {
        let st = self.state();
        let watch = st.watch.as_ref()?;
        let session = st.session.as_ref()?;
        if st.revision.is_none() || !session.is_alive() || watch.fired.load(Ordering::Acquire) {
            return None;
        }
        let since = watch.checked_at.elapsed();
        (since < session.ttl).then(|| Attempt::Busy {
            retry_in: Some(session.ttl - since),
        })
    }
}

/// How many entries one read of a queue's head (or of the entries before
/// ours) returns: entries of a backend whose prefix is nested in the queue
/// are skipped (see [`Queue`]), and the next page is read only when a whole
/// page held nothing but those.
const QUEUE_PAGE: i64 = 4;

/// The first entries of a queue (the holder first).
fn first() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(QUEUE_PAGE)
        .with_keys_only()
}

/// The entries created before `revision`, the latest first (our
/// predecessor first).
fn predecessor(revision: i64) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_max_create_revision(revision - 1)
        .with_limit(QUEUE_PAGE)
        .with_keys_only()
}

/// The kind of a queue's entry: what its name says (an entry of a name
/// no version writes counts as a writer).
fn kind_of(entry: &KeyValue) -> EntryKind {
    entry
        .key_str()
        .ok()
        .and_then(|k| k.rsplit_once('/'))
        .and_then(|(_, name)| parse_entry(name))
        .map_or(EntryKind::Writer, |(kind, _)| kind)
}

/// The key just past every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A read of the entries of a queue in the key range `from..end`, in
/// create order, a page at a time.
struct Scan {
    from: String,
    end: Vec<u8>,
    ascending: bool,
    limit: i64,
}

impl Scan {
    /// The entries of the whole queue.
    fn all(queue: &str, ascending: bool, limit: i64) -> Self {
        Scan {
            from: queue.to_owned(),
            end: prefix_end(queue),
            ascending,
            limit,
        }
    }

    /// The two ranges of a queue where every entry but the readers is:
    /// before `%R` and from `%S` on.
    fn non_readers(queue: &str) -> [Self; 2] {
        [
            Scan {
                from: queue.to_owned(),
                end: format!("{queue}{READER}").into_bytes(),
                ascending: false,
                limit: QUEUE_PAGE,
            },
            Scan {
                from: format!("{queue}{AFTER_READERS}"),
                end: prefix_end(queue),
                ascending: false,
                limit: QUEUE_PAGE,
            },
        ]
    }

    /// The options of a page: created before `below` and, after a page
    /// whose last entry was created at `last`, past it.
    fn options(&self, below: Option<i64>, last: Option<i64>) -> GetOptions {
        let order = if self.ascending {
            SortOrder::Ascend
        } else {
            SortOrder::Descend
        };
        let mut options = GetOptions::new()
            .with_range(self.end.clone())
            .with_sort(SortTarget::Create, order)
            .with_limit(self.limit)
            .with_keys_only();
        let mut max = below.map(|b| b - 1);
        if let Some(last) = last {
            if self.ascending {
                options = options.with_min_create_revision(last + 1);
            } else {
                max = Some(max.map_or(last - 1, |m| m.min(last - 1)));
            }
        }
        if let Some(max) = max {
            options = options.with_max_create_revision(max);
        }
        options
    }

    fn op(&self, below: Option<i64>) -> TxnOp {
        TxnOp::get(self.from.as_str(), Some(self.options(below, None)))
    }

    /// Up to `want` entries of `queue` created before `below`, from the
    /// first page a transaction read (`page`) and further pages read at
    /// `read_at`; and whether there may be more.
    async fn collect(
        &self,
        session: &Session,
        queue: &str,
        below: i64,
        (mut entries, mut more): (Vec<KeyValue>, bool),
        want: usize,
        read_at: i64,
    ) -> Result<(Vec<KeyValue>, bool), etcd_client::Error> {
        let mut found = Vec::new();
        loop {
            let last = entries.last().map(KeyValue::create_revision);
            for entry in entries {
                if in_queue(queue, entry.key()) && entry.create_revision() < below {
                    found.push(entry);
                    if found.len() == want {
                        return Ok((found, true));
                    }
                }
            }
            let (true, Some(last)) = (more, last) else {
                return Ok((found, false));
            };
            let mut kv = session.client.kv_client();
            let options = self.options(Some(below), Some(last)).with_revision(read_at);
            let mut next = session
                .call(kv.get(self.from.as_str(), Some(options)))
                .await?;
            more = next.more();
            entries = next.take_kvs();
        }
    }
}

/// The start of the line a granted permit's entry carries after its
/// holder's record: `dlock-slot {slot}`.
const SLOT_LINE: &str = "dlock-slot ";

/// A granted permit's entry value: the holder's record, then its slot.
fn slotted_value(record: &str, slot: u32) -> String {
    format!("{record}\n{SLOT_LINE}{slot}")
}

/// The holder's record and the slot an entry's value carries.
pub(super) fn record_and_slot(value: &str) -> (&str, Option<u32>) {
    match value.rsplit_once('\n') {
        Some((record, line)) => match line.strip_prefix(SLOT_LINE).map(str::parse) {
            Some(Ok(slot)) => (record, Some(slot)),
            _ => (value, None),
        },
        None => (value, None),
    }
}

/// What one read of the queue says an attempt is to do.
enum Look {
    /// Our entry may hold the key now.
    Holds,
    /// An entry of a kind ours may not sit beside is there.
    Mismatch(EntryKind),
    /// Wait for this.
    Behind(Watched),
    /// The predecessor is not read yet (a writer's put reads the head only).
    Unread,
    /// The queue changed between the reads of one revision: look again.
    Again,
}

/// What a put of our entry answered.
enum Put {
    /// Put now: its create revision, and the transaction's answer (the
    /// reads after the put, from index 1).
    Fresh(i64, TxnResponse),
    /// It was there (the answer of an earlier put was lost): its create
    /// revision is known now, and the next step reads (and writes) it.
    Found,
    /// An entry of ours from an ended session was deleted: put again.
    Again,
}

fn kvs(response: &TxnResponse, i: usize) -> Vec<KeyValue> {
    page(response, i).0
}

/// The entries the `i`-th read of a transaction returned, and whether
/// there are more.
fn page(response: &TxnResponse, i: usize) -> (Vec<KeyValue>, bool) {
    match response.op_responses().into_iter().nth(i) {
        Some(TxnOpResponse::Get(mut get)) => {
            let more = get.more();
            (get.take_kvs(), more)
        }
        _ => (Vec::new(), false),
    }
}

/// Which entry of a queue a read looks for.
#[derive(Clone, Copy)]
enum Queue {
    /// The first one (the holder).
    Head,
    /// The one created just before ours.
    Before,
}

impl Queue {
    /// The options of the page after one whose last entry was created at
    /// `last`.
    fn after(self, last: i64) -> GetOptions {
        match self {
            Queue::Head => first().with_min_create_revision(last + 1),
            Queue::Before => predecessor(last),
        }
    }
}

/// Whether `key` is an entry of `queue` itself (`{queue}{owner}`: owner
/// tokens are escaped, so they hold no `/`), not an entry of a backend whose
/// prefix is `queue` or lies below it (`{queue}{its key}/{its owner}`).
fn in_queue(queue: &str, key: &[u8]) -> bool {
    key.strip_prefix(queue.as_bytes())
        .is_some_and(|owner| !owner.is_empty() && !owner.contains(&b'/'))
}

/// The entry `which` looks for among the entries of `queue` a read returned
/// (`page`, `more` after it), reading further pages at `read_at` (the
/// revision of the first read, so every page is of one state) while the
/// pages hold only entries of nested backends.
async fn entry_in_queue(
    session: &Session,
    queue: &str,
    which: Queue,
    (mut entries, mut more): (Vec<KeyValue>, bool),
    read_at: i64,
) -> Result<Option<KeyValue>, etcd_client::Error> {
    loop {
        let last = entries.last().map(KeyValue::create_revision);
        if let Some(found) = entries.into_iter().find(|e| in_queue(queue, e.key())) {
            return Ok(Some(found));
        }
        let (true, Some(last)) = (more, last) else {
            return Ok(None);
        };
        let mut kv = session.client.kv_client();
        let options = which.after(last).with_revision(read_at);
        let mut next = session.call(kv.get(queue, Some(options))).await?;
        more = next.more();
        entries = next.take_kvs();
    }
}

fn revision_of(response: &TxnResponse) -> i64 {
    response.header().map_or(0, |h| h.revision())
}

impl Inner {
    /// The in-progress state of `request`'s acquisition.
    pub(super) fn pending_for(&self, request: &AcquireRequest) -> Arc<Pending> {
        lock(&self.pending)
            .entry(request.owner.clone())
            .or_insert_with(|| {
                let queue = self.queue_of(&request.key);
                let kind = EntryKind::of(request.mode);
                Arc::new(Pending {
                    key: format!("{queue}{}", kind.name(&request.owner)),
                    kind,
                    queue,
                    slots: self.slots_of(&request.key),
                    owner: request.owner.clone(),
                    holder: request.holder.encode(),
                    notify: Arc::new(Notify::new()),
                    put_on_the_wire: Arc::new(tokio::sync::Mutex::new(())),
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
            Err(error) if error.is_retryable() => {
                return Ok(Attempt::Unavailable {
                    error,
                    retry_in: RETRY,
                });
            }
            Err(error) => return Err(error),
        };
        {
            let mut st = pending.state();
            if !st
                .session
                .as_ref()
                .is_some_and(|s| Arc::ptr_eq(s, &session))
            {
                // An entry of an ended session goes with its lease.
                st.session = Some(session.clone());
                st.revision = None;
                st.watch = None;
            }
        }
        let answer = match pending.kind {
            EntryKind::Permit(permits) => {
                self.permit_steps(request, &session, &pending, permits, started)
                    .await
            }
            _ => self.steps(request, &session, &pending, started).await,
        };
        match answer {
            Ok(Step::Done(attempt)) => Ok(attempt),
            Ok(Step::Mismatch(held)) => {
                // Our entry goes at once; the runtime's clean-up finds nothing.
                let _ = self
                    .drop_pending(&request.key, &request.owner, request.mode)
                    .await;
                Err(BackendError::config(HoldMode::mismatch(
                    &request.key,
                    held.mode(),
                    request.mode,
                )))
            }
            Err((what, err)) => {
                let error = backend_error(what, err);
                if error.is_retryable() {
                    Ok(Attempt::Unavailable {
                        error,
                        retry_in: RETRY,
                    })
                } else {
                    Err(error)
                }
            }
        }
    }

    /// The steps of a writer's or a reader's attempt.
    async fn steps(
        self: &Arc<Self>,
        request: &AcquireRequest,
        session: &Arc<Session>,
        pending: &Pending,
        started: Instant,
    ) -> Result<Step, (&'static str, etcd_client::Error)> {
        const READING: &str = "reading the lock's queue";
        // Whether the next read may be a plain read: our entry was just put
        // and did not hold, so it cannot hold on that read's word alone
        // (a grant writes; see the module docs).
        let mut read_only = false;
        for _ in 0..MAX_STEPS {
            let known = pending.state().revision;
            let (revision, response, granting) = match known {
                Some(revision) => {
                    let response = self
                        .look_again(session, pending, revision, !read_only)
                        .await
                        .map_err(|e| (READING, e))?;
                    if !response.succeeded() {
                        // Deleted behind our back while queued: queue again.
                        pending.forget_entry();
                        read_only = false;
                        continue;
                    }
                    (revision, response, !read_only)
                }
                None => {
                    let reads = match pending.kind {
                        EntryKind::Reader => Scan::non_readers(&pending.queue)
                            .iter()
                            .map(|scan| scan.op(None))
                            .collect(),
                        _ => vec![TxnOp::get(pending.queue.as_str(), Some(first()))],
                    };
                    match self
                        .put_entry(session, pending, reads)
                        .await
                        .map_err(|e| ("putting the lock entry", e))?
                    {
                        Put::Fresh(revision, response) => (revision, response, true),
                        Put::Found | Put::Again => continue,
                    }
                }
            };
            read_only = false;
            let read_at = revision_of(&response);
            let look = self
                .look(
                    session,
                    pending,
                    revision,
                    &response,
                    known.is_some(),
                    read_at,
                )
                .await
                .map_err(|e| (READING, e))?;
            match look {
                Look::Holds if granting => {
                    let lease =
                        self.grant(request, session, pending, revision, read_at, None, started);
                    return Ok(Step::Done(Attempt::Held(lease)));
                }
                // Read without a write: the next read writes.
                Look::Holds | Look::Again => {}
                Look::Unread => read_only = true,
                Look::Mismatch(held) => return Ok(Step::Mismatch(held)),
                Look::Behind(watched) => {
                    return Ok(Step::Done(
                        self.wait(request, session, pending, watched, read_at),
                    ));
                }
            }
        }
        Ok(Step::Done(Attempt::Busy {
            retry_in: Some(Duration::ZERO),
        }))
    }

    /// Reads the queue again for our entry of create revision `revision`,
    /// in one transaction that answers "not succeeded" when the entry is
    /// gone; with `write`, the same transaction writes the entry (keeping
    /// its value and lease), so that the grant it may find is at its
    /// revision.
    async fn look_again(
        &self,
        session: &Session,
        pending: &Pending,
        revision: i64,
        write: bool,
    ) -> Result<TxnResponse, etcd_client::Error> {
        let key = pending.key.as_str();
        let mut ops = vec![if write {
            TxnOp::put(
                key,
                "",
                Some(PutOptions::new().with_ignore_value().with_ignore_lease()),
            )
        } else {
            TxnOp::get(key, Some(GetOptions::new().with_keys_only()))
        }];
        match pending.kind {
            EntryKind::Reader => {
                ops.extend(
                    Scan::non_readers(&pending.queue)
                        .iter()
                        .map(|scan| scan.op(Some(revision))),
                );
            }
            _ => {
                ops.push(TxnOp::get(pending.queue.as_str(), Some(first())));
                ops.push(TxnOp::get(
                    pending.queue.as_str(),
                    Some(predecessor(revision)),
                ));
            }
        }
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, revision)])
            .and_then(ops);
        let mut kv = session.client.kv_client();
        session.call(kv.txn(txn)).await
    }

    /// What the reads of a writer's or a reader's transaction (those from
    /// index 1 on) say; `before` when a writer's transaction also read its
    /// predecessor.
    async fn look(
        &self,
        session: &Session,
        pending: &Pending,
        revision: i64,
        response: &TxnResponse,
        before: bool,
        read_at: i64,
    ) -> Result<Look, etcd_client::Error> {
        let queue = pending.queue.as_str();
        if pending.kind == EntryKind::Reader {
            let mut nearest: Option<KeyValue> = None;
            for (i, scan) in Scan::non_readers(queue).iter().enumerate() {
                let (found, _) = scan
                    .collect(session, queue, revision, page(response, 1 + i), 1, read_at)
                    .await?;
                if let Some(e) = found.into_iter().next()
                    && nearest
                        .as_ref()
                        .is_none_or(|n| n.create_revision() < e.create_revision())
                {
                    nearest = Some(e);
                }
            }
            return Ok(match nearest {
                None => Look::Holds,
                Some(e) if !kind_of(&e).fits(EntryKind::Reader) => Look::Mismatch(kind_of(&e)),
                Some(e) => Look::Behind(Watched::Deletion(e.key().to_vec())),
            });
        }
        let head = entry_in_queue(session, queue, Queue::Head, page(response, 1), read_at).await?;
        if let Some(head) = &head {
            let kind = kind_of(head);
            if !kind.fits(EntryKind::Writer) {
                return Ok(Look::Mismatch(kind));
            }
            if head.create_revision() == revision {
                return Ok(Look::Holds);
            }
        }
        if !before {
            return Ok(Look::Unread);
        }
        let ahead =
            entry_in_queue(session, queue, Queue::Before, page(response, 2), read_at).await?;
        Ok(match ahead {
            Some(ahead) => Look::Behind(Watched::Deletion(ahead.key().to_vec())),
            None => Look::Again,
        })
    }

    /// A busy answer, watching `watched` from just after `read_at` (unless
    /// the request tries once).
    fn wait(
        &self,
        request: &AcquireRequest,
        session: &Arc<Session>,
        pending: &Pending,
        watched: Watched,
        read_at: i64,
    ) -> Attempt {
        if request.wait.is_zero() {
            // Tried once: the wait loop abandons, deleting our entry.
            return Attempt::Busy { retry_in: None };
        }
        self.watch(session, pending, watched, read_at);
        Attempt::Busy {
            retry_in: Some(session.ttl),
        }
    }

    /// The steps of a permit's attempt: put our entry, read the entries
    /// before it (the first `permits + 1`), the one just before it and the
    /// slot claims; hold when fewer than `permits` are before it, claiming
    /// the lowest free slot.
    async fn permit_steps(
        self: &Arc<Self>,
        request: &AcquireRequest,
        session: &Arc<Session>,
        pending: &Pending,
        permits: u32,
        started: Instant,
    ) -> Result<Step, (&'static str, etcd_client::Error)> {
        const READING: &str = "reading the semaphore's queue";
        let n = permits as usize;
        let firsts = Scan::all(&pending.queue, true, i64::from(permits) + 2);
        let latest = Scan::all(&pending.queue, false, QUEUE_PAGE + 1);
        let slots = || {
            TxnOp::get(
                pending.slots.as_str(),
                Some(GetOptions::new().with_prefix()),
            )
        };
        for _ in 0..MAX_STEPS {
            let known = pending.state().revision;
            let (revision, response) = match known {
                Some(revision) => {
                    let key = pending.key.as_str();
                    let txn = Txn::new()
                        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
                        .and_then([
                            TxnOp::get(key, Some(GetOptions::new().with_keys_only())),
                            firsts.op(Some(revision)),
                            latest.op(Some(revision)),
                            slots(),
                        ]);
                    let mut kv = session.client.kv_client();
                    let response = session.call(kv.txn(txn)).await.map_err(|e| (READING, e))?;
                    if !response.succeeded() {
                        pending.forget_entry();
                        continue;
                    }
                    (revision, response)
                }
                None => {
                    let reads = vec![firsts.op(None), latest.op(None), slots()];
                    match self
                        .put_entry(session, pending, reads)
                        .await
                        .map_err(|e| ("putting the permit entry", e))?
                    {
                        Put::Fresh(revision, response) => (revision, response),
                        Put::Found | Put::Again => continue,
                    }
                }
            };
            let read_at = revision_of(&response);
            let queue = pending.queue.as_str();
            let (before, _) = firsts
                .collect(session, queue, revision, page(&response, 1), n + 1, read_at)
                .await
                .map_err(|e| (READING, e))?;
            if let Some(held) = before
                .iter()
                .map(kind_of)
                .find(|kind| !kind.fits(pending.kind))
            {
                return Ok(Step::Mismatch(held));
            }
            let claims = kvs(&response, 3);
            let ours = claims.iter().find_map(|c| {
                let slot = slot_of(&pending.slots, c.key())?;
                (c.value() == pending.owner.as_bytes()).then_some((slot, c))
            });
            if let Some((_, claim)) = ours
                && claim.lease() != session.lease_id
            {
                // Claimed by an earlier attempt on a session that has
                // ended: its lease takes the claim (at the latest when it
                // expires), and with it the slot, so no grant may rest on
                // it. Deleted now, then the slots are read again.
                let stale = SlotClaim {
                    key: String::from_utf8_lossy(claim.key()).into_owned(),
                    revision: claim.create_revision(),
                };
                let mut kv = session.client.kv_client();
                session
                    .call(kv.txn(Txn::new().and_then([stale.delete_op()])))
                    .await
                    .map_err(|e| ("deleting a slot claim of an ended session", e))?;
                continue;
            }
            if let Some((slot, claim)) = ours {
                // Claimed by an earlier attempt whose answer was lost.
                let claim = SlotClaim {
                    key: String::from_utf8_lossy(claim.key()).into_owned(),
                    revision: claim.create_revision(),
                };
                let token = claim.revision;
                let lease = self.grant(
                    request,
                    session,
                    pending,
                    revision,
                    token,
                    Some((slot, claim)),
                    started,
                );
                return Ok(Step::Done(Attempt::Held(lease)));
            }
            if before.len() > n {
                let (ahead, _) = latest
                    .collect(session, queue, revision, page(&response, 2), 1, read_at)
                    .await
                    .map_err(|e| (READING, e))?;
                let Some(ahead) = ahead.into_iter().next() else {
                    continue;
                };
                let watched = Watched::Change(ahead.key().to_vec());
                return Ok(Step::Done(
                    self.wait(request, session, pending, watched, read_at),
                ));
            }
            if before.len() == n {
                let watched = Watched::DeletionBefore {
                    queue: pending.queue.clone(),
                    below: revision,
                };
                return Ok(Step::Done(
                    self.wait(request, session, pending, watched, read_at),
                ));
            }
            let taken: Vec<u32> = claims
                .iter()
                .filter_map(|e| slot_of(&pending.slots, e.key()))
                .collect();
            let Some(slot) = (0..permits).find(|s| !taken.contains(s)) else {
                // A holder's claim outlives its entry for a moment (an
                // abandoned grant's clean-up deletes the entry first).
                return Ok(Step::Done(Attempt::Busy {
                    retry_in: Some(if request.wait.is_zero() {
                        Duration::ZERO
                    } else {
                        RETRY
                    }),
                }));
            };
            match self
                .claim(session, pending, revision, slot)
                .await
                .map_err(|e| ("claiming a slot", e))?
            {
                Some(claim) => {
                    let token = claim.revision;
                    let lease = self.grant(
                        request,
                        session,
                        pending,
                        revision,
                        token,
                        Some((slot, claim)),
                        started,
                    );
                    return Ok(Step::Done(Attempt::Held(lease)));
                }
                None => continue,
            }
        }
        Ok(Step::Done(Attempt::Busy {
            retry_in: Some(Duration::ZERO),
        }))
    }

    /// Claims `slot` for our entry of create revision `revision`: one
    /// transaction that creates the claim (if no one holds that slot) and
    /// writes the slot into our entry, both under the session's lease, while
    /// our entry is there. `None` when the slot was taken first or our
    /// entry is gone (then queued again).
    async fn claim(
        &self,
        session: &Session,
        pending: &Pending,
        revision: i64,
        slot: u32,
    ) -> Result<Option<SlotClaim>, etcd_client::Error> {
        let key = pending.key.as_str();
        let claim = format!("{}{slot}", pending.slots);
        let lease = || Some(PutOptions::new().with_lease(session.lease_id));
        let txn = Txn::new()
            .when([
                Compare::create_revision(key, CompareOp::Equal, revision),
                Compare::create_revision(claim.as_str(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(claim.as_str(), pending.owner.as_str(), lease()),
                TxnOp::put(key, slotted_value(&pending.holder, slot), lease()),
            ])
            .or_else([TxnOp::get(key, Some(GetOptions::new().with_keys_only()))]);
        let mut kv = session.client.kv_client();
        let response = session.call(kv.txn(txn)).await?;
        if response.succeeded() {
            return Ok(Some(SlotClaim {
                key: claim,
                revision: revision_of(&response),
            }));
        }
        let ours = kvs(&response, 0)
            .first()
            .is_some_and(|e| e.create_revision() == revision);
        if !ours {
            pending.forget_entry();
        }
        Ok(None)
    }

    /// Puts our entry under the session's lease, unless it exists (the
    /// answer of an earlier put was lost), with `reads` after the put in the
    /// same transaction.
    async fn put_entry(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
        reads: Vec<TxnOp>,
    ) -> Result<Put, etcd_client::Error> {
        let key = pending.key.as_str();
        let mut ops = vec![TxnOp::put(
            key,
            pending.holder.as_str(),
            Some(PutOptions::new().with_lease(session.lease_id)),
        )];
        ops.extend(reads);
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then(ops)
            .or_else([TxnOp::get(key, Some(GetOptions::new().with_keys_only()))]);
        // Sent from a task of its own, which finishes even when this
        // attempt is dropped, holding `put_on_the_wire` until it is
        // answered (see `drop_pending`).
        let on_the_wire = pending.put_on_the_wire.clone().lock_owned().await;
        let put = {
            let session = session.clone();
            async move {
                let mut kv = session.client.kv_client();
                let answer = session.call(kv.txn(txn)).await;
                drop(on_the_wire);
                answer
            }
        };
        let response = crate::driver::run(put).await?;
        if response.succeeded() {
            let revision = revision_of(&response);
            self.counters.entries_put.fetch_add(1, Ordering::Relaxed);
            pending.state().revision = Some(revision);
            return Ok(Put::Fresh(revision, response));
        }
        match kvs(&response, 0).into_iter().next() {
            Some(e) if e.lease() == session.lease_id => {
                self.counters
                    .creates_recovered
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    key,
                    "dlock etcd: lost put reply; entry found again by its key"
                );
                pending.state().revision = Some(e.create_revision());
                Ok(Put::Found)
            }
            Some(e) => {
                // Ours, from a session that ended: its lease is going;
                // delete it now rather than queue behind it.
                let deadline = Some(Instant::now() + session.op_timeout);
                delete_entry(session, key, e.create_revision(), None, deadline).await?;
                Ok(Put::Again)
            }
            None => Ok(Put::Again),
        }
    }

    /// Watches `on` from just after `read_at` (the revision the queue was
    /// read at), so that no change is missed. The watch runs in its own
    /// task on its own stream; it fires on what it waits for, or when the
    /// stream breaks or is cancelled (the next attempt reads the queue
    /// again and watches again).
    fn watch(&self, session: &Arc<Session>, pending: &Pending, on: Watched, read_at: i64) {
        {
            let mut st = pending.state();
            if let Some(watch) = &mut st.watch
                && watch.on == on
                && !watch.fired.load(Ordering::Acquire)
            {
                watch.checked_at = Instant::now();
                return;
            }
            st.watch = None;
        }
        self.counters.watches_set.fetch_add(1, Ordering::Relaxed);
        let fired = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let task = {
            let (fired, stop, on) = (fired.clone(), stop.clone(), on.clone());
            let (notify, counters) = (pending.notify.clone(), self.counters.clone());
            let mut watches = session.client.watch_client();
            async move {
                let watched = async {
                    let options = WatchOptions::new().with_start_revision(read_at + 1);
                    let (key, options) = match &on {
                        Watched::Deletion(key) | Watched::Change(key) => (key.clone(), options),
                        Watched::DeletionBefore { queue, .. } => (
                            queue.as_bytes().to_vec(),
                            options
                                .with_prefix()
                                .with_prev_key()
                                .with_filters([WatchFilterType::NoPut]),
                        ),
                    };
                    let Ok(mut stream) = watches.watch(key, Some(options)).await else {
                        tokio::time::sleep(RETRY).await;
                        return;
                    };
                    loop {
                        match stream.message().await {
                            Ok(Some(answer)) => {
                                if answer.canceled()
                                    || answer.events().iter().any(|e| wakes(&on, e))
                                {
                                    return;
                                }
                            }
                            // The stream broke: look again after a pause.
                            _ => {
                                tokio::time::sleep(RETRY).await;
                                return;
                            }
                        }
                    }
                };
                tokio::select! {
                    () = watched => {
                        fired.store(true, Ordering::Release);
                        counters.watch_events.fetch_add(1, Ordering::Relaxed);
                        notify.notify_waiters();
                    }
                    () = stop.cancelled() => {}
                }
            }
        };
        crate::driver::handle().spawn(task);
        pending.state().watch = Some(Watch {
            on,
            fired,
            stop,
            checked_at: Instant::now(),
        });
    }

    /// Our entry holds the key: the lease, registered with its session.
    #[allow(clippy::too_many_arguments)]
    fn grant(
        &self,
        request: &AcquireRequest,
        session: &Arc<Session>,
        pending: &Pending,
        revision: i64,
        token: i64,
        slot: Option<(u32, SlotClaim)>,
        started: Instant,
    ) -> Lease {
        if let Some(done) = lock(&self.pending).remove(&request.owner) {
            done.state().watch = None;
        }
        let (slot, claim) = slot.unzip();
        let held = session.register(
            pending.key.clone(),
            revision,
            claim,
            request.lost.clone(),
            crate::time::saturating_add(started, request.lease),
        );
        if !session.is_alive() {
            // The session ended between the read and the registration:
            // this grant is lost with it (its lease takes the entry).
            session.unregister(&held);
            request.lost.cancel();
        }
        let lease = Lease::new(request, Some(FencingToken::new(token as u64))).with_extra(held);
        match slot {
            Some(slot) => lease.with_slot(slot),
            None => lease,
        }
    }

    /// Ends an acquisition that did not end with a grant (given up,
    /// dropped, failed), or a permit whose grant was not seen: deletes its
    /// entry by name and, for a permit, the slot claims its owner holds.
    /// The name holds the acquisition's owner token, which no other
    /// acquisition uses, so this never deletes anyone else's entry; and it
    /// is found even when this process forgot the acquisition — the
    /// runtime's second release of a dropped acquisition, after a put that
    /// was still on the wire at the first, finds the entry that put
    /// created. A claim needs the entry: once the entry is deleted no claim
    /// of it can be created, so the claims read in the same transaction are
    /// all there will be.
    pub(super) async fn drop_pending(
        self: &Arc<Self>,
        stored_key: &str,
        owner: &str,
        mode: HoldMode,
    ) -> Result<(), BackendError> {
        let pending = lock(&self.pending).remove(owner);
        let session = match &pending {
            Some(pending) => {
                let session = {
                    let mut st = pending.state();
                    st.watch = None;
                    st.session.clone()
                };
                if let Some(session) = &session {
                    // A put still on the wire (its attempt dropped) is
                    // answered, or cut at its bound, before the delete: the
                    // server may apply concurrent requests in either order.
                    let bound = session.op_timeout * 2;
                    let _ =
                        tokio::time::timeout(bound, pending.put_on_the_wire.clone().lock_owned())
                            .await;
                }
                session
            }
            None => None,
        };
        let Some(session) = session.or_else(|| self.current_alive()) else {
            // No live session: its lease takes every entry with it.
            return Ok(());
        };
        let kind = EntryKind::of(mode);
        let key = format!("{}{}", self.queue_of(stored_key), kind.name(owner));
        let slots = matches!(kind, EntryKind::Permit(_)).then(|| self.slots_of(stored_key));
        let deadline = Instant::now() + session.op_timeout;
        match delete_named(&session, &key, slots.as_deref(), owner, Some(deadline)).await {
            Ok(()) => Ok(()),
            Err(err) if super::transient(&err) => {
                let message = format!(
                    "etcd: the queued entry {key} is not deleted yet ({err}); the delete goes on \
                     in the background until it succeeds or the session ends"
                );
                let owner = owner.to_owned();
                crate::driver::handle().spawn(async move {
                    let _ = delete_named(&session, &key, slots.as_deref(), &owner, None).await;
                });
                Err(BackendError::transient(message))
            }
            Err(err) => Err(backend_error(&format!("deleting the entry {key}"), err)),
        }
    }
}

/// What one attempt's steps came to.
enum Step {
    /// The attempt's answer.
    Done(Attempt),
    /// Holders (or waiters) of this kind are in the queue: a mismatch.
    Mismatch(EntryKind),
}

/// Whether a watch event is what `on` waits for.
fn wakes(on: &Watched, event: &etcd_client::Event) -> bool {
    match on {
        Watched::Deletion(_) => event.event_type() == EventType::Delete,
        Watched::Change(_) => true,
        Watched::DeletionBefore { queue, below } => {
            event.event_type() == EventType::Delete
                && match event.prev_kv() {
                    Some(prev) => in_queue(queue, prev.key()) && prev.create_revision() < *below,
                    // Compacted away: look again.
                    None => true,
                }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{in_queue, prefix_end, record_and_slot, slotted_value};

    #[test]
    fn a_granted_permits_value_carries_its_slot_after_the_record() {
        let value = slotted_value("1 42 host name", 3);
        assert_eq!(record_and_slot(&value), ("1 42 host name", Some(3)));
        assert_eq!(record_and_slot("1 42 host"), ("1 42 host", None));
        assert_eq!(record_and_slot("a\nb"), ("a\nb", None));
    }

    #[test]
    fn a_prefix_ends_past_every_key_starting_with_it() {
        assert_eq!(prefix_end("/p/k/"), b"/p/k0");
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80");
    }

    #[test]
    fn only_entries_one_segment_below_a_queue_are_in_it() {
        let queue = "/p/dlock:x/";
        assert!(in_queue(queue, b"/p/dlock:x/0f3a"));
        assert!(in_queue(queue, b"/p/dlock:x/owner%2Fslash"));
        // A backend whose prefix is `/p/dlock:x`: its key k's entries.
        assert!(!in_queue(queue, b"/p/dlock:x/dlock:k/0f3a"));
        assert!(!in_queue(queue, b"/p/dlock:x/"));
        assert!(!in_queue(queue, b"/p/dlock:y/0f3a"));
    }
}
