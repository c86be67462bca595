//! SQLite's doorbells: a release in one process wakes waiters in another
//! through a file-change notification on `<database>.dlock-bells/`, not the
//! polling interval; the bells fall back to polling when they cannot be
//! watched, stay bounded, and keep no registration of a cancelled waiter.
//!
//! The handoff test uses real processes (this test binary run again as a
//! child). The others use two `SqliteBackend`s opened separately on one file
//! in this process: each has its own local waiters and its own watcher, so a
//! release by one reaches the other's waiters only as a release by another
//! process would — through the bell, or the poll.
#![cfg(feature = "sqlite")]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock_runtime::{Registry, SqliteBackend};
use dlock_tests::unique_key;

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos()
}

/// A fresh database path of this test's own.
fn db_path(case: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("doorbell-{case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    dir.join("locks.db")
}

fn bells_dir(db: &Path) -> PathBuf {
    let mut dir = db.as_os_str().to_owned();
    dir.push(".dlock-bells");
    dir.into()
}

async fn backend(url: &str) -> (SqliteBackend, Registry) {
    let backend = SqliteBackend::connect(url).await.expect("open sqlite");
    let registry = Registry::builder().default_backend(backend.clone()).build();
    (backend, registry)
}

/// The child's side of the handoff test, chosen by `DLOCK_DOORBELL_CHILD`:
/// takes and releases the key on command from stdin (`acquire`, `release`),
/// answering `HELD` and `RELEASING <unix ns before the release>`, `RELEASED`.
#[test]
fn child_process_entry() {
    let Ok(url) = std::env::var("DLOCK_DOORBELL_CHILD") else {
        return;
    };
    let key = std::env::var("DLOCK_DOORBELL_KEY").expect("key");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let (_backend, registry) = backend(&url).await;
        let mut guard = None;
        let mut out = std::io::stdout();
        for line in std::io::stdin().lock().lines() {
            match line.expect("stdin").trim() {
                "acquire" => {
                    let held = registry
                        .lock(&key)
                        .lease(Duration::from_secs(30))
                        .wait(Duration::from_secs(10))
                        .acquire()
                        .await
                        .expect("the child acquires");
                    guard = Some(held);
                    writeln!(out, "HELD").expect("stdout");
                }
                "release" => {
                    let held = guard.take().expect("held");
                    writeln!(out, "RELEASING {}", unix_ns()).expect("stdout");
                    out.flush().expect("stdout");
                    held.release().await.expect("the child releases");
                    writeln!(out, "RELEASED").expect("stdout");
                }
                other => panic!("unknown command {other}"),
            }
            out.flush().expect("stdout");
        }
    });
}

/// Reads the child's lines until one holds `marker`; returns what follows it
/// (the child's test harness prints its own text first, on the same line).
fn expect_line(out: &mut impl BufRead, marker: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).expect("read the child") > 0,
            "the child ended before saying {marker}"
        );
        if let Some((_, rest)) = line.trim_end().split_once(marker) {
            return rest.trim().to_owned();
        }
    }
}

/// A holder in another process releases; a waiter here, which would look
/// again only every 10 s (`?poll=10s`) and whose holder's lease runs for
/// 30 s, takes the key within 1 s: only the doorbell can have woken it.
/// Prints the median handoff of 20 rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_release_rings_the_waiter_awake() {
    let db = db_path("handoff");
    let url = format!("sqlite://{}?poll=10s", db.display());
    let (waiting, registry) = backend(&url).await;
    let key = unique_key("doorbell-handoff");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "child_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DLOCK_DOORBELL_CHILD", &url)
        .env("DLOCK_DOORBELL_KEY", &key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the holder");
    let mut to_child = child.stdin.take().expect("stdin");
    let mut from_child = BufReader::new(child.stdout.take().expect("stdout"));

    let rounds = 20;
    let mut handoffs = Vec::with_capacity(rounds);
    for round in 0..rounds {
        writeln!(to_child, "acquire").expect("tell the child");
        to_child.flush().expect("tell the child");
        expect_line(&mut from_child, "HELD");

        let waiter = {
            let registry = registry.clone();
            let key = key.clone();
            tokio::spawn(async move {
                let guard = registry
                    .lock(&key)
                    .lease(Duration::from_secs(30))
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await;
                (guard, unix_ns())
            })
        };
        // Let the waiter find the key busy and go to sleep.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "round {round}: the key was not busy");

        writeln!(to_child, "release").expect("tell the child");
        to_child.flush().expect("tell the child");
        let released_at: u128 = expect_line(&mut from_child, "RELEASING")
            .parse()
            .expect("a time");
        expect_line(&mut from_child, "RELEASED");
        let (guard, acquired_at) = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter ends")
            .expect("the waiter's task");
        let guard = guard.expect("the waiter acquires");
        let handoff = Duration::from_nanos(acquired_at.saturating_sub(released_at) as u64);
        assert!(
            handoff < Duration::from_secs(1),
            "round {round}: the waiter took {handoff:?}: it was not rung awake (poll is 10 s)"
        );
        handoffs.push(handoff);
        guard.release().await.expect("release");
    }
    assert!(waiting.hears_doorbells());
    drop(to_child);
    assert!(child.wait().expect("the child ends").success());

    handoffs.sort();
    println!(
        "sqlite doorbell: cross-process handoff over {rounds} rounds: \
         median {:?}, min {:?}, max {:?}",
        handoffs[rounds / 2],
        handoffs[0],
        handoffs[rounds - 1]
    );
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
    let busy = waiter
        .lock(&key)
        .wait(Duration::from_millis(100))
        .acquire()
        .await;
    assert!(busy.is_err());
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
            std::fs::remove_dir_all(bells_dir(&db)).expect("remove the bells");
            // Let the watcher hear that its directory is gone.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
