//! The conformance suite and fault-injection tests on the in-process backend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, MemoryBackend, Registry, lock};
use dlock_tests::{Harness, MemoryFaults, unique_key};
use tokio::sync::OnceCell;

fn backend() -> &'static MemoryBackend {
    static BACKEND: std::sync::OnceLock<MemoryBackend> = std::sync::OnceLock::new();
    BACKEND.get_or_init(MemoryBackend::new)
}

async fn harness() -> &'static Harness {
    static HARNESS: OnceCell<Harness> = OnceCell::const_new();
    HARNESS
        .get_or_init(|| async {
            dlock_runtime::init(
                Registry::builder()
                    .default_backend(backend().clone())
                    .build(),
            )
            .expect("first init");
            Harness {
                faults: Arc::new(MemoryFaults(backend().clone())),
                fences: true,
            }
        })
        .await
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

#[tokio::test]
async fn second_init_is_an_error() {
    harness().await;
    let again = dlock_runtime::init(Registry::builder().build());
    assert!(matches!(again, Err(LockError::Config { .. })));
}

#[tokio::test]
async fn no_renewal_after_release() {
    harness().await;
    let key = unique_key("no-renewal-after-release");
    for _ in 0..20 {
        let guard = lock(&key)
            .lease(Duration::from_millis(100))
            .acquire()
            .await
            .expect("acquire");
        tokio::time::sleep(Duration::from_millis(12)).await;
        guard.release().await.expect("release");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(backend().renewals_after_release(), 0);
}

#[tokio::test]
async fn failing_renewals_end_in_loss_before_the_lease_ends() {
    // A private backend: fault injection here must not disturb the other tests.
    let mem = MemoryBackend::new();
    let registry = Registry::builder().default_backend(mem.clone()).build();
    let lease = Duration::from_millis(900);
    let guard = registry
        .lock("flaky")
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let acquired = Instant::now();
    mem.fail_renewals(true);
    tokio::time::timeout(2 * lease, guard.lost())
        .await
        .expect("loss is signalled");
    let noticed = acquired.elapsed();
    assert!(
        noticed < lease,
        "loss signalled after the lease ended: {noticed:?}"
    );
    assert!(noticed > lease / 2, "gave up too early: {noticed:?}");
    mem.fail_renewals(false);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

#[tokio::test]
async fn advancing_the_clock_expires_leases() {
    let mem = MemoryBackend::new();
    let registry = Registry::builder().default_backend(mem.clone()).build();
    let guard = registry
        .lock("clock")
        .lease(Duration::from_secs(3))
        .acquire()
        .await
        .expect("acquire");
    let waiter = tokio::spawn({
        let registry = registry.clone();
        async move {
            registry
                .lock("clock")
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    mem.advance(Duration::from_secs(61));
    let next = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("the waiter sees the jump")
        .expect("task")
        .expect("acquired after expiry");
    assert!(next.fencing_token() > guard.fencing_token());
    tokio::time::timeout(Duration::from_secs(3), guard.lost())
        .await
        .expect("the old holder learns at its next renewal");
    next.release().await.expect("release");
}

#[test]
fn registry_outlives_the_runtime_that_built_it() {
    let registry = tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async { Registry::from_url("memory://").await.expect("memory://") });
    // That runtime is gone; a new one uses the same registry.
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(async {
            let guard = registry.lock("k").acquire().await.expect("acquire");
            guard.release().await.expect("release");
        });
}

#[tokio::test]
async fn bad_urls_are_config_errors() {
    for url in [
        "nope",
        "ftp://x",
        "redis-ish://x",
        "sqlite://",
        "sqlite://x.db?poll=fast",
    ] {
        let result = Registry::from_url(url).await;
        assert!(
            matches!(result, Err(LockError::Config { .. })),
            "{url}: {result:?}"
        );
    }
    let secret = Registry::from_url("ftp://user:hunter2@host/")
        .await
        .unwrap_err();
    assert!(!format!("{secret} {secret:?}").contains("hunter2"));
}
