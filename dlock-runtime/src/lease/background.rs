//! Releases no caller awaits: a guard dropped (by a panic, a cancelled
//! future, an early return), a release whose caller stopped waiting, an
//! acquisition abandoned while its request may be on the wire, shutdown.
//!
//! Each is handed over the one way here: as a [`Releasing`], counted by its
//! registry's shutdown tracker from the moment it is asked for until it has
//! run, so [`Registry::shutdown`](crate::Registry::shutdown) waits for it.

use std::future::Future;
use std::sync::Arc;

use super::shutdown::Leases;
use crate::backend::{Lease, LockBackend};

/// One release in flight: the registry's shutdown waits for it until this
/// is dropped — when the release has run, or when the task that carried it
/// is gone. An acquisition in flight is counted by one too, until it has
/// returned (see [`acquire`](super::lock::acquire)).
#[derive(Debug)]
#[must_use = "a release counts as in flight until this is dropped"]
pub(crate) struct Releasing {
    leases: Arc<Leases>,
}

impl Releasing {
    /// Counts a release of a lease of `leases` as in flight.
    pub(crate) fn new(leases: &Arc<Leases>) -> Self {
        leases.release_started();
        Releasing {
            leases: leases.clone(),
        }
    }

    /// Runs `release` on dlock's I/O runtime, which outlives the callers'
    /// runtimes; counted until it has run.
    pub(crate) fn spawn<F>(self, release: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        crate::driver::handle().spawn(async move {
            release.await;
            drop(self);
        });
    }

    /// Sends the owner-checked release of an acquisition the caller
    /// abandoned while its request may have been on the wire. The owner token
    /// is unique to that acquisition, so the release frees the key only if
    /// the abandoned request did take it.
    ///
    /// It goes from the caller's runtime, so that a backend that sends from
    /// there (Redis over its local connection) sends it after the abandoned
    /// command, on the same connection. If that runtime is shutting down the
    /// task never runs (and stops counting): once the abandoned command has
    /// been answered or has timed out, a backstop releases again from
    /// dlock's runtime (a no-op if the key is free already). The backstop is
    /// counted too when `wait_for_backstop` (shutdown stopped an attempt on
    /// the wire: it must not return while that attempt can still take the
    /// key), else not.
    pub(crate) fn spawn_after_abandoned(
        self,
        backend: Arc<dyn LockBackend>,
        lease: Lease,
        wait_for_backstop: bool,
    ) {
        let backstop_counted = wait_for_backstop.then(|| Releasing::new(&self.leases));
        let lease = Arc::new(lease);
        let release = {
            let (backend, lease) = (backend.clone(), lease.clone());
            async move {
                let _ = backend.release(&lease).await;
                drop(self);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !crate::driver::on_io_runtime() => drop(runtime.spawn(release)),
            _ => drop(crate::driver::handle().spawn(release)),
        }
        crate::driver::handle().spawn(async move {
            tokio::time::sleep(backend.abandoned_command_bound()).await;
            let _ = backend.release(&lease).await;
            drop(backstop_counted);
        });
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        self.leases.release_finished();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Registry;
    use crate::backend::AcquireRequest;
    use crate::backend::memory::MemoryBackend;

    #[tokio::test]
    async fn shutdown_waits_for_a_release_in_the_background_until_it_has_run() {
        let registry = Registry::builder()
            .default_backend(MemoryBackend::new())
            .build();
        let (finish, finished) = tokio::sync::oneshot::channel::<()>();
        Releasing::new(&registry.inner.leases).spawn(async move {
            let _ = finished.await;
        });
        let report = registry.shutdown(Duration::from_millis(50)).await;
        assert_eq!(report.unfinished, 1, "the release in flight is waited for");
        finish.send(()).expect("the release is still waiting");
        let report = registry.shutdown(Duration::from_secs(5)).await;
        assert_eq!(
            report.unfinished, 0,
            "a release that has run counts no more"
        );
    }

    #[tokio::test]
    async fn shutdown_waits_for_an_abandoned_acquisitions_release_but_not_its_backstop() {
        let backend: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
        let registry = Registry::builder().default_backend(backend.clone()).build();
        let request = AcquireRequest::new("dlock:k", "owner", Duration::from_secs(1));
        Releasing::new(&registry.inner.leases).spawn_after_abandoned(
            backend,
            Lease::new(&request, None),
            false,
        );
        let report = registry.shutdown(Duration::from_secs(1)).await;
        assert_eq!(
            report.unfinished, 0,
            "the backstop, seconds later, is not waited for"
        );
    }
}
