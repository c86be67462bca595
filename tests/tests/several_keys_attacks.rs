//! Holds of several keys under stress, on real servers: an acquisition the
//! caller gives up on while its one step (script, statement, transaction)
//! is on the wire, or at any other moment, leaves no key held; a step whose
//! answer is lost is held once, by the hold's one owner; a hold of many keys
//! (64, 100) stays held under the watchdog; a server that goes silent ends
//! a waiting hold within its `wait`; one key of a hold revoked
//! cancels the hold and frees the others; fenced and unfenced holds of the
//! same keys exclude each other; several-key and single-key holds of
//! overlapping fresh keys on the SQL lease tables never fail nor overlap; a
//! waiter follows the busy key, takes over an expired holder and keeps its
//! budget; siblings inside a hold take turns; shutdown answers `ShutDown` to
//! a waiting hold and frees every key; and a busy or abandoned hold with
//! `hold_at_least` keeps none of the keys it took (where the keys go one by
//! one: Redis Cluster across slots, Redlock, session modes).
#![cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite"
))]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, Registry};
use dlock_tests::unique_key;

/// How long the proxy holds the acquisition's step back.
const HELD_BACK: Duration = Duration::from_millis(800);

/// A backend the cases run on, reached as separate processes would reach it
/// (each [`Backend::registry`] its own connections), and where its cases'
/// keys lie. Named as the module of its tests is.
struct Backend {
    name: &'static str,
    reach: Reach,
    /// The keys of a case in different Redis Cluster hash slots.
    across_slots: bool,
}

/// How a [`Backend`]'s registries are made.
enum Reach {
    #[cfg(feature = "redis")]
    Redis(String),
    #[cfg(feature = "redis")]
    Redlock(String),
    /// A database server, with `?options` on its URL.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    Sql(dlock_tests::sql_db::SqlDb, &'static str),
    /// A SQLite file in this directory (kept while the test runs).
    #[cfg(feature = "sqlite")]
    Sqlite(tempfile::TempDir),
}

#[cfg(feature = "redis")]
fn redis_url() -> String {
    dlock_tests::server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

/// A registry on the Redis (or Redis Cluster) server at `url`.
#[cfg(feature = "redis")]
async fn redis_at(url: &str) -> Registry {
    let backend = dlock_runtime::RedisBackend::connect(url).await;
    Registry::builder()
        .default_backend(backend.unwrap_or_else(|e| dlock_tests::servers_missing(url, e)))
        .build()
}

impl Backend {
    fn new(name: &'static str, reach: Reach) -> Backend {
        Backend {
            name,
            reach,
            across_slots: false,
        }
    }

    #[cfg(feature = "redis")]
    fn redis() -> Backend {
        Backend::new("redis", Reach::Redis(redis_url()))
    }

    #[cfg(feature = "redis")]
    fn redis_cluster() -> Backend {
        let url = dlock_tests::server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        Backend::new("redis-cluster", Reach::Redis(url))
    }

    /// Redis Cluster, each case's keys in different hash slots (so taken one
    /// by one).
    #[cfg(feature = "redis")]
    fn redis_cluster_across_slots() -> Backend {
        Backend {
            name: "redis-cluster-across-slots",
            across_slots: true,
            ..Backend::redis_cluster()
        }
    }

    #[cfg(feature = "redis")]
    fn redlock() -> Backend {
        let url = dlock_tests::server_url(
            "DLOCK_TEST_REDLOCK_URL",
            "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
        );
        Backend::new("redlock", Reach::Redlock(url))
    }

    #[cfg(feature = "postgres")]
    fn postgres() -> Backend {
        let db = dlock_tests::sql_db::SqlDb::Postgres;
        Backend::new("postgres", Reach::Sql(db, ""))
    }

    #[cfg(feature = "postgres")]
    fn postgres_session() -> Backend {
        let db = dlock_tests::sql_db::SqlDb::Postgres;
        Backend::new("postgres-session", Reach::Sql(db, "mode=session"))
    }

    #[cfg(feature = "mysql")]
    fn mysql() -> Backend {
        let db = dlock_tests::sql_db::SqlDb::Mysql;
        Backend::new("mysql", Reach::Sql(db, ""))
    }

    #[cfg(feature = "mysql")]
    fn mysql_session() -> Backend {
        let db = dlock_tests::sql_db::SqlDb::Mysql;
        Backend::new("mysql-session", Reach::Sql(db, "mode=session"))
    }

    #[cfg(feature = "sqlite")]
    fn sqlite() -> Backend {
        let dir = tempfile::tempdir().expect("tempdir");
        Backend::new("sqlite", Reach::Sqlite(dir))
    }

    /// A new registry on this backend, as another process would have.
    async fn registry(&self) -> Registry {
        match &self.reach {
            #[cfg(feature = "redis")]
            Reach::Redis(url) => redis_at(url).await,
            #[cfg(feature = "redis")]
            Reach::Redlock(url) => {
                let backend = dlock_runtime::RedlockBackend::connect(url).await;
                Registry::builder()
                    .default_backend(
                        backend.unwrap_or_else(|e| dlock_tests::servers_missing(url, e)),
                    )
                    .build()
            }
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Reach::Sql(db, options) => db.registry(options).await,
            #[cfg(feature = "sqlite")]
            Reach::Sqlite(dir) => {
                let url = format!("sqlite://{}", dir.path().join("locks.db").display());
                let backend = dlock_runtime::SqliteBackend::connect(&url).await;
                Registry::builder()
                    .default_backend(backend.expect("open"))
                    .build()
            }
        }
    }

    /// Where this backend's cases put their keys.
    fn keys(&self) -> Keys {
        Keys {
            backend: self.name,
            across_slots: self.across_slots,
        }
    }
}

/// The keys of a case on one backend: named after the backend and the case
/// (backends sharing a server never meet), sharing a hash tag (one Redis
/// Cluster slot) or, across slots, each in a slot of its own.
#[derive(Clone, Copy)]
struct Keys {
    backend: &'static str,
    across_slots: bool,
}

impl Keys {
    fn named<const N: usize>(self, case: &str) -> [String; N] {
        let base = unique_key(&format!("{}-{case}", self.backend));
        std::array::from_fn(|i| {
            let name = char::from(b'a' + u8::try_from(i).expect("a few keys"));
            if self.across_slots {
                format!("{base}:{name}")
            } else {
                format!("{{{base}}}:{name}")
            }
        })
    }

    /// Two keys of `case`.
    fn two(self, case: &str) -> [String; 2] {
        self.named(case)
    }

    /// Four keys of `case`.
    fn four(self, case: &str) -> [String; 4] {
        self.named(case)
    }
}

/// The tests of one backend: a module named after `$backend` (a constructor
/// of [`Backend`]), a test in it per case, named after the case. Each test
/// runs `$case` with a new registry of the backend for each name in its
/// parentheses (as separate processes would have them) and, after a `;`,
/// the backend's [`Keys`]; a case followed by `on_one_thread` runs on a
/// current-thread runtime.
macro_rules! on_backend {
    ($backend:ident: $($case:ident($($registry:ident),+ $(; $keys:ident)?) $($one_thread:ident)?),+ $(,)?) => {
        mod $backend {
            $(on_backend!(@test $backend [$($one_thread)?] $case ($($registry),+) $(; $keys)?);)+
        }
    };
    (@test $backend:ident [] $($case:tt)*) => {
        on_backend!(@fn $backend
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)] $($case)*);
    };
    (@test $backend:ident [on_one_thread] $($case:tt)*) => {
        on_backend!(@fn $backend #[tokio::test(flavor = "current_thread")] $($case)*);
    };
    (@fn $backend:ident #[$runtime:meta] $case:ident ($($registry:ident),+) $(; $keys:ident)?) => {
        #[$runtime]
        async fn $case() {
            let backend = super::Backend::$backend();
            $(let $registry = backend.registry().await;)+
            $(let $keys = backend.keys();)?
            super::$case($(&$registry),+ $(, $keys)?).await;
        }
    };
}

