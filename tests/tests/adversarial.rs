//! Adversarial tests of the runtime core, written by a review whose brief was
//! to break it: each failed on the code it was written against (the comment
//! says how, and which clause of DESIGN.md it broke) and passes since the fix.
//!
//! In-process backends only (memory, SQLite on a temporary file); the Redis
//! cases are in `adversarial_redis.rs`. Faults come from the memory backend's
//! hooks and from polling futures by hand (`now_or_never`), never from timing
//! luck.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dlock_runtime::{LockError, LockGuard, MemoryBackend, Registry, distributed_lock};
use futures_util::FutureExt;
use tokio::sync::{OnceCell, oneshot};

const MS: Duration = Duration::from_millis(1);

fn memory_registry() -> (MemoryBackend, Registry) {
    let mem = MemoryBackend::new();
    let registry = Registry::builder().default_backend(mem.clone()).build();
    (mem, registry)
}

// ---------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------

/// Shutdown racing an acquisition already waiting in the wait loop.
///
/// A holder and a waiter in the same registry. `shutdown` marks the holder
/// lost and releases it; the release wakes the local waiter, which takes the
/// key and gets a guard — after shutdown began, and unseen by shutdown.
///
/// Contract (§3, `Registry::shutdown` docs): shutdown "releases every held
/// lease", and "new acquisitions fail with `LockError::ShutDown` from now
/// on". Here a lease is granted after shutdown started, shutdown reports
/// nothing unfinished, and the key stays held by a process that is going
/// away (renewed by its watchdog) — the next replica of a rolling deploy
/// waits for it. Fault: the wait loop (`backend::wait::acquire`) never looks
/// at `Leases::is_closing` again after `lock::acquire` checked it once, and
/// a grant that arrives while closing is not refused/released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_a_grant_to_a_waiter_it_woke() {
    let (mem, registry) = memory_registry();
    let key = "adv:shutdown-waiter";
    let holder = registry
        .lock(key)
        .lease(Duration::from_secs(10))
        .acquire()
        .await
        .expect("holder");
    let waiter = tokio::spawn({
        let registry = registry.clone();
        async move {
            registry
                .lock(key)
                .wait(Duration::from_secs(5))
                .lease(Duration::from_secs(10))
                .acquire()
                .await
        }
    });
    // The waiter has tried, registered its wake-up and sleeps on it.
    tokio::time::sleep(100 * MS).await;
    let report = registry.shutdown(Duration::from_secs(2)).await;
    let got = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the waiter answers")
        .expect("task");
    let escaped = got.is_ok();
    let still_held = mem.held_keys();
    let held = registry.held_leases();
    drop(holder);
    drop(got);
    assert!(
        !escaped && still_held.is_empty() && held == 0,
        "after shutdown ({report:?}) an acquisition that was waiting got the key \
         (acquire ok: {escaped}); keys still held on the backend: {still_held:?}, \
         leases the registry still holds: {held}"
    );
}

// ---------------------------------------------------------------------------
// Cancellation of an acquisition on dlock's I/O runtime
// ---------------------------------------------------------------------------

/// The caller drops an acquisition (SQLite: it runs on dlock's I/O runtime)
/// after the I/O task has been granted the key and handed it over, but before
/// the caller's future was polled again to take it.
///
/// `acquire_on_io_runtime` releases a grant only when `tx.send` fails (the
/// receiver already gone). Here the send succeeds — the value sits in the
/// oneshot — and then the receiver is dropped with the caller's future: the
/// `Lease` is dropped with it, nobody releases it and nobody renews it, so
/// the key stays taken for the whole lease (30 s by default) by an
/// acquisition whose caller is gone.
///
/// Contract: §5.6 "dropping the caller's future at any point — while
/// acquiring … — an abandoned acquisition stops" and the function's own doc
/// ("whatever the task … was granted for a caller that is gone, is released
/// at once"). Poll-once + drop is exactly a `select!`/`timeout` that fires
/// in the tick in which the grant arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_io_runtime_acquisition_dropped_after_its_grant_releases_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}/adv.db", dir.path().display());
    let mine = Registry::from_url(&url).await.expect("sqlite");
    let other = Registry::from_url(&url).await.expect("sqlite");
    let key = "adv:io-grant-dropped";

    let mut acquiring = Box::pin(mine.lock(key).lease(Duration::from_secs(5)).acquire());
    assert!(
        (&mut acquiring).now_or_never().is_none(),
        "the first poll hands the attempt to the I/O runtime"
    );
    // The I/O task is granted the key and sends it to the (still living) receiver.
    tokio::time::sleep(500 * MS).await;
    drop(acquiring);
    // Give any clean-up a generous moment.
    tokio::time::sleep(500 * MS).await;

    let next = other.lock(key).acquire().await;
    assert!(
        next.is_ok(),
        "the key is still held by an acquisition whose caller dropped it: {next:?}"
    );
}

