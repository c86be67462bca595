//! `inspect`, `list`, `revoke` and `max_hold` pushed at their edges on every
//! backend: prefixes with wildcard characters, a prefix equal to a whole key,
//! key order under a limit, non-ASCII keys, expired leases, revocations
//! racing renewals, releases and each other, one key of a several-key hold
//! revoked, the reason a revoked holder is told, and a ceiling under a
//! nested hold and under a minimum hold.
#![cfg(all(
    feature = "sqlite",
    feature = "redis",
    feature = "postgres",
    feature = "mysql",
    feature = "zookeeper",
    feature = "etcd"
))]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dlock_runtime::{LossReason, Registry};
use dlock_tests::sql_db::SqlDb;
use dlock_tests::{server_url, servers_missing, unique_key};

const SECOND: Duration = Duration::from_secs(1);

fn sqlite_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("admin-edges-{}.db", std::process::id()))
    })
}

fn url_of(backend: &str) -> String {
    match backend {
        "memory" => "memory://".to_owned(),
        "sqlite" => SqlDb::Sqlite(sqlite_path()).url(),
        "postgres" => SqlDb::Postgres.url(),
        "postgres_session" => format!("{}?mode=session", SqlDb::Postgres.url()),
        "mysql" => SqlDb::Mysql.url(),
        "mysql_session" => format!("{}?mode=session", SqlDb::Mysql.url()),
        "redis" => server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/"),
        "redis_cluster" => server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        ),
        "redlock" => server_url(
            "DLOCK_TEST_REDLOCK_URL",
            "redlock://127.0.0.1:46379,127.0.0.1:46380,127.0.0.1:46381,127.0.0.1:46382,127.0.0.1:46383",
        ),
        "zookeeper" => dlock_tests::zk_support::url(),
        "etcd" => server_url(
            "DLOCK_TEST_ETCD_URL",
            "etcd://127.0.0.1:42379,127.0.0.1:42389,127.0.0.1:42399/dlock-test",
        ),
        other => panic!("unknown backend {other}"),
    }
}

async fn registry(backend: &str) -> Registry {
    let url = url_of(backend);
    Registry::from_url(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

async fn hold(registry: &Registry, key: &str) -> dlock_runtime::LockGuard {
    registry
        .lock(key)
        .lease(10 * SECOND)
        .wait(10 * SECOND)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("acquire {key:?}: {e}"))
}

async fn listed(registry: &Registry, prefix: &str, limit: usize) -> Vec<String> {
    registry
        .list(prefix, limit)
        .await
        .unwrap_or_else(|e| panic!("list {prefix:?}: {e}"))
        .iter()
        .map(|info| info.key().to_owned())
        .collect()
}

/// A prefix with `%`, `_`, `*`, `?`, `[`, `]`, `\` lists only the keys that
/// start with it literally.
async fn list_takes_wildcards_in_the_prefix_literally(backend: &str) {
    let registry = registry(backend).await;
    let base = unique_key(&format!("wildcards-{backend}"));
    let specials = ["%", "_", "*", "?", "[", "]", "\\", "^", "-"];
    let mut guards = Vec::new();
    for special in specials {
        guards.push(hold(&registry, &format!("{base}:a{special}b")).await);
    }
    guards.push(hold(&registry, &format!("{base}:aXb")).await);
    guards.push(hold(&registry, &format!("{base}:a")).await);
    for special in specials {
        let prefix = format!("{base}:a{special}");
        assert_eq!(
            listed(&registry, &prefix, 100).await,
            vec![format!("{prefix}b")],
            "{backend}: list({prefix:?})"
        );
    }
    for guard in guards {
        guard.release().await.expect("release");
    }
}

/// A prefix equal to a whole key lists that key (and the longer ones),
/// nothing twice, and no bookkeeping beside it.
async fn list_with_a_whole_key_as_prefix_lists_it_once(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("whole-key-prefix-{backend}"));
    let guard = hold(&registry, &key).await;
    assert_eq!(
        listed(&registry, &key, 100).await,
        vec![key.clone()],
        "{backend}"
    );
    guard.release().await.expect("release");
    assert_eq!(
        listed(&registry, &key, 100).await,
        Vec::<String>::new(),
        "{backend}: after the release"
    );
}

