//! Leases on the in-process backend: a stalled backend does not starve
//! another one's renewals (loss is time-driven), the minimum lease is enforced
//! and kept, tokens keep growing after idle entries are collected, and the
//! backend's state stays bounded by what is in use.

use std::time::Duration;

use dlock_runtime::backend::{AcquireRequest, Attempt};
use dlock_runtime::{LockBackend, LockError, MIN_LEASE, MemoryBackend, Registry};
use dlock_tests::memory_support::{registry, stored};
use dlock_tests::scenarios::StalledAndHealthy;
use dlock_tests::{acquire_and_release, unique_key};

/// One registry, two backends; every renewal on one of them hangs.
/// The healthy backend's lease stays held (and renewed); the stalled one's is
/// declared lost at its give-up instant although its renewal never answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_backend_does_not_starve_others() {
    let (stalled, healthy) = (MemoryBackend::new(), MemoryBackend::new());
    let reg = Registry::builder()
        .default_backend(stalled.clone())
        .backend("healthy", healthy.clone())
        .build();
    let leases = StalledAndHealthy::acquire(&reg, "healthy").await;
    stalled.stall_renewals(true);
    let lost_after = leases.stalled_lease_is_lost_before_it_ends().await;
    assert!(
        lost_after >= leases.lease / 2,
        "lost after {lost_after:?}: earlier than its give-up instant"
    );
    let renewals_then = healthy.renewal_count();
    leases
        .healthy_lease_is_held_after_3s(&registry(&healthy))
        .await;
    assert!(healthy.held_keys().contains(&stored(leases.healthy_key())));
    assert!(
        healthy.renewal_count() >= renewals_then + 4,
        "the healthy lease was renewed {} times in ~2 s (every 300 ms expected)",
        healthy.renewal_count() - renewals_then
    );
    leases.finish(async { stalled.stall_renewals(false) }).await;
}

/// A lease below [`MIN_LEASE`] is a configuration error; a lease of
/// exactly `MIN_LEASE` works and is renewed (held for a whole second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_has_a_minimum_and_the_minimum_works() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("min-lease");
    let short = reg
        .lock(&key)
        .lease(Duration::from_millis(50))
        .acquire()
        .await;
    assert!(
        matches!(short, Err(LockError::Config { .. })),
        "lease(50ms): {short:?}"
    );
    assert_eq!(backend.entries(), 0, "nothing taken for a refused lease");
    let guard = reg
        .lock(&key)
        .lease(MIN_LEASE)
        .acquire()
        .await
        .expect("lease(MIN_LEASE)");
    let renewals = backend.renewal_count();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!guard.is_lost(), "a MIN_LEASE lease was lost within 1 s");
    assert!(backend.held_keys().contains(&stored(&key)));
    assert!(
        backend.renewal_count() >= renewals + 10,
        "renewed {} times in 1 s (every ~33 ms expected)",
        backend.renewal_count() - renewals
    );
    assert!(matches!(
        registry(&backend).lock(&key).acquire().await,
        Err(LockError::Busy { .. })
    ));
    guard.release().await.expect("held for the whole second");
}

/// Per key, every token is above the previous one, also after the
/// key's entry was removed (released, or deleted behind the holder's back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_strictly_increase_after_entries_are_collected() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let keys: Vec<String> = (0..1500)
        .map(|i| unique_key(&format!("tokens-{i}")))
        .collect();
    let mut last = Vec::with_capacity(keys.len());
    for key in &keys {
        let guard = reg.lock(key).acquire().await.expect("acquire");
        last.push(guard.fencing_token().expect("fences").get());
        guard.release().await.expect("release");
    }
    assert_eq!(backend.entries(), 0, "per-key entries are gone");
    for (i, key) in keys.iter().enumerate() {
        let guard = reg.lock(key).acquire().await.expect("acquire");
        let token = guard.fencing_token().expect("fences").get();
        assert!(token > last[i], "{key}: {token} after {}", last[i]);
        last[i] = token;
        if i % 10 == 0 {
            // Deleted behind the holder's back: the next token still grows.
            backend.expire_now(&stored(key));
            let _ = guard.release().await;
            let again = reg.lock(key).acquire().await.expect("acquire");
            let token = again.fencing_token().expect("fences").get();
            assert!(token > last[i], "{key}: {token} after {}", last[i]);
            again.release().await.expect("release");
        } else {
            guard.release().await.expect("release");
        }
    }
}

