//! Redlock's two connections per node, in order: each node has a
//! home connection (dlock's I/O runtime) and a local one (the caller's
//! runtime), and a command on one connection can overtake a command still
//! outstanding on the other.
//!
//! The servers are the test's own (`OwnRedis`, ports 29460–29469), reached
//! through a small TCP proxy that can hold back, on one connection, the first
//! command carrying a given key: the connection's later bytes queue behind it
//! (TCP order), every other connection flows. That is a slow node as Redlock
//! sees it — a node that answers after the per-node timeout — but on one of
//! its two connections only.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::{RedlockBackend, Registry};
use dlock_testkit::FaultProxy as Proxy;
use dlock_tests::redis_support::OwnRedis;
use redis::AsyncCommands;

/// Three nodes of the test's own (ports `first`, `first+1`, `first+2`); the
/// third behind a [`Proxy`].
struct Nodes {
    servers: Vec<OwnRedis>,
    proxy: Proxy,
}

impl Nodes {
    async fn start(first: u16) -> Nodes {
        let mut servers = Vec::new();
        for port in first..first + 3 {
            servers.push(OwnRedis::start(port, &[]).await);
        }
        let proxy = Proxy::to_port(servers[2].port()).await.expect("proxy");
        Nodes { servers, proxy }
    }

    /// Holds back, for `hold`, the next chunk sent to node 3 that carries
    /// `stored` and an `EVALSHA`/`EVAL` (a script call on the key, not a
    /// SUBSCRIBE).
    fn hold_script_call(&self, stored: &str, hold: Duration) {
        self.proxy.hold_next(&[stored.as_bytes(), b"EVAL"], hold);
    }

    fn url(&self) -> String {
        format!(
            "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
            self.servers[0].port(),
            self.servers[1].port(),
            self.proxy.port()
        )
    }

    async fn registry(&self) -> Registry {
        let backend = RedlockBackend::connect(&self.url())
            .await
            .expect("redlock over the test's own nodes");
        Registry::builder().default_backend(backend).build()
    }

    /// `(node number, value, PTTL)` of every node that holds `stored` (read
    /// directly from the servers, not through the proxy).
    async fn holders(&self, stored: &str) -> Vec<(usize, String, i64)> {
        let mut held = Vec::new();
        for (i, server) in self.servers.iter().enumerate() {
            let mut conn = server.admin().await;
            let value: Option<String> = conn.get(stored).await.expect("GET");
            let ttl: i64 = conn.pttl(stored).await.expect("PTTL");
            if let Some(value) = value {
                held.push((i + 1, value, ttl));
            }
        }
        held
    }
}

