//! Releases no caller awaits: a guard dropped (by a panic, a cancelled
//! future, an early return), a release whose caller stopped waiting, an
//! acquisition abandoned while its request may be on the wire, shutdown.
//!
//! Each is handed over the one way here: as a [`Releasing`], counted by its
//! registry's shutdown tracker from the moment it is asked for until it has
//! run, so [`Registry::shutdown`](crate::Registry::shutdown) waits for it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::shutdown::Leases;
use crate::backend::{Lease, LockBackend};

/// How long after an abandoned acquisition the backstop release goes out:
/// longer than the backends' default command timeout.
const ABANDONED_BACKSTOP: Duration = Duration::from_secs(3);

/// One release in flight: the registry's shutdown waits for it until this
/// is dropped — when the release has run, or when the task that carried it
/// is gone.
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
    /// been answered or has timed out, an uncounted backstop releases again
    /// from dlock's runtime (a no-op if the key is free already).
    pub(crate) fn spawn_after_abandoned(self, backend: Arc<dyn LockBackend>, lease: Lease) {
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
            tokio::time::sleep(ABANDONED_BACKSTOP).await;
            let _ = backend.release(&lease).await;
        });
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        self.leases.release_finished();
    }
}
