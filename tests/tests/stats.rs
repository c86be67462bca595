//! `Registry::stats()` counts a scripted sequence exactly: acquisitions,
//! busy answers (fail and skip), skipped bodies, releases, renewals and their
//! failures, losses by reason, and the `held` and `waiting` gauges.

use std::time::Duration;

use dlock_runtime::{
    LockError, LossReason, MemoryBackend, Registry, Stats, distributed_lock, lock,
};

/// Short leases: the watchdog renews every 100 ms.
const LEASE: Duration = Duration::from_millis(300);

#[distributed_lock(key = "stats:{name}")]
async fn fails_when_busy(name: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(key = "stats:{name}", on_busy = "skip")]
async fn skips_when_busy(name: &str) -> Result<(), LockError> {
    Ok(())
}

fn stats() -> Stats {
    dlock_runtime::global().expect("initialised").stats()
}

async fn settle() {
    // Lets a renewal on the wire at a release come back.
    tokio::time::sleep(Duration::from_millis(50)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_a_scripted_sequence_exactly() {
    let mem = MemoryBackend::new();
    dlock_runtime::init(Registry::builder().default_backend(mem.clone()).build()).expect("init");
    let start = stats();
    assert_eq!(
        (
            start.acquired,
            start.busy,
            start.skipped,
            start.released,
            start.lost
        ),
        (0, 0, 0, 0, 0)
    );
    assert_eq!(
        (
            start.renewals,
            start.renewal_failures,
            start.held,
            start.waiting
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(start.lost_by_reason.len(), LossReason::ALL.len());
    assert!(start.lost_by_reason.iter().all(|(_, n)| *n == 0));

    // Acquired, renewed a few times, busy (fail and skip), released.
    let a = lock("stats:a")
        .lease(LEASE)
        .acquire()
        .await
        .expect("acquire");
    let s = stats();
    assert_eq!((s.acquired, s.held, s.waiting), (1, 1, 0));
    assert!(matches!(
        fails_when_busy("a").await,
        Err(LockError::Busy { .. })
    ));
    assert_eq!(skips_when_busy("a").await.ok(), Some(()));
    let s = stats();
    assert_eq!((s.busy, s.skipped), (2, 1));
    tokio::time::sleep(LEASE).await;
    a.release().await.expect("release");
    settle().await;
    let s = stats();
    assert_eq!((s.acquired, s.released, s.held, s.lost), (1, 1, 0, 0));
    assert!(s.renewals >= 2, "{s:?}");
    assert_eq!(s.renewals, mem.renewal_count());
    assert_eq!(s.renewal_failures, 0);

    // Not renewed in time: failed renewals, then lost as expired.
    let renewed_so_far = mem.renewal_count();
    let b = lock("stats:b")
        .lease(LEASE)
        .acquire()
        .await
        .expect("acquire");
    mem.fail_renewals(true);
    tokio::time::timeout(2 * LEASE, b.lost())
        .await
        .expect("lost");
    assert_eq!(b.loss_reason(), Some(LossReason::Expired));
    settle().await;
    mem.fail_renewals(false);
    let s = stats();
    assert!(s.renewal_failures >= 1, "{s:?}");
    assert_eq!(s.renewal_failures, mem.renewal_count() - renewed_so_far);
    assert_eq!((s.lost, s.lost_for(LossReason::Expired), s.held), (1, 1, 0));
    assert!(matches!(b.release().await, Err(LockError::Lost { .. })));
    assert_eq!(stats().released, 1, "a lost lease's release is no release");

    // Revoked on the server: the memory backend's test control.
    let c = lock("stats:c")
        .lease(LEASE)
        .acquire()
        .await
        .expect("acquire");
    mem.revoke_on_renewal(true);
    tokio::time::timeout(2 * LEASE, c.lost())
        .await
        .expect("lost");
    mem.revoke_on_renewal(false);
    assert_eq!(c.loss_reason(), Some(LossReason::Revoked));
    assert!(matches!(c.release().await, Err(LockError::Lost { .. })));

    // Gone from the server (expired or deleted there).
    let d = lock("stats:d")
        .lease(LEASE)
        .acquire()
        .await
        .expect("acquire");
    assert!(mem.expire_now("dlock:stats:d"));
    tokio::time::timeout(2 * LEASE, d.lost())
        .await
        .expect("lost");
    assert_eq!(d.loss_reason(), Some(LossReason::Gone));
    drop(d);

    // A waiter is counted while it waits.
    let e = lock("stats:e")
        .lease(LEASE)
        .acquire()
        .await
        .expect("acquire");
    let waiter = tokio::spawn(
        lock("stats:e")
            .wait(Duration::from_secs(5))
            .lease(LEASE)
            .acquire(),
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    let s = stats();
    assert_eq!((s.waiting, s.held), (1, 1));
    e.release().await.expect("release");
    let f = waiter
        .await
        .expect("task")
        .expect("acquired after the release");
    let s = stats();
    assert_eq!((s.waiting, s.held), (0, 1));
    f.release().await.expect("release");
    settle().await;

    let s = stats();
    assert_eq!(s.acquired, 6);
    assert_eq!(s.released, 3);
    assert_eq!(s.busy, 2);
    assert_eq!(s.skipped, 1);
    assert_eq!(s.lost, 3);
    for (reason, n) in &s.lost_by_reason {
        let expected = match reason {
            LossReason::Expired | LossReason::Revoked | LossReason::Gone => 1,
            _ => 0,
        };
        assert_eq!(*n, expected, "{reason}");
    }
    assert_eq!((s.held, s.waiting), (0, 0));
    assert_eq!(s.acquired, s.held + s.released + s.lost);
    // Every renewal the store received is counted once: confirmed, failed,
    // or the one answer each of the revoked and the gone leases got.
    assert_eq!(s.renewals + s.renewal_failures + 2, mem.renewal_count());
}
