//! One renewal scheduler per registry. It only schedules: it never awaits a backend.
//!
//! Every held lease sits in one ordered schedule under the instant the
//! [state machine](super::state) says it is next due: a renewal, or its
//! give-up instant. The task sleeps until the earliest entry, then
//!
//! - declares lost, **at their give-up instant**, the leases not renewed by
//!   then — whether a renewal is still on the wire or not (time-driven loss:
//!   the holder hears of it before the server's expiry, even when the server
//!   hangs instead of answering);
//! - takes every renewal due within a short window and sends them, one
//!   [`renew_all`](crate::backend::LockBackend::renew_all) batch per backend,
//!   each batch in a task of its own: a stalled backend (or batch) delays no
//!   other lease's renewal or loss.
//!
//! A batch that does not answer by the latest give-up instant among its leases
//! is abandoned (its leases are lost by then anyway). Leases with
//! `watchdog = false` are never renewed; only their hard cap is scheduled.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::held::HeldLease;
use super::loss::LossReason;
use super::state::{Due, Finished, RenewalAnswer, RenewalTicket};
use crate::backend::Renewal;
use crate::token::FencingToken;

/// Renewals due within this window of now are sent in the same batch.
const BATCH_WINDOW: Duration = Duration::from_millis(10);

/// The task looks at its schedule at least this often, even with nothing due.
/// An entry due later than the next look is scheduled without waking the task:
/// then acquiring a lock of a few seconds or more never costs a cross-thread
/// wake-up, even when it is the only one held. An idle look also notices that
/// every handle is gone.
const IDLE_LOOK: Duration = Duration::from_secs(1);

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
    entries: BTreeMap<(Instant, u64), Entry>,
    /// When the task will look next (`None`: not before it is woken). An entry
    /// due later than this needs no wake-up.
    wakes_at: Option<Instant>,
}

#[derive(Debug)]
struct Entry {
    lease: Arc<HeldLease>,
    due: Due,
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

    /// Puts `lease` on the schedule where its state machine says it is due
    /// (moving it if it was elsewhere), or takes it off. Lock order: the
    /// lease's state, then the schedule — never the other way round.
    pub(crate) fn reschedule(&self, lease: &Arc<HeldLease>) {
        let mut sched = lease.sched();
        let due = sched.machine.due();
        if sched.slot == due.map(Due::at) {
            return;
        }
        let wake = {
            let mut schedule = self.shared.schedule();
            if let Some(old) = sched.slot.take() {
                schedule.entries.remove(&(old, lease.id));
            }
            let Some(due) = due else {
                return;
            };
            let at = due.at();
            schedule.entries.insert(
                (at, lease.id),
                Entry {
                    lease: lease.clone(),
                    due,
                },
            );
            sched.slot = Some(at);
            let wake = schedule.wakes_at.is_none_or(|next| at < next);
            if wake {
                schedule.wakes_at = Some(at);
            }
            wake
        };
        drop(sched);
        if wake {
            self.shared.wake.notify_one();
        }
    }

    /// Takes a lease off the schedule (its release was asked for).
    pub(crate) fn unschedule(&self, slot: Instant, id: u64) {
        self.shared.schedule().entries.remove(&(slot, id));
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
            while let Some(entry) = schedule.entries.first_entry() {
                let ready = match entry.get().due {
                    Due::Renew(at) => at <= now + BATCH_WINDOW,
                    // Never early: a loss is declared at its instant, not before.
                    Due::GiveUp(at) => at <= now,
                };
                if !ready {
                    break;
                }
                due.push(entry.remove());
            }
            let next = schedule.entries.keys().next().map(|(at, _)| *at);
            // Set under the lock that `reschedule` reads it under; a wake-up
            // sent between here and the wait below is kept by `Notify`.
            schedule.wakes_at = if due.is_empty() {
                Some(next.map_or(now + IDLE_LOOK, |at| at.min(now + IDLE_LOOK)))
            } else {
                Some(now)
            };
            (due, next)
        };
        if !due.is_empty() {
            look_at(&Watchdog { shared: strong }, due, now);
            continue;
        }
        let wake_handle = strong.wake.clone();
        let wake = wake_handle.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        // Hold only a weak reference while asleep, so that a dropped registry
        // with nothing scheduled lets this task end.
        let idle = next.is_none();
        let last_handle = Arc::strong_count(&strong) == 1;
        drop(strong);
        if idle && last_handle {
            return;
        }
        let at = next.map_or(now + IDLE_LOOK, |at| at.min(now + IDLE_LOOK));
        tokio::select! {
            () = tokio::time::sleep_until(at.into()) => {}
            () = &mut wake => {}
        }
    }
}

