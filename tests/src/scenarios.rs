//! Scenarios that need a registry of their own (they shut it down, or stall
//! its backend), shared by the backends' test files. The conformance suite
//! runs on the process-wide registry; these take the registry to use and the
//! backend's [`Faults`] to look at its storage.

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, Registry};

use crate::{Faults, unique_key};

/// `shutdown` releases every held lease at once (the keys are free on the
/// backend when it returns), tells a running body its lease is lost, refuses
/// new acquisitions, and waits for the release of a guard dropped just before.
///
/// `registry` must be a fresh registry on the backend `faults` looks at; it is
/// shut down. `dropped_before` is a second fresh registry on the same backend
/// (for the dropped-guard part).
pub async fn graceful_shutdown(
    registry: &Registry,
    dropped_before: &Registry,
    faults: &dyn Faults,
) {
    let stored = |key: &str| format!("{}{key}", registry.key_prefix());
    let keys: Vec<String> = (0..3)
        .map(|i| unique_key(&format!("shutdown-{i}")))
        .collect();
    let lease = Duration::from_secs(30);
    let g0 = registry
        .lock(&keys[0])
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let g1 = registry
        .lock(&keys[1])
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let body = tokio::spawn({
        let (registry, key) = (registry.clone(), keys[2].clone());
        async move {
            let guard = registry
                .lock(&key)
                .lease(lease)
                .acquire()
                .await
                .expect("acquire");
            let lost = guard.lost();
            let outcome = guard
                .scope(async {
                    entered_tx.send(()).expect("test waits");
                    tokio::select! {
                        () = lost => "lost",
                        () = tokio::time::sleep(Duration::from_secs(30)) => "ran to the end",
                    }
                })
                .await;
            (outcome, guard.release().await)
        }
    });
    entered_rx.await.expect("the body runs");
    assert_eq!(registry.held_leases(), 3);
    for key in &keys {
        assert!(
            faults.is_held(&stored(key)).await,
            "{key} held before shutdown"
        );
    }

    let report = tokio::time::timeout(
        Duration::from_secs(3),
        registry.shutdown(Duration::from_secs(2)),
    )
    .await
    .expect("shutdown returns by its deadline");
    assert_eq!((report.released, report.unfinished), (3, 0), "{report:?}");
    for key in &keys {
        assert!(
            !faults.is_held(&stored(key)).await,
            "{key} still held on the backend after shutdown"
        );
    }
    let (outcome, _release) = tokio::time::timeout(Duration::from_secs(1), body)
        .await
        .expect("the body hears of the shutdown")
        .expect("task");
    assert_eq!(outcome, "lost");
    let refused = registry.lock(unique_key("after-shutdown")).acquire().await;
    assert!(
        matches!(refused, Err(LockError::ShutDown)),
        "acquire after shutdown: {refused:?}"
    );
    assert_eq!(registry.held_leases(), 0);
    drop((g0, g1));

    // A guard dropped just before shutdown: its background release is waited for.
    let key = unique_key("shutdown-dropped");
    drop(
        dropped_before
            .lock(&key)
            .lease(lease)
            .acquire()
            .await
            .expect("acquire"),
    );
    let report = dropped_before.shutdown(Duration::from_secs(2)).await;
    assert_eq!(report.unfinished, 0, "{report:?}");
    assert!(
        !faults.is_held(&stored(&key)).await,
        "shutdown returned before the dropped guard's release reached the backend"
    );
}

/// One registry, two backends: three leases on its default backend, which
/// the test then stalls (every renewal hangs), and one on its backend
/// `healthy`, which goes on. The stalled backend's short lease is declared
/// lost at its give-up instant although its renewal never answers; the
/// healthy lease stays held: a stalled backend does not starve another.
pub struct StalledAndHealthy {
    /// Both short leases' length (900 ms).
    pub lease: Duration,
    healthy_key: String,
    healthy: LockGuard,
    healthy_since: Instant,
    stalled: LockGuard,
    asked: Instant,
    long: LockGuard,
}

impl StalledAndHealthy {
    /// Takes the leases on `registry`: 900 ms on its backend `healthy`, then
    /// on its default backend 4 s (its renewal, due at 1.33 s, hangs until
    /// its give-up instant, 3.6 s: the stalled backend has a renewal on the
    /// wire for most of the test) and 900 ms. The test stalls the default
    /// backend next.
    pub async fn acquire(registry: &Registry, healthy: &str) -> Self {
        let lease = Duration::from_millis(900);
        let healthy_key = unique_key("healthy");
        let healthy_guard = registry
            .lock(&healthy_key)
            .backend(healthy)
            .lease(lease)
            .acquire()
            .await
            .expect("acquire on the healthy backend");
        let healthy_since = Instant::now();
        let long = registry
            .lock(unique_key("stalled-long"))
            .lease(Duration::from_secs(4))
            .acquire()
            .await
            .expect("acquire the long lease on the backend to stall");
        let asked = Instant::now();
        let stalled = registry
            .lock(unique_key("stalled"))
            .lease(lease)
            .acquire()
            .await
            .expect("acquire on the backend to stall");
        StalledAndHealthy {
            lease,
            healthy_key,
            healthy: healthy_guard,
            healthy_since,
            stalled,
            asked,
            long,
        }
    }

    /// The user key of the healthy lease.
    pub fn healthy_key(&self) -> &str {
        &self.healthy_key
    }

    /// The stalled backend's short lease is declared lost before it ends;
    /// answers when, counted from its acquisition.
    pub async fn stalled_lease_is_lost_before_it_ends(&self) -> Duration {
        tokio::time::timeout(self.lease, self.stalled.lost())
            .await
            .expect("the stalled lease is declared lost before the server would expire it");
        let lost_after = self.asked.elapsed();
        assert!(
            lost_after < self.lease,
            "lost after {lost_after:?}, not before the lease ({:?}) ran out",
            self.lease
        );
        lost_after
    }

    /// Three seconds after it was taken, the healthy lease is still held:
    /// not lost, and busy for `other` (a registry of its own on the healthy
    /// backend's store).
    pub async fn healthy_lease_is_held_after_3s(&self, other: &Registry) {
        tokio::time::sleep_until((self.healthy_since + Duration::from_secs(3)).into()).await;
        assert!(
            !self.healthy.is_lost(),
            "the healthy lease was lost while the other backend stalled"
        );
        let taken = other.lock(&self.healthy_key).acquire().await;
        assert!(
            matches!(taken, Err(LockError::Busy { .. })),
            "another registry took the healthy key while its holder still held it: {taken:?}"
        );
    }

    /// Releases the healthy lease (held throughout), awaits `unstall`, and
    /// finds the stalled lease's release answering that it was lost.
    pub async fn finish(self, unstall: impl std::future::Future<Output = ()>) {
        self.healthy
            .release()
            .await
            .expect("the healthy lease was held throughout");
        unstall.await;
        assert!(matches!(
            self.stalled.release().await,
            Err(LockError::Lost { .. })
        ));
        drop(self.long);
    }
}
