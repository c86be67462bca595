//! The core rework's guarantees on the in-process backend: cancel-safe
//! release, fault isolation between backends, sibling futures that take turns,
//! saturating durations and a minimum lease, late grants, hybrid tokens,
//! bounded state and graceful shutdown.
//!
//! Each test says what the runtime before the rework (commit `1c8e415`, "old
//! main") did instead. Most build their own [`Registry`] over their own
//! [`MemoryBackend`], so that the backend's counters see only that test; the
//! `#[distributed_lock]` functions use the global registry installed by
//! [`global`].

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, Renewal, WakeSource};
use dlock_runtime::{
    BackendError, LockBackend, LockError, MIN_LEASE, MemoryBackend, Registry, current,
    distributed_lock,
};
use dlock_tests::unique_key;
use futures_util::future::BoxFuture;

fn registry(backend: &MemoryBackend) -> Registry {
    Registry::builder().default_backend(backend.clone()).build()
}

/// The stored form of a key (default prefix).
fn stored(key: &str) -> String {
    format!("dlock:{key}")
}

/// Polls `cond` every 5 ms for up to `within`; whether it became true.
async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn global_backend() -> &'static MemoryBackend {
    static BACKEND: OnceLock<MemoryBackend> = OnceLock::new();
    BACKEND.get_or_init(MemoryBackend::new)
}

/// The global registry (over [`global_backend`]) that `#[distributed_lock]` uses.
fn global() -> &'static Registry {
    static INIT: Once = Once::new();
    INIT.call_once(|| dlock_runtime::init(registry(global_backend())).expect("first init"));
    dlock_runtime::global().expect("installed above")
}

/// A [`MemoryBackend`] behind two knobs: the answer to the next grant can be
/// held back (a grant that reaches the caller late), and releases can be slow.
#[derive(Debug, Clone)]
struct Knobbed {
    inner: MemoryBackend,
    /// Held back once, after the inner backend has granted the key.
    delay_next_grant: Arc<Mutex<Option<Duration>>>,
    /// The token of the grant that was held back.
    late_token: Arc<Mutex<Option<u64>>>,
    release_delay: Duration,
}

impl Knobbed {
    fn new(inner: &MemoryBackend) -> Self {
        Knobbed {
            inner: inner.clone(),
            delay_next_grant: Arc::default(),
            late_token: Arc::default(),
            release_delay: Duration::ZERO,
        }
    }

    fn delay_next_grant(&self, by: Duration) {
        *self.delay_next_grant.lock().unwrap() = Some(by);
    }

    fn late_token(&self) -> Option<u64> {
        self.late_token.lock().unwrap().take()
    }
}

impl LockBackend for Knobbed {
    fn kind(&self) -> &'static str {
        "knobbed-memory"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            let answer = self.inner.try_acquire(request).await?;
            if let Attempt::Held(lease) = &answer {
                let delay = self.delay_next_grant.lock().unwrap().take();
                if let Some(delay) = delay {
                    *self.late_token.lock().unwrap() = lease.token.map(u64::from);
                    tokio::time::sleep(delay).await;
                }
            }
            Ok(answer)
        })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.inner.wake_source(request)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        self.inner.renew_all(batch)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(self.release_delay).await;
            self.inner.release(lease).await
        })
    }

    fn needs_io_runtime(&self) -> bool {
        false
    }
}

// ---------------------------------------------------------------------------
// 1. A cancelled release leaves no renewed lease.

