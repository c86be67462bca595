//! Cancellation on the in-process backend: a release the caller gives up on
//! while a renewal hangs still happens and stops the renewals; a grant that
//! reaches its caller after the caller is gone, or too late to be used, is
//! released; `is_lost()` turns true at the give-up instant; and
//! `on_lost = "cancel"` returns the lost error even when the body would resume
//! in the tick of the loss. Faults come from the backend's hooks and from
//! polling futures by hand (`now_or_never`), never from timing luck.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, MemoryBackend, Registry, distributed_lock};
use dlock_tests::memory_support::{Knobbed, eventually, registry, stored};
use dlock_tests::unique_key;
use futures_util::FutureExt;
use tokio::sync::{OnceCell, oneshot};

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

/// The caller gives up on `release()` while a renewal hangs; the
/// release must still happen and no renewal may follow it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_release_leaves_no_renewed_lease() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("cancelled-release");
    let guard = reg
        .lock(&key)
        .lease(Duration::from_millis(600))
        .acquire()
        .await
        .expect("acquire");
    backend.stall_renewals(true);
    let before = backend.renewal_count();
    assert!(
        eventually(Duration::from_secs(1), || backend.renewal_count() > before).await,
        "the watchdog sends a renewal within a third of the lease"
    );
    // A renewal is on the wire and hangs. The caller stops waiting for the release.
    match tokio::time::timeout(Duration::from_millis(50), guard.release()).await {
        Err(_elapsed) => {}
        Ok(done) => done.expect("a release that finished in time succeeds"),
    }
    backend.stall_renewals(false);
    // The release goes on without its caller: the entry is removed (an
    // expired one would still be counted by `entries()`), long before the lease ends.
    assert!(
        eventually(Duration::from_millis(250), || backend.entries() == 0).await,
        "the key was not freed after the cancelled release: {:?}",
        backend.held_keys()
    );
    let count = backend.renewal_count();
    // Longer than the lease and three renewal periods.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        backend.renewal_count(),
        count,
        "renewals went on after the release was asked for"
    );
    assert_eq!(backend.renewals_after_release(), 0);
    assert!(backend.held_keys().is_empty());
    registry(&backend)
        .lock(&key)
        .acquire()
        .await
        .expect("the key is free for another registry")
        .release()
        .await
        .expect("release");
}

/// A grant whose answer arrives after the holder would have had to
/// give it up (lease − 10 %) is not handed to the caller: it is released at
/// once and, with a wait budget left, the acquisition tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_grant_is_not_used() {
    let inner = MemoryBackend::new();
    let knobbed = Knobbed::new(&inner);
    let reg = Registry::builder().default_backend(knobbed.clone()).build();
    let key = unique_key("late-grant");
    let lease = Duration::from_secs(1);
    // Answered at 950 ms: past the give-up instant (900 ms), while the grant
    // still stands on the backend (1 s).
    let late = Duration::from_millis(950);

    // No wait budget: no guard, and the grant is undone.
    knobbed.delay_next_grant(late);
    let answer = reg.lock(&key).lease(lease).acquire().await;
    assert!(
        matches!(
            answer,
            Err(LockError::Busy { .. } | LockError::Backend { .. })
        ),
        "a grant that came too late was used: {answer:?}"
    );
    assert!(knobbed.late_token().is_some(), "the grant was held back");
    assert_eq!(
        inner.entries(),
        0,
        "the late grant was left on the backend: {:?}",
        inner.held_keys()
    );
    registry(&inner)
        .lock(&key)
        .acquire()
        .await
        .expect("free for another registry at once")
        .release()
        .await
        .expect("release");

    // With a wait budget: a fresh grant, never the late one.
    knobbed.delay_next_grant(late);
    let guard = reg
        .lock(&key)
        .lease(lease)
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .expect("tries again after the late grant");
    let late_token = knobbed.late_token().expect("the grant was held back");
    let token = guard.fencing_token().expect("memory fences").get();
    assert!(
        token > late_token,
        "the guard carries the late grant's token {late_token}"
    );
    assert!(!guard.is_lost());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!guard.is_lost(), "the guard's lease is a fresh one");
    assert!(inner.held_keys().contains(&stored(&key)));
    guard.release().await.expect("release");
    assert_eq!(inner.entries(), 0);
}

/// `is_lost()` is true as soon as the give-up instant (lease − 10 %)
/// passes without a renewal, whatever the watchdog is doing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn is_lost_turns_true_at_the_give_up_instant() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("give-up");
    backend.stall_renewals(true);
    let lease = Duration::from_secs(1);
    let asked = Instant::now();
    let guard = reg
        .lock(&key)
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let acquired = Instant::now();
    // The give-up instant lies between asked + 900 ms and acquired + 900 ms.
    tokio::time::sleep_until((asked + Duration::from_millis(700)).into()).await;
    assert!(!guard.is_lost(), "lost before the give-up instant");
    tokio::time::sleep_until((acquired + Duration::from_millis(901)).into()).await;
    assert!(
        guard.is_lost(),
        "not lost right after the give-up instant, with its renewal hanging"
    );
    backend.stall_renewals(false);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

const MS: Duration = Duration::from_millis(1);

/// The caller drops an acquisition that runs on dlock's I/O runtime (SQLite)
/// after the I/O task was granted the key and handed it over, but before the
/// caller's future was polled again to take it: the grant is released at once
/// (DESIGN.md §5.6, an abandoned acquisition stops), so another registry takes
/// the key. Poll-once + drop is exactly a `select!`/`timeout` that fires in the
/// tick in which the grant arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_io_runtime_acquisition_dropped_after_its_grant_releases_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}/cancel.db", dir.path().display());
    let mine = Registry::from_url(&url).await.expect("sqlite");
    let other = Registry::from_url(&url).await.expect("sqlite");
    let key = "cancel:io-grant-dropped";

    // The key is busy at first, so the first poll surely leaves the
    // acquisition waiting on the I/O runtime (a free key could be granted
    // before the first poll returns, on a loaded machine).
    let holding = other.lock(key).acquire().await.expect("the key is free");
    let mut acquiring = Box::pin(
        mine.lock(key)
            .wait(Duration::from_secs(30))
            .lease(Duration::from_secs(5))
            .acquire(),
    );
    assert!(
        (&mut acquiring).now_or_never().is_none(),
        "the first poll hands the attempt to the I/O runtime"
    );
    holding.release().await.expect("release");
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

type Lost = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Hard cap of 200 ms (no watchdog): lost at its give-up instant.
#[distributed_lock(key = "cancel:cancel:{id}", lease = "200ms", watchdog = false)]
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

/// `on_lost = "cancel"` (the default): the lease is lost and signalled while
/// the body waits, and when the task is next polled the body's own await is
/// ready too (its I/O answered in the same tick). The call still returns the
/// lost error, and the body does not run past the loss (DESIGN.md §2 table,
/// §5.4: "stop the body at its next `.await` and return the lost error").
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
