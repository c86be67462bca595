//! Reentrancy on the in-process backend: a call chain enters a held key at
//! once, sibling futures take turns (each within its own `wait`), a spawned
//! task does not inherit the hold, nested guards share the outer lease and
//! never keep the key past the outer release, and a nested release reports a
//! lost lease.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use dlock_runtime::{LockError, LockGuard, MemoryBackend, Registry, current, distributed_lock};
use dlock_tests::memory_support::{eventually, memory_registry, registry, stored};
use dlock_tests::unique_key;

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

/// Two `join!`ed calls inside a scope holding their key take turns.
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

/// A sibling with `wait = 0` finds the key busy while the other is
/// inside; once it has left, the next one enters.
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

/// A call chain (a locked function calling locked functions of the
/// same key, one after the other, three deep) enters at once with `wait = 0`
/// and shares the outer lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_chain_enters_at_once() {
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

/// Releasing a nested hold after the shared lease was lost reports
/// `Lost`.
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

/// A task spawned inside a body does not inherit the hold: its
/// acquisition of the same key is busy, while the body's own is reentrant.
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

const MS: Duration = Duration::from_millis(1);

/// A nested guard that outlives the scope it was taken in (moved into a
/// struct, a spawned task, returned out of a `#[distributed_lock]` body) does
/// not keep the key: the outer holder's `release()` frees it on the backend at
/// once and nothing renews it after (DESIGN.md §2 Guaranteed release, §5.3; a
/// nested hold shares the outer lease and cannot extend it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outer_release_frees_the_key_while_a_nested_guard_lives() {
    let (mem, registry) = memory_registry();
    let key = "nested:nested-escapes";
    let outer = registry
        .lock(key)
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("outer");
    let nested = outer
        .scope(registry.lock(key).acquire())
        .await
        .expect("reentrant entry");
    let released = outer.release().await;
    assert!(released.is_ok(), "{released:?}");
    // Well past the 300 ms lease: only renewals can keep it.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let held = mem.held_keys();
    let renewals = mem.renewal_count();
    drop(nested);
    assert!(
        held.is_empty(),
        "the outer release answered Ok, yet {held:?} is still held \
         ({renewals} renewals so far)"
    );
}

/// The same shape with a lost lease: the outer `release()` answers
/// `Err(LockError::Lost)` although a nested guard still lives (the protected
/// work may have overlapped with another holder's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outer_release_reports_a_loss_while_a_nested_guard_lives() {
    let (mem, registry) = memory_registry();
    let key = "nested:nested-hides-loss";
    let outer = registry
        .lock(key)
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("outer");
    let nested = outer
        .scope(registry.lock(key).acquire())
        .await
        .expect("reentrant entry");
    assert!(mem.expire_now(&format!("dlock:{key}")));
    tokio::time::timeout(Duration::from_secs(2), outer.lost())
        .await
        .expect("the loss reaches the holder at its next renewal");
    assert!(outer.is_lost());
    let released = outer.release().await;
    drop(nested);
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "release of a lost lease answered {released:?}"
    );
}

/// A nested guard kept while the same code calls another function locking
/// the key: the guard is a nested holder that is "inside", so the call takes
/// its turn like a sibling would (a nested acquisition enters at once only if
/// no other nested holder of the same scope is inside): `Busy` with
/// `wait = 0`. Code meant to run under the nested guard runs in its `scope`,
/// and enters at once there; after the nested guard's release, the next call
/// enters at once too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_guard_is_a_holder_its_own_scope_is_the_call_chain() {
    let (_mem, registry) = memory_registry();
    let key = "nested:call-chain";

    async fn locks_the_same_key(registry: &Registry, key: &str) -> Result<LockGuard, LockError> {
        registry.lock(key).acquire().await
    }

    let outer = registry.lock(key).acquire().await.expect("outer");
    outer
        .scope(async {
            let first = locks_the_same_key(&registry, key).await.expect("enters");
            let beside = locks_the_same_key(&registry, key).await;
            assert!(
                matches!(beside, Err(LockError::Busy { .. })),
                "a second nested holder beside a live one: {beside:?}"
            );
            let under = first.scope(locks_the_same_key(&registry, key)).await;
            under
                .expect("under the nested guard, in its scope")
                .release()
                .await
                .expect("release");
            first.release().await.expect("release");
            let after = locks_the_same_key(&registry, key).await;
            after
                .expect("after the nested guard's release")
                .release()
                .await
                .expect("release");
        })
        .await;
    outer.release().await.expect("release");
}

/// Siblings under one lease, each polled inside its own `scope` of the same
/// guard (`join!(g.scope(a), g.scope(b))`, or `join_all` over scoped work),
/// take turns: never two inside at once (DESIGN.md §2 Reentrancy: sibling
/// futures are not one call chain; they take turns, each within its own
/// `wait`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_in_separate_scopes_of_one_guard_take_turns() {
    let (_mem, registry) = memory_registry();
    let key = "nested:sibling-scopes";
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let work = || {
        let (registry, inside, most) = (registry.clone(), inside.clone(), most.clone());
        async move {
            let guard = registry
                .lock(key)
                .wait(Duration::from_secs(2))
                .acquire()
                .await
                .expect("takes its turn");
            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(50 * MS).await;
            inside.fetch_sub(1, Ordering::SeqCst);
            guard.release().await.expect("release");
        }
    };
    let outer = registry.lock(key).acquire().await.expect("outer");
    tokio::join!(outer.scope(work()), outer.scope(work()));
    outer.release().await.expect("release");
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two siblings held the key's nested hold at the same time"
    );
}

