//! One renewal task per registry.
//!
//! Every held lease sits in one ordered schedule. The task sleeps until the
//! earliest due lease, takes every lease due within a short window, and renews
//! them per backend with one [`renew_all`](crate::backend::LockBackend::renew_all)
//! call (a pipeline or one statement where the backend can), instead of a timer
//! task per lock. A renewal that fails is retried until the lease is about to
//! end; then the lease is declared lost *before* it ends on the server, so the
//! holder hears of it in time. Leases with `watchdog = false` are never renewed;
//! the schedule only declares them lost when their hard cap arrives.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::backend::Renewal;
use crate::error::BackendError;
use crate::lock::held::{HeldLease, Phase};

/// Leases due within this window of the earliest are renewed in the same batch.
const BATCH_WINDOW: Duration = Duration::from_millis(10);

/// The task looks at its schedule at least this often, even with nothing due.
/// A lease due later than the next look is scheduled without waking the task:
/// then acquiring a lock of a few seconds or more never costs a cross-thread
/// wake-up, even when it is the only one held. An idle look also notices that
/// every handle is gone.
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// How often a held lease is renewed: a third of its length.
pub(crate) fn renew_period(lease: Duration) -> Duration {
    lease / 3
}

/// How long before the local bound of a lease it is declared lost when it could
/// not be renewed: a tenth of the lease, at most one second.
pub(crate) fn safety_margin(lease: Duration) -> Duration {
    (lease / 10).min(Duration::from_secs(1))
}

/// How soon a failed renewal is tried again.
fn retry_after(lease: Duration) -> Duration {
    (lease / 15).max(Duration::from_millis(5))
}

/// The handle held by a registry and by each lease.
#[derive(Debug, Clone)]
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    schedule: Mutex<Schedule>,
    wake: Arc<Notify>,
}

#[derive(Debug, Default)]
struct Schedule {
    leases: BTreeMap<(Instant, u64), Arc<HeldLease>>,
    /// When the task will look next (`None`: not before it is woken). A lease
    /// due later than this needs no wake-up.
    wakes_at: Option<Instant>,
}

impl Shared {
    fn schedule(&self) -> MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Watchdog {
    /// Starts the task on the I/O runtime. It ends once every handle is gone.
    pub(crate) fn start() -> Watchdog {
        let shared = Arc::new(Shared::default());
        crate::driver::handle().spawn(run(Arc::downgrade(&shared)));
        Watchdog { shared }
    }

    /// Puts a freshly acquired lease on the schedule.
    pub(crate) fn register(&self, lease: &Arc<HeldLease>) {
        let due = {
            let mut state = lease.state();
            let due = if lease.renew {
                lease.acquired_at + renew_period(lease.lease_len)
            } else {
                state
                    .valid_until
                    .checked_sub(safety_margin(lease.lease_len))
                    .unwrap_or(state.valid_until)
            };
            state.slot = Some(due);
            due
        };
        self.insert(due, lease.clone());
    }

    fn insert(&self, due: Instant, lease: Arc<HeldLease>) {
        let wake = {
            let mut schedule = self.shared.schedule();
            schedule.leases.insert((due, lease.id), lease);
            let wake = schedule.wakes_at.is_none_or(|at| due < at);
            if wake {
                schedule.wakes_at = Some(due);
            }
            wake
        };
        if wake {
            self.shared.wake.notify_one();
        }
    }

    /// Takes a released lease off the schedule.
    pub(crate) fn unschedule(&self, slot: Instant, id: u64) {
        self.shared.schedule().leases.remove(&(slot, id));
    }

    /// How many leases the watchdog looks after.
    pub(crate) fn len(&self) -> usize {
        self.shared.schedule().leases.len()
    }
}

async fn run(shared: Weak<Shared>) {
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        let (due, next) = {
            let mut schedule = strong.schedule();
            let mut due = Vec::new();
            while let Some(entry) = schedule.leases.first_entry() {
                if entry.key().0 > now + BATCH_WINDOW {
                    break;
                }
                due.push(entry.remove());
            }
            let next = schedule.leases.keys().next().map(|(at, _)| *at);
            // Set under the lock that `insert` reads it under; a wake-up sent
            // between here and the wait below is kept by `Notify` as a permit.
            schedule.wakes_at = if due.is_empty() {
                Some(next.map_or(now + IDLE_LOOK, |at| at.min(now + IDLE_LOOK)))
            } else {
                Some(now)
            };
            (due, next)
        };
        if !due.is_empty() {
            renew_due(&Watchdog { shared: strong }, due).await;
            continue;
        }
        let wake_handle = strong.wake.clone();
        let wake = wake_handle.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        // Hold only a weak reference while asleep, so that a dropped registry
        // with nothing scheduled lets this task end.
        let idle = next.is_none();
        let strong_count_before_sleep = Arc::strong_count(&strong);
        drop(strong);
        if idle && strong_count_before_sleep == 1 {
            return;
        }
        let at = next.map_or(now + IDLE_LOOK, |at| at.min(now + IDLE_LOOK));
        tokio::select! {
            () = tokio::time::sleep_until(at.into()) => {}
            () = &mut wake => {}
        }
    }
}

