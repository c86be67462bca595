//! One backend session: one etcd lease, kept alive by one task, and every
//! lease (entry) held through it; the reaper that deletes entries whose
//! dlock lease ran out unrenewed.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, Error as EtcdError, GetOptions, Txn, TxnOp, TxnOpResponse,
    TxnResponse,
};
use tokio_util::sync::CancellationToken;

use super::url::revocation_mark;
use super::{Counters, lease_gone, transient};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A session of the backend: its etcd lease and the entries held through it.
pub(super) struct Session {
    /// The backend's client (shared by every session).
    pub(super) client: Client,
    /// The etcd lease every entry of the session is put under.
    pub(super) lease_id: i64,
    /// The lease's TTL (the smaller of the one asked for and the one granted).
    pub(super) ttl: Duration,
    /// The bound on one request.
    pub(super) op_timeout: Duration,
    base: Instant,
    /// When the latest keep-alive (or the grant) that the server answered
    /// was sent (ns after `base`): the server cannot expire the lease
    /// before this + `ttl`.
    last_heard: AtomicU64,
    held: Mutex<Held>,
    next_id: AtomicU64,
    reaper: Arc<tokio::sync::Notify>,
    /// Asks the keeper for a keep-alive now (a renewal batch).
    kick: tokio::sync::Notify,
    /// Notified whenever a keep-alive is answered.
    answered: tokio::sync::Notify,
    /// Cancelled when the session has ended (its lease expired, revoked, or
    /// declared lost) or is dropped.
    pub(super) ended: CancellationToken,
    counters: Arc<Counters>,
}

#[derive(Default)]
struct Held {
    by_end: BTreeMap<(Instant, u64), Arc<HeldEntry>>,
    next_look: Option<Instant>,
}

/// The reaper looks at least this often, even with nothing due.
const IDLE_LOOK: Duration = Duration::from_secs(1);

