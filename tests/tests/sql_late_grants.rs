//! Lease mode on PostgreSQL and MySQL: a caller that gives up while its
//! acquire statement is on its way to the server, from a runtime of its own
//! that then stops running (it is left idle, or it is shut down). Whatever
//! the late acquire is granted is released — after the statement it undoes,
//! or at the latest by the runtime's backstop from dlock's own runtime —
//! never left to the gone caller for its whole lease.
#![cfg(any(feature = "postgres", feature = "mysql"))]

use std::time::{Duration, Instant};

use dlock_runtime::Registry;
use dlock_tests::sql_db::SqlDb;
use dlock_tests::sql_support::{Fault, Proxy, SqlMode, proxy_to};
use dlock_tests::unique_key;

/// How long the proxy holds the acquire statement back.
const HELD_BACK: Duration = Duration::from_millis(800);

/// How long the caller waits before it gives up.
const GIVES_UP_AFTER: Duration = Duration::from_millis(200);

/// The lease the gone caller asked for: far longer than any release path.
const LEASE: Duration = Duration::from_secs(60);

/// A runtime of the test's own (proxy, server checks), and a registry going
/// through a proxy it runs.
fn through_a_proxy(db: SqlDb) -> (tokio::runtime::Runtime, Proxy, Registry) {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (proxy, registry) = main.block_on(async {
        let proxy = proxy_to(&db.host_port()).await;
        let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
        let registry = db.connect_url(&url).await.expect("connect").registry();
        (proxy, registry)
    });
    (main, proxy, registry)
}

