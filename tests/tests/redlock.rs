//! The conformance suite on Redlock over the five Redis masters of
//! `scripts/servers.sh`, and what only Redlock has: majority votes, split
//! votes undone on every node (quietly: no waiter is woken by a roll-back),
//! nodes that never answered costing no wait, no fencing token.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockBackend, LockError, RedlockBackend, Registry};
use dlock_tests::redis_support::{RedisFaults, RedisKeyFaults, verbatim};
use dlock_tests::{Harness, server_url, servers_missing, unique_key};
use futures_util::StreamExt;
use redis::AsyncCommands;
use tokio::sync::OnceCell;

fn url() -> String {
    server_url(
        "DLOCK_TEST_REDLOCK_URL",
        "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
    )
}

/// `host:port` of each node of the Redlock URL.
fn node_hosts() -> Vec<String> {
    let url = url();
    let hosts = url.trim_start_matches("redlock://");
    hosts
        .split(',')
        .map(|h| h.trim_end_matches('/').to_owned())
        .collect()
}

/// `redis://host:port` for each node of the Redlock URL.
fn node_urls() -> Vec<String> {
    node_hosts()
        .iter()
        .map(|h| format!("redis://{h}/"))
        .collect()
}

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = RedlockBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(RedisKeyFaults {
                    redis: RedisFaults::nodes(&node_urls()).await,
                    layout: verbatim,
                }),
                fences: false,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);

