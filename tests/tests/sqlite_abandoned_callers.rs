//! A caller's runtime shut down, or the registry shut down, while its SQLite
//! call is still on a connection's worker thread (the database's write lock
//! held by another connection, so the statement waits up to its busy
//! timeout) leaves no key held for its lease: the runtime's backstop release
//! of the abandoned attempt goes out after the longest such statement
//! (`LockBackend::abandoned_command_bound`), and shutdown waits for it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlock_runtime::{Registry, SqliteBackend};
use dlock_tests::sql_db::SqliteFaults;
use dlock_tests::unique_key;

/// The lease each abandoned attempt asks for: far longer than the bound.
const LEASE: Duration = Duration::from_secs(60);

fn url(path: &Path) -> String {
    format!("sqlite://{}", path.display())
}

async fn registry(path: &Path) -> Registry {
    Registry::builder()
        .default_backend(
            SqliteBackend::connect(&url(path))
                .await
                .expect("open sqlite"),
        )
        .build()
}

/// The owner of `key`'s row (`None`: free or no row), read directly.
async fn owner(path: &Path, key: &str) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>("SELECT owner FROM dlock_leases WHERE key = ?1")
        .bind(format!("dlock:{key}"))
        .fetch_optional(&mut SqliteFaults::connect_to(path).await)
        .await
        .expect("read the row")
        .flatten()
}

/// A case's directory (its database goes there), the runtime the test
/// itself runs on, and `callers` keys named after `name`.
fn case(name: &str, callers: usize) -> (tempfile::TempDir, tokio::runtime::Runtime, Vec<String>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let keys = (0..callers)
        .map(|i| unique_key(&format!("{name}-{i}")))
        .collect();
    (dir, main, keys)
}

/// The keys of `keys` someone holds, with their owners.
async fn held(path: &Path, keys: &[String]) -> Vec<(String, String)> {
    let mut held = Vec::new();
    for key in keys {
        if let Some(owner) = owner(path, key).await {
            held.push((key.clone(), owner));
        }
    }
    held
}

/// A connection holding the database's write lock (`BEGIN IMMEDIATE`),
/// once `registry` has made the lock table.
async fn write_locked(path: &Path, registry: &Registry) -> sqlx::SqliteConnection {
    registry
        .lock(unique_key("warm"))
        .acquire()
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
    let mut blocker = SqliteFaults::connect_to(path).await;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut blocker)
        .await
        .expect("take the write lock");
    blocker
}

/// Starts an acquisition of `key` on a `current_thread` runtime of its own,
/// lets it reach the database (whose write lock is held, so the statement
/// waits on the connection's worker thread), then shuts that runtime down.
/// Answers the registry, alive until the end of the test.
fn acquire_then_shut_the_runtime_down(path: PathBuf, key: String) -> Registry {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let registry = runtime.block_on(async {
        let registry = registry(&path).await;
        let attempt = {
            let registry = registry.clone();
            tokio::spawn(async move { registry.lock(&key).lease(LEASE).acquire().await })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!attempt.is_finished(), "the write lock holds the attempt");
        registry
    });
    // The attempt's future is dropped with the runtime; its statement is
    // still on the worker thread.
    drop(runtime);
    registry
}

/// Several callers' acquisitions (one registry and one key each) are on
/// the worker threads when their runtimes are shut down; the write lock is
/// freed after the first clean-up releases have gone out and past 3 s (the
/// other backends' backstop), before the attempts' busy timeout, so each
/// attempt takes its key after its first release. No key may stay held for
/// its 60 s lease: each is free 15 s after the runtimes were shut down.
#[test]
fn a_runtime_shut_down_mid_acquire_leaves_every_key_free_far_within_the_lease() {
    let (dir, main, keys) = case("shut-down-mid-acquire", 6);
    let path = dir.path().join("locks.db");
    let mut blocker = main.block_on(async { write_locked(&path, &registry(&path).await).await });
    let callers: Vec<_> = keys
        .iter()
        .map(|key| {
            let (path, key) = (path.clone(), key.clone());
            std::thread::spawn(move || acquire_then_shut_the_runtime_down(path, key))
        })
        .collect();
    let registries: Vec<Registry> = callers
        .into_iter()
        .map(|c| c.join().expect("caller"))
        .collect();
    let shut_down = Instant::now();
    main.block_on(async {
        // After the other backends' backstop (3 s), before the attempts'
        // busy timeout (5 s).
        tokio::time::sleep_until((shut_down + Duration::from_millis(3800)).into()).await;
        sqlx::query("ROLLBACK")
            .execute(&mut blocker)
            .await
            .expect("free the write lock");
        tokio::time::sleep_until((shut_down + Duration::from_secs(15)).into()).await;
        let held = held(&path, &keys).await;
        assert!(
            held.is_empty(),
            "keys held 15 s after their callers' runtimes were shut down: {held:?}"
        );
    });
    drop(registries);
}

