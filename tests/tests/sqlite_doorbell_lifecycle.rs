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
    self, Queued, TwoBackends, backend, bells_dir, finds_busy, in_child_process, inotify_fds,
    relative_to_cwd, remove_bells, rung_awake, wait_until_registered, watcher_threads,
};
use dlock_tests::{acquire_and_release, hold, unique_key};

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
    let b = TwoBackends::on(db, "?poll=20ms").await;
    let key = unique_key("doorbell-fallback");
    for round in 0..5 {
        let took = b.queue(&key).await.release().await;
        assert!(
            rung_awake(took),
            "round {round}: the waiter did not acquire by polling (every 20 ms) \
             within 1 s: {took:?}"
        );
    }
    assert!(
        !b.waiting.hears_doorbells(),
        "the watcher cannot exist here"
    );
    assert!(
        bells_dir(&b.db).is_file(),
        "the blocking file is left alone"
    );
}

/// 1,000 distinct keys leave at most 256 bell files of one byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bells_stay_bounded() {
    let b = TwoBackends::on(db_path("bounded"), "").await;

    // No waiter yet: nobody to ring for, no directory.
    acquire_and_release(&b.holder, &unique_key("bell-0")).await;
    assert!(!bells_dir(&b.db).exists(), "rung with nobody listening");

    // A waiter sets up the bells.
    let key = unique_key("bell-wait");
    let guard = b.holder.lock(&key).acquire().await.expect("hold");
    wait_until_registered(&b.waiting, &b.waiter, &key).await;
    assert!(b.waiting.hears_doorbells());
    guard.release().await.expect("release");

    for i in 0..1000 {
        acquire_and_release(&b.holder, &unique_key(&format!("bell-{i}"))).await;
    }
    let bells: Vec<_> = std::fs::read_dir(bells_dir(&b.db))
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
    let b = TwoBackends::on(db_path("cancel"), "?poll=10s").await;
    let keys: Vec<_> = (0..5)
        .map(|i| unique_key(&format!("doorbell-cancel-{i}")))
        .collect();
    let mut guards = Vec::new();
    for key in &keys {
        guards.push(hold(&b.holder, key).await);
    }
    let tasks: Vec<_> = keys
        .iter()
        .flat_map(|key| [key.clone(), key.clone()])
        .map(|key| {
            let waiter = b.waiter.clone();
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
    while b.waiting.doorbell_waits() == 0 {
        assert!(started.elapsed() < Duration::from_secs(5), "nobody waits");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(b.waiting.doorbell_waits() <= keys.len());
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        assert!(task.await.expect_err("aborted").is_cancelled());
    }
    // The wait loops run on dlock's I/O runtime and stop when they notice
    // their callers are gone.
    let dropped = Instant::now();
    while b.waiting.doorbell_waits() > 0 {
        assert!(
            dropped.elapsed() < Duration::from_secs(2),
            "cancelled waiters stay registered: {} buckets",
            b.waiting.doorbell_waits()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The bells still work for the next waiter.
    let next = Queued::behind(guards.remove(0), &b.waiter, &keys[0]).await;
    for guard in guards {
        guard.release().await.expect("release");
    }
    let took = next.release().await;
    assert!(rung_awake(took), "{took:?}");
    assert_eq!(b.waiting.doorbell_waits(), 0);
}

/// The bells directory removed under a watching backend: the next waiter
/// watches a new one and is rung awake again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_bells_directory_is_watched_anew() {
    let b = TwoBackends::on(db_path("removed"), "?poll=10s").await;
    let key = unique_key("doorbell-removed");
    for round in 0..2 {
        let took = b.queue(&key).await.release().await;
        assert!(rung_awake(took), "round {round}: {took:?}");
        assert!(b.waiting.hears_doorbells());
        if round == 0 {
            remove_bells(&b.db);
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
    let url = format!("sqlite://{}?poll=10s", relative_to_cwd(&db).display());
    let b = TwoBackends::open(db, url).await;
    let key = unique_key("doorbell-doorbell-relative");
    for round in 0..2 {
        let queued = b.queue(&key).await;
        let recreated = bells_dir(&b.db).is_dir();
        let took = queued.release().await;
        assert!(b.waiting.hears_doorbells());
        assert!(
            rung_awake(took),
            "round {round} ({}): the waiter was not rung awake within 3 s \
             (took {took:?}; poll is 10 s); bells directory recreated by the \
             waiter: {recreated}",
            b.url
        );
        if round == 0 {
            remove_bells(&b.db);
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
    let b = TwoBackends::on(db_path("doorbell-recreated"), "?poll=10s").await;
    // "Another process": a backend of its own, with its own watcher.
    let (_other, other) = backend(&b.url).await;
    let key = unique_key("doorbell-doorbell-recreated");
    let other_key = unique_key("doorbell-doorbell-recreated-other");

    let queued = b.queue(&key).await;
    assert!(b.waiting.hears_doorbells());

    remove_bells(&b.db);
    // Let the watcher hear it (and wake its waiter, which finds the key busy).
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Another process's first waiter creates the directory again.
    let other_guard = hold(&b.holder, &other_key).await;
    assert!(
        finds_busy(&other, &other_key, Duration::from_millis(50)).await,
        "the other key was not busy"
    );
    assert!(bells_dir(&b.db).is_dir(), "the other waiter made the bells");
    other_guard.release().await.expect("release");

    let took = queued.release().await;
    assert!(
        rung_awake(took),
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
    let b = TwoBackends::on(db_path("doorbell-unavailable"), "?poll=10s").await;
    let key = unique_key("doorbell-doorbell-unavailable");

    std::fs::write(bells_dir(&b.db), b"stray").expect("block the bells");
    let guard = hold(&b.holder, &key).await;
    assert!(finds_busy(&b.waiter, &key, Duration::from_millis(30)).await);
    assert!(!b.waiting.hears_doorbells(), "the watcher cannot exist yet");
    // The obstacle goes away; another process's waiter makes the bells. The
    // backend tries to watch again a second after it failed.
    std::fs::remove_file(bells_dir(&b.db)).expect("unblock");
    std::fs::create_dir(bells_dir(&b.db)).expect("bells");
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let queued = Queued::behind(guard, &b.waiter, &key).await;
    let hears = b.waiting.hears_doorbells();
    let took = queued.release().await;
    assert!(
        rung_awake(took),
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
