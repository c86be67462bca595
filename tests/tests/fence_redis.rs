//! The Redis fence (`dlock_runtime::fence::redis`) on a single server and on
//! Redis Cluster: a stale holder's late write is refused, concurrent writers
//! end with the largest token's value, hash fields are fenced one by one,
//! the fence outlives the value's deletion, tokens compare exactly, and the
//! fence lives in its key's slot.
#![cfg(feature = "redis")]

use std::time::Duration;

use dlock_runtime::fence::redis as fenced;
use dlock_runtime::{FencingToken, LockError, Registry};
use dlock_tests::fence_support::assert_fenced;
use dlock_tests::{server_url, servers_missing, unique_key};
use rand::seq::SliceRandom;
use redis::AsyncCommands;

fn single_url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

fn cluster_url() -> String {
    server_url(
        "DLOCK_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
    )
}

async fn single() -> redis::aio::MultiplexedConnection {
    let url = single_url();
    redis::Client::open(url.as_str())
        .unwrap_or_else(|e| servers_missing(&url, e))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

async fn cluster() -> redis::cluster_async::ClusterConnection {
    let url = cluster_url();
    let nodes: Vec<String> = url
        .trim_start_matches("redis+cluster://")
        .split(',')
        .map(|n| format!("redis://{}", n.trim_end_matches('/')))
        .collect();
    redis::cluster::ClusterClient::new(nodes)
        .unwrap_or_else(|e| servers_missing(&url, e))
        .get_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// The suite on one deployment: `$conn` opens a connection, `$url` is the
/// lock backend's URL.
macro_rules! fence_suite {
    ($name:ident, $conn:path, $url:path) => {
        mod $name {
            use super::*;

            /// A's lease runs out (no watchdog); B takes the lock with a
            /// larger token and writes through the fence; A's late write is
            /// refused and the value stays B's.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stale_holders_write_is_refused() {
                let registry = Registry::from_url(&$url()).await.expect("backend");
                let mut conn = $conn().await;
                let key = unique_key("fence-stale");
                let data = format!("fence-test:{key}");
                // Connected before A's short lease starts.
                registry
                    .lock(unique_key("fence-warm-up"))
                    .acquire()
                    .await
                    .expect("warm-up")
                    .release()
                    .await
                    .expect("warm-up release");
                let a = registry
                    .lock(&*key)
                    .lease(Duration::from_secs(1))
                    .watchdog(false)
                    .acquire()
                    .await
                    .expect("A acquires");
                let b = registry
                    .lock(&*key)
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
                    .expect("B acquires after A's lease ran out");
                let (ta, tb) = (a.fencing_token().unwrap(), b.fencing_token().unwrap());
                assert!(tb > ta);
                b.scope(fenced::set_current(&mut conn, &data, "B"))
                    .await
                    .expect("B writes");
                let refused = a.scope(fenced::set_current(&mut conn, &data, "A")).await;
                assert_fenced(refused, &data, ta.get(), tb.get());
                let value: String = conn.get(&data).await.unwrap();
                assert_eq!(value, "B");
                // Equal passes: B writes again.
                b.scope(fenced::set_current(&mut conn, &data, "B2"))
                    .await
                    .expect("equal token");
                let value: String = conn.get(&data).await.unwrap();
                assert_eq!(value, "B2");
                b.release().await.unwrap();
                let _ = a.release().await;
                let _: () = conn.del(&[&data, &fenced::fence_key(&data)]).await.unwrap();
            }

            /// An operator revokes A's hold (`Registry::revoke`): B is
            /// granted the key with a larger token and writes through the
            /// fence; A's late write with its revoked token is refused.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_revoked_holders_late_write_is_refused() {
                let registry = Registry::from_url(&$url()).await.expect("backend");
                let mut conn = $conn().await;
                let key = unique_key("fence-revoked");
                let data = format!("fence-test:{key}");
                let a = registry.lock(&*key).acquire().await.expect("A acquires");
                let ta = a.fencing_token().expect("A's token");
                let revoked = registry.revoke(&key).await.expect("revoke");
                assert_eq!(revoked.len(), 1, "{revoked:?}");
                let b = registry
                    .lock(&*key)
                    .wait(Duration::from_secs(10))
                    .acquire()
                    .await
                    .expect("B acquires after the revocation");
                let tb = b.fencing_token().expect("B's token");
                assert!(tb > ta, "B's token {tb} above the revoked {ta}");
                b.scope(fenced::set_current(&mut conn, &data, "B"))
                    .await
                    .expect("B writes");
                // A, paused through all of it, writes with the token it had.
                let refused = fenced::set(&mut conn, &data, "A", ta).await;
                assert_fenced(refused, &data, ta.get(), tb.get());
                let value: String = conn.get(&data).await.unwrap();
                assert_eq!(value, "B");
                tokio::time::timeout(Duration::from_secs(15), a.lost())
                    .await
                    .expect("A learns that it lost the key");
                b.release().await.unwrap();
                let _ = a.release().await;
                let _: () = conn.del(&[&data, &fenced::fence_key(&data)]).await.unwrap();
            }

            /// Many writers at once, tokens shuffled: each refusal names a
            /// larger token, and the value left is the largest token's.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_writers_leave_the_largest_tokens_value() {
                let conn = $conn().await;
                let data = format!("fence-test:{}", unique_key("fence-order"));
                let mut tokens: Vec<u64> = (1..=32).collect();
                tokens.shuffle(&mut rand::rng());
                let mut tasks = Vec::new();
                for t in tokens {
                    let (mut conn, data) = (conn.clone(), data.clone());
                    tasks.push(tokio::spawn(async move {
                        match fenced::set(&mut conn, &data, t.to_string(), FencingToken::new(t))
                            .await
                        {
                            Ok(()) => {}
                            Err(LockError::Fenced { seen, .. }) => {
                                assert!(seen.unwrap().get() > t, "refused {t}");
                            }
                            Err(e) => panic!("{t}: {e}"),
                        }
                    }));
                }
                for task in tasks {
                    task.await.unwrap();
                }
                let mut conn = conn;
                let value: String = conn.get(&data).await.unwrap();
                assert_eq!(value, "32");
                let _: () = conn.del(&[&data, &fenced::fence_key(&data)]).await.unwrap();
            }

            /// Each field of a hash has its own fence.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn hash_fields_are_fenced_one_by_one() {
                let mut conn = $conn().await;
                let data = format!("fence-test:{}", unique_key("fence-hash"));
                fenced::hset(&mut conn, &data, "a", "a10", FencingToken::new(10))
                    .await
                    .unwrap();
                fenced::hset(&mut conn, &data, "b", "b5", FencingToken::new(5))
                    .await
                    .unwrap();
                let refused = fenced::hset(&mut conn, &data, "a", "a9", FencingToken::new(9)).await;
                assert_fenced(refused, &format!("{data}#a"), 9, 10);
                fenced::hset(&mut conn, &data, "b", "b6", FencingToken::new(6))
                    .await
                    .unwrap();
                let (a, b): (String, String) = redis::cmd("HMGET")
                    .arg(&data)
                    .arg("a")
                    .arg("b")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert_eq!((a.as_str(), b.as_str()), ("a10", "b6"));
                let _: () = conn
                    .del(&[&data, &fenced::hash_fence_key(&data)])
                    .await
                    .unwrap();
            }

            /// Deleting the value leaves its fence, with the retention as TTL:
            /// a stale write after the deletion is still refused.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_fence_outlives_the_values_deletion() {
                let mut conn = $conn().await;
                let data = format!("fence-test:{}", unique_key("fence-deleted"));
                fenced::set(&mut conn, &data, "x", FencingToken::new(10))
                    .await
                    .unwrap();
                let _: () = conn.del(&data).await.unwrap();
                let refused = fenced::set(&mut conn, &data, "y", FencingToken::new(9)).await;
                assert_fenced(refused, &data, 9, 10);
                let exists: bool = conn.exists(&data).await.unwrap();
                assert!(!exists, "the refused write wrote nothing");
                let ttl: i64 = conn.pttl(fenced::fence_key(&data)).await.unwrap();
                let retention = dlock_runtime::fence::DEFAULT_RETENTION.as_millis() as i64;
                assert!(ttl > retention - 60_000 && ttl <= retention, "{ttl}");
                let _: () = conn.del(fenced::fence_key(&data)).await.unwrap();
            }

            /// Tokens compare as integers, exactly: 10 after 9, and 2^60 + 1
            /// against 2^60 (one double apart from nothing).
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tokens_compare_exactly_as_integers() {
                let mut conn = $conn().await;
                let data = format!("fence-test:{}", unique_key("fence-exact"));
                for t in [9, 10] {
                    fenced::set(&mut conn, &data, "v", FencingToken::new(t))
                        .await
                        .unwrap();
                }
                assert_fenced(
                    fenced::set(&mut conn, &data, "v", FencingToken::new(9)).await,
                    &data,
                    9,
                    10,
                );
                let big = 1u64 << 60;
                fenced::set(&mut conn, &data, "v", FencingToken::new(big + 1))
                    .await
                    .unwrap();
                assert_fenced(
                    fenced::set(&mut conn, &data, "v", FencingToken::new(big)).await,
                    &data,
                    big,
                    big + 1,
                );
                fenced::set(&mut conn, &data, "v", FencingToken::new(u64::MAX))
                    .await
                    .unwrap();
                let _: () = conn.del(&[&data, &fenced::fence_key(&data)]).await.unwrap();
            }
        }
    };
}

fence_suite!(single_server, single, single_url);
fence_suite!(redis_cluster, cluster, cluster_url);

/// Redis Cluster puts a key's fences in the key's own slot (`CLUSTER
/// KEYSLOT`, asked of a node): the script touches one slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fences_are_in_their_keys_slot() {
    let url = cluster_url();
    let first = url
        .trim_start_matches("redis+cluster://")
        .split(',')
        .next()
        .map(|n| format!("redis://{}", n.trim_end_matches('/')))
        .unwrap();
    let mut node = redis::Client::open(first.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(&first, e));
    for key in ["balance", "{user:7}:balance", "a{b}c", "{}x"] {
        let mut slots = Vec::new();
        for k in [
            key.to_owned(),
            fenced::fence_key(key),
            fenced::hash_fence_key(key),
        ] {
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(k)
                .query_async(&mut node)
                .await
                .unwrap();
            slots.push(slot);
        }
        assert!(slots.iter().all(|&s| s == slots[0]), "{key}: {slots:?}");
    }
}
