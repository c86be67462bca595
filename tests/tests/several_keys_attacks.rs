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

/// Two registries on one backend that takes several keys in one step, as
/// two processes would have (and the SQLite file's directory, kept while
/// they are used).
mod two_registries {
    use dlock_runtime::Registry;

    #[cfg(feature = "redis")]
    pub(super) async fn redis() -> (Registry, Registry) {
        let url = dlock_tests::server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
        let registry = || async {
            let backend = dlock_runtime::RedisBackend::connect(&url).await;
            Registry::builder()
                .default_backend(backend.unwrap_or_else(|e| dlock_tests::servers_missing(&url, e)))
                .build()
        };
        (registry().await, registry().await)
    }

    #[cfg(feature = "postgres")]
    pub(super) async fn postgres() -> (Registry, Registry) {
        let db = dlock_tests::sql_db::SqlDb::Postgres;
        (db.registry("").await, db.registry("").await)
    }

    #[cfg(feature = "mysql")]
    pub(super) async fn mysql() -> (Registry, Registry) {
        let db = dlock_tests::sql_db::SqlDb::Mysql;
        (db.registry("").await, db.registry("").await)
    }

    #[cfg(feature = "sqlite")]
    pub(super) async fn sqlite(dir: &tempfile::TempDir) -> (Registry, Registry) {
        let url = format!("sqlite://{}", dir.path().join("locks.db").display());
        let registry = || async {
            let backend = dlock_runtime::SqliteBackend::connect(&url).await;
            Registry::builder()
                .default_backend(backend.expect("open"))
                .build()
        };
        (registry().await, registry().await)
    }
}

/// One test per backend that takes several keys in one step (a module named
/// after `$case`, a test per backend in it), each running
/// `$case(&first, &second)` on two registries of that backend.
macro_rules! on_each_one_step_backend {
    ($case:ident) => {
        mod $case {
            #[cfg(feature = "redis")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                let (first, second) = super::two_registries::redis().await;
                super::$case(&first, &second).await;
            }

            #[cfg(feature = "postgres")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let (first, second) = super::two_registries::postgres().await;
                super::$case(&first, &second).await;
            }

            #[cfg(feature = "mysql")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mysql() {
                let (first, second) = super::two_registries::mysql().await;
                super::$case(&first, &second).await;
            }

            #[cfg(feature = "sqlite")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                let dir = tempfile::tempdir().expect("tempdir");
                let (first, second) = super::two_registries::sqlite(&dir).await;
                super::$case(&first, &second).await;
            }
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
    let other = observer
        .lock(&keys[0])
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the key not revoked stayed held after a lost hold: {e}"));
    other.release().await.expect("release");
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
        let free = second
            .lock(&c)
            .wait(Duration::ZERO)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("`{c}` was left taken by a refused hold: {e}"));
        free.release().await.expect("release");
        held.release().await.expect("release");
    }
}