// ---------------------------------------------------------------------------
// Reentrancy
// ---------------------------------------------------------------------------

/// A nested guard that outlives the scope it was taken in keeps the outer
/// lock alive after the outer holder released it.
///
/// The outer guard's `release()` answers `Ok(())` — but only drops one hold
/// of the shared lease (`LockGuard::release`: `!held.drop_hold()` ⇒ return):
/// the key stays held on the backend and the watchdog keeps renewing it, for
/// as long as the nested guard lives (moved into a struct, a spawned task,
/// returned out of a `#[distributed_lock]` body).
///
/// Contract: §2 Guaranteed release "The lock is released as soon as the body
/// ends"; `LockGuard::release` docs "Releases the lock now"; §5.3 "after
/// return … the key is gone from the server at once". A nested hold "shares
/// the outer lease" — it cannot extend it past the outer holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outer_release_frees_the_key_while_a_nested_guard_lives() {
    let (mem, registry) = memory_registry();
    let key = "adv:nested-escapes";
    let outer = registry
        .lock(key)
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("outer");
    let nested = outer
        .scope(registry.lock(key).acquire())
        .await
        .expect("reentrant entry");
    let released = outer.release().await;
    assert!(released.is_ok(), "{released:?}");
    // Well past the 300 ms lease: only renewals can keep it.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let held = mem.held_keys();
    let renewals = mem.renewal_count();
    drop(nested);
    assert!(
        held.is_empty(),
        "the outer release answered Ok, yet {held:?} is still held \
         ({renewals} renewals so far)"
    );
}

/// The same shape, lost lease: the outer `release()` says `Ok(())` although
/// the lease was lost while it was held.
///
/// Contract: `LockGuard::release` docs "reports how it went:
/// `Err(LockError::Lost)` if the lease had been lost while held — the
/// protected work may have overlapped with another holder's". The early
/// return for a non-last hold checks `is_lost` only when the guard being
/// released is itself nested (`was_nested && held.is_lost()`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outer_release_reports_a_loss_while_a_nested_guard_lives() {
    let (mem, registry) = memory_registry();
    let key = "adv:nested-hides-loss";
    let outer = registry
        .lock(key)
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("outer");
    let nested = outer
        .scope(registry.lock(key).acquire())
        .await
        .expect("reentrant entry");
    assert!(mem.expire_now(&format!("dlock:{key}")));
    tokio::time::timeout(Duration::from_secs(2), outer.lost())
        .await
        .expect("the loss reaches the holder at its next renewal");
    assert!(outer.is_lost());
    let released = outer.release().await;
    drop(nested);
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "release of a lost lease answered {released:?}"
    );
}

/// A nested guard kept while the same code calls another function locking
/// the key: the guard is a nested holder that is "inside", so the call takes
/// its turn like a sibling would (the issue's rule: "a nested acquisition
/// enters at once only if no other nested holder of the same scope is
/// inside") — `Busy` with `wait = 0`. Code meant to run *under* the nested
/// guard runs in its `scope`, and enters at once there; after the nested
/// guard's release, the next call enters at once too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_guard_is_a_holder_its_own_scope_is_the_call_chain() {
    let (_mem, registry) = memory_registry();
    let key = "adv:call-chain";

    async fn locks_the_same_key(registry: &Registry, key: &str) -> Result<LockGuard, LockError> {
        registry.lock(key).acquire().await
    }

    let outer = registry.lock(key).acquire().await.expect("outer");
    outer
        .scope(async {
            let first = locks_the_same_key(&registry, key).await.expect("enters");
            let beside = locks_the_same_key(&registry, key).await;
            assert!(
                matches!(beside, Err(LockError::Busy { .. })),
                "a second nested holder beside a live one: {beside:?}"
            );
            let under = first.scope(locks_the_same_key(&registry, key)).await;
            under
                .expect("under the nested guard, in its scope")
                .release()
                .await
                .expect("release");
            first.release().await.expect("release");
            let after = locks_the_same_key(&registry, key).await;
            after
                .expect("after the nested guard's release")
                .release()
                .await
                .expect("release");
        })
        .await;
    outer.release().await.expect("release");
}

