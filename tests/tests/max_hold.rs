//! `max_hold`: a ceiling on one hold under the watchdog. At the ceiling the
//! renewals stop, `lost()` fires with the reason `MaxHold`, the attribute
//! cancels its body (`on_lost = "cancel"`), and the key is free for another
//! holder within one lease — on the in-process backend and on Redis.

use std::time::{Duration, Instant};

use dlock_runtime::{
    LockError, LossReason, MemoryBackend, Registry, distributed_lock, lock, lock_all,
};
use dlock_tests::unique_key;
use tokio::sync::OnceCell;

const LEASE: Duration = Duration::from_secs(1);
const MAX_HOLD: Duration = Duration::from_secs(2);

/// The watchdog looks at a lease every renewal period: the ceiling must be
/// acted on within one.
const RENEW_PERIOD: Duration = Duration::from_millis(333);

async fn init() {
    static INIT: OnceCell<()> = OnceCell::const_new();
    INIT.get_or_init(|| async {
        #[allow(unused_mut)]
        let mut builder = Registry::builder().default_backend(MemoryBackend::new());
        #[cfg(feature = "redis")]
        {
            let url = dlock_tests::server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
            let redis = dlock_runtime::RedisBackend::connect(&url)
                .await
                .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e));
            builder = builder.backend("redis", redis);
        }
        dlock_runtime::init(builder.build()).expect("first init");
    })
    .await;
}

#[distributed_lock(key = "{key}", lease = "1s", max_hold = "2s")]
async fn overstays_on_memory(key: &str) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(10)).await;
    Ok(())
}

#[cfg(feature = "redis")]
#[distributed_lock(key = "{key}", lease = "1s", max_hold = "2s", backend = "redis")]
async fn overstays_on_redis(key: &str) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_secs(10)).await;
    Ok(())
}

