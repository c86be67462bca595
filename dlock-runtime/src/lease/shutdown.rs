//! Graceful shutdown: each registry's tracker of its live leases and of
//! the releases in flight, and what shutdown does with it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use super::held::HeldLease;
use super::registry::{Registry, global};

/// Shuts the global registry down for a graceful restart: see
/// [`Registry::shutdown`]. Without a registry there is nothing to release.
pub async fn shutdown(deadline: Duration) -> ShutdownReport {
    match global() {
        Some(registry) => registry.shutdown(deadline).await,
        None => ShutdownReport::default(),
    }
}

/// What [`Registry::shutdown`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Held leases whose release shutdown asked for.
    pub released: usize,
    /// Releases still unfinished when the deadline passed (their keys expire
    /// with their leases).
    pub unfinished: usize,
}

/// Every live lease of a registry, its releases and acquisitions in flight:
/// what shutdown releases, stops and waits for.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    live: Mutex<HashMap<u64, Weak<HeldLease>>>,
    /// Releases in flight, each counted by a
    /// [`Releasing`](super::background::Releasing) from when it is asked for
    /// until it has run; and acquisitions in flight, counted the same way
    /// until they have returned (a grant on its way becomes a tracked lease,
    /// or is released).
    releasing: AtomicUsize,
    settled: Notify,
    closing: AtomicBool,
    /// Cancelled by shutdown: acquisitions still waiting stop.
    closed: CancellationToken,
}

impl Leases {
    fn live_map(&self) -> MutexGuard<'_, HashMap<u64, Weak<HeldLease>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn track(&self, lease: &Arc<HeldLease>) {
        self.live_map().insert(lease.id, Arc::downgrade(lease));
    }

    /// Takes a released lease out of the live ones.
    pub(crate) fn forget(&self, id: u64) {
        self.live_map().remove(&id);
    }

    pub(super) fn release_started(&self) {
        self.releasing.fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn release_finished(&self) {
        self.releasing.fetch_sub(1, Ordering::SeqCst);
        if self.is_closing() {
            // Only shutdown waits on it.
            self.settled.notify_waiters();
        }
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Resolves when shutdown has begun.
    pub(crate) fn closed(&self) -> WaitForCancellationFuture<'_> {
        self.closed.cancelled()
    }

    pub(super) fn live(&self) -> usize {
        let mut live = self.live_map();
        live.retain(|_, l| l.strong_count() > 0);
        live.len()
    }
}

impl Registry {
    /// Releases every lease for a graceful restart (a rolling deploy), so the
    /// next replica need not wait for them to expire: acquisitions fail with
    /// [`LockError::ShutDown`](crate::LockError::ShutDown) from now on — also
    /// those already waiting, whose attempts on the wire are undone — every
    /// held lease is marked lost (bodies with `on_lost = "cancel"` stop at
    /// their next `.await`) and released, and the releases in flight — also
    /// those handed to the background by guards' `Drop` — are waited for, up
    /// to `deadline`. Once it has returned with nothing unfinished, no key is
    /// held or taken through this registry any more.
    ///
    /// ```no_run
    /// # async fn f() {
    /// // after the HTTP server has drained its requests:
    /// let report = dlock_runtime::shutdown(std::time::Duration::from_secs(5)).await;
    /// assert_eq!(report.unfinished, 0);
    /// # }
    /// ```
    pub async fn shutdown(&self, deadline: Duration) -> ShutdownReport {
        let leases = &self.inner.leases;
        leases.closing.store(true, Ordering::SeqCst);
        leases.closed.cancel();
        let held: Vec<Arc<HeldLease>> = leases
            .live_map()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        let released = held.len();
        for lease in held {
            lease.signal_lost(super::loss::LossReason::Shutdown);
            lease.release_in_background();
        }
        let until = crate::time::saturating_add(Instant::now(), deadline);
        loop {
            let settled = leases.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            let unfinished = leases.releasing.load(Ordering::SeqCst);
            if unfinished == 0 || Instant::now() >= until {
                tracing::info!(released, unfinished, "dlock registry shut down");
                return ShutdownReport {
                    released,
                    unfinished,
                };
            }
            let _ = tokio::time::timeout_at(until.into(), settled).await;
        }
    }
}