/// Several tasks on registries of their own take random pairs (in random
/// order) and single keys of fresh keys (new rows each round): every
/// acquisition succeeds within its wait (a deadlock the server detects is
/// retried, never surfaced), and no two holds of a key overlap.
async fn overlapping_fresh_keys_never_fail(registries: Vec<Registry>, rounds: usize) {
    let base = unique_key("overlapping-fresh");
    let held: Arc<Mutex<HashSet<String>>> = Arc::default();
    let tasks: Vec<_> = registries
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
    let first = other
        .lock(&keys[0])
        .wait(Duration::ZERO)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the first key was left taken by a busy hold: {e}"));
    first.release().await.expect("release");
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

#[cfg(feature = "redis")]
mod redis_backend {
    use super::*;
    use dlock_runtime::RedisBackend;
    use dlock_tests::{server_url, servers_missing};

    fn url() -> String {
        server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
    }

    async fn registry_at(url: &str) -> Registry {
        Registry::builder()
            .default_backend(
                RedisBackend::connect(url)
                    .await
                    .unwrap_or_else(|e| servers_missing(url, e)),
            )
            .build()
    }

    fn host_port(url: &str) -> String {
        let rest = url.split("://").nth(1).expect("a URL");
        rest.trim_end_matches('/')
            .rsplit('@')
            .next()
            .unwrap()
            .to_owned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_abandoned_one_step_leaves_no_key_held() {
        let url = url();
        let proxy = dlock_testkit::FaultProxy::start(host_port(&url))
            .await
            .expect("proxy");
        let proxied = registry_at(&format!("redis://{}/", proxy.addr())).await;
        let observer = registry_at(&url).await;
        let keys = two_keys("redis-abandoned-step");
        abandoned_step_leaves_no_key_held(&proxied, &proxy, &observer, &keys, keys[1].as_bytes())
            .await;
    }

    /// A server that stops answering while a hold of two keys waits: the
    /// hold is an error within its `wait` and the attempt grace, not at the
    /// backend's own 10 s request timeout, and leaves neither key held once
    /// the server answers again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_a_silent_server_ends_a_hold_within_its_wait() {
        let url = url();
        let proxy = dlock_testkit::FaultProxy::start(host_port(&url))
            .await
            .expect("proxy");
        let proxied = registry_at(&format!("redis://{}/?timeout=10s", proxy.addr())).await;
        let observer = registry_at(&url).await;
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_many_keys_stay_held() {
        let url = url();
        many_keys_stay_held(&registry_at(&url).await, &registry_at(&url).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_revoked_key_cancels_the_hold() {
        let url = url();
        revoked_key_cancels_the_hold(&registry_at(&url).await, &registry_at(&url).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_fenced_and_unfenced_holds_exclude_each_other() {
        let url = url();
        fenced_and_unfenced_exclude(&registry_at(&url).await, &registry_at(&url).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_many_keys_stay_held() {
        let url = server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        many_keys_stay_held(&registry_at(&url).await, &registry_at(&url).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_fenced_and_unfenced_holds_exclude_each_other() {
        let url = server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        fenced_and_unfenced_exclude(&registry_at(&url).await, &registry_at(&url).await).await;
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql_backends {
    use super::*;
    use dlock_tests::sql_db::SqlDb;
    use dlock_tests::sql_support::{SqlMode, proxy_to};

    async fn proxied(db: SqlDb) -> (Registry, dlock_testkit::FaultProxy) {
        let proxy = proxy_to(&db.host_port()).await;
        let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
        let registry = db.connect_url(&url).await.expect("connect").registry();
        (registry, proxy)
    }

    async fn abandoned(db: SqlDb, needle: Option<&[u8]>) {
        let (registry, proxy) = proxied(db).await;
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

    async fn registries(db: SqlDb, mode: SqlMode, n: usize) -> Vec<Registry> {
        let mut all = Vec::new();
        for _ in 0..n {
            all.push(db.connect(mode.query()).await.registry());
        }
        all
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_abandoned_one_step_leaves_no_key_held() {
        abandoned(SqlDb::Postgres, None).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_abandoned_one_step_at_its_second_key_leaves_no_key_held() {
        abandoned(SqlDb::Mysql, None).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_abandoned_one_step_at_its_commit_leaves_no_key_held() {
        abandoned(SqlDb::Mysql, Some(b"COMMIT")).await;
    }

    /// A hold given up while its transaction's `BEGIN` is on the wire: the
    /// server starts the transaction after the caller left. The connection
    /// must not go back to the pool inside it (every later statement on it
    /// would run there uncommitted, its row locks held), so each key the
    /// registry takes and releases afterwards is free for another process.
    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_abandoned_one_step_at_its_begin_leaves_no_transaction_open() {
        let db = SqlDb::Mysql;
        let (registry, proxy) = proxied(db).await;
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

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_many_keys_stay_held() {
        let db = SqlDb::Postgres;
        many_keys_stay_held(&db.registry("").await, &db.registry("").await).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_many_keys_stay_held() {
        let db = SqlDb::Mysql;
        many_keys_stay_held(&db.registry("").await, &db.registry("").await).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_revoked_key_cancels_the_hold() {
        let db = SqlDb::Postgres;
        revoked_key_cancels_the_hold(&db.registry("").await, &db.registry("").await).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_revoked_key_cancels_the_hold() {
        let db = SqlDb::Mysql;
        revoked_key_cancels_the_hold(&db.registry("").await, &db.registry("").await).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_overlapping_fresh_keys_never_fail() {
        let db = SqlDb::Postgres;
        overlapping_fresh_keys_never_fail(registries(db, SqlMode::Lease, 4).await, 40).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_overlapping_fresh_keys_never_fail() {
        let db = SqlDb::Mysql;
        overlapping_fresh_keys_never_fail(registries(db, SqlMode::Lease, 4).await, 40).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_busy_second_key_leaves_first_free() {
        let db = SqlDb::Postgres;
        let r = registries(db, SqlMode::Session, 2).await;
        busy_second_key_leaves_first_free(&r[0], &r[1]).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_busy_second_key_leaves_first_free() {
        let db = SqlDb::Mysql;
        let r = registries(db, SqlMode::Session, 2).await;
        busy_second_key_leaves_first_free(&r[0], &r[1]).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_busy_second_key_leaves_first_free() {
        let db = SqlDb::Postgres;
        let r = registries(db, SqlMode::Lease, 2).await;
        busy_second_key_leaves_first_free(&r[0], &r[1]).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_busy_second_key_leaves_first_free() {
        let db = SqlDb::Mysql;
        let r = registries(db, SqlMode::Lease, 2).await;
        busy_second_key_leaves_first_free(&r[0], &r[1]).await;
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
    let first = holder
        .lock(&keys[0])
        .wait(Duration::ZERO)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("the first key was left taken by a busy waiter: {e}"));
    first.release().await.expect("release");
    held.release().await.expect("release");
}

#[cfg(feature = "redis")]
mod redis_waits {
    use super::*;
    use dlock_runtime::RedisBackend;
    use dlock_tests::{server_url, servers_missing};

    async fn registry() -> Registry {
        let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
        Registry::builder()
            .default_backend(
                RedisBackend::connect(&url)
                    .await
                    .unwrap_or_else(|e| servers_missing(&url, e)),
            )
            .build()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_one_step_waiter_follows_the_busy_key() {
        waiter_follows_the_busy_key(&registry().await, &registry().await, &registry().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_one_step_waiter_keeps_its_budget() {
        waiter_keeps_its_budget(&registry().await, &registry().await).await;
    }
}

#[cfg(feature = "postgres")]
mod postgres_waits {
    use super::*;
    use dlock_tests::sql_db::SqlDb;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_one_step_waiter_follows_the_busy_key() {
        let db = SqlDb::Postgres;
        waiter_follows_the_busy_key(
            &db.registry("").await,
            &db.registry("").await,
            &db.registry("").await,
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_one_step_waiter_keeps_its_budget() {
        let db = SqlDb::Postgres;
        waiter_keeps_its_budget(&db.registry("").await, &db.registry("").await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_waiter_keeps_its_budget() {
        let db = SqlDb::Postgres;
        waiter_keeps_its_budget(
            &db.registry("mode=session").await,
            &db.registry("mode=session").await,
        )
        .await;
    }
}

#[cfg(feature = "mysql")]
mod mysql_waits {
    use super::*;
    use dlock_tests::sql_db::SqlDb;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_one_step_waiter_follows_the_busy_key() {
        let db = SqlDb::Mysql;
        waiter_follows_the_busy_key(
            &db.registry("").await,
            &db.registry("").await,
            &db.registry("").await,
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_one_step_waiter_keeps_its_budget() {
        let db = SqlDb::Mysql;
        waiter_keeps_its_budget(&db.registry("").await, &db.registry("").await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_waiter_keeps_its_budget() {
        let db = SqlDb::Mysql;
        waiter_keeps_its_budget(
            &db.registry("mode=session").await,
            &db.registry("mode=session").await,
        )
        .await;
    }
}

/// Cuts the connection just after the first request carrying every one of
/// `needles` (the request reaches the server, its answer never comes back),
/// for a protocol whose frame length `frame_len` reads.
struct CutOnce {
    needles: Vec<Vec<u8>>,
    frame_len: fn(&[u8]) -> Option<usize>,
    cut: std::sync::atomic::AtomicBool,
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
/// lost (the connection cut just after it): the acquisition goes on and gets
/// both keys, each held by the hold's one owner; once released both are
/// free, and no key is left held without a holder.
async fn lost_answer_then_retry(proxied: &Registry, observer: &Registry, keys: &[String]) {
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
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_one_step_with_a_lost_answer_is_held_once() {
    use dlock_runtime::RedisBackend;
    let url = dlock_tests::server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
    let keys = two_keys("redis-lost-answer");
    let filter = Arc::new(CutOnce {
        needles: vec![keys[0].as_bytes().to_vec(), keys[1].as_bytes().to_vec()],
        frame_len: resp_frame_len,
        // Armed below, once the connections are up.
        cut: std::sync::atomic::AtomicBool::new(true),
    });
    let upstream = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let proxy = dlock_testkit::FaultProxy::start_filtered(upstream, filter.clone())
        .await
        .expect("proxy");
    let registry_at = |url: String| async move {
        Registry::builder()
            .default_backend(RedisBackend::connect(&url).await.expect("connect"))
            .build()
    };
    let proxied = registry_at(format!("redis://{}/", proxy.addr())).await;
    let observer = registry_at(url.clone()).await;
    warm_up(&proxied).await;
    filter.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    lost_answer_then_retry(&proxied, &observer, &keys).await;
    assert!(
        filter.cut.load(std::sync::atomic::Ordering::SeqCst),
        "the answer was cut"
    );
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_one_step_with_a_lost_commit_answer_is_held_once() {
    use dlock_tests::sql_db::SqlDb;
    let db = SqlDb::Mysql;
    let keys = two_keys("mysql-lost-answer");
    let filter = Arc::new(CutOnce {
        needles: vec![b"\x03COMMIT".to_vec()],
        frame_len: mysql_frame_len,
        // Armed below, once the connections are up.
        cut: std::sync::atomic::AtomicBool::new(true),
    });
    let proxy = dlock_testkit::FaultProxy::start_filtered(db.host_port(), filter.clone())
        .await
        .expect("proxy");
    let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
    let proxied = db.connect_url(&url).await.expect("connect").registry();
    let observer = db.registry("").await;
    warm_up(&proxied).await;
    filter.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    lost_answer_then_retry(&proxied, &observer, &keys).await;
    assert!(
        filter.cut.load(std::sync::atomic::Ordering::SeqCst),
        "the answer was cut"
    );
}

/// Hold acquisitions of two keys given up at many moments (every 250 µs of
/// their first 10 ms, so at each of their awaits), with both keys free and
/// with the second held elsewhere: afterwards another process takes both
/// within 5 s — never a key left held for the 30 s lease.
async fn abandoned_at_every_moment(registry: &Registry, observer: &Registry) {
    abandoned_at_every_moment_of(registry, observer, two_keys).await;
}

/// [`abandoned_at_every_moment`] with the keys `keys` makes for a case.
async fn abandoned_at_every_moment_of(
    registry: &Registry,
    observer: &Registry,
    keys: fn(&str) -> [String; 2],
) {
    for busy in [false, true] {
        for i in 0..40u64 {
            let keys = keys(&format!("abandoned-moment-{busy}-{i}"));
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
                .wait(Duration::from_secs(5))
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

#[cfg(feature = "redis")]
mod redis_abandoned {
    use super::*;
    use dlock_runtime::RedisBackend;
    use dlock_tests::{server_url, servers_missing};

    async fn registry(var: &str, default: &str) -> Registry {
        let url = server_url(var, default);
        Registry::builder()
            .default_backend(
                RedisBackend::connect(&url)
                    .await
                    .unwrap_or_else(|e| servers_missing(&url, e)),
            )
            .build()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_hold_abandoned_at_every_moment_leaves_no_key_held() {
        let (var, default) = ("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
        abandoned_at_every_moment(&registry(var, default).await, &registry(var, default).await)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_hold_abandoned_at_every_moment_leaves_no_key_held() {
        let (var, default) = (
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        abandoned_at_every_moment(&registry(var, default).await, &registry(var, default).await)
            .await;
    }

    /// Two keys in different hash slots (no shared tag).
    fn two_slots(case: &str) -> [String; 2] {
        let key = unique_key(case);
        [format!("{key}:a"), format!("{key}:b")]
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_hold_across_slots_abandoned_at_every_moment_leaves_no_key_held() {
        let (var, default) = (
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        abandoned_at_every_moment_of(
            &registry(var, default).await,
            &registry(var, default).await,
            two_slots,
        )
        .await;
    }
}

#[cfg(feature = "sqlite")]
mod sqlite_backend {
    use super::*;
    use dlock_runtime::SqliteBackend;

    async fn registry(path: &std::path::Path) -> Registry {
        let url = format!("sqlite://{}", path.display());
        Registry::builder()
            .default_backend(SqliteBackend::connect(&url).await.expect("open"))
            .build()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_hold_abandoned_at_every_moment_leaves_no_key_held() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("several.db");
        let first = registry(&path).await;
        abandoned_at_every_moment(&first, &registry(&path).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_many_keys_stay_held() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("several.db");
        let first = registry(&path).await;
        many_keys_stay_held(&first, &registry(&path).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_one_step_waiter_follows_the_busy_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("several.db");
        let first = registry(&path).await;
        waiter_follows_the_busy_key(&first, &registry(&path).await, &registry(&path).await).await;
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql_abandoned {
    use super::*;
    use dlock_tests::sql_db::SqlDb;

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_hold_abandoned_at_every_moment_leaves_no_key_held() {
        let db = SqlDb::Postgres;
        abandoned_at_every_moment(&db.registry("").await, &db.registry("").await).await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_session_hold_abandoned_at_every_moment_leaves_no_key_held() {
        let db = SqlDb::Postgres;
        abandoned_at_every_moment(
            &db.registry("mode=session").await,
            &db.registry("mode=session").await,
        )
        .await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_hold_abandoned_at_every_moment_leaves_no_key_held() {
        let db = SqlDb::Mysql;
        abandoned_at_every_moment(&db.registry("").await, &db.registry("").await).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_session_hold_abandoned_at_every_moment_leaves_no_key_held() {
        let db = SqlDb::Mysql;
        abandoned_at_every_moment(
            &db.registry("mode=session").await,
            &db.registry("mode=session").await,
        )
        .await;
    }
}

#[cfg(feature = "redis")]
mod redlock_backend {
    use super::*;
    use dlock_runtime::RedlockBackend;
    use dlock_tests::{server_url, servers_missing};

    async fn registry() -> Registry {
        let url = server_url(
            "DLOCK_TEST_REDLOCK_URL",
            "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
        );
        Registry::builder()
            .default_backend(
                RedlockBackend::connect(&url)
                    .await
                    .unwrap_or_else(|e| servers_missing(&url, e)),
            )
            .build()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_hold_abandoned_at_every_moment_leaves_no_key_held() {
        abandoned_at_every_moment(&registry().await, &registry().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_waiter_keeps_its_budget() {
        waiter_keeps_its_budget(&registry().await, &registry().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_busy_second_key_leaves_first_free() {
        busy_second_key_leaves_first_free(&registry().await, &registry().await).await;
    }
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

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_several_key_siblings_take_turns() {
    let url = dlock_tests::server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
    let registry = Registry::builder()
        .default_backend(
            dlock_runtime::RedisBackend::connect(&url)
                .await
                .expect("connect"),
        )
        .build();
    siblings_take_turns(&registry).await;
}

/// Shutdown while this registry holds `[c, d]` and waits for `[a, b]` (`b`
/// held elsewhere): the waiter answers `ShutDown`, nothing is left
/// unfinished, and once shutdown has returned another process takes every
/// key at once.
async fn shutdown_frees_every_key(registry: Registry, observer: &Registry, keys: [String; 4]) {
    let [a, b, c, d] = keys;
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

/// Four keys sharing a hash tag.
fn four_keys(case: &str) -> [String; 4] {
    let tag = unique_key(case);
    ["a", "b", "c", "d"].map(|s| format!("{{{tag}}}:{s}"))
}

/// Four keys in different hash slots.
fn four_slots(case: &str) -> [String; 4] {
    let key = unique_key(case);
    ["a", "b", "c", "d"].map(|s| format!("{key}:{s}"))
}

#[cfg(feature = "redis")]
mod redis_shutdown {
    use super::*;
    use dlock_runtime::RedisBackend;
    use dlock_tests::server_url;

    async fn registry(url: &str) -> Registry {
        Registry::builder()
            .default_backend(RedisBackend::connect(url).await.expect("connect"))
            .build()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_shutdown_frees_every_key_of_several_key_holds() {
        let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
        shutdown_frees_every_key(
            registry(&url).await,
            &registry(&url).await,
            four_keys("redis-shutdown"),
        )
        .await;
    }

    // One thread: shutdown runs from start to end before the waiter is polled.
    #[tokio::test(flavor = "current_thread")]
    async fn redis_cluster_across_slots_shutdown_frees_every_key_of_several_key_holds() {
        let url = server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        shutdown_frees_every_key(
            registry(&url).await,
            &registry(&url).await,
            four_slots("cluster-shutdown"),
        )
        .await;
    }

    /// Shutdown while a one-step acquisition's script is held back by a
    /// proxy: once shutdown returns, neither key is held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_shutdown_during_a_one_step_on_the_wire_frees_both_keys() {
        let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
        let upstream = url
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .to_owned();
        let proxy = dlock_testkit::FaultProxy::start(upstream)
            .await
            .expect("proxy");
        let proxied = registry(&format!("redis://{}/", proxy.addr())).await;
        let observer = registry(&url).await;
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
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sql_shutdown {
    use super::*;
    use dlock_tests::sql_db::SqlDb;

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_shutdown_frees_every_key_of_several_key_holds() {
        let db = SqlDb::Postgres;
        shutdown_frees_every_key(
            db.registry("").await,
            &db.registry("").await,
            four_keys("pg-shutdown"),
        )
        .await;
    }

    #[cfg(feature = "postgres")]
    // One thread: shutdown runs from start to end before the waiter is polled.
    #[tokio::test(flavor = "current_thread")]
    async fn postgres_session_shutdown_frees_every_key_of_several_key_holds() {
        let db = SqlDb::Postgres;
        shutdown_frees_every_key(
            db.registry("mode=session").await,
            &db.registry("mode=session").await,
            four_keys("pg-session-shutdown"),
        )
        .await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_shutdown_frees_every_key_of_several_key_holds() {
        let db = SqlDb::Mysql;
        shutdown_frees_every_key(
            db.registry("").await,
            &db.registry("").await,
            four_keys("mysql-shutdown"),
        )
        .await;
    }

    #[cfg(feature = "mysql")]
    // One thread: shutdown runs from start to end before the waiter is polled.
    #[tokio::test(flavor = "current_thread")]
    async fn mysql_session_shutdown_frees_every_key_of_several_key_holds() {
        let db = SqlDb::Mysql;
        shutdown_frees_every_key(
            db.registry("mode=session").await,
            &db.registry("mode=session").await,
            four_keys("mysql-session-shutdown"),
        )
        .await;
    }
}

/// With `hold_at_least`, a hold of `[a, b]` that finds `b` busy (wait 0)
/// never had a body to keep the keys after: `a`, taken first where the keys
/// go one by one, is free for another process at once.
async fn busy_hold_keeps_nothing_at_least(
    registry: &Registry,
    other: &Registry,
    keys: [String; 2],
) {
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
    let first = other
        .lock(&keys[0])
        .wait(Duration::from_millis(500))
        .acquire()
        .await
        .unwrap_or_else(|e| {
            panic!("the first key stayed held after a busy acquisition with hold_at_least: {e}")
        });
    first.release().await.expect("release");
    elsewhere.release().await.expect("release");
}

/// Two keys in different Redis Cluster hash slots.
fn two_slots_apart(case: &str) -> [String; 2] {
    let key = unique_key(case);
    [format!("{key}:a"), format!("{key}:b")]
}

#[cfg(feature = "redis")]
mod redis_hold_at_least {
    use super::*;
    use dlock_runtime::{RedisBackend, RedlockBackend};
    use dlock_tests::server_url;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_busy_hold_keeps_nothing_at_least() {
        let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
        let registry = || async {
            Registry::builder()
                .default_backend(RedisBackend::connect(&url).await.expect("connect"))
                .build()
        };
        busy_hold_keeps_nothing_at_least(
            &registry().await,
            &registry().await,
            two_keys("redis-at-least"),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_across_slots_busy_hold_keeps_nothing_at_least() {
        let url = server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        let registry = || async {
            Registry::builder()
                .default_backend(RedisBackend::connect(&url).await.expect("connect"))
                .build()
        };
        busy_hold_keeps_nothing_at_least(
            &registry().await,
            &registry().await,
            two_slots_apart("cluster-at-least"),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_busy_hold_keeps_nothing_at_least() {
        let url = server_url(
            "DLOCK_TEST_REDLOCK_URL",
            "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
        );
        let registry = || async {
            Registry::builder()
                .default_backend(RedlockBackend::connect(&url).await.expect("connect"))
                .build()
        };
        busy_hold_keeps_nothing_at_least(
            &registry().await,
            &registry().await,
            two_keys("redlock-at-least"),
        )
        .await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_busy_hold_keeps_nothing_at_least() {
    let db = dlock_tests::sql_db::SqlDb::Postgres;
    busy_hold_keeps_nothing_at_least(
        &db.registry("").await,
        &db.registry("").await,
        two_keys("pg-at-least"),
    )
    .await;
}

/// With `hold_at_least`, a hold of `[a, b]` given up while it waits for `b`
/// (held elsewhere) leaves `a` free for another process at once.
async fn abandoned_hold_keeps_nothing_at_least(
    registry: &Registry,
    other: &Registry,
    keys: [String; 2],
) {
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
    let first = other
        .lock(&keys[0])
        .wait(Duration::from_millis(500))
        .acquire()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the first key stayed held after an abandoned acquisition with hold_at_least: {e}"
            )
        });
    first.release().await.expect("release");
    elsewhere.release().await.expect("release");
}

#[cfg(feature = "redis")]
mod redis_abandoned_at_least {
    use super::*;
    use dlock_runtime::{RedisBackend, RedlockBackend};
    use dlock_tests::server_url;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_across_slots_abandoned_hold_keeps_nothing_at_least() {
        let url = server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        let registry = || async {
            Registry::builder()
                .default_backend(RedisBackend::connect(&url).await.expect("connect"))
                .build()
        };
        abandoned_hold_keeps_nothing_at_least(
            &registry().await,
            &registry().await,
            two_slots_apart("cluster-abandoned-at-least"),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_abandoned_hold_keeps_nothing_at_least() {
        let url = server_url(
            "DLOCK_TEST_REDLOCK_URL",
            "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
        );
        let registry = || async {
            Registry::builder()
                .default_backend(RedlockBackend::connect(&url).await.expect("connect"))
                .build()
        };
        abandoned_hold_keeps_nothing_at_least(
            &registry().await,
            &registry().await,
            two_keys("redlock-abandoned-at-least"),
        )
        .await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_busy_hold_keeps_nothing_at_least() {
    let db = dlock_tests::sql_db::SqlDb::Postgres;
    busy_hold_keeps_nothing_at_least(
        &db.registry("mode=session").await,
        &db.registry("mode=session").await,
        two_keys("pg-session-at-least"),
    )
    .await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_session_busy_hold_keeps_nothing_at_least() {
    let db = dlock_tests::sql_db::SqlDb::Mysql;
    busy_hold_keeps_nothing_at_least(
        &db.registry("mode=session").await,
        &db.registry("mode=session").await,
        two_keys("mysql-session-at-least"),
    )
    .await;
}

/// Without the watchdog (1 s lease), a hold of `[a, b]` that waits 2 s for
/// `b`: `a`, taken first where the keys go one by one, has run out by then
/// and another process took it. The hold must not be granted as if `a` were
/// still its own.
async fn expired_first_key_is_not_granted(
    registry: &Registry,
    other: &Registry,
    keys: [String; 2],
) {
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

#[cfg(feature = "redis")]
mod redis_expired_first_key {
    use super::*;
    use dlock_runtime::{RedisBackend, RedlockBackend};
    use dlock_tests::server_url;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_cluster_across_slots_expired_first_key_is_not_granted() {
        let url = server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        let registry = || async {
            Registry::builder()
                .default_backend(RedisBackend::connect(&url).await.expect("connect"))
                .build()
        };
        expired_first_key_is_not_granted(
            &registry().await,
            &registry().await,
            two_slots_apart("cluster-expired-first"),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_expired_first_key_is_not_granted() {
        let url = server_url(
            "DLOCK_TEST_REDLOCK_URL",
            "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
        );
        let registry = || async {
            Registry::builder()
                .default_backend(RedlockBackend::connect(&url).await.expect("connect"))
                .build()
        };
        expired_first_key_is_not_granted(
            &registry().await,
            &registry().await,
            two_keys("redlock-expired-first"),
        )
        .await;
    }
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

on_each_one_step_backend!(waiter_takes_over_an_expired_holder);

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

on_each_one_step_backend!(tokens_rise_across_grants_and_revocation);
