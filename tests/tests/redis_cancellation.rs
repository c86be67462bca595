//! Cancellation and shutdown on a single Redis server: a release the caller
//! gives up on while the server stalls still frees the key and stops the
//! renewals, a waiter dropped while it joins the release channel leaves it,
//! and graceful shutdown frees every key at once.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::{RedisBackend, Registry};
use dlock_tests::redis_support::{RedisFaults, RedisKeyFaults};
use dlock_tests::{server_url, servers_missing, unique_key};
use futures_util::FutureExt;
use redis::AsyncCommands;

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

/// A registry on connections of its own: what another process would have.
async fn registry() -> Registry {
    let url = url();
    Registry::builder()
        .default_backend(
            RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e)),
        )
        .build()
}

/// A registry of its own, with a prefix unique to this run, so that the
/// server-side keys and channels it makes can be counted.
async fn prefixed_registry() -> (Registry, String) {
    let url = url();
    let backend = RedisBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let prefix = format!("cancel{:016x}:", rand::random::<u64>());
    let registry = Registry::builder()
        .default_backend(backend)
        .key_prefix(prefix.clone())
        .build();
    (registry, prefix)
}

/// A plain connection to the server, for looking at keys behind dlock's back.
async fn admin() -> redis::aio::MultiplexedConnection {
    let url = url();
    redis::Client::open(url.as_str())
        .unwrap_or_else(|e| servers_missing(&url, e))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// The Redis key of a lock (`{dlock:key}`: hash-tagged stored key).
fn redis_key(key: &str) -> String {
    format!("{{dlock:{key}}}")
}

async fn exists(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    conn.exists(redis_key(key)).await.expect("EXISTS")
}

/// Keeps the server busy for 500 ms (a script spinning on `TIME`).
const BUSY_500MS: &str = "local t = redis.call('TIME') \
    local s = tonumber(t[1]) * 1000000 + tonumber(t[2]) \
    repeat local n = redis.call('TIME') \
    until tonumber(n[1]) * 1000000 + tonumber(n[2]) > s + 500000";

/// The server stalls for 500 ms just as a renewal goes out; the
/// caller gives up on `release()` after 250 ms. The release still happens
/// (the key is deleted well before any renewed lease could have run out) and
/// no renewal follows it (the key stays free, another registry takes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_release_leaves_no_renewed_lease() {
    let reg = registry().await;
    let mut conn = admin().await;
    let key = unique_key("cancelled-release");
    let guard = reg
        .lock(&key)
        .lease(Duration::from_millis(1500))
        .acquire()
        .await
        .expect("acquire");
    let t0 = Instant::now();
    // The server is busy from ~450 ms to ~950 ms: the renewal due at 500 ms
    // waits behind the script.
    tokio::time::sleep_until((t0 + Duration::from_millis(450)).into()).await;
    let busy = tokio::spawn(async move {
        let mut stall = admin().await;
        let _: redis::RedisResult<()> = redis::cmd("EVAL")
            .arg(BUSY_500MS)
            .arg(0)
            .query_async(&mut stall)
            .await;
    });
    tokio::time::sleep_until((t0 + Duration::from_millis(600)).into()).await;
    let cancelled = tokio::time::timeout(Duration::from_millis(250), guard.release()).await;
    assert!(
        cancelled.is_err(),
        "the release finished while the server was stalled (the stall came too late?)"
    );
    busy.await.expect("stall task");
    // Renewed at ~950 ms, the lease would last to ~2.45 s; unrenewed, to 1.5 s.
    let deadline = t0 + Duration::from_millis(1450);
    loop {
        if !exists(&mut conn, &key).await {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the key is still there after the cancelled release (PTTL {} ms)",
            conn.pttl::<_, i64>(redis_key(&key)).await.expect("PTTL")
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Nothing brings it back: no renewal after the release.
    let until = t0 + Duration::from_millis(4600);
    while Instant::now() < until {
        assert!(
            !exists(&mut conn, &key).await,
            "the key came back after its release"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    registry()
        .await
        .lock(&key)
        .acquire()
        .await
        .expect("free for another registry")
        .release()
        .await
        .expect("release");
}

/// `shutdown` deletes every held key on the server before it
/// returns, tells a running body its lease is lost, and refuses new
/// acquisitions; a guard dropped just before it has its background release
/// waited for (`dlock_tests::scenarios::graceful_shutdown`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_releases_every_lease() {
    let faults = RedisKeyFaults {
        redis: RedisFaults::nodes(&[url()]).await,
        layout: dlock_tests::redis_support::hash_tagged,
    };
    dlock_tests::scenarios::graceful_shutdown(&registry().await, &registry().await, &faults).await;
}

/// A waiter whose acquisition is dropped (a `timeout`, a `select!`, or its
/// own `wait` deadline around `wake_source`) while it joins the release
/// channel, after the listener counted it and subscribed: the process leaves
/// the channel, so no subscription is left per such waiter and key (DESIGN.md
/// §4: state is bounded; §5.6: an abandoned acquisition stops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_while_joining_the_release_channel_leaves_it() {
    let (registry, prefix) = prefixed_registry().await;
    let key = "abandoned-join";
    let channel = format!("{{{prefix}{key}}}:released");
    let mut conn = admin().await;
    let subscribers = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        let channel = channel.clone();
        async move {
            let (_, n): (String, i64) = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(&channel)
                .query_async(&mut conn)
                .await
                .expect("PUBSUB NUMSUB");
            n
        }
    };

    let holder = registry
        .lock(key)
        .lease(Duration::from_secs(10))
        .acquire()
        .await
        .expect("holder");
    // Step the waiter by hand: each poll takes one step (a round trip, then
    // the join), and the waits between let the other side answer.
    let mut waiter = Box::pin(registry.lock(key).wait(Duration::from_secs(5)).acquire());
    let mut joined = false;
    for _ in 0..20 {
        assert!((&mut waiter).now_or_never().is_none(), "the key is busy");
        tokio::time::sleep(Duration::from_millis(50)).await;
        if subscribers(&mut conn).await == 1 {
            joined = true;
            break;
        }
    }
    assert!(joined, "the waiter never subscribed");
    // Subscribed, and the listener's answer waits in the oneshot: stop here.
    drop(waiter);
    holder.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let left = subscribers(&mut conn).await;
    assert_eq!(
        left, 0,
        "nobody waits on {channel} any more, yet this process is still subscribed to it"
    );
}
