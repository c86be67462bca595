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
//! State is bounded: a key's entry is removed when it is released, expired
//! entries are collected as new keys come in, and waiter entries live only
//! while someone waits. Tokens come from one counter for all keys, so they
//! keep growing per key although per-key entries are forgotten.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::wait::Waiters;
use super::{
    AcquireRequest, Attempt, HeldEntry, HolderRecord, KeyEntry, Lease, LockBackend, Renewal,
    WakeSource,
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

#[derive(Debug)]
struct Entry {
    owner: String,
    expires_at: Instant,
    holder: Arc<HolderRecord>,
    token: u64,
    granted_at: SystemTime,
}

impl Entry {
    fn held_entry(&self, now: Instant) -> HeldEntry {
        let mut held = HeldEntry::new(self.owner.clone());
        held.holder = Some((*self.holder).clone());
        held.token = Some(FencingToken::new(self.token));
        held.granted_at = Some(self.granted_at);
        held.expires_in = Some(self.expires_at.saturating_duration_since(now));
        held
    }
}

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
        let was_held = self.keys().held.remove(key).is_some();
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
            .filter(|(_, e)| e.expires_at > now)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Entries the store keeps right now: held keys (expired ones not yet
    /// collected included) and keys with waiters. Bounded by what is in use,
    /// not by every key ever locked.
    pub fn entries(&self) -> usize {
        self.keys().held.len() + self.inner.waiters.len()
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

    /// Drops expired entries, now and then (every 1,024 new keys): expired
    /// leases of holders that never released must not pile up.
    fn collect_expired(keys: &mut Keys, now: Instant) {
        keys.inserts += 1;
        if keys.inserts >= 1024 || keys.held.len() > 2 * keys.inserts.max(1024) {
            keys.inserts = 0;
            keys.held.retain(|_, e| e.expires_at > now);
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
                && entry.owner == lease.owner
                && entry.expires_at > now
            {
                if self.inner.revoke_on_renewal.load(Ordering::SeqCst) {
                    keys.held.remove(&lease.key);
                    drop(keys);
                    self.inner.waiters.wake(&lease.key);
                    return Ok(Renewal::Revoked);
                }
                entry.expires_at = saturating_add(now, ttl);
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

impl LockBackend for MemoryBackend {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            let now = self.now();
            let mut keys = self.keys();
            if let Some(entry) = keys.held.get(&request.key)
                && entry.expires_at > now
                && entry.owner != request.owner
            {
                return Ok(Attempt::Busy {
                    retry_in: Some(entry.expires_at - now),
                });
            }
            let token = self.inner.tokens.fetch_add(1, Ordering::SeqCst) + 1;
            let granted_at = match keys.held.get(&request.key) {
                // The same owner again (a retried attempt): still the first grant.
                Some(entry) if entry.owner == request.owner && entry.expires_at > now => {
                    entry.granted_at
                }
                _ => SystemTime::now(),
            };
            let fresh = keys
                .held
                .insert(
                    request.key.clone(),
                    Entry {
                        owner: request.owner.clone(),
                        expires_at: saturating_add(now, request.lease),
                        holder: request.holder.clone(),
                        token,
                        granted_at,
                    },
                )
                .is_none();
            if fresh {
                Self::collect_expired(&mut keys, now);
            }
            Ok(Attempt::Held(Lease::new(
                request,
                Some(FencingToken::new(token)),
            )))
        })
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
            let freed = {
                let mut keys = self.keys();
                let ours = keys
                    .held
                    .get(&lease.key)
                    .is_some_and(|e| e.owner == lease.owner);
                if ours {
                    keys.held.remove(&lease.key);
                }
                if keys.released.len() >= RELEASES_REMEMBERED {
                    keys.released.pop_front();
                }
                keys.released
                    .push_back((lease.key.clone(), lease.owner.clone()));
                ours
            };
            if freed {
                self.inner.waiters.wake(&lease.key);
            }
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
        let entry = keys.held.get(key).filter(|e| e.expires_at > now).map(|e| {
            let mut entry = KeyEntry::new(key, vec![e.held_entry(now)]);
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
            .filter(|(k, e)| k.starts_with(prefix) && e.expires_at > now)
            .map(|(k, e)| {
                let mut entry = KeyEntry::new(k.clone(), vec![e.held_entry(now)]);
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
            let removed = keys.held.remove(key).filter(|e| e.expires_at > now);
            if let Some(entry) = &removed {
                if keys.revoked.len() >= RELEASES_REMEMBERED {
                    keys.revoked.pop_front();
                }
                keys.revoked
                    .push_back((key.to_owned(), entry.owner.clone()));
            }
            removed
        };
        self.inner.waiters.wake(key);
        Box::pin(std::future::ready(Ok(removed
            .map(|e| vec![e.held_entry(now)])
            .unwrap_or_default())))
    }
}
