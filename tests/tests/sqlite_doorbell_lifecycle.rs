//! The life of SQLite's doorbells: waiters fall back to polling when the
//! bells directory cannot exist, and watch again when it is removed (also
//! through a relative path, also for waiters already waiting when it is
//! created again); the bell files stay bounded; cancelled waiters and dropped
//! backends leave no registration, watcher thread or inotify descriptor; a
//! watcher that failed is tried again.
//!
//! Every waiter here looks again only every 10 s (`?poll=10s`) and its
//! holder's lease runs 30 s, so a waiter that takes the key within a second
//! of a release was rung awake; one that does not was left to its poll.
#![cfg(feature = "sqlite")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlock_tests::doorbell_support::{
    self, backend, bells_dir, handoff, hold, in_child_process, inotify_fds, relative_to_cwd,
    remove_bells, spawn_waiter, wait_until_registered, watcher_threads,
};
use dlock_tests::unique_key;

/// A fresh database path of this test's own.
fn db_path(case: &str) -> PathBuf {
    doorbell_support::db_path(Path::new(env!("CARGO_TARGET_TMPDIR")), case)
}

/// A file where the bells directory should be: the watcher cannot be set up,
/// waiters poll, releases do not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_bells_directory_waiters_poll() {
    let db = db_path("fallback");
    std::fs::write(bells_dir(&db), b"not a directory").expect("block the bells");
    let url = format!("sqlite://{}?poll=20ms", db.display());
    let (_holding, holder) = backend(&url).await;
    let (waiting, waiter) = backend(&url).await;
    let key = unique_key("doorbell-fallback");
    for _ in 0..5 {
        let guard = holder
            .lock(&key)
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .expect("hold");
        let waits = {
            let waiter = waiter.clone();
            let key = key.clone();
            tokio::spawn(async move {
                waiter
                    .lock(&key)
                    .lease(Duration::from_secs(30))
                    .wait(Duration::from_secs(10))
                    .acquire()
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        guard
            .release()
            .await
            .expect("a release does not fail on a bell");
        let taken = tokio::time::timeout(Duration::from_secs(5), waits)
            .await
            .expect("the waiter ends")
            .expect("the waiter's task")
            .expect("the waiter acquires by polling");
        assert!(released.elapsed() < Duration::from_secs(1));
        taken.release().await.expect("release");
    }
    assert!(!waiting.hears_doorbells(), "the watcher cannot exist here");
    assert!(bells_dir(&db).is_file(), "the blocking file is left alone");
}

/// 1,000 distinct keys leave at most 256 bell files of one byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bells_stay_bounded() {
    let db = db_path("bounded");
    let url = format!("sqlite://{}", db.display());
    let (_holding, holder) = backend(&url).await;
    let (waiting, waiter) = backend(&url).await;

    // No waiter yet: nobody to ring for, no directory.
    let guard = holder
        .lock(unique_key("bell-0"))
        .acquire()
        .await
        .expect("lock");
    guard.release().await.expect("release");
    assert!(!bells_dir(&db).exists(), "rung with nobody listening");

    // A waiter sets up the bells.
    let key = unique_key("bell-wait");
    let guard = holder.lock(&key).acquire().await.expect("hold");
    wait_until_registered(&waiting, &waiter, &key).await;
    assert!(waiting.hears_doorbells());
    guard.release().await.expect("release");

    for i in 0..1000 {
        let guard = holder
            .lock(unique_key(&format!("bell-{i}")))
            .acquire()
            .await
            .expect("lock");
        guard.release().await.expect("release");
    }
    let bells: Vec<_> = std::fs::read_dir(bells_dir(&db))
        .expect("the bells directory")
        .map(|e| e.expect("entry").metadata().expect("metadata"))
        .collect();
    println!("{} bell files after 1,000 keys", bells.len());
    assert!(bells.len() <= 256, "{} bell files", bells.len());
    assert!(bells.len() > 200, "the keys' bells were not rung");
    assert!(bells.iter().all(|m| m.is_file() && m.len() == 1));
}

/// Waiters dropped while waiting leave no bucket registered; the next waiter
/// is still rung awake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiters_leave_no_registration() {
    let db = db_path("cancel");
    let url = format!("sqlite://{}?poll=10s", db.display());
    let (_holding, holder) = backend(&url).await;
    let (waiting, waiter) = backend(&url).await;
    let keys: Vec<_> = (0..5)
        .map(|i| unique_key(&format!("doorbell-cancel-{i}")))
        .collect();
    let mut guards = Vec::new();
    for key in &keys {
        guards.push(
            holder
                .lock(key)
                .lease(Duration::from_secs(30))
                .acquire()
                .await
                .expect("hold"),
        );
    }
    let tasks: Vec<_> = keys
        .iter()
        .flat_map(|key| [key.clone(), key.clone()])
        .map(|key| {
            let waiter = waiter.clone();
            tokio::spawn(async move {
                waiter
                    .lock(key)
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
            })
        })
        .collect();
    let started = Instant::now();
    while waiting.doorbell_waits() == 0 {
        assert!(started.elapsed() < Duration::from_secs(5), "nobody waits");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(waiting.doorbell_waits() <= keys.len());
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        assert!(task.await.expect_err("aborted").is_cancelled());
    }
    // The wait loops run on dlock's I/O runtime and stop when they notice
    // their callers are gone.
    let dropped = Instant::now();
    while waiting.doorbell_waits() > 0 {
        assert!(
            dropped.elapsed() < Duration::from_secs(2),
            "cancelled waiters stay registered: {} buckets",
            waiting.doorbell_waits()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The bells still work for the next waiter.
    let next = {
        let waiter = waiter.clone();
        let key = keys[0].clone();
        tokio::spawn(async move {
            waiter
                .lock(key)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let released = Instant::now();
    for guard in guards {
        guard.release().await.expect("release");
    }
    let taken = tokio::time::timeout(Duration::from_secs(5), next)
        .await
        .expect("the waiter ends")
        .expect("the waiter's task")
        .expect("the waiter acquires");
    assert!(released.elapsed() < Duration::from_secs(1));
    taken.release().await.expect("release");
    assert_eq!(waiting.doorbell_waits(), 0);
}

/// The bells directory removed under a watching backend: the next waiter
/// watches a new one and is rung awake again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_bells_directory_is_watched_anew() {
    let db = db_path("removed");
    let url = format!("sqlite://{}?poll=10s", db.display());
    let (_holding, holder) = backend(&url).await;
    let (waiting, waiter) = backend(&url).await;
    let key = unique_key("doorbell-removed");
    for round in 0..2 {
        let guard = holder
            .lock(&key)
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .expect("hold");
        let waits = {
            let waiter = waiter.clone();
            let key = key.clone();
            tokio::spawn(async move {
                waiter
                    .lock(key)
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        guard.release().await.expect("release");
        let taken = tokio::time::timeout(Duration::from_secs(5), waits)
            .await
            .expect("the waiter ends")
            .expect("the waiter's task")
            .expect("the waiter acquires");
        let took = released.elapsed();
        assert!(took < Duration::from_secs(1), "round {round}: {took:?}");
        taken.release().await.expect("release");
        assert!(waiting.hears_doorbells());
        if round == 0 {
            remove_bells(&db);
            // Let the watcher hear that its directory is gone.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `sqlite://relative/locks.db`: the watcher reports absolute paths; the
/// doorbells still notice that their bells directory was removed, so the next
/// waiter sets up a new watcher and is rung awake. The same case as
/// `a_removed_bells_directory_is_watched_anew`, through a relative path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_path_notices_its_bells_removed() {
    let db = db_path("doorbell-relative");
    let rel = relative_to_cwd(&db);
    let url = format!("sqlite://{}?poll=10s", rel.display());
    let (_holding, holder) = backend(&url).await;
    let (waiting, waiter) = backend(&url).await;
    let key = unique_key("doorbell-doorbell-relative");
    for round in 0..2 {
        let guard = hold(&holder, &key).await;
        let waits = spawn_waiter(&waiter, &key);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waits.is_finished(), "the key was not busy");
        let recreated = bells_dir(&db).is_dir();
        let took = handoff(guard, waits, Duration::from_secs(3)).await;
        assert!(waiting.hears_doorbells());
        assert!(
            took.is_some_and(|t| t < Duration::from_secs(1)),
            "round {round} ({url}): the waiter was not rung awake within 3 s \
             (took {took:?}; poll is 10 s); bells directory recreated by the \
             waiter: {recreated}"
        );
        if round == 0 {
            remove_bells(&db);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The bells directory is removed (a `/tmp` cleaner, an operator) while a
/// waiter waits, and another process's waiter creates it again: the waiter
/// that was already waiting moves to the new directory and is rung awake by
/// the next release, not left to its poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_already_waiting_are_rung_from_recreated_bells() {
    let db = db_path("doorbell-recreated");
    let url = format!("sqlite://{}?poll=10s", db.display());
    let (_holding, holder) = backend(&url).await;
    let (waiting, waiter) = backend(&url).await;
    // "Another process": a backend of its own, with its own watcher.
    let (_other, other) = backend(&url).await;
    let key = unique_key("doorbell-doorbell-recreated");
    let other_key = unique_key("doorbell-doorbell-recreated-other");

    let guard = hold(&holder, &key).await;
    let waits = spawn_waiter(&waiter, &key);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waits.is_finished(), "the key was not busy");
    assert!(waiting.hears_doorbells());

    remove_bells(&db);
    // Let the watcher hear it (and wake its waiter, which finds the key busy).
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Another process's first waiter creates the directory again.
    let other_guard = hold(&holder, &other_key).await;
    let busy = other
        .lock(&other_key)
        .wait(Duration::from_millis(50))
        .acquire()
        .await;
    assert!(busy.is_err(), "the other key was not busy");
    assert!(bells_dir(&db).is_dir(), "the other waiter made the bells");
    other_guard.release().await.expect("release");

    let took = handoff(guard, waits, Duration::from_secs(3)).await;
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(1)),
        "the waiter that waited through the removal was not rung awake within \
         3 s (took {took:?}; poll is 10 s)"
    );
}

/// The watcher cannot be set up once (here a stray file where the directory
/// goes; equally the inotify instance limit, 128 per user by default, reached
/// for a moment by other programs): once the obstacle is gone the backend
/// tries again (after 1 s), and waiters are rung awake again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_failed_is_tried_again() {
    let db = db_path("doorbell-unavailable");
    let url = format!("sqlite://{}?poll=10s", db.display());
    let (_holding, holder) = backend(&url).await;
    let (waiting, waiter) = backend(&url).await;
    let key = unique_key("doorbell-doorbell-unavailable");

    std::fs::write(bells_dir(&db), b"stray").expect("block the bells");
    let guard = hold(&holder, &key).await;
    let busy = waiter
        .lock(&key)
        .wait(Duration::from_millis(30))
        .acquire()
        .await;
    assert!(busy.is_err());
    assert!(!waiting.hears_doorbells(), "the watcher cannot exist yet");
    // The obstacle goes away; another process's waiter makes the bells. The
    // backend tries to watch again a second after it failed.
    std::fs::remove_file(bells_dir(&db)).expect("unblock");
    std::fs::create_dir(bells_dir(&db)).expect("bells");
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let waits = spawn_waiter(&waiter, &key);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waits.is_finished(), "the key was not busy");
    let hears = waiting.hears_doorbells();
    let took = handoff(guard, waits, Duration::from_secs(3)).await;
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(1)),
        "a waiter that came after the obstacle was gone was not rung awake \
         within 3 s (took {took:?}; poll is 10 s; hears the bells: {hears})"
    );
}

/// 50 backends, one after another, each of which waited (so set up its
/// watcher: one thread, one inotify descriptor), dropped with their
/// registries: none of their watchers outlives them. (Sequential, so as not
/// to take 50 of the user's 128 inotify instances at once.) In a child
/// process, so that other tests' watchers do not count.
#[test]
fn dropped_backends_leave_no_watcher() {
    let Some(rt) = in_child_process(
        "dropped_backends_leave_no_watcher",
        "DLOCK_DOORBELL_WATCHER_LEAK_CHILD",
        Duration::from_secs(120),
    ) else {
        return;
    };
    rt.block_on(async {
        let db = db_path("doorbell-leak");
        let url = format!("sqlite://{}?poll=10s", db.display());
        let (_holding, holder) = backend(&url).await;
        let key = unique_key("doorbell-doorbell-leak");
        let guard = hold(&holder, &key).await;
        let (fds0, threads0) = (inotify_fds(), watcher_threads());
        let mut peak = (0, 0);
        for _ in 0..50 {
            let (waiting, waiter) = backend(&url).await;
            wait_until_registered(&waiting, &waiter, &key).await;
            assert!(waiting.hears_doorbells());
            peak = (peak.0.max(inotify_fds()), peak.1.max(watcher_threads()));
            drop(waiter);
            drop(waiting);
        }
        // A dropped watcher's thread ends (and closes its descriptor) on its
        // own time: wait for it, generously, then compare.
        let deadline = Instant::now() + Duration::from_secs(20);
        while (inotify_fds() > fds0 || watcher_threads() > threads0) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (fds, threads) = (inotify_fds(), watcher_threads());
        println!(
            "inotify fds: {fds0} before, peak {}, {fds} after; watcher threads: \
             {threads0} before, peak {}, {threads} after",
            peak.0, peak.1
        );
        assert!(peak.0 >= 1 && peak.1 >= 1, "no watcher was ever set up");
        assert!(fds <= fds0, "inotify descriptors leaked: {fds0} -> {fds}");
        assert!(
            threads <= threads0,
            "watcher threads leaked: {threads0} -> {threads}"
        );
        guard.release().await.expect("release");
    });
}
