//! The guard of a held lock.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::{DropGuard, WaitForCancellationFutureOwned};
use tracing::Instrument;

use super::context::Hold;
use super::held::HeldLease;
use super::loss::LossReason;
use crate::error::LockError;
use crate::token::FencingToken;

/// A held lock. Dropping it releases the lock in the background; prefer
/// [`release`](LockGuard::release) where you can await, to see errors.
///
/// A guard taken inside a scope that already holds the same key (see
/// [`scope`](LockGuard::scope)) is a **nested** hold: it shares the outer
/// lease — its watchdog, its fencing token and its `hold_at_least` — and the
/// `lease`, `watchdog` and `hold_at_least` it was asked with do not apply (a
/// `debug` event says so when they differ).
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    /// The leases held (one per key, canonical order) and the hold's loss
    /// signal; `None` once released.
    hold: Option<Hold>,
    /// For a nested hold: its turns at the gates of the scopes it entered.
    nested: Option<Vec<OwnedSemaphorePermit>>,
    /// The gate of this guard's scopes: nested acquisitions inside them pass
    /// it one at a time (siblings take turns, across all of this guard's
    /// scopes). Made by the first `scope`.
    gate: OnceLock<Arc<Semaphore>>,
    /// For a nested hold over the leases of several scopes: stops the task
    /// that joins their loss signals into the hold's.
    _joined_loss: Option<DropGuard>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LockGuard");
        if let Some(hold) = &self.hold {
            let first = &hold.leases[0];
            d.field("keys", &self.keys())
                .field("backend", &first.backend_name)
                .field("fencing_token", &first.fencing_token())
                .field("nested", &self.nested.is_some())
                .field("lost", &hold.is_lost());
        }
        d.finish()
    }
}

impl LockGuard {
    pub(super) fn new(held: Arc<HeldLease>, nested: Option<OwnedSemaphorePermit>) -> Self {
        let lost = held.lost.clone();
        LockGuard::of_hold(
            Hold {
                leases: Arc::from([held]),
                lost,
            },
            nested.map(|permit| vec![permit]),
            None,
        )
    }

    pub(super) fn of_hold(
        hold: Hold,
        nested: Option<Vec<OwnedSemaphorePermit>>,
        joined_loss: Option<DropGuard>,
    ) -> Self {
        LockGuard {
            hold: Some(hold),
            nested,
            gate: OnceLock::new(),
            _joined_loss: joined_loss,
        }
    }

    /// The lease of an outer single-key guard, taken out of it (the guard is
    /// then empty: its drop releases nothing).
    pub(super) fn into_lease(mut self) -> Arc<HeldLease> {
        let hold = self.hold.take().expect("not yet released");
        debug_assert!(self.nested.is_none() && hold.leases.len() == 1);
        hold.leases[0].clone()
    }

    /// A hold no body ran under (a hold of several keys given up while it
    /// was being built): its release frees every key at once, whatever
    /// `hold_at_least` says.
    pub(super) fn waive_hold_at_least(&self) {
        for lease in self.hold().leases.iter() {
            lease.waive_hold_at_least();
        }
    }

    fn hold(&self) -> &Hold {
        self.hold
            .as_ref()
            .expect("LockGuard is only emptied by release or drop")
    }

    fn first(&self) -> &HeldLease {
        &self.hold().leases[0]
    }

    /// The key as given to [`lock`](crate::lock()) (without the registry's
    /// prefix); for several keys, the first of [`keys`](LockGuard::keys).
    pub fn key(&self) -> &str {
        &self.first().user_key
    }

    /// Every key of the hold as given (without the registry's prefix), in
    /// canonical order: sorted by their bytes, without duplicates. One key
    /// for a guard of [`lock`](crate::lock()).
    pub fn keys(&self) -> Vec<String> {
        self.hold()
            .leases
            .iter()
            .map(|l| l.user_key.clone())
            .collect()
    }

