//! Short outages ridden out within `wait`: an acquisition
//! tried while its Redis server (or every Redlock master) is down keeps
//! trying with a back-off and succeeds once the server is back, if that is
//! within its `wait`; an outage longer than `wait` is a backend error, after
//! the `wait`, not at once.
//!
//! On `redis-server`s of the test's own (ports 29404–29408), which the tests
//! kill and start again.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, RedisBackend, RedlockBackend, Registry};
use dlock_tests::redis_support::OwnRedis;
use dlock_tests::unique_key;

async fn redis_registry(server: &OwnRedis) -> Registry {
    let url = format!("{}?timeout=500ms", server.url());
    Registry::builder()
        .default_backend(RedisBackend::connect(&url).await.expect("connect"))
        .build()
}

/// Acquires and releases `key` once: the connections are open and warm.
async fn lock_once(registry: &Registry, key: &str) {
    let guard = registry.lock(key).acquire().await.expect("acquire");
    guard.release().await.expect("release");
}

/// The server is down when the acquisition starts (wait = 5 s) and back 1 s
/// later: the acquisition succeeds, soon after the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_acquisition_rides_out_a_restart_within_wait() {
    let mut server = OwnRedis::start(29404, &[]).await;
    let registry = redis_registry(&server).await;
    let key = unique_key("outage");
    lock_once(&registry, &key).await;

    server.kill();
    let started = Instant::now();
    let attempt = tokio::spawn({
        let (registry, key) = (registry.clone(), key.clone());
        async move {
            let answer = registry
                .lock(&key)
                .wait(Duration::from_secs(5))
                .acquire()
                .await;
            (answer, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart().await;
    let back = Instant::now();
    let (answer, acquired) = attempt.await.expect("task");
    let guard = answer.expect("acquired once the server was back");
    assert!(guard.fencing_token().is_some());
    println!(
        "acquired {:?} after the start, {:?} after the server answered again",
        acquired - started,
        acquired.saturating_duration_since(back)
    );
    assert!(acquired - started < Duration::from_secs(5));
    guard.release().await.expect("release");
}

/// An outage longer than `wait`: the backend's error, once `wait` has run
/// out (not at once), and retryable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_longer_than_wait_is_an_error_after_wait() {
    let mut server = OwnRedis::start(29405, &[]).await;
    let registry = redis_registry(&server).await;
    let key = unique_key("long-outage");
    lock_once(&registry, &key).await;

    server.kill();
    let started = Instant::now();
    let answer = registry
        .lock(&key)
        .wait(Duration::from_secs(1))
        .acquire()
        .await;
    let took = started.elapsed();
    println!("an outage longer than a 1 s wait: {answer:?} after {took:?}");
    match answer {
        Err(err @ LockError::Backend { .. }) => assert!(err.is_retryable(), "{err}"),
        other => panic!("expected the backend's error, got {other:?}"),
    }
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "answered after {took:?}"
    );
    // `wait = 0` still tries once and answers at once.
    let started = Instant::now();
    let once = registry.lock(&key).acquire().await;
    assert!(matches!(once, Err(LockError::Backend { .. })), "{once:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// Redlock with every master down when the acquisition starts (wait = 5 s),
/// all back 1 s later: the acquisition succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_acquisition_rides_out_a_restart_within_wait() {
    let mut servers = vec![
        OwnRedis::start(29406, &[]).await,
        OwnRedis::start(29407, &[]).await,
        OwnRedis::start(29408, &[]).await,
    ];
    let url = format!(
        "redlock://{}",
        servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect::<Vec<_>>()
            .join(",")
    );
    let registry = Registry::builder()
        .default_backend(RedlockBackend::connect(&url).await.expect("connect"))
        .build();
    let key = unique_key("redlock-outage");
    lock_once(&registry, &key).await;

    for server in &mut servers {
        server.kill();
    }
    let started = Instant::now();
    let attempt = tokio::spawn({
        let (registry, key) = (registry.clone(), key.clone());
        async move {
            registry
                .lock(&key)
                .wait(Duration::from_secs(5))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    for server in &mut servers {
        server.restart().await;
    }
    let guard = attempt
        .await
        .expect("task")
        .expect("acquired once the masters were back");
    assert!(started.elapsed() < Duration::from_secs(5));
    guard.release().await.expect("release");
}
