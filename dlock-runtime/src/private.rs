//! What `#[distributed_lock]` expands to calls. **Not a stable API**: names and
//! signatures here change without notice; use the attribute, or
//! [`lock`](crate::lock()) and [`LockGuard`](crate::LockGuard).

use std::borrow::Cow;
use std::future::Future;

pub use crate::backend::HoldMode;
pub use crate::outcome::{LockOutcome, SkipOutcome};
pub use std::format;
pub use std::string::String;
pub use std::time::Duration;
pub use std::vec::Vec;

use crate::error::LockError;
use crate::lease::{Keys, LockOptions, acquire_counted, count_skipped, global};

/// What to do when the lock is busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusyPolicy {
    /// Return the busy error.
    Fail,
    /// Do not run the body; return the skip value.
    Skip,
}

/// What to do when the lease is lost while the body runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostPolicy {
    /// Stop the body at its next `.await` and return the lost error.
    Cancel,
    /// Let the body finish (a `warn` event is logged).
    Continue,
}

/// The attribute's arguments, checked at compile time.
#[derive(Debug)]
pub struct Spec {
    /// `module::function`, for traces.
    pub function: &'static str,
    /// `wait`.
    pub wait: Duration,
    /// `lease`.
    pub lease: Duration,
    /// `on_busy`.
    pub on_busy: BusyPolicy,
    /// `on_lost`.
    pub on_lost: LostPolicy,
    /// `watchdog`.
    pub watchdog: bool,
    /// `fencing`.
    pub fencing: bool,
    /// `hold_at_least`.
    pub hold_at_least: Option<Duration>,
    /// `max_hold`.
    pub max_hold: Option<Duration>,
    /// The key template as written (the templates of `keys` joined by `,`):
    /// the metrics' `key` label.
    pub key_template: &'static str,
    /// `backend`.
    pub backend: Option<&'static str>,
    /// `permits` / `mode`.
    pub mode: HoldMode,
}

/// Runs `body` under the lock, with `on_busy = "fail"`.
pub async fn run_fail<R: LockOutcome, F: Future<Output = R>>(
    spec: &'static Spec,
    key: String,
    body: F,
) -> R {
    run(spec, Keys::One(key), body, None).await
}

/// Runs `body` under the lock, with `on_busy = "skip"`.
pub async fn run_skip<R: SkipOutcome, F: Future<Output = R>>(
    spec: &'static Spec,
    key: String,
    body: F,
) -> R {
    run(spec, Keys::One(key), body, Some(R::skipped)).await
}

/// Runs `body` under one hold of several keys (`keys = [..]`), with `on_busy = "fail"`.
pub async fn run_fail_all<R: LockOutcome, F: Future<Output = R>>(
    spec: &'static Spec,
    keys: Vec<String>,
    body: F,
) -> R {
    run(spec, Keys::All(keys), body, None).await
}

/// Runs `body` under one hold of several keys (`keys = [..]`), with `on_busy = "skip"`.
pub async fn run_skip_all<R: SkipOutcome, F: Future<Output = R>>(
    spec: &'static Spec,
    keys: Vec<String>,
    body: F,
) -> R {
    run(spec, Keys::All(keys), body, Some(R::skipped)).await
}

async fn run<R: LockOutcome, F: Future<Output = R>>(
    spec: &'static Spec,
    keys: Keys,
    body: F,
    skipped: Option<fn() -> R>,
) -> R {
    let Some(registry) = global() else {
        return R::from_lock_error(LockError::NotInitialized);
    };
    let options = LockOptions {
        wait: spec.wait,
        lease: spec.lease,
        watchdog: spec.watchdog,
        fencing: spec.fencing,
        hold_at_least: spec.hold_at_least,
        backend: spec.backend.map(Cow::Borrowed),
        max_hold: spec.max_hold,
        key_label: Some(Cow::Borrowed(spec.key_template)),
        mode: spec.mode,
        permits: spec.mode.permits(),
    };
    let acquired = acquire_counted(registry, &options, keys).await;
    let guard = match acquired {
        Ok(guard) => guard,
        Err(err) => {
            return match (err, skipped) {
                (LockError::Busy { key, waited }, Some(skipped)) => {
                    tracing::debug!(
                        function = spec.function,
                        key = %key,
                        waited_ms = waited.as_secs_f64() * 1000.0,
                        "dlock: busy, body skipped"
                    );
                    count_skipped(registry, &options);
                    skipped()
                }
                (err, _) => R::from_lock_error(err),
            };
        }
    };
    let body = guard.scope(body);
    let finished = match spec.on_lost {
        LostPolicy::Cancel => {
            let lost = guard.lost();
            // The loss first: a body that would resume after the loss was
            // signalled is not polled again.
            tokio::select! {
                biased;
                () = lost => None,
                out = body => Some(out),
            }
        }
        LostPolicy::Continue => Some(body.await),
    };
    let key = if finished.is_some() {
        guard.key().to_owned()
    } else {
        guard.lost_key().to_owned()
    };
    let Some(out) = finished else {
        // Return the loss at once: dropping the guard hands the owner-checked
        // release to dlock's runtime (it still frees the key when only our side
        // gave up), instead of making the caller wait on a server that may be gone.
        drop(guard);
        tracing::warn!(function = spec.function, key = %key, "dlock: lease lost, body cancelled");
        return R::from_lock_error(LockError::Lost { key });
    };
    match guard.release().await {
        Ok(()) => {}
        Err(LockError::Lost { key }) if spec.on_lost == LostPolicy::Cancel => {
            // Lost after the body's last `.await` (or as it finished): the
            // work was not protected to its end, and the caller must know.
            tracing::warn!(function = spec.function, key = %key, "dlock: lease lost as the body finished");
            return R::from_lock_error(LockError::Lost { key });
        }
        Err(LockError::Lost { .. }) => tracing::warn!(
            function = spec.function,
            key = %key,
            "dlock: the lease was lost while the body ran to completion (on_lost = \"continue\")"
        ),
        Err(err) => {
            tracing::warn!(function = spec.function, key = %key, error = %err, "dlock: release failed")
        }
    }
    out
}