impl Drop for Session {
    fn drop(&mut self) {
        if !self.ended.is_cancelled() {
            self.ended.cancel();
            // Nothing of ours is held or queued any more: give the lease
            // back rather than let it expire.
            let (mut client, id, bound) = (self.client.clone(), self.lease_id, self.op_timeout);
            crate::driver::handle().spawn(async move {
                let _ = tokio::time::timeout(bound, client.lease_revoke(id)).await;
            });
        }
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("lease", &format_args!("{:x}", self.lease_id))
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl Session {
    pub(super) fn new(
        client: Client,
        lease_id: i64,
        ttl: Duration,
        granted_at: Instant,
        counters: Arc<Counters>,
    ) -> Arc<Self> {
        Arc::new(Session {
            client,
            lease_id,
            ttl,
            op_timeout: op_timeout(ttl),
            base: granted_at,
            last_heard: AtomicU64::new(0),
            held: Mutex::new(Held::default()),
            next_id: AtomicU64::new(1),
            reaper: Arc::new(tokio::sync::Notify::new()),
            kick: tokio::sync::Notify::new(),
            answered: tokio::sync::Notify::new(),
            ended: CancellationToken::new(),
            counters,
        })
    }

    pub(super) fn is_alive(&self) -> bool {
        !self.ended.is_cancelled()
    }

    fn heard(&self, sent: Instant) {
        let ns = sent.saturating_duration_since(self.base).as_nanos();
        self.last_heard
            .fetch_max(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::AcqRel);
        self.answered.notify_waiters();
    }

    /// Whether etcd keeps the session's lease at least until `at` without
    /// another keep-alive: it cannot expire it before the last answered
    /// keep-alive was sent + the TTL.
    pub(super) fn outlasts(&self, at: Instant) -> bool {
        self.is_alive() && self.last_heard() + self.ttl >= at
    }

    /// Has the keeper send a keep-alive now and waits until one sent at or
    /// after `since` is answered: true then, false at `deadline` or when the
    /// session ends. A renewal batch is one such keep-alive, so a renewed
    /// lease's etcd lease was extended after the renewal was sent.
    pub(super) async fn keep_alive_since(&self, since: Instant, deadline: Instant) -> bool {
        self.kick.notify_one();
        loop {
            let answered = self.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if self.last_heard() >= since {
                return true;
            }
            if !self.is_alive() {
                return false;
            }
            tokio::select! {
                () = &mut answered => {}
                () = self.ended.cancelled() => return false,
                () = tokio::time::sleep_until(deadline.into()) => return self.last_heard() >= since,
            }
        }
    }

    fn last_heard(&self) -> Instant {
        self.base + Duration::from_nanos(self.last_heard.load(Ordering::Acquire))
    }

    /// When the session's entries are declared lost unless a keep-alive is
    /// answered first: ⅔ of the TTL after the last one answered was sent,
    /// before the server can expire the lease.
    fn loss_at(&self) -> Instant {
        self.last_heard() + self.ttl * 2 / 3
    }

    /// `request`, bounded by [`op_timeout`](Self::op_timeout); a lease the
    /// server no longer knows ends the session.
    pub(super) async fn call<T>(
        &self,
        request: impl Future<Output = Result<T, EtcdError>>,
    ) -> Result<T, EtcdError> {
        let answer = match tokio::time::timeout(self.op_timeout, request).await {
            Ok(answer) => answer,
            Err(_) => Err(timed_out()),
        };
        if let Err(err) = &answer
            && lease_gone(err)
        {
            self.end(
                "etcd no longer knows the session's lease (expired or revoked)",
                true,
            );
        }
        answer
    }

    /// A granted entry, whose dlock lease ends at `expires_at` unless renewed.
    pub(super) fn register(
        self: &Arc<Self>,
        key: String,
        revision: i64,
        slot: Option<SlotClaim>,
        lost: CancellationToken,
        expires_at: Instant,
    ) -> Arc<HeldEntry> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(HeldEntry {
            key,
            revision,
            slot,
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
            held.by_end.insert((expires_at, id), entry.clone());
            held.next_look.is_some_and(|next| expires_at < next)
        };
        if wake {
            self.reaper.notify_one();
        }
        entry
    }

    pub(super) fn unregister(&self, entry: &HeldEntry) {
        let mut held = lock(&self.held);
        let mut state = lock(&entry.state);
        state.ended = true;
        held.by_end.remove(&(state.expires_at, entry.id));
    }

    /// A renewal sent at `sent` found the entry ours: its dlock lease now
    /// ends at `sent + ttl`. False if it had ended meanwhile.
    pub(super) fn extend(&self, entry: &HeldEntry, sent: Instant, ttl: Duration) -> bool {
        let at = crate::time::saturating_add(sent, ttl);
        let wake = {
            let mut held = lock(&self.held);
            let mut state = lock(&entry.state);
            if state.ended {
                return false;
            }
            let Some(e) = held.by_end.remove(&(state.expires_at, entry.id)) else {
                return false;
            };
            state.expires_at = at;
            held.by_end.insert((at, entry.id), e);
            held.next_look.is_some_and(|next| at < next)
        };
        if wake {
            self.reaper.notify_one();
        }
        true
    }

    fn take_expired(&self, now: Instant) -> (Vec<Arc<HeldEntry>>, Instant) {
        let mut held = lock(&self.held);
        let mut due = Vec::new();
        while let Some(entry) = held.by_end.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let e = entry.remove();
            lock(&e.state).ended = true;
            due.push(e);
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

    /// Ends the session: every entry held through it is declared lost at
    /// once, and (unless etcd already dropped it) its lease is revoked in
    /// the background, which deletes every entry put under it — held or
    /// queued. The next acquisition opens a new session.
    pub(super) fn end(&self, why: &'static str, lease_gone: bool) {
        if self.ended.is_cancelled() {
            return;
        }
        // Cancelled before the held list is taken: a grant registered after
        // this sees the session ended (see `grant`).
        self.ended.cancel();
        let entries: Vec<Arc<HeldEntry>> = std::mem::take(&mut lock(&self.held).by_end)
            .into_values()
            .collect();
        self.counters.sessions_ended.fetch_add(1, Ordering::Relaxed);
        if !entries.is_empty() {
            self.counters
                .losses
                .fetch_add(entries.len() as u64, Ordering::Relaxed);
            tracing::warn!(
                lease = %format_args!("{:x}", self.lease_id),
                leases = entries.len(),
                reason = why,
                "dlock etcd: every lease of the session is lost"
            );
        }
        for entry in entries {
            lock(&entry.state).ended = true;
            entry.lost.cancel();
        }
        if !lease_gone {
            // Until the lease is gone, on the server, by revocation or by
            // expiry (at the latest `last heard + TTL`).
            let (client, id) = (self.client.clone(), self.lease_id);
            let (until, bound) = (self.last_heard() + self.ttl, self.op_timeout);
            crate::driver::handle().spawn(revoke_until_gone(client, id, until, bound));
        }
    }
}

/// The error of a request cut at its bound.
pub(super) fn timed_out() -> EtcdError {
    EtcdError::IoError(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "no answer from etcd in time",
    ))
}

/// The bound on one request: a quarter of the session TTL, from 500 ms to 2 s.
pub(super) fn op_timeout(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(500), Duration::from_secs(2))
}

async fn revoke_until_gone(mut client: Client, id: i64, until: Instant, bound: Duration) {
    let mut backoff = Duration::from_millis(50);
    while Instant::now() < until {
        match tokio::time::timeout(bound, client.lease_revoke(id)).await {
            Ok(Ok(_)) => return,
            Ok(Err(err)) if lease_gone(&err) || !transient(&err) => return,
            _ => {}
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// An entry we hold: what a lease's `extra` carries.
#[derive(Debug)]
pub(super) struct HeldEntry {
    /// Its etcd key: `{prefix}/{escaped key}/{owner}`.
    pub(super) key: String,
    /// Its create revision.
    pub(super) revision: i64,
    /// A permit's slot claim.
    pub(super) slot: Option<SlotClaim>,
    id: u64,
    pub(super) session: Weak<Session>,
    pub(super) lost: CancellationToken,
    state: Mutex<HeldState>,
}

/// A permit holder's claim of its slot: `{prefix}/%slots/{escaped key}/{slot}`,
/// created under the session's lease by the grant.
#[derive(Debug, Clone)]
pub(super) struct SlotClaim {
    /// The claim's etcd key.
    pub(super) key: String,
    /// Its create revision: the grant's fencing token.
    pub(super) revision: i64,
}

impl SlotClaim {
    /// Deletes the claim if it is still this one (its create revision):
    /// one operation of a transaction.
    pub(super) fn delete_op(&self) -> TxnOp {
        TxnOp::txn(
            Txn::new()
                .when([Compare::create_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    self.revision,
                )])
                .and_then([TxnOp::delete(self.key.as_str(), None)]),
        )
    }
}

#[derive(Debug)]
struct HeldState {
    expires_at: Instant,
    ended: bool,
}

impl HeldEntry {
    pub(super) fn is_ended(&self) -> bool {
        lock(&self.state).ended
    }
}

/// Deletes `key` if its create revision is still `revision` (so never a
/// newer entry of the same name), until done, the session ended (its lease
/// takes the entry with it) or `deadline`. The same transaction deletes the
/// mark a revocation may have left for this entry's name, whether the entry
/// is still there (a name queued again after its revocation) or gone (the
/// hold is over: nobody will read it).
///
/// A permit's slot claim goes in the same transaction, if it is still ours
/// (its own create revision), whether the entry is still there or not.
pub(super) async fn delete_entry(
    session: &Session,
    key: &str,
    revision: i64,
    slot: Option<&SlotClaim>,
    deadline: Option<Instant>,
) -> Result<(), EtcdError> {
    let mark = revocation_mark(key);
    let txn = || {
        let mut ours = vec![TxnOp::delete(key, None)];
        let mut otherwise = Vec::new();
        if let Some(m) = mark.as_deref() {
            ours.push(TxnOp::delete(m, None));
            otherwise.push(TxnOp::delete(m, None));
        }
        if let Some(claim) = slot {
            ours.push(claim.delete_op());
            otherwise.push(claim.delete_op());
        }
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, revision)])
            .and_then(ours);
        if otherwise.is_empty() {
            txn
        } else {
            txn.or_else(otherwise)
        }
    };
    delete_with(session, txn, deadline).await.map(|_| ())
}

