//! The conformance cases. Each takes the [`Harness`] of the backend under test.
// A case left off the list at the end is unused: dead code fails the build.
#![deny(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{FencingToken, LockError, MIN_LEASE, distributed_lock, lock};

use crate::{Harness, unique_key};

const SECOND: Duration = Duration::from_secs(1);

/// An application error, as users write them.
#[derive(Debug)]
pub enum AppError {
    /// The lock could not be taken or was lost.
    Lock(LockError),
    /// The body failed on its own.
    Failed(&'static str),
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}

fn is_lock_err(r: &Result<impl std::fmt::Debug, AppError>, f: fn(&LockError) -> bool) -> bool {
    matches!(r, Err(AppError::Lock(e)) if f(e))
}

async fn assert_free(h: &Harness, key: &str, why: &str) {
    assert!(
        !h.faults.is_held(&h.stored(key)).await,
        "{why}: `{key}` is still held on the server"
    );
}

/// Acquires `key`, waiting up to `wait`, and says how long it took.
async fn time_to_acquire(
    key: &str,
    wait: Duration,
) -> (Result<dlock_runtime::LockGuard, LockError>, Duration) {
    let started = Instant::now();
    let guard = lock(key).wait(wait).lease(30 * SECOND).acquire().await;
    (guard, started.elapsed())
}

/// Two holders of one key never overlap (guards, many tasks).
async fn mutual_exclusion(_h: &Harness) {
    let key = unique_key("mutex");
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let (key, inside, overlaps, done) =
                (key.clone(), inside.clone(), overlaps.clone(), done.clone());
            tokio::spawn(async move {
                for _ in 0..8 {
                    let guard = lock(&key)
                        .wait(30 * SECOND)
                        .lease(10 * SECOND)
                        .acquire()
                        .await
                        .expect("acquire under contention");
                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    done.fetch_add(1, Ordering::SeqCst);
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "holders overlapped");
    assert_eq!(done.load(Ordering::SeqCst), 48);
}

#[distributed_lock(key = "{key}", wait = "30s", lease = "10s")]
async fn exclusive_increment(
    key: &str,
    inside: &AtomicUsize,
    overlaps: &AtomicUsize,
) -> Result<(), AppError> {
    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
        overlaps.fetch_add(1, Ordering::SeqCst);
    }
    tokio::time::sleep(Duration::from_millis(2)).await;
    inside.fetch_sub(1, Ordering::SeqCst);
    Ok(())
}

/// The same through `#[distributed_lock]`.
async fn mutual_exclusion_through_the_attribute(_h: &Harness) {
    let key = unique_key("mutex-attr");
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let (key, inside, overlaps) = (key.clone(), inside.clone(), overlaps.clone());
            tokio::spawn(async move {
                for _ in 0..8 {
                    exclusive_increment(&key, &inside, &overlaps)
                        .await
                        .expect("locked call");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "holders overlapped");
}

/// Successive holders get strictly increasing fencing tokens (or, on a backend
/// without safe tokens, none at all — never a wrong one).
async fn fencing_tokens_strictly_increase(h: &Harness) {
    let key = unique_key("tokens");
    if !h.fences {
        let guard = lock(&key).acquire().await.expect("acquire");
        assert_eq!(
            guard.fencing_token(),
            None,
            "a backend without fencing hands out no token"
        );
        guard.release().await.expect("release");
        return;
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::<FencingToken>::new()));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (key, seen) = (key.clone(), seen.clone());
            tokio::spawn(async move {
                for _ in 0..5 {
                    let guard = lock(&key)
                        .wait(30 * SECOND)
                        .acquire()
                        .await
                        .expect("acquire");
                    let token = guard.fencing_token().expect("this backend fences");
                    seen.lock().unwrap().push(token);
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 20);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens not strictly increasing in acquisition order: {seen:?}"
    );
}

#[distributed_lock(key = "{key}", lease = "30s")]
async fn returns_ok(key: &str) -> Result<u32, AppError> {
    Ok(7)
}

/// After a normal return the key is free at once.
async fn release_after_return(h: &Harness) {
    let key = unique_key("ret");
    assert_eq!(returns_ok(&key).await.expect("runs"), 7);
    assert_free(h, &key, "after return").await;
    let guard = lock(&key).acquire().await.expect("free right after return");
    guard.release().await.expect("release");
}

fn failing_step() -> Result<(), AppError> {
    Err(AppError::Failed("step"))
}

#[distributed_lock(key = "{key}", lease = "30s")]
async fn returns_early(key: &str) -> Result<u32, AppError> {
    failing_step()?;
    Ok(1)
}

/// After an early `?` the key is free at once.
async fn release_after_question_mark(h: &Harness) {
    let key = unique_key("qmark");
    assert!(matches!(
        returns_early(&key).await,
        Err(AppError::Failed("step"))
    ));
    assert_free(h, &key, "after `?`").await;
    let guard = lock(&key).acquire().await.expect("free right after `?`");
    guard.release().await.expect("release");
}

#[distributed_lock(key = "{key}", lease = "30s")]
async fn panics(key: String) -> Result<(), AppError> {
    tokio::task::yield_now().await;
    panic!("body panicked on purpose");
}

/// After a panic the key is freed by the guard's `Drop` — within moments, not
/// after the 30 s lease.
async fn release_after_panic(_h: &Harness) {
    let key = unique_key("panic");
    let joined = tokio::spawn(panics(key.clone())).await;
    assert!(joined.expect_err("the body panics").is_panic());
    let (guard, took) = time_to_acquire(&key, 5 * SECOND).await;
    guard
        .expect("the panicked holder released")
        .release()
        .await
        .expect("release");
    assert!(took < 5 * SECOND, "took {took:?}");
}

#[distributed_lock(key = "{key}", lease = "30s")]
async fn runs_until_cancelled(
    key: String,
    entered: tokio::sync::oneshot::Sender<()>,
) -> Result<(), AppError> {
    let _ = entered.send(());
    tokio::time::sleep(Duration::from_secs(3600)).await;
    Ok(())
}

/// After the caller drops the future the key is freed at once.
async fn release_after_cancellation(h: &Harness) {
    let key = unique_key("cancel");
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(runs_until_cancelled(key.clone(), tx));
    rx.await.expect("the body started");
    assert!(
        h.faults.is_held(&h.stored(&key)).await,
        "held while the body runs"
    );
    task.abort();
    assert!(task.await.expect_err("aborted").is_cancelled());
    let (guard, took) = time_to_acquire(&key, 5 * SECOND).await;
    guard
        .expect("the cancelled holder released")
        .release()
        .await
        .expect("release");
    assert!(took < 5 * SECOND, "took {took:?}");
}

/// A holder that vanishes without releasing (no renewals, no release: what a
/// killed process does) blocks others for at most its lease.
async fn expiry_when_the_holder_vanishes(_h: &Harness) {
    let key = unique_key("vanish");
    let lease = Duration::from_millis(600);
    let guard = lock(&key)
        .lease(lease)
        .watchdog(false)
        .acquire()
        .await
        .expect("acquire");
    std::mem::forget(guard);
    let started = Instant::now();
    let next = lock(&key)
        .wait(10 * SECOND)
        .acquire()
        .await
        .expect("free after the lease");
    let took = started.elapsed();
    next.release().await.expect("release");
    assert!(
        took >= lease / 2,
        "acquired after {took:?}: the vanished lease was not held"
    );
    assert!(took < 5 * SECOND, "took {took:?}");
}

#[distributed_lock(key = "{key}", lease = "600ms")]
async fn long_body(key: &str, runs_for: Duration) -> Result<bool, AppError> {
    tokio::time::sleep(runs_for).await;
    Ok(dlock_runtime::current().expect("inside").is_lost())
}

/// A body running for several leases keeps its lock (the watchdog renews it).
async fn watchdog_keeps_a_long_body_locked(_h: &Harness) {
    let key = unique_key("watchdog");
    let body = tokio::spawn({
        let key = key.clone();
        async move { long_body(&key, Duration::from_millis(2500)).await }
    });
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let other = lock(&key).acquire().await;
        assert!(
            matches!(other, Err(LockError::Busy { .. })),
            "the key must stay held while the body runs: {other:?}"
        );
    }
    let lost = body.await.expect("task").expect("the long body completes");
    assert!(!lost, "the lease was lost although the watchdog runs");
}

#[distributed_lock(key = "{key}", lease = "900ms")]
async fn counts_until_cancelled(key: &str, counter: &AtomicUsize) -> Result<(), AppError> {
    for _ in 0..200 {
        counter.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(())
}

/// A lost lease reaches the holder within a renewal period, and the body stops
/// at its next `.await` (`on_lost = "cancel"`, the default).
async fn lost_lease_cancels_the_body(h: &Harness) {
    let key = unique_key("lost");
    let counter = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let call = tokio::spawn({
        let (key, counter) = (key.clone(), counter.clone());
        async move { counts_until_cancelled(&key, &counter).await }
    });
    let _lost = revoke_and_expect_the_body_cancelled(h, &key, call, &counter).await;
    assert!(started.elapsed() < 4 * SECOND, "the body was not cancelled");
}

/// Revokes `key` while `call`'s body counts, and checks that the body is
/// cancelled within a renewal period and counts no more; the call's answer.
async fn revoke_and_expect_the_body_cancelled(
    h: &Harness,
    key: &str,
    call: tokio::task::JoinHandle<Result<(), AppError>>,
    counter: &AtomicUsize,
) -> Result<(), AppError> {
    // Once the body runs: every key is held.
    let until = Instant::now() + 10 * SECOND;
    while counter.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < until, "the body never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let revoked_at = Instant::now();
    h.faults.revoke(&h.stored(key)).await;
    let result = call.await.expect("task");
    let noticed = revoked_at.elapsed();
    assert!(
        is_lock_err(&result, |e| matches!(e, LockError::Lost { .. })),
        "expected Lost, got {result:?}"
    );
    // One renewal period (lease / 3 = 300 ms) plus round trips.
    assert!(
        noticed < Duration::from_millis(1500),
        "loss noticed after {noticed:?}"
    );
    let after = counter.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        counter.load(Ordering::SeqCst),
        after,
        "the body still runs after the loss"
    );
    result
}

#[distributed_lock(key = "{key}", lease = "900ms", on_lost = "continue")]
async fn finishes_despite_loss(key: &str, revoked: &AtomicBool) -> Result<u32, AppError> {
    while !revoked.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Past the next renewal, which finds the lease gone.
    tokio::time::sleep(Duration::from_millis(700)).await;
    Ok(42)
}

/// With `on_lost = "continue"` the body runs to its end and its value is returned.
async fn lost_lease_with_on_lost_continue_lets_the_body_finish(h: &Harness) {
    let key = unique_key("lost-continue");
    let revoked = Arc::new(AtomicBool::new(false));
    let call = tokio::spawn({
        let (key, revoked) = (key.clone(), revoked.clone());
        async move { finishes_despite_loss(&key, &revoked).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.faults.revoke(&h.stored(&key)).await;
    revoked.store(true, Ordering::SeqCst);
    assert_eq!(call.await.expect("task").expect("finishes"), 42);
}

/// A programmatic holder sees the loss through `lost()` and `release()`.
async fn lost_lease_reaches_a_guard_holder(h: &Harness) {
    let key = unique_key("lost-guard");
    let guard = lock(&key)
        .lease(Duration::from_millis(900))
        .acquire()
        .await
        .expect("acquire");
    h.faults.revoke(&h.stored(&key)).await;
    tokio::time::timeout(Duration::from_millis(1500), guard.lost())
        .await
        .expect("the loss reaches the holder within a renewal period");
    assert!(guard.is_lost());
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

#[distributed_lock(key = "{key}", lease = "30s")]
async fn outer(
    key: &str,
) -> Result<
    (
        Option<FencingToken>,
        Option<FencingToken>,
        Option<FencingToken>,
    ),
    AppError,
> {
    let mine = dlock_runtime::current().expect("inside").fencing_token();
    let nested = inner(key).await?;
    // A programmatic acquisition of the same key in the same task is reentrant too.
    let guard = lock(key).acquire().await?;
    let programmatic = guard.fencing_token();
    guard.release().await?;
    Ok((mine, nested, programmatic))
}

#[distributed_lock(key = "{key}", lease = "30s")]
async fn inner(key: &str) -> Result<Option<FencingToken>, AppError> {
    Ok(dlock_runtime::current().expect("inside").fencing_token())
}

/// A task holding a key enters nested locks of the same key at once; the
/// outermost release frees it.
async fn reentrancy_within_a_task(h: &Harness) {
    let key = unique_key("reentrant");
    let (mine, nested, programmatic) = tokio::time::timeout(5 * SECOND, outer(&key))
        .await
        .expect("no self-deadlock")
        .expect("reentrant calls succeed");
    assert_eq!(mine.is_some(), h.fences);
    assert_eq!(mine, nested);
    assert_eq!(mine, programmatic);
    assert_free(h, &key, "after the outermost call").await;
    // Another task does not share the hold.
    let guard = lock(&key).acquire().await.expect("free");
    let other_task = tokio::spawn({
        let key = key.clone();
        async move { lock(&key).acquire().await.map(|_| ()) }
    });
    assert!(matches!(
        other_task.await.expect("task"),
        Err(LockError::Busy { .. })
    ));
    guard.release().await.expect("release");
}

#[distributed_lock(key = "{key}", on_busy = "skip")]
async fn skippable(key: &str, ran: &AtomicUsize) -> Result<Option<u32>, AppError> {
    ran.fetch_add(1, Ordering::SeqCst);
    Ok(Some(1))
}

#[distributed_lock(key = "{key}", on_busy = "skip")]
async fn skippable_unit(key: &str, ran: &AtomicUsize) {
    ran.fetch_add(1, Ordering::SeqCst);
}

/// `on_busy = "skip"` does not run the body and returns the skip value.
async fn skip_policy(_h: &Harness) {
    let key = unique_key("skip");
    let ran = AtomicUsize::new(0);
    assert_eq!(skippable(&key, &ran).await.expect("runs"), Some(1));
    let guard = lock(&key).acquire().await.expect("acquire");
    assert_eq!(skippable(&key, &ran).await.expect("skipped"), None);
    skippable_unit(&key, &ran).await;
    assert_eq!(ran.load(Ordering::SeqCst), 1, "a skipped body ran");
    guard.release().await.expect("release");
    skippable_unit(&key, &ran).await;
    assert_eq!(ran.load(Ordering::SeqCst), 2);
}

#[distributed_lock(key = "{key}", wait = "400ms")]
async fn waits_then_fails(key: &str) -> Result<(), AppError> {
    Ok(())
}

/// `on_busy = "fail"` returns `Busy` once the wait budget is spent — not before,
/// and not much after.
async fn fail_policy_and_wait_budget(_h: &Harness) {
    let key = unique_key("fail");
    let guard = lock(&key).acquire().await.expect("acquire");
    let started = Instant::now();
    let result = waits_then_fails(&key).await;
    let took = started.elapsed();
    assert!(
        is_lock_err(&result, |e| matches!(e, LockError::Busy { .. })),
        "{result:?}"
    );
    assert!(
        took >= Duration::from_millis(400),
        "gave up early: {took:?}"
    );
    assert!(
        took < Duration::from_millis(1400),
        "overran the budget: {took:?}"
    );
    let started = Instant::now();
    let busy = lock(&key).acquire().await;
    assert!(matches!(busy, Err(LockError::Busy { .. })));
    assert!(started.elapsed() < SECOND, "wait = 0 must try once");
    guard.release().await.expect("release");
}

#[distributed_lock(key = "{key}", hold_at_least = "1s")]
async fn quick_job(key: &str) -> Result<(), AppError> {
    Ok(())
}

/// `hold_at_least` keeps the key held after the body ends, as a lease that
/// expires (the call itself returns at once).
async fn hold_at_least_keeps_the_key_after_the_body(h: &Harness) {
    let key = unique_key("at-least");
    let started = Instant::now();
    quick_job(&key).await.expect("runs");
    let returned = started.elapsed();
    assert!(
        returned < Duration::from_millis(900),
        "the caller slept: {returned:?}"
    );
    assert!(
        h.faults.is_held(&h.stored(&key)).await,
        "released too early"
    );
    assert!(matches!(
        lock(&key).acquire().await,
        Err(LockError::Busy { .. })
    ));
    let (guard, _) = time_to_acquire(&key, 5 * SECOND).await;
    let free_after = started.elapsed();
    guard
        .expect("free after hold_at_least")
        .release()
        .await
        .expect("release");
    assert!(
        free_after >= Duration::from_millis(900),
        "free after {free_after:?}"
    );
    assert!(free_after < 4 * SECOND, "free after {free_after:?}");
}

#[distributed_lock(key = "{key}", lease = "600ms", watchdog = false)]
async fn outlives_its_cap(key: &str) -> Result<(), AppError> {
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(())
}

/// `watchdog = false`: the lease is not renewed; when it runs out the body is
/// cancelled (the default `on_lost`) and the key is free for others.
async fn watchdog_false_is_a_hard_cap(_h: &Harness) {
    let key = unique_key("cap");
    let started = Instant::now();
    let result = outlives_its_cap(&key).await;
    let took = started.elapsed();
    assert!(
        is_lock_err(&result, |e| matches!(e, LockError::Lost { .. })),
        "{result:?}"
    );
    assert!(took < Duration::from_millis(1200), "took {took:?}");
    let guard = lock(&key)
        .wait(2 * SECOND)
        .acquire()
        .await
        .expect("free after the cap");
    guard.release().await.expect("release");
}

/// A waiter gets a released key within a few round trips, not a lease.
async fn release_wakes_a_waiter_quickly(_h: &Harness) {
    let key = unique_key("handoff");
    let guard = lock(&key).acquire().await.expect("acquire");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let g = lock(&key)
                .wait(20 * SECOND)
                .lease(30 * SECOND)
                .acquire()
                .await;
            (g, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released_at = Instant::now();
    guard.release().await.expect("release");
    let (next, acquired_at) = waiter.await.expect("task");
    next.expect("handed over").release().await.expect("release");
    let handoff = acquired_at.saturating_duration_since(released_at);
    assert!(handoff < SECOND, "handoff took {handoff:?}");
}

#[distributed_lock(key = "{key}")]
async fn reports_current(key: &str) -> Option<(String, Option<FencingToken>)> {
    let c = dlock_runtime::current()?;
    Some((c.key().to_owned(), c.fencing_token()))
}

/// `current()` is `None` outside a lock and describes the lock inside.
async fn current_inside_and_outside(h: &Harness) {
    let key = unique_key("current");
    assert!(dlock_runtime::current().is_none());
    let (seen_key, token) = reports_current(&key).await.expect("runs");
    assert_eq!(seen_key, key);
    assert_eq!(token.is_some(), h.fences);
    assert!(dlock_runtime::current().is_none());
    let guard = lock(&key).acquire().await.expect("acquire");
    let inside = guard
        .scope(async { dlock_runtime::current().map(|c| c.fencing_token()) })
        .await;
    assert_eq!(inside, Some(guard.fencing_token()));
    guard.release().await.expect("release");
}

/// Keys no backend can store are a typed error, never a panic or a collision.
async fn invalid_keys_are_rejected(_h: &Harness) {
    for bad in [
        String::new(),
        "a\nb".into(),
        "nul\0".into(),
        "x".repeat(5000),
    ] {
        let result = lock(bad.clone()).acquire().await;
        assert!(
            matches!(result, Err(LockError::InvalidKey { .. })),
            "{bad:?} gave {result:?}"
        );
    }
    for odd in ["{}", "*", "a/b/../c", "ключ", "🔒 lock", "%s%n"] {
        let key = unique_key(odd);
        let guard = lock(&key).acquire().await.expect("odd but valid key");
        guard.release().await.expect("release");
    }
}

/// The pieces fuzzed keys are made of: what backends are known to trip on
/// (hash-tag braces, glob and path characters, quotes, escapes, non-ASCII,
/// look-alikes that differ only in case, spacing or Unicode normalisation) and
/// control characters, which every backend must refuse.
const KEY_PIECES: &[&str] = &[
    "{", "}", "{}", "}{", "*", "?", "[", "]", "/", "..", "../", ":", " ", "\\", "%", "%s", "_",
    "'", "\"", "`", ";", "--", "#", "$", "a", "A", "0", "é", "e\u{301}", "ß", "日本", "ключ", "🔒",
    "\u{200b}", "\u{7f}", "\n", "\0", "\t", "\u{85}",
];

fn fuzzed_key(rng: &mut impl rand::Rng) -> String {
    let n = rng.random_range(1..10);
    (0..n)
        .map(|_| KEY_PIECES[rng.random_range(0..KEY_PIECES.len())])
        .collect()
}

fn expect_invalid(key: &str, prefix: &str) -> bool {
    key.is_empty()
        || key.chars().any(char::is_control)
        || prefix.len() + key.len() > dlock_runtime::MAX_KEY_LEN
}

/// Fuzzed key names: each is stored under a key of its own (all of them can be
/// held at once, and each is then busy for another task) or refused with
/// `InvalidKey` — never a collision, another error or a panic.
async fn fuzzed_keys_never_collide(h: &Harness) {
    use rand::SeedableRng as _;
    let prefix = h.registry().key_prefix().to_owned();
    let run = unique_key("fuzz");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xd10c);
    let mut keys = std::collections::BTreeSet::new();
    for _ in 0..200 {
        keys.insert(format!("{run}:{}", fuzzed_key(&mut rng)));
    }
    // Exactly at the length limit, one byte over it, and nothing but the run id.
    let room = dlock_runtime::MAX_KEY_LEN - prefix.len() - run.len() - 1;
    keys.insert(format!("{run}:{}", "é".repeat(room / 2)));
    keys.insert(format!("{run}:{}", "x".repeat(room + 1)));
    keys.insert(run.clone());

    let mut held = Vec::new();
    for key in &keys {
        match lock(key.clone()).acquire().await {
            Ok(guard) => {
                assert!(
                    !expect_invalid(key, &prefix),
                    "{key:?} should have been refused"
                );
                held.push(guard);
            }
            Err(LockError::InvalidKey { .. }) => {
                assert!(expect_invalid(key, &prefix), "{key:?} refused")
            }
            Err(e) => panic!("{key:?}: {e}"),
        }
    }
    assert!(
        held.len() > keys.len() / 3,
        "too few valid keys to mean anything"
    );
    let names: Vec<String> = held.iter().map(|g| g.key().to_owned()).collect();
    let again = names.clone();
    tokio::spawn(async move {
        for key in again {
            let other = lock(key.clone()).acquire().await;
            assert!(
                matches!(other, Err(LockError::Busy { .. })),
                "{key:?} held, yet {other:?}"
            );
        }
    })
    .await
    .expect("no panic");
    for guard in held {
        guard.release().await.expect("release");
    }
    tokio::spawn(async move {
        for key in names {
            let guard = lock(key.clone())
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("{key:?}: {e}"));
            guard.release().await.expect("release");
        }
    })
    .await
    .expect("no panic");
}

#[distributed_lock(key = "{{fuzz}}:{run}:{a}/{b}")]
async fn templated_key(run: &str, a: &str, b: &str) -> Result<String, LockError> {
    Ok(dlock_runtime::current().expect("inside").key().to_owned())
}

/// Fuzzed values interpolated by a key template reach the backend as exactly the
/// text the template says (`{{`/`}}` literal, `{a}` the value), or are refused
/// with `InvalidKey`.
async fn fuzzed_template_values_reach_the_backend_verbatim(h: &Harness) {
    use rand::SeedableRng as _;
    let prefix = h.registry().key_prefix().to_owned();
    let run = unique_key("template");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7e41);
    for _ in 0..100 {
        let (a, b) = (fuzzed_key(&mut rng), fuzzed_key(&mut rng));
        let expected = format!("{{fuzz}}:{run}:{a}/{b}");
        match templated_key(&run, &a, &b).await {
            Ok(key) => {
                assert_eq!(key, expected);
                assert!(!expect_invalid(&expected, &prefix));
            }
            Err(LockError::InvalidKey { .. }) => {
                assert!(expect_invalid(&expected, &prefix), "{expected:?}")
            }
            Err(e) => panic!("{expected:?}: {e}"),
        }
    }
}

/// Naming a backend that is not registered is `UnknownBackend`.
async fn unknown_backend_is_an_error(_h: &Harness) {
    let result = lock(unique_key("unknown"))
        .backend("no-such-backend")
        .acquire()
        .await;
    assert!(
        matches!(result, Err(LockError::UnknownBackend { .. })),
        "{result:?}"
    );
}

/// `wait(Duration::MAX)` waits for ever (no overflow): on a free key, and on a
/// key released 200 ms later. A lease below `MIN_LEASE` is a configuration
/// error; a lease of exactly `MIN_LEASE` is kept by the watchdog.
async fn wait_forever_and_the_minimum_lease(h: &Harness) {
    let key = unique_key("wait-forever");
    let holder = lock(&key)
        .wait(Duration::MAX)
        .acquire()
        .await
        .expect("a free key");
    let started = Instant::now();
    let releaser = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        holder.release().await
    });
    let next = tokio::time::timeout(5 * SECOND, lock(&key).wait(Duration::MAX).acquire())
        .await
        .expect("handed over when released")
        .expect("acquire");
    assert!(started.elapsed() >= Duration::from_millis(150));
    releaser.await.expect("task").expect("release");
    next.release().await.expect("release");

    let short = lock(&key).lease(MIN_LEASE / 2).acquire().await;
    assert!(
        matches!(short, Err(LockError::Config { .. })),
        "a lease below MIN_LEASE: {short:?}"
    );
    let guard = lock(&key)
        .lease(MIN_LEASE)
        .acquire()
        .await
        .expect("MIN_LEASE");
    // The watchdog keeps a 100 ms lease only while this process runs: a probe
    // beside it measures how late the runtime ran it (other cases of this
    // binary, other load), until the lease is released. A stall of a quarter
    // of the lease may cost the lease, and then the loss must have been
    // signalled.
    let done = Arc::new(AtomicBool::new(false));
    let probe = tokio::spawn({
        let done = done.clone();
        async move {
            let mut worst = Duration::ZERO;
            while !done.load(Ordering::SeqCst) {
                let before = Instant::now();
                tokio::time::sleep(Duration::from_millis(5)).await;
                worst = worst.max(before.elapsed().saturating_sub(Duration::from_millis(5)));
            }
            worst
        }
    });
    // And a probe of the server: how long its answers took meanwhile (a
    // server starved of CPU answers renewals late too).
    let server_probe = async {
        let probe_key = h.stored(&unique_key("min-lease-probe"));
        let mut worst = Duration::ZERO;
        while !done.load(Ordering::SeqCst) {
            let before = Instant::now();
            h.faults.is_held(&probe_key).await;
            worst = worst.max(before.elapsed());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        worst
    };
    let kept = async {
        tokio::time::sleep(SECOND).await;
        let held = h.faults.is_held(&h.stored(&key)).await;
        let lost = guard.is_lost();
        let released = guard.release().await;
        done.store(true, Ordering::SeqCst);
        (held, lost, released)
    };
    let (worst_stall, worst_answer, (held, lost, released)) =
        tokio::join!(async { probe.await.expect("probe") }, server_probe, kept);
    if lost || released.is_err() {
        assert!(
            worst_stall >= MIN_LEASE / 4 || worst_answer >= MIN_LEASE / 10,
            "a MIN_LEASE lease was lost although this process ran at most {worst_stall:?} late \
             and the server answered within {worst_answer:?}"
        );
        assert!(
            matches!(released, Err(LockError::Lost { .. })),
            "a lost lease's release: {released:?}"
        );
        return;
    }
    assert!(held, "a kept MIN_LEASE lease is not held on the server");
}

/// A waiter whose caller gives up (a timeout around `acquire`) stops waiting:
/// when the holder releases later, the key stays free.
async fn an_abandoned_waiter_takes_nothing(h: &Harness) {
    let key = unique_key("abandoned-waiter");
    let guard = lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let started = Instant::now();
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            tokio::time::timeout(SECOND, lock(&key).wait(60 * SECOND).acquire())
                .await
                .is_err()
        }
    });
    assert!(
        waiter.await.expect("task"),
        "the key was busy for the whole second"
    );
    tokio::time::sleep_until((started + Duration::from_millis(1500)).into()).await;
    guard.release().await.expect("release");
    tokio::time::sleep_until((started + 2 * SECOND).into()).await;
    assert_free(
        h,
        &key,
        "the abandoned waiter took the key after its caller had gone",
    )
    .await;
}

/// Rounds of the opposite-orders case: each of two tasks takes the same two
/// keys, in opposite orders, this many times.
const OPPOSITE_ORDER_ROUNDS: usize = 500;

/// Counts the holders of one key at a time; an overlap is a second holder.
#[derive(Default)]
struct Occupancy {
    inside: AtomicUsize,
    overlaps: AtomicUsize,
}

impl Occupancy {
    fn enter(&self) {
        if self.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn leave(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Two tasks naming the same two keys in opposite orders never wait on each
/// other for ever, and a third taking one of the keys alone never overlaps
/// with them.
async fn several_keys_in_opposite_orders_never_deadlock(_h: &Harness) {
    let (a, b) = (unique_key("opposite-a"), unique_key("opposite-b"));
    let on_a = Arc::new(Occupancy::default());
    let on_b = Arc::new(Occupancy::default());
    let pair_done = Arc::new(AtomicUsize::new(0));
    let pair = |keys: [String; 2]| {
        let (on_a, on_b, pair_done) = (on_a.clone(), on_b.clone(), pair_done.clone());
        tokio::spawn(async move {
            for _ in 0..OPPOSITE_ORDER_ROUNDS {
                let guard = dlock_runtime::lock_all(keys.clone())
                    .wait(30 * SECOND)
                    .acquire()
                    .await
                    .expect("a hold of both keys within the wait");
                on_a.enter();
                on_b.enter();
                tokio::task::yield_now().await;
                on_b.leave();
                on_a.leave();
                guard.release().await.expect("release");
            }
            pair_done.fetch_add(1, Ordering::SeqCst);
        })
    };
    let forward = pair([a.clone(), b.clone()]);
    let backward = pair([b.clone(), a.clone()]);
    let single = tokio::spawn({
        let (a, on_a, pair_done) = (a.clone(), on_a.clone(), pair_done.clone());
        async move {
            let mut rounds = 0usize;
            while pair_done.load(Ordering::SeqCst) < 2 {
                let guard = lock(&a)
                    .wait(30 * SECOND)
                    .acquire()
                    .await
                    .expect("the single key within the wait");
                on_a.enter();
                tokio::task::yield_now().await;
                on_a.leave();
                guard.release().await.expect("release");
                rounds += 1;
                // Leaves the pair a turn: this task checks exclusion, not fairness.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            rounds
        }
    });
    tokio::time::timeout(300 * SECOND, async {
        forward.await.expect("forward task");
        backward.await.expect("backward task");
    })
    .await
    .expect("the two orders finish: they never wait on each other for ever");
    let single_rounds = single.await.expect("single task");
    assert!(single_rounds > 0, "the single-key task never ran");
    assert_eq!(
        on_a.overlaps.load(Ordering::SeqCst),
        0,
        "two holders of `{a}`"
    );
    assert_eq!(
        on_b.overlaps.load(Ordering::SeqCst),
        0,
        "two holders of `{b}`"
    );
}

/// One key held elsewhere: the hold is busy (naming that key), within its
/// one wait budget, and the other keys are free afterwards.
async fn several_keys_all_or_nothing(h: &Harness) {
    let keys = [
        unique_key("all-or-nothing-1"),
        unique_key("all-or-nothing-2"),
        unique_key("all-or-nothing-3"),
    ];
    let elsewhere = lock(&keys[1]).acquire().await.expect("acquire");
    for wait in [Duration::ZERO, Duration::from_millis(300)] {
        let started = Instant::now();
        let err = dlock_runtime::lock_all(keys.iter().rev())
            .wait(wait)
            .acquire()
            .await
            .expect_err("one key is held elsewhere");
        let took = started.elapsed();
        assert!(
            matches!(&err, LockError::Busy { key, .. } if *key == keys[1]),
            "expected Busy naming {}, got {err:?}",
            keys[1]
        );
        assert!(
            took >= wait,
            "gave up after {took:?}, before the wait of {wait:?}"
        );
        assert!(
            took < wait + 5 * SECOND,
            "one wait budget for all: took {took:?}"
        );
        for key in [&keys[0], &keys[2]] {
            assert_free(h, key, "a busy hold of several keys").await;
        }
        assert!(h.faults.is_held(&h.stored(&keys[1])).await);
    }
    elsewhere.release().await.expect("release");
    let guard = dlock_runtime::lock_all(&keys)
        .acquire()
        .await
        .expect("every key free");
    for key in &keys {
        assert!(h.faults.is_held(&h.stored(key)).await, "`{key}` not held");
    }
    guard.release().await.expect("release");
    for key in &keys {
        assert_free(h, key, "released hold of several keys").await;
    }
}

/// Waits until `key` is free on the server (a background release), up to
/// 10 s: past the backstop release of a statement whose caller left (7 s on
/// SQLite, whose statement may land after the first clean-up), far below
/// the default lease.
async fn eventually_free(h: &Harness, key: &str, why: &str) {
    let until = Instant::now() + 10 * SECOND;
    while h.faults.is_held(&h.stored(key)).await {
        assert!(Instant::now() < until, "{why}: `{key}` is still held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A hold of several keys dropped at each of its awaits in turn leaves
/// nothing held; so does one dropped while it waits for a busy key.
async fn several_keys_cancelled_at_each_await_leave_nothing_held(h: &Harness) {
    let keys = [
        unique_key("cancel-each-1"),
        unique_key("cancel-each-2"),
        unique_key("cancel-each-3"),
    ];
    let mut completed = false;
    for polls in 1..=200usize {
        let mut acquisition = Box::pin(dlock_runtime::lock_all(&keys).wait(10 * SECOND).acquire());
        let mut pending = 0usize;
        let answer = std::future::poll_fn(|cx| match acquisition.as_mut().poll(cx) {
            std::task::Poll::Ready(answer) => std::task::Poll::Ready(Some(answer)),
            std::task::Poll::Pending => {
                pending += 1;
                if pending >= polls {
                    std::task::Poll::Ready(None)
                } else {
                    std::task::Poll::Pending
                }
            }
        })
        .await;
        drop(acquisition);
        match answer {
            Some(guard) => {
                guard.expect("acquire").release().await.expect("release");
                completed = true;
                break;
            }
            None => {
                for key in &keys {
                    eventually_free(h, key, &format!("dropped after {polls} polls")).await;
                }
            }
        }
    }
    assert!(
        completed,
        "the acquisition never completed within 200 polls"
    );

    // Dropped while it waits for the middle key: the first is released, and
    // the middle one is not taken once its holder lets go.
    let elsewhere = lock(&keys[1]).acquire().await.expect("acquire");
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        dlock_runtime::lock_all(&keys).wait(60 * SECOND).acquire(),
    )
    .await;
    assert!(abandoned.is_err(), "the middle key was busy throughout");
    elsewhere.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(500)).await;
    for key in &keys {
        eventually_free(h, key, "abandoned while waiting").await;
    }
}

#[distributed_lock(keys = ["{a}", "{b}"], lease = "900ms")]
async fn counts_under_two_keys(a: &str, b: &str, counter: &AtomicUsize) -> Result<(), AppError> {
    for _ in 0..200 {
        counter.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(())
}

/// The loss of one key of a hold is the loss of the hold: the body is
/// cancelled, the error names the lost key, and the other key is freed.
async fn loss_of_one_key_cancels_the_body_of_several(h: &Harness) {
    let (a, b) = (unique_key("lost-one-a"), unique_key("lost-one-b"));
    let counter = Arc::new(AtomicUsize::new(0));
    let call = tokio::spawn({
        let (a, b, counter) = (a.clone(), b.clone(), counter.clone());
        async move { counts_under_two_keys(&a, &b, &counter).await }
    });
    let result = revoke_and_expect_the_body_cancelled(h, &b, call, &counter).await;
    if let Err(AppError::Lock(LockError::Lost { key })) = &result {
        assert_eq!(*key, b, "the error names the lost key");
    }
    eventually_free(h, &a, "the key that was not lost").await;
}

#[distributed_lock(keys = ["{b}", "{a}"], lease = "30s")]
async fn reports_every_key(
    a: &str,
    b: &str,
) -> Result<
    (
        Vec<String>,
        Option<FencingToken>,
        Option<FencingToken>,
        Option<FencingToken>,
    ),
    AppError,
> {
    let current = dlock_runtime::current().expect("inside");
    Ok((
        current.keys(),
        current.fencing_token(),
        current.fencing_token_of(a),
        current.fencing_token_of(b),
    ))
}

/// Each key of a hold has its own token (the first key's is the hold's), and
/// a later holder of each key gets a greater one.
async fn several_keys_tokens_per_key(h: &Harness) {
    let (a, b) = (unique_key("tokens-a"), unique_key("tokens-b"));
    let guard = dlock_runtime::lock_all([&b, &a, &b])
        .acquire()
        .await
        .expect("acquire");
    assert_eq!(
        guard.keys(),
        [a.clone(), b.clone()],
        "canonical order, each key once"
    );
    assert_eq!(guard.key(), a);
    let (ta, tb) = (guard.fencing_token_of(&a), guard.fencing_token_of(&b));
    assert_eq!(
        guard.fencing_token(),
        ta,
        "the hold's token is the first key's"
    );
    assert_eq!(guard.fencing_token_of("not-a-key-of-this-hold"), None);
    assert_eq!(ta.is_some() && tb.is_some(), h.fences, "{ta:?} {tb:?}");
    guard.release().await.expect("release");

    let (keys, first, of_a, of_b) = reports_every_key(&a, &b).await.expect("runs");
    assert_eq!(keys, [a.clone(), b.clone()]);
    assert_eq!(first, of_a);
    if h.fences {
        assert!(
            of_a > ta && of_b > tb,
            "{ta:?} {tb:?} then {of_a:?} {of_b:?}"
        );
        let later = lock(&b).acquire().await.expect("acquire");
        assert!(later.fencing_token() > of_b);
        later.release().await.expect("release");
    }
}

#[distributed_lock(keys = ["{a}", "{b}"], lease = "30s")]
async fn holds_two_keys(a: &str, b: &str, c: &str) -> Result<(), AppError> {
    // Every key held up the chain: enters at once, in any order.
    let both = dlock_runtime::lock_all([b, a]).acquire().await?;
    assert_eq!(
        both.fencing_token_of(a),
        dlock_runtime::current()
            .expect("inside")
            .fencing_token_of(a)
    );
    both.release().await?;
    // One of them alone enters at once too.
    let one = lock(b).acquire().await?;
    one.release().await?;
    // Some of them and another key: a configuration error at once.
    let started = Instant::now();
    let err = dlock_runtime::lock_all([a, c])
        .wait(10 * SECOND)
        .acquire()
        .await
        .expect_err("holds only some of the keys");
    assert!(matches!(err, LockError::Config { .. }), "{err:?}");
    assert!(started.elapsed() < SECOND, "not at once");
    Ok(())
}

/// A call chain holding every key enters a hold of them at once; one holding
/// only some gets `LockError::Config` at once.
async fn several_keys_reentrancy(h: &Harness) {
    let (a, b, c) = (unique_key("re-a"), unique_key("re-b"), unique_key("re-c"));
    tokio::time::timeout(10 * SECOND, holds_two_keys(&a, &b, &c))
        .await
        .expect("never waits on itself")
        .expect("runs");
    for key in [&a, &b, &c] {
        assert_free(h, key, "after the outer hold").await;
    }
}

/// `inspect` reads the holder from the server: this process, the guard's
/// token, a lease counting down; a free key is `None`.
async fn inspect_shows_this_process_and_the_guards_token(h: &Harness) {
    let registry = h.registry();
    let key = unique_key("inspect");
    assert_eq!(
        registry.inspect(&key).await.expect("inspect a free key"),
        None
    );
    let before = std::time::SystemTime::now();
    let guard = lock(&key)
        .lease(10 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let after = std::time::SystemTime::now();
    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("a held key is shown");
    assert_eq!(info.key(), key);
    let [holder] = info.holders() else {
        panic!("one holder expected: {info:?}");
    };
    assert_eq!(holder.pid(), Some(std::process::id()), "{holder:?}");
    assert!(holder.host().is_some_and(|h| !h.is_empty()), "{holder:?}");
    assert!(!holder.is_reader());
    assert_eq!(holder.slot(), None);
    if h.fences {
        assert_eq!(holder.token(), guard.fencing_token(), "{holder:?}");
    }
    if let Some(left) = holder.expires_in() {
        assert!(
            left > Duration::ZERO && left <= 10 * SECOND,
            "expires in {left:?}"
        );
    }
    if let Some(granted) = holder.granted_at() {
        // The server's clock; the servers run on this machine.
        let slack = 5 * SECOND;
        assert!(
            granted + slack >= before && granted <= after + slack,
            "granted at {granted:?}, acquired between {before:?} and {after:?}"
        );
    }
    guard.release().await.expect("release");
    assert_eq!(
        registry.inspect(&key).await.expect("inspect after release"),
        None
    );
}

/// `inspect` counts a waiter where the backend knows its waiters.
async fn inspect_counts_waiters_where_known(h: &Harness) {
    let registry = h.registry();
    let key = unique_key("inspect-waiters");
    let guard = lock(&key)
        .lease(10 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move { lock(&key).wait(30 * SECOND).acquire().await }
    });
    let deadline = Instant::now() + 10 * SECOND;
    loop {
        let info = registry
            .inspect(&key)
            .await
            .expect("inspect")
            .expect("held");
        match info.waiters() {
            None | Some(1) => break,
            Some(n) => assert!(
                Instant::now() < deadline,
                "still {n} waiters shown, one waits"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    guard.release().await.expect("release");
    let second = tokio::time::timeout(10 * SECOND, waiter)
        .await
        .expect("the waiter gets the key")
        .expect("task")
        .expect("acquire after the release");
    second.release().await.expect("release");
}

/// `list` shows the held keys under a prefix, in key order, up to the limit.
async fn list_shows_held_keys_under_a_prefix(h: &Harness) {
    let registry = h.registry();
    let prefix = unique_key("list");
    let keys = [
        format!("{prefix}:b"),
        format!("{prefix}:a"),
        format!("{prefix}:c"),
    ];
    let outside = unique_key("lisu");
    let mut guards = Vec::new();
    for key in keys.iter().chain([&outside]) {
        guards.push(
            lock(key)
                .lease(10 * SECOND)
                .acquire()
                .await
                .expect("acquire"),
        );
    }
    let listed = registry.list(&prefix, 10).await.expect("list");
    let names: Vec<&str> = listed.iter().map(|i| i.key()).collect();
    let mut expected: Vec<&str> = keys.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(names, expected);
    for info in &listed {
        assert_eq!(info.holders().len(), 1, "{info:?}");
        assert_eq!(info.holders()[0].pid(), Some(std::process::id()));
    }
    let two = registry.list(&prefix, 2).await.expect("list with a limit");
    let names: Vec<&str> = two.iter().map(|i| i.key()).collect();
    assert_eq!(names, expected[..2]);
    assert!(registry.list(&prefix, 0).await.expect("limit 0").is_empty());
    for guard in guards {
        guard.release().await.expect("release");
    }
    assert!(
        registry
            .list(&prefix, 10)
            .await
            .expect("list after release")
            .is_empty(),
        "released keys are not listed"
    );
}

/// `revoke` takes a key from its holder: the holder learns within a renewal
/// period, the key is free at once, and the next token is larger.
async fn revoke_makes_the_holder_lost_and_the_next_token_larger(h: &Harness) {
    let registry = h.registry();
    let key = unique_key("revoke");
    assert!(
        registry
            .revoke(&key)
            .await
            .expect("revoke a free key")
            .is_empty(),
        "nothing to revoke on a free key"
    );
    let guard = lock(&key)
        .lease(3 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let revoked = registry.revoke(&key).await.expect("revoke");
    let [holder] = revoked.as_slice() else {
        panic!("one holder revoked: {revoked:?}");
    };
    assert_eq!(holder.pid(), Some(std::process::id()));
    if h.fences {
        assert_eq!(holder.token(), guard.fencing_token());
    }
    let next = lock(&key)
        .wait(10 * SECOND)
        .lease(10 * SECOND)
        .acquire()
        .await
        .expect("the key is free for another holder after a revocation");
    if h.fences {
        assert!(
            next.fencing_token() > guard.fencing_token(),
            "next token {:?} after the revoked {:?}",
            next.fencing_token(),
            guard.fencing_token()
        );
    }
    tokio::time::timeout(10 * SECOND, guard.lost())
        .await
        .expect("the revoked holder learns within a renewal period");
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("the new holder keeps the key after the old one's release");
    assert_eq!(info.holders()[0].token(), next.fencing_token());
    next.release().await.expect("release");
}

#[distributed_lock(key = "{key}", lease = "3s", on_lost = "cancel")]
async fn held_until_revoked(key: &str, started: &tokio::sync::Notify) -> Result<(), AppError> {
    started.notify_one();
    tokio::time::sleep(60 * SECOND).await;
    Ok(())
}

/// A revoked body under `on_lost = "cancel"` stops with `Lost`.
async fn revoke_cancels_the_body(h: &Harness) {
    let registry = h.registry();
    let key = unique_key("revoke-body");
    let started = Arc::new(tokio::sync::Notify::new());
    let body = tokio::spawn({
        let (key, started) = (key.clone(), started.clone());
        async move { held_until_revoked(&key, &started).await }
    });
    started.notified().await;
    let revoked = registry.revoke(&key).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    let answer = tokio::time::timeout(10 * SECOND, body)
        .await
        .expect("the body is cancelled within a renewal period")
        .expect("task");
    assert!(
        is_lock_err(&answer, |e| matches!(e, LockError::Lost { .. })),
        "{answer:?}"
    );
}

crate::suite!(
    conformance_suite,
    conformance,
    &crate::Harness,
    "`$harness().await` (an `async fn() -> &'static Harness`)";
    mutual_exclusion,
    mutual_exclusion_through_the_attribute,
    fencing_tokens_strictly_increase,
    release_after_return,
    release_after_question_mark,
    release_after_panic,
    release_after_cancellation,
    expiry_when_the_holder_vanishes,
    watchdog_keeps_a_long_body_locked,
    lost_lease_cancels_the_body,
    lost_lease_with_on_lost_continue_lets_the_body_finish,
    lost_lease_reaches_a_guard_holder,
    reentrancy_within_a_task,
    skip_policy,
    fail_policy_and_wait_budget,
    hold_at_least_keeps_the_key_after_the_body,
    watchdog_false_is_a_hard_cap,
    release_wakes_a_waiter_quickly,
    current_inside_and_outside,
    invalid_keys_are_rejected,
    fuzzed_keys_never_collide,
    fuzzed_template_values_reach_the_backend_verbatim,
    unknown_backend_is_an_error,
    wait_forever_and_the_minimum_lease,
    an_abandoned_waiter_takes_nothing,
    several_keys_in_opposite_orders_never_deadlock,
    several_keys_all_or_nothing,
    several_keys_cancelled_at_each_await_leave_nothing_held,
    loss_of_one_key_cancels_the_body_of_several,
    several_keys_tokens_per_key,
    several_keys_reentrancy,
    inspect_shows_this_process_and_the_guards_token,
    inspect_counts_waiters_where_known,
    list_shows_held_keys_under_a_prefix,
    revoke_makes_the_holder_lost_and_the_next_token_larger,
    revoke_cancels_the_body,
);
