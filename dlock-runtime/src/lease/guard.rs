//! The guard of a held lock.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tracing::Instrument;

use super::held::HeldLease;
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
    held: Option<Arc<HeldLease>>,
    /// For a nested hold: its turn at the gate of the scope it entered.
    nested: Option<OwnedSemaphorePermit>,
    /// The gate of this guard's scopes: nested acquisitions inside them pass
    /// it one at a time (siblings take turns, across all of this guard's
    /// scopes). Made by the first `scope`.
    gate: OnceLock<Arc<Semaphore>>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LockGuard");
        if let Some(held) = &self.held {
            d.field("key", &held.user_key)
                .field("backend", &held.backend_name)
                .field("fencing_token", &held.fencing_token())
                .field("nested", &self.nested.is_some())
                .field("lost", &held.is_lost());
        }
        d.finish()
    }
}

impl LockGuard {
    pub(super) fn new(held: Arc<HeldLease>, nested: Option<OwnedSemaphorePermit>) -> Self {
        LockGuard {
            held: Some(held),
            nested,
            gate: OnceLock::new(),
        }
    }

    fn held(&self) -> &Arc<HeldLease> {
        self.held
            .as_ref()
            .expect("LockGuard is only emptied by release or drop")
    }

    /// The key as given to [`lock`](crate::lock()) (without the registry's prefix).
    pub fn key(&self) -> &str {
        &self.held().user_key
    }

    /// The fencing token of this acquisition: strictly greater than every token
    /// handed out for this key before. `None` for a hold taken with
    /// [`fencing(false)`](crate::LockBuilder::fencing) (or `fencing = false`, or
    /// on a `?fencing=off` Redis backend), and on backends without a safe token
    /// (Redlock).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.held().fencing_token()
    }

    /// Whether the lease is known to be lost: reported lost, or past the
    /// instant at which its holder must give it up (before the server's
    /// expiry) without a renewal — even before the watchdog has looked.
    pub fn is_lost(&self) -> bool {
        self.held().is_lost()
    }

    /// Resolves when the lease is lost: it expired, the watchdog could not renew
    /// it in time, or the backend reported it gone. Never resolves if the lock is
    /// released first. The future owns what it needs (`'static`).
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.held().lost.clone().cancelled_owned()
    }

    /// Runs `future` with this lock visible to [`current()`](crate::current())
    /// and reentrant for the call chain it runs: a function it calls that locks
    /// the same key enters at once. Futures polled concurrently inside it
    /// (`join!`, `select!`) are not one call chain: they take turns.
    ///
    /// A nested guard (one taken inside a scope that holds its key) holds its
    /// turn until it is released: code that should run *under* it must run in
    /// its own `scope`, or it waits for that turn like a sibling.
    pub fn scope<F: Future>(&self, future: F) -> impl Future<Output = F::Output> {
        let held = self.held().clone();
        let span = held.span.clone();
        let gate = self
            .gate
            .get_or_init(|| Arc::new(Semaphore::new(1)))
            .clone();
        super::context::scope(held, gate, future.instrument(span))
    }

    /// Releases the lock now (or, with `hold_at_least`, lets it expire then) and
    /// reports how it went: `Err(LockError::Lost)` if the lease had been lost
    /// while held — the protected work may have overlapped with another holder's.
    /// Releasing a nested hold only ends that hold (and reports `Lost` if the
    /// shared lease was lost, or released by its outer holder first). The
    /// outer guard's release always releases: a nested guard that outlives
    /// it protects nothing any more.
    ///
    /// Cancel-safe: once called, the release happens even if this future is
    /// dropped before it completes (a timeout around it, a disconnected
    /// client) — no renewal is sent for the lease again.
    pub async fn release(mut self) -> Result<(), LockError> {
        let held = self.held.take().expect("not yet released");
        if self.nested.take().is_some() {
            held.drop_nested_hold();
            return if held.is_lost() {
                Err(LockError::Lost {
                    key: held.user_key.clone(),
                })
            } else {
                Ok(())
            };
        }
        held.release().await
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        if self.nested.take().is_some() {
            held.drop_nested_hold();
        } else {
            // Cannot await here (a panic unwinds, a future is cancelled):
            // hand the release to the I/O runtime, without blocking.
            held.release_in_background();
        }
    }
}
