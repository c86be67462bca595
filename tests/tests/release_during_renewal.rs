//! A release asked for while a renewal of the lease hangs on the wire, on the
//! in-process backend: the key is freed at once (DESIGN.md §5, invariant 3),
//! not once the hanging renewal gives up; with `hold_at_least` the release
//! waits for the renewal no longer than its own lease's give-up instant.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, Renewal, WakeSource};
use dlock_runtime::{BackendError, LockBackend, MemoryBackend, Registry};
use dlock_tests::memory_support::{eventually, registry};
use dlock_tests::unique_key;
use futures_util::future::BoxFuture;
use tokio::sync::watch;

/// Every renewal hangs; the lease's renewal is on the wire when the holder
/// releases it. The release frees the key and returns within a round trip,
/// while the lease still has seconds to run: the owner-checked release makes
/// the hanging renewal a no-op whenever it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_the_key_at_once_while_a_renewal_hangs() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("release-renewal-hangs");
    let guard = reg
        .lock(&key)
        .lease(Duration::from_secs(6))
        .acquire()
        .await
        .expect("acquire");
    backend.stall_renewals(true);
    assert!(
        eventually(Duration::from_secs(4), || backend.renewal_count() > 0).await,
        "the watchdog sends a renewal within a third of the lease"
    );
    let started = Instant::now();
    let released = tokio::time::timeout(Duration::from_secs(1), guard.release()).await;
    let took = started.elapsed();
    let still_held = backend.held_keys();
    backend.stall_renewals(false);
    assert!(
        released.is_ok() && still_held.is_empty(),
        "the release waited for the hanging renewal: returned: {}, after {took:?}, \
         keys still held on the backend: {still_held:?}",
        released.is_ok()
    );
    released
        .expect("returned")
        .expect("the release of a lease still valid succeeds");
    assert_eq!(backend.renewals_after_release(), 0);
}

/// The in-process backend, whose renewal batches (the watchdog's) hang while
/// `stalled` is true; a single renewal (`hold_at_least`'s shortening) answers.
#[derive(Debug, Clone)]
struct StalledBatches {
    inner: MemoryBackend,
    stalled: Arc<watch::Sender<bool>>,
}

impl LockBackend for StalledBatches {
    fn kind(&self) -> &'static str {
        "stalled-batches-memory"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        self.inner.try_acquire(request)
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.inner.wake_source(request)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        Box::pin(async move {
            let mut stalled = self.stalled.subscribe();
            let _ = stalled.wait_for(|stalled| !*stalled).await;
            self.inner.renew_all(batch).await
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        self.inner.renew(lease, ttl)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        self.inner.release(lease)
    }

    fn needs_io_runtime(&self) -> bool {
        false
    }
}

/// With `hold_at_least` the release waits for the renewal on the wire — but
/// not past its own lease's give-up instant, even when that renewal went out
/// in one batch with a much longer lease's, whose call may hang far longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_at_least_release_waits_no_longer_than_its_own_lease() {
    let inner = MemoryBackend::new();
    let backend = StalledBatches {
        inner: inner.clone(),
        stalled: Arc::new(watch::channel(false).0),
    };
    let reg = Registry::builder().default_backend(backend.clone()).build();
    let long = reg
        .lock(unique_key("batch-long"))
        .lease(Duration::from_secs(9))
        .acquire()
        .await
        .expect("long lease");
    let long_acquired = Instant::now();
    // The short lease is due for renewal (a third of 3 s) a few milliseconds
    // before the long one (a third of 9 s): both go out in one batch.
    tokio::time::sleep_until((long_acquired + Duration::from_millis(1995)).into()).await;
    let short = reg
        .lock(unique_key("batch-short"))
        .lease(Duration::from_secs(3))
        .hold_at_least(Duration::from_millis(200))
        .acquire()
        .await
        .expect("short lease");
    let short_acquired = Instant::now();
    backend.stalled.send_replace(true);
    assert!(
        eventually(Duration::from_secs(4), || backend.stalled.receiver_count()
            >= 1)
        .await,
        "the renewals are on the wire, hanging"
    );
    let started = Instant::now();
    // The short lease gives up 2.7 s after it was taken; the long one at 8.1 s.
    let own_give_up = short_acquired + Duration::from_millis(2700);
    let released = tokio::time::timeout_at(
        (own_give_up + Duration::from_millis(500)).into(),
        short.release(),
    )
    .await;
    let took = started.elapsed();
    backend.stalled.send_replace(false);
    drop(long);
    assert!(
        released.is_ok(),
        "the release waited {took:?} for a batch bounded by another lease's give-up instant"
    );
}
