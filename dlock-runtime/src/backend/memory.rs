//! The in-process backend (`memory://`), with fault controls for tests.
//!
//! Same semantics as the networked backends — owner-checked leases that
//! expire, a fencing token per key that only grows, waiters woken on release —
//! within one process. Clone it before registering to keep a handle on the
//! controls: [`expire_now`](MemoryBackend::expire_now),
//! [`fail_renewals`](MemoryBackend::fail_renewals) and
//! [`advance`](MemoryBackend::advance) make the lost path testable without a server.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use super::{AcquireRequest, Acquired, Lease, LockBackend, Renewal};
use crate::error::BackendError;
use crate::token::FencingToken;

/// The in-process backend. Cheap to clone; clones share their state.
#[derive(Clone, Debug, Default)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    keys: Mutex<HashMap<String, Entry>>,
    /// Added to the real clock: [`MemoryBackend::advance`] moves time forward.
    skew: Mutex<Duration>,
    fail_renewals: AtomicBool,
    renewals: AtomicU64,
    renewals_after_release: AtomicU64,
    /// Wakes every waiter when time jumps.
    clock_moved: Notify,
}

#[derive(Debug)]
struct Entry {
    owner: Option<String>,
    /// Owners that released this key, to catch a renewal after release.
    released_owners: Vec<String>,
    token: u64,
    expires_at: Instant,
    released: Arc<Notify>,
}

impl MemoryBackend {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn keys(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.inner.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> Instant {
        Instant::now() + *self.inner.skew.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends the lease on `key` (the stored key, i.e. with the registry's prefix,
    /// `dlock:` by default) as if it had expired or an operator had deleted it.
    /// Returns whether it was held. The holder learns at its next renewal.
    pub fn expire_now(&self, key: &str) -> bool {
        let mut keys = self.keys();
        let Some(entry) = keys.get_mut(key) else {
            return false;
        };
        let was_held = entry.owner.take().is_some();
        entry.released.notify_waiters();
        was_held
    }

    /// While `true`, every renewal fails with a transient error (a network
    /// outage): the watchdog retries, then declares the lease lost before it ends.
    pub fn fail_renewals(&self, fail: bool) {
        self.inner.fail_renewals.store(fail, Ordering::SeqCst);
    }

    /// Moves this store's clock forward: leases whose end falls within `by` expire.
    pub fn advance(&self, by: Duration) {
        *self.inner.skew.lock().unwrap_or_else(|p| p.into_inner()) += by;
        self.inner.clock_moved.notify_waiters();
    }

    /// Keys held right now (unexpired), stored form.
    pub fn held_keys(&self) -> Vec<String> {
        let now = self.now();
        self.keys()
            .iter()
            .filter(|(_, e)| e.owner.is_some() && e.expires_at > now)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Renewals received so far (successful or not).
    pub fn renewal_count(&self) -> u64 {
        self.inner.renewals.load(Ordering::SeqCst)
    }

    /// Renewals that arrived for an owner after that owner had released the
    /// key. The runtime promises this stays zero.
    pub fn renewals_after_release(&self) -> u64 {
        self.inner.renewals_after_release.load(Ordering::SeqCst)
    }

    fn try_take(&self, request: &AcquireRequest) -> Result<Lease, (Arc<Notify>, Instant)> {
        let now = self.now();
        let real_start = Instant::now();
        let mut keys = self.keys();
        let entry = keys.entry(request.key.clone()).or_insert_with(|| Entry {
            owner: None,
            released_owners: Vec::new(),
            token: 0,
            expires_at: now,
            released: Arc::new(Notify::new()),
        });
        if entry.owner.is_some() && entry.expires_at > now {
            return Err((entry.released.clone(), entry.expires_at));
        }
        entry.owner = Some(request.owner.clone());
        entry.token += 1;
        entry.expires_at = now + request.lease;
        Ok(Lease {
            key: request.key.clone(),
            owner: request.owner.clone(),
            token: Some(FencingToken::new(entry.token)),
            valid_until: real_start + request.lease,
            extra: None,
        })
    }
}

impl LockBackend for MemoryBackend {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Acquired, BackendError>> {
        Box::pin(async move {
            let deadline = Instant::now() + request.wait;
            loop {
                // Register for the wake-ups before looking, so that a release
                // between the look and the wait is not missed.
                let clock_moved = self.inner.clock_moved.notified();
                tokio::pin!(clock_moved);
                clock_moved.as_mut().enable();
                let (released, expires_at) = match self.try_take(request) {
                    Ok(lease) => return Ok(Acquired::Held(lease)),
                    Err(busy) => busy,
                };
                let released = released.notified_owned();
                tokio::pin!(released);
                released.as_mut().enable();
                // `try_take` looked under the lock; a release after it notifies
                // `released`, which is registered now. Re-check once to close
                // the window between the unlock and the registration.
                if let Ok(lease) = self.try_take(request) {
                    return Ok(Acquired::Held(lease));
                }
                let now = Instant::now();
                if now >= deadline {
                    return Ok(Acquired::Busy);
                }
                // The holder's lease ends at `expires_at` on the skewed clock.
                let until_expiry = expires_at.saturating_duration_since(self.now());
                let wake_at = deadline.min(now + until_expiry);
                tokio::select! {
                    () = released => {}
                    () = clock_moved => {}
                    () = tokio::time::sleep_until(wake_at.into()) => {}
                }
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        Box::pin(async move {
            self.inner.renewals.fetch_add(1, Ordering::SeqCst);
            let real_start = Instant::now();
            let now = self.now();
            let mut keys = self.keys();
            let Some(entry) = keys.get_mut(&lease.key) else {
                return Ok(Renewal::Lost);
            };
            if entry.released_owners.contains(&lease.owner) {
                self.inner
                    .renewals_after_release
                    .fetch_add(1, Ordering::SeqCst);
            }
            if self.inner.fail_renewals.load(Ordering::SeqCst) {
                return Err(BackendError::transient(
                    "memory backend: renewals are failing (fault injected)",
                ));
            }
            if entry.owner.as_deref() != Some(&lease.owner) || entry.expires_at <= now {
                return Ok(Renewal::Lost);
            }
            entry.expires_at = now + ttl;
            Ok(Renewal::Renewed {
                valid_until: real_start + ttl,
            })
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let mut keys = self.keys();
            if let Some(entry) = keys.get_mut(&lease.key) {
                if entry.owner.as_deref() == Some(&lease.owner) {
                    entry.owner = None;
                    entry.released.notify_waiters();
                }
                if entry.released_owners.len() >= 16 {
                    entry.released_owners.remove(0);
                }
                entry.released_owners.push(lease.owner.clone());
            }
            Ok(())
        })
    }

    fn needs_io_runtime(&self) -> bool {
        false
    }
}
