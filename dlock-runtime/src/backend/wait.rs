//! The one wait loop every backend shares, and the wake-up sources it sleeps on.
//!
//! A backend implements a single attempt ([`LockBackend::try_acquire`]) and
//! says what wakes its waiters ([`LockBackend::wake_source`]); [`acquire`]
//! does the rest, the same way for every backend:
//!
//! 1. try once; a grant is stamped with its local validity, measured from the
//!    instant *before* the request (minus the backend's drift), and a grant
//!    that comes back too late to be used safely is released and tried again;
//! 2. on the first busy answer, register the wake-up source, then try again at
//!    once (a release between the first try and the registration is not missed);
//! 3. sleep until the earliest of a wake-up, the holder's expiry (or the
//!    backend's back-off, with a little jitter), the polling interval and the
//!    deadline; repeat.
//!
//! An attempt the backend could not decide ([`Attempt::Unavailable`]: a
//! server down or restarting, too few Redlock nodes) is tried again with a
//! back-off that doubles from the backend's `retry_in` up to
//! [`UNAVAILABLE_BACKOFF_MAX`], until the server answers or the deadline
//! passes; only then is the backend's error the answer. A short outage is
//! ridden out within `wait`.
//!
//! **Each attempt is bounded by the caller's deadline**, so an unreachable
//! server (one that answers nothing, a black hole) is an error within
//! `wait`, not at the backend's own request timeout: an attempt still
//! unanswered [`ATTEMPT_GRACE`] after the deadline is dropped, and the
//! answer is the backend's error ([`BackendError::is_retryable`], as when
//! the budget runs out while the backend is unavailable). The grace is
//! there for a server that answers, slowly: an attempt sent just before
//! the deadline (a waiter woken then), or a first attempt that takes about
//! as long as a short `wait` on a loaded machine, still gets its answer
//! (a grant, or busy) rather than an error. A dropped attempt may still
//! run on the server: like every error of the loop, it is followed by the
//! runtime's owner-checked release (now and again after a backstop), which
//! undoes a grant or frees a queued entry; the loop does not wait for the
//! backend's [`abandon`](LockBackend::abandon) then, which could itself
//! wait for the silent server (and gives it at most [`ATTEMPT_GRACE`] when
//! the budget runs out while the backend is unavailable, for the same
//! reason). A try-once (`wait = 0`) has no budget to cut at: its one
//! attempt ends when the backend answers or its own request timeout passes.
//!
//! Deadlines saturate: `wait = Duration::MAX` waits forever. Dropping the
//! future stops the loop at its current `.await`; the runtime then sends an
//! owner-checked release in case an attempt was granted on the wire.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::future::select_all;
use rand::Rng;
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

use super::{AcquireRequest, Attempt, Lease, LockBackend};
use crate::error::BackendError;
use crate::time::{give_up_at, saturating_add};

mod all;
pub(crate) use all::{AcquiredAll, acquire_all_watched};

/// What wakes a waiter: notifications (a release message, a local release),
/// a polling interval, or nothing (then the holder's expiry and the
/// deadline). Built by [`LockBackend::wake_source`]; whatever keeps the
/// subscription alive goes in with [`keep_alive`](WakeSource::keep_alive)
/// and is dropped with the source, when the waiter stops waiting.
#[derive(Default)]
pub struct WakeSource {
    notifies: Vec<Arc<Notify>>,
    poll: Option<Duration>,
    keep: Vec<Box<dyn Any + Send + Sync>>,
}

impl fmt::Debug for WakeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeSource")
            .field("notifies", &self.notifies.len())
            .field("poll", &self.poll)
            .finish_non_exhaustive()
    }
}

impl WakeSource {
    /// No wake-up: the waiter looks again when the holder's lease ends, or at
    /// the deadline.
    pub fn none() -> Self {
        Self::default()
    }