/// Callers on `current_thread` runtimes of their own are mid-acquire (their
/// statements on the worker threads, the write lock held) when the registry
/// is shut down; the lock is freed after the backstop releases have gone
/// out. Shutdown promises that once it has returned with nothing
/// unfinished, no key is held or taken through the registry any more.
#[test]
fn a_shutdown_with_callers_mid_acquire_on_other_runtimes_leaves_no_key_held() {
    let (dir, main, keys) = case("shutdown-mid-acquire", 3);
    let path = dir.path().join("locks.db");
    let (shared, mut blocker) = main.block_on(async {
        let shared = registry(&path).await;
        let blocker = write_locked(&path, &shared).await;
        (shared, blocker)
    });
    let callers: Vec<_> = keys
        .iter()
        .map(|key| {
            let (registry, key) = (shared.clone(), key.clone());
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime")
                    .block_on(async move { registry.lock(&key).lease(LEASE).acquire().await })
                    .err()
            })
        })
        .collect();
    main.block_on(async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let shutting = Instant::now();
        let shutdown = {
            let shared = shared.clone();
            tokio::spawn(async move { shared.shutdown(Duration::from_secs(30)).await })
        };
        // After the other backends' backstop (3 s), before the attempts'
        // busy timeout (5 s).
        tokio::time::sleep_until((shutting + Duration::from_millis(3800)).into()).await;
        sqlx::query("ROLLBACK")
            .execute(&mut blocker)
            .await
            .expect("free the write lock");
        let report = shutdown.await.expect("shutdown");
        assert_eq!(report.unfinished, 0, "shutdown finished everything");
        for caller in callers {
            assert!(
                caller.join().expect("caller").is_some(),
                "shutdown stopped it"
            );
        }
        // The statements left land within moments of the lock's freeing.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let held = held(&path, &keys).await;
        assert!(
            held.is_empty(),
            "keys held after the registry's shutdown returned: {held:?}"
        );
    });
}

