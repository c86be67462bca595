//! Graceful shutdown on the in-process backend: every held lease released at
//! once, a dropped guard's release awaited, and no grant handed to a waiter
//! that the shutdown's own releases woke.

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, MemoryBackend, Registry};
use dlock_tests::memory_support::{Knobbed, eventually, memory_registry, registry};
use dlock_tests::unique_key;
use tokio::task::JoinHandle;

/// `shutdown` releases every held lease at once (the keys are free
/// on the backend when it returns), tells a running body its lease is lost,
/// and refuses new acquisitions (`dlock_tests::scenarios::graceful_shutdown`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_releases_every_lease() {
    let backend = MemoryBackend::new();
    dlock_tests::scenarios::graceful_shutdown(
        &registry(&backend),
        &registry(&backend),
        &dlock_tests::MemoryFaults(backend.clone()),
    )
    .await;
    assert_eq!(backend.entries(), 0);
}

/// A guard dropped just before `shutdown` hands its release to the
/// background; `shutdown` waits for it (up to its deadline, and says when
/// it could not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_dropped_guards_release() {
    let inner = MemoryBackend::new();
    let slow = Knobbed {
        release_delay: Duration::from_millis(300),
        ..Knobbed::new(&inner)
    };
    let reg = Registry::builder().default_backend(slow.clone()).build();
    let key = unique_key("shutdown-dropped");
    drop(reg.lock(&key).acquire().await.expect("acquire"));
    let report = reg.shutdown(Duration::from_secs(2)).await;
    assert_eq!(report.unfinished, 0, "{report:?}");
    assert!(
        inner.held_keys().is_empty(),
        "shutdown returned before the dropped guard's release was done"
    );

    // A deadline shorter than the release: reported as unfinished.
    let inner = MemoryBackend::new();
    let slower = Knobbed {
        release_delay: Duration::from_millis(600),
        ..Knobbed::new(&inner)
    };
    let reg = Registry::builder().default_backend(slower).build();
    drop(reg.lock(&key).acquire().await.expect("acquire"));
    let started = Instant::now();
    let report = reg.shutdown(Duration::from_millis(100)).await;
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(report.unfinished, 1, "{report:?}");
    assert!(
        eventually(Duration::from_secs(2), || inner.held_keys().is_empty()).await,
        "the release finishes after the deadline all the same"
    );
}

const MS: Duration = Duration::from_millis(1);

/// Takes `key` on `registry` with a 10 s lease.
async fn hold(registry: &Registry, key: &str) -> LockGuard {
    registry
        .lock(key)
        .lease(Duration::from_secs(10))
        .acquire()
        .await
        .expect("holder")
}

/// A task that waits up to 5 s for `key` on `registry` (10 s lease), once it
/// has tried, registered its wake-up and sleeps on it (100 ms later).
async fn waiter(registry: &Registry, key: &str) -> JoinHandle<Result<LockGuard, LockError>> {
    let waiter = tokio::spawn({
        let (registry, key) = (registry.clone(), key.to_owned());
        async move {
            registry
                .lock(key)
                .wait(Duration::from_secs(5))
                .lease(Duration::from_secs(10))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(100 * MS).await;
    waiter
}

/// Shutdown racing an acquisition already waiting in the wait loop: a holder
/// and a waiter in the same registry; `shutdown` marks the holder lost and
/// releases it, which wakes the local waiter. The waiter gets
/// an error, not a guard, and the key is free afterwards
/// (DESIGN.md §3: shutdown releases every held lease, and new acquisitions
/// fail with `ShutDown` from then on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_a_grant_to_a_waiter_it_woke() {
    let (mem, registry) = memory_registry();
    let key = "shutdown:shutdown-waiter";
    let holder = hold(&registry, key).await;
    let waiter = waiter(&registry, key).await;
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

/// Once `shutdown` has returned, no key is taken on the backend any more —
/// not even by an acquisition that was already waiting, which shutdown's own
/// release woke (its grant takes 300 ms to answer): shutdown stops it, and
/// waits until whatever it may have been granted has been undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_is_taken_after_shutdown_returns() {
    let inner = MemoryBackend::new();
    let knobbed = Knobbed::new(&inner);
    let registry = Registry::builder().default_backend(knobbed.clone()).build();
    let key = "shutdown:taken-after-return";
    let holder = hold(&registry, key).await;
    knobbed.delay_next_grant(300 * MS);
    let waiter = waiter(&registry, key).await;
    let report = registry.shutdown(Duration::from_secs(2)).await;
    let taken_after =
        eventually(Duration::from_millis(500), || !inner.held_keys().is_empty()).await;
    let got = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the waiter answers")
        .expect("task");
    drop(holder);
    assert!(got.is_err(), "the waiter got a guard after shutdown");
    assert!(
        !taken_after,
        "a waiter took the key after shutdown ({report:?}) had returned"
    );
    assert!(inner.held_keys().is_empty());
}

/// An acquisition waiting for a key another registry holds stops at
/// shutdown with `ShutDown`: shutdown leaves no task waiting for a key it
/// would only give back.
async fn shutdown_stops_a_waiting_acquisition(shut: Registry, other: Registry, key: &str) {
    let holder = hold(&other, key).await;
    let waiter = waiter(&shut, key).await;
    let report = shut.shutdown(Duration::from_secs(2)).await;
    let stopped = tokio::time::timeout(Duration::from_secs(1), waiter).await;
    holder.release().await.expect("release");
    let answer = stopped
        .unwrap_or_else(|_| panic!("the acquisition still waits after shutdown ({report:?})"))
        .expect("task");
    assert!(matches!(answer, Err(LockError::ShutDown)), "{answer:?}");
    assert_eq!(report.unfinished, 0, "{report:?}");
}

/// On a backend called inline (the in-process one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_a_waiting_inline_acquisition() {
    let backend = MemoryBackend::new();
    shutdown_stops_a_waiting_acquisition(
        registry(&backend),
        registry(&backend),
        "shutdown:waiting-inline",
    )
    .await;
}

/// On a backend called from dlock's I/O runtime (SQLite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_a_waiting_acquisition_on_the_io_runtime() {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("shutdown-{}.db", std::process::id()));
    let url = format!("sqlite://{}", path.display());
    let shut = Registry::from_url(&url).await.expect("sqlite");
    let other = Registry::from_url(&url).await.expect("sqlite");
    shutdown_stops_a_waiting_acquisition(shut, other, &unique_key("shutdown-waiting-io")).await;
}