    /// Woken by `notify`: `notify_waiters` wakes every waiter (a local
    /// release), `notify_one` one of them (a release message: see
    /// [`acquire`] for how a wake-up is never lost with the waiter).
    pub fn notify(notify: Arc<Notify>) -> Self {
        Self::default().also(notify)
    }

    /// Also woken by `notify`.
    pub fn also(mut self, notify: Arc<Notify>) -> Self {
        self.notifies.push(notify);
        self
    }

    /// Also looks again at least this often (waiters in processes a release
    /// cannot reach).
    pub fn poll_every(mut self, interval: Duration) -> Self {
        self.poll = Some(self.poll.map_or(interval, |p| p.min(interval)));
        self
    }

    /// Keeps `guard` (a subscription) alive as long as the source.
    pub fn keep_alive(mut self, guard: impl Any + Send + Sync) -> Self {
        self.keep.push(Box::new(guard));
        self
    }

    /// The union of two sources.
    pub fn merge(mut self, other: WakeSource) -> Self {
        self.notifies.extend(other.notifies);
        if let Some(p) = other.poll {
            self = self.poll_every(p);
        }
        self.keep.extend(other.keep);
        self
    }

    /// Registers for the next notification now; the returned future resolves
    /// on the first one sent after this call.
    fn arm(&self) -> Armed {
        let waits: Vec<_> = self
            .notifies
            .iter()
            .map(|n| {
                let mut notified = Box::pin(n.clone().notified_owned());
                notified.as_mut().enable();
                notified
            })
            .collect();
        Armed(waits)
    }
}

struct Armed(Vec<Pin<Box<OwnedNotified>>>);

impl Armed {
    async fn fired(self) {
        if self.0.is_empty() {
            std::future::pending::<()>().await;
        }
        select_all(self.0).await;
    }
}

/// A wake-up taken by a waiter that has not taken the key since. Backends
/// that wake one waiter per release (`notify_one`) rely on that waiter to
/// look, and to learn when the key's next holder expires: if it leaves
/// without the key (its future dropped, an error, the deadline), the wake-up
/// goes to the next waiter, which then looks itself. Otherwise a waiter that
/// was not woken would sleep until the expiry of the holder it last saw, even
/// after a new holder that never releases (a crashed process) expired.
/// Tokio forwards a `notify_one` whose `Notified` is dropped before it
/// completes; this covers the time after it completed.
struct OwedWake(Option<Vec<Arc<Notify>>>);

impl OwedWake {
    /// The waiter holds the key: nothing is owed (it wakes the next waiter
    /// when it releases).
    fn settled(&mut self) {
        self.0 = None;
    }
}

impl Drop for OwedWake {
    fn drop(&mut self) {
        for notify in self.0.iter().flatten() {
            notify.notify_one();
        }
    }
}

/// The longest pause between two attempts while the backend stays
/// unavailable: a server back from a restart is noticed within this.
pub const UNAVAILABLE_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// How long after the caller's deadline the wait loop still waits for an
/// attempt's answer before dropping the attempt (see the
/// [module docs](self)): an unreachable server is an error at most this
/// long after `wait`.
pub const ATTEMPT_GRACE: Duration = Duration::from_millis(250);

/// When the wait loop drops an attempt that is still unanswered:
/// [`ATTEMPT_GRACE`] after the deadline; never for a try-once (`wait = 0`),
/// which the backend's own request timeout bounds.
fn attempt_bound(wait: Duration, deadline: Instant) -> Option<Instant> {
    if wait.is_zero() {
        return None;
    }
    Some(saturating_add(deadline, ATTEMPT_GRACE))
}

/// The pause after the `streak`-th unavailable answer in a row (from 1):
/// `retry_in` doubled each time, capped at [`UNAVAILABLE_BACKOFF_MAX`] (or at
/// `retry_in` when the backend asked for more).
fn unavailable_backoff(retry_in: Duration, streak: u32) -> Duration {
    let doubled = retry_in.saturating_mul(1 << streak.saturating_sub(1).min(16));
    doubled.min(UNAVAILABLE_BACKOFF_MAX.max(retry_in))
}