/// A caller's runtime whose own pool is open and whose statements are
/// prepared: the held-back acquire is one chunk carrying its key, sent on a
/// connection of this runtime.
fn a_warm_caller_runtime(registry: &Registry, case: &str) -> tokio::runtime::Runtime {
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    caller.block_on(async {
        for i in 0..10 {
            let warm = unique_key(&format!("{case}-warm-{i}"));
            let g = registry.lock(&warm).acquire().await.expect("warm up");
            g.release().await.expect("release");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    caller
}

/// The caller gives up on `key` (held back by the proxy) from `caller`.
fn gives_up(caller: &tokio::runtime::Runtime, registry: &Registry, proxy: &Proxy, key: &str) {
    proxy.hold_next(&[key.as_bytes()], HELD_BACK);
    let gave_up = caller.block_on(async {
        tokio::time::timeout(GIVES_UP_AFTER, registry.lock(key).lease(LEASE).acquire()).await
    });
    assert!(gave_up.is_err(), "the caller gave up before the answer");
    assert!(proxy.held_on().is_some(), "the acquire was held back");
}

/// When, after the caller left, the key was first and last seen held within
/// `watch`.
fn held_window(
    main: &tokio::runtime::Runtime,
    db: SqlDb,
    stored: &str,
    watch: Duration,
) -> Option<(Duration, Duration)> {
    let faults = db.faults(SqlMode::Lease);
    main.block_on(async {
        let left = Instant::now();
        let mut held: Option<(Duration, Duration)> = None;
        while left.elapsed() < watch {
            if faults.is_held(stored).await {
                let at = left.elapsed();
                held = Some(held.map_or((at, at), |(first, _)| (first, at)));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        held
    })
}

/// The caller's runtime stays alive but idle once its `block_on` returned
/// (a synchronous program that enters its runtime per request): nothing
/// that was spawned there runs. The late grant must still be released by
/// the backstop from dlock's runtime (3 s after the caller left, bounded by
/// the 3 s call timeout): the key is free 8 s after the caller left.
fn a_late_grant_is_released_while_the_callers_runtime_is_idle(db: SqlDb) {
    let (main, proxy, registry) = through_a_proxy(db);
    let caller = a_warm_caller_runtime(&registry, "late-grant-idle-runtime");
    let key = unique_key("late-grant-idle-runtime");
    let stored = format!("{}{key}", registry.key_prefix());
    gives_up(&caller, &registry, &proxy, &key);
    let held = held_window(&main, db, &stored, Duration::from_secs(8));
    if let Some((first, last)) = held {
        assert!(
            last < Duration::from_secs(7),
            "{db:?}: the late grant (first seen held {first:?} after the caller left) was \
             still held {last:?} after the caller left, while the caller's runtime is idle"
        );
    }
    drop(caller);
    drop(proxy);
    drop(main);
}

/// The caller's runtime is shut down right after its caller gave up: the
/// connection of the dropped acquire closes with it, so nothing can tell
/// when the server is done with that statement, and no release can be
/// ordered after it. The backstop from dlock's runtime (3 s after the caller
/// left, past the call timeout) releases the late grant: the key is free 7 s
/// after the caller left.
fn a_late_grant_is_released_by_the_backstop_after_the_callers_runtime_shut_down(db: SqlDb) {
    let (main, proxy, registry) = through_a_proxy(db);
    let caller = a_warm_caller_runtime(&registry, "late-grant-runtime-shut-down");
    let key = unique_key("late-grant-runtime-shut-down");
    let stored = format!("{}{key}", registry.key_prefix());
    gives_up(&caller, &registry, &proxy, &key);
    drop(caller);
    let held = held_window(&main, db, &stored, Duration::from_secs(8));
    if let Some((first, last)) = held {
        assert!(
            last < Duration::from_secs(7),
            "{db:?}: the late grant was held from {first:?} to {last:?} after the caller left \
             (its runtime shut down)"
        );
    }
    drop(proxy);
    drop(main);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_a_late_grant_is_released_while_the_callers_runtime_is_idle() {
    a_late_grant_is_released_while_the_callers_runtime_is_idle(SqlDb::Postgres);
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_a_late_grant_is_released_while_the_callers_runtime_is_idle() {
    a_late_grant_is_released_while_the_callers_runtime_is_idle(SqlDb::Mysql);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_a_late_grant_is_released_by_the_backstop_after_the_callers_runtime_shut_down() {
    a_late_grant_is_released_by_the_backstop_after_the_callers_runtime_shut_down(SqlDb::Postgres);
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_a_late_grant_is_released_by_the_backstop_after_the_callers_runtime_shut_down() {
    a_late_grant_is_released_by_the_backstop_after_the_callers_runtime_shut_down(SqlDb::Mysql);
}

/// How many callers hang up at once in [`a_storm_of_hang_ups_leaves_no_key_held`].
const CALLERS: usize = 200;

/// How long after the storm every key must be free again: far below
/// [`LEASE`], so only the hang-ups' clean-ups can have freed them.
const CLEAN_UP_BOUND: Duration = Duration::from_secs(15);

/// Many callers hang up at once, at random moments of their acquisition
/// (before the statement went out, while it runs, after it was answered) or
/// of their release. Soon after the storm (well within the lease) no key is held, and every
/// key can be taken at once: the drained connections went back to the pool
/// in a state the next caller can use. Each chunk takes a few milliseconds
/// through a proxy, so most hang-ups come while a statement runs.
async fn a_storm_of_hang_ups_leaves_no_key_held(db: SqlDb) {
    let proxy = proxy_to(&db.host_port()).await;
    let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
    let registry = db.connect_url(&url).await.expect("connect").registry();
    proxy.set(Fault::Delay(Duration::from_millis(3)));
    let faults = db.faults(SqlMode::Lease);
    let keys: Vec<String> = (0..CALLERS)
        .map(|i| unique_key(&format!("hang-up-storm-{i}")))
        .collect();
    let callers = keys.iter().map(|key| {
        let registry = registry.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let patience = Duration::from_micros(rand::random_range(0..20_000));
            let acquired =
                tokio::time::timeout(patience, registry.lock(&key).lease(LEASE).acquire()).await;
            if let Ok(Ok(guard)) = acquired {
                let patience = Duration::from_micros(rand::random_range(0..10_000));
                let _ = tokio::time::timeout(patience, guard.release()).await;
            }
        })
    });
    for caller in futures_util::future::join_all(callers).await {
        caller.expect("a caller panicked");
    }
    proxy.set(Fault::Pass);
    // Every late grant is released by the clean-up of its caller's hang-up,
    // not by its 60 s lease: the bound is generous for a loaded machine (the
    // clean-ups queue for the pool's connections) and far below the lease.
    let storm_ended = Instant::now();
    let mut held: Vec<String> = keys.clone();
    while !held.is_empty() {
        let mut still = Vec::new();
        for key in &held {
            if faults
                .is_held(&format!("{}{key}", registry.key_prefix()))
                .await
            {
                still.push(key.clone());
            }
        }
        held = still;
        if held.is_empty() || storm_ended.elapsed() > CLEAN_UP_BOUND {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        held.is_empty(),
        "{db:?}: {} of {CALLERS} keys still held {:?} after their callers hung up \
         (their lease is {LEASE:?}): {:?}",
        held.len(),
        storm_ended.elapsed(),
        &held[..held.len().min(5)]
    );
    let started = Instant::now();
    for key in &keys {
        let guard = registry
            .lock(key)
            .wait(Duration::ZERO)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{db:?}: {key} after the storm: {e}"));
        guard.release().await.expect("release");
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{db:?}: taking and releasing {CALLERS} free keys took {:?}",
        started.elapsed()
    );
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_storm_of_hang_ups_leaves_no_key_held() {
    a_storm_of_hang_ups_leaves_no_key_held(SqlDb::Postgres).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_storm_of_hang_ups_leaves_no_key_held() {
    a_storm_of_hang_ups_leaves_no_key_held(SqlDb::Mysql).await;
}

/// A caller's runtime whose own pool is not open yet: its first acquisition
/// goes to dlock's I/O runtime. Given up while the acquire is held back, the
/// late grant is released within a round trip, as on the caller's own pool:
/// the clean-up release, sent from the caller's runtime at once (which goes
/// on running), goes out after the acquire it undoes, however the two
/// runtimes' threads are scheduled (several rounds, each a fresh runtime).
fn a_late_grant_on_dlocks_runtime_is_released_within_a_round_trip(db: SqlDb) {
    let (main, proxy, registry) = through_a_proxy(db);
    let fresh = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    };
    // The I/O runtime's connections open and their statements prepared.
    for i in 0..6 {
        let warm = unique_key(&format!("late-grant-hop-warm-{i}"));
        fresh().block_on(async {
            let g = registry.lock(&warm).acquire().await.expect("warm up");
            g.release().await.expect("release");
        });
    }
    for round in 0..8 {
        let key = unique_key(&format!("late-grant-hop-{round}"));
        let stored = format!("{}{key}", registry.key_prefix());
        let caller = fresh();
        proxy.hold_next(&[key.as_bytes()], HELD_BACK);
        let watch = Duration::from_millis(3500);
        let held = std::thread::scope(|s| {
            s.spawn(|| {
                caller.block_on(async {
                    let gave_up = tokio::time::timeout(
                        GIVES_UP_AFTER,
                        registry.lock(&key).lease(LEASE).acquire(),
                    )
                    .await;
                    assert!(gave_up.is_err(), "the caller gave up before the answer");
                    // The caller's runtime goes on running.
                    tokio::time::sleep(watch).await;
                });
            });
            std::thread::sleep(GIVES_UP_AFTER);
            held_window(&main, db, &stored, watch)
        });
        assert!(proxy.held_on().is_some(), "the acquire was held back");
        if let Some((first, last)) = held {
            assert!(
                last - first < Duration::from_secs(1),
                "{db:?}, round {round}: the late grant was held from {first:?} to {last:?} \
                 after the caller left"
            );
        }
        drop(caller);
    }
    drop(proxy);
    drop(main);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_a_late_grant_on_dlocks_runtime_is_released_within_a_round_trip() {
    a_late_grant_on_dlocks_runtime_is_released_within_a_round_trip(SqlDb::Postgres);
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_a_late_grant_on_dlocks_runtime_is_released_within_a_round_trip() {
    a_late_grant_on_dlocks_runtime_is_released_within_a_round_trip(SqlDb::Mysql);
}

/// Shutdown stops an acquisition whose acquire is held back on its way to
/// the server. Once shutdown has returned with nothing unfinished, the key
/// is not held — not even by the late acquire it stopped.
async fn shutdown_leaves_no_late_grant_of_an_acquisition_it_stopped(db: SqlDb) {
    let proxy = proxy_to(&db.host_port()).await;
    let url = db.url().replace(&db.host_port(), &proxy.addr().to_string());
    let registry = db.connect_url(&url).await.expect("connect").registry();
    let faults = db.faults(SqlMode::Lease);
    for i in 0..3 {
        let warm = unique_key(&format!("shutdown-late-grant-warm-{i}"));
        let g = registry.lock(&warm).acquire().await.expect("warm up");
        g.release().await.expect("release");
    }
    let key = unique_key("shutdown-late-grant");
    let stored = format!("{}{key}", registry.key_prefix());
    proxy.hold_next(&[key.as_bytes()], HELD_BACK);
    let waiting = tokio::spawn({
        let (registry, key) = (registry.clone(), key.clone());
        async move { registry.lock(&key).lease(LEASE).acquire().await.map(drop) }
    });
    tokio::time::sleep(GIVES_UP_AFTER).await;
    assert!(proxy.held_on().is_some(), "the acquire was held back");
    let report = registry.shutdown(Duration::from_secs(10)).await;
    assert_eq!(report.unfinished, 0, "{db:?}: shutdown finished everything");
    assert!(
        waiting.await.expect("the acquisition").is_err(),
        "shutdown stopped the acquisition"
    );
    let returned = Instant::now();
    while returned.elapsed() < Duration::from_millis(1500) {
        assert!(
            !faults.is_held(&stored).await,
            "{db:?}: the key is held {:?} after shutdown returned",
            returned.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_shutdown_leaves_no_late_grant_of_an_acquisition_it_stopped() {
    shutdown_leaves_no_late_grant_of_an_acquisition_it_stopped(SqlDb::Postgres).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_shutdown_leaves_no_late_grant_of_an_acquisition_it_stopped() {
    shutdown_leaves_no_late_grant_of_an_acquisition_it_stopped(SqlDb::Mysql).await;
}
