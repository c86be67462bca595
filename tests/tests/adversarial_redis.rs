//! Adversarial tests of the Redis backend (single server at 46379): each one
//! FAILS on the code it was written against, and says which clause of
//! DESIGN.md it shows broken. See also `adversarial.rs`.
#![cfg(feature = "redis")]

use std::time::Duration;

use dlock_runtime::{RedisBackend, Registry};
use dlock_tests::redis_support::RedisFaults;
use dlock_tests::{server_url, servers_missing};
use futures_util::FutureExt;

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

/// A registry of its own, with a prefix unique to this run, so that the
/// server-side keys and channels it makes can be counted.
async fn registry() -> (Registry, String) {
    let url = url();
    let backend = RedisBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    let prefix = format!("adv{:016x}:", rand::random::<u64>());
    let registry = Registry::builder()
        .default_backend(backend)
        .key_prefix(prefix.clone())
        .build();
    (registry, prefix)
}

async fn admin() -> redis::aio::MultiplexedConnection {
    RedisFaults::nodes(&[url()]).await.first_node().await
}

/// Locks and releases N distinct keys (`order:{id}`-style): every one leaves a
/// `{K}:fence` counter on the server, with no TTL, for ever.
///
/// Contract: §4 Redis "the counter shared per hash slot (one per server
/// without Cluster), **never a key per lock name**"; §4 "State is bounded";
/// §5.8 "after N distinct keys are locked and released, the server … hold[s]
/// O(1) state once a bounded retention has passed, not O(N)". Fault:
/// `acquire.lua` `INCR`s `KEYS[2]` = `{K}:fence`, one key per lock name,
/// never expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_keys_leave_a_fence_counter_each_for_ever() {
    const N: usize = 50;
    let (registry, prefix) = registry().await;
    for id in 0..N {
        let guard = registry
            .lock(format!("order:{id}"))
            .acquire()
            .await
            .expect("acquire");
        guard.release().await.expect("release");
    }
    let mut conn = admin().await;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{prefix}*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    let mut without_ttl = 0;
    for key in &left {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .expect("PTTL");
        if ttl == -1 {
            without_ttl += 1;
        }
    }
    // Clean up the test's own mess before judging.
    for key in &left {
        let _: i64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await.unwrap_or(0);
    }
    assert!(
        left.len() <= 1,
        "{N} keys locked and released left {} keys on the server ({without_ttl} of them \
         never expire), e.g. {:?}",
        left.len(),
        left.first()
    );
}

/// A replica promoted behind its master: the lock's counter on the new
/// master misses the last `INCR` (asynchronous replication). Simulated by
/// putting the counter back to what such a replica holds.
///
/// The next token equals the last one handed out: a stale holder's writes
/// with that token are accepted by fenced storage.
///
/// Contract: §2 fencing token "strictly increasing per key"; §4 Tokens
/// "strictly increase per key even when the backend loses its per-key state
/// (… a replica promoted behind its master): where the backend keeps a
/// counter, the token is the larger of the counter + 1 and the server's
/// clock in µs". Fault: `acquire.lua` seeds from `TIME` only when `INCR`
/// answers 1 (counter missing); a counter that is present but behind is
/// trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_repeat_after_a_replica_behind_its_master_is_promoted() {
    let (registry, prefix) = registry().await;
    let key = "replica-behind";
    let first = registry.lock(key).acquire().await.expect("acquire");
    let before: u64 = first.fencing_token().expect("token").into();
    first.release().await.expect("release");

    // What the promoted replica has: the counter before the last grant.
    let fence = format!("{{{prefix}{key}}}:fence");
    let mut conn = admin().await;
    let counter: u64 = redis::cmd("GET")
        .arg(&fence)
        .query_async(&mut conn)
        .await
        .expect("the counter of this key");
    assert_eq!(counter, before, "layout as read in acquire.lua");
    let _: () = redis::cmd("SET")
        .arg(&fence)
        .arg(before - 1)
        .query_async(&mut conn)
        .await
        .expect("SET");

    let second = registry.lock(key).acquire().await.expect("acquire");
    let after: u64 = second.fencing_token().expect("token").into();
    second.release().await.expect("release");
    let _: i64 = redis::cmd("DEL").arg(&fence).query_async(&mut conn).await.unwrap_or(0);
    assert!(
        after > before,
        "token after the promotion {after} is not above the last one handed out {before}"
    );
}

/// A waiter whose acquisition is dropped (a `timeout`, a `select!`, or its
/// own `wait` deadline around `wake_source`) while it joins the release
/// channel: the listener has counted it and subscribed, the answer is in the
/// oneshot, but the `Subscription` whose `Drop` sends `Leave` is never built.
/// The process stays subscribed to that channel for ever: one leaked
/// subscription (a `channels` entry in the listener, a channel on the
/// server) per such waiter and key.
///
/// Contract: §4 "State is bounded … waiter entries … never grow the server
/// or the process without bound"; §5.6 "an abandoned acquisition stops";
/// §5.8. Fault: `Listener::join` — the count is taken in the listener task
/// before the caller has the guard that gives it back (no `Leave` when the
/// reply is dropped unreceived).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_while_joining_the_release_channel_leaks_its_subscription() {
    let (registry, prefix) = registry().await;
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