/// Item 1. The caller gives up on `release()` while a renewal hangs; the
/// release must still happen and no renewal may follow it.
///
/// Old main: the release waited for the renewal on the wire *before* taking
/// the lease off the watchdog's schedule; dropping it there left the lease
/// scheduled, so the watchdog went on renewing it and the key stayed held
/// (renewed) for as long as the process lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_release_leaves_no_renewed_lease() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("cancelled-release");
    let guard = reg
        .lock(&key)
        .lease(Duration::from_millis(600))
        .acquire()
        .await
        .expect("acquire");
    backend.stall_renewals(true);
    let before = backend.renewal_count();
    assert!(
        eventually(Duration::from_secs(1), || backend.renewal_count() > before).await,
        "the watchdog sends a renewal within a third of the lease"
    );
    // A renewal is on the wire and hangs. The caller stops waiting for the release.
    match tokio::time::timeout(Duration::from_millis(50), guard.release()).await {
        Err(_elapsed) => {}
        Ok(done) => done.expect("a release that finished in time succeeds"),
    }
    backend.stall_renewals(false);
    // The release goes on without its caller: the entry is removed (an
    // expired one would still be counted by `entries()`), long before the lease ends.
    assert!(
        eventually(Duration::from_millis(250), || backend.entries() == 0).await,
        "the key was not freed after the cancelled release: {:?}",
        backend.held_keys()
    );
    let count = backend.renewal_count();
    // Longer than the lease and three renewal periods.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        backend.renewal_count(),
        count,
        "renewals went on after the release was asked for"
    );
    assert_eq!(backend.renewals_after_release(), 0);
    assert!(backend.held_keys().is_empty());
    registry(&backend)
        .lock(&key)
        .acquire()
        .await
        .expect("the key is free for another registry")
        .release()
        .await
        .expect("release");
}

// ---------------------------------------------------------------------------
// 2. A stalled backend does not starve the others.

/// Item 2. One registry, two backends; every renewal on one of them hangs.
/// The healthy backend's lease stays held; the stalled one's is declared lost
/// at its give-up instant although its renewal never answers.
///
/// Old main: the watchdog awaited every backend's batch before looking at its
/// schedule again, so a hung renewal (of the 4 s lease below) kept the
/// healthy backend's lease from being renewed until the server expired it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_backend_does_not_starve_others() {
    let (stalled, healthy) = (MemoryBackend::new(), MemoryBackend::new());
    let reg = Registry::builder()
        .default_backend(stalled.clone())
        .backend("healthy", healthy.clone())
        .build();
    let (key_s, key_long, key_h) = (
        unique_key("stalled"),
        unique_key("stalled-long"),
        unique_key("healthy"),
    );
    let lease = Duration::from_millis(900);
    let guard_h = reg
        .lock(&key_h)
        .backend("healthy")
        .lease(lease)
        .acquire()
        .await
        .expect("acquire on the healthy backend");
    let healthy_since = Instant::now();
    stalled.stall_renewals(true);
    // Its renewal (due at 1.33 s) hangs until its give-up instant (3.6 s):
    // the stalled backend has a renewal on the wire for most of the test.
    let guard_long = reg
        .lock(&key_long)
        .lease(Duration::from_secs(4))
        .acquire()
        .await
        .expect("acquire the long lease on the stalled backend");
    let asked = Instant::now();
    let guard_s = reg
        .lock(&key_s)
        .lease(lease)
        .acquire()
        .await
        .expect("acquire on the stalled backend");
    tokio::time::timeout(lease, guard_s.lost())
        .await
        .expect("the stalled lease is declared lost before the server would expire it");
    let lost_after = asked.elapsed();
    assert!(
        lost_after < lease,
        "lost after {lost_after:?}, not before the lease ({lease:?}) ran out"
    );
    assert!(
        lost_after >= lease / 2,
        "lost after {lost_after:?}: earlier than its give-up instant"
    );
    let renewals_then = healthy.renewal_count();
    tokio::time::sleep_until((healthy_since + Duration::from_secs(3)).into()).await;
    assert!(
        !guard_h.is_lost(),
        "the healthy lease was lost while the other backend stalled"
    );
    assert!(healthy.held_keys().contains(&stored(&key_h)));
    assert!(
        healthy.renewal_count() >= renewals_then + 4,
        "the healthy lease was renewed {} times in ~2 s (every 300 ms expected)",
        healthy.renewal_count() - renewals_then
    );
    assert!(matches!(
        registry(&healthy).lock(&key_h).acquire().await,
        Err(LockError::Busy { .. })
    ));
    guard_h.release().await.expect("held throughout");
    stalled.stall_renewals(false);
    assert!(matches!(
        guard_s.release().await,
        Err(LockError::Lost { .. })
    ));
    drop(guard_long);
}

// ---------------------------------------------------------------------------
// 3. Siblings do not share a hold.

#[derive(Default)]
struct Account {
    balance: AtomicU64,
    inside: AtomicUsize,
    overlapped: AtomicBool,
}

