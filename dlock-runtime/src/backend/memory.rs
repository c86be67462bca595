//! The in-process backend (`memory://`), with fault controls for tests.
//!
//! Same semantics as the networked backends — owner-checked leases that
//! expire, fencing tokens that only grow, waiters woken on release — within
//! one process. Clone it before registering to keep a handle on the
//! controls: [`expire_now`](MemoryBackend::expire_now),
//! [`fail_renewals`](MemoryBackend::fail_renewals),
//! [`stall_renewals`](MemoryBackend::stall_renewals),
//! [`advance`](MemoryBackend::advance) and
//! [`revoke_on_renewal`](MemoryBackend::revoke_on_renewal) make the lost
//! path testable without a server.
//!
//! Every operation decides under one mutex, on this store's clock, in one
//! step. A key's entry holds its holders, all in one
//! [`HoldMode`]:
//!
//! - **Plain locks** (the write mode): one holder.
//! - **Semaphores** (`permits(n)`): up to `n` holders, each on the lowest
//!   free slot `0..n` and each with its own expiry, so a crashed holder frees
//!   only its own permit after its lease. The number of permits is the mode
//!   stored with the holders: another number, or another kind of lock, while
//!   the key has holders is a [`HoldMode::mismatch`] error. A release wakes
//!   one waiter (one slot came free).
//! - **Read-write locks**: any number of readers, each with its own expiry,
//!   never beside a writer. Writers are preferred with a *waiting-writer
//!   mark*, as in madelson's writer-intent: a writer that finds readers
//!   leaves a mark of its own (3 s, renewed by its attempts every second)
//!   that makes new readers busy; the mark goes with its grant, its
//!   [`abandon`](LockBackend::abandon) or its owner's release. A short mark
//!   of its own, rather than the writer's lease, means a writer that vanished
//!   while waiting holds readers back for seconds only. A release by a
//!   writer or a reader wakes every waiter (readers enter together).
//!
//! Fencing tokens come from one counter for all keys and every mode, so they
//! grow per key (readers and writers share one sequence) and per (key, slot),
//! although per-key entries are forgotten.
//!
//! State is bounded: a key's entry is removed once it has neither holders
//! nor writer marks, expired entries are collected as new keys come in, and
//! waiter entries live only while someone waits.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::wait::Waiters;
use super::{
    AcquireRequest, Attempt, HeldEntry, HoldMode, HolderRecord, KeyEntry, Lease, LockBackend,
    Renewal, WakeSource,
};
use crate::error::BackendError;
use crate::time::saturating_add;
use crate::token::FencingToken;

/// How many recent releases are remembered to catch a renewal sent after one.
const RELEASES_REMEMBERED: usize = 4096;

/// The in-process backend. Cheap to clone; clones share their state.
#[derive(Clone, Debug)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        MemoryBackend {
            inner: Arc::new(Inner {
                keys: Mutex::default(),
                skew: Mutex::default(),
                tokens: AtomicU64::new(0),
                fail_renewals: AtomicBool::new(false),
                stall_renewals: watch::channel(false).0,
                renewals: AtomicU64::new(0),
                renewals_after_release: AtomicU64::new(0),
                waiters: Arc::default(),
                revoke_on_renewal: AtomicBool::new(false),
            }),
        }
    }
}

#[derive(Debug)]
struct Inner {
    keys: Mutex<Keys>,
    /// Added to the real clock: [`MemoryBackend::advance`] moves time forward.
    skew: Mutex<Duration>,
    /// One counter for every key: the fencing tokens.
    tokens: AtomicU64,
    fail_renewals: AtomicBool,
    stall_renewals: watch::Sender<bool>,
    renewals: AtomicU64,
    renewals_after_release: AtomicU64,
    waiters: Arc<Waiters>,
    /// [`MemoryBackend::revoke_on_renewal`].
    revoke_on_renewal: AtomicBool,
}

#[derive(Debug, Default)]
struct Keys {
    held: HashMap<String, Entry>,
    /// Recent releases `(key, owner)`, oldest first, to catch a renewal after release.
    released: VecDeque<(String, String)>,
    /// Recent revocations `(key, owner)`, oldest first: their renewals answer
    /// [`Renewal::Revoked`].
    revoked: VecDeque<(String, String)>,
    /// Inserts since expired entries were last collected.
    inserts: usize,
}