/// After 20,000 distinct keys are locked and released, and after
/// holders that never released have expired, the store keeps O(1) entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_is_bounded() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let prefix = unique_key("bounded");
    for i in 0..20_000 {
        acquire_and_release(&reg, &format!("{prefix}:{i}")).await;
    }
    assert!(
        backend.entries() <= 2,
        "{} entries after 20,000 released keys",
        backend.entries()
    );
    // Holders that vanish without releasing: their entries expire and are collected.
    for i in 0..2048 {
        let request = AcquireRequest::new(
            stored(&format!("{prefix}:ghost:{i}")),
            "ghost",
            Duration::from_millis(100),
        );
        let attempt = backend.try_acquire(&request).await.expect("attempt");
        assert!(matches!(attempt, Attempt::Held(_)));
    }
    assert!(backend.entries() >= 2048);
    backend.advance(Duration::from_secs(1));
    for i in 0..1100 {
        acquire_and_release(&reg, &format!("{prefix}:after:{i}")).await;
    }
    assert!(
        backend.entries() <= 2,
        "{} entries once the vanished holders' leases expired",
        backend.entries()
    );
}

/// Three thousand keys of live holders (plain, readers, permits) and three
/// thousand of crashed ones: once the crashed leases ended, twenty thousand
/// fresh keys locked and released run several collection passes over them
/// all. The crashed keys go; every live holder keeps its key (its renewal
/// answers renewed); the store never keeps more than twice the keys it
/// ever held at once, plus 1,024.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collection_passes_drop_only_ended_holders_and_keep_the_store_bounded() {
    use dlock_runtime::HoldMode;
    use dlock_runtime::backend::Renewal;
    let backend = MemoryBackend::new();
    let prefix = unique_key("mem-passes");
    let modes = [
        HoldMode::Exclusive,
        HoldMode::Shared,
        HoldMode::Permit { permits: 2 },
    ];
    let mut live = Vec::new();
    for i in 0..6000 {
        let (name, owner, lease) = if i % 2 == 0 {
            ("live", "live", Duration::from_secs(600))
        } else {
            ("crashed", "crashed", Duration::from_secs(1))
        };
        let request = AcquireRequest::new(stored(&format!("{prefix}:{name}:{i}")), owner, lease)
            .with_mode(modes[i % 3]);
        let Attempt::Held(lease) = backend.try_acquire(&request).await.expect("attempt") else {
            panic!("a fresh key is free");
        };
        if i % 2 == 0 {
            live.push(lease);
        }
    }
    let peak = backend.entries();
    backend.advance(Duration::from_secs(2));
    for i in 0..20_000 {
        let request = AcquireRequest::new(
            stored(&format!("{prefix}:fresh:{i}")),
            "fresh",
            Duration::from_secs(600),
        );
        let Attempt::Held(lease) = backend.try_acquire(&request).await.expect("attempt") else {
            panic!("a fresh key is free");
        };
        backend.release(&lease).await.expect("release");
        let kept = backend.entries();
        assert!(
            kept <= 2 * peak + 1024,
            "{kept} entries kept after {i} fresh keys, {peak} held at most"
        );
    }
    let crashed = backend.entries_under(&stored(&format!("{prefix}:crashed")));
    assert_eq!(crashed, 0, "crashed holders' keys left");
    let batch: Vec<_> = live.iter().map(|l| (l, Duration::from_secs(600))).collect();
    let renewed = backend.renew_all(&batch).await;
    let lost: Vec<_> = renewed
        .iter()
        .zip(&live)
        .filter(|(r, _)| !matches!(r, Ok(Renewal::Renewed)))
        .map(|(r, l)| (l.key.clone(), format!("{r:?}")))
        .collect();
    assert!(lost.is_empty(), "live holders collected: {lost:?}");
    assert_eq!(
        backend.entries_under(&stored(&format!("{prefix}:live"))),
        live.len()
    );
}
