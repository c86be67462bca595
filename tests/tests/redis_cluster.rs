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
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

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
    let handoffs = dlock_tests::handoff::measure_when_ready(
        &holder,
        &waiter,
        5,
        // A key per round: the keys land on different shards.
        |round| dlock_tests::unique_key(&format!("sharded-handoff-{round}")),
        |key| {
            let channel = format!("{}:released", hash_tagged(&h.stored(&key)));
            async move {
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
            }
        },
    )
    .await;
    println!("handoffs through the key's shard: {:?}", handoffs.0);
    assert!(
        handoffs.median() < Duration::from_millis(1000),
        "median handoff {:?} (all: {handoffs:?})",
        handoffs.median()
    );
}

const CLUSTER_PORTS: [u16; 3] = [47001, 47002, 47003];

async fn node(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("node")
}

async fn node_id(port: u16) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query_async(&mut node(port).await)
        .await
        .expect("CLUSTER MYID")
}

/// The port of the master that owns `slot`, from `CLUSTER NODES`.
async fn slot_owner(slot: u16) -> u16 {
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut node(CLUSTER_PORTS[0]).await)
        .await
        .expect("CLUSTER NODES");
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let port = fields[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .expect("ip:port@bus");
        for range in &fields[8..] {
            if range.starts_with('[') {
                continue;
            }
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            let (lo, hi): (u16, u16) = (lo.parse().expect("slot"), hi.parse().expect("slot"));
            if (lo..=hi).contains(&slot) {
                return port;
            }
        }
    }
    panic!("nobody owns slot {slot}:\n{nodes}")
}

/// Moves `slot` (and its keys) from the master on `from` to the one on `to`,
/// the way `redis-cli --cluster reshard` does.
async fn move_slot(slot: u16, from: u16, to: u16) {
    let (from_id, to_id) = (node_id(from).await, node_id(to).await);
    let (mut src, mut dst) = (node(from).await, node(to).await);
    let _: () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("IMPORTING")
        .arg(&from_id)
        .query_async(&mut dst)
        .await
        .expect("SETSLOT IMPORTING");
    let _: () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("MIGRATING")
        .arg(&to_id)
        .query_async(&mut src)
        .await
        .expect("SETSLOT MIGRATING");
    loop {
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(100)
            .query_async(&mut src)
            .await
            .expect("GETKEYSINSLOT");
        if keys.is_empty() {
            break;
        }
        let _: redis::Value = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(to)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS")
            .arg(&keys)
            .query_async(&mut src)
            .await
            .expect("MIGRATE");
    }
    // The new owner first, then the old one (which then drops the slot's
    // sharded subscriptions), then the third master.
    for port in [to, from]
        .into_iter()
        .chain(CLUSTER_PORTS.into_iter().filter(|p| *p != to && *p != from))
    {
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("NODE")
            .arg(&to_id)
            .query_async(&mut node(port).await)
            .await
            .expect("SETSLOT NODE");
    }
}

/// The slot of a waited-on key moves to another master while a waiter is
/// subscribed to its release channel. The old owner drops the sharded
/// subscription (`SUNSUBSCRIBE`); the listener must subscribe again on the
/// new owner, so the release (which now goes to the new owner) still wakes
/// the waiter at once rather than at the end of the holder's 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_follows_its_channels_slot_to_another_master() {
    let h = harness().await;
    let (holder, waiter) = (other_process().await, other_process().await);
    let key = dlock_tests::unique_key("slot-moves");
    let lock_key = hash_tagged(&h.stored(&key));
    let channel = format!("{lock_key}:released");
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&lock_key)
        .query_async(&mut node(CLUSTER_PORTS[0]).await)
        .await
        .expect("CLUSTER KEYSLOT");
    let home = slot_owner(slot).await;
    let away = *CLUSTER_PORTS
        .iter()
        .find(|p| **p != home)
        .expect("3 masters");

    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("acquire");
    let waiting = dlock_tests::handoff::start_waiting(&waiter, &key, Duration::from_secs(25));
    let subscribed_on = |port: u16, channel: String| async move {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("SHARDNUMSUB")
            .arg(&channel)
            .query_async(&mut node(port).await)
            .await
            .expect("PUBSUB SHARDNUMSUB");
        n
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while subscribed_on(home, channel.clone()).await != 1 {
        assert!(Instant::now() < deadline, "the waiter never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    move_slot(slot, home, away).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut resubscribed = false;
    while Instant::now() < deadline {
        if subscribed_on(away, channel.clone()).await == 1 {
            resubscribed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let released = Instant::now();
    guard.release().await.expect("release after the move");
    let (next, acquired) = waiting.await.expect("task");
    let next = next.expect("handed over");
    let took = acquired.saturating_duration_since(released);
    next.release().await.expect("release");
    move_slot(slot, away, home).await;
    assert!(
        resubscribed,
        "the waiter did not subscribe again on the slot's new owner (port {away})"
    );
    assert!(
        took < Duration::from_secs(2),
        "the release after the move woke the waiter only after {took:?}"
    );
}
