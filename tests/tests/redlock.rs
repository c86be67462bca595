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

/// `url` with a per-node timeout of 1 s (the default is 200 ms). The cases
/// that use it check what Redlock keeps (exclusion, release, bounded state),
/// not its timeout rule, which the cases named for it test with timeouts of
/// their own: five nodes and the tests share this machine's two CPUs, so a
/// node can miss 200 ms by scheduling alone. The bound stays far below the
/// leases (the backend takes at most a tenth of a lease).
fn generous(url: &str) -> String {
    format!("{url}?timeout=1s")
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
            let url = generous(&url());
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

/// The Redlock URL on database `db` of each node: the tests below that count
/// keys or connections use a database of their own (no other test of the
/// repository uses 12–14), which `CLIENT LIST` shows as `db=N`.
fn url_on_db(db: u32) -> String {
    format!("redlock://{}/{db}", node_hosts().join(","))
}

/// The `redis://` URL of each node on database `db`.
fn node_urls_on_db(db: u32) -> Vec<String> {
    node_hosts()
        .iter()
        .map(|h| format!("redis://{h}/{db}"))
        .collect()
}

async fn registry_on_db(db: u32, prefix: &str) -> Registry {
    let url = generous(&url_on_db(db));
    Registry::builder()
        .default_backend(
            RedlockBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e)),
        )
        .key_prefix(prefix)
        .build()
}

/// The keys matching `pattern` in the database `url` names (`SCAN`).
async fn count_keys(url: &str, pattern: &str) -> usize {
    let mut conn = node(url).await;
    let mut keys = conn
        .scan_match::<_, String>(pattern)
        .await
        .expect("SCAN MATCH");
    let mut count = 0;
    while keys.next_item().await.is_some() {
        count += 1;
    }
    count
}

async fn dbsize(url: &str) -> u64 {
    redis::cmd("DBSIZE")
        .query_async(&mut node(url).await)
        .await
        .expect("DBSIZE")
}

/// Redlock keeps no key per lock name: 20,000 distinct names locked and
/// released (32 at a time) leave every node's database as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_names_leave_no_key_on_any_node() {
    const DB: u32 = 12;
    const NAMES: usize = 20_000;
    const TASKS: usize = 32;
    let prefix = format!("{}:", unique_key("bounded"));
    let registry = Arc::new(registry_on_db(DB, &prefix).await);
    let urls = node_urls_on_db(DB);
    let mut baseline = Vec::new();
    for url in &urls {
        baseline.push(dbsize(url).await);
    }
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let registry = registry.clone();
            tokio::spawn(async move {
                for i in (t..NAMES).step_by(TASKS) {
                    let guard = registry
                        .lock(format!("order:{i}"))
                        .acquire()
                        .await
                        .expect("acquire");
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    let took = started.elapsed();
    println!(
        "{NAMES} names locked and released in {took:?} ({:.0}/s)",
        NAMES as f64 / took.as_secs_f64()
    );
    for (url, before) in urls.iter().zip(baseline) {
        let left = count_keys(url, &format!("{prefix}*")).await;
        let after = dbsize(url).await;
        println!("{url}: DBSIZE {before} before, {after} after; {left} keys under the prefix");
        assert_eq!(left, 0, "{url}: {left} keys left under {prefix}");
        assert!(
            after <= before,
            "{url}: DBSIZE {before} before, {after} after"
        );
    }
}

/// One connection as `CLIENT LIST` shows it.
#[derive(Debug, Clone)]
struct ClientInfo {
    id: u64,
    db: u32,
    idle: u64,
    cmd: String,
    pubsub: bool,
}

/// The connections on the node `url` names, on database `db`, other than
/// pub/sub ones (`url` itself is on database 0: this one is not counted).
async fn command_connections(url: &str, db: u32) -> Vec<ClientInfo> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut node(url).await)
        .await
        .expect("CLIENT LIST");
    list.lines()
        .map(|line| {
            let field = |name: &str| {
                line.split(' ')
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                    .unwrap_or_default()
                    .to_owned()
            };
            let subscribed = ["sub", "psub", "ssub"]
                .iter()
                .any(|f| field(f).parse::<u64>().unwrap_or(0) > 0);
            ClientInfo {
                id: field("id").parse().expect("id"),
                db: field("db").parse().expect("db"),
                idle: field("idle").parse().expect("idle"),
                cmd: field("cmd"),
                pubsub: subscribed || field("flags").contains('P'),
            }
        })
        .filter(|c| c.db == db && !c.pubsub)
        .collect()
}

