//! The conformance suite, unchanged, on a three-master Redis Cluster.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{RedisBackend, Registry};
use dlock_tests::redis_support::{RedisFaults, RedisKeyFaults, hash_tagged};
use dlock_tests::{Harness, server_url, servers_missing};
use tokio::sync::OnceCell;

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = server_url(
                "DLOCK_TEST_REDIS_CLUSTER_URL",
                "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
            );
            let backend = RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            let seeds: Vec<String> = url
                .trim_start_matches("redis+cluster://")
                .split(',')
                .map(|h| format!("redis://{h}"))
                .collect();
            Harness {
                faults: Arc::new(RedisKeyFaults {
                    redis: RedisFaults::cluster(&seeds).await,
                    layout: hash_tagged,
                }),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);

/// A backend on connections of its own: what another process would have.
async fn other_process() -> Registry {
    let url = server_url(
        "DLOCK_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
    );
    Registry::builder()
        .default_backend(RedisBackend::connect(&url).await.expect("connect"))
        .build()
}

/// How many subscribers `channel` has on every node: (plain, sharded).
async fn subscribers(channel: &str) -> (i64, i64) {
    let mut plain = 0;
    let mut sharded = 0;
    for port in [47001, 47002, 47003] {
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("node");
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query_async(&mut conn)
            .await
            .expect("PUBSUB NUMSUB");
        plain += n;
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("SHARDNUMSUB")
            .arg(channel)
            .query_async(&mut conn)
            .await
            .expect("PUBSUB SHARDNUMSUB");
        sharded += n;
    }
    (plain, sharded)
}

/// A release on the cluster wakes a waiter of another connection at once
/// (the holder's lease is 30 s), through a sharded channel: the waiter is
/// `SSUBSCRIBE`d on the key's shard only, never `SUBSCRIBE`d (a `PUBLISH`
/// is broadcast to every node of a cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_through_the_keys_shard() {
    let h = harness().await;
    let (holder, waiter) = (other_process().await, other_process().await);
    let mut handoffs = Vec::new();
    for round in 0..5 {
        // A key per round: the keys land on different shards.
        let key = dlock_tests::unique_key(&format!("sharded-handoff-{round}"));
        let channel = format!("{}:released", hash_tagged(&h.stored(&key)));
        let guard = holder
            .lock(&key)
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .expect("acquire");
        let waiting = tokio::spawn({
            let (waiter, key) = (waiter.clone(), key.clone());
            async move {
                let g = waiter
                    .lock(&key)
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await;
                (g, Instant::now())
            }
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (plain, sharded) = subscribers(&channel).await;
            assert_eq!(plain, 0, "a plain SUBSCRIBE to {channel} on a cluster");
            if sharded == 1 {
                break;
            }
            assert!(Instant::now() < deadline, "the waiter never subscribed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let released = Instant::now();
        guard.release().await.expect("release");
        let (next, acquired) = waiting.await.expect("task");
        next.expect("handed over").release().await.expect("release");
        handoffs.push(acquired - released);
    }
    handoffs.sort();
    println!("handoffs through the key's shard: {handoffs:?}");
    assert!(
        handoffs[2] < Duration::from_millis(100),
        "median handoff {:?} (all: {handoffs:?})",
        handoffs[2]
    );
}