/// Callers that leave while their attempts wait for the database's write
/// lock (a timeout around `acquire`; one registry and one key each): each
/// attempt goes on on its worker thread and takes its key once the lock is
/// free. The clean-up release of each abandoned attempt goes out after it
/// (sent at once, it would race the attempt for the write lock, and one
/// in eight or so would come first and free nothing), so every key is free
/// again within moments, long before the runtime's backstop (the busy
/// timeout and a margin, 7 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_taking_keys_after_their_callers_left_are_released_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("locks.db");
    let mut registries = Vec::new();
    for _ in 0..6 {
        registries.push(registry(&path).await);
    }
    let keys: Vec<String> = (0..6)
        .map(|i| unique_key(&format!("left-mid-acquire-{i}")))
        .collect();
    let mut blocker = write_locked(&path, &registries[0]).await;
    let attempts = registries.iter().zip(&keys).map(|(registry, key)| {
        tokio::time::timeout(
            Duration::from_millis(500),
            registry.lock(key).lease(LEASE).acquire(),
        )
    });
    for left in futures_util::future::join_all(attempts).await {
        assert!(left.is_err(), "the write lock holds the attempt: {left:?}");
    }
    // The clean-up releases are out by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("ROLLBACK")
        .execute(&mut blocker)
        .await
        .expect("free the write lock");
    let freed = Instant::now();
    // Each attempt takes its key as soon as the lock is free (its row is
    // made then: nothing else writes it); its release follows it.
    for key in &keys {
        loop {
            let row: Option<Option<String>> =
                sqlx::query_scalar("SELECT owner FROM dlock_leases WHERE key = ?1")
                    .bind(format!("dlock:{key}"))
                    .fetch_optional(&mut blocker)
                    .await
                    .expect("read the row");
            if row == Some(None) {
                break;
            }
            assert!(
                freed.elapsed() < Duration::from_secs(4),
                "{key} is not free 4 s after the write lock was (row: {row:?})"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(
        held(&path, &keys).await.is_empty(),
        "keys taken again after their releases"
    );
}

/// How an abandoned attempt asks for its key.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// A plain lock (the writer of a read-write lock).
    Plain,
    /// A reader's share.
    Reader,
    /// A permit of a semaphore of three.
    Permit,
    /// A plain lock of two keys at once (the key and `<key>-b`).
    TwoKeys,
}

impl Kind {
    /// The keys an attempt on `key` asks for.
    fn keys(self, key: &str) -> Vec<String> {
        match self {
            Kind::TwoKeys => vec![key.to_owned(), format!("{key}-b")],
            _ => vec![key.to_owned()],
        }
    }

    /// How many keys `callers` attempts whose callers left while they
    /// waited on connections take once the write lock is free: a
    /// statement runs then all the same, a transaction whose `BEGIN
    /// IMMEDIATE` was not answered is rolled back at once.
    fn taken_late(self, callers: usize) -> usize {
        match self {
            Kind::Plain => callers,
            Kind::TwoKeys => 2 * callers,
            Kind::Reader | Kind::Permit => 0,
        }
    }

    async fn acquire(self, registry: &Registry, key: &str) -> Result<(), dlock_runtime::LockError> {
        let lock = match self {
            Kind::Plain => registry.lock(key),
            Kind::Reader => registry.lock(key).read(),
            Kind::Permit => registry.lock(key).permits(3),
            Kind::TwoKeys => registry.lock_all(self.keys(key)),
        };
        lock.lease(LEASE).acquire().await.map(drop)
    }
}

/// What holds `key` (a plain owner, the owners of live holder rows), and
/// whether its lease-table row exists, read on `conn`.
async fn holders_of(
    conn: &mut sqlx::SqliteConnection,
    key: &str,
) -> (bool, Option<String>, Vec<String>) {
    let row: Option<Option<String>> =
        sqlx::query_scalar("SELECT owner FROM dlock_leases WHERE key = ?1")
            .bind(format!("dlock:{key}"))
            .fetch_optional(&mut *conn)
            .await
            .expect("read the row");
    let shares: Vec<String> = sqlx::query_scalar(
        "SELECT owner FROM dlock_leases_holders WHERE key = ?1 AND owner IS NOT NULL",
    )
    .bind(format!("dlock:{key}"))
    .fetch_all(&mut *conn)
    .await
    .expect("read the holder rows");
    (row.is_some(), row.flatten(), shares)
}

/// Callers of `kind` (one per registry of `registries`, each on a key of
/// its own) leave while their attempts wait for the database's write lock;
/// once it is free, every key is free again within `bound` — far before the
/// runtime's backstop (7 s after they left) — and stays free. At least
/// `late` of the keys are seen to have been taken first (their rows exist:
/// nothing else writes them).
async fn left_attempts_are_freed_within(
    kind: Kind,
    registries: &[Registry],
    path: &Path,
    late: usize,
) {
    const BOUND: Duration = Duration::from_secs(3);
    let keys: Vec<String> = (0..registries.len())
        .map(|i| unique_key(&format!("left-{kind:?}-{i}")))
        .collect();
    let mut blocker = write_locked(path, &registries[0]).await;
    let attempts = registries.iter().zip(&keys).map(|(registry, key)| {
        tokio::time::timeout(Duration::from_millis(500), kind.acquire(registry, key))
    });
    for left in futures_util::future::join_all(attempts).await {
        assert!(
            left.is_err(),
            "{kind:?}: the write lock holds the attempt: {left:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("ROLLBACK")
        .execute(&mut blocker)
        .await
        .expect("free the write lock");
    let freed = Instant::now();
    let all: Vec<String> = keys.iter().flat_map(|k| kind.keys(k)).collect();
    // Done when every key is free and the late statements have run (their
    // keys' rows are there: nothing else writes them).
    loop {
        let mut state = Vec::new();
        for key in &all {
            state.push((key, holders_of(&mut blocker, key).await));
        }
        let taken = state.iter().filter(|(_, (row, _, _))| *row).count();
        let held: Vec<_> = state
            .iter()
            .filter(|(_, (_, owner, shares))| owner.is_some() || !shares.is_empty())
            .collect();
        if held.is_empty() && taken >= late {
            break;
        }
        assert!(
            freed.elapsed() < BOUND,
            "{kind:?}: {BOUND:?} after the write lock was freed, {taken} of the {late} \
             late keys taken, and these held: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Nothing is taken after its release either.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for key in &all {
        let (_, owner, shares) = holders_of(&mut blocker, key).await;
        assert!(
            owner.is_none() && shares.is_empty(),
            "{kind:?}: {key} taken again after its release: {owner:?} {shares:?}"
        );
    }
    // No transaction of theirs stays open.
    SqliteFaults::assert_writable(path, &format!("{kind:?} callers left")).await;
}

/// Each kind of attempt, one registry (so one pool) per caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_attempt_whose_caller_left_leaves_its_keys_free_at_once() {
    for kind in [Kind::Plain, Kind::Reader, Kind::Permit, Kind::TwoKeys] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("locks.db");
        let mut registries = Vec::new();
        for _ in 0..3 {
            registries.push(registry(&path).await);
        }
        let late = kind.taken_late(registries.len());
        left_attempts_are_freed_within(kind, &registries, &path, late).await;
    }
}

/// Six callers of one registry, whose pool has four connections: four
/// attempts wait on the connections' worker threads and two for a
/// connection; the followers of the four hold their connections until the
/// late statements ran, and the six clean-up releases still go out within
/// moments of the write lock's freeing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_of_one_registry_leaving_more_attempts_than_connections_leave_keys_free_at_once() {
    for kind in [Kind::Plain, Kind::TwoKeys] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("locks.db");
        let shared = registry(&path).await;
        let registries = vec![shared; 6];
        // The four on the connections' threads.
        let late = kind.taken_late(4);
        left_attempts_are_freed_within(kind, &registries, &path, late).await;
    }
}