/// `list` answers in key order (bytewise), so a limit keeps the first keys:
/// `p` before `p:x` before `p~`.
async fn list_answers_in_key_order_under_a_limit(backend: &str) {
    let registry = registry(backend).await;
    let base = unique_key(&format!("order-{backend}"));
    let keys = [
        base.clone(),
        format!("{base}!"),
        format!("{base}:x"),
        format!("{base}~"),
    ];
    let mut guards = Vec::new();
    for key in keys.iter().rev() {
        guards.push(hold(&registry, key).await);
    }
    assert_eq!(
        listed(&registry, &base, 100).await,
        keys.to_vec(),
        "{backend}: every key"
    );
    assert_eq!(
        listed(&registry, &base, 1).await,
        vec![keys[0].clone()],
        "{backend}: limit 1"
    );
    assert_eq!(
        listed(&registry, &base, 2).await,
        keys[..2].to_vec(),
        "{backend}: limit 2"
    );
    for guard in guards {
        guard.release().await.expect("release");
    }
}

/// The largest limits (`usize::MAX`, and past `i64::MAX`) list every
/// held key; a limit of 0 lists none.
async fn list_takes_any_limit(backend: &str) {
    let registry = registry(backend).await;
    let base = unique_key(&format!("limits-{backend}"));
    let guard = hold(&registry, &format!("{base}:a")).await;
    for limit in [usize::MAX, i64::MAX as usize + 1, u32::MAX as usize + 1] {
        assert_eq!(
            listed(&registry, &base, limit).await,
            vec![format!("{base}:a")],
            "{backend}: limit {limit}"
        );
    }
    assert_eq!(
        listed(&registry, &base, 0).await,
        Vec::<String>::new(),
        "{backend}: limit 0"
    );
    guard.release().await.expect("release");
}

/// Keys with non-ASCII characters are inspected, listed (also by a
/// non-ASCII prefix) and revoked under the key they were locked with.
async fn non_ascii_keys_read_back_as_locked(backend: &str) {
    let registry = registry(backend).await;
    let base = unique_key(&format!("unicode-{backend}"));
    let keys = [
        format!("{base}:é/ü"),
        format!("{base}:日本語"),
        format!("{base}:😀%2F"),
    ];
    let mut guards = Vec::new();
    for key in &keys {
        guards.push(hold(&registry, key).await);
    }
    let mut sorted = keys.to_vec();
    sorted.sort();
    assert_eq!(listed(&registry, &base, 100).await, sorted, "{backend}");
    for key in &keys {
        let info = registry
            .inspect(key)
            .await
            .expect("inspect")
            .unwrap_or_else(|| panic!("{backend}: {key} is held"));
        assert_eq!(info.key(), key, "{backend}");
    }
    assert_eq!(
        listed(&registry, &format!("{base}:日"), 100).await,
        vec![keys[1].clone()],
        "{backend}: a non-ASCII prefix"
    );
    let revoked = registry.revoke(&keys[2]).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{backend}: {revoked:?}");
    for guard in guards {
        let _ = guard.release().await;
    }
}

/// A lease that ran out without a renewal (its guard still alive, the
/// watchdog off) is shown neither by `inspect` nor by `list`, and revoking
/// it revokes nobody.
async fn expired_leases_are_not_shown_as_held(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("expired-{backend}"));
    let guard = registry
        .lock(&key)
        .lease(SECOND)
        .watchdog(false)
        .acquire()
        .await
        .expect("acquire");
    tokio::time::sleep(3 * SECOND).await;
    assert!(
        registry.inspect(&key).await.expect("inspect").is_none(),
        "{backend}: an expired lease is shown held"
    );
    assert_eq!(
        listed(&registry, &key, 10).await,
        Vec::<String>::new(),
        "{backend}: an expired lease is listed"
    );
    let revoked = registry.revoke(&key).await.expect("revoke");
    assert!(revoked.is_empty(), "{backend}: {revoked:?}");
    drop(guard);
}

