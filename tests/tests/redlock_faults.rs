//! Redlock with masters down: with 2 of 5 nodes down it still acquires, holds
//! and releases; with 3 down it fails within the wait budget with an error
//! that says how many nodes answered; once they are back, it works again
//! without a new backend. A node already down when the backend is created
//! costs no call any wait, and is taken into the votes once it is back.
//!
//! One test, alone in its binary: it stops servers other tests use.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, RedlockBackend, Registry};
use dlock_tests::redis_support::{RestartRedisOnDrop, start_redis, stop_redis};
use dlock_tests::{acquire_eventually, server_url, servers_missing, unique_key};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minority_down_still_locks_majority_down_fails_in_time() {
    let url = server_url(
        "DLOCK_TEST_REDLOCK_URL",
        "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
    );
    let registry = Registry::builder()
        .default_backend(
            RedlockBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e)),
        )
        .build();
    let lease = Duration::from_millis(900);

    let restart = RestartRedisOnDrop(vec![46381, 46382, 46383]);
    stop_redis(46381);
    stop_redis(46382);

    // Two of five down: three votes are a majority.
    let guard = registry
        .lock(unique_key("minority-down"))
        .lease(lease)
        .acquire()
        .await
        .expect("acquire with 3 of 5 nodes");
    assert_eq!(guard.fencing_token(), None);
    // Held across several renewals on the three live nodes.
    tokio::time::sleep(lease * 2).await;
    assert!(!guard.is_lost(), "renewals on a majority keep the lease");
    guard.release().await.expect("release");

    // A lock held when a third node dies can no longer be renewed on a
    // majority: its holder learns of the loss before the lease ends.
    let held = registry
        .lock(unique_key("third-node-dies"))
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    stop_redis(46383);
    let stopped = Instant::now();
    tokio::time::timeout(lease, held.lost())
        .await
        .expect("the loss reaches the holder within the lease");
    assert!(stopped.elapsed() < lease, "{:?}", stopped.elapsed());
    let _ = held.release().await;

    // Three of five down: no majority, an error within the wait budget.
    let wait = Duration::from_millis(500);
    let started = Instant::now();
    let result = registry
        .lock(unique_key("majority-down"))
        .wait(wait)
        .lease(lease)
        .acquire()
        .await;
    let took = started.elapsed();
    match &result {
        Err(err @ LockError::Backend { source, .. }) => {
            assert!(err.is_retryable(), "{err}");
            let message = source.to_string();
            assert!(
                message.contains("only 2 of 5 nodes answered, 3 needed"),
                "{message}"
            );
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    assert!(took < wait + Duration::from_millis(500), "took {took:?}");

    drop(restart);
    // The same backend reconnects to the restarted nodes by itself.
    let guard = acquire_eventually(&registry, &unique_key("after-restart")).await;
    guard.release().await.expect("release");

    // A node down when a backend is created: its votes fail at once while it
    // is down, and its connection task takes it in once it is back.
    let restart = RestartRedisOnDrop(vec![46383]);
    stop_redis(46383);
    let late = Registry::builder()
        .default_backend(RedlockBackend::connect(&url).await.expect("4 of 5 answer"))
        .build();
    let started = Instant::now();
    for _ in 0..20 {
        let guard = late
            .lock(unique_key("late-node-down"))
            .lease(lease)
            .acquire()
            .await
            .expect("acquire with 4 of 5 nodes");
        guard.release().await.expect("release");
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "20 pairs with a node down took {:?}",
        started.elapsed()
    );
    start_redis(46383);
    let back = Instant::now();
    let mut late_node = redis::Client::open("redis://127.0.0.1:46383/")
        .expect("node url")
        .get_multiplexed_async_connection()
        .await
        .expect("the restarted node answers");
    let key = unique_key("late-node-back");
    let stored = format!("{}{key}", late.key_prefix());
    loop {
        let guard = late
            .lock(&key)
            .lease(lease)
            .acquire()
            .await
            .expect("acquire");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&stored)
            .query_async(&mut late_node)
            .await
            .expect("PTTL");
        guard.release().await.expect("release");
        if ttl > 0 {
            break;
        }
        // The longest back-off is 2 s (plus a quarter of jitter).
        assert!(
            back.elapsed() < Duration::from_secs(4),
            "the node that was down at connect is still not voting"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the node down at connect voted again {:?} after its restart",
        back.elapsed()
    );
    drop(restart);
}