async fn node(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("node url")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

/// How many nodes hold `key` right now.
async fn copies(key: &str) -> usize {
    let mut held = 0;
    for url in node_urls() {
        let ttl: i64 = node(&url).await.pttl(key).await.expect("PTTL");
        if ttl > 0 {
            held += 1;
        }
    }
    held
}

#[tokio::test]
async fn a_lock_is_written_to_every_node_and_released_from_every_node() {
    let h = harness().await;
    let key = unique_key("every-node");
    let guard = h.registry().lock(&key).acquire().await.expect("acquire");
    assert_eq!(guard.fencing_token(), None, "Redlock has no safe token");
    assert_eq!(copies(&h.stored(&key)).await, 5);
    guard.release().await.expect("release");
    assert_eq!(copies(&h.stored(&key)).await, 0);
}

#[tokio::test]
async fn a_minority_of_foreign_copies_does_not_block_the_majority() {
    let h = harness().await;
    let key = unique_key("minority");
    let stored = h.stored(&key);
    let urls = node_urls();
    // Another client holds the key on two nodes only (a split vote it lost).
    for url in &urls[..2] {
        let _: () = node(url)
            .await
            .set_ex(&stored, "someone-else", 30)
            .await
            .expect("SET");
    }
    let guard = h
        .registry()
        .lock(&key)
        .acquire()
        .await
        .expect("three of five is a majority");
    assert_eq!(copies(&stored).await, 5);
    guard.release().await.expect("release");
    // Our release is owner-checked: the foreign copies stay.
    assert_eq!(copies(&stored).await, 2);
    for url in &urls[..2] {
        let _: i64 = node(url).await.del(&stored).await.expect("DEL");
    }
}

#[tokio::test]
async fn a_majority_of_foreign_copies_is_busy_and_our_votes_are_undone() {
    let h = harness().await;
    let key = unique_key("majority");
    let stored = h.stored(&key);
    let urls = node_urls();
    for url in &urls[..3] {
        let _: () = node(url)
            .await
            .set_ex(&stored, "someone-else", 30)
            .await
            .expect("SET");
    }
    let started = Instant::now();
    let result = h
        .registry()
        .lock(&key)
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(matches!(result, Err(LockError::Busy { .. })), "{result:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    // The two nodes that said yes were released again.
    for url in &urls[3..] {
        let exists: bool = node(url).await.exists(&stored).await.expect("EXISTS");
        assert!(!exists, "a vote of the failed attempt was left on {url}");
    }
    for url in &urls[..3] {
        let _: i64 = node(url).await.del(&stored).await.expect("DEL");
    }
}

#[tokio::test]
async fn deleting_the_key_from_a_majority_is_a_loss() {
    let h = harness().await;
    let key = unique_key("majority-del");
    let stored = h.stored(&key);
    let guard = h
        .registry()
        .lock(&key)
        .lease(Duration::from_millis(900))
        .acquire()
        .await
        .expect("acquire");
    let urls = node_urls();
    // Two nodes forgetting is survivable…
    for url in &urls[..2] {
        let _: i64 = node(url).await.del(&stored).await.expect("DEL");
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!guard.is_lost(), "three copies are still a majority");
    // …three are not.
    let _: i64 = node(&urls[2]).await.del(&stored).await.expect("DEL");
    tokio::time::timeout(Duration::from_millis(900), guard.lost())
        .await
        .expect("the loss reaches the holder within one lease");
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

#[tokio::test]
async fn bad_redlock_urls_are_config_errors() {
    for url in [
        "redlock://127.0.0.1:46379,127.0.0.1:46380",
        "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381?timeout=soon",
        "redis://127.0.0.1:46379/",
    ] {
        let result = RedlockBackend::connect(url).await;
        assert!(
            matches!(result, Err(LockError::Config { .. })),
            "{url}: {result:?}"
        );
    }
    // Through the registry, the scheme picks the backend.
    let registry = Registry::from_url(&url()).await.expect("redlock:// opens");
    let guard = registry
        .lock(unique_key("from-url"))
        .acquire()
        .await
        .expect("acquire");
    assert_eq!(guard.fencing_token(), None);
    guard.release().await.expect("release");
}

/// Counts the messages published on `channel` on every node, from the moment
/// this returns (every node has confirmed the subscription).
async fn count_messages(urls: &[String], channel: &str) -> Arc<AtomicUsize> {
    let heard = Arc::new(AtomicUsize::new(0));
    for url in urls {
        let mut pubsub = redis::Client::open(url.as_str())
            .expect("node url")
            .get_async_pubsub()
            .await
            .unwrap_or_else(|e| servers_missing(url, e));
        pubsub.subscribe(channel).await.expect("SUBSCRIBE");
        let heard = heard.clone();
        tokio::spawn(async move {
            let mut messages = pubsub.into_on_message();
            while messages.next().await.is_some() {
                heard.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    heard
}

/// Waiters that fail against a foreign holder's majority undo their minority
/// grants without a release message: no waiter wakes another (the storm of
/// issue "roll-backs must not wake anyone"), and the holder's real release
/// still wakes them at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_back_a_failed_attempt_wakes_no_one() {
    const WAITERS: usize = 4;
    let h = harness().await;
    let key = unique_key("quiet-rollback");
    let stored = h.stored(&key);
    // The channel the backend's release script publishes on.
    let channel = format!("{stored}:released");
    let urls = node_urls();
    let heard = count_messages(&urls, &channel).await;
    // A foreign client holds the key on three of five nodes.
    for url in &urls[..3] {
        let set: Option<String> = redis::cmd("SET")
            .arg(&stored)
            .arg("someone-else")
            .arg("NX")
            .arg("PX")
            .arg(5000)
            .query_async(&mut node(url).await)
            .await
            .expect("SET");
        assert_eq!(set.as_deref(), Some("OK"), "the foreign grant on {url}");
    }
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let key = key.clone();
            tokio::spawn(async move {
                let guard = h
                    .registry()
                    .lock(&key)
                    .wait(Duration::from_secs(2))
                    .acquire()
                    .await?;
                let got = Instant::now();
                guard.release().await?;
                Ok::<_, LockError>(got)
            })
        })
        .collect();
    // Every waiter fails (two votes of five), rolls its two grants back and
    // waits: in silence.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        heard.load(Ordering::SeqCst),
        0,
        "roll-backs of failed attempts published release messages"
    );
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "a waiter gave up or got the key held by someone else"
    );
    for url in &urls[3..] {
        let exists: bool = node(url).await.exists(&stored).await.expect("EXISTS");
        assert!(!exists, "a vote of a failed attempt was left on {url}");
    }

    // The foreign holder releases as Redlock does: delete and publish on
    // each of its nodes. One waiter gets the key within a few round trips.
    for url in &urls[..3] {
        let mut conn = node(url).await;
        let _: i64 = conn.del(&stored).await.expect("DEL");
        let _: i64 = conn.publish(&channel, "").await.expect("PUBLISH");
    }
    let released = Instant::now();
    let mut first = None;
    for waiter in waiters {
        match waiter.await.expect("waiter task") {
            Ok(got) => first = Some(first.map_or(got, |f: Instant| f.min(got))),
            Err(LockError::Busy { .. }) => {}
            Err(e) => panic!("waiter failed: {e}"),
        }
    }
    let first = first.expect("a waiter got the key after the release");
    let after = first.saturating_duration_since(released);
    assert!(
        after < Duration::from_millis(300),
        "the first waiter got the key {after:?} after the release"
    );
    assert!(
        heard.load(Ordering::SeqCst) >= 3,
        "the counting subscribers missed the foreign release messages"
    );
}

/// A stand-in for a dead Redis node: a TCP listener that counts the
/// connections made to it, and closes them at once or keeps them open
/// without a word (a node that hangs).
struct DeadNode {
    address: String,
    accepts: Arc<AtomicUsize>,
}

impl DeadNode {
    async fn start(silent: bool) -> DeadNode {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind an ephemeral port");
        let address = listener.local_addr().expect("local address").to_string();
        let accepts = Arc::new(AtomicUsize::new(0));
        let counter = accepts.clone();
        tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                if silent {
                    kept.push(socket);
                }
            }
        });
        DeadNode { address, accepts }
    }

    fn accepts(&self) -> usize {
        self.accepts.load(Ordering::SeqCst)
    }
}

