//! The wait loop of several keys taken in one step
//! ([`LockBackend::try_acquire_all`]): the single-key loop's rules, with
//! the whole step as the attempt. A busy answer names the busy key; the
//! waiter sleeps on that key's wake-up source (registered when the busy key
//! changes, then the step is tried again at once) and on that holder's
//! expiry, within one `wait` budget.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{
    ATTEMPT_GRACE, Armed, OwedWake, WakeSource, attempt_bound, busy_at_the_end, jitter, unanswered,
    unavailable_backoff, valid_until,
};
use crate::backend::{AcquireRequest, AttemptAll, Lease, LockBackend};
use crate::error::BackendError;
use crate::time::{give_up_at, saturating_add};

/// The answer of the several-key wait loop.
#[derive(Debug)]
pub(crate) enum AcquiredAll {
    /// Every key is ours, one lease per request; [`Lease::valid_until`] is set.
    Held(Vec<Lease>),
    /// The key of this index stayed busy until the wait budget ran out.
    Busy(usize),
}

/// Takes every key of `requests` in one step, waiting up to the first
/// request's `wait` (the requests share it, and their lease). `on_the_wire`
/// is true while a step is sent and not yet answered, as in
/// [`acquire_watched`](super::acquire_watched). The caller has checked that
/// the backend takes these keys in one step: an error if it does not.
pub(crate) async fn acquire_all_watched(
    backend: &dyn LockBackend,
    requests: &[AcquireRequest],
    on_the_wire: &AtomicBool,
) -> Result<AcquiredAll, BackendError> {
    let Some(first) = requests.first() else {
        return Ok(AcquiredAll::Held(Vec::new()));
    };
    let deadline = saturating_add(Instant::now(), first.wait);
    let drift = backend.drift(first.lease);
    // The wake-up source of the key last found busy, with its index.
    let mut source: Option<(usize, WakeSource)> = None;
    let mut busy_key = 0;
    let mut unavailable_streak = 0u32;
    let mut unanswered_before = false;
    let mut last_unavailable: Option<String> = None;
    let mut owed = OwedWake(None);
    let mut busy_before = false;
    loop {
        let armed = source.as_ref().map(|(_, s)| s.arm());
        let Some(step) = backend.try_acquire_all(requests) else {
            return Err(BackendError::permanent(format!(
                "{}: does not take these keys in one step",
                backend.kind()
            )));
        };
        let sent = Instant::now();
        on_the_wire.store(true, Ordering::SeqCst);
        // Bounded as the single key's attempt is: a silent server is an
        // error (or, for the last look after a busy answer, `Busy`) at most
        // `ATTEMPT_GRACE` after the deadline; `on_the_wire` stays set then,
        // so the caller undoes what the server may still grant.
        let attempt = match attempt_bound(first.wait, deadline) {
            None => step.await,
            Some(bound) => match tokio::time::timeout_at(bound.into(), step).await {
                Ok(attempt) => attempt,
                Err(_) if busy_at_the_end(busy_before, sent, deadline) => {
                    return Ok(AcquiredAll::Busy(busy_key));
                }
                Err(_) => {
                    let keys = requests.iter().map(|r| r.key.as_str()).collect::<Vec<_>>();
                    return Err(unanswered(
                        backend,
                        &keys.join(", "),
                        first.wait,
                        sent,
                        last_unavailable.as_deref(),
                    ));
                }
            },
        };
        on_the_wire.store(false, Ordering::SeqCst);
        let attempt = attempt?;
        busy_before = matches!(attempt, AttemptAll::Busy { .. });
        if !matches!(attempt, AttemptAll::Unavailable { .. }) {
            unavailable_streak = 0;
            last_unavailable = None;
        }
        let (retry_in, unavailable) = match attempt {
            AttemptAll::Held(mut leases) => {
                owed.settled();
                let until = valid_until(sent, first.lease, drift);
                for lease in &mut leases {
                    lease.valid_until = until;
                    lease.after_unanswered |= unanswered_before;
                }
                if Instant::now() < give_up_at(until, first.lease) {
                    return Ok(AcquiredAll::Held(leases));
                }
                // Too late to be used safely, as for a single key: undo it.
                let took = sent.elapsed();
                futures_util::future::join_all(leases.iter().map(|l| backend.release(l))).await;
                let late = BackendError::transient(format!(
                    "the backend granted the keys only after {took:?}, too late to use a {:?} lease",
                    first.lease
                ));
                (Some(Duration::ZERO), Some(late))
            }
            AttemptAll::Busy { key, retry_in } => {
                if source.as_ref().is_some_and(|(k, _)| *k != key) {
                    // Woken for a key that is not the busy one now: that
                    // wake-up goes on to the key's next waiter.
                    owed = OwedWake(None);
                }
                busy_key = key.min(requests.len() - 1);
                (retry_in, None)
            }
            AttemptAll::Unavailable { error, retry_in } => {
                unavailable_streak += 1;
                unanswered_before = true;
                last_unavailable = Some(error.to_string());
                (
                    Some(unavailable_backoff(retry_in, unavailable_streak)),
                    Some(error),
                )
            }
        };
        let now = Instant::now();
        if now >= deadline {
            let abandon =
                futures_util::future::join_all(requests.iter().map(|r| backend.abandon(r)));
            return match unavailable {
                Some(error) => {
                    // Bounded like an attempt: the runtime's release that
                    // follows every error frees whatever this leaves.
                    let bound = saturating_add(now, ATTEMPT_GRACE);
                    let _ = tokio::time::timeout_at(bound.into(), abandon).await;
                    Err(error)
                }
                None => {
                    abandon.await;
                    Ok(AcquiredAll::Busy(busy_key))
                }
            };
        }
        let registered = match &source {
            Some((key, registered)) if *key == busy_key || unavailable.is_some() => registered,
            _ => {
                // A new busy key: register its wake-up (the old one dropped
                // first: a backend may register the owner once), then try
                // again at once.
                drop(source.take());
                let wake = backend.wake_source(&requests[busy_key]);
                let registered = tokio::time::timeout_at(deadline.into(), wake)
                    .await
                    .unwrap_or_default();
                source = Some((busy_key, registered));
                continue;
            }
        };
        let mut sleep = retry_in.map(|d| d + jitter(d));
        if let Some(poll) = registered.poll {
            sleep = Some(sleep.map_or(poll, |s| s.min(poll)));
        }
        let wake_at = sleep.map_or(deadline, |s| deadline.min(saturating_add(now, s)));
        let armed = armed.unwrap_or(Armed(Vec::new()));
        tokio::select! {
            () = armed.fired() => owed.0 = Some(registered.notifies.clone()),
            () = tokio::time::sleep_until(wake_at.into()) => {}
        }
    }
}