impl Account {
    /// Read, wait, write: loses an update if two run at once.
    async fn add_one(&self) {
        if self.inside.fetch_add(1, Ordering::SeqCst) > 0 {
            self.overlapped.store(true, Ordering::SeqCst);
        }
        let read = self.balance.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        self.balance.store(read + 1, Ordering::SeqCst);
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

#[distributed_lock(key = "acct:{id}", wait = "3s")]
async fn debit(id: &str, account: &Account) -> Result<(), LockError> {
    account.add_one().await;
    Ok(())
}

#[distributed_lock(key = "acct:{id}")]
async fn debit_now(id: &str, account: &Account) -> Result<(), LockError> {
    account.add_one().await;
    Ok(())
}

/// Item 3. Two `join!`ed calls inside a scope holding their key take turns.
///
/// Old main: a nested acquisition found the key in the task's held set and
/// entered at once, so both siblings ran together and one update was lost
/// (balance +1, both inside at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_do_not_share_a_hold() {
    let reg = global();
    let id = unique_key("siblings");
    let account = Account::default();
    let guard = reg
        .lock(format!("acct:{id}"))
        .acquire()
        .await
        .expect("acquire");
    let (a, b) = guard
        .scope(async { tokio::join!(debit(&id, &account), debit(&id, &account)) })
        .await;
    a.expect("first sibling");
    b.expect("second sibling");
    assert_eq!(
        account.balance.load(Ordering::SeqCst),
        2,
        "an update was lost"
    );
    assert!(
        !account.overlapped.load(Ordering::SeqCst),
        "the siblings were inside at the same time"
    );
    guard.release().await.expect("release");
}

/// Item 3. A sibling with `wait = 0` finds the key busy while the other is
/// inside; once it has left, the next one enters.
///
/// Old main: the `wait = 0` sibling entered at once (shared hold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sibling_with_wait_zero_is_busy() {
    let reg = global();
    let id = unique_key("siblings-busy");
    let account = Account::default();
    let guard = reg
        .lock(format!("acct:{id}"))
        .acquire()
        .await
        .expect("acquire");
    let (first, second, third) = guard
        .scope(async {
            let (first, second) = tokio::join!(debit(&id, &account), async {
                while account.inside.load(Ordering::SeqCst) == 0 {
                    tokio::task::yield_now().await;
                }
                debit_now(&id, &account).await
            });
            (first, second, debit_now(&id, &account).await)
        })
        .await;
    first.expect("the first sibling runs");
    assert!(
        matches!(second, Err(LockError::Busy { .. })),
        "a wait = 0 sibling entered while the other was inside: {second:?}"
    );
    third.expect("free again once the sibling left");
    assert_eq!(account.balance.load(Ordering::SeqCst), 2);
    guard.release().await.expect("release");
}

#[distributed_lock(key = "chain:{id}")]
async fn chain_outer(id: &str) -> Result<Vec<u64>, LockError> {
    let mut tokens = vec![token_here()];
    tokens.extend(chain_middle(id).await?);
    Ok(tokens)
}

#[distributed_lock(key = "chain:{id}")]
async fn chain_middle(id: &str) -> Result<Vec<u64>, LockError> {
    // Two calls one after the other: a call chain, not siblings.
    let first = chain_inner(id).await?;
    let second = chain_inner(id).await?;
    Ok(vec![token_here(), first, second])
}

#[distributed_lock(key = "chain:{id}")]
async fn chain_inner(id: &str) -> Result<u64, LockError> {
    tokio::task::yield_now().await;
    Ok(token_here())
}

fn token_here() -> u64 {
    current()
        .expect("inside a lock")
        .fencing_token()
        .expect("memory fences")
        .into()
}

/// Item 3. A call chain (a locked function calling locked functions of the
/// same key, one after the other, three deep) enters at once with `wait = 0`
/// and shares the outer lease.
///
/// Old main: this worked; the test guards against the sibling fix breaking it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_chain_still_enters_at_once() {
    global();
    let id = unique_key("chain");
    let tokens = chain_outer(&id).await.expect("the whole chain enters");
    assert_eq!(tokens.len(), 4);
    assert!(
        tokens.iter().all(|t| *t == tokens[0]),
        "nested holds share the outer lease: {tokens:?}"
    );
    let stored_key = stored(&format!("chain:{id}"));
    assert!(
        eventually(Duration::from_secs(1), || !global_backend()
            .held_keys()
            .contains(&stored_key))
        .await,
        "released after the chain"
    );
}