/// The most connection attempts to one node that never answers in `elapsed`:
/// the backend's connection task (a round at 0, then after 100 ms doubling up
/// to 2 s; the managed connection makes up to two attempts a round) and the
/// pub/sub listener (one attempt at most every 500 ms).
fn most_connection_attempts(elapsed: Duration) -> usize {
    let (mut rounds, mut at, mut pause) = (0, Duration::ZERO, Duration::from_millis(100));
    while at <= elapsed {
        rounds += 1;
        at += pause;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
    let listener = (elapsed.as_millis() / 500) as usize + 1;
    2 * rounds + listener
}

/// Two of five nodes have never answered (one refuses at once, one hangs):
/// every call fails their votes at once instead of waiting for a connection,
/// and each is reconnected by one loop with a back-off, not once per call.
/// Dropping the backend ends those loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_never_answered_cost_no_wait_and_one_reconnect_loop() {
    const PAIRS: u32 = 200;
    // Generous for the live nodes' first connections on a busy machine; the
    // old per-call connection waited this long for the hanging node on every
    // call (200 pairs: 100 s).
    let timeout = Duration::from_millis(250);
    let closing = DeadNode::start(false).await;
    let silent = DeadNode::start(true).await;
    let live = node_hosts();
    let url = format!(
        "redlock://{},{},{}?timeout={}ms",
        live[..3].join(","),
        closing.address,
        silent.address,
        timeout.as_millis()
    );
    let born = Instant::now();
    let backend: Arc<dyn LockBackend> = Arc::new(
        RedlockBackend::connect(&url)
            .await
            .unwrap_or_else(|e| servers_missing(&url, e)),
    );
    let dropped = Arc::downgrade(&backend);
    let registry = Registry::builder().default_backend(backend).build();
    let key = unique_key("never-answered");

    let started = Instant::now();
    for _ in 0..PAIRS {
        let guard = registry
            .lock(&key)
            .acquire()
            .await
            .expect("three live nodes of five are a majority");
        guard.release().await.expect("release");
    }
    let took = started.elapsed();
    // Counted before the span they are bounded by ends.
    let (closed, hung) = (closing.accepts(), silent.accepts());
    let alive = born.elapsed();
    let bound = most_connection_attempts(alive);
    eprintln!(
        "{PAIRS} acquire/release pairs with 2 of 5 nodes dead: {took:?}; connections to the \
         dead nodes in {alive:?}: {closed} (closing), {hung} (hanging), at most {bound} expected"
    );
    assert!(
        took < timeout * PAIRS / 4,
        "{PAIRS} pairs took {took:?}: the calls waited for the dead nodes"
    );
    assert!(
        closed <= bound && hung <= bound,
        "{closed} and {hung} connections to the dead nodes in {alive:?}: one per call, not one \
         loop per node (at most {bound} expected)"
    );

    // The connection tasks end with the backend.
    drop(registry);
    let deadline = Instant::now() + Duration::from_secs(5);
    while dropped.strong_count() > 0 {
        assert!(Instant::now() < deadline, "the backend was never dropped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // An attempt under way when the backend went ends within the timeout.
    tokio::time::sleep(timeout * 3).await;
    let (closed, hung) = (closing.accepts(), silent.accepts());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        (closing.accepts(), silent.accepts()),
        (closed, hung),
        "a dropped backend still reconnects to its dead nodes"
    );
}