    /// The fencing token of this acquisition: strictly greater than every token
    /// handed out for this key before. For several keys, the first key's (see
    /// [`fencing_token_of`](LockGuard::fencing_token_of)). `None` for a hold
    /// taken with [`fencing(false)`](crate::LockBuilder::fencing) (or `fencing =
    /// false`, or on a `?fencing=off` Redis backend), and on backends without a
    /// safe token (Redlock).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.first().fencing_token()
    }

    /// The semaphore slot this hold took (`0..permits`, see
    /// [`LockBuilder::permits`](crate::LockBuilder::permits)); `None` for a
    /// plain or read-write lock. For several keys, the first key's.
    pub fn permit(&self) -> Option<u32> {
        self.first().lease.slot
    }

    /// The fencing token of one key of the hold; `None` if the hold does not
    /// have that key, or on backends without a safe token (Redlock).
    pub fn fencing_token_of(&self, key: &str) -> Option<FencingToken> {
        self.hold()
            .leases
            .iter()
            .find(|l| l.user_key == key)
            .and_then(|l| l.fencing_token())
    }

    /// The key to name in a loss: the first lost one, else the first.
    pub(crate) fn lost_key(&self) -> &str {
        self.hold().lost_key()
    }

    /// Whether the loss of one of this guard's own leases was signalled.
    pub(super) fn lost_itself(&self) -> bool {
        self.hold().leases.iter().any(|l| l.lost_itself())
    }

    /// Whether the lease is known to be lost: reported lost, or past the
    /// instant at which its holder must give it up (before the server's
    /// expiry) without a renewal — even before the watchdog has looked. For
    /// several keys: whether any of them is.
    pub fn is_lost(&self) -> bool {
        self.hold().is_lost()
    }

    /// Why the lease (for several keys, the first of them lost) was lost:
    /// `None` while it is held. Known as soon as [`is_lost`](LockGuard::is_lost)
    /// is true. A nested hold whose outer holder released the lease first
    /// has none.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.hold().loss_reason()
    }

    /// Resolves when the lease is lost: it expired, the watchdog could not renew
    /// it in time, or the backend reported it gone; for several keys, when any
    /// of them is. Never resolves if the lock is released first. The future
    /// owns what it needs (`'static`).
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.hold().lost.clone().cancelled_owned()
    }

    /// Runs `future` with this lock visible to [`current()`](crate::current())
    /// and reentrant for the call chain it runs: a function it calls that locks
    /// the same key (or keys) enters at once. Futures polled concurrently inside it
    /// (`join!`, `select!`) are not one call chain: they take turns.
    ///
    /// A nested guard (one taken inside a scope that holds its key) holds its
    /// turn until it is released: code that should run *under* it must run in
    /// its own `scope`, or it waits for that turn like a sibling.
    pub fn scope<F: Future>(&self, future: F) -> impl Future<Output = F::Output> {
        let hold = self.hold().clone();
        let span = hold.leases[0].span.clone();
        let gate = self
            .gate
            .get_or_init(|| Arc::new(Semaphore::new(1)))
            .clone();
        super::context::scope(hold, gate, future.instrument(span))
    }

    /// Releases the lock now (or, with `hold_at_least`, lets it expire then) and
    /// reports how it went: `Err(LockError::Lost)` if the lease had been lost
    /// while held — the protected work may have overlapped with another holder's.
    /// Releasing a nested hold only ends that hold (and reports `Lost` if the
    /// shared lease was lost, or released by its outer holder first). The
    /// outer guard's release always releases: a nested guard that outlives
    /// it protects nothing any more. For several keys, every key is released
    /// (at the same time) and the first error is reported.
    ///
    /// Cancel-safe: once called, the release happens even if this future is
    /// dropped before it completes (a timeout around it, a disconnected
    /// client) — no renewal is sent for the lease again.
    pub async fn release(mut self) -> Result<(), LockError> {
        let hold = self.hold.take().expect("not yet released");
        if self.nested.take().is_some() {
            for lease in hold.leases.iter() {
                lease.drop_nested_hold();
            }
            return if hold.is_lost() {
                Err(LockError::Lost {
                    key: hold.lost_key().to_owned(),
                })
            } else {
                Ok(())
            };
        }
        if let [lease] = &*hold.leases {
            return lease.clone().release().await;
        }
        // Every release is asked for even if this future is dropped before
        // it polls them all.
        let _rest = ReleaseInBackground(hold.leases.clone());
        let outcomes =
            futures_util::future::join_all(hold.leases.iter().map(|l| l.clone().release())).await;
        outcomes.into_iter().collect()
    }
}

/// Releases in the background, on drop, the leases whose release was not yet
/// asked for (a no-op for the others).
struct ReleaseInBackground(Arc<[Arc<HeldLease>]>);

impl Drop for ReleaseInBackground {
    fn drop(&mut self) {
        for lease in self.0.iter() {
            lease.clone().release_in_background();
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(hold) = self.hold.take() else {
            return;
        };
        if self.nested.take().is_some() {
            for lease in hold.leases.iter() {
                lease.drop_nested_hold();
            }
        } else {
            // Cannot await here (a panic unwinds, a future is cancelled):
            // hand the release to the I/O runtime, without blocking.
            drop(ReleaseInBackground(hold.leases));
        }
    }
}