/// Revocations at every point of the renewal cycle: the holder is told it
/// lost the key, the key stays free (no renewal in flight
/// brings it back), and the next token is larger than the revoked one.
async fn revocations_racing_renewals_leave_the_key_free(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("revoke-renewal-{backend}"));
    let mut last_token = None;
    for round in 0..6u64 {
        let guard = registry
            .lock(&key)
            .lease(dlock_runtime::MIN_LEASE * 3)
            .wait(10 * SECOND)
            .acquire()
            .await
            .expect("acquire");
        let token = guard.fencing_token();
        if let (Some(before), Some(now)) = (last_token, token) {
            assert!(
                now > before,
                "{backend} round {round}: {now:?} after {before:?}"
            );
        }
        last_token = token;
        tokio::time::sleep(Duration::from_millis(37 * round)).await;
        let revoked = registry.revoke(&key).await.expect("revoke");
        assert_eq!(revoked.len(), 1, "{backend} round {round}: {revoked:?}");
        if let (Some(revoked), Some(held)) = (revoked[0].token(), token) {
            assert_eq!(revoked, held, "{backend} round {round}");
        }
        tokio::time::timeout(5 * SECOND, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{backend} round {round}: the holder is never told"));
        tokio::time::sleep(dlock_runtime::MIN_LEASE * 4).await;
        assert!(
            registry.inspect(&key).await.expect("inspect").is_none(),
            "{backend} round {round}: the revoked lease came back"
        );
        assert!(guard.release().await.is_err(), "{backend} round {round}");
    }
}

/// A revocation racing the holder's release: both succeed or report
/// cleanly, and the key is free afterwards for the next holder, whose
/// token is larger.
async fn a_revocation_racing_a_release_leaves_the_key_free(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("revoke-release-{backend}"));
    for round in 0..40 {
        let guard = hold(&registry, &key).await;
        let token = guard.fencing_token();
        let revoke = registry.revoke(&key);
        let release = guard.release();
        let (revoked, _released) = tokio::join!(revoke, release);
        let revoked = revoked.expect("revoke");
        assert!(revoked.len() <= 1, "{backend} round {round}: {revoked:?}");
        let next = registry
            .lock(&key)
            .wait(5 * SECOND)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{backend} round {round}: the key stays taken: {e}"));
        if let (Some(before), Some(now)) = (token, next.fencing_token()) {
            assert!(now > before, "{backend} round {round}");
        }
        next.release().await.expect("release");
    }
}

/// `inspect` and `list` while the key is taken and released again and
/// again: each answers (held or free), never an error.
async fn admin_reads_racing_grants_and_releases_never_fail(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("churn-{backend}"));
    let churn_registry = registry.clone();
    let churn_key = key.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let churn = tokio::spawn(async move {
        let mut rounds = 0u32;
        while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(guard) = churn_registry
                .lock(&churn_key)
                .lease(10 * SECOND)
                .wait(SECOND)
                .acquire()
                .await
            {
                let _ = guard.release().await;
                rounds += 1;
            }
        }
        rounds
    });
    let started = Instant::now();
    let mut calls = 0u32;
    while started.elapsed() < 4 * SECOND {
        registry
            .inspect(&key)
            .await
            .unwrap_or_else(|e| panic!("{backend}: inspect after {calls} calls: {e:?}"));
        registry
            .list(&key, 10)
            .await
            .unwrap_or_else(|e| panic!("{backend}: list after {calls} calls: {e:?}"));
        calls += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = churn.await.expect("the churning task");
    assert!(rounds > 0, "{backend}: the key was never taken");
}

/// Two revocations at once take the key from its holder once: together
/// they name the holder once, and the next holder is left alone.
async fn two_revocations_at_once_revoke_the_holder_once(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("two-revokes-{backend}"));
    let guard = hold(&registry, &key).await;
    let (a, b) = tokio::join!(registry.revoke(&key), registry.revoke(&key));
    let (a, b) = (a.expect("revoke"), b.expect("revoke"));
    assert_eq!(a.len() + b.len(), 1, "{backend}: {a:?} {b:?}");
    tokio::time::timeout(10 * SECOND, guard.lost())
        .await
        .unwrap_or_else(|_| panic!("{backend}: the holder is never told"));
    let next = registry
        .lock(&key)
        .wait(5 * SECOND)
        .acquire()
        .await
        .expect("the next holder");
    let info = registry
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.holders()[0].token(), next.fencing_token(), "{backend}");
    next.release().await.expect("release");
}

