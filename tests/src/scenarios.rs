//! Scenarios that need a registry of their own (they shut it down, or stall
//! its backend), shared by the backends' test files. The conformance suite
//! runs on the process-wide registry; these take the registry to use and the
//! backend's [`Faults`] to look at its storage.

use std::time::Duration;

use dlock_runtime::{LockError, Registry};

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
