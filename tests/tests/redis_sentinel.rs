//! Redis behind Sentinel (`redis+sentinel://`): the conformance suite on the
//! primary the sentinels name, and failovers while keys are held and waited
//! for (`SENTINEL FAILOVER`, and a SIGKILL of the primary).
//!
//! The tests that fail over hold a write lock for their whole run and the
//! others a read lock, so that no other test of this binary sees a failover;
//! each one that fails over leaves the set-up healthy (the sentinels agree
//! on a primary, whose replica is linked).
#![cfg(feature = "redis")]

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, RedisBackend, Registry};
use dlock_tests::redis_support::{RestartRedisOnDrop, sigkill_redis};
use dlock_tests::sentinel_support::{
    HOST, NAME, connection, named_by, primary_port, sentinel_ports, url, wait_healthy,
};
use dlock_tests::{Faults, Harness, servers_missing, unique_key};
use futures_util::future::BoxFuture;
use redis::aio::MultiplexedConnection;
use tokio::sync::{OnceCell, OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// Waits until every sentinel names a primary other than `old` and answers it.
async fn wait_moved_from(old: u16) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut named = Vec::new();
        for sentinel in sentinel_ports() {
            named.push(named_by(sentinel).await);
        }
        if let Some(Some(new)) = named.first()
            && *new != old
            && named.iter().all(|n| *n == Some(*new))
        {
            return *new;
        }
        assert!(
            Instant::now() < deadline,
            "the sentinels did not move the primary from {old} within 30 s: {named:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Server-side access to the primary the sentinels name now.
struct SentinelFaults;

impl SentinelFaults {
    async fn primary() -> MultiplexedConnection {
        let port = primary_port().await;
        connection(port)
            .await
            .unwrap_or_else(|e| servers_missing(&url(), e))
    }

    /// Whether `{stored}` has an unexpired lease on the primary now.
    async fn held_on_primary(stored: &str) -> bool {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(format!("{{{stored}}}"))
            .query_async(&mut Self::primary().await)
            .await
            .expect("PTTL");
        ttl > 0
    }
}

impl Faults for SentinelFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let _: i64 = redis::cmd("DEL")
                .arg(format!("{{{stored_key}}}"))
                .query_async(&mut Self::primary().await)
                .await
                .expect("DEL");
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(Self::held_on_primary(stored_key))
    }
}

/// Failovers and every other test of this binary exclude each other.
static FAILOVERS: std::sync::LazyLock<Arc<RwLock<()>>> =
    std::sync::LazyLock::new(|| Arc::new(RwLock::new(())));

thread_local! {
    /// The read lock of the test running on this thread (libtest runs each
    /// test on a thread of its own, and the lock ends with the thread).
    static NO_FAILOVER: RefCell<Option<OwnedRwLockReadGuard<()>>> = const { RefCell::new(None) };
}

/// Holds the read lock until the test's thread ends.
async fn no_failover_during_this_test() {
    // A test before this one on the same thread (one test thread) lets go.
    NO_FAILOVER.with(|g| g.borrow_mut().take());
    let guard = FAILOVERS.clone().read_owned().await;
    NO_FAILOVER.with(|g| *g.borrow_mut() = Some(guard));
}

/// Takes the write lock: no other test of this binary runs meanwhile.
async fn exclusive() -> OwnedRwLockWriteGuard<()> {
    NO_FAILOVER.with(|g| g.borrow_mut().take());
    FAILOVERS.clone().write_owned().await
}

