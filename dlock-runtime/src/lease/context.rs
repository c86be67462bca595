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
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::held::HeldLease;
use super::loss::LossReason;
use crate::token::FencingToken;

tokio::task_local! {
    static HELD: Stack;
}

#[derive(Clone, Default)]
struct Stack(Vec<Frame>);

/// One scope in which a hold (one lease per key, canonical order) is held,
/// and the gate its nested holders pass one at a time.
#[derive(Clone)]
pub(crate) struct Frame {
    pub(crate) hold: Hold,
    pub(crate) gate: Arc<Semaphore>,
}

/// The leases of one hold (one per key, canonical order) and its loss signal:
/// cancelled when any of them is lost.
#[derive(Clone)]
pub(crate) struct Hold {
    pub(crate) leases: Arc<[Arc<HeldLease>]>,
    pub(crate) lost: CancellationToken,
}

/// A key held further up this call chain: the lease holding it and the gate
/// of the frame it was found in, with that frame's depth in the stack.
#[derive(Clone)]
pub(crate) struct Found {
    pub(crate) lease: Arc<HeldLease>,
    pub(crate) gate: Arc<Semaphore>,
    pub(crate) depth: usize,
}

/// Runs `future` with `hold` on top of this task's stack of held locks;
/// nested acquisitions inside pass `gate` (the holding guard's) one at a time.
pub(crate) fn scope<F: Future>(
    hold: Hold,
    gate: Arc<Semaphore>,
    future: F,
) -> impl Future<Output = F::Output> {
    let mut stack = HELD.try_with(Stack::clone).unwrap_or_default();
    stack.0.push(Frame { hold, gate });
    HELD.scope(stack, future)
}

/// The innermost frame of this task holding this registry's backend's stored key.
pub(crate) fn find(registry_id: u64, backend: &str, key: &str) -> Option<Found> {
    HELD.try_with(|stack| {
        stack.0.iter().enumerate().rev().find_map(|(depth, f)| {
            f.hold
                .leases
                .iter()
                .find(|l| {
                    l.registry_id == registry_id
                        && &*l.backend_name == backend
                        && l.lease.key == key
                })
                .map(|lease| Found {
                    lease: lease.clone(),
                    gate: f.gate.clone(),
                    depth,
                })
        })
    })
    .ok()
    .flatten()
}

/// The lock [`token_for`] chose: its key, its backend's name, its token.
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]
pub(crate) struct TokenFor {
    pub(crate) key: String,
    pub(crate) backend: String,
    pub(crate) token: Option<FencingToken>,
}

/// The token a fenced write to `resource` from this task uses: `None`
/// outside any held scope. The lock whose key is `resource` (innermost
/// first; one key of a hold of several), else the innermost hold's first
/// key. `Err(Lost)` when another hold of the call chain than the one giving
/// the token is known lost — a holder whose outer lease ran out must not
/// write with the newer token of a lock it took inside (a lost lock giving
/// the token itself is left to the fence, which refuses it once a newer
/// holder wrote).
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]
pub(crate) fn token_for(resource: &str) -> Option<Result<TokenFor, crate::LockError>> {
    HELD.try_with(|stack| {
        let frames = &stack.0;
        let innermost = frames.len().checked_sub(1)?;
        let (depth, lease) = frames
            .iter()
            .enumerate()
            .rev()
            .find_map(|(depth, f)| {
                f.hold
                    .leases
                    .iter()
                    .find(|l| l.user_key == resource)
                    .map(|l| (depth, l))
            })
            .unwrap_or((innermost, &frames[innermost].hold.leases[0]));
        let giver = &frames[depth].hold;
        if let Some(lost) = frames
            .iter()
            .map(|f| &f.hold)
            .find(|h| !Arc::ptr_eq(&h.leases, &giver.leases) && h.is_lost())
        {
            return Some(Err(crate::LockError::Lost {
                key: lost.lost_key().to_owned(),
            }));
        }
        Some(Ok(TokenFor {
            key: lease.user_key.clone(),
            backend: lease.backend_name.to_string(),
            token: lease.fencing_token(),
        }))
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
    HELD.try_with(|stack| stack.0.last().map(|f| f.hold.clone()))
        .ok()
        .flatten()
        .map(|hold| CurrentLock { hold })
}

/// A lock held by the current task; see [`current()`].
#[derive(Clone)]
pub struct CurrentLock {
    hold: Hold,
}

impl Hold {
    /// Why the hold was lost: the reason of its first lease known lost.
    pub(crate) fn loss_reason(&self) -> Option<LossReason> {
        self.leases.iter().find_map(|l| l.loss_reason())
    }

    /// Whether the hold's loss was signalled or any of its leases is known lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled() || self.leases.iter().any(|l| l.is_lost())
    }

    /// The key to name in a loss: the first one whose own loss was
    /// signalled, else the first known lost, else the first.
    pub(crate) fn lost_key(&self) -> &str {
        let lost = self
            .leases
            .iter()
            .find(|l| l.lost_itself())
            .or_else(|| self.leases.iter().find(|l| l.is_lost()));
        &lost.unwrap_or(&self.leases[0]).user_key
    }
}

impl std::fmt::Debug for CurrentLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CurrentLock")
            .field("keys", &self.keys())
            .field("backend", &self.backend())
            .field("fencing_token", &self.fencing_token())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl CurrentLock {
    fn first(&self) -> &HeldLease {
        &self.hold.leases[0]
    }

    /// The key as written in the attribute or passed to [`lock`](crate::lock());
    /// for several keys, the first of [`keys`](CurrentLock::keys).
    pub fn key(&self) -> &str {
        &self.first().user_key
    }

    /// Every key of the hold as the user wrote it, in canonical order (sorted
    /// by their bytes, without duplicates); one key for a plain lock.
    pub fn keys(&self) -> Vec<String> {
        self.hold
            .leases
            .iter()
            .map(|l| l.user_key.clone())
            .collect()
    }

    /// The fencing token of one key of the hold; `None` if the hold does not
    /// have that key, or on backends without a safe token (Redlock).
    pub fn fencing_token_of(&self, key: &str) -> Option<FencingToken> {
        self.hold
            .leases
            .iter()
            .find(|l| l.user_key == key)
            .and_then(|l| l.fencing_token())
    }

    /// The backend's name in the registry (`"default"` for the default backend).
    pub fn backend(&self) -> &str {
        &self.first().backend_name
    }

    /// The fencing token of this acquisition (for several keys, the first
    /// key's); `None` for a hold taken without one
    /// ([`fencing(false)`](crate::LockBuilder::fencing), `fencing = false`, a
    /// `?fencing=off` Redis backend) and on backends without a safe token
    /// (Redlock).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.first().fencing_token()
    }

    /// The semaphore slot of the innermost hold (`0..permits`); `None` for a
    /// plain or read-write lock.
    pub fn permit(&self) -> Option<u32> {
        self.first().lease.slot
    }

    /// Whether the lease is known to be lost (also once its local give-up
    /// instant has passed, before the watchdog has looked); for several keys,
    /// whether any of them is.
    pub fn is_lost(&self) -> bool {
        self.hold.is_lost()
    }

    /// Why the lease (for several keys, the first of them lost) was lost;
    /// `None` while it is held. See [`LossReason`].
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.hold.loss_reason()
    }

    /// Resolves when the lease (for several keys, any of them) is lost
    /// (never, if it is released first).
    pub fn lost(&self) -> WaitForCancellationFutureOwned {
        self.hold.lost.clone().cancelled_owned()
    }
}