/// Waits until every node shows a command connection on `db` that is not in
/// `seen` (one set of ids per node), locking and releasing `key` meanwhile so
/// that a local connection gets opened; answers the new ones.
async fn wait_for_new_connections(
    registry: &Registry,
    key: &str,
    db: u32,
    seen: &[Vec<u64>],
) -> Vec<Vec<ClientInfo>> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let guard = registry.lock(key).acquire().await.expect("acquire");
        guard.release().await.expect("release");
        let mut fresh = Vec::new();
        for (url, seen) in node_urls().iter().zip(seen) {
            let new: Vec<ClientInfo> = command_connections(url, db)
                .await
                .into_iter()
                .filter(|c| !seen.contains(&c.id))
                .collect();
            fresh.push(new);
        }
        if fresh.iter().all(|new| !new.is_empty()) {
            return fresh;
        }
        assert!(
            Instant::now() < deadline,
            "no local connection opened on every node: {fresh:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Calls from the application's runtime reach each node over a connection
/// of that runtime's own (no hop to dlock's I/O runtime): the first call
/// opens it in the background on every node, and from then on the home
/// connection opened by `connect` carries none of that runtime's commands.
#[tokio::test]
async fn calls_from_the_application_runtime_take_a_local_connection() {
    const DB: u32 = 13;
    let registry = registry_on_db(DB, &format!("{}:", unique_key("fast-path"))).await;
    let urls = node_urls();
    // Only the home connections so far (and whatever a previous run of this
    // test left closing).
    let mut home = Vec::new();
    for url in &urls {
        let ids: Vec<u64> = command_connections(url, DB)
            .await
            .iter()
            .map(|c| c.id)
            .collect();
        assert!(!ids.is_empty(), "{url}: no connection on db {DB}");
        home.push(ids);
    }
    let local = wait_for_new_connections(&registry, "warm-up", DB, &home).await;
    for (url, new) in urls.iter().zip(&local) {
        assert_eq!(
            new.len(),
            1,
            "{url}: one local connection per node: {new:?}"
        );
    }
    // A second later, a hundred locks: every command over the local ones.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for i in 0..100 {
        let guard = registry
            .lock(format!("pair:{i}"))
            .acquire()
            .await
            .expect("acquire");
        guard.release().await.expect("release");
    }
    for ((url, home), local) in urls.iter().zip(&home).zip(&local) {
        let now = command_connections(url, DB).await;
        let local = now
            .iter()
            .find(|c| c.id == local[0].id)
            .unwrap_or_else(|| panic!("{url}: the local connection closed: {now:?}"));
        assert!(
            local.idle == 0 && local.cmd == "evalsha",
            "{url}: the local connection did not carry the locks: {local:?}"
        );
        for c in now.iter().filter(|c| home.contains(&c.id)) {
            assert!(
                c.idle >= 1,
                "{url}: the home connection carried commands of the application's runtime: {c:?}"
            );
        }
    }
}

/// A runtime shut down under its local connections (each `#[tokio::test]`
/// has its own): the next runtime's calls go home at once, then over local
/// connections of their own, and none fails.
#[test]
fn a_runtime_shut_down_under_its_local_connections_does_not_break_the_next() {
    const DB: u32 = 14;
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    };
    let first = runtime();
    let (registry, seen) = first.block_on(async {
        let registry = registry_on_db(DB, &format!("{}:", unique_key("shut-down"))).await;
        let mut home = Vec::new();
        for url in node_urls() {
            home.push(
                command_connections(&url, DB)
                    .await
                    .iter()
                    .map(|c| c.id)
                    .collect::<Vec<_>>(),
            );
        }
        let local = wait_for_new_connections(&registry, "first", DB, &home).await;
        let seen: Vec<Vec<u64>> = home
            .into_iter()
            .zip(local)
            .map(|(mut ids, new)| {
                ids.extend(new.iter().map(|c| c.id));
                ids
            })
            .collect();
        for i in 0..10 {
            let guard = registry
                .lock(format!("on-a:{i}"))
                .acquire()
                .await
                .expect("acquire on the first runtime");
            guard.release().await.expect("release");
        }
        (registry, seen)
    });
    drop(first);

    let second = runtime();
    second.block_on(async {
        let started = Instant::now();
        for i in 0..50 {
            let guard = tokio::time::timeout(
                Duration::from_secs(2),
                registry.lock(format!("on-b:{i}")).acquire(),
            )
            .await
            .expect("an acquisition on the second runtime hung")
            .expect("acquire on the second runtime");
            guard
                .release()
                .await
                .expect("release on the second runtime");
        }
        println!("50 pairs on the second runtime in {:?}", started.elapsed());
        // The second runtime gets local connections of its own.
        wait_for_new_connections(&registry, "second", DB, &seen).await;
    });
}

