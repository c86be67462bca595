//! A Redis server killed with SIGKILL while a lock is held: the holder learns
//! of the loss before its lease would have ended, an annotated body with
//! `on_lost = "cancel"` stops, and after a restart new acquisitions work
//! without restarting the process (the connection reconnects by itself).
//!
//! One test, alone in its binary: nothing else uses this server meanwhile.
#![cfg(feature = "redis")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, RedisBackend, Registry, distributed_lock, lock};
use dlock_tests::redis_support::{RestartRedisOnDrop, sigkill_redis};
use dlock_tests::{acquire_eventually, servers_missing, unique_key};

/// The fifth Redis instance of `scripts/servers.sh`, which this test may kill.
const PORT: u16 = 46383;

#[derive(Debug)]
enum AppError {
    Lock(LockError),
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}

#[distributed_lock(key = "{key}", lease = "1500ms")]
async fn long_job(
    key: &str,
    ticks: &AtomicUsize,
    entered: tokio::sync::mpsc::Sender<()>,
) -> Result<(), AppError> {
    entered.send(()).await.expect("report");
    for _ in 0..600 {
        ticks.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_while_held() {
    let url = format!("redis://127.0.0.1:{PORT}/?timeout=300ms");
    let backend = RedisBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    dlock_runtime::init(Registry::builder().default_backend(backend).build()).expect("init");
    let lease = Duration::from_millis(1500);

    // A guard holder and an annotated body hold two keys when the server dies.
    let guard = lock(unique_key("killed-guard"))
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let ticks = std::sync::Arc::new(AtomicUsize::new(0));
    let (entered_tx, mut entered) = tokio::sync::mpsc::channel(1);
    let job = tokio::spawn({
        let ticks = ticks.clone();
        async move { long_job(&unique_key("killed-job"), &ticks, entered_tx).await }
    });
    entered.recv().await.expect("the body started");

    let restart = RestartRedisOnDrop(vec![PORT]);
    sigkill_redis(PORT);
    let killed = Instant::now();

    tokio::time::timeout(lease, guard.lost())
        .await
        .expect("the loss reaches the guard before the lease ends");
    let result = tokio::time::timeout(lease, job)
        .await
        .expect("the body stops")
        .expect("task");
    assert!(
        matches!(result, Err(AppError::Lock(LockError::Lost { .. }))),
        "{result:?}"
    );
    assert!(
        killed.elapsed() < lease,
        "loss after {:?}",
        killed.elapsed()
    );
    let at_stop = ticks.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(ticks.load(Ordering::SeqCst), at_stop, "the body still runs");
    let _ = guard.release().await;

    // While the server is down: an error within the wait budget, not a hang.
    let started = Instant::now();
    let down = lock(unique_key("while-down"))
        .wait(Duration::from_millis(500))
        .acquire()
        .await;
    assert!(matches!(down, Err(LockError::Backend { .. })), "{down:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    drop(restart);
    // Same process, same backend: it reconnects by itself.
    let guard = acquire_eventually(
        dlock_runtime::global().expect("initialised"),
        &unique_key("after-restart"),
    )
    .await;
    assert!(guard.fencing_token().is_some());
    guard.release().await.expect("release");
}
