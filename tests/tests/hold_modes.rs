//! The runtime's routing of hold modes: several keys are taken in one step
//! only as whole keys; readers and semaphores go key by key through the
//! wait loop, whose rules their modes need.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock_runtime::backend::{
    AcquireRequest, Attempt, AttemptAll, HoldMode, Lease, Renewal, WakeSource,
};
use dlock_runtime::{BackendError, LockBackend, LockError, MemoryBackend, Registry};
use dlock_tests::unique_key;
use futures_util::future::BoxFuture;

/// A [`MemoryBackend`] that claims a one-step path for several keys and
/// counts its use; the step itself answers an error.
#[derive(Debug, Default)]
struct OneStep {
    inner: MemoryBackend,
    one_steps: AtomicUsize,
}

impl LockBackend for OneStep {
    fn kind(&self) -> &'static str {
        "one-step-memory"
    }

    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        self.inner.offers(mode)
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        self.inner.try_acquire(request)
    }

    fn try_acquire_all<'a>(
        &'a self,
        requests: &'a [AcquireRequest],
    ) -> Option<BoxFuture<'a, Result<AttemptAll, BackendError>>> {
        let _ = requests;
        Some(Box::pin(async move {
            self.one_steps.fetch_add(1, Ordering::SeqCst);
            Err(BackendError::permanent("the one-step path was taken"))
        }))
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.inner.wake_source(request)
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        self.inner.abandon(request)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        self.inner.renew_all(batch)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        self.inner.release(lease)
    }

    fn needs_io_runtime(&self) -> bool {
        false
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_keys_take_the_one_step_path_only_as_whole_keys() {
    let backend = Arc::new(OneStep::default());
    let registry = Registry::builder()
        .default_backend(backend.clone() as Arc<dyn LockBackend>)
        .build();
    let keys = [unique_key("one-step-a"), unique_key("one-step-b")];

    let read = registry
        .lock_all(&keys)
        .read()
        .acquire()
        .await
        .expect("read");
    assert!(read.permit().is_none());
    read.release().await.expect("release");
    let permit = registry
        .lock_all(&keys)
        .permits(3)
        .acquire()
        .await
        .expect("a permit of each");
    assert_eq!(permit.permit(), Some(0));
    permit.release().await.expect("release");
    assert_eq!(
        backend.one_steps.load(Ordering::SeqCst),
        0,
        "readers and permits went through the one-step path"
    );

    let whole = registry.lock_all(&keys).acquire().await;
    assert!(
        matches!(whole, Err(LockError::Backend { .. })),
        "whole keys take the one-step path: {whole:?}"
    );
    assert_eq!(backend.one_steps.load(Ordering::SeqCst), 1);
}