/// Locks and releases a throw-away key: loads the scripts on every node, and
/// (from this runtime) starts opening the local connections.
async fn warm_up(registry: &Registry, name: &str) {
    for i in 0..2 {
        let guard = registry
            .lock(format!("redlock-order:warm-up:{name}:{i}"))
            .acquire()
            .await
            .expect("warm-up lock");
        guard.release().await.expect("warm-up release");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn unique(case: &str) -> String {
    format!("redlock-order:{case}:{:016x}", rand::random::<u64>())
}

/// Steady state: the caller's runtime has its local connections open, so the
/// acquire goes local. Node 3 answers it late (after the per-node timeout);
/// nodes 1 and 2 are a majority, so the lock is granted. The guard is then
/// dropped (the usual `let _guard = …;` end of scope), so the release goes from
/// dlock's I/O runtime over the home connections while node 3's acquire is
/// still outstanding on the local one. Node 3 must not be left holding the key
/// after the release: the release follows the acquire on node 3 (with one more
/// slow or down node, nobody could lock the key for a full lease otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_guard_releases_home_ahead_of_a_slow_nodes_local_acquire() {
    let nodes = Nodes::start(29460).await;
    let registry = nodes.registry().await;
    warm_up(&registry, "drop").await;
    // home + pub/sub listener + local, at least.
    assert!(
        nodes.proxy.accepted() >= 3,
        "{} connections",
        nodes.proxy.accepted()
    );

    let key = unique("dropped-guard");
    let stored = format!("{}{key}", registry.key_prefix());
    nodes.hold_script_call(&stored, Duration::from_millis(1500));
    let lease = Duration::from_secs(20);
    let guard = registry
        .lock(&key)
        .lease(lease)
        .wait(Duration::ZERO)
        .acquire()
        .await
        .expect("nodes 1 and 2 are a majority of three");
    let sprung_on = nodes.proxy.held_on();
    assert!(sprung_on.is_some(), "node 3's acquire was not held back");
    drop(guard);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let holders = nodes.holders(&stored).await;
    assert!(
        holders.is_empty(),
        "2.5 s after the guard was dropped (the acquire on node 3 was held on proxy connection \
         #{} of {}), the key is still held (node, owner, PTTL ms): {holders:?}",
        sprung_on.unwrap(),
        nodes.proxy.accepted(),
    );
}

/// The other direction: the first lock from a runtime goes home (its local
/// connections are only opening). Node 3 answers late; the lock is granted by
/// nodes 1 and 2. By the time the caller releases (awaiting, on the same
/// runtime) the local connections are open, while node 3's acquire is still
/// outstanding on home: the late acquire must not leave node 3 holding the key
/// after a release that reported success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_awaited_release_goes_local_ahead_of_a_first_acquire_sent_home() {
    let nodes = Nodes::start(29463).await;
    // Another backend over the same nodes loads the scripts on every node (a
    // held-back EVALSHA must not come back NOSCRIPT); ours stays untouched:
    // its local connections are not open yet.
    warm_up(&nodes.registry().await, "first-call").await;
    let registry = nodes.registry().await;
    let before = nodes.proxy.accepted();

    let key = unique("first-call");
    let stored = format!("{}{key}", registry.key_prefix());
    nodes.hold_script_call(&stored, Duration::from_millis(1500));
    let guard = registry
        .lock(&key)
        .lease(Duration::from_secs(20))
        .wait(Duration::ZERO)
        .acquire()
        .await
        .expect("nodes 1 and 2 are a majority of three");
    let sprung_on = nodes.proxy.held_on();
    assert!(sprung_on.is_some(), "node 3's acquire was not held back");
    guard.release().await.expect("the release reports success");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let holders = nodes.holders(&stored).await;
    assert!(
        holders.is_empty(),
        "2.5 s after an awaited release returned Ok (node 3's acquire was held on proxy \
         connection #{}; connections {before} before the lock, {} after), the key is still \
         held (node, owner, PTTL ms): {holders:?}",
        sprung_on.unwrap(),
        nodes.proxy.accepted(),
    );
}

/// An acquisition abandoned while its acquire is outstanding (on home: the
/// first call from this runtime) is cleaned up over local and home, and on home
/// the clean-up follows the acquire, so no key is left, well before the 3 s
/// backstop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_first_acquisition_is_cleaned_up_behind_its_acquire() {
    let nodes = Nodes::start(29466).await;
    warm_up(&nodes.registry().await, "abandoned").await;
    let registry = nodes.registry().await;

    let key = unique("abandoned");
    let stored = format!("{}{key}", registry.key_prefix());
    nodes.hold_script_call(&stored, Duration::from_millis(600));
    let started = Instant::now();
    // Dropped after node 1 and 2 have answered, while node 3's acquire is held.
    let outcome = tokio::time::timeout(
        Duration::from_millis(100),
        registry
            .lock(&key)
            .lease(Duration::from_secs(20))
            .wait(Duration::ZERO)
            .acquire(),
    )
    .await;
    assert!(outcome.is_err(), "the caller gave up: {outcome:?}");
    assert!(nodes.proxy.held_on().is_some());
    tokio::time::sleep(Duration::from_millis(1500).saturating_sub(started.elapsed())).await;
    let holders = nodes.holders(&stored).await;
    assert!(
        holders.is_empty(),
        "1.5 s after an abandoned acquisition (backstop at 3 s), still held: {holders:?}"
    );
}
