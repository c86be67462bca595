//! One held lease, shared by its guards and the watchdog: the I/O around the
//! [state machine](super::state).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::background::Releasing;
use super::loss::LossReason;
use super::shutdown::Leases;
use super::state::{LeaseState, ReleaseStart, TimeLoss};
use super::watchdog::Watchdog;
use crate::backend::{Lease, LockBackend, Renewal};
use crate::error::{BackendError, LockError};
use crate::stats::Site;
use crate::token::FencingToken;

/// The state machine and the watchdog slot the lease occupies.
#[derive(Debug)]
pub(crate) struct Sched {
    pub(crate) machine: LeaseState,
    /// The schedule entry of this lease, if it has one.
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
    /// Set when the lease ends without a body having run under it (a hold of
    /// several keys that could not be completed): `hold_at_least` is waived.
    no_body: AtomicBool,
    /// Whether it was taken with a fencing token asked for (`fencing`).
    pub(crate) fenced: bool,
    /// Cancelled when the lease is lost (by the watchdog, or by the backend on
    /// its own); shared by the leases of one hold of several keys.
    pub(crate) lost: CancellationToken,
    /// Whether the loss of this lease itself was signalled (not another key's
    /// of its hold).
    lost_itself: AtomicBool,
    /// The token the backend cancels when it learns on its own that this
    /// lease is gone: `lost` itself for a single key, this key's own for a
    /// hold of several (the hold passes it on to `lost`).
    backend_lost: CancellationToken,
    /// Nested guards alive for this acquisition.
    nested_holds: AtomicUsize,
    pub(crate) acquired_at: Instant,
    pub(crate) span: tracing::Span,
    pub(crate) watchdog: Watchdog,
    leases: Arc<Leases>,
    sched: Mutex<Sched>,
    /// Notified when a renewal's answer has been taken (a release may wait for it).
    renewal_settled: Notify,
    /// Where its events are counted.
    pub(crate) site: Site,
    /// Why it was lost (the first reason found).
    loss: OnceLock<LossReason>,
    /// Whether its end (release or loss) was counted.
    counted_out: AtomicBool,
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
    pub(crate) fenced: bool,
    pub(crate) lost: CancellationToken,
    pub(crate) backend_lost: CancellationToken,
    pub(crate) span: tracing::Span,
    pub(crate) watchdog: Watchdog,
    pub(crate) leases: Arc<Leases>,
    pub(crate) site: Site,
    /// `max_hold`: the ceiling on the hold, from now.
    pub(crate) max_hold: Option<Duration>,
}

impl HeldLease {
    /// The lease, registered with its registry (for shutdown) but not yet scheduled.
    pub(crate) fn new(n: NewLease) -> Arc<Self> {
        let now = Instant::now();
        let mut machine = LeaseState::new(n.lease.valid_until, n.lease_len, n.renew, now);
        if let Some(max_hold) = n.max_hold {
            machine.cap_at(crate::time::saturating_add(now, max_hold));
        }
        n.site.acquired();
        let held = Arc::new(HeldLease {
            id: n.id,
            registry_id: n.registry_id,
            backend_name: n.backend_name,
            backend: n.backend,
            user_key: n.user_key,
            lease: n.lease,
            lease_len: n.lease_len,
            renew: n.renew,
            hold_at_least: n.hold_at_least,
            no_body: AtomicBool::new(false),
            fenced: n.fenced,
            lost: n.lost,
            lost_itself: AtomicBool::new(false),
            backend_lost: n.backend_lost,
            nested_holds: AtomicUsize::new(0),
            acquired_at: now,
            span: n.span,
            watchdog: n.watchdog,
            leases: n.leases,
            sched: Mutex::new(Sched {
                machine,
                slot: None,
            }),
            renewal_settled: Notify::new(),
            site: n.site,
            loss: OnceLock::new(),
            counted_out: AtomicBool::new(false),
        });
        held.leases.track(&held);
        held
    }

    pub(crate) fn sched(&self) -> MutexGuard<'_, Sched> {
        // Every update is a few field stores: a panic cannot leave it half
        // written, so poisoning is ignored.
        self.sched.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn fencing_token(&self) -> Option<FencingToken> {
        self.lease.token
    }