/// Renews (or expires) every due lease, one batch per backend, backends in parallel.
async fn renew_due(watchdog: &Watchdog, due: Vec<Arc<HeldLease>>) {
    let now = Instant::now();
    // Grouped by the backend object's address: one batch per backend.
    let mut by_backend: HashMap<usize, Vec<Arc<HeldLease>>> = HashMap::new();
    for lease in due {
        let mut state = lease.state();
        if state.phase != Phase::Held {
            continue;
        }
        state.slot = None;
        if !lease.renew {
            lease.mark_lost(
                &mut state,
                "the lease reached its hard cap (watchdog = false)",
            );
            drop(state);
            lease.notify_state_changed();
            continue;
        }
        if lease.is_lost() {
            // The backend reported the loss on its own (session expiry, dead connection).
            lease.mark_lost(&mut state, "the backend reported the lease lost");
            drop(state);
            lease.notify_state_changed();
            continue;
        }
        state.phase = Phase::Renewing;
        drop(state);
        by_backend
            .entry(Arc::as_ptr(&lease.backend) as *const () as usize)
            .or_default()
            .push(lease);
    }
    let batches = by_backend
        .into_values()
        .map(|leases| renew_batch(watchdog, leases, now));
    futures_util::future::join_all(batches).await;
}

async fn renew_batch(watchdog: &Watchdog, leases: Vec<Arc<HeldLease>>, started: Instant) {
    let backend = leases[0].backend.clone();
    // Give up on an answer once the first lease of the batch would have to be
    // declared lost anyway.
    let budget = leases
        .iter()
        .map(|l| {
            let deadline = l.state().valid_until;
            deadline
                .checked_sub(safety_margin(l.lease_len))
                .unwrap_or(deadline)
                .saturating_duration_since(started)
        })
        .min()
        .unwrap_or_default()
        .max(Duration::from_millis(5));
    let batch: Vec<_> = leases.iter().map(|l| (&l.lease, l.lease_len)).collect();
    let results = match tokio::time::timeout(budget, backend.renew_all(&batch)).await {
        Ok(results) if results.len() == leases.len() => results,
        Ok(_) => leases
            .iter()
            .map(|_| {
                Err(BackendError::permanent(
                    "backend answered a renewal batch with the wrong number of results",
                ))
            })
            .collect(),
        Err(_) => leases
            .iter()
            .map(|_| {
                Err(BackendError::transient(format!(
                    "renewal timed out after {budget:?}"
                )))
            })
            .collect(),
    };
    let now = Instant::now();
    for (lease, result) in leases.into_iter().zip(results) {
        let reschedule = {
            let mut state = lease.state();
            match result {
                Ok(Renewal::Renewed { valid_until }) => {
                    state.valid_until = valid_until;
                    state.phase = Phase::Held;
                    tracing::trace!(
                        parent: &lease.span,
                        key = %lease.user_key,
                        "dlock lease renewed"
                    );
                    let due = now + renew_period(lease.lease_len);
                    state.slot = Some(due);
                    Some(due)
                }
                Ok(Renewal::Lost) => {
                    lease.mark_lost(&mut state, "the key is no longer ours on the server");
                    None
                }
                Err(err) => {
                    let give_up_at = state
                        .valid_until
                        .checked_sub(safety_margin(lease.lease_len))
                        .unwrap_or(state.valid_until);
                    if now >= give_up_at {
                        lease.mark_lost(
                            &mut state,
                            &format!("renewals failed until the lease ran out: {err}"),
                        );
                        None
                    } else {
                        tracing::warn!(
                            parent: &lease.span,
                            key = %lease.user_key,
                            error = %err,
                            "dlock renewal failed; retrying"
                        );
                        state.phase = Phase::Held;
                        let due = (now + retry_after(lease.lease_len)).min(give_up_at);
                        state.slot = Some(due);
                        Some(due)
                    }
                }
            }
        };
        if let Some(due) = reschedule {
            watchdog.insert(due, lease.clone());
        }
        lease.notify_state_changed();
    }
}
