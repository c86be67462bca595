//! The conformance suite on a single Redis server, and what only Redis has:
//! ACL users, TLS, pub/sub wake-ups between processes, fence counters that
//! survive data loss, clear errors for bad credentials and dead servers.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, RedisBackend, Registry};
use dlock_tests::redis_support::{RedisFaults, RedisKeyFaults, hash_tagged};
use dlock_tests::{Harness, server_url, servers_missing, unique_key};
use tokio::sync::OnceCell;

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(RedisKeyFaults {
                    redis: RedisFaults::nodes(&[url]).await,
                    layout: hash_tagged,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

/// A second backend on its own connections: what another process would have.
async fn other_process() -> Registry {
    Registry::builder()
        .default_backend(RedisBackend::connect(&url()).await.expect("connect"))
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_of_another_connection_at_once() {
    harness().await;
    let (holder, waiter) = (other_process().await, other_process().await);
    let handoffs = dlock_tests::handoff::measure(
        &holder,
        &waiter,
        &unique_key("pubsub-handoff"),
        5,
        Duration::from_millis(100),
    )
    .await;
    // The holder's lease was 30 s: only the release message can explain this.
    assert!(
        handoffs.median() < Duration::from_millis(1000),
        "median handoff {:?} (all: {handoffs:?})",
        handoffs.median()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_when_the_counter_is_lost() {
    let h = harness().await;
    let key = unique_key("fence-loss");
    let registry = h.registry();
    let first = registry.lock(&key).acquire().await.expect("acquire");
    let before = first.fencing_token().expect("token");
    first.release().await.expect("release");
    // A restart without persistence, or an operator's FLUSHALL, loses the
    // counter (one per server, shared by every key).
    RedisFaults::nodes(&[url()])
        .await
        .delete("dlock-fence")
        .await;
    let second = registry.lock(&key).acquire().await.expect("acquire");
    assert!(second.fencing_token().expect("token") > before);
    second.release().await.expect("release");
}

#[tokio::test]
async fn acl_user_limited_to_the_lock_keys() {
    harness().await;
    let url = server_url(
        "DLOCK_TEST_REDIS_ACL_URL",
        "redis://dlock:dlock-secret@127.0.0.1:46379/",
    );
    let registry = Registry::builder()
        .default_backend(
            RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e)),
        )
        .build();
    let key = unique_key("acl");
    let guard = registry
        .lock(&key)
        .lease(Duration::from_millis(600))
        .acquire()
        .await
        .expect("acquire as the ACL user");
    // Held past a renewal, then released: every command of the backend is allowed.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!guard.is_lost());
    guard.release().await.expect("release as the ACL user");
    // A prefix outside the user's key pattern is refused by the server, clearly.
    let outside = Registry::builder()
        .default_backend(RedisBackend::connect(&url).await.expect("connect"))
        .key_prefix("other:")
        .build();
    let refused = outside.lock(&key).acquire().await;
    match refused {
        Err(LockError::Backend { source, .. }) => {
            let message = source.to_string().to_lowercase();
            assert!(
                message.contains("noperm") || message.contains("permission"),
                "{source}"
            );
        }
        other => panic!("expected a permission error, got {other:?}"),
    }
}

#[tokio::test]
async fn wrong_password_is_a_clear_error_without_the_password() {
    let result = RedisBackend::connect("redis://dlock:not-the-password@127.0.0.1:46379/").await;
    let err = result.expect_err("must not connect");
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("not-the-password"), "{shown}");
    assert!(matches!(err, LockError::Backend { .. }), "{shown}");
}

#[tokio::test]
async fn unreachable_server_fails_within_the_timeout() {
    let started = Instant::now();
    let result = RedisBackend::connect("redis://127.0.0.1:1/?timeout=500ms").await;
    assert!(
        matches!(result, Err(LockError::Backend { .. })),
        "{result:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn tls_with_a_private_ca() {
    harness().await;
    let url = server_url("DLOCK_TEST_REDIS_TLS_URL", "rediss://127.0.0.1:46390/");
    let ca = std::env::var("DLOCK_TEST_REDIS_TLS_CA").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../target/servers/tls/ca.crt").to_owned()
    });
    let url = format!("{url}?tls_ca={ca}");
    let registry = Registry::builder()
        .default_backend(
            RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e)),
        )
        .build();
    let guard = registry
        .lock(unique_key("tls"))
        .acquire()
        .await
        .expect("acquire over TLS");
    assert!(guard.fencing_token().is_some());
    guard.release().await.expect("release over TLS");
    // Without the CA the server's certificate is not trusted.
    let plain = RedisBackend::connect(&server_url(
        "DLOCK_TEST_REDIS_TLS_URL",
        "rediss://127.0.0.1:46390/",
    ))
    .await;
    assert!(plain.is_err());
}

#[tokio::test]
async fn bad_redis_urls_are_config_errors() {
    for url in [
        "redis://a:1,b:2/",
        "redis://127.0.0.1:46379/?timeout=never",
        "rediss://127.0.0.1:46390/?tls_ca=/no/such/file",
    ] {
        let result = RedisBackend::connect(url).await;
        assert!(
            matches!(result, Err(LockError::Config { .. })),
            "{url}: {result:?}"
        );
    }
}

/// Acquisitions dropped at every point of their flight (before sending, on
/// the wire, after the grant) leave no key behind, and not only after the
/// lease: the release follows the abandoned command on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_acquisitions_leave_no_key() {
    let h = harness().await;
    let mut keys = Vec::new();
    for i in 0..200u64 {
        let key = unique_key(&format!("abandoned-{i}"));
        let attempt = h
            .registry()
            .lock(&key)
            .lease(Duration::from_secs(30))
            .acquire();
        // Granted guards are dropped here too (released in the background).
        let _ = tokio::time::timeout(Duration::from_micros(25 * (i % 12)), attempt).await;
        keys.push(key);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for key in keys {
        assert!(
            !h.faults.is_held(&h.stored(&key)).await,
            "{key} is still held"
        );
    }
}

/// The same at the moment commands switch connections: a backend's first
/// commands from a runtime go over its home connection while a local one
/// opens, later ones over the local one. An acquisition abandoned on one and
/// released over the other must still leave no key (ten fresh backends, each
/// with acquisitions abandoned from its first command on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_acquisitions_leave_no_key_while_connections_switch() {
    let h = harness().await;
    let mut keys = Vec::new();
    for _ in 0..10 {
        let fresh = other_process().await;
        for i in 0..40u64 {
            let key = unique_key(&format!("abandoned-switch-{i}"));
            let attempt = fresh.lock(&key).lease(Duration::from_secs(30)).acquire();
            let _ = tokio::time::timeout(Duration::from_micros(50 * (i % 8)), attempt).await;
            keys.push(key);
            tokio::task::yield_now().await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut held = Vec::new();
    for key in keys {
        if h.faults.is_held(&h.stored(&key)).await {
            held.push(key);
        }
    }
    assert!(held.is_empty(), "still held: {held:?}");
}