/// The CPU time this process has used so far, all threads (ns resolution).
fn process_cpu() -> Duration {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    Duration::from_nanos(
        tasks
            .filter_map(|task| {
                let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
                stat.split(' ').next()?.parse::<u64>().ok()
            })
            .sum(),
    )
}

/// Not a check: Redlock acquire+release pairs/s, and this process's CPU µs
/// per pair, at concurrency 1 and 32 over the local connections (from the
/// runtime that opened them) and over the home ones (from another runtime,
/// whose calls go home: the way every call went before the local
/// connections), in interleaved rounds, on a current-thread and on a
/// two-worker runtime. Run it with `cargo test --release -p dlock-tests
/// --features redis --test redlock -- --ignored --nocapture
/// redlock_throughput_local_vs_home`.
#[test]
#[ignore = "a measurement, not a check"]
fn redlock_throughput_local_vs_home() {
    const ROUND: Duration = Duration::from_secs(1);
    const ROUNDS: usize = 9;
    /// Pairs/s and CPU µs per pair.
    async fn round(registry: &Registry, tasks: usize) -> (f64, f64) {
        let cpu = process_cpu();
        let started = Instant::now();
        let stop = started + ROUND;
        let pairs: usize = futures_util::future::join_all((0..tasks).map(|t| async move {
            let mut pairs = 0;
            while Instant::now() < stop {
                let guard = registry
                    .lock(format!("pairs:{t}"))
                    .acquire()
                    .await
                    .expect("acquire");
                guard.release().await.expect("release");
                pairs += 1;
            }
            pairs
        }))
        .await
        .into_iter()
        .sum();
        let cpu = (process_cpu() - cpu).as_secs_f64() * 1e6;
        (
            pairs as f64 / started.elapsed().as_secs_f64(),
            cpu / pairs as f64,
        )
    }
    use dlock_tests::handoff::median_f64 as median;
    for flavor in ["current_thread", "multi_thread(2)"] {
        let runtime = || {
            let mut builder = if flavor == "current_thread" {
                tokio::runtime::Builder::new_current_thread()
            } else {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(2);
                b
            };
            builder.enable_all().build().expect("runtime")
        };
        let (local, home) = (runtime(), runtime());
        let registry = Arc::new(local.block_on(async {
            let registry = registry_on_db(0, &format!("{}:", unique_key("throughput"))).await;
            // The local connections open on this runtime, in the background.
            for _ in 0..10 {
                let guard = registry.lock("warm-up").acquire().await.expect("acquire");
                guard.release().await.expect("release");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            registry
        }));
        let mut figures: std::collections::BTreeMap<(usize, &str), Vec<(f64, f64)>> =
            Default::default();
        for _ in 0..ROUNDS {
            for tasks in [1, 32] {
                for (path, rt) in [("local", &local), ("home", &home)] {
                    let figure = rt.block_on(round(&registry, tasks));
                    figures.entry((tasks, path)).or_default().push(figure);
                }
            }
        }
        for ((tasks, path), rounds) in &figures {
            println!(
                "{flavor}, concurrency {tasks:>2}, {path:>5}: median {:>6.0} pairs/s, \
                 {:>5.0} client CPU µs/pair (pairs/s by round: {})",
                median(rounds.iter().map(|r| r.0).collect()),
                median(rounds.iter().map(|r| r.1).collect()),
                rounds
                    .iter()
                    .map(|r| format!("{:.0}", r.0))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        drop(registry);
        drop((local, home));
    }
}