async fn harness() -> &'static Harness {
    no_failover_during_this_test().await;
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            let url = url();
            let backend = RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| servers_missing(&url, e));
            dlock_runtime::init(Registry::builder().default_backend(backend).build())
                .expect("first init");
            Harness {
                faults: Arc::new(SentinelFaults),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

/// A backend of its own: what another process would have.
async fn other_process(url: &str) -> Registry {
    Registry::builder()
        .default_backend(
            RedisBackend::connect(url)
                .await
                .unwrap_or_else(|e| servers_missing(url, e)),
        )
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_of_another_connection_at_once() {
    harness().await;
    let (holder, waiter) = (other_process(&url()).await, other_process(&url()).await);
    let handoffs = dlock_tests::handoff::measure(
        &holder,
        &waiter,
        &unique_key("sentinel-handoff"),
        5,
        Duration::from_millis(100),
    )
    .await;
    // The holder's lease was 30 s: only the release message can explain this.
    assert!(
        handoffs.median() < Duration::from_millis(1000),
        "median handoff {:?} (all: {handoffs:?})",
        handoffs.median()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_wait_for_the_followed_primarys_replica() {
    harness().await;
    let acknowledged = other_process(&format!("{}?replicas=1", url())).await;
    let guard = acknowledged
        .lock(unique_key("sentinel-replicas"))
        .acquire()
        .await
        .expect("one replica acknowledges");
    assert!(guard.fencing_token().is_some());
    guard.release().await.expect("release");
    // The set-up has one replica: two never acknowledge, and the grant is
    // undone and tried again until the wait runs out.
    let too_many = other_process(&format!("{}?replicas=2&timeout=400ms", url())).await;
    let key = unique_key("sentinel-replicas-2");
    let started = Instant::now();
    let refused = too_many
        .lock(&key)
        .wait(Duration::from_secs(1))
        .acquire()
        .await;
    match refused {
        Err(LockError::Backend { source, .. }) => {
            assert!(source.to_string().contains("replicas"), "{source}")
        }
        other => panic!("expected the replicas' error, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(!SentinelFaults.is_held(&format!("dlock:{key}")).await);
}

#[tokio::test]
async fn sentinels_that_are_all_down_are_an_error_within_the_timeout() {
    for url in [
        "redis+sentinel://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/dlock?timeout=500ms",
        // Reachable but answering nothing: bounded by the timeout, not the OS.
        "redis+sentinel://10.255.255.1:26379/dlock?timeout=500ms",
    ] {
        let started = Instant::now();
        let result = dlock_runtime::connect(url).await;
        let Err(err) = result else {
            panic!("{url}: connected to nothing")
        };
        assert!(
            matches!(err, LockError::Backend { .. }) && err.is_retryable(),
            "{url}: {err:?}"
        );
        assert!(err.to_string().contains("sentinel"), "{url}: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{url}: {:?}",
            started.elapsed()
        );
    }
}

#[tokio::test]
async fn a_primary_the_sentinels_do_not_know_is_a_clear_error() {
    let url = url().replace("/dlock", "/no-such-primary");
    let err = RedisBackend::connect(&url).await.expect_err("unknown name");
    let shown = err.to_string();
    assert!(shown.contains("does not know `no-such-primary`"), "{shown}");
}

#[tokio::test]
async fn bad_sentinel_urls_are_config_errors_without_their_secrets() {
    for url in [
        // No primary name.
        "redis+sentinel://u:hunter2@127.0.0.1:46411,127.0.0.1:46412/",
        "redis+sentinel://u:hunter2@127.0.0.1:46411?sentinel_password=s3cret",
        // A sentinel without a port.
        "redis+sentinel://u:hunter2@127.0.0.1/dlock?sentinel_password=s3cret",
        "redis+sentinel://127.0.0.1:46411/dlock?sentinel_tls=maybe&sentinel_password=s3cret",
        "redis+sentinel://127.0.0.1:46411/dlock?db=zero&sentinel_password=s3cret",
        // Sentinel options on other URLs.
        "redis://u:hunter2@127.0.0.1:46379/?sentinel_password=s3cret",
        "redis+cluster://127.0.0.1:47001?sentinel_username=me",
    ] {
        let err = RedisBackend::connect(url).await.expect_err(url);
        let shown = format!("{err} {err:?}");
        assert!(matches!(err, LockError::Config { .. }), "{url}: {shown}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("s3cret"),
            "{url}: {shown}"
        );
    }
    // A wrong data-node password fails at connect, without the password.
    let wrong = url().replace("://", "://nobody:hunter2@");
    let err = RedisBackend::connect(&wrong)
        .await
        .expect_err("wrong password");
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
}

/// One key held per entry of `holders`, and a waiter on the first one.
struct Held {
    key: String,
    guard: LockGuard,
    token: u64,
}

/// Keys held and waited for through a failover that `fail_over` starts
/// (given the primary's port): holders whose lease the new primary lacks
/// are lost at their next renewal (the others hold their key there), the
/// waiter gets its key within its wait, and tokens keep growing. Answers
/// the old primary's port.
async fn keys_held_and_waited_for_across_a_failover<F>(
    case: &str,
    lease: Duration,
    fail_over: F,
) -> u16
where
    F: FnOnce(u16),
{
    let url = url();
    let (holder, waiter) = (other_process(&url).await, other_process(&url).await);
    let mut held = Vec::new();
    for i in 0..4 {
        let key = unique_key(&format!("{case}-{i}"));
        let guard = holder
            .lock(&key)
            .lease(lease)
            .acquire()
            .await
            .expect("acquire before the failover");
        let token = guard.fencing_token().expect("token").get();
        held.push(Held { key, guard, token });
    }
    let waited_key = held[0].key.clone();
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let answer = waiter
            .lock(&waited_key)
            .lease(Duration::from_secs(10))
            .wait(Duration::from_secs(45))
            .acquire()
            .await;
        (answer, started.elapsed(), waiter)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let old = primary_port().await;
    let started = Instant::now();
    fail_over(old);
    let new = wait_moved_from(old).await;
    eprintln!(
        "{case}: the sentinels moved the primary {old} -> {new} after {:?}",
        started.elapsed()
    );
    // A key the new primary lacks (as if replication had not carried it
    // over): its holder must hear it at its next renewal there, long before
    // the old primary (writable for ≈11 s after a `SENTINEL FAILOVER`) or
    // its lease would tell.
    let missing = &held[3];
    SentinelFaults
        .revoke(&format!("dlock:{}", missing.key))
        .await;
    // The backends follow within a second; a renewal period later every
    // holder has renewed on the new primary, or learnt its key is not there.
    tokio::time::sleep(Duration::from_secs(1) + lease).await;
    assert!(
        missing.guard.is_lost(),
        "{case}: a lease the new primary lacks was not reported lost"
    );
    let mut kept = 0;
    for h in &held[1..3] {
        let on_new = SentinelFaults::held_on_primary(&format!("dlock:{}", h.key)).await;
        assert!(
            h.guard.is_lost() || on_new,
            "{}: the holder believes it holds a key the new primary lacks",
            h.key
        );
        kept += usize::from(!h.guard.is_lost());
    }
    eprintln!("{case}: {kept} of 2 holders kept their lease across the failover");

    let mut held = held.into_iter();
    let first = held.next().expect("four keys");
    // Released (or lost): the waiter takes the first key.
    let _ = first.guard.release().await;
    for h in held {
        let _ = h.guard.release().await;
        let again = holder
            .lock(&h.key)
            .acquire()
            .await
            .expect("acquire after the failover");
        let token = again.fencing_token().expect("token").get();
        assert!(token > h.token, "{}: {token} after {}", h.key, h.token);
        again.release().await.expect("release after the failover");
    }
    let (answer, waited, _waiter) = waiting.await.expect("the waiter's task");
    let guard = answer.unwrap_or_else(|e| panic!("{case}: the waiter got no key: {e}"));
    let token = guard.fencing_token().expect("token").get();
    assert!(token > first.token, "{token} after {}", first.token);
    assert!(
        SentinelFaults::held_on_primary(&format!("dlock:{}", first.key)).await || guard.is_lost(),
        "the waiter holds a key the primary lacks"
    );
    eprintln!("{case}: the waiter got its key after {waited:?}");
    guard.release().await.expect("the waiter's release");
    old
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_is_followed_while_keys_are_held_and_waited_for() {
    let _alone = exclusive().await;
    wait_healthy().await;
    keys_held_and_waited_for_across_a_failover("sentinel-failover", Duration::from_secs(3), |_| {
        let sentinel = sentinel_ports()[0];
        let answer = std::process::Command::new("redis-cli")
            .args([
                "-h",
                HOST,
                "-p",
                &sentinel.to_string(),
                "SENTINEL",
                "FAILOVER",
                NAME,
            ])
            .output()
            .expect("redis-cli");
        let said = String::from_utf8_lossy(&answer.stdout);
        assert!(said.trim() == "OK", "SENTINEL FAILOVER: {said}");
    })
    .await;
    wait_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_followed_while_keys_are_held_and_waited_for() {
    let _alone = exclusive().await;
    wait_healthy().await;
    let mut restart = None;
    let old = keys_held_and_waited_for_across_a_failover(
        "sentinel-sigkill",
        Duration::from_secs(10),
        |port| {
            restart = Some(RestartRedisOnDrop(vec![port]));
            sigkill_redis(port);
        },
    )
    .await;
    // Back as a replica of the new primary.
    drop(restart);
    assert_ne!(primary_port().await, old);
    wait_healthy().await;
}

/// A semaphore through a `SENTINEL FAILOVER`: on the new primary, never
/// more holders than permits, each holder that still believes it holds its
/// permit is there with its slot and token, and a waiter gets a permit
/// after a release with a larger token than that slot's before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_keeps_at_most_its_permits_across_a_failover() {
    let _alone = exclusive().await;
    wait_healthy().await;
    let url = url();
    let (holder, waiter) = (other_process(&url).await, other_process(&url).await);
    let key = unique_key("sentinel-semaphore-failover");
    let lease = Duration::from_secs(3);
    let mut guards = Vec::new();
    for _ in 0..2 {
        let guard = holder
            .lock(&key)
            .permits(2)
            .lease(lease)
            .acquire()
            .await
            .expect("acquire before the failover");
        guards.push(guard);
    }
    let before: Vec<_> = guards
        .iter()
        .map(|g| g.fencing_token().expect("token").get())
        .collect();
    let waited_key = key.clone();
    let waiting = tokio::spawn(async move {
        let answer = waiter
            .lock(&waited_key)
            .permits(2)
            .lease(Duration::from_secs(10))
            .wait(Duration::from_secs(45))
            .acquire()
            .await;
        (answer, waiter)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let old = primary_port().await;
    let sentinel = sentinel_ports()[0];
    let answer = std::process::Command::new("redis-cli")
        .args([
            "-h",
            HOST,
            "-p",
            &sentinel.to_string(),
            "SENTINEL",
            "FAILOVER",
            NAME,
        ])
        .output()
        .expect("redis-cli");
    let said = String::from_utf8_lossy(&answer.stdout);
    assert!(said.trim() == "OK", "SENTINEL FAILOVER: {said}");
    let new = wait_moved_from(old).await;
    eprintln!("semaphore: the sentinels moved the primary {old} -> {new}");
    // Every holder has renewed on the new primary, or learnt it lost.
    tokio::time::sleep(Duration::from_secs(1) + lease).await;

    let shown = holder.inspect(&key).await.expect("inspect");
    let on_new: Vec<_> = shown
        .iter()
        .flat_map(|info| info.holders().iter())
        .map(|h| (h.slot(), h.token()))
        .collect();
    assert!(on_new.len() <= 2, "more holders than permits: {on_new:?}");
    let kept: Vec<_> = guards.iter().filter(|g| !g.is_lost()).collect();
    for guard in &kept {
        assert!(
            on_new.contains(&(guard.permit(), guard.fencing_token())),
            "a holder believes it holds a permit the new primary lacks: {:?} not in {on_new:?}",
            guard.permit()
        );
    }
    eprintln!("semaphore: {} of 2 holders kept their permit", kept.len());

    for guard in guards {
        let _ = guard.release().await;
    }
    let (answer, _waiter) = waiting.await.expect("the waiter's task");
    let granted = answer.expect("the waiter gets a permit after the releases");
    let token = granted.fencing_token().expect("token").get();
    assert!(
        before.iter().all(|&t| token > t),
        "{token} after {before:?}"
    );
    granted.release().await.expect("the waiter's release");
    wait_healthy().await;
}