/// A semaphore inside a hold of one of its permits, with the same number,
/// enters at once and shares the outer permit.
#[tokio::test]
async fn a_permit_inside_a_permit_of_the_same_semaphore_enters() {
    let (_mem, registry) = memory_registry();
    let key = unique_key("nested-permit");
    let outer = registry
        .lock(&key)
        .permits(2)
        .acquire()
        .await
        .expect("outer");
    let other = registry
        .lock(&key)
        .permits(2)
        .acquire()
        .await
        .expect("other");
    outer
        .scope(async {
            let inner = registry
                .lock(&key)
                .permits(2)
                .acquire()
                .await
                .expect("a permit inside a permit of the same semaphore");
            assert_eq!(inner.permit(), outer.permit(), "the outer permit is shared");
            assert_eq!(inner.fencing_token(), outer.fencing_token());
            inner.release().await.expect("release");
        })
        .await;
    other.release().await.expect("release");
    outer.release().await.expect("release");
}

/// Inside a hold of a key, any other mode than the outer one (except a read
/// inside a write) is a `Config` error at once naming both, never a wait on
/// the hold itself.
#[tokio::test]
async fn another_mode_inside_a_hold_is_a_config_error_at_once() {
    let (_mem, registry) = memory_registry();
    let key = unique_key("nested-mismatch");
    let semaphore = registry
        .lock(&key)
        .permits(3)
        .acquire()
        .await
        .expect("outer");
    semaphore
        .scope(async {
            for (inner, names) in [
                (registry.lock(&key).permits(4), ["3 permits", "4 permits"]),
                (registry.lock(&key), ["3 permits", "a lock"]),
                (registry.lock(&key).read(), ["3 permits", "a read lock"]),
            ] {
                let started = std::time::Instant::now();
                let answer = inner.wait(Duration::from_secs(10)).acquire().await;
                let Err(LockError::Config { message }) = &answer else {
                    panic!("another mode inside a semaphore: {answer:?}");
                };
                assert!(
                    names.iter().all(|n| message.contains(n)),
                    "{message} names {names:?}"
                );
                assert!(started.elapsed() < Duration::from_secs(5), "not at once");
            }
        })
        .await;
    semaphore.release().await.expect("release");

    let writer = registry.lock(&key).acquire().await.expect("outer");
    writer
        .scope(async {
            let answer = registry
                .lock(&key)
                .permits(2)
                .wait(Duration::from_secs(10))
                .acquire()
                .await;
            assert!(
                matches!(&answer, Err(LockError::Config { message }) if message.contains("2 permits")),
                "a semaphore inside a lock: {answer:?}"
            );
        })
        .await;
    writer.release().await.expect("release");
}

/// Several keys in read mode or as semaphores are taken one by one in that
/// mode (never in the one-step path, which is for whole keys), and a read
/// of all of them inside a write of all of them enters.
#[tokio::test]
async fn several_keys_are_taken_in_the_asked_mode() {
    let (_mem, registry) = memory_registry();
    let keys = [unique_key("modes-a"), unique_key("modes-b")];
    let first = registry
        .lock_all(&keys)
        .read()
        .acquire()
        .await
        .expect("read");
    let second = registry
        .lock_all(&keys)
        .read()
        .acquire()
        .await
        .expect("readers of several keys share them");
    let writer = registry.lock_all(&keys).acquire().await;
    assert!(
        matches!(writer, Err(LockError::Busy { .. })),
        "a writer beside readers: {writer:?}"
    );
    first.release().await.expect("release");
    second.release().await.expect("release");

    let permits: Vec<LockGuard> = vec![
        registry
            .lock_all(&keys)
            .permits(2)
            .acquire()
            .await
            .expect("permit"),
        registry
            .lock_all(&keys)
            .permits(2)
            .acquire()
            .await
            .expect("permit"),
    ];
    let third = registry.lock_all(&keys).permits(2).acquire().await;
    assert!(
        matches!(third, Err(LockError::Busy { .. })),
        "a third holder of 2 permits: {third:?}"
    );
    for guard in permits {
        guard.release().await.expect("release");
    }

    let writer = registry
        .lock_all(&keys)
        .write()
        .acquire()
        .await
        .expect("write");
    writer
        .scope(async {
            registry
                .lock_all(&keys)
                .read()
                .acquire()
                .await
                .expect("a read of every key inside a write of every key")
                .release()
                .await
                .expect("release");
            let answer = registry.lock_all(&keys).permits(2).acquire().await;
            assert!(
                matches!(answer, Err(LockError::Config { .. })),
                "a semaphore inside a write: {answer:?}"
            );
        })
        .await;
    writer.release().await.expect("release");
}
