//! The state of one held lease, shared by its guards and the watchdog.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backend::{Lease, LockBackend, Renewal};
use crate::error::{BackendError, LockError};
use crate::token::FencingToken;
use crate::watchdog::Watchdog;

/// Where a lease is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Held and scheduled with the watchdog.
    Held,
    /// A renewal is on the wire; release waits for it to come back.
    Renewing,
    /// Lost (expired, taken over, renewal impossible); the key may be held elsewhere.
    Lost,
    /// Released (or handed to `hold_at_least`): no call about it will follow.
    Released,
}

#[derive(Debug)]
pub(crate) struct LeaseState {
    pub(crate) phase: Phase,
    /// Conservative local bound on the lease's end.
    pub(crate) valid_until: Instant,
    /// The watchdog slot this lease occupies, if any.
    pub(crate) slot: Option<Instant>,
}

/// One acquisition, shared by its guards (reentrant holds included) and the watchdog.
#[derive(Debug)]
pub(crate) struct HeldLease {
    pub(crate) id: u64,
    pub(crate) registry_id: u64,
    pub(crate) backend_name: Arc<str>,
    pub(crate) backend: Arc<dyn LockBackend>,
    /// The key as the user wrote it (no prefix).
    pub(crate) user_key: String,
    pub(crate) lease: Lease,
    pub(crate) lease_len: Duration,
    /// Whether the watchdog renews it (`watchdog = false` makes the lease a hard cap).
    pub(crate) renew: bool,
    pub(crate) hold_at_least: Option<Duration>,
    /// Cancelled when the lease is lost.
    pub(crate) lost: CancellationToken,
    /// Guards alive for this acquisition; the last one releases.
    pub(crate) holds: AtomicUsize,
    pub(crate) acquired_at: Instant,
    pub(crate) span: tracing::Span,
    pub(crate) watchdog: Watchdog,
    state: Mutex<LeaseState>,
    state_changed: Notify,
}

pub(crate) struct NewLease {
    pub(crate) id: u64,
    pub(crate) registry_id: u64,
    pub(crate) backend_name: Arc<str>,
    pub(crate) backend: Arc<dyn LockBackend>,
    pub(crate) user_key: String,
    pub(crate) lease: Lease,
    pub(crate) lease_len: Duration,
    pub(crate) renew: bool,
    pub(crate) hold_at_least: Option<Duration>,
    pub(crate) lost: CancellationToken,
    pub(crate) span: tracing::Span,
    pub(crate) watchdog: Watchdog,
}

impl HeldLease {
    pub(crate) fn new(n: NewLease) -> Arc<Self> {
        let valid_until = n.lease.valid_until;
        Arc::new(HeldLease {
            id: n.id,
            registry_id: n.registry_id,
            backend_name: n.backend_name,
            backend: n.backend,
            user_key: n.user_key,
            lease: n.lease,
            lease_len: n.lease_len,
            renew: n.renew,
            hold_at_least: n.hold_at_least,
            lost: n.lost,
            holds: AtomicUsize::new(1),
            acquired_at: Instant::now(),
            span: n.span,
            watchdog: n.watchdog,
            state: Mutex::new(LeaseState {
                phase: Phase::Held,
                valid_until,
                slot: None,
            }),
            state_changed: Notify::new(),
        })
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, LeaseState> {
        // A panic while holding this lock cannot leave the state half-written
        // (every update is a few field stores), so poisoning is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn notify_state_changed(&self) {
        self.state_changed.notify_waiters();
    }

    pub(crate) fn fencing_token(&self) -> Option<FencingToken> {
        self.lease.token
    }

    /// Whether the lease is known to be lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Marks the lease lost and tells the holder.
    pub(crate) fn mark_lost(&self, state: &mut LeaseState, why: &str) {
        state.phase = Phase::Lost;
        state.slot = None;
        if !self.lost.is_cancelled() {
            tracing::warn!(
                parent: &self.span,
                key = %self.user_key,
                backend = %self.backend_name,
                reason = why,
                "dlock lease lost"
            );
            self.lost.cancel();
        }
    }

    /// Adds a reentrant hold; false if the lease is already on its way out.
    pub(crate) fn add_hold(&self) -> bool {
        let mut n = self.holds.load(Ordering::Acquire);
        loop {
            if n == 0 {
                return false;
            }
            match self
                .holds
                .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(current) => n = current,
            }
        }
    }

    /// Drops one hold; true if it was the last (the caller must release).
    pub(crate) fn drop_hold(&self) -> bool {
        self.holds.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Stops renewals (waiting for one on the wire), then frees the key — or,
    /// with `hold_at_least`, lets it expire that long from now.
    ///
    /// Runs the backend call on the I/O runtime when the backend needs it.
    pub(crate) async fn release(self: Arc<Self>) -> Result<(), LockError> {
        if self.backend.needs_io_runtime() {
            crate::driver::run(self.release_here()).await
        } else {
            self.release_here().await
        }
    }

    async fn release_here(self: Arc<Self>) -> Result<(), LockError> {
        let slot = loop {
            let notified = self.state_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.state();
                match state.phase {
                    Phase::Renewing => {}
                    Phase::Held | Phase::Lost => {
                        state.phase = Phase::Released;
                        break state.slot.take();
                    }
                    Phase::Released => return Ok(()),
                }
            }
            notified.await;
        };
        if let Some(slot) = slot {
            self.watchdog.unschedule(slot, self.id);
        }
        let held_for = self.acquired_at.elapsed();
        self.span.record("held_ms", held_for.as_secs_f64() * 1000.0);
        let outcome: Result<(), BackendError> = match self.hold_at_least {
            Some(at_least) => match self.backend.renew(&self.lease, at_least).await {
                Ok(Renewal::Renewed { .. }) => Ok(()),
                Ok(Renewal::Lost) => {
                    self.lost.cancel();
                    Ok(())
                }
                Err(err) => Err(err),
            },
            None => self.backend.release(&self.lease).await,
        };
        match outcome {
            Ok(()) if self.lost.is_cancelled() => {
                tracing::debug!(parent: &self.span, key = %self.user_key, "dlock released a lost lease");
                Err(LockError::Lost {
                    key: self.user_key.clone(),
                })
            }
            Ok(()) => {
                tracing::debug!(
                    parent: &self.span,
                    key = %self.user_key,
                    held_ms = held_for.as_secs_f64() * 1000.0,
                    hold_at_least = self.hold_at_least.is_some(),
                    "dlock released"
                );
                Ok(())
            }
            Err(err) => {
                tracing::warn!(
                    parent: &self.span,
                    key = %self.user_key,
                    error = %err,
                    "dlock release failed; the lease will expire on its own"
                );
                Err(err.into_lock_error(self.backend.kind()))
            }
        }
    }
}