/// Everything kept of one key: its holders (one writer, readers, or the
/// permit holders of a semaphore, all in one mode) and the marks of writers
/// waiting behind readers.
#[derive(Debug, Default)]
struct Entry {
    holders: Vec<Holder>,
    /// Writers waiting behind readers `(owner, mark's end)`: while one is
    /// unexpired, new readers are busy.
    writers_waiting: Vec<(String, Instant)>,
}

/// One holder of a key.
#[derive(Debug)]
struct Holder {
    owner: String,
    expires_at: Instant,
    holder: Arc<HolderRecord>,
    token: u64,
    granted_at: SystemTime,
    mode: HoldMode,
    slot: Option<u32>,
}

impl Holder {
    fn held_entry(&self, now: Instant) -> HeldEntry {
        let mut held = HeldEntry::new(self.owner.clone());
        held.holder = Some((*self.holder).clone());
        held.token = Some(FencingToken::new(self.token));
        held.granted_at = Some(self.granted_at);
        held.expires_in = Some(self.expires_at.saturating_duration_since(now));
        held.mode = self.mode;
        held.slot = self.slot;
        held
    }
}

impl Entry {
    /// Forgets holders and marks whose time is over.
    fn prune(&mut self, now: Instant) {
        self.holders.retain(|h| h.expires_at > now);
        self.writers_waiting.retain(|(_, until)| *until > now);
    }

    /// Whether nothing of the key is left to keep.
    fn is_empty(&self) -> bool {
        self.holders.is_empty() && self.writers_waiting.is_empty()
    }

    /// The mode of the key's holders, if it has any.
    fn mode(&self) -> Option<HoldMode> {
        self.holders.first().map(|h| h.mode)
    }

    /// The earliest end among the key's holders.
    fn earliest_expiry(&self) -> Option<Instant> {
        self.holders.iter().map(|h| h.expires_at).min()
    }

    /// The unexpired holders' entries, as `inspect` shows them.
    fn held_entries(&self, now: Instant) -> Vec<HeldEntry> {
        let mut live: Vec<&Holder> = self.holders.iter().filter(|h| h.expires_at > now).collect();
        live.sort_by_key(|h| (h.slot, h.token));
        live.iter().map(|h| h.held_entry(now)).collect()
    }

    /// Whether the key has an unexpired holder.
    fn is_held(&self, now: Instant) -> bool {
        self.holders.iter().any(|h| h.expires_at > now)
    }

    /// Removes what `owner` holds of the key (only `slot`'s permit if
    /// given) and its waiting-writer mark; what was removed.
    fn remove_owner(&mut self, owner: &str, slot: Option<u32>) -> Vec<Holder> {
        self.writers_waiting.retain(|(o, _)| o != owner);
        let mut removed = Vec::new();
        let mut i = 0;
        while i < self.holders.len() {
            let h = &self.holders[i];
            if h.owner == owner && (slot.is_none() || h.slot == slot) {
                removed.push(self.holders.swap_remove(i));
            } else {
                i += 1;
            }
        }
        removed
    }
}

/// Whether holders of `held` and a request for `asked` are told apart by a
/// mismatch (different kinds of lock, or semaphores of different sizes),
/// rather than by being busy.
fn mismatched(held: HoldMode, asked: HoldMode) -> bool {
    match (held, asked) {
        (HoldMode::Exclusive | HoldMode::Shared, HoldMode::Exclusive | HoldMode::Shared) => false,
        (HoldMode::Permit { permits: m }, HoldMode::Permit { permits: n }) => m != n,
        _ => true,
    }
}

/// How long a waiting writer's mark holds new readers back unless the
/// writer tries again: short, so that a writer that vanished while waiting
/// delays readers by seconds, not by a lease.
const WRITER_MARK: Duration = Duration::from_secs(3);

/// How often a writer waiting behind readers tries again, renewing its mark.
const WRITER_MARK_RENEWAL: Duration = Duration::from_secs(1);

