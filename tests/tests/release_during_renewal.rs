//! A release asked for while a renewal of the lease hangs on the wire, on the
//! in-process backend: the key is freed at once (DESIGN.md §5, invariant 3),
//! not once the hanging renewal gives up.

use std::time::{Duration, Instant};

use dlock_runtime::MemoryBackend;
use dlock_tests::memory_support::{eventually, registry};
use dlock_tests::unique_key;

/// Every renewal hangs; the lease's renewal is on the wire when the holder
/// releases it. The release frees the key and returns within a round trip,
/// while the lease still has seconds to run: the owner-checked release makes
/// the hanging renewal a no-op whenever it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_the_key_at_once_while_a_renewal_hangs() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("release-renewal-hangs");
    let guard = reg
        .lock(&key)
        .lease(Duration::from_secs(6))
        .acquire()
        .await
        .expect("acquire");
    backend.stall_renewals(true);
    assert!(
        eventually(Duration::from_secs(4), || backend.renewal_count() > 0).await,
        "the watchdog sends a renewal within a third of the lease"
    );
    let started = Instant::now();
    let released = tokio::time::timeout(Duration::from_secs(1), guard.release()).await;
    let took = started.elapsed();
    let still_held = backend.held_keys();
    backend.stall_renewals(false);
    assert!(
        released.is_ok() && still_held.is_empty(),
        "the release waited for the hanging renewal: returned: {}, after {took:?}, \
         keys still held on the backend: {still_held:?}",
        released.is_ok()
    );
    released
        .expect("returned")
        .expect("the release of a lease still valid succeeds");
    assert_eq!(backend.renewals_after_release(), 0);
}