/// Item 3. Releasing a nested hold after the shared lease was lost reports
/// `Lost`.
///
/// Old main: releasing a nested hold only dropped the hold and answered `Ok(())`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_release_reports_a_lost_lease() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("nested-lost");
    let guard = reg
        .lock(&key)
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("acquire");
    let nested_release = guard
        .scope(async {
            let nested = reg.lock(&key).acquire().await.expect("enters at once");
            assert!(backend.expire_now(&stored(&key)));
            tokio::time::timeout(Duration::from_secs(1), nested.lost())
                .await
                .expect("the loss reaches the nested hold at the next renewal");
            nested.release().await
        })
        .await;
    assert!(
        matches!(nested_release, Err(LockError::Lost { .. })),
        "nested release after the loss: {nested_release:?}"
    );
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

/// Item 3. A task spawned inside a body does not inherit the hold: its
/// acquisition of the same key is busy, while the body's own is reentrant.
///
/// Old main: the same (task-local state); kept as a guard for the rework.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spawned_task_does_not_inherit_the_hold() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("spawned");
    let guard = reg.lock(&key).acquire().await.expect("acquire");
    let (own, spawned) = guard
        .scope(async {
            let own = reg.lock(&key).acquire().await.map(drop);
            let (reg, key) = (reg.clone(), key.clone());
            let spawned = tokio::spawn(async move { reg.lock(&key).acquire().await.map(drop) })
                .await
                .expect("task");
            (own, spawned)
        })
        .await;
    own.expect("the body's own call chain enters");
    assert!(
        matches!(spawned, Err(LockError::Busy { .. })),
        "a spawned task shared the hold: {spawned:?}"
    );
    guard.release().await.expect("release");
}

// ---------------------------------------------------------------------------
// 4. Durations saturate; a lease has a minimum.

/// Item 4. A lease below [`MIN_LEASE`] is a configuration error; a lease of
/// exactly `MIN_LEASE` works and is renewed (held for a whole second).
///
/// Old main: any non-zero lease was accepted (there was no minimum).
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

// ---------------------------------------------------------------------------
// 5. A late grant is not used.

/// Item 5. A grant whose answer arrives after the holder would have had to
/// give it up (lease − 10 %) is not handed to the caller: it is released at
/// once and, with a wait budget left, the acquisition tries again.
///
/// Old main: the late grant was returned as a guard whose lease was nearly
/// (or already) over on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_grant_is_not_used() {
    let inner = MemoryBackend::new();
    let knobbed = Knobbed::new(&inner);
    let reg = Registry::builder().default_backend(knobbed.clone()).build();
    let key = unique_key("late-grant");
    let lease = Duration::from_secs(1);
    // Answered at 950 ms: past the give-up instant (900 ms), while the grant
    // still stands on the backend (1 s).
    let late = Duration::from_millis(950);

    // No wait budget: no guard, and the grant is undone.
    knobbed.delay_next_grant(late);
    let answer = reg.lock(&key).lease(lease).acquire().await;
    assert!(
        matches!(
            answer,
            Err(LockError::Busy { .. } | LockError::Backend { .. })
        ),
        "a grant that came too late was used: {answer:?}"
    );
    assert!(knobbed.late_token().is_some(), "the grant was held back");
    assert_eq!(
        inner.entries(),
        0,
        "the late grant was left on the backend: {:?}",
        inner.held_keys()
    );
    registry(&inner)
        .lock(&key)
        .acquire()
        .await
        .expect("free for another registry at once")
        .release()
        .await
        .expect("release");

    // With a wait budget: a fresh grant, never the late one.
    knobbed.delay_next_grant(late);
    let guard = reg
        .lock(&key)
        .lease(lease)
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .expect("tries again after the late grant");
    let late_token = knobbed.late_token().expect("the grant was held back");
    let token = guard.fencing_token().expect("memory fences").get();
    assert!(
        token > late_token,
        "the guard carries the late grant's token {late_token}"
    );
    assert!(!guard.is_lost());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!guard.is_lost(), "the guard's lease is a fresh one");
    assert!(inner.held_keys().contains(&stored(&key)));
    guard.release().await.expect("release");
    assert_eq!(inner.entries(), 0);
}