/// Siblings under one lease run *concurrently* when each is polled inside
/// its own `scope` of the same guard.
///
/// The gate that makes siblings take turns belongs to the scope frame
/// (`context::scope` makes a fresh `Semaphore::new(1)` per call), not to the
/// lease: `join!(g.scope(a), g.scope(b))` — or `join_all(items.map(|i|
/// g.scope(work(i))))` — gives every sibling a gate of its own, and each
/// enters at once.
///
/// Contract (§2 Reentrancy): "Sibling futures polled inside the scope
/// (`join!`, `select!`, `FuturesUnordered` …) are *not* one call chain: they
/// take turns, each within its own `wait`."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_in_separate_scopes_of_one_guard_take_turns() {
    let (_mem, registry) = memory_registry();
    let key = "adv:sibling-scopes";
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let work = || {
        let (registry, inside, most) = (registry.clone(), inside.clone(), most.clone());
        async move {
            let guard = registry
                .lock(key)
                .wait(Duration::from_secs(2))
                .acquire()
                .await
                .expect("takes its turn");
            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(50 * MS).await;
            inside.fetch_sub(1, Ordering::SeqCst);
            guard.release().await.expect("release");
        }
    };
    let outer = registry.lock(key).acquire().await.expect("outer");
    tokio::join!(outer.scope(work()), outer.scope(work()));
    outer.release().await.expect("release");
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two siblings held the key's nested hold at the same time"
    );
}

// ---------------------------------------------------------------------------
// on_lost = "cancel"
// ---------------------------------------------------------------------------

async fn global() {
    static INIT: OnceCell<()> = OnceCell::const_new();
    INIT.get_or_init(|| async {
        dlock_runtime::init(
            Registry::builder()
                .default_backend(MemoryBackend::new())
                .build(),
        )
        .expect("first init");
    })
    .await;
}

type Lost = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Hard cap of 200 ms (no watchdog): lost at its give-up instant.
#[distributed_lock(key = "adv:cancel:{id}", lease = "200ms", watchdog = false)]
async fn waits_for_go(
    id: u64,
    lost: oneshot::Sender<Lost>,
    go: oneshot::Receiver<()>,
    ran_after_loss: Arc<AtomicBool>,
) -> Result<(), LockError> {
    let current = dlock_runtime::current().expect("inside the lock");
    let _ = lost.send(Box::pin(current.lost()));
    let _ = go.await;
    // Code after the `.await` at which the body should have been stopped.
    ran_after_loss.store(current.is_lost(), Ordering::SeqCst);
    Ok(())
}

/// `on_lost = "cancel"` (the default): the lease is lost and *signalled*
/// while the body waits; when the task is next polled the body's own await
/// is ready too (its I/O answered in the same tick). The attribute's
/// `select!` is `biased` towards the body, so the body resumes, runs past
/// the loss, and the function returns `Ok(())`; the release then answers
/// `Lost` and is only logged ("on_lost = continue" wording).
///
/// Contract (§2 table, §5.4): `on_lost = "cancel"`: "when the lease is lost,
/// stop the body at its next `.await` and return the lost error". Fault:
/// `private::run` polls the body before the loss signal (`biased; out =
/// body`) and does not turn a `Lost` release into the lost error for the
/// cancel policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_policy_returns_lost_when_the_body_would_resume_after_the_loss() {
    global().await;
    let (lost_tx, lost_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel();
    let ran_after_loss = Arc::new(AtomicBool::new(false));
    let mut call = Box::pin(waits_for_go(
        rand::random(),
        lost_tx,
        go_rx,
        ran_after_loss.clone(),
    ));
    assert!(
        (&mut call).now_or_never().is_none(),
        "acquired; the body waits for `go`"
    );
    let lost = lost_rx.await.expect("the body started");
    tokio::time::timeout(Duration::from_secs(2), lost)
        .await
        .expect("the hard cap loses the lease");
    // The body's awaited I/O answers before the task is polled again.
    go_tx.send(()).expect("body waiting");
    let out = call.await;
    assert!(
        matches!(out, Err(LockError::Lost { .. })) && !ran_after_loss.load(Ordering::SeqCst),
        "on_lost = cancel, lease lost (and signalled) before the body resumed: \
         returned {out:?}, body ran past the loss: {}",
        ran_after_loss.load(Ordering::SeqCst)
    );
}
