//! What the current task holds: [`current()`] and reentrancy.
//!
//! Held locks are kept in a task-local stack of **frames** that
//! `#[distributed_lock]` (and [`LockGuard::scope`](crate::LockGuard::scope))
//! push for the duration of a body. Reentrancy is for a *call chain*: a
//! nested acquisition of the same key (same registry, backend and stored key)
//! finds the innermost frame holding it and takes that frame's **gate**, a
//! one-permit semaphore belonging to the guard whose scope it is (shared by
//! all of that guard's scopes). The first nested holder enters at once; the
//! code it runs in its own scope pushes a new frame (with its own guard's
//! gate), so its own nested calls enter at once too. Sibling futures polled inside one
//! scope — `join!`, `select!`, `FuturesUnordered`, a future built elsewhere
//! and awaited inside — all see the same frame, so they take turns at its
//! gate, each within its own `wait`: they never share the hold.
//!
//! A task spawned inside a body starts with an empty stack: it does not
//! inherit the hold.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::held::HeldLease;
use crate::token::FencingToken;

tokio::task_local! {
    static HELD: Stack;
}

#[derive(Clone, Default)]
struct Stack(Vec<Frame>);

/// One scope in which a lease is held, and the gate its nested holders pass one at a time.
#[derive(Clone)]
pub(crate) struct Frame {
    pub(crate) lease: Arc<HeldLease>,
    pub(crate) gate: Arc<Semaphore>,
}

/// Runs `future` with `lease` on top of this task's stack of held locks;
/// nested acquisitions inside pass `gate` (the holding guard's) one at a time.
pub(crate) fn scope<F: Future>(
    lease: Arc<HeldLease>,
    gate: Arc<Semaphore>,
    future: F,
) -> impl Future<Output = F::Output> {
    let mut stack = HELD.try_with(Stack::clone).unwrap_or_default();
    stack.0.push(Frame { lease, gate });
    HELD.scope(stack, future)
}

/// The innermost frame of this task holding this registry's backend's stored key.
pub(crate) fn find(registry_id: u64, backend: &str, key: &str) -> Option<Frame> {
    HELD.try_with(|stack| {
        stack
            .0
            .iter()
            .rev()
            .find(|f| {
                let l = &f.lease;
                l.registry_id == registry_id && &*l.backend_name == backend && l.lease.key == key
            })
            .cloned()
    })
    .ok()
    .flatten()
}

/// The innermost lock held by the current task inside a `#[distributed_lock]`
/// function (or a [`LockGuard::scope`](crate::LockGuard::scope)), if any.
///
/// ```no_run
/// # use dlock_runtime::distributed_lock;
/// # #[derive(Debug)] struct E;
/// # impl From<dlock_runtime::LockError> for E { fn from(_: dlock_runtime::LockError) -> E { E } }
/// #[distributed_lock(key = "report:{day}")]
/// async fn build_report(day: u32) -> Result<(), E> {
///     let lock = dlock_runtime::current().expect("inside the lock");
///     let token: u64 = lock.fencing_token().expect("this backend fences").into();
///     // write with `token`, so that a stale holder's writes are refused
///     # let _ = token;
///     Ok(())
/// }
/// ```
pub fn current() -> Option<CurrentLock> {
    HELD.try_with(|stack| stack.0.last().map(|f| f.lease.clone()))
        .ok()
        .flatten()
        .map(|held| CurrentLock { held })
}

/// A lock held by the current task; see [`current()`].
#[derive(Clone)]
pub struct CurrentLock {
    held: Arc<HeldLease>,
}

impl std::fmt::Debug for CurrentLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CurrentLock")
            .field("key", &self.key())
            .field("backend", &self.backend())
            .field("fencing_token", &self.fencing_token())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl CurrentLock {
    /// The key as written in the attribute or passed to [`lock`](crate::lock()).
    pub fn key(&self) -> &str {
        &self.held.user_key
    }

    /// The backend's name in the registry (`"default"` for the default backend).
    pub fn backend(&self) -> &str {
        &self.held.backend_name
    }

    /// The fencing token of this acquisition; `None` for a hold taken without
    /// one ([`fencing(false)`](crate::LockBuilder::fencing), `fencing = false`,
    /// a `?fencing=off` Redis backend) and on backends without a safe token
    /// (Redlock).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.held.fencing_token()
    }

    /// Whether the lease is known to be lost (also once its local give-up
    /// instant has passed, before the watchdog has looked).
    pub fn is_lost(&self) -> bool {
        self.held.is_lost()
    }

    /// Resolves when the lease is lost (never, if it is released first).
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.held.lost.clone().cancelled_owned()
    }
}