/// The answer of the wait loop.
#[derive(Debug)]
#[non_exhaustive]
pub enum Acquired {
    /// The key is ours; [`Lease::valid_until`] is set.
    Held(Lease),
    /// The key stayed busy for the whole wait budget.
    Busy,
}

/// Acquires `request.key`, waiting up to `request.wait`: the loop described
/// in the [module docs](self). Errors of an attempt end the loop at once,
/// except [`Attempt::Unavailable`], which is retried with a growing back-off
/// until the deadline.
pub async fn acquire(
    backend: &dyn LockBackend,
    request: &AcquireRequest,
) -> Result<Acquired, BackendError> {
    acquire_watched(backend, request, &AtomicBool::new(false)).await
}

/// [`acquire`], keeping `on_the_wire` true while an attempt is sent and not
/// yet answered: whoever drops this future learns whether the server may
/// still run an attempt after it.
pub(crate) async fn acquire_watched(
    backend: &dyn LockBackend,
    request: &AcquireRequest,
    on_the_wire: &AtomicBool,
) -> Result<Acquired, BackendError> {
    let deadline = saturating_add(Instant::now(), request.wait);
    let drift = backend.drift(request.lease);
    let mut source: Option<WakeSource> = None;
    let mut unavailable_streak = 0u32;
    let mut unanswered_before = false;
    // What the last unavailable answer said: an attempt dropped unanswered
    // at the deadline names it, so the caller learns the cause, not only
    // the last symptom.
    let mut last_unavailable: Option<String> = None;
    let mut owed = OwedWake(None);
    // Whether the last answer was busy: see `busy_at_the_end`.
    let mut busy_before = false;
    loop {
        let armed = source.as_ref().map(WakeSource::arm);
        let sent = Instant::now();
        on_the_wire.store(true, Ordering::SeqCst);
        let attempt = match attempt_bound(request.wait, deadline) {
            None => backend.try_acquire(request).await,
            Some(bound) => {
                match tokio::time::timeout_at(bound.into(), backend.try_acquire(request)).await {
                    Ok(attempt) => attempt,
                    // Dropped unanswered; `on_the_wire` stays set: the
                    // server may still run it.
                    Err(_) if busy_at_the_end(busy_before, sent, deadline) => {
                        return Ok(Acquired::Busy);
                    }
                    Err(_) => {
                        return Err(unanswered(
                            backend,
                            &request.key,
                            request.wait,
                            sent,
                            last_unavailable.as_deref(),
                        ));
                    }
                }
            }
        };
        on_the_wire.store(false, Ordering::SeqCst);
        let attempt = attempt?;
        let now = Instant::now();
        busy_before = matches!(attempt, Attempt::Busy { .. });
        if !matches!(attempt, Attempt::Unavailable { .. }) {
            unavailable_streak = 0;
            last_unavailable = None;
        }
        if matches!(attempt, Attempt::Held(_)) {
            owed.settled();
        }
        let (retry_in, unavailable) = match attempt {
            Attempt::Held(mut lease) => {
                lease.valid_until = valid_until(sent, request.lease, drift);
                lease.after_unanswered |= unanswered_before;
                if now < give_up_at(lease.valid_until, request.lease) {
                    return Ok(Acquired::Held(lease));
                }
                // The grant came back after the point where the holder would
                // have to give it up: using it would be unsafe. Undo it.
                tracing::debug!(
                    key = %request.key,
                    took_ms = (now - sent).as_secs_f64() * 1000.0,
                    "dlock grant arrived too late to be used; released"
                );
                let _ = backend.release(&lease).await;
                let late = BackendError::transient(format!(
                    "the backend granted the lock only after {:?}, too late to use a {:?} lease",
                    now - sent,
                    request.lease
                ));
                (Some(Duration::ZERO), Some(late))
            }
            Attempt::Busy { retry_in } => (retry_in, None),
            Attempt::Unavailable { error, retry_in } => {
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
            return match unavailable {
                Some(error) => {
                    // Bounded like an attempt: the runtime's release that
                    // follows every error frees whatever this leaves.
                    let bound = saturating_add(now, ATTEMPT_GRACE);
                    let _ = tokio::time::timeout_at(bound.into(), backend.abandon(request)).await;
                    Err(error)
                }
                None => {
                    backend.abandon(request).await;
                    Ok(Acquired::Busy)
                }
            };
        }
        let Some(registered) = &source else {
            // First refusal: register the wake-up, then try again at once.
            let registered = tokio::time::timeout_at(deadline.into(), backend.wake_source(request))
                .await
                .unwrap_or_default();
            source = Some(registered);
            continue;
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

/// Whether an attempt sent at `sent` and still unanswered
/// [`ATTEMPT_GRACE`] after the deadline is the wait's last look at a key
/// the server had just answered busy: sent after a busy answer, within
/// [`ATTEMPT_GRACE`] of the deadline. The wait's answer is then `Busy`, what
/// the server last said once the budget was spent, not an error for a
/// server slow to answer one more time (a loaded machine). The attempt is
/// still undone: `on_the_wire` stays set, and the caller follows it with
/// its owner-checked release.
fn busy_at_the_end(busy_before: bool, sent: Instant, deadline: Instant) -> bool {
    busy_before && saturating_add(sent, ATTEMPT_GRACE) >= deadline
}

/// The error of an attempt sent at `sent` and dropped unanswered at the
/// deadline, naming what the attempt before it answered when that was an
/// error.
fn unanswered(
    backend: &dyn LockBackend,
    keys: &str,
    wait: Duration,
    sent: Instant,
    before: Option<&str>,
) -> BackendError {
    let mut text = format!(
        "the {} backend did not answer an attempt on {keys} within {:?} (the wait was {wait:?}); \
         the attempt was dropped",
        backend.kind(),
        sent.elapsed(),
    );
    if let Some(before) = before {
        text.push_str("; the attempt before it failed: ");
        text.push_str(before);
    }
    BackendError::transient(text)
}

/// The local end of a lease granted by a request sent at `sent`.
pub(crate) fn valid_until(sent: Instant, lease: Duration, drift: Duration) -> Instant {
    saturating_add(sent, lease.saturating_sub(drift))
}

/// A little randomness after a holder's expiry or a back-off (1 ms + up to a
/// tenth, at most 10 ms), so that waiters do not all try in the same instant.
fn jitter(base: Duration) -> Duration {
    let spread = (base / 10).min(Duration::from_millis(10));
    let extra = if spread.is_zero() {
        Duration::ZERO
    } else {
        rand::rng().random_range(Duration::ZERO..=spread)
    };
    Duration::from_millis(1) + extra
}

/// Per-key wake-ups inside one process, for backends that wake their own
/// waiters (memory, and SQLite's waiters in the releasing process).
///
/// An entry lives only while someone waits on the key: the
/// [`WakeSource`] it hands out removes it when the last waiter drops it, so
/// the map holds O(current waiters), never O(keys ever used).
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    map: Mutex<HashMap<String, (Arc<Notify>, usize)>>,
}

impl Waiters {
    fn map(&self) -> MutexGuard<'_, HashMap<String, (Arc<Notify>, usize)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A wake-up source for `key`, woken by [`wake`](Self::wake).
    pub(crate) fn source(self: &Arc<Self>, key: &str) -> WakeSource {
        let notify = {
            let mut map = self.map();
            let entry = map
                .entry(key.to_owned())
                .or_insert_with(|| (Arc::new(Notify::new()), 0));
            entry.1 += 1;
            entry.0.clone()
        };
        WakeSource::notify(notify).keep_alive(Registration {
            waiters: self.clone(),
            key: key.to_owned(),
        })
    }

    /// Wakes every waiter of `key` in this process.
    pub(crate) fn wake(&self, key: &str) {
        if let Some((notify, _)) = self.map().get(key) {
            notify.notify_waiters();
        }
    }

    /// Wakes one waiter of `key` in this process (one permit came free); a
    /// waiter not yet asleep finds the wake-up when it looks.
    pub(crate) fn wake_one(&self, key: &str) {
        if let Some((notify, _)) = self.map().get(key) {
            notify.notify_one();
        }
    }

    /// Wakes every waiter of every key (the clock moved).
    pub(crate) fn wake_all(&self) {
        for (notify, _) in self.map().values() {
            notify.notify_waiters();
        }
    }

    /// Acquisitions waiting for `key` in this process right now.
    pub(crate) fn waiting(&self, key: &str) -> usize {
        self.map().get(key).map_or(0, |(_, n)| *n)
    }

    /// Keys starting with `prefix` with waiters right now.
    pub(crate) fn count_under(&self, prefix: &str) -> usize {
        self.map().keys().filter(|k| k.starts_with(prefix)).count()
    }

    /// Keys with waiters right now.
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

struct Registration {
    waiters: Arc<Waiters>,
    key: String,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.waiters.map();
        if let Some(entry) = map.get_mut(&self.key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                map.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AttemptAll;

    #[test]
    fn waiter_entries_are_dropped_with_their_last_waiter() {
        let waiters = Arc::new(Waiters::default());
        let a = waiters.source("k");
        let b = waiters.source("k");
        let c = waiters.source("other");
        assert_eq!(waiters.len(), 2);
        drop(a);
        assert_eq!(waiters.len(), 2);
        drop(b);
        drop(c);
        assert_eq!(waiters.len(), 0);
    }

    #[tokio::test]
    async fn an_armed_source_hears_a_wake_sent_before_it_is_awaited() {
        let waiters = Arc::new(Waiters::default());
        let source = waiters.source("k");
        let armed = source.arm();
        waiters.wake("k");
        tokio::time::timeout(Duration::from_secs(1), armed.fired())
            .await
            .expect("the wake-up sent after arming is kept");
    }

    #[test]
    fn unavailable_backoff_doubles_up_to_its_cap() {
        let ms = Duration::from_millis;
        let steps: Vec<_> = (1..=7).map(|n| unavailable_backoff(ms(25), n)).collect();
        assert_eq!(
            steps,
            [ms(25), ms(50), ms(100), ms(200), ms(400), ms(500), ms(500)]
        );
        assert_eq!(unavailable_backoff(ms(25), u32::MAX), ms(500));
        // A backend that asks for a longer pause gets it, not more.
        assert_eq!(unavailable_backoff(ms(900), 3), ms(900));
    }

    /// A backend that answers an attempt only after `answers_after`
    /// (never, for `None`), and then that the key is busy; with
    /// `first_fails`, its first attempt answers at once that it is
    /// unavailable, with that text; with `busy_at_once`, its first attempts
    /// answer at once that the key is busy (the holder's expiry that far).
    #[derive(Debug, Default)]
    struct Slow {
        answers_after: Option<Duration>,
        first_fails: Option<&'static str>,
        busy_at_once: Option<(usize, Duration)>,
        attempts: std::sync::atomic::AtomicUsize,
    }

    impl LockBackend for Slow {
        fn kind(&self) -> &'static str {
            "slow"
        }

        fn try_acquire<'a>(
            &'a self,
            _request: &'a AcquireRequest,
        ) -> futures_util::future::BoxFuture<'a, Result<Attempt, BackendError>> {
            Box::pin(async move {
                let n = self.attempts.fetch_add(1, Ordering::SeqCst);
                if let Some((_, expiry)) = self.busy_at_once.filter(|(count, _)| n < *count) {
                    return Ok(Attempt::Busy {
                        retry_in: Some(expiry),
                    });
                }
                let first = n == 0;
                if let (true, Some(text)) = (first, self.first_fails) {
                    return Ok(Attempt::Unavailable {
                        error: BackendError::transient(text),
                        retry_in: Duration::from_millis(10),
                    });
                }
                match self.answers_after {
                    Some(after) => tokio::time::sleep(after).await,
                    None => std::future::pending::<()>().await,
                }
                Ok(Attempt::Busy { retry_in: None })
            })
        }

        /// Several keys answer as one key does, the first key named busy.
        fn try_acquire_all<'a>(
            &'a self,
            requests: &'a [AcquireRequest],
        ) -> Option<futures_util::future::BoxFuture<'a, Result<AttemptAll, BackendError>>> {
            Some(Box::pin(async move {
                Ok(match self.try_acquire(&requests[0]).await? {
                    Attempt::Held(_) => unreachable!("the slow backend never grants"),
                    Attempt::Busy { retry_in } => AttemptAll::Busy { key: 0, retry_in },
                    Attempt::Unavailable { error, retry_in } => {
                        AttemptAll::Unavailable { error, retry_in }
                    }
                })
            }))
        }

        fn renew_all<'a>(
            &'a self,
            batch: &'a [(&'a Lease, Duration)],
        ) -> futures_util::future::BoxFuture<'a, Vec<Result<super::super::Renewal, BackendError>>>
        {
            Box::pin(std::future::ready(
                batch
                    .iter()
                    .map(|_| Err(BackendError::permanent("not held")))
                    .collect(),
            ))
        }

        fn release<'a>(
            &'a self,
            _lease: &'a Lease,
        ) -> futures_util::future::BoxFuture<'a, Result<(), BackendError>> {
            Box::pin(std::future::ready(Ok(())))
        }
    }

    fn request(wait: Duration) -> AcquireRequest {
        AcquireRequest::new("k", "owner", Duration::from_secs(5)).with_wait(wait)
    }

    /// Whether `took` is `at`, give or take a loaded machine's scheduling.
    fn about(took: Duration, at: Duration) -> bool {
        took >= at && took < at + Duration::from_millis(200)
    }

    #[tokio::test]
    async fn an_unanswered_attempt_is_an_error_just_after_the_deadline() {
        let silent = Slow::default();
        let wait = Duration::from_millis(400);
        let started = Instant::now();
        let answer = acquire(&silent, &request(wait)).await;
        let took = started.elapsed();
        let error = answer.expect_err("a silent backend is an error");
        assert!(error.is_retryable(), "{error}");
        assert!(about(took, wait + ATTEMPT_GRACE), "answered after {took:?}");
    }

    #[tokio::test]
    async fn an_unanswered_attempt_names_what_the_attempt_before_it_answered() {
        let failing = Slow {
            first_fails: Some("only 0 of 1 replicas acknowledged; undone"),
            ..Slow::default()
        };
        let answer = acquire(&failing, &request(Duration::from_millis(100))).await;
        let error = answer.expect_err("a silent backend is an error");
        let text = error.to_string();
        assert!(text.contains("did not answer"), "{text}");
        assert!(
            text.contains(
                "the attempt before it failed: only 0 of 1 replicas acknowledged; undone"
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_last_look_left_unanswered_after_a_busy_answer_is_busy() {
        let wait = Duration::from_millis(300);
        // Busy twice (the first try, and the try after registering the
        // wake-up) until the deadline; the try at the deadline never answers.
        let slow = Slow {
            busy_at_once: Some((2, wait)),
            ..Slow::default()
        };
        let started = Instant::now();
        let on_the_wire = AtomicBool::new(false);
        let answer = acquire_watched(&slow, &request(wait), &on_the_wire).await;
        assert!(matches!(answer, Ok(Acquired::Busy)), "{answer:?}");
        assert!(about(started.elapsed(), wait + ATTEMPT_GRACE));
        assert!(
            on_the_wire.load(Ordering::SeqCst),
            "the caller must learn that the last attempt may still run"
        );
    }

    #[tokio::test]
    async fn a_server_silent_long_before_the_deadline_is_an_error_after_a_busy_answer() {
        let wait = Duration::from_millis(800);
        let slow = Slow {
            busy_at_once: Some((2, Duration::from_millis(50))),
            ..Slow::default()
        };
        let answer = acquire(&slow, &request(wait)).await;
        let error = answer.expect_err("a server silent for most of the wait is an error");
        assert!(error.to_string().contains("did not answer"), "{error}");
    }

    fn two_keys(wait: Duration) -> [AcquireRequest; 2] {
        [
            request(wait),
            AcquireRequest::new("k2", "owner", Duration::from_secs(5)).with_wait(wait),
        ]
    }

    #[tokio::test]
    async fn an_unanswered_step_on_several_keys_is_an_error_just_after_the_deadline() {
        let silent = Slow {
            first_fails: Some("the first step failed"),
            ..Slow::default()
        };
        let wait = Duration::from_millis(400);
        let started = Instant::now();
        let on_the_wire = AtomicBool::new(false);
        let answer = acquire_all_watched(&silent, &two_keys(wait), &on_the_wire).await;
        let took = started.elapsed();
        let error = answer.expect_err("a silent backend is an error");
        let text = error.to_string();
        assert!(
            text.contains("did not answer an attempt on k, k2"),
            "{text}"
        );
        assert!(
            text.contains("the attempt before it failed: the first step failed"),
            "{text}"
        );
        assert!(about(took, wait + ATTEMPT_GRACE), "answered after {took:?}");
        assert!(
            on_the_wire.load(Ordering::SeqCst),
            "the caller must learn that the step may still run"
        );
    }

    #[tokio::test]
    async fn a_last_step_left_unanswered_after_a_busy_answer_is_busy() {
        let wait = Duration::from_millis(300);
        let slow = Slow {
            busy_at_once: Some((2, wait)),
            ..Slow::default()
        };
        let started = Instant::now();
        let on_the_wire = AtomicBool::new(false);
        let answer = acquire_all_watched(&slow, &two_keys(wait), &on_the_wire).await;
        assert!(matches!(answer, Ok(AcquiredAll::Busy(0))), "{answer:?}");
        assert!(about(started.elapsed(), wait + ATTEMPT_GRACE));
        assert!(on_the_wire.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn an_attempt_answered_within_the_grace_is_the_answer() {
        let slow = Slow {
            answers_after: Some(Duration::from_millis(100)),
            ..Slow::default()
        };
        let answer = acquire(&slow, &request(Duration::from_millis(20))).await;
        assert!(matches!(answer, Ok(Acquired::Busy)), "{answer:?}");
    }

    #[tokio::test]
    async fn a_try_once_waits_for_the_backends_own_answer() {
        let slow = Slow {
            answers_after: Some(ATTEMPT_GRACE * 2),
            ..Slow::default()
        };
        let answer = acquire(&slow, &request(Duration::ZERO)).await;
        assert!(matches!(answer, Ok(Acquired::Busy)), "{answer:?}");
    }

    #[test]
    fn an_attempt_is_bounded_by_the_deadline_and_the_grace() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(attempt_bound(Duration::ZERO, now), None);
        assert_eq!(
            attempt_bound(ms(900), now + ms(900)),
            Some(now + ms(900) + ATTEMPT_GRACE)
        );
        let forever = saturating_add(now, Duration::MAX);
        assert!(attempt_bound(Duration::MAX, forever).is_some_and(|b| b >= forever));
    }

    #[test]
    fn jitter_is_small() {
        for ms in [0, 1, 50, 5000] {
            let j = jitter(Duration::from_millis(ms));
            assert!(j >= Duration::from_millis(1) && j <= Duration::from_millis(11));
        }
    }
}
