//! A caller that gives up while its acquisition is on the wire: the server
//! may run the attempt *after* the clean-up release the runtime sends when
//! the caller leaves (the release overtakes it on another connection), and
//! grant the key to a caller that is gone. The runtime releases again once
//! such an attempt has surely been answered or timed out, so the key is free
//! within seconds, never held for the whole lease.
//!
//! The backend here is the memory backend behind a "wire" that runs each
//! attempt 300 ms after it was sent, whether or not the caller still waits
//! for the answer: a server executing a statement its client stopped
//! waiting for. Both ways the runtime calls a backend are checked: inline on
//! the caller's runtime, and on dlock's own I/O runtime (sqlx pools).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal, WakeSource};
use dlock_runtime::{BackendError, MemoryBackend, Registry};
use futures_util::future::BoxFuture;

/// How long after it is sent an attempt reaches the store.
const ON_THE_WIRE: Duration = Duration::from_millis(300);
/// The lease asked for: far longer than the test waits for the key to be free.
const LEASE: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct SlowWire {
    store: Arc<MemoryBackend>,
    io_runtime: bool,
}

impl LockBackend for SlowWire {
    fn kind(&self) -> &'static str {
        "slow-wire-memory"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        // The request is on its way: it arrives whatever the caller does next.
        let store = self.store.clone();
        let sent = AcquireRequest::new(request.key.clone(), request.owner.clone(), request.lease);
        let arrives = tokio::spawn(async move {
            tokio::time::sleep(ON_THE_WIRE).await;
            store.try_acquire(&sent).await
        });
        Box::pin(async move {
            arrives
                .await
                .unwrap_or_else(|e| Err(BackendError::permanent(e.to_string())))
        })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.store.wake_source(request)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        self.store.renew_all(batch)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        // Releases are fast: they overtake an attempt still on the wire.
        self.store.release(lease)
    }

    fn needs_io_runtime(&self) -> bool {
        self.io_runtime
    }
}

async fn gone_caller_leaves_no_key_held(io_runtime: bool) {
    let store = Arc::new(MemoryBackend::new());
    let registry = Registry::builder()
        .default_backend(SlowWire {
            store: store.clone(),
            io_runtime,
        })
        .build();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(50),
        registry.lock("hung-up").lease(LEASE).acquire(),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "the caller gave up while the attempt was on the wire"
    );
    let left = Instant::now();

    // The attempt reaches the store after the caller left, and after the
    // clean-up release it triggered: the key is granted to nobody.
    tokio::time::sleep(ON_THE_WIRE + Duration::from_millis(200)).await;
    let held_after_arrival = !store.held_keys().is_empty();

    // Generous bound for liveness on a loaded machine, far below the lease.
    let deadline = left + Duration::from_secs(20);
    while !store.held_keys().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        store.held_keys().is_empty(),
        "a key granted to a gone caller was still held {:?} after it left (lease {LEASE:?}; \
         held right after the late attempt arrived: {held_after_arrival})",
        left.elapsed()
    );
    // The key is usable again by anyone.
    let guard = registry
        .lock("hung-up")
        .acquire()
        .await
        .expect("the key is free");
    guard.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_inline_acquisition_leaves_no_key_held() {
    gone_caller_leaves_no_key_held(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_acquisition_on_the_io_runtime_leaves_no_key_held() {
    gone_caller_leaves_no_key_held(true).await;
}

/// Shutdown stops an acquisition whose attempt is on the wire. When shutdown
/// returns (and the process may exit) the attempt must not be left to take
/// the key afterwards, for nobody, for the whole lease: shutdown waits until
/// no key can be taken through its registry any more.
async fn shutdown_leaves_no_key_to_an_attempt_on_the_wire(io_runtime: bool) {
    let store = Arc::new(MemoryBackend::new());
    let registry = Registry::builder()
        .default_backend(SlowWire {
            store: store.clone(),
            io_runtime,
        })
        .build();
    let waiter = tokio::spawn({
        let registry = registry.clone();
        async move {
            registry
                .lock("stopped-on-the-wire")
                .wait(Duration::from_secs(5))
                .lease(LEASE)
                .acquire()
                .await
                .map(drop)
        }
    });
    // The first attempt is on the wire.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = registry.shutdown(Duration::from_secs(5)).await;
    let returned = Instant::now();
    let mut taken_after = None;
    while returned.elapsed() < ON_THE_WIRE + Duration::from_millis(500) {
        if !store.held_keys().is_empty() {
            taken_after = Some(returned.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let answer = waiter.await.expect("task");
    assert!(
        matches!(answer, Err(dlock_runtime::LockError::ShutDown)),
        "{answer:?}"
    );
    assert_eq!(
        taken_after, None,
        "the stopped attempt took the key after shutdown ({report:?}) had returned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_no_key_to_an_inline_attempt_on_the_wire() {
    shutdown_leaves_no_key_to_an_attempt_on_the_wire(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_no_key_to_an_io_runtime_attempt_on_the_wire() {
    shutdown_leaves_no_key_to_an_attempt_on_the_wire(true).await;
}