impl MemoryBackend {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn keys(&self) -> MutexGuard<'_, Keys> {
        self.inner.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> Instant {
        Instant::now() + *self.inner.skew.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends the lease on `key` (the stored key, i.e. with the registry's prefix,
    /// `dlock:` by default) as if it had expired or an operator had deleted it.
    /// Returns whether it was held. The holder learns at its next renewal.
    pub fn expire_now(&self, key: &str) -> bool {
        let now = self.now();
        let was_held = self.keys().held.remove(key).is_some_and(|e| e.is_held(now));
        self.inner.waiters.wake(key);
        was_held
    }

    /// While `true`, every renewal fails with a transient error (a network
    /// outage): the watchdog retries, then declares the lease lost before it ends.
    pub fn fail_renewals(&self, fail: bool) {
        self.inner.fail_renewals.store(fail, Ordering::SeqCst);
    }

    /// While `true`, renewals hang without an answer (a stalled server, a held
    /// database write lock): the watchdog must declare the leases lost at
    /// their give-up instant anyway, and other backends' leases must not wait.
    /// Renewals stalled so far answer when it is set back to `false`.
    pub fn stall_renewals(&self, stall: bool) {
        self.inner.stall_renewals.send_replace(stall);
    }

    /// While `true`, every renewal of a lease this store holds ends it and
    /// answers [`Renewal::Revoked`], as after an operator's revocation: the
    /// holder's loss is reported with the reason
    /// [`Revoked`](crate::LossReason::Revoked).
    pub fn revoke_on_renewal(&self, revoke: bool) {
        self.inner.revoke_on_renewal.store(revoke, Ordering::SeqCst);
    }

    /// Moves this store's clock forward: leases whose end falls within `by` expire.
    pub fn advance(&self, by: Duration) {
        *self.inner.skew.lock().unwrap_or_else(|p| p.into_inner()) += by;
        self.inner.waiters.wake_all();
    }

    /// Keys held right now (unexpired), stored form.
    pub fn held_keys(&self) -> Vec<String> {
        let now = self.now();
        self.keys()
            .held
            .iter()
            .filter(|(_, e)| e.is_held(now))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Entries the store keeps right now: held keys (expired ones not yet
    /// collected included) and keys with waiters. Bounded by what is in use,
    /// not by every key ever locked.
    pub fn entries(&self) -> usize {
        self.keys().held.len() + self.inner.waiters.len()
    }

    /// Entries the store keeps right now for stored keys starting with
    /// `prefix`: keys with holders or waiting writers (expired ones not yet
    /// collected included), and keys with waiters.
    pub fn entries_under(&self, prefix: &str) -> usize {
        self.keys()
            .held
            .keys()
            .filter(|k| k.starts_with(prefix))
            .count()
            + self.inner.waiters.count_under(prefix)
    }

    /// Renewals received so far (successful or not).
    pub fn renewal_count(&self) -> u64 {
        self.inner.renewals.load(Ordering::SeqCst)
    }

    /// Renewals that arrived for an owner after that owner had released the
    /// key (among the last 4,096 releases). The runtime promises this stays zero.
    pub fn renewals_after_release(&self) -> u64 {
        self.inner.renewals_after_release.load(Ordering::SeqCst)
    }

    /// Drops expired entries, now and then: expired leases of holders that
    /// never released must not pile up. A pass visits every key, so it runs
    /// once the new keys since the last one number half the keys kept (at
    /// least 1,024): each new key pays for a bounded share of a pass however
    /// many keys are held, and the keys kept stay within twice the keys
    /// live at the last pass (so twice the most ever held at once) plus
    /// 1,024. Keys whose holders ended without a release (expired) go only
    /// at the next pass: after as many new keys as half the keys kept.
    fn collect_expired(keys: &mut Keys, now: Instant) {
        keys.inserts += 1;
        if keys.inserts >= (keys.held.len() / 2).max(1024) {
            keys.inserts = 0;
            keys.held.retain(|_, e| {
                e.prune(now);
                !e.is_empty()
            });
        }
    }

    async fn stalled(&self) {
        let mut stall = self.inner.stall_renewals.subscribe();
        let _ = stall.wait_for(|stalled| !*stalled).await;
    }

    /// Renews one lease (a call of its own: stalls and faults apply to each).
    fn renew_one<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        Box::pin(async move {
            self.inner.renewals.fetch_add(1, Ordering::SeqCst);
            {
                let keys = self.keys();
                if keys
                    .released
                    .iter()
                    .any(|(k, o)| *k == lease.key && *o == lease.owner)
                {
                    self.inner
                        .renewals_after_release
                        .fetch_add(1, Ordering::SeqCst);
                }
            }
            self.stalled().await;
            if self.inner.fail_renewals.load(Ordering::SeqCst) {
                return Err(BackendError::transient(
                    "memory backend: renewals are failing (fault injected)",
                ));
            }
            let now = self.now();
            let mut keys = self.keys();
            if let Some(entry) = keys.held.get_mut(&lease.key)
                && let Some(holder) = entry
                    .holders
                    .iter_mut()
                    .find(|h| h.owner == lease.owner && h.slot == lease.slot && h.expires_at > now)
            {
                if self.inner.revoke_on_renewal.load(Ordering::SeqCst) {
                    entry.remove_owner(&lease.owner, lease.slot);
                    if entry.is_empty() {
                        keys.held.remove(&lease.key);
                    }
                    drop(keys);
                    self.inner.waiters.wake(&lease.key);
                    return Ok(Renewal::Revoked);
                }
                holder.expires_at = saturating_add(now, ttl);
                return Ok(Renewal::Renewed);
            }
            let revoked = keys
                .revoked
                .iter()
                .any(|(k, o)| *k == lease.key && *o == lease.owner);
            Ok(if revoked {
                Renewal::Revoked
            } else {
                Renewal::Lost
            })
        })
    }
}

impl MemoryBackend {
    /// One attempt at `request` on the key's `entry` (pruned of what expired).
    fn attempt(&self, entry: &mut Entry, request: &AcquireRequest, now: Instant) -> Attempt {
        let busy = |until: Option<Instant>| Attempt::Busy {
            retry_in: until.map(|t| t.saturating_duration_since(now)),
        };
        // The same owner again (a retried attempt): still its first grant.
        let again = entry
            .holders
            .iter()
            .position(|h| h.owner == request.owner && h.mode == request.mode);
        let slot = match request.mode {
            _ if again.is_some() => again.and_then(|i| entry.holders[i].slot),
            HoldMode::Exclusive => {
                if !entry.holders.is_empty() {
                    if entry.mode() == Some(HoldMode::Shared) {
                        // Writers are preferred: new readers wait behind this mark.
                        let until = saturating_add(now, WRITER_MARK);
                        entry.writers_waiting.retain(|(o, _)| *o != request.owner);
                        entry.writers_waiting.push((request.owner.clone(), until));
                        let renew_mark = saturating_add(now, WRITER_MARK_RENEWAL);
                        return busy(entry.earliest_expiry().map(|t| t.min(renew_mark)));
                    }
                    return busy(entry.earliest_expiry());
                }
                None
            }
            HoldMode::Shared => {
                if !entry.holders.is_empty() && entry.mode() != Some(HoldMode::Shared) {
                    return busy(entry.earliest_expiry());
                }
                if let Some(until) = entry
                    .writers_waiting
                    .iter()
                    .filter(|(o, _)| *o != request.owner)
                    .map(|(_, until)| *until)
                    .min()
                {
                    return busy(Some(until));
                }
                None
            }
            HoldMode::Permit { permits } => {
                let taken: Vec<u32> = entry.holders.iter().filter_map(|h| h.slot).collect();
                match (0..permits).find(|slot| !taken.contains(slot)) {
                    Some(slot) => Some(slot),
                    None => return busy(entry.earliest_expiry()),
                }
            }
        };
        let token = self.inner.tokens.fetch_add(1, Ordering::SeqCst) + 1;
        let expires_at = saturating_add(now, request.lease);
        match again {
            Some(i) => {
                let holder = &mut entry.holders[i];
                holder.token = token;
                holder.expires_at = expires_at;
            }
            None => entry.holders.push(Holder {
                owner: request.owner.clone(),
                expires_at,
                holder: request.holder.clone(),
                token,
                granted_at: SystemTime::now(),
                mode: request.mode,
                slot,
            }),
        }
        entry.writers_waiting.retain(|(o, _)| *o != request.owner);
        let lease = Lease::new(request, Some(FencingToken::new(token)));
        Attempt::Held(match slot {
            Some(slot) => lease.with_slot(slot),
            None => lease,
        })
    }

    /// Wakes the waiters a release of `freed` lets in: one for a permit
    /// (one slot came free), every one otherwise (readers enter together).
    fn wake_after(&self, key: &str, freed: &[Holder]) {
        if freed.is_empty() {
            return;
        }
        if freed
            .iter()
            .all(|h| matches!(h.mode, HoldMode::Permit { .. }))
        {
            for _ in freed {
                self.inner.waiters.wake_one(key);
            }
        } else {
            self.inner.waiters.wake(key);
        }
    }
}

impl LockBackend for MemoryBackend {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        let _ = mode;
        Ok(())
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            let now = self.now();
            let mut keys = self.keys();
            let fresh = !keys.held.contains_key(&request.key);
            let entry = keys.held.entry(request.key.clone()).or_default();
            entry.prune(now);
            if let Some(held) = entry.mode()
                && mismatched(held, request.mode)
            {
                if entry.is_empty() {
                    keys.held.remove(&request.key);
                }
                return Err(BackendError::config(HoldMode::mismatch(
                    &request.key,
                    held,
                    request.mode,
                )));
            }
            let answer = self.attempt(entry, request, now);
            if entry.is_empty() {
                keys.held.remove(&request.key);
            } else if fresh {
                Self::collect_expired(&mut keys, now);
            }
            Ok(answer)
        })
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        let mut keys = self.keys();
        if let Some(entry) = keys.held.get_mut(&request.key) {
            let before = entry.writers_waiting.len();
            entry
                .writers_waiting
                .retain(|(owner, _)| *owner != request.owner);
            let unmarked = entry.writers_waiting.len() != before;
            if entry.is_empty() {
                keys.held.remove(&request.key);
            }
            drop(keys);
            if unmarked {
                // Readers held back by the mark may enter now.
                self.inner.waiters.wake(&request.key);
            }
        }
        Box::pin(std::future::ready(()))
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        let key = &request.key;
        Box::pin(std::future::ready(self.inner.waiters.source(key)))
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(futures_util::future::join_all(
            batch.iter().map(|(lease, ttl)| self.renew_one(lease, *ttl)),
        ))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let (freed, unmarked) = {
                let mut keys = self.keys();
                let mut freed = Vec::new();
                let mut unmarked = false;
                if let Some(entry) = keys.held.get_mut(&lease.key) {
                    let marks = entry.writers_waiting.len();
                    freed = entry.remove_owner(&lease.owner, lease.slot);
                    unmarked = entry.writers_waiting.len() != marks;
                    if entry.is_empty() {
                        keys.held.remove(&lease.key);
                    }
                }
                if keys.released.len() >= RELEASES_REMEMBERED {
                    keys.released.pop_front();
                }
                keys.released
                    .push_back((lease.key.clone(), lease.owner.clone()));
                (freed, unmarked)
            };
            if unmarked && freed.is_empty() {
                self.inner.waiters.wake(&lease.key);
            }
            self.wake_after(&lease.key, &freed);
            Ok(())
        })
    }

    fn needs_io_runtime(&self) -> bool {
        false
    }

    fn inspect<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyEntry>, BackendError>> {
        let now = self.now();
        let keys = self.keys();
        let entry = keys.held.get(key).filter(|e| e.is_held(now)).map(|e| {
            let mut entry = KeyEntry::new(key, e.held_entries(now));
            entry.waiters = Some(self.inner.waiters.waiting(key));
            entry
        });
        Box::pin(std::future::ready(Ok(entry)))
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<KeyEntry>, BackendError>> {
        let now = self.now();
        let keys = self.keys();
        let mut held: Vec<KeyEntry> = keys
            .held
            .iter()
            .filter(|(k, e)| k.starts_with(prefix) && e.is_held(now))
            .map(|(k, e)| {
                let mut entry = KeyEntry::new(k.clone(), e.held_entries(now));
                entry.waiters = Some(self.inner.waiters.waiting(k));
                entry
            })
            .collect();
        held.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        held.truncate(limit);
        Box::pin(std::future::ready(Ok(held)))
    }

    fn revoke<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<HeldEntry>, BackendError>> {
        let now = self.now();
        let removed = {
            let mut keys = self.keys();
            let removed = keys
                .held
                .remove(key)
                .map(|e| e.held_entries(now))
                .unwrap_or_default();
            for entry in &removed {
                if keys.revoked.len() >= RELEASES_REMEMBERED {
                    keys.revoked.pop_front();
                }
                keys.revoked
                    .push_back((key.to_owned(), entry.owner.clone()));
            }
            removed
        };
        self.inner.waiters.wake(key);
        Box::pin(std::future::ready(Ok(removed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    fn request(key: &str, owner: &str, mode: HoldMode) -> AcquireRequest {
        AcquireRequest::new(key, owner, LEASE).with_mode(mode)
    }

    async fn held(mem: &MemoryBackend, request: &AcquireRequest) -> Lease {
        match mem.try_acquire(request).await.expect("no error") {
            Attempt::Held(lease) => lease,
            other => panic!("{} not granted: {other:?}", request.owner),
        }
    }

    async fn is_busy(mem: &MemoryBackend, request: &AcquireRequest) -> bool {
        matches!(
            mem.try_acquire(request).await.expect("no error"),
            Attempt::Busy { .. }
        )
    }

    const THREE: HoldMode = HoldMode::Permit { permits: 3 };

    #[tokio::test]
    async fn permits_take_the_lowest_free_slot_and_a_slotless_release_frees_the_owners() {
        let mem = MemoryBackend::new();
        let a = held(&mem, &request("k", "a", THREE)).await;
        let b = held(&mem, &request("k", "b", THREE)).await;
        let c = held(&mem, &request("k", "c", THREE)).await;
        assert_eq!((a.slot, b.slot, c.slot), (Some(0), Some(1), Some(2)));
        assert!(is_busy(&mem, &request("k", "d", THREE)).await);
        // The runtime's undo of an abandoned attempt carries no slot.
        let mut undo = Lease::new(&request("k", "b", THREE), None);
        undo.slot = None;
        mem.release(&undo).await.expect("release");
        let d = held(&mem, &request("k", "d", THREE)).await;
        assert_eq!(d.slot, Some(1));
        assert!(d.token > b.token, "slot 1's token went back");
    }

    #[tokio::test]
    async fn another_mode_on_held_holders_is_a_config_error() {
        let mem = MemoryBackend::new();
        let a = held(&mem, &request("k", "a", THREE)).await;
        for mode in [
            HoldMode::Permit { permits: 4 },
            HoldMode::Exclusive,
            HoldMode::Shared,
        ] {
            let err = mem
                .try_acquire(&request("k", "x", mode))
                .await
                .expect_err("a mismatch");
            assert!(err.is_config(), "{err}");
        }
        mem.release(&a).await.expect("release");
        held(&mem, &request("k", "x", HoldMode::Shared)).await;
    }

    #[tokio::test]
    async fn a_writer_mark_holds_readers_back_until_it_expires_or_is_abandoned() {
        let mem = MemoryBackend::new();
        let reader = held(&mem, &request("k", "r1", HoldMode::Shared)).await;
        let writer = request("k", "w", HoldMode::Exclusive);
        assert!(is_busy(&mem, &writer).await);
        assert!(is_busy(&mem, &request("k", "r2", HoldMode::Shared)).await);
        // A writer that vanished while waiting: its mark ends on its own.
        mem.advance(WRITER_MARK + Duration::from_millis(1));
        held(&mem, &request("k", "r2", HoldMode::Shared)).await;

        assert!(is_busy(&mem, &writer).await);
        assert!(is_busy(&mem, &request("k", "r3", HoldMode::Shared)).await);
        mem.abandon(&writer).await;
        held(&mem, &request("k", "r3", HoldMode::Shared)).await;
        let _ = reader;
    }

    #[tokio::test]
    async fn readers_and_writers_leave_nothing_once_gone() {
        let mem = MemoryBackend::new();
        let r = held(&mem, &request("k", "r", HoldMode::Shared)).await;
        let writer = request("k", "w", HoldMode::Exclusive);
        assert!(is_busy(&mem, &writer).await);
        mem.release(&r).await.expect("release");
        let w = held(&mem, &writer).await;
        assert!(w.token > r.token, "one sequence for readers and writers");
        mem.release(&w).await.expect("release");
        assert_eq!(mem.entries_under("k"), 0);
    }
}