/// Deletes `key`, whatever it holds (an entry named by the owner token of
/// an acquisition that is over), and the mark a revocation may have left
/// for it; with `slots` (a permit's key), then the slot claims there whose
/// value is `owner`, read in the same transaction as the delete.
pub(super) async fn delete_named(
    session: &Session,
    key: &str,
    slots: Option<&str>,
    owner: &str,
    deadline: Option<Instant>,
) -> Result<(), EtcdError> {
    let mark = revocation_mark(key);
    let txn = || {
        let mut ops = vec![TxnOp::delete(key, None)];
        ops.extend(mark.as_deref().map(|m| TxnOp::delete(m, None)));
        if let Some(slots) = slots {
            ops.push(TxnOp::get(slots, Some(GetOptions::new().with_prefix())));
        }
        Txn::new().and_then(ops)
    };
    let Some(response) = delete_with(session, txn, deadline).await? else {
        return Ok(());
    };
    let Some(TxnOpResponse::Get(read)) = response.op_responses().into_iter().last() else {
        return Ok(());
    };
    for claim in read.kvs().iter().filter(|c| c.value() == owner.as_bytes()) {
        let claim = SlotClaim {
            key: String::from_utf8_lossy(claim.key()).into_owned(),
            revision: claim.create_revision(),
        };
        let ours = || Txn::new().and_then([claim.delete_op()]);
        delete_with(session, ours, deadline).await?;
    }
    Ok(())
}