/// Two keys of one test sharing a hash tag (one Redis Cluster slot).
fn two_keys(case: &str) -> [String; 2] {
    let tag = unique_key(case);
    [format!("{{{tag}}}:a"), format!("{{{tag}}}:b")]
}

/// `n` keys of one test sharing a hash tag.
fn many_keys(case: &str, n: usize) -> Vec<String> {
    let tag = unique_key(case);
    (0..n).map(|i| format!("{{{tag}}}:{i:03}")).collect()
}

/// Watches `keys` through `observer` for `watch`: the longest stretch any of
/// them was seen held (first to last sighting).
async fn longest_held(observer: &Registry, keys: &[String], watch: Duration) -> Duration {
    let started = Instant::now();
    let mut seen: Vec<Option<(Duration, Duration)>> = vec![None; keys.len()];
    while started.elapsed() < watch {
        for (i, key) in keys.iter().enumerate() {
            if observer.inspect(key).await.expect("inspect").is_some() {
                let at = started.elapsed();
                seen[i] = Some(seen[i].map_or((at, at), |(first, _)| (first, at)));
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    seen.iter()
        .flatten()
        .map(|(first, last)| *last - *first)
        .max()
        .unwrap_or_default()
}

/// The caller gives up on a hold of `keys` while the proxy holds back the
/// request carrying every one of `needle`: no key is left held for longer
/// than a round trip after the server answers it, and the keys are free for
/// another process afterwards.
async fn abandoned_step_leaves_no_key_held(
    proxied: &Registry,
    proxy: &dlock_testkit::FaultProxy,
    observer: &Registry,
    keys: &[String],
    needle: &[u8],
) {
    // Connections open and statements prepared.
    for _ in 0..3 {
        let warm = two_keys(&format!("abandoned-step-warm-{}", keys[0]));
        let g = proxied.lock_all(&warm).acquire().await.expect("warm up");
        g.release().await.expect("release");
    }
    proxy.hold_next(&[needle], HELD_BACK);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        proxied
            .lock_all(keys)
            .lease(Duration::from_secs(60))
            .acquire(),
    )
    .await;
    assert!(gave_up.is_err(), "the caller gave up before the answer");
    assert!(proxy.held_on().is_some(), "the step was held back");
    let held = longest_held(observer, keys, Duration::from_secs(5)).await;
    assert!(
        held < Duration::from_secs(1),
        "a key of the abandoned hold stayed held for {held:?} after the caller left"
    );
    let again = observer
        .lock_all(keys)
        .wait(Duration::ZERO)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the keys of the abandoned hold are not free: {e}"));
    again.release().await.expect("release");
}

/// Holds of 64 and 100 keys with a 2 s lease stay held under the watchdog
/// for three leases, and are free once released.
async fn many_keys_stay_held(registry: &Registry, observer: &Registry) {
    for n in [64, 100] {
        let keys = many_keys(&format!("many-keys-{n}"), n);
        let guard = registry
            .lock_all(&keys)
            .lease(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{n} free keys: {e}"));
        assert_eq!(guard.keys().len(), n);
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert!(
            !guard.is_lost(),
            "a hold of {n} keys was lost under the watchdog"
        );
        for key in [&keys[0], &keys[n / 2], &keys[n - 1]] {
            assert!(
                observer.inspect(key).await.expect("inspect").is_some(),
                "`{key}` of a hold of {n} keys is not held on the server"
            );
        }
        guard.release().await.expect("release");
        let again = observer
            .lock_all(&keys)
            .wait(Duration::ZERO)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("the {n} keys are not free after release: {e}"));
        again.release().await.expect("release");
    }
}

/// One key of a held pair revoked: the hold's loss signal fires within a
/// few renewals, and once the guard is given up the other key is free.
async fn revoked_key_cancels_the_hold(registry: &Registry, observer: &Registry) {
    let keys = two_keys("revoked-one-key");
    let guard = registry
        .lock_all(&keys)
        .lease(Duration::from_secs(2))
        .acquire()
        .await
        .expect("free keys");
    let revoked = observer.revoke(&keys[1]).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "one holder revoked");
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the loss of one key is the loss of the hold");
    let _ = guard.release().await;
    assert_free(
        observer,
        &keys[0],
        Duration::from_secs(1),
        "the key not revoked stayed held after a lost hold",
    )
    .await;
}

/// Takes `key` on `registry` within `wait` and releases it: a panic saying
/// `kept` (what left it held) if it is not free.
async fn assert_free(registry: &Registry, key: &str, wait: Duration, kept: &str) {
    let guard = registry
        .lock(key)
        .wait(wait)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{kept}: {e}"));
    guard.release().await.expect("release");
}

/// Asserts `answer` is a busy answer.
fn assert_busy(answer: Result<dlock_runtime::LockGuard, LockError>, what: &str) {
    match answer {
        Err(LockError::Busy { .. }) => {}
        Ok(_) => panic!("{what}: granted while another holder held a key"),
        Err(e) => panic!("{what}: expected busy, got {e}"),
    }
}

/// A fenced and an unfenced hold of overlapping keys exclude each other,
/// both ways, and a refused hold takes nothing.
async fn fenced_and_unfenced_exclude(first: &Registry, second: &Registry) {
    for holder_fenced in [false, true] {
        let tag = unique_key(&format!("fenced-{holder_fenced}"));
        let [a, b, c] = [
            format!("{{{tag}}}:a"),
            format!("{{{tag}}}:b"),
            format!("{{{tag}}}:c"),
        ];
        let held = first
            .lock_all([&a, &b])
            .fencing(holder_fenced)
            .acquire()
            .await
            .expect("free keys");
        assert_busy(
            second
                .lock_all([&b, &c])
                .fencing(!holder_fenced)
                .wait(Duration::ZERO)
                .acquire()
                .await,
            "a several-key hold of a held key",
        );
        assert_busy(
            second
                .lock(&a)
                .fencing(!holder_fenced)
                .wait(Duration::ZERO)
                .acquire()
                .await,
            "a single-key hold of a held key",
        );
        assert_free(
            second,
            &c,
            Duration::ZERO,
            &format!("`{c}` was left taken by a refused hold"),
        )
        .await;
        held.release().await.expect("release");
    }
}

/// Four tasks on registries of their own take random pairs (in random
/// order) and single keys of fresh keys (new rows each round), 40 rounds:
/// every acquisition succeeds within its wait (a deadlock the server detects
/// is retried, never surfaced), and no two holds of a key overlap.
async fn overlapping_fresh_keys_never_fail(a: &Registry, b: &Registry, c: &Registry, d: &Registry) {
    let rounds = 40;
    let base = unique_key("overlapping-fresh");
    let held: Arc<Mutex<HashSet<String>>> = Arc::default();
    let tasks: Vec<_> = [a, b, c, d]
        .map(Registry::clone)
        .into_iter()
        .enumerate()
        .map(|(t, registry)| {
            let (base, held) = (base.clone(), held.clone());
            tokio::spawn(async move {
                for round in 0..rounds {
                    let pool: Vec<String> = (0..3).map(|i| format!("{base}:{round}:{i}")).collect();
                    let pick = |n: usize| pool[n % pool.len()].clone();
                    let r = rand::random::<u32>() as usize;
                    let keys: Vec<String> = if (t + round) % 3 == 0 {
                        vec![pick(r)]
                    } else {
                        let first = r % pool.len();
                        let second = (first + 1 + (r / 7) % (pool.len() - 1)) % pool.len();
                        vec![pick(first), pick(second)]
                    };
                    let guard = registry
                        .lock_all(&keys)
                        .wait(Duration::from_secs(20))
                        .lease(Duration::from_secs(10))
                        .acquire()
                        .await
                        .unwrap_or_else(|e| panic!("task {t} round {round} {keys:?}: {e}"));
                    {
                        let mut set = held.lock().unwrap();
                        for k in &keys {
                            assert!(set.insert(k.clone()), "`{k}` held twice at once");
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    {
                        let mut set = held.lock().unwrap();
                        for k in &keys {
                            set.remove(k);
                        }
                    }
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
}

/// With `wait = 0` a hold of two keys whose second is held elsewhere is
/// busy, and leaves the first free for another process at once.
async fn busy_second_key_leaves_first_free(registry: &Registry, other: &Registry) {
    let keys = two_keys("busy-second-key");
    let elsewhere = other.lock(&keys[1]).acquire().await.expect("free key");
    assert_busy(
        registry
            .lock_all(&keys)
            .wait(Duration::ZERO)
            .acquire()
            .await,
        "a hold whose second key is held elsewhere",
    );
    assert_free(
        other,
        &keys[0],
        Duration::ZERO,
        "the first key was left taken by a busy hold",
    )
    .await;
    elsewhere.release().await.expect("release");
    // And the other way round: a hold of both by this registry is refused
    // to the other process key by key.
    let both = registry
        .lock_all(&keys)
        .wait(Duration::ZERO)
        .acquire()
        .await
        .expect("free keys");
    for key in &keys {
        assert_busy(
            other.lock(key).wait(Duration::ZERO).acquire().await,
            "a key of a held pair",
        );
    }
    both.release().await.expect("release");
}

/// `host:port` of a Redis URL (no credentials, no path).
#[cfg(feature = "redis")]
fn host_port(url: &str) -> String {
    let rest = url.split("://").nth(1).expect("a URL");
    rest.trim_end_matches('/')
        .rsplit('@')
        .next()
        .unwrap()
        .to_owned()
}

/// A proxy to the Redis server, a registry through it with `?query` on its
/// URL, and an observer registry on the server itself.
#[cfg(feature = "redis")]
async fn redis_proxied(query: &str) -> (dlock_testkit::FaultProxy, Registry, Registry) {
    let url = redis_url();
    let proxy = dlock_testkit::FaultProxy::start(host_port(&url))
        .await
        .expect("proxy");
    let proxied = redis_at(&format!("redis://{}/{query}", proxy.addr())).await;
    (proxy, proxied, redis_at(&url).await)
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_abandoned_one_step_leaves_no_key_held() {
    let (proxy, proxied, observer) = redis_proxied("").await;
    let keys = two_keys("redis-abandoned-step");
    abandoned_step_leaves_no_key_held(&proxied, &proxy, &observer, &keys, keys[1].as_bytes()).await;
}

/// A server that stops answering while a hold of two keys waits: the
/// hold is an error within its `wait` and the attempt grace, not at the
/// backend's own 10 s request timeout, and leaves neither key held once
/// the server answers again.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_silent_server_ends_a_hold_within_its_wait() {
    let (proxy, proxied, observer) = redis_proxied("?timeout=10s").await;
    let keys = two_keys("redis-silent-server-hold");
    let warm = proxied.lock_all(&keys).acquire().await.expect("warm up");
    warm.release().await.expect("release");
    proxy.set(dlock_testkit::Fault::Hold);
    let wait = Duration::from_millis(500);
    let started = Instant::now();
    let answer = proxied.lock_all(&keys).wait(wait).acquire().await;
    let took = started.elapsed();
    assert!(
        matches!(answer, Err(LockError::Backend { .. })),
        "a silent server is a backend error, got {:?}",
        answer.map(|g| g.keys().to_vec())
    );
    assert!(
        took < Duration::from_secs(3),
        "the hold answered {took:?} after it began, with a 500 ms wait"
    );
    proxy.set(dlock_testkit::Fault::Pass);
    let again = observer
        .lock_all(&keys)
        .wait(Duration::from_secs(15))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the keys of the failed hold are not free: {e}"));
    again.release().await.expect("release");
}

/// Shutdown while a one-step acquisition's script is held back by a
/// proxy: once shutdown returns, neither key is held.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_shutdown_during_a_one_step_on_the_wire_frees_both_keys() {
    let (proxy, proxied, observer) = redis_proxied("").await;
    let warm = two_keys("shutdown-wire-warm");
    proxied
        .lock_all(&warm)
        .acquire()
        .await
        .expect("warm up")
        .release()
        .await
        .expect("release");
    let keys = two_keys("shutdown-wire");
    proxy.hold_next(&[keys[1].as_bytes()], Duration::from_millis(800));
    let acquiring = tokio::spawn({
        let (proxied, keys) = (proxied.clone(), keys.clone());
        async move {
            proxied
                .lock_all(&keys)
                .lease(Duration::from_secs(60))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(proxy.held_on().is_some(), "the step was held back");
    let report = proxied.shutdown(Duration::from_secs(10)).await;
    assert_eq!(report.unfinished, 0, "{report:?}");
    let _ = acquiring.await;
    for key in &keys {
        assert!(
            observer.inspect(key).await.expect("inspect").is_none(),
            "`{key}` held once shutdown returned"
        );
    }
}

/// A registry through a new proxy to `db`'s server, and the proxy.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn sql_proxied(db: dlock_tests::sql_db::SqlDb) -> (Registry, dlock_testkit::FaultProxy) {
    let proxy = dlock_tests::sql_support::proxy_to(&db.host_port()).await;
    let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
    let registry = db.connect_url(&url).await.expect("connect").registry();
    (registry, proxy)
}

/// [`abandoned_step_leaves_no_key_held`] on `db`, the step held back at
/// `needle` (or at its second key).
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn sql_abandoned_step(db: dlock_tests::sql_db::SqlDb, needle: Option<&[u8]>) {
    let (registry, proxy) = sql_proxied(db).await;
    let observer = db.registry("").await;
    // Keys of this case alone: the cases of one database run at once.
    let case = match needle {
        None => "sql-abandoned-step-second-key",
        Some(n) => &format!("sql-abandoned-step-{}", String::from_utf8_lossy(n)),
    };
    let keys = two_keys(case);
    let needle = needle.unwrap_or(keys[1].as_bytes());
    abandoned_step_leaves_no_key_held(&registry, &proxy, &observer, &keys, needle).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_abandoned_one_step_leaves_no_key_held() {
    sql_abandoned_step(dlock_tests::sql_db::SqlDb::Postgres, None).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_abandoned_one_step_at_its_second_key_leaves_no_key_held() {
    sql_abandoned_step(dlock_tests::sql_db::SqlDb::Mysql, None).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_abandoned_one_step_at_its_commit_leaves_no_key_held() {
    sql_abandoned_step(dlock_tests::sql_db::SqlDb::Mysql, Some(b"COMMIT")).await;
}

/// A hold given up while its transaction's `BEGIN` is on the wire: the
/// server starts the transaction after the caller left. The connection
/// must not go back to the pool inside it (every later statement on it
/// would run there uncommitted, its row locks held), so each key the
/// registry takes and releases afterwards is free for another process.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_abandoned_one_step_at_its_begin_leaves_no_transaction_open() {
    let db = dlock_tests::sql_db::SqlDb::Mysql;
    let (registry, proxy) = sql_proxied(db).await;
    let observer = db.registry("").await;
    let keys = two_keys("sql-abandoned-step-begin");
    abandoned_step_leaves_no_key_held(&registry, &proxy, &observer, &keys, b"BEGIN").await;
    for round in 0..8 {
        let key = unique_key(&format!("after-abandoned-begin-{round}"));
        let guard = registry.lock(&key).acquire().await.expect("free key");
        guard.release().await.expect("release");
        let again = observer
            .lock(&key)
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap_or_else(|e| {
                panic!("a key the registry released is not free elsewhere (round {round}): {e}")
            });
        again.release().await.expect("release");
    }
}

/// A one-step waiter for `[a, b]`: `a` held by one process for a moment,
/// `b` by another for 30 s. Once `a` is released the waiter finds `b` busy
/// and sleeps on `b`; `b`'s release, 1 s later, wakes it at once (not after
/// `b`'s lease or a long poll).
async fn waiter_follows_the_busy_key(waiter: &Registry, first: &Registry, second: &Registry) {
    let keys = two_keys("busy-key-moves");
    let a = first.lock(&keys[0]).acquire().await.expect("free key");
    let b = second
        .lock(&keys[1])
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("free key");
    let waiting = tokio::spawn({
        let (waiter, keys) = (waiter.clone(), keys.clone());
        async move {
            let guard = waiter
                .lock_all(&keys)
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (guard, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let released = Instant::now();
    b.release().await.expect("release");
    let (guard, acquired) = waiting.await.expect("waiting task");
    let after = acquired.saturating_duration_since(released);
    guard
        .expect("every key once released")
        .release()
        .await
        .expect("release");
    assert!(
        after < Duration::from_millis(900),
        "the release of the key found busy second woke the waiter only after {after:?}"
    );
}

/// A one-step waiter whose second key stays held (30 s lease, another
/// process) gives up within its 1 s budget (plus a little), and leaves the
/// first key free.
async fn waiter_keeps_its_budget(waiter: &Registry, holder: &Registry) {
    let keys = two_keys("one-step-budget");
    let held = holder
        .lock(&keys[1])
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("free key");
    let started = Instant::now();
    let answer = waiter
        .lock_all(&keys)
        .wait(Duration::from_secs(1))
        .acquire()
        .await;
    let took = started.elapsed();
    assert_busy(answer, "a hold whose second key stays held");
    assert!(
        took >= Duration::from_millis(950) && took < Duration::from_millis(1500),
        "a 1 s wait gave up after {took:?}"
    );
    assert_free(
        holder,
        &keys[0],
        Duration::ZERO,
        "the first key was left taken by a busy waiter",
    )
    .await;
    held.release().await.expect("release");
}

/// Cuts the connection just after the first request carrying every one of
/// `needles` (the request reaches the server, its answer never comes back),
/// for a protocol whose frame length `frame_len` reads.
struct CutOnce {
    needles: Vec<Vec<u8>>,
    frame_len: fn(&[u8]) -> Option<usize>,
    cut: std::sync::atomic::AtomicBool,
}

impl CutOnce {
    /// A filter that cuts nothing until armed (once the connections are up).
    fn disarmed(needles: Vec<Vec<u8>>, frame_len: fn(&[u8]) -> Option<usize>) -> Arc<CutOnce> {
        Arc::new(CutOnce {
            needles,
            frame_len,
            cut: std::sync::atomic::AtomicBool::new(true),
        })
    }
}

impl dlock_testkit::RequestFilter for CutOnce {
    fn frame_len(&self, bytes: &[u8]) -> Option<usize> {
        (self.frame_len)(bytes)
    }

    fn request(&self, _index: usize, frame: &[u8]) -> dlock_testkit::Verdict {
        let carries = |needle: &Vec<u8>| frame.windows(needle.len()).any(|w| w == &needle[..]);
        if self.needles.iter().all(carries)
            && !self.cut.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            dlock_testkit::Verdict::ForwardThenCut(Duration::from_millis(100))
        } else {
            dlock_testkit::Verdict::Forward
        }
    }
}

/// The length of the RESP request at the start of `bytes` (an array of bulk
/// strings, as clients send).
fn resp_frame_len(bytes: &[u8]) -> Option<usize> {
    fn line(bytes: &[u8], at: usize) -> Option<(usize, usize)> {
        let end = bytes[at..].windows(2).position(|w| w == b"\r\n")? + at;
        let n: usize = std::str::from_utf8(&bytes[at + 1..end])
            .ok()?
            .parse()
            .ok()?;
        Some((n, end + 2))
    }
    let (items, mut at) = line(bytes, 0)?;
    for _ in 0..items {
        let (len, next) = line(bytes, at)?;
        at = next + len + 2;
        if at > bytes.len() {
            return None;
        }
    }
    Some(at)
}

/// The length of the MySQL packet at the start of `bytes`.
fn mysql_frame_len(bytes: &[u8]) -> Option<usize> {
    if bytes.len() < 4 {
        return None;
    }
    let len = usize::from(bytes[0]) | usize::from(bytes[1]) << 8 | usize::from(bytes[2]) << 16;
    Some(4 + len)
}

/// Connections open and statements prepared.
async fn warm_up(registry: &Registry) {
    for _ in 0..3 {
        let warm = two_keys("lost-answer-warm");
        let g = registry.lock_all(&warm).acquire().await.expect("warm up");
        g.release().await.expect("release");
    }
}

/// A hold of two keys whose one step ran on the server but whose answer was
/// lost (`filter` cuts the connection just after it, armed once `proxied`'s
/// connections are up): the acquisition goes on and gets both keys, each
/// held by the hold's one owner; once released both are free, and no key is
/// left held without a holder.
async fn lost_answer_then_retry(
    proxied: &Registry,
    observer: &Registry,
    filter: &CutOnce,
    keys: &[String],
) {
    warm_up(proxied).await;
    filter.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    let guard = proxied
        .lock_all(keys)
        .wait(Duration::from_secs(10))
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("a hold whose first answer was lost: {e}"));
    for key in keys {
        let info = observer
            .inspect(key)
            .await
            .expect("inspect")
            .unwrap_or_else(|| panic!("`{key}` not held on the server by the hold"));
        let holders = info.holders();
        assert_eq!(holders.len(), 1, "`{key}`: {holders:?}");
        assert_eq!(
            holders[0].token(),
            guard.fencing_token_of(key),
            "`{key}`: the server's holder is not the hold's grant"
        );
    }
    guard.release().await.expect("release");
    for key in keys {
        assert!(
            observer.inspect(key).await.expect("inspect").is_none(),
            "`{key}` still held after the hold was released"
        );
    }
    assert!(
        filter.cut.load(std::sync::atomic::Ordering::SeqCst),
        "the answer was cut"
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_step_with_a_lost_answer_is_held_once() {
    let url = redis_url();
    let keys = two_keys("redis-lost-answer");
    let needles = vec![keys[0].as_bytes().to_vec(), keys[1].as_bytes().to_vec()];
    let filter = CutOnce::disarmed(needles, resp_frame_len);
    let proxy = dlock_testkit::FaultProxy::start_filtered(host_port(&url), filter.clone())
        .await
        .expect("proxy");
    let proxied = redis_at(&format!("redis://{}/", proxy.addr())).await;
    lost_answer_then_retry(&proxied, &redis_at(&url).await, &filter, &keys).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_one_step_with_a_lost_commit_answer_is_held_once() {
    let db = dlock_tests::sql_db::SqlDb::Mysql;
    let keys = two_keys("mysql-lost-answer");
    let filter = CutOnce::disarmed(vec![b"\x03COMMIT".to_vec()], mysql_frame_len);
    let proxy = dlock_testkit::FaultProxy::start_filtered(db.host_port(), filter.clone())
        .await
        .expect("proxy");
    let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
    let proxied = db.connect_url(&url).await.expect("connect").registry();
    lost_answer_then_retry(&proxied, &db.registry("").await, &filter, &keys).await;
}

/// Hold acquisitions of two keys given up at many moments (every 250 µs of
/// their first 10 ms, so at each of their awaits), with both keys free and
/// with the second held elsewhere: afterwards another process takes both
/// within 10 s (past every backend's backstop release, SQLite's 7 s the
/// longest) — never a key left held for the 30 s lease.
async fn abandoned_at_every_moment(registry: &Registry, observer: &Registry, layout: Keys) {
    for busy in [false, true] {
        for i in 0..40u64 {
            let keys = layout.two(&format!("abandoned-moment-{busy}-{i}"));
            let elsewhere = if busy {
                Some(observer.lock(&keys[1]).acquire().await.expect("free key"))
            } else {
                None
            };
            let attempt = tokio::time::timeout(
                Duration::from_micros(250 * i),
                registry
                    .lock_all(&keys)
                    .lease(Duration::from_secs(30))
                    .wait(Duration::from_secs(30))
                    .acquire(),
            )
            .await;
            if let Ok(answer) = attempt {
                answer.expect("free keys").release().await.expect("release");
            }
            if let Some(elsewhere) = elsewhere {
                elsewhere.release().await.expect("release");
            }
            let started = Instant::now();
            let again = observer
                .lock_all(&keys)
                .wait(Duration::from_secs(10))
                .acquire()
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "given up after {:?} (second key busy: {busy}): the keys stayed \
                         held for {:?}: {e}",
                        Duration::from_micros(250 * i),
                        started.elapsed()
                    )
                });
            again.release().await.expect("release");
        }
    }
    let settled = Instant::now();
    while registry.held_leases() > 0 && settled.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        registry.held_leases(),
        0,
        "leases still tracked after every abandoned hold was undone"
    );
}

/// Inside a hold of `[a, b]`, sibling futures asking for `[b, a]`, `[a, b]`
/// and `a` alone take turns: each enters (within its wait), never two at once.
async fn siblings_take_turns(registry: &Registry) {
    let [a, b] = two_keys("several-siblings");
    let inside = std::sync::atomic::AtomicUsize::new(0);
    let overlapped = std::sync::atomic::AtomicBool::new(false);
    let sibling = |keys: Vec<String>| {
        let (inside, overlapped) = (&inside, &overlapped);
        async move {
            let guard = registry
                .lock_all(&keys)
                .wait(Duration::from_secs(5))
                .acquire()
                .await?;
            if inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
                overlapped.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            guard.release().await
        }
    };
    let outer = registry
        .lock_all([&a, &b])
        .acquire()
        .await
        .expect("free keys");
    let (x, y, z) = outer
        .scope(async {
            tokio::join!(
                sibling(vec![b.clone(), a.clone()]),
                sibling(vec![a.clone(), b.clone()]),
                sibling(vec![a.clone()]),
            )
        })
        .await;
    x.expect("a sibling naming [b, a]");
    y.expect("a sibling naming [a, b]");
    z.expect("a sibling naming a");
    assert!(
        !overlapped.load(std::sync::atomic::Ordering::SeqCst),
        "siblings were inside at the same time"
    );
    outer.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_several_key_siblings_take_turns() {
    let (_backend, registry) = dlock_tests::memory_support::memory_registry();
    siblings_take_turns(&registry).await;
}

/// Shutdown while this registry holds `[c, d]` and waits for `[a, b]` (`b`
/// held elsewhere): the waiter answers `ShutDown`, nothing is left
/// unfinished, and once shutdown has returned another process takes every
/// key at once.
async fn shutdown_frees_every_key(registry: &Registry, observer: &Registry, layout: Keys) {
    let [a, b, c, d] = layout.four("shutdown");
    let elsewhere = observer.lock(&b).acquire().await.expect("free key");
    let held = registry
        .lock_all([&c, &d])
        .acquire()
        .await
        .expect("free keys");
    let waiting = tokio::spawn({
        let (registry, a, b) = (registry.clone(), a.clone(), b.clone());
        async move {
            registry
                .lock_all([&a, &b])
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = registry.shutdown(Duration::from_secs(10)).await;
    assert_eq!(report.unfinished, 0, "{report:?}");
    let answer = waiting.await.expect("waiting task");
    elsewhere.release().await.expect("release");
    let all = observer
        .lock_all([&a, &b, &c, &d])
        .wait(Duration::ZERO)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("a key was still held once shutdown returned: {e}"));
    all.release().await.expect("release");
    drop(held);
    match answer {
        Err(LockError::ShutDown) => {}
        Ok(_) => panic!("granted during shutdown"),
        Err(e) => panic!("a waiting acquisition stopped by shutdown: expected ShutDown, got {e}"),
    }
}

/// With `hold_at_least`, a hold of `[a, b]` that finds `b` busy (wait 0)
/// never had a body to keep the keys after: `a`, taken first where the keys
/// go one by one, is free for another process at once.
async fn busy_hold_keeps_nothing_at_least(registry: &Registry, other: &Registry, layout: Keys) {
    let keys = layout.two("busy-at-least");
    let elsewhere = other.lock(&keys[1]).acquire().await.expect("free key");
    assert_busy(
        registry
            .lock_all(&keys)
            .hold_at_least(Duration::from_secs(20))
            .wait(Duration::ZERO)
            .acquire()
            .await,
        "a hold whose second key is held elsewhere",
    );
    assert_free(
        other,
        &keys[0],
        Duration::from_millis(500),
        "the first key stayed held after a busy acquisition with hold_at_least",
    )
    .await;
    elsewhere.release().await.expect("release");
}

/// With `hold_at_least`, a hold of `[a, b]` given up while it waits for `b`
/// (held elsewhere) leaves `a` free for another process at once.
async fn abandoned_hold_keeps_nothing_at_least(
    registry: &Registry,
    other: &Registry,
    layout: Keys,
) {
    let keys = layout.two("abandoned-at-least");
    let elsewhere = other.lock(&keys[1]).acquire().await.expect("free key");
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        registry
            .lock_all(&keys)
            .hold_at_least(Duration::from_secs(20))
            .wait(Duration::from_secs(30))
            .acquire(),
    )
    .await;
    assert!(gave_up.is_err(), "the caller gave up while the hold waited");
    assert_free(
        other,
        &keys[0],
        Duration::from_millis(500),
        "the first key stayed held after an abandoned acquisition with hold_at_least",
    )
    .await;
    elsewhere.release().await.expect("release");
}

/// Without the watchdog (1 s lease), a hold of `[a, b]` that waits 2 s for
/// `b`: `a`, taken first where the keys go one by one, has run out by then
/// and another process took it. The hold must not be granted as if `a` were
/// still its own.
async fn expired_first_key_is_not_granted(registry: &Registry, other: &Registry, layout: Keys) {
    let keys = layout.two("expired-first");
    let elsewhere = other.lock(&keys[1]).acquire().await.expect("free key");
    let waiting = tokio::spawn({
        let (registry, keys) = (registry.clone(), keys.clone());
        async move {
            registry
                .lock_all(&keys)
                .lease(Duration::from_secs(1))
                .watchdog(false)
                .wait(Duration::from_secs(10))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let taker = other
        .lock(&keys[0])
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .expect("the first key ran out without the watchdog");
    elsewhere.release().await.expect("release");
    let answer = waiting.await.expect("waiting task");
    let granted = answer.is_ok();
    if let Ok(guard) = answer {
        let _ = guard.release().await;
    }
    taker.release().await.expect("release");
    assert!(
        !granted,
        "a hold of {keys:?} was granted while another process held `{}`",
        keys[0]
    );
}

/// A one-step waiter whose busy key's holder never releases (a 1.5 s lease
/// without the watchdog, as a crashed holder leaves it): the waiter takes
/// both keys soon after that lease runs out, not at the end of its wait.
async fn waiter_takes_over_an_expired_holder(waiter: &Registry, holder: &Registry) {
    let keys = two_keys("expired-holder");
    let crashed = holder
        .lock(&keys[1])
        .lease(Duration::from_millis(1500))
        .watchdog(false)
        .acquire()
        .await
        .expect("free key");
    let started = Instant::now();
    let guard = waiter
        .lock_all(&keys)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("both keys once the holder's lease ran out");
    let took = started.elapsed();
    guard.release().await.expect("release");
    drop(crashed);
    assert!(
        took < Duration::from_millis(2500),
        "the waiter took the keys {took:?} after it began, for a holder's 1.5 s lease"
    );
}

/// Tokens per key across one-step and single-key grants and a revocation:
/// a single-key grant after a one-step hold, a one-step grant after a
/// revoked single-key hold, each key's token larger than every earlier one.
async fn tokens_rise_across_grants_and_revocation(registry: &Registry, observer: &Registry) {
    let keys = two_keys("tokens-across");
    let token_of = |g: &dlock_runtime::LockGuard, k: &str| g.fencing_token_of(k).expect("token");
    let both = registry.lock_all(&keys).acquire().await.expect("free keys");
    let first = [token_of(&both, &keys[0]), token_of(&both, &keys[1])];
    both.release().await.expect("release");
    let single = registry.lock(&keys[1]).acquire().await.expect("free key");
    let single_token = single.fencing_token().expect("token");
    assert!(
        single_token > first[1],
        "{single_token:?} after {:?}",
        first[1]
    );
    let revoked = observer.revoke(&keys[1]).await.expect("revoke");
    assert_eq!(revoked.len(), 1);
    let again = registry
        .lock_all(&keys)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("the keys after the revocation");
    assert!(token_of(&again, &keys[0]) > first[0]);
    assert!(
        token_of(&again, &keys[1]) > single_token,
        "a one-step grant after a revoked hold: {:?} after {single_token:?}",
        token_of(&again, &keys[1])
    );
    again.release().await.expect("release");
    drop(single);
}

#[cfg(feature = "redis")]
on_backend!(redis:
    many_keys_stay_held(registry, observer),
    revoked_key_cancels_the_hold(registry, observer),
    fenced_and_unfenced_exclude(first, second),
    waiter_follows_the_busy_key(waiter, first, second),
    waiter_keeps_its_budget(waiter, holder),
    waiter_takes_over_an_expired_holder(waiter, holder),
    tokens_rise_across_grants_and_revocation(registry, observer),
    abandoned_at_every_moment(registry, observer; keys),
    siblings_take_turns(registry),
    shutdown_frees_every_key(registry, observer; keys),
    busy_hold_keeps_nothing_at_least(registry, other; keys),
);

#[cfg(feature = "redis")]
on_backend!(redis_cluster:
    many_keys_stay_held(registry, observer),
    fenced_and_unfenced_exclude(first, second),
    abandoned_at_every_moment(registry, observer; keys),
);

// One thread for shutdown: it runs from start to end before the waiter is
// polled.
#[cfg(feature = "redis")]
on_backend!(redis_cluster_across_slots:
    abandoned_at_every_moment(registry, observer; keys),
    shutdown_frees_every_key(registry, observer; keys) on_one_thread,
    busy_hold_keeps_nothing_at_least(registry, other; keys),
    abandoned_hold_keeps_nothing_at_least(registry, other; keys),
    expired_first_key_is_not_granted(registry, other; keys),
);

#[cfg(feature = "redis")]
on_backend!(redlock:
    busy_second_key_leaves_first_free(registry, other),
    waiter_keeps_its_budget(waiter, holder),
    abandoned_at_every_moment(registry, observer; keys),
    busy_hold_keeps_nothing_at_least(registry, other; keys),
    abandoned_hold_keeps_nothing_at_least(registry, other; keys),
    expired_first_key_is_not_granted(registry, other; keys),
);

#[cfg(feature = "postgres")]
on_backend!(postgres:
    many_keys_stay_held(registry, observer),
    revoked_key_cancels_the_hold(registry, observer),
    overlapping_fresh_keys_never_fail(a, b, c, d),
    busy_second_key_leaves_first_free(registry, other),
    waiter_follows_the_busy_key(waiter, first, second),
    waiter_keeps_its_budget(waiter, holder),
    waiter_takes_over_an_expired_holder(waiter, holder),
    tokens_rise_across_grants_and_revocation(registry, observer),
    abandoned_at_every_moment(registry, observer; keys),
    shutdown_frees_every_key(registry, observer; keys),
    busy_hold_keeps_nothing_at_least(registry, other; keys),
);

// One thread for shutdown: it runs from start to end before the waiter is
// polled.
#[cfg(feature = "postgres")]
on_backend!(postgres_session:
    busy_second_key_leaves_first_free(registry, other),
    waiter_keeps_its_budget(waiter, holder),
    abandoned_at_every_moment(registry, observer; keys),
    shutdown_frees_every_key(registry, observer; keys) on_one_thread,
    busy_hold_keeps_nothing_at_least(registry, other; keys),
);

#[cfg(feature = "mysql")]
on_backend!(mysql:
    many_keys_stay_held(registry, observer),
    revoked_key_cancels_the_hold(registry, observer),
    overlapping_fresh_keys_never_fail(a, b, c, d),
    busy_second_key_leaves_first_free(registry, other),
    waiter_follows_the_busy_key(waiter, first, second),
    waiter_keeps_its_budget(waiter, holder),
    waiter_takes_over_an_expired_holder(waiter, holder),
    tokens_rise_across_grants_and_revocation(registry, observer),
    abandoned_at_every_moment(registry, observer; keys),
    shutdown_frees_every_key(registry, observer; keys),
);

// One thread for shutdown: it runs from start to end before the waiter is
// polled.
#[cfg(feature = "mysql")]
on_backend!(mysql_session:
    busy_second_key_leaves_first_free(registry, other),
    waiter_keeps_its_budget(waiter, holder),
    abandoned_at_every_moment(registry, observer; keys),
    shutdown_frees_every_key(registry, observer; keys) on_one_thread,
    busy_hold_keeps_nothing_at_least(registry, other; keys),
);

#[cfg(feature = "sqlite")]
on_backend!(sqlite:
    many_keys_stay_held(registry, observer),
    waiter_follows_the_busy_key(waiter, first, second),
    waiter_takes_over_an_expired_holder(waiter, holder),
    tokens_rise_across_grants_and_revocation(registry, observer),
    abandoned_at_every_moment(registry, observer; keys),
);