    /// Whether the lease is known to be lost: reported, or past its give-up
    /// instant (even before the watchdog has looked). A lease whose release
    /// was asked for protects nothing any more: lost too, for the nested
    /// holders that outlive their outer one.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled() || {
            let sched = self.sched();
            sched.machine.is_lost(Instant::now()) || sched.machine.release_requested()
        }
    }

    /// Whether the loss of this lease itself was signalled (for a hold of
    /// several keys: this key is the one lost).
    pub(crate) fn lost_itself(&self) -> bool {
        self.lost_itself.load(Ordering::Acquire) || self.backend_lost.is_cancelled()
    }

    /// Tells the holder that the lease is lost (once), with the reason.
    pub(crate) fn signal_lost(&self, reason: LossReason) {
        self.lost_itself.store(true, Ordering::Release);
        self.note_loss(reason);
        if !self.lost.is_cancelled() {
            tracing::warn!(
                parent: &self.span,
                key = %self.user_key,
                backend = %self.backend_name,
                reason = reason.describe(),
                loss_reason = reason.as_str(),
                "dlock lease lost"
            );
            self.lost.cancel();
        }
    }

    /// Records why the lease was lost (the first reason stays) and counts
    /// the loss, unless its end was counted already.
    pub(crate) fn note_loss(&self, reason: LossReason) {
        let _ = self.loss.set(reason);
        if !self.counted_out.swap(true, Ordering::AcqRel) {
            let reason = self.loss.get().copied().unwrap_or(reason);
            let now = Instant::now();
            let due = {
                let sched = self.sched();
                match (reason, sched.machine.ceiling()) {
                    (LossReason::MaxHold, Some(ceiling)) => ceiling,
                    _ => sched.machine.give_up_at(),
                }
            };
            let late = now.saturating_duration_since(due);
            self.site.lost(reason, self.acquired_at.elapsed(), late);
        }
    }

    /// Counts the release of a lease still held (unless its end was counted already).
    fn count_released(&self) {
        if !self.counted_out.swap(true, Ordering::AcqRel) {
            self.site.released(self.acquired_at.elapsed());
        }
    }

    /// The loss reason of a time-driven loss.
    pub(crate) fn time_loss_reason(&self, loss: TimeLoss) -> LossReason {
        match loss {
            TimeLoss::Ceiling => LossReason::MaxHold,
            TimeLoss::GiveUp if self.renew => LossReason::Expired,
            TimeLoss::GiveUp => LossReason::HardCap,
        }
    }

    /// Why this lease was lost: recorded, or found now (the backend's own
    /// signal, a give-up instant or ceiling passed before the watchdog
    /// looked). `None` while it is held, and for a lease released by its
    /// holder.
    pub(crate) fn loss_reason(&self) -> Option<LossReason> {
        if let Some(reason) = self.loss.get() {
            return Some(*reason);
        }
        let sched = self.sched();
        if sched.machine.release_requested() {
            return None;
        }
        if self.backend_lost.is_cancelled() {
            return Some(LossReason::SessionEnded);
        }
        sched
            .machine
            .time_loss(Instant::now())
            .map(|loss| self.time_loss_reason(loss))
    }

    /// Wakes a release waiting for the renewal on the wire.
    pub(crate) fn renewal_settled(&self) {
        self.renewal_settled.notify_waiters();
    }

    /// Adds a nested hold; false if the lease is already lost or on its way out.
    pub(crate) fn add_nested_hold(&self) -> bool {
        self.nested_holds.fetch_add(1, Ordering::AcqRel);
        if self.is_lost() {
            self.drop_nested_hold();
            return false;
        }
        true
    }

    /// Ends a nested hold.
    pub(crate) fn drop_nested_hold(&self) {
        self.nested_holds.fetch_sub(1, Ordering::AcqRel);
    }

    /// Asks for the release: final, synchronous, before any `.await`. Takes
    /// the lease off the schedule, so no renewal is begun again. `None` if it
    /// was asked for already.
    fn request_release(&self) -> Option<(ReleaseStart, Releasing)> {
        let (start, counted, slot) = {
            let mut sched = self.sched();
            let start = sched.machine.request_release(Instant::now())?;
            // Counted under the lease's lock: shutdown never sees the phase
            // changed but the release not yet counted.
            let counted = Releasing::new(&self.leases);
            (start, counted, sched.slot.take())
        };
        // Why it ended: a loss recorded, the backend's own report, time; or
        // released while held (also a key whose hold lost another key).
        let now = Instant::now();
        let reason = self.loss.get().copied().or_else(|| {
            if self.backend_lost.is_cancelled() {
                Some(LossReason::SessionEnded)
            } else {
                let loss = self.sched().machine.time_loss(now);
                loss.map(|loss| self.time_loss_reason(loss))
            }
        });
        match reason {
            Some(reason) if start.was_lost || self.backend_lost.is_cancelled() => {
                self.signal_lost(reason);
            }
            _ => self.count_released(),
        }
        if let Some(slot) = slot {
            self.watchdog.unschedule(slot, self.id);
        }
        tracing::trace!(
            parent: &self.span,
            key = %self.user_key,
            token = self.lease.token.map(FencingToken::get),
            "dlock release requested"
        );
        Some((start, counted))
    }

    /// Releases the lease and says how it went. Cancel-safe: once called, the
    /// release is carried out even if the caller's future is dropped at any
    /// `.await` (it then finishes on dlock's I/O runtime).
    pub(crate) async fn release(self: Arc<Self>) -> Result<(), LockError> {
        let Some((start, counted)) = self.request_release() else {
            return self.release_outcome_when_asked_already();
        };
        if self.backend.needs_io_runtime() {
            // A spawned task goes on when the caller stops waiting.
            return crate::driver::run(async move {
                let outcome = self.send_release(start).await;
                drop(counted);
                outcome
            })
            .await;
        }
        let fallback = FinishInBackground {
            held: Some((self.clone(), start, counted)),
        };
        let outcome = self.send_release(start).await;
        fallback.finished();
        outcome
    }

    /// Releases the lease without waiting (from `Drop`, from shutdown).
    pub(crate) fn release_in_background(self: Arc<Self>) {
        if let Some((start, counted)) = self.request_release() {
            counted.spawn(async move {
                let _ = self.send_release(start).await;
            });
        }
    }

    fn release_outcome_when_asked_already(&self) -> Result<(), LockError> {
        if self.is_lost() {
            Err(LockError::Lost {
                key: self.user_key.clone(),
            })
        } else {
            Ok(())
        }
    }

    /// The lease ends without a body having run under it: its release frees
    /// the key at once, whatever `hold_at_least` says.
    pub(crate) fn waive_hold_at_least(&self) {
        self.no_body.store(true, Ordering::Release);
    }

    /// Frees the key at once — or, with `hold_at_least`, waits for a renewal
    /// still on the wire and lets the key expire that long from now. A plain
    /// release need not wait: renewals are owner-checked, so one that lands
    /// after the key was freed is a no-op. The wait ends at this lease's
    /// give-up instant at the latest (the lease is lost by then, and the
    /// renewal may share a batch whose time limit is a longer lease's).
    async fn send_release(self: Arc<Self>, start: ReleaseStart) -> Result<(), LockError> {
        let give_up = self.sched().machine.give_up_at();
        // No minimum for a hold no body ran under, nor for one already lost
        // (its ceiling reached, revoked, expired): extending it would keep
        // the key past what ended it.
        let hold_at_least = self
            .hold_at_least
            .filter(|_| !self.no_body.load(Ordering::Acquire) && !self.lost.is_cancelled());
        while hold_at_least.is_some() && self.sched().machine.renewal_in_flight() {
            let settled = self.renewal_settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if !self.sched().machine.renewal_in_flight() {
                break;
            }
            if tokio::time::timeout_at(give_up.into(), settled)
                .await
                .is_err()
            {
                break;
            }
        }
        let held_for = self.acquired_at.elapsed();
        self.span.record("held_ms", held_for.as_secs_f64() * 1000.0);
        let outcome: Result<(), BackendError> = match hold_at_least {
            Some(at_least) => match self.backend.renew(&self.lease, at_least).await {
                Ok(Renewal::Renewed) => Ok(()),
                Ok(_) => {
                    self.sched().machine.mark_lost();
                    self.signal_lost(LossReason::Gone);
                    Ok(())
                }
                Err(err) => Err(err),
            },
            None => self.backend.release(&self.lease).await,
        };
        if self.sched().machine.finish_release() {
            self.leases.forget(self.id);
        }
        let lost = start.was_lost || self.lost.is_cancelled();
        if self.nested_holds.load(Ordering::Acquire) > 0 {
            // Nested guards that outlived their outer one learn that the
            // lease is gone (their `lost()` resolves).
            self.lost.cancel();
        }
        match outcome {
            Ok(()) if lost => {
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

/// If the caller drops an inline release before it has finished, the release
/// is sent again from dlock's I/O runtime (owner-checked, so a release that
/// did reach the server makes the second one a no-op).
struct FinishInBackground {
    held: Option<(Arc<HeldLease>, ReleaseStart, Releasing)>,
}

impl FinishInBackground {
    /// The inline release has finished: nothing is left to send.
    fn finished(mut self) {
        self.held = None;
    }
}

impl Drop for FinishInBackground {
    fn drop(&mut self) {
        if let Some((held, start, counted)) = self.held.take() {
            counted.spawn(async move {
                let _ = held.send_release(start).await;
            });
        }
    }
}