/// Sends `txn` until it is answered (its answer), the session ended
/// (`None`: its lease takes the keys) or `deadline`.
async fn delete_with(
    session: &Session,
    txn: impl Fn() -> Txn,
    deadline: Option<Instant>,
) -> Result<Option<TxnResponse>, EtcdError> {
    let mut backoff = Duration::from_millis(10);
    loop {
        if !session.is_alive() {
            return Ok(None);
        }
        let mut kv = session.client.kv_client();
        match session.call(kv.txn(txn())).await {
            Ok(response) => return Ok(Some(response)),
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

/// Deletes the entries whose dlock lease ran out unrenewed, each at the
/// end of its lease. One task per session.
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
        for entry in due {
            tracing::debug!(key = %entry.key, "dlock etcd: lease ran out unrenewed; entry deleted");
            let session = strong.clone();
            crate::driver::handle().spawn(async move {
                let _ = delete_entry(
                    &session,
                    &entry.key,
                    entry.revision,
                    entry.slot.as_ref(),
                    None,
                )
                .await;
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

/// Keeps the session's etcd lease alive for the session's whole life: a
/// keep-alive every sixth of the TTL and one per renewal batch, on one stream, the stream opened
/// again when it breaks (etcd-client's streams do not reconnect), and the
/// session ended — every entry declared lost — when etcd answers that the
/// lease is gone, or when no keep-alive was answered for ⅔ of the TTL.
pub(super) async fn keeper(session: Weak<Session>) {
    let Some(strong) = session.upgrade() else {
        return;
    };
    let (mut leases, id, every, ended) = (
        strong.client.lease_client(),
        strong.lease_id,
        strong.ttl / 6,
        strong.ended.clone(),
    );
    strong.heard(strong.base);
    drop(strong);
    let mut stream = None;
    let mut kicked = false;
    loop {
        let Some(strong) = session.upgrade() else {
            return;
        };
        if !strong.is_alive() {
            return;
        }
        let now = Instant::now();
        let loss_at = strong.loss_at();
        if now >= loss_at {
            strong.end(
                "no etcd keep-alive answered for 2/3 of the session TTL: the lease may expire",
                false,
            );
            return;
        }
        let due = strong.last_heard() + every;
        if now < due && !kicked {
            drop(strong);
            let Some(kick) = session.upgrade() else {
                return;
            };
            tokio::select! {
                () = ended.cancelled() => return,
                () = kick.kick.notified() => kicked = true,
                () = tokio::time::sleep_until(due.min(loss_at).into()) => {}
            }
            continue;
        }
        kicked = false;
        let sent = now;
        let bound = (sent + strong.op_timeout).min(loss_at);
        let answer = tokio::time::timeout_at(bound.into(), async {
            match &mut stream {
                None => {
                    let opened = leases.keep_alive(id).await?;
                    strong
                        .counters
                        .streams_opened
                        .fetch_add(1, Ordering::Relaxed);
                    stream = Some(opened);
                    Ok(Some(1))
                }
                Some((keeper, answers)) => {
                    keeper.keep_alive().await?;
                    Ok(answers.message().await?.map(|a| a.ttl()))
                }
            }
        })
        .await;
        match answer {
            Ok(Ok(Some(ttl))) if ttl > 0 => strong.heard(sent),
            Ok(Ok(Some(_))) => {
                strong.end(
                    "etcd no longer knows the session's lease (expired or revoked)",
                    true,
                );
                return;
            }
            Ok(Err(EtcdError::LeaseKeepAliveError(_))) if stream.is_none() => {
                // Opening the stream on a lease etcd no longer knows.
                strong.end(
                    "etcd no longer knows the session's lease (expired or revoked)",
                    true,
                );
                return;
            }
            Ok(Err(err)) if lease_gone(&err) => {
                strong.end(
                    "etcd no longer knows the session's lease (expired or revoked)",
                    true,
                );
                return;
            }
            other => {
                // A broken or silent stream: open a new one.
                if let Ok(Err(err)) = &other {
                    tracing::debug!(error = %err, "dlock etcd: keep-alive stream broke; reopening");
                }
                stream = None;
                drop(strong);
                tokio::select! {
                    () = ended.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
    }
}