/// Item 5. `is_lost()` is true as soon as the give-up instant (lease − 10 %)
/// passes without a renewal, whatever the watchdog is doing.
///
/// Old main: `is_lost()` only read the flag the watchdog set, so it said
/// `false` until the watchdog got round to it (never, with a renewal hanging).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn is_lost_turns_true_at_the_give_up_instant() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let key = unique_key("give-up");
    backend.stall_renewals(true);
    let lease = Duration::from_secs(1);
    let asked = Instant::now();
    let guard = reg
        .lock(&key)
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let acquired = Instant::now();
    // The give-up instant lies between asked + 900 ms and acquired + 900 ms.
    tokio::time::sleep_until((asked + Duration::from_millis(700)).into()).await;
    assert!(!guard.is_lost(), "lost before the give-up instant");
    tokio::time::sleep_until((acquired + Duration::from_millis(901)).into()).await;
    assert!(
        guard.is_lost(),
        "not lost right after the give-up instant, with its renewal hanging"
    );
    backend.stall_renewals(false);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

// ---------------------------------------------------------------------------
// 7. Tokens strictly increase per key, also after per-key state is gone.

/// Item 7. Per key, every token is above the previous one, also after the
/// key's entry was removed (released, or deleted behind the holder's back).
///
/// Old main: memory kept one entry per key for ever (which is why its tokens
/// grew); with entries now collected, tokens must not restart.
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

// ---------------------------------------------------------------------------
// 8. Bounded state.

/// Item 8. After 20,000 distinct keys are locked and released, and after
/// holders that never released have expired, the store keeps O(1) entries.
///
/// Old main: one entry per key ever locked, for ever (20,000 entries here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_is_bounded() {
    let backend = MemoryBackend::new();
    let reg = registry(&backend);
    let prefix = unique_key("bounded");
    for i in 0..20_000 {
        reg.lock(format!("{prefix}:{i}"))
            .acquire()
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
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
        reg.lock(format!("{prefix}:after:{i}"))
            .acquire()
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
    }
    assert!(
        backend.entries() <= 2,
        "{} entries once the vanished holders' leases expired",
        backend.entries()
    );
}

// ---------------------------------------------------------------------------
// 10. Graceful shutdown.

/// Item 10. `shutdown` releases every held lease at once (the keys are free
/// on the backend when it returns), tells a running body its lease is lost,
/// and refuses new acquisitions (`dlock_tests::scenarios::graceful_shutdown`).
///
/// Old main: there was no shutdown; held leases stayed until they expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_releases_every_lease() {
    let backend = MemoryBackend::new();
    dlock_tests::scenarios::graceful_shutdown(
        &registry(&backend),
        &registry(&backend),
        &dlock_tests::MemoryFaults(backend.clone()),
    )
    .await;
    assert_eq!(backend.entries(), 0);
}

/// Item 10. A guard dropped just before `shutdown` hands its release to the
/// background; `shutdown` waits for it (up to its deadline, and says when
/// it could not).
///
/// Old main: there was no shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_dropped_guards_release() {
    let inner = MemoryBackend::new();
    let slow = Knobbed {
        release_delay: Duration::from_millis(300),
        ..Knobbed::new(&inner)
    };
    let reg = Registry::builder().default_backend(slow.clone()).build();
    let key = unique_key("shutdown-dropped");
    drop(reg.lock(&key).acquire().await.expect("acquire"));
    let report = reg.shutdown(Duration::from_secs(2)).await;
    assert_eq!(report.unfinished, 0, "{report:?}");
    assert!(
        inner.held_keys().is_empty(),
        "shutdown returned before the dropped guard's release was done"
    );

    // A deadline shorter than the release: reported as unfinished.
    let inner = MemoryBackend::new();
    let slower = Knobbed {
        release_delay: Duration::from_millis(600),
        ..Knobbed::new(&inner)
    };
    let reg = Registry::builder().default_backend(slower).build();
    drop(reg.lock(&key).acquire().await.expect("acquire"));
    let started = Instant::now();
    let report = reg.shutdown(Duration::from_millis(100)).await;
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(report.unfinished, 1, "{report:?}");
    assert!(
        eventually(Duration::from_secs(2), || inner.held_keys().is_empty()).await,
        "the release finishes after the deadline all the same"
    );
}