/// Revoking one key of a several-key hold loses the whole hold (its
/// `lost()` fires); the other keys stay held until its release frees them.
async fn revoking_one_key_of_several_loses_the_hold(backend: &str) {
    let registry = registry(backend).await;
    let base = unique_key(&format!("several-{backend}"));
    let keys = [
        format!("{base}:a"),
        format!("{base}:b"),
        format!("{base}:c"),
    ];
    let guard = registry
        .lock_all(keys.clone())
        .lease(2 * SECOND)
        .wait(10 * SECOND)
        .acquire()
        .await
        .expect("acquire all");
    let revoked = registry.revoke(&keys[1]).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{backend}: {revoked:?}");
    tokio::time::timeout(5 * SECOND, guard.lost())
        .await
        .unwrap_or_else(|_| panic!("{backend}: the hold is never told"));
    assert!(guard.is_lost(), "{backend}");
    assert_eq!(
        listed(&registry, &base, 10).await,
        vec![keys[0].clone(), keys[2].clone()],
        "{backend}"
    );
    assert!(guard.release().await.is_err(), "{backend}");
    assert_eq!(
        listed(&registry, &base, 10).await,
        Vec::<String>::new(),
        "{backend}: after the release"
    );
}

/// Revoking one key takes only that key: the same process's other holds
/// (through the same registry, so the same connections and sessions) stay
/// held and are not signalled lost.
async fn revoking_one_key_leaves_the_holders_other_keys_held(backend: &str) {
    let registry = registry(backend).await;
    let base = unique_key(&format!("neighbours-{backend}"));
    let revoked_key = format!("{base}:revoked");
    let kept_key = format!("{base}:kept");
    let kept = registry
        .lock(&kept_key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire the kept key");
    let target = registry
        .lock(&revoked_key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire the revoked key");
    let revoked = registry.revoke(&revoked_key).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{backend}: {revoked:?}");
    tokio::time::timeout(5 * SECOND, target.lost())
        .await
        .unwrap_or_else(|_| panic!("{backend}: the revoked holder is never told"));
    tokio::time::sleep(3 * SECOND).await;
    assert!(
        !kept.is_lost(),
        "{backend}: the other key was lost too: {:?}",
        kept.loss_reason()
    );
    let info = registry
        .inspect(&kept_key)
        .await
        .expect("inspect")
        .unwrap_or_else(|| panic!("{backend}: the other key is free"));
    assert_eq!(info.holders()[0].token(), kept.fencing_token(), "{backend}");
    kept.release()
        .await
        .expect("the other key releases cleanly");
    let _ = target.release().await;
}

/// A revocation while another task waits for the key: `inspect` counts
/// the waiter where the backend knows waiters, and the waiter gets the key
/// soon after the revocation, not at the end of the revoked lease.
async fn a_revocation_hands_the_key_to_a_waiter_promptly(backend: &str) {
    let holder = registry(backend).await;
    // One registry: `memory://` opens a new store per registry.
    let waiter = holder.clone();
    let key = unique_key(&format!("waiter-{backend}"));
    let guard = holder
        .lock(&key)
        .lease(30 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let waiting_key = key.clone();
    let waiting = tokio::spawn(async move {
        let next = waiter
            .lock(&waiting_key)
            .lease(10 * SECOND)
            .wait(25 * SECOND)
            .acquire()
            .await;
        (Instant::now(), next)
    });
    tokio::time::sleep(2 * SECOND).await;
    let info = holder.inspect(&key).await.expect("inspect").expect("held");
    if let Some(waiters) = info.waiters() {
        assert_eq!(waiters, 1, "{backend}: {info:?}");
    }
    let revoked_at = Instant::now();
    let revoked = holder.revoke(&key).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{backend}: {revoked:?}");
    let (granted_at, next) = waiting.await.expect("the waiter's task");
    let next = next.unwrap_or_else(|e| panic!("{backend}: the waiter never gets the key: {e}"));
    let took = granted_at - revoked_at;
    assert!(
        took < 5 * SECOND,
        "{backend}: the waiter got the key {took:?} after the revocation"
    );
    if let (Some(before), Some(now)) = (guard.fencing_token(), next.fencing_token()) {
        assert!(now > before, "{backend}");
    }
    next.release().await.expect("release");
    let _ = guard.release().await;
}

/// A revoked holder's loss is reported with the reason `Revoked`, not as
/// an expiry or an ended session.
async fn a_revoked_holder_is_told_the_reason_revoked(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("revoked-reason-{backend}"));
    let guard = registry
        .lock(&key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let revoked = registry.revoke(&key).await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{backend}: {revoked:?}");
    tokio::time::timeout(5 * SECOND, guard.lost())
        .await
        .unwrap_or_else(|_| panic!("{backend}: the holder is never told"));
    assert_eq!(guard.loss_reason(), Some(LossReason::Revoked), "{backend}");
}

/// A hold nested in a hold with a ceiling keeps the outer ceiling: both
/// are lost at it, with the reason `MaxHold`, and the key is free soon
/// after.
async fn a_nested_hold_keeps_the_outer_ceiling(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("ceiling-nested-{backend}"));
    let outer = registry
        .lock(&key)
        .lease(SECOND)
        .max_hold(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let started = Instant::now();
    let inner_registry = registry.clone();
    let inner_key = key.clone();
    let inner_reason = outer
        .scope(async move {
            let inner = inner_registry
                .lock(&inner_key)
                .lease(30 * SECOND)
                .acquire()
                .await
                .expect("nested acquire");
            tokio::time::timeout(10 * SECOND, inner.lost())
                .await
                .expect("the nested hold is lost at the outer ceiling");
            let reason = inner.loss_reason();
            let _ = inner.release().await;
            reason
        })
        .await;
    assert!(
        started.elapsed() < 6 * SECOND,
        "{backend}: {:?}",
        started.elapsed()
    );
    assert_eq!(inner_reason, Some(LossReason::MaxHold), "{backend}");
    assert!(outer.is_lost(), "{backend}");
    assert_eq!(outer.loss_reason(), Some(LossReason::MaxHold), "{backend}");
    let _ = outer.release().await;
    assert!(
        registry.inspect(&key).await.expect("inspect").is_none(),
        "{backend}: held after the release"
    );
}

/// A hold that reached its ceiling is lost: releasing it afterwards with
/// `hold_at_least` reports the loss and does not extend the lease again,
/// so the key is free within one lease of the ceiling.
async fn a_minimum_hold_does_not_extend_a_hold_past_its_ceiling(backend: &str) {
    let registry = registry(backend).await;
    let key = unique_key(&format!("ceiling-minimum-{backend}"));
    let guard = registry
        .lock(&key)
        .lease(SECOND)
        .max_hold(2 * SECOND)
        .hold_at_least(20 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    tokio::time::timeout(8 * SECOND, guard.lost())
        .await
        .unwrap_or_else(|_| panic!("{backend}: not lost at the ceiling"));
    let lost_at = Instant::now();
    assert_eq!(guard.loss_reason(), Some(LossReason::MaxHold), "{backend}");
    assert!(
        guard.release().await.is_err(),
        "{backend}: the release after the ceiling"
    );
    let next = registry
        .lock(&key)
        .wait(15 * SECOND)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{backend}: the key outlives its ceiling: {e}"));
    assert!(
        lost_at.elapsed() < 4 * SECOND,
        "{backend}: the key was free only {:?} after the ceiling",
        lost_at.elapsed()
    );
    next.release().await.expect("release");
}

macro_rules! backend_tests {
    ($attack:ident; $($backend:ident),*) => {
        mod $attack {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $backend() {
                    super::$attack(stringify!($backend)).await;
                }
            )*
        }
    };
}

macro_rules! on_every_backend {
    ($($attack:ident),* $(,)?) => {
        $(
            backend_tests!(
                $attack;
                memory,
                sqlite,
                postgres,
                postgres_session,
                mysql,
                mysql_session,
                redis,
                redis_cluster,
                redlock,
                zookeeper,
                etcd
            );
        )*
    };
}

on_every_backend!(
    list_takes_wildcards_in_the_prefix_literally,
    list_with_a_whole_key_as_prefix_lists_it_once,
    list_answers_in_key_order_under_a_limit,
    list_takes_any_limit,
    non_ascii_keys_read_back_as_locked,
    expired_leases_are_not_shown_as_held,
    revocations_racing_renewals_leave_the_key_free,
    a_revocation_racing_a_release_leaves_the_key_free,
    admin_reads_racing_grants_and_releases_never_fail,
    revoking_one_key_of_several_loses_the_hold,
    revoking_one_key_leaves_the_holders_other_keys_held,
    a_revocation_hands_the_key_to_a_waiter_promptly,
    a_nested_hold_keeps_the_outer_ceiling,
    a_minimum_hold_does_not_extend_a_hold_past_its_ceiling,
    two_revocations_at_once_revoke_the_holder_once,
    a_revoked_holder_is_told_the_reason_revoked,
);