/// Runs a body that sleeps past its ceiling; checks it is cancelled within
/// one renewal period after the ceiling, and that the key is then free.
async fn body_past_the_ceiling_is_cancelled<F: Future<Output = Result<(), LockError>>>(
    key: &str,
    backend: Option<&str>,
    call: F,
) {
    let started = Instant::now();
    let outcome = call.await;
    let took = started.elapsed();
    assert!(
        matches!(outcome, Err(LockError::Lost { .. })),
        "{outcome:?}"
    );
    assert!(took >= MAX_HOLD, "cancelled before the ceiling: {took:?}");
    assert!(
        took < MAX_HOLD + RENEW_PERIOD,
        "cancelled {:?} after the ceiling, more than one renewal period",
        took - MAX_HOLD
    );
    let mut next = lock(key).wait(LEASE);
    if let Some(backend) = backend {
        next = next.backend(backend);
    }
    let freed = Instant::now();
    let guard = next
        .acquire()
        .await
        .expect("the key is free within a lease");
    assert!(freed.elapsed() <= LEASE, "{:?}", freed.elapsed());
    guard.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sleeping_past_max_hold_is_cancelled_on_memory() {
    init().await;
    let key = unique_key("max-hold-attribute");
    body_past_the_ceiling_is_cancelled(&key, None, overstays_on_memory(&key)).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sleeping_past_max_hold_is_cancelled_on_redis() {
    init().await;
    let key = unique_key("max-hold-attribute-redis");
    body_past_the_ceiling_is_cancelled(&key, Some("redis"), overstays_on_redis(&key)).await;
}

/// A builder hold that is not released at its ceiling: `lost()` fires with
/// `MaxHold`, no renewal follows, and the lease runs out on the server within
/// one lease, so another holder gets the key (with a larger token).
async fn an_unreleased_hold_runs_out_after_its_ceiling(backend: Option<&str>, fenced: bool) {
    init().await;
    let key = unique_key(&format!("max-hold-builder-{backend:?}"));
    let with_backend = |b: dlock_runtime::LockBuilder| match backend {
        Some(name) => b.backend(name),
        None => b,
    };
    let guard = with_backend(lock(&key).lease(LEASE).max_hold(MAX_HOLD))
        .acquire()
        .await
        .expect("acquire");
    let granted = Instant::now();
    tokio::time::timeout(MAX_HOLD + LEASE, guard.lost())
        .await
        .expect("lost at the ceiling");
    let lost_after = granted.elapsed();
    assert!(
        lost_after < MAX_HOLD + RENEW_PERIOD,
        "ceiling noticed late: {lost_after:?}"
    );
    assert!(
        lost_after + Duration::from_millis(50) >= MAX_HOLD,
        "{lost_after:?}"
    );
    assert_eq!(guard.loss_reason(), Some(LossReason::MaxHold));
    assert!(guard.is_lost());
    // Renewed past the first lease: the watchdog ran until the ceiling.
    assert!(lost_after > LEASE);
    let waited = Instant::now();
    let next = with_backend(lock(&key).wait(LEASE + RENEW_PERIOD))
        .acquire()
        .await
        .expect("the lease runs out on the server within one lease");
    assert!(waited.elapsed() <= LEASE + RENEW_PERIOD);
    if fenced {
        assert!(next.fencing_token() > guard.fencing_token());
    }
    next.release().await.expect("release");
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreleased_hold_runs_out_after_its_ceiling_on_memory() {
    an_unreleased_hold_runs_out_after_its_ceiling(None, true).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreleased_hold_runs_out_after_its_ceiling_on_redis() {
    an_unreleased_hold_runs_out_after_its_ceiling(Some("redis"), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ceiling_caps_a_hold_of_several_keys_as_a_whole() {
    init().await;
    let (a, b) = (unique_key("max-hold-all-a"), unique_key("max-hold-all-b"));
    let guard = lock_all([&a, &b])
        .lease(LEASE)
        .max_hold(MAX_HOLD)
        .acquire()
        .await
        .expect("acquire");
    let granted = Instant::now();
    tokio::time::timeout(MAX_HOLD + LEASE, guard.lost())
        .await
        .expect("lost at the ceiling");
    assert!(granted.elapsed() < MAX_HOLD + RENEW_PERIOD);
    assert_eq!(guard.loss_reason(), Some(LossReason::MaxHold));
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

#[distributed_lock(key = "{key}", lease = "1s", max_hold = "2s")]
async fn outer_with_a_ceiling(key: &str) -> Result<Option<LossReason>, LockError> {
    // A nested hold of the same key asks for no ceiling: the outer one applies.
    let inner = lock(key).lease(Duration::from_secs(30)).acquire().await?;
    inner.lost().await;
    let reason = inner.loss_reason();
    let _ = inner.release().await;
    Ok(reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_hold_keeps_the_outer_ceiling() {
    init().await;
    let key = unique_key("max-hold-nested");
    let started = Instant::now();
    // The outer body is cancelled at the ceiling, at the nested `lost()`'s
    // wake-up at the latest: either way the call ends at the ceiling.
    let outcome = outer_with_a_ceiling(&key).await;
    let took = started.elapsed();
    assert!(
        took >= MAX_HOLD && took < MAX_HOLD + RENEW_PERIOD,
        "{took:?}"
    );
    assert!(
        matches!(
            outcome,
            Err(LockError::Lost { .. }) | Ok(Some(LossReason::MaxHold))
        ),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_ceiling_without_the_watchdog_or_below_the_lease_is_a_config_error() {
    init().await;
    let key = unique_key("max-hold-config");
    let no_watchdog = lock(&key)
        .watchdog(false)
        .max_hold(Duration::from_secs(60))
        .acquire()
        .await;
    assert!(
        matches!(&no_watchdog, Err(LockError::Config { .. })),
        "{no_watchdog:?}"
    );
    let below = lock(&key)
        .lease(Duration::from_secs(10))
        .max_hold(Duration::from_secs(5))
        .acquire()
        .await;
    assert!(matches!(&below, Err(LockError::Config { .. })), "{below:?}");
    let zero = lock(&key).max_hold(Duration::ZERO).acquire().await;
    assert!(matches!(&zero, Err(LockError::Config { .. })), "{zero:?}");
}
