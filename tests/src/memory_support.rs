//! Support for the tests of the runtime on the in-process backend: registries
//! over a [`MemoryBackend`], and a backend whose grants and releases can be
//! held back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, Renewal, WakeSource};
use dlock_runtime::{BackendError, LockBackend, MemoryBackend, Registry};
use futures_util::future::BoxFuture;

/// A registry whose default backend is `backend`.
pub fn registry(backend: &MemoryBackend) -> Registry {
    Registry::builder().default_backend(backend.clone()).build()
}

/// A fresh [`MemoryBackend`] and a registry over it.
pub fn memory_registry() -> (MemoryBackend, Registry) {
    let mem = MemoryBackend::new();
    let registry = Registry::builder().default_backend(mem.clone()).build();
    (mem, registry)
}

/// The stored form of a key (default prefix).
pub fn stored(key: &str) -> String {
    format!("dlock:{key}")
}

/// Polls `cond` every 5 ms for up to `within`; whether it became true.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A [`MemoryBackend`] behind two knobs: the answer to the next grant can be
/// held back (a grant that reaches the caller late), and releases can be slow.
#[derive(Debug, Clone)]
pub struct Knobbed {
    /// The backend that answers.
    pub inner: MemoryBackend,
    /// Held back once, after the inner backend has granted the key.
    pub delay_next_grant: Arc<Mutex<Option<Duration>>>,
    /// The token of the grant that was held back.
    pub late_token: Arc<Mutex<Option<u64>>>,
    /// How long every release waits before it is sent.
    pub release_delay: Duration,
}

impl Knobbed {
    /// Over `inner`, holding nothing back.
    pub fn new(inner: &MemoryBackend) -> Self {
        Knobbed {
            inner: inner.clone(),
            delay_next_grant: Arc::default(),
            late_token: Arc::default(),
            release_delay: Duration::ZERO,
        }
    }

    /// Holds the next grant back by `by` after the inner backend granted it.
    pub fn delay_next_grant(&self, by: Duration) {
        *self.delay_next_grant.lock().unwrap() = Some(by);
    }

    /// The token of the grant that was held back, once.
    pub fn late_token(&self) -> Option<u64> {
        self.late_token.lock().unwrap().take()
    }
}

impl LockBackend for Knobbed {
    fn kind(&self) -> &'static str {
        "knobbed-memory"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            let answer = self.inner.try_acquire(request).await?;
            if let Attempt::Held(lease) = &answer {
                let delay = self.delay_next_grant.lock().unwrap().take();
                if let Some(delay) = delay {
                    *self.late_token.lock().unwrap() = lease.token.map(u64::from);
                    tokio::time::sleep(delay).await;
                }
            }
            Ok(answer)
        })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.inner.wake_source(request)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        self.inner.renew_all(batch)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(self.release_delay).await;
            self.inner.release(lease).await
        })
    }

    fn needs_io_runtime(&self) -> bool {
        false
    }
}