/// The registry (one pool) is shut down while its callers' attempts, on
/// the test's own runtime, wait for the database's write lock; the lock is
/// freed a moment later. The late grants are freed within moments of it,
/// not at the backstop, and shutdown, which waits for the backstop of the
/// attempts it stopped, returns with nothing unfinished and no key held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_stopping_attempts_on_the_wire_frees_their_late_grants_at_once() {
    const BOUND: Duration = Duration::from_secs(3);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("locks.db");
    let shared = registry(&path).await;
    let keys: Vec<String> = (0..3)
        .map(|i| unique_key(&format!("shutdown-follow-{i}")))
        .collect();
    let mut blocker = write_locked(&path, &shared).await;
    let attempts: Vec<_> = keys
        .iter()
        .map(|key| {
            let (registry, key) = (shared.clone(), key.clone());
            tokio::spawn(async move { registry.lock(&key).lease(LEASE).acquire().await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let shutdown = {
        let shared = shared.clone();
        tokio::spawn(async move { shared.shutdown(Duration::from_secs(30)).await })
    };
    for attempt in attempts {
        let stopped = tokio::time::timeout(Duration::from_secs(10), attempt)
            .await
            .expect("shutdown stops the attempt")
            .expect("attempt task");
        assert!(stopped.is_err(), "shutdown stopped it: {stopped:?}");
    }
    sqlx::query("ROLLBACK")
        .execute(&mut blocker)
        .await
        .expect("free the write lock");
    let freed = Instant::now();
    loop {
        let mut taken = 0;
        let mut held = Vec::new();
        for key in &keys {
            let (row, owner, _) = holders_of(&mut blocker, key).await;
            taken += usize::from(row);
            if let Some(owner) = owner {
                held.push((key.clone(), owner));
            }
        }
        if taken == keys.len() && held.is_empty() {
            break;
        }
        assert!(
            freed.elapsed() < BOUND,
            "{BOUND:?} after the write lock was freed: {taken} keys taken late, held: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let report = shutdown.await.expect("shutdown");
    assert_eq!(report.unfinished, 0, "shutdown finished everything");
    assert!(
        held(&path, &keys).await.is_empty(),
        "keys held after the registry's shutdown returned"
    );
}

/// Polls `work` until it is done or `budget` has passed, then drops it:
/// whether it finished.
async fn drop_after<F: std::future::Future>(work: F, budget: Duration) -> Option<F::Output> {
    let started = Instant::now();
    let mut work = std::pin::pin!(work);
    loop {
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(work.as_mut().poll(cx)));
        if let std::task::Poll::Ready(out) = polled.await {
            return Some(out);
        }
        if started.elapsed() >= budget {
            return None;
        }
        tokio::task::yield_now().await;
    }
}

/// What the churn's callers saw hold the keys at once, and the tokens of
/// the holds already released, by (key, slot).
#[derive(Default)]
struct Seen {
    permits: usize,
    plain_on_permits: usize,
    readers: usize,
    writers: usize,
    released: std::collections::HashMap<(u8, Option<u32>), u64>,
    wrong: Vec<String>,
    /// Callers that left, holds taken, mismatches.
    left: usize,
    taken: usize,
    mismatched: usize,
}

/// Callers of two registries (two pools) on one database file take
/// permits of a semaphore of three, a plain lock on that key (a mismatch
/// while permits stand), and readers and writers of a read-write lock,
/// each dropped at a random moment of its acquisition half the time (so at
/// every point of a share's folded grant and release). Never more than
/// three permits, a plain holder beside permits or a reader beside a writer
/// is seen; a token is above every token of a hold released before its
/// acquisition began, per (key, slot); once the callers are done both keys
/// are free within moments, no transaction stays open (another connection
/// writes), and every connection of both pools still takes transactions of
/// its own (renewals of shares).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_of_two_registries_dropped_at_random_moments_keep_exclusion_and_leave_the_database_whole()
 {
    use dlock_runtime::backend::{AcquireRequest, Attempt, HoldMode, LockBackend, Renewal};
    use std::sync::{Arc, Mutex};

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("locks.db");
    let backends: Vec<Arc<dyn LockBackend>> = vec![
        Arc::new(SqliteBackend::connect(&url(&path)).await.expect("open")),
        Arc::new(SqliteBackend::connect(&url(&path)).await.expect("open")),
    ];
    let registries: Vec<Registry> = backends
        .iter()
        .map(|b| Registry::builder().default_backend(b.clone()).build())
        .collect();
    let (sem, rw) = (unique_key("churn-sem"), unique_key("churn-rw"));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut tasks = Vec::new();
    for (r, registry) in registries.iter().enumerate() {
        for t in 0..4 {
            let (registry, sem, rw, seen) =
                (registry.clone(), sem.clone(), rw.clone(), seen.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..150 {
                    let what = rand::random::<u8>() % 7;
                    let (key, lock) = match what {
                        0..=2 => (0u8, registry.lock(&sem).permits(3)),
                        3 => (0, registry.lock(&sem)),
                        4 | 5 => (1, registry.lock(&rw).read()),
                        _ => (1, registry.lock(&rw)),
                    };
                    let floor = seen.lock().unwrap().released.clone();
                    let acquire = lock.lease(LEASE).wait(Duration::from_secs(20)).acquire();
                    let got = if rand::random::<bool>() {
                        let budget = Duration::from_micros(rand::random::<u64>() % 4000);
                        match drop_after(acquire, budget).await {
                            Some(got) => got,
                            None => {
                                seen.lock().unwrap().left += 1;
                                continue;
                            }
                        }
                    } else {
                        acquire.await
                    };
                    let guard = match got {
                        Ok(guard) => guard,
                        // A plain lock where permits stand, or permits where
                        // a plain lock stands.
                        Err(dlock_runtime::LockError::Config { .. }) if key == 0 => {
                            seen.lock().unwrap().mismatched += 1;
                            continue;
                        }
                        Err(e) => panic!("registry {r} task {t} step {i} ({what}): {e}"),
                    };
                    let token = guard.fencing_token().expect("fences").get();
                    let slot = guard.permit();
                    {
                        let mut s = seen.lock().unwrap();
                        s.taken += 1;
                        let below = floor.get(&(key, slot)).copied().unwrap_or(0);
                        if token <= below {
                            s.wrong.push(format!(
                                "({what}) token {token} at ({key}, {slot:?}) after {below}"
                            ));
                        }
                        match what {
                            0..=2 => s.permits += 1,
                            3 => s.plain_on_permits += 1,
                            4 | 5 => s.readers += 1,
                            _ => s.writers += 1,
                        }
                        let state = (s.permits, s.plain_on_permits, s.readers, s.writers);
                        if s.permits > 3
                            || (s.plain_on_permits > 0 && (s.permits > 0 || s.plain_on_permits > 1))
                            || (s.writers > 0 && (s.readers > 0 || s.writers > 1))
                        {
                            s.wrong.push(format!("({what}) held at once: {state:?}"));
                        }
                    }
                    tokio::time::sleep(Duration::from_micros(rand::random::<u64>() % 3000)).await;
                    {
                        let mut s = seen.lock().unwrap();
                        match what {
                            0..=2 => s.permits -= 1,
                            3 => s.plain_on_permits -= 1,
                            4 | 5 => s.readers -= 1,
                            _ => s.writers -= 1,
                        }
                    }
                    assert!(!guard.is_lost(), "({what}) lost while held");
                    guard.release().await.expect("release");
                    let mut s = seen.lock().unwrap();
                    let top = s.released.entry((key, slot)).or_default();
                    *top = (*top).max(token);
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("caller");
    }
    let (wrong, left, taken, mismatched) = {
        let mut s = seen.lock().unwrap();
        (std::mem::take(&mut s.wrong), s.left, s.taken, s.mismatched)
    };
    assert!(wrong.is_empty(), "exclusion or tokens broken: {wrong:?}");
    eprintln!("{left} left, {taken} taken, {mismatched} mismatched");
    assert!(
        left > 0 && taken > 0 && mismatched > 0,
        "{left} left, {taken} taken, {mismatched} mismatched"
    );
    // Every key free within moments of the last caller.
    let done = Instant::now();
    let mut conn = SqliteFaults::connect_to(&path).await;
    loop {
        let mut held = Vec::new();
        for key in [&sem, &rw] {
            let (_, owner, shares) = holders_of(&mut conn, key).await;
            if owner.is_some() || !shares.is_empty() {
                held.push((key.clone(), owner, shares));
            }
        }
        if held.is_empty() {
            break;
        }
        assert!(
            done.elapsed() < Duration::from_secs(3),
            "3 s after the callers were done, still held: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    SqliteFaults::assert_writable(&path, "the callers were done").await;
    // More renewals at once than a pool has connections: each begins its
    // transaction.
    for (b, backend) in backends.iter().enumerate() {
        let mut leases = Vec::new();
        for i in 0..8 {
            let request = AcquireRequest::new(
                unique_key(&format!("churn-after-{b}-{i}")),
                format!("after-{b}-{i}"),
                LEASE,
            )
            .with_mode(HoldMode::Shared);
            match backend.try_acquire(&request).await.expect("attempt") {
                Attempt::Held(lease) => leases.push(lease),
                other => panic!("a reader of a fresh key: {other:?}"),
            }
        }
        let renewals = leases.iter().map(|lease| async move {
            let batch = [(lease, LEASE)];
            backend.renew_all(&batch).await
        });
        for renewed in futures_util::future::join_all(renewals).await {
            assert!(
                matches!(renewed.as_slice(), [Ok(Renewal::Renewed)]),
                "registry {b}: a renewal after the churn: {renewed:?}"
            );
        }
        for lease in &leases {
            backend.release(lease).await.expect("release");
        }
    }
    drop(registries);
}
