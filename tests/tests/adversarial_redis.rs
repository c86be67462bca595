//! Adversarial tests of the Redis backend (single server at 46379): each
//! failed on the code it was written against (the comment says how, and which
//! clause of DESIGN.md it broke) and passes since the fix. See also
//! `adversarial.rs`.
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
async fn a_waiter_dropped_while_joining_the_release_channel_leaves_it() {
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