/// Loses the leases past their give-up instant, starts the due renewals (one
/// spawned batch per backend), and puts everything back where it is due next.
fn look_at(watchdog: &Watchdog, due: Vec<Entry>, now: Instant) {
    let mut batches: HashMap<usize, Vec<(Arc<HeldLease>, RenewalTicket)>> = HashMap::new();
    for Entry { lease, due } in due {
        let ticket = {
            let mut sched = lease.sched();
            if sched.slot == Some(due.at()) {
                sched.slot = None;
            }
            if let Some(loss) = sched.machine.expire(now) {
                drop(sched);
                lease.signal_lost(lease.time_loss_reason(loss));
                lease.renewal_settled();
                continue;
            }
            if lease.lost.is_cancelled() {
                // The backend reported the loss on its own (session expiry,
                // dead connection), or another key of the hold was lost.
                sched.machine.mark_lost();
                drop(sched);
                if lease.lost_itself() {
                    lease.note_loss(LossReason::SessionEnded);
                }
                None
            } else {
                sched.machine.begin_renewal(now, now + BATCH_WINDOW)
            }
        };
        watchdog.reschedule(&lease);
        if let Some(ticket) = ticket {
            batches
                .entry(Arc::as_ptr(&lease.backend) as *const () as usize)
                .or_default()
                .push((lease, ticket));
        }
    }
    for batch in batches.into_values() {
        tokio::spawn(renew_batch(watchdog.clone(), batch));
    }
}

/// One backend's due renewals, in one call; the answers go through the state machine.
async fn renew_batch(watchdog: Watchdog, leases: Vec<(Arc<HeldLease>, RenewalTicket)>) {
    // Commit each renewal under its lease's lock: one whose release was asked
    // for since `look_at` began it is dropped here, never sent.
    let leases: Vec<_> = leases
        .into_iter()
        .filter(|(lease, ticket)| {
            let mut sched = lease.sched();
            if sched.machine.commit_renewal(*ticket) {
                tracing::trace!(
                    parent: &lease.span,
                    key = %lease.user_key,
                    token = lease.lease.token.map(FencingToken::get),
                    "dlock renewal sent"
                );
                true
            } else {
                drop(sched);
                lease.renewal_settled();
                false
            }
        })
        .collect();
    if leases.is_empty() {
        return;
    }
    let backend = leases[0].0.backend.clone();
    let sent = leases[0].1.sent;
    // Past the latest give-up instant every lease of the batch is lost anyway.
    let give_up = leases
        .iter()
        .map(|(l, _)| l.sched().machine.give_up_at())
        .max()
        .unwrap_or(sent);
    let batch: Vec<_> = leases
        .iter()
        .map(|(l, _)| (&l.lease, l.lease_len))
        .collect();
    let answers = tokio::time::timeout_at(give_up.into(), backend.renew_all(&batch)).await;
    // Why a lease that a renewal's answer ends was lost.
    let mut gone = vec![LossReason::Expired; leases.len()];
    let answers: Vec<RenewalAnswer> = match answers {
        Ok(answers) if answers.len() == leases.len() => answers
            .into_iter()
            .zip(&leases)
            .zip(&mut gone)
            .map(|((answer, (lease, _)), gone)| match answer {
                Ok(Renewal::Renewed) => {
                    lease.site.renewal(true);
                    RenewalAnswer::Renewed {
                        drift: backend.drift(lease.lease_len),
                    }
                }
                Ok(Renewal::Revoked) => {
                    *gone = LossReason::Revoked;
                    RenewalAnswer::Lost
                }
                Ok(Renewal::Lost) => {
                    *gone = LossReason::Gone;
                    RenewalAnswer::Lost
                }
                Err(err) => {
                    lease.site.renewal(false);
                    tracing::warn!(
                        parent: &lease.span,
                        key = %lease.user_key,
                        error = %err,
                        "dlock renewal failed; retrying until the give-up instant"
                    );
                    RenewalAnswer::Failed
                }
            })
            .collect(),
        Ok(_) => {
            tracing::error!(
                backend = backend.kind(),
                "dlock backend answered a renewal batch with the wrong number of results"
            );
            leases.iter().for_each(|(l, _)| l.site.renewal(false));
            vec![RenewalAnswer::Failed; leases.len()]
        }
        Err(_) => {
            leases.iter().for_each(|(l, _)| l.site.renewal(false));
            vec![RenewalAnswer::Failed; leases.len()]
        }
    };
    drop(batch);
    let now = Instant::now();
    for (((lease, ticket), answer), gone) in leases.into_iter().zip(answers).zip(gone) {
        let finished = lease.sched().machine.finish_renewal(ticket, answer, now);
        match finished {
            Finished::Renewed => {
                tracing::trace!(
                    parent: &lease.span,
                    key = %lease.user_key,
                    token = lease.lease.token.map(FencingToken::get),
                    "dlock lease renewed"
                );
            }
            Finished::Lost => lease.signal_lost(match answer {
                RenewalAnswer::Lost => gone,
                _ => LossReason::Expired,
            }),
            Finished::Retry | Finished::Ignored => {}
        }
        watchdog.reschedule(&lease);
        lease.renewal_settled();
    }
}
