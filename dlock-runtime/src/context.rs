//! What the current task holds: [`current()`] and reentrancy.
//!
//! Held locks are kept in a task-local stack that `#[distributed_lock]` (and
//! [`LockGuard::scope`](crate::LockGuard::scope)) push for the duration of the
//! body. A nested acquisition of the same key on the same backend of the same
//! registry finds it there and adds a hold instead of waiting for itself.

use std::future::Future;
use std::sync::Arc;

use tokio_util::sync::WaitForCancellationFutureOwned;

use crate::lock::held::HeldLease;
use crate::token::FencingToken;

tokio::task_local! {
    static HELD: Stack;
}

#[derive(Clone, Default)]
struct Stack(Vec<Arc<HeldLease>>);

/// Runs `future` with `lease` on top of this task's stack of held locks.
pub(crate) fn scope<F: Future>(
    lease: Arc<HeldLease>,
    future: F,
) -> impl Future<Output = F::Output> {
    let mut stack = HELD.try_with(Stack::clone).unwrap_or_default();
    stack.0.push(lease);
    HELD.scope(stack, future)
}

/// The held lease of this task for this registry, backend and stored key.
pub(crate) fn find(registry_id: u64, backend: &str, key: &str) -> Option<Arc<HeldLease>> {
    HELD.try_with(|stack| {
        stack
            .0
            .iter()
            .rev()
            .find(|l| {
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
    HELD.try_with(|stack| stack.0.last().cloned())
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

    /// The fencing token of this acquisition; `None` only on backends without a
    /// safe token (Redlock).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.held.fencing_token()
    }

    /// Whether the lease is known to be lost.
    pub fn is_lost(&self) -> bool {
        self.held.is_lost()
    }

    /// Resolves when the lease is lost (never, if it is released first).
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.held.lost.clone().cancelled_owned()
    }
}
