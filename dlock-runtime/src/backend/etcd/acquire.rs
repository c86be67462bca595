//! Acquisition: an attempt's state across attempts, putting (or finding
//! again) our entry, watching the entry just ahead of it, and the grant.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, TxnResponse, WatchOptions,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::session::{Session, delete_entry, delete_named};
use super::{Inner, MAX_STEPS, RETRY, backend_error, lock};
use crate::backend::{AcquireRequest, Attempt, Lease};
use crate::error::BackendError;
use crate::token::FencingToken;

/// A watch on our predecessor's deletion. Dropping it ends the watch.
struct Watch {
    key: Vec<u8>,
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
    /// Our entry's key: `{prefix}/{escaped key}/{owner}`.
    pub(super) key: String,
    /// The key's queue: `{prefix}/{escaped key}/`.
    queue: String,
    /// The holder's record, the entry's value.
    holder: String,
    pub(super) notify: Arc<Notify>,
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

/// The first entry of a queue (the holder).
fn first() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
        .with_keys_only()
}

/// The entry created just before `revision` (our predecessor).
fn predecessor(revision: i64) -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_max_create_revision(revision - 1)
        .with_limit(1)
        .with_keys_only()
}

fn kvs(response: &TxnResponse, i: usize) -> Vec<KeyValue> {
    match response.op_responses().into_iter().nth(i) {
        Some(TxnOpResponse::Get(mut get)) => get.take_kvs(),
        _ => Vec::new(),
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
                Arc::new(Pending {
                    key: format!("{queue}{}", super::url::escape(&request.owner)),
                    queue,
                    holder: request.holder.encode(),
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
            Err(error) if error.is_retryable() => {
                return Ok(Attempt::Unavailable {
                    error,
                    retry_in: RETRY,
                });
            }
            Err(error) => return Err(error),
        };
        let unavailable = |what: &str, err| {
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
        for _ in 0..MAX_STEPS {
            let known = pending.state().revision;
            let revision = match known {
                Some(revision) => revision,
                None => match self.put_entry(&session, &pending).await {
                    Ok(Some((revision, holder))) => {
                        if holder {
                            return Ok(Attempt::Held(
                                self.grant(request, &session, &pending, revision, started),
                            ));
                        }
                        revision
                    }
                    Ok(None) => continue,
                    Err(err) => return unavailable("putting the lock entry", err),
                },
            };
            // One read of our entry, the holder and our predecessor.
            let mut kv = session.client.kv_client();
            let read = Txn::new().and_then([
                TxnOp::get(
                    pending.key.as_str(),
                    Some(GetOptions::new().with_keys_only()),
                ),
                TxnOp::get(pending.queue.as_str(), Some(first())),
                TxnOp::get(pending.queue.as_str(), Some(predecessor(revision))),
            ]);
            let response = match session.call(kv.txn(read)).await {
                Ok(response) => response,
                Err(err) => return unavailable("reading the lock's queue", err),
            };
            let ours = kvs(&response, 0);
            if !ours
                .first()
                .is_some_and(|e| e.create_revision() == revision && e.lease() == session.lease_id)
            {
                // Deleted behind our back while queued: queue again.
                let mut st = pending.state();
                st.revision = None;
                st.watch = None;
                continue;
            }
            if kvs(&response, 1)
                .first()
                .is_some_and(|e| e.create_revision() == revision)
            {
                return Ok(Attempt::Held(
                    self.grant(request, &session, &pending, revision, started),
                ));
            }
            let Some(ahead) = kvs(&response, 2).into_iter().next() else {
                // The queue changed between the reads of one revision: look again.
                continue;
            };
            if request.wait.is_zero() {
                // Tried once: the wait loop abandons, deleting our entry.
                return Ok(Attempt::Busy { retry_in: None });
            }
            self.watch(
                &session,
                &pending,
                ahead.key().to_vec(),
                revision_of(&response),
            );
            return Ok(Attempt::Busy {
                retry_in: Some(session.ttl),
            });
        }
        Ok(Attempt::Busy {
            retry_in: Some(Duration::ZERO),
        })
    }

    /// Puts our entry under the session's lease, unless it exists (the
    /// answer of an earlier put was lost): one transaction that also reads
    /// the queue's first entry. `(create revision, whether it holds)`, or
    /// `None` when an old entry of ours had to be deleted first.
    async fn put_entry(
        &self,
        session: &Arc<Session>,
        pending: &Pending,
    ) -> Result<Option<(i64, bool)>, etcd_client::Error> {
        let key = pending.key.as_str();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    key,
                    pending.holder.as_str(),
                    Some(PutOptions::new().with_lease(session.lease_id)),
                ),
                TxnOp::get(pending.queue.as_str(), Some(first())),
            ])
            .or_else([
                TxnOp::get(key, Some(GetOptions::new().with_keys_only())),
                TxnOp::get(pending.queue.as_str(), Some(first())),
            ]);
        let mut kv = session.client.kv_client();
        let response = session.call(kv.txn(txn)).await?;
        let holder = kvs(&response, 1).into_iter().next();
        let (revision, recovered) = if response.succeeded() {
            (revision_of(&response), false)
        } else {
            match kvs(&response, 0).into_iter().next() {
                Some(e) if e.lease() == session.lease_id => (e.create_revision(), true),
                Some(e) => {
                    // Ours, from a session that ended: its lease is going;
                    // delete it now rather than queue behind it.
                    let deadline = Some(Instant::now() + session.op_timeout);
                    delete_entry(session, key, e.create_revision(), deadline).await?;
                    return Ok(None);
                }
                None => return Ok(None),
            }
        };
        if recovered {
            self.counters
                .creates_recovered
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                key,
                "dlock etcd: lost put reply; entry found again by its key"
            );
        } else {
            self.counters.entries_put.fetch_add(1, Ordering::Relaxed);
        }
        let mut st = pending.state();
        st.revision = Some(revision);
        Ok(Some((
            revision,
            holder.is_some_and(|h| h.create_revision() == revision),
        )))
    }

    /// Watches our predecessor's deletion from just after `read_at` (the
    /// revision the queue was read at), so that no deletion is missed.
    /// The watch runs in its own task on its own stream; it fires on the
    /// deletion, or when the stream breaks or is cancelled (the next
    /// attempt reads the queue again and watches again).
    fn watch(&self, session: &Arc<Session>, pending: &Pending, ahead: Vec<u8>, read_at: i64) {
        {
            let mut st = pending.state();
            if let Some(watch) = &mut st.watch
                && watch.key == ahead
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
            let (fired, stop, key) = (fired.clone(), stop.clone(), ahead.clone());
            let (notify, counters) = (pending.notify.clone(), self.counters.clone());
            let mut watches = session.client.watch_client();
            async move {
                let watched = async {
                    let options = WatchOptions::new().with_start_revision(read_at + 1);
                    let Ok(mut stream) = watches.watch(key, Some(options)).await else {
                        tokio::time::sleep(RETRY).await;
                        return;
                    };
                    loop {
                        match stream.message().await {
                            Ok(Some(answer)) => {
                                if answer.canceled()
                                    || answer
                                        .events()
                                        .iter()
                                        .any(|e| e.event_type() == EventType::Delete)
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
            key: ahead,
            fired,
            stop,
            checked_at: Instant::now(),
        });
    }

    /// Our entry holds the key: the lease, registered with its session.
    fn grant(
        &self,
        request: &AcquireRequest,
        session: &Arc<Session>,
        pending: &Pending,
        revision: i64,
        started: Instant,
    ) -> Lease {
        if let Some(done) = lock(&self.pending).remove(&request.owner) {
            done.state().watch = None;
        }
        let held = session.register(
            pending.key.clone(),
            revision,
            request.lost.clone(),
            crate::time::saturating_add(started, request.lease),
        );
        if !session.is_alive() {
            // The session ended between the read and the registration:
            // this grant is lost with it (its lease takes the entry).
            session.unregister(&held);
            request.lost.cancel();
        }
        Lease::new(request, Some(FencingToken::new(revision as u64))).with_extra(held)
    }

    /// Ends an acquisition that did not end with a grant (given up,
    /// dropped, failed): deletes its entry by name. The name holds the
    /// acquisition's owner token, which no other acquisition uses, so this
    /// never deletes anyone else's entry; and it is found even when this
    /// process forgot the acquisition — the runtime's second release of a
    /// dropped acquisition, after a put that was still on the wire at the
    /// first, finds the entry that put created.
    pub(super) async fn drop_pending(
        self: &Arc<Self>,
        stored_key: &str,
        owner: &str,
    ) -> Result<(), BackendError> {
        let pending = lock(&self.pending).remove(owner);
        let session = match &pending {
            Some(pending) => {
                let mut st = pending.state();
                st.watch = None;
                st.session.clone()
            }
            None => None,
        };
        let Some(session) = session.or_else(|| self.current_alive()) else {
            // No live session: its lease takes every entry with it.
            return Ok(());
        };
        let key = format!("{}{}", self.queue_of(stored_key), super::url::escape(owner));
        let deadline = Instant::now() + session.op_timeout;
        match delete_named(&session, &key, Some(deadline)).await {
            Ok(()) => Ok(()),
            Err(err) if super::transient(&err) => {
                let message = format!(
                    "etcd: the queued entry {key} is not deleted yet ({err}); the delete goes on \
                     in the background until it succeeds or the session ends"
                );
                crate::driver::handle().spawn(async move {
                    let _ = delete_named(&session, &key, None).await;
                });
                Err(BackendError::transient(message))
            }
            Err(err) => Err(backend_error(&format!("deleting the entry {key}"), err)),
        }
    }
}
