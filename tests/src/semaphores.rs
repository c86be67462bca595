//! The semaphore cases (`permits(n)`), run by every backend that offers
//! semaphores. Each takes the [`Harness`] of the backend under test.
// A case left off the list at the end is unused: dead code fails the build.
#![deny(dead_code)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, lock};
use futures_util::StreamExt;

use crate::{Harness, unique_key};

const SECOND: Duration = Duration::from_secs(1);

/// Takes one of `n` permits of `key`, trying once, with a 30 s lease.
async fn permit_now(key: &str, n: u32) -> Result<LockGuard, LockError> {
    lock(key).permits(n).lease(30 * SECOND).acquire().await
}

/// Whether `r` is a [`LockError::Config`] whose message contains every one of `words`.
fn is_config_naming<T: std::fmt::Debug>(r: &Result<T, LockError>, words: &[&str]) -> bool {
    matches!(r, Err(LockError::Config { message }) if words.iter().all(|w| message.contains(w)))
}

/// Waits up to 5 s for `key` to be free on the server.
async fn eventually_free(h: &Harness, key: &str, why: &str) {
    let until = Instant::now() + 5 * SECOND;
    while h.faults.is_held(&h.stored(key)).await {
        assert!(Instant::now() < until, "{why}: `{key}` is still held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Twelve tasks competing for three permits: never more than three inside
/// at once, and every task gets its turn.
async fn at_most_n_holders_at_once(_h: &Harness) {
    let key = unique_key("sem-at-most-n");
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..12)
        .map(|_| {
            let (key, inside, most) = (key.clone(), inside.clone(), most.clone());
            tokio::spawn(async move {
                for _ in 0..3 {
                    let guard = lock(&key)
                        .permits(3)
                        .wait(60 * SECOND)
                        .lease(30 * SECOND)
                        .acquire()
                        .await
                        .expect("a permit within the wait");
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    tokio::time::timeout(120 * SECOND, futures_util::future::join_all(tasks))
        .await
        .expect("every task got its permits")
        .into_iter()
        .for_each(|t| t.expect("task"));
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 3, "{most} holders of 3 permits at once");
    assert!(
        most >= 2,
        "the permits were never shared: at most {most} at once"
    );
}

/// Holders at the same time have distinct slots `0..n`; one more is busy.
async fn concurrent_holders_have_distinct_slots(_h: &Harness) {
    let key = unique_key("sem-slots");
    let mut guards = Vec::new();
    for _ in 0..3 {
        guards.push(permit_now(&key, 3).await.expect("a free permit"));
    }
    let slots: BTreeSet<u32> = guards
        .iter()
        .map(|g| g.permit().expect("a permit has a slot"))
        .collect();
    assert_eq!(slots, BTreeSet::from([0, 1, 2]));
    let fourth = permit_now(&key, 3).await;
    assert!(
        matches!(fourth, Err(LockError::Busy { .. })),
        "a fourth holder of 3 permits: {fourth:?}"
    );
    for guard in guards {
        guard.release().await.expect("release");
    }
}

/// A later grant of a slot carries a larger fencing token than every
/// earlier grant of that slot.
async fn a_later_grant_of_a_slot_has_a_larger_token(h: &Harness) {
    if !h.fences {
        return;
    }
    let key = unique_key("sem-slot-tokens");
    let first = permit_now(&key, 2).await.expect("slot 0");
    let second = permit_now(&key, 2).await.expect("slot 1");
    assert_eq!((first.permit(), second.permit()), (Some(0), Some(1)));
    let mut last = [
        first.fencing_token().expect("token"),
        second.fencing_token().expect("token"),
    ];
    let mut held = [Some(first), Some(second)];
    for round in 0..6 {
        let slot = round % 2;
        held[slot]
            .take()
            .expect("held")
            .release()
            .await
            .expect("release");
        let again = permit_now(&key, 2).await.expect("the freed slot");
        assert_eq!(again.permit(), Some(slot as u32), "the free slot is taken");
        let token = again.fencing_token().expect("token");
        assert!(
            token > last[slot],
            "slot {slot}: token {token:?} after {:?}",
            last[slot]
        );
        last[slot] = token;
        held[slot] = Some(again);
    }
    for guard in held.into_iter().flatten() {
        guard.release().await.expect("release");
    }
}

/// Another number of permits while the semaphore has holders is a `Config`
/// error naming both numbers; once every permit is free it is accepted.
async fn a_different_permit_count_while_held_is_a_config_error(_h: &Harness) {
    let key = unique_key("sem-mismatch");
    let guard = permit_now(&key, 3).await.expect("acquire");
    let other = lock(&key).permits(5).wait(2 * SECOND).acquire().await;
    assert!(
        is_config_naming(&other, &["3", "5"]),
        "5 permits on a semaphore of 3: {other:?}"
    );
    guard.release().await.expect("release");
    let five = permit_now(&key, 5)
        .await
        .expect("5 permits once the 3 are free");
    assert_eq!(five.permit(), Some(0));
    five.release().await.expect("release");
}

/// A plain lock or a reader on a held semaphore, and a semaphore on a held
/// plain lock, are `Config` errors.
async fn a_plain_lock_on_a_held_semaphore_is_a_config_error(_h: &Harness) {
    let key = unique_key("sem-plain");
    let guard = permit_now(&key, 3).await.expect("acquire");
    let plain = lock(&key).wait(SECOND).acquire().await;
    assert!(
        matches!(plain, Err(LockError::Config { .. })),
        "a plain lock on a held semaphore: {plain:?}"
    );
    guard.release().await.expect("release");

    let plain = lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("plain");
    let permit = lock(&key).permits(3).wait(SECOND).acquire().await;
    assert!(
        matches!(permit, Err(LockError::Config { .. })),
        "a permit on a held plain lock: {permit:?}"
    );
    plain.release().await.expect("release");
}

/// A release hands the permit to a waiter at once, not at the lease's end.
async fn a_release_wakes_a_permit_waiter_promptly(_h: &Harness) {
    let key = unique_key("sem-wake");
    let a = permit_now(&key, 2).await.expect("first");
    let b = permit_now(&key, 2).await.expect("second");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let guard = lock(&key)
                .permits(2)
                .wait(25 * SECOND)
                .lease(30 * SECOND)
                .acquire()
                .await;
            (guard, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "both permits were held");
    let released = Instant::now();
    a.release().await.expect("release");
    let (guard, granted) = waiter.await.expect("task");
    let guard = guard.expect("the freed permit");
    let took = granted - released;
    assert!(
        took < 5 * SECOND,
        "granted {took:?} after the release, with 30 s leases"
    );
    guard.release().await.expect("release");
    b.release().await.expect("release");
}

/// A holder that vanishes (no renewal, no release) frees its permit after
/// its lease, and only its own.
async fn a_crashed_holders_permit_frees_after_its_lease(_h: &Harness) {
    let key = unique_key("sem-crash");
    let lease = Duration::from_millis(600);
    let alive = permit_now(&key, 2).await.expect("acquire");
    let crashed = lock(&key)
        .permits(2)
        .lease(lease)
        .watchdog(false)
        .acquire()
        .await
        .expect("acquire");
    std::mem::forget(crashed);
    let started = Instant::now();
    let next = lock(&key)
        .permits(2)
        .wait(10 * SECOND)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("the crashed holder's permit after its lease");
    let took = started.elapsed();
    assert!(
        took >= lease / 2,
        "granted after {took:?}: the crashed holder's permit was not held"
    );
    assert!(took < 5 * SECOND, "took {took:?}");
    let third = permit_now(&key, 2).await;
    assert!(
        matches!(third, Err(LockError::Busy { .. })),
        "the living holder's permit stays taken: {third:?}"
    );
    next.release().await.expect("release");
    alive.release().await.expect("release");
}

/// A permit taken away on the server reaches its holder as a loss, and a
/// body running in its scope sees `current()` lost.
async fn a_lost_permit_reaches_its_holder(h: &Harness) {
    let key = unique_key("sem-lost");
    let guard = lock(&key)
        .permits(3)
        .lease(Duration::from_millis(900))
        .acquire()
        .await
        .expect("acquire");
    let body = guard.scope(async {
        let current = dlock_runtime::current().expect("inside");
        assert_eq!(current.permit(), Some(0));
        tokio::time::timeout(Duration::from_millis(2500), current.lost())
            .await
            .is_ok()
    });
    let revoke = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        h.faults.revoke(&h.stored(&key)).await;
    };
    let (noticed, ()) = tokio::join!(body, revoke);
    assert!(noticed, "the loss did not reach the body");
    assert!(guard.is_lost());
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

/// An acquisition dropped at any of its `.await`s — while it waits, or
/// right after a grant — leaves no permit behind: afterwards every permit
/// is free at once.
async fn a_cancelled_acquisition_leaves_no_permit(h: &Harness) {
    let key = unique_key("sem-cancel");
    let mut completed = false;
    for polls in 1..=200usize {
        let mut acquisition = Box::pin(
            lock(&key)
                .permits(2)
                .wait(10 * SECOND)
                .lease(30 * SECOND)
                .acquire(),
        );
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
            None => eventually_free(h, &key, &format!("dropped after {polls} polls")).await,
        }
    }
    assert!(
        completed,
        "the acquisition never completed within 200 polls"
    );

    // Dropped while waiting for a permit.
    let a = permit_now(&key, 2).await.expect("first");
    let b = permit_now(&key, 2).await.expect("second");
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        lock(&key).permits(2).wait(60 * SECOND).acquire(),
    )
    .await;
    assert!(abandoned.is_err(), "both permits were busy throughout");
    a.release().await.expect("release");
    b.release().await.expect("release");
    eventually_free(h, &key, "abandoned while waiting").await;
    let again = [
        permit_now(&key, 2).await.expect("a free permit"),
        permit_now(&key, 2).await.expect("a second free permit"),
    ];
    for guard in again {
        guard.release().await.expect("release");
    }
}

/// `permits(0)` and more than `MAX_PERMITS` are `Config` errors.
async fn permit_counts_out_of_range_are_config_errors(_h: &Harness) {
    let key = unique_key("sem-range");
    for n in [0, dlock_runtime::backend::MAX_PERMITS + 1] {
        let answer = lock(&key).permits(n).acquire().await;
        assert!(
            is_config_naming(&answer, &[&n.to_string()]),
            "permits({n}): {answer:?}"
        );
    }
}

/// `permits(1)` is the plain lock: it excludes a plain holder and is
/// excluded by one, and has no slot.
async fn one_permit_is_the_plain_lock(_h: &Harness) {
    let key = unique_key("sem-one");
    let plain = lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("plain");
    let one = permit_now(&key, 1).await;
    assert!(
        matches!(one, Err(LockError::Busy { .. })),
        "permits(1) beside a plain holder: {one:?}"
    );
    plain.release().await.expect("release");
    let one = permit_now(&key, 1).await.expect("permits(1)");
    assert_eq!(one.permit(), None, "permits(1) is a plain lock");
    let plain = lock(&key).acquire().await;
    assert!(
        matches!(plain, Err(LockError::Busy { .. })),
        "a plain lock beside permits(1): {plain:?}"
    );
    one.release().await.expect("release");
}

/// After 10,000 distinct semaphores were taken and released, nothing of
/// them is held or kept (where the harness can count what the server keeps).
async fn state_is_bounded_after_ten_thousand_names(h: &Harness) {
    let prefix = unique_key("sem-bounded");
    futures_util::stream::iter(0..10_000)
        .for_each_concurrent(16, |i| {
            let key = format!("{prefix}:{i}");
            async move {
                let guard = permit_now(&key, 3).await.expect("acquire");
                guard.release().await.expect("release");
            }
        })
        .await;
    let held = h.registry().list(&prefix, 10).await.expect("list");
    assert!(held.is_empty(), "still held: {held:?}");
    let left = h.faults.leftover(&h.stored(&prefix)).await;
    assert!(
        left.is_none_or(|n| n == 0),
        "{left:?} entries kept for 10,000 free semaphores"
    );
}

/// `inspect` shows each permit holder with its slot and token.
async fn inspect_shows_each_permit_holder_with_its_slot(h: &Harness) {
    let key = unique_key("sem-inspect");
    let a = permit_now(&key, 3).await.expect("first");
    let b = permit_now(&key, 3).await.expect("second");
    let info = h
        .registry()
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("a held semaphore is shown");
    let mut shown: Vec<_> = info
        .holders()
        .iter()
        .map(|holder| {
            assert!(!holder.is_reader(), "{holder:?}");
            (holder.slot(), holder.token())
        })
        .collect();
    shown.sort();
    let mut expected = vec![
        (a.permit(), a.fencing_token()),
        (b.permit(), b.fencing_token()),
    ];
    expected.sort();
    if h.fences {
        assert_eq!(shown, expected);
    } else {
        let slots: Vec<_> = shown.iter().map(|(slot, _)| *slot).collect();
        assert_eq!(slots, vec![Some(0), Some(1)]);
    }
    a.release().await.expect("release");
    b.release().await.expect("release");
    assert!(
        h.registry().inspect(&key).await.expect("inspect").is_none(),
        "a free semaphore is not shown"
    );
}

crate::suite!(
    semaphore_suite,
    semaphores,
    &crate::Harness,
    "`$harness().await` (an `async fn() -> &'static Harness`)";
    at_most_n_holders_at_once,
    concurrent_holders_have_distinct_slots,
    a_later_grant_of_a_slot_has_a_larger_token,
    a_different_permit_count_while_held_is_a_config_error,
    a_plain_lock_on_a_held_semaphore_is_a_config_error,
    a_release_wakes_a_permit_waiter_promptly,
    a_crashed_holders_permit_frees_after_its_lease,
    a_lost_permit_reaches_its_holder,
    a_cancelled_acquisition_leaves_no_permit,
    permit_counts_out_of_range_are_config_errors,
    one_permit_is_the_plain_lock,
    state_is_bounded_after_ten_thousand_names,
    inspect_shows_each_permit_holder_with_its_slot,
);
