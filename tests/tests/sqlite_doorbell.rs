//! SQLite's doorbells wake waiters: a release in another process wakes a
//! waiter through a file-change notification on `<database>.dlock-bells/`,
//! not the polling interval; so does a release racing the first waiter's
//! watch, a release of another key of the same bucket, and a release by a
//! backend that opened the database through a symbolic link; a bell that
//! hangs stalls no lock.
//!
//! Every waiter here looks again only every 10 s (`?poll=10s`) and its
//! holder's lease runs 30 s, so a waiter that takes the key within a second
//! of a release was rung awake. The handoff test uses real processes (this
//! test binary run again as a child); the others use `SqliteBackend`s opened
//! separately on one file in this process: each has its own local waiters and
//! its own watcher, so a release by one reaches the other's waiters only as a
//! release by another process would.
#![cfg(feature = "sqlite")]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock_tests::doorbell_support::{
    self, Queued, TwoBackends, backend, bell_path, bells_dir, bucket, finds_busy, handoff,
    in_child_process, rung_awake, spawn_waiter,
};
use dlock_tests::{hold, unique_key};

/// A fresh database path of this test's own.
fn db_path(case: &str) -> PathBuf {
    doorbell_support::db_path(Path::new(env!("CARGO_TARGET_TMPDIR")), case)
}

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos()
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

    let handoffs = dlock_tests::handoff::Handoffs::sorted(handoffs);
    println!(
        "sqlite doorbell: cross-process handoff over {rounds} rounds: \
         median {:?}, min {:?}, max {:?}",
        handoffs.median(),
        handoffs.0[0],
        handoffs.0[rounds - 1]
    );
}

/// One database, opened as `real.db` by the waiter and through a symlink
/// `link.db -> real.db` by the holder (SQLite resolves the link: one file, one
/// WAL, one lease table): the bells are named after the database file, so the
/// holder's release rings the waiter awake. A hard link is the same case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_opened_through_a_symlink_rings_the_same_bells() {
    let db = db_path("doorbell-symlink");
    let link = db.with_file_name("link.db");
    let (waiting, waiter) = backend(&format!("sqlite://{}?poll=10s", db.display())).await;
    std::os::unix::fs::symlink(&db, &link).expect("symlink");
    let (_holding, holder) = backend(&format!("sqlite://{}?poll=10s", link.display())).await;
    let key = unique_key("doorbell-doorbell-symlink");

    let guard = hold(&holder, &key).await;
    // One lease table: the waiter sees the holder's lease.
    assert!(
        finds_busy(&waiter, &key, Duration::from_millis(20)).await,
        "both paths are one database"
    );
    let queued = Queued::behind(guard, &waiter, &key).await;
    assert!(waiting.hears_doorbells());
    let took = queued.release().await;
    assert!(
        rung_awake(took),
        "a release through {} did not ring the waiter on {} within 3 s (took \
         {took:?}; poll is 10 s); bells: {:?}",
        link.display(),
        db.display(),
        std::fs::read_dir(db.parent().expect("dir"))
            .expect("dir")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".dlock-bells"))
            .collect::<Vec<_>>()
    );
}

/// A bell whose `open` blocks (here a FIFO, standing in for a hung or very
/// slow filesystem: NFS, FUSE) stalls no lock: rings go through a thread of
/// their own, so other locks of the process, on every database, and the
/// watchdog go on, and no lease of another lock is lost. Runs in a child
/// process (a stall would disturb the other tests).
#[test]
fn a_hung_bell_stalls_no_lock() {
    let Some(rt) = in_child_process(
        "a_hung_bell_stalls_no_lock",
        "DLOCK_DOORBELL_HUNG_BELL_CHILD",
        Duration::from_secs(60),
    ) else {
        return;
    };
    rt.block_on(async {
        let db = db_path("doorbell-hung");
        let url = format!("sqlite://{}?poll=10s", db.display());
        let (_holding, holder) = backend(&url).await;
        // An unrelated database and lock in the same process.
        let other_db = db_path("doorbell-hung-other");
        let (_o, other) = backend(&format!("sqlite://{}", other_db.display())).await;
        let bystander = other
            .lock(unique_key("doorbell-hung-bystander"))
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .expect("bystander");

        let keys = [unique_key("doorbell-hung-a"), unique_key("doorbell-hung-b")];
        std::fs::create_dir_all(bells_dir(&db)).expect("bells");
        let mut fifos = Vec::new();
        for key in &keys {
            let bell = bell_path(&db, key);
            if !bell.exists() {
                let made = Command::new("mkfifo").arg(&bell).status().expect("mkfifo");
                assert!(made.success());
                fifos.push(bell);
            }
        }
        let mut releases = Vec::new();
        for key in &keys {
            let guard = hold(&holder, key).await;
            releases.push(tokio::spawn(guard.release()));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stuck = releases.iter().filter(|r| !r.is_finished()).count();
        println!(
            "releases stuck on their bell: {stuck} of {}",
            releases.len()
        );

        // Another database's lock, from the same process.
        let started = Instant::now();
        let unrelated = tokio::time::timeout(
            Duration::from_secs(2),
            other.lock(unique_key("doorbell-hung-unrelated")).acquire(),
        )
        .await;
        let unrelated_took = started.elapsed();
        let bystander_lost = bystander.is_lost();

        // Unblock the bells (a reader lets each blocked `open` go on); with
        // no ring stuck there is no writer, and opening to read would block.
        let readers: Vec<_> = if stuck > 0 {
            fifos
                .iter()
                .map(|f| std::fs::File::open(f).expect("open the FIFO to read"))
                .collect()
        } else {
            Vec::new()
        };
        for r in releases {
            let _ = tokio::time::timeout(Duration::from_secs(10), r).await;
        }
        drop(readers);
        println!(
            "unrelated acquire: {} after {unrelated_took:?}; the bystander's 1 s \
             lease lost meanwhile: {bystander_lost}",
            if unrelated.is_ok() {
                "answered"
            } else {
                "no answer"
            }
        );
        assert!(
            unrelated.is_ok(),
            "an acquire on another database got no answer within 2 s: dlock's \
             I/O runtime is blocked by the releases' bells ({stuck} releases stuck)"
        );
        assert!(
            !bystander_lost,
            "an unrelated lock's lease was lost: the watchdog could not renew it"
        );
        assert_eq!(
            stuck, 0,
            "a release hung on its bell (a FIFO: `open` blocks)"
        );
    });
}

/// The first waiter of a database creates the bells directory and adds its
/// watch while the holder (another backend: its own doorbells, as another
/// process) releases at the same moment — before the directory exists (the
/// ring is skipped), while it is being made, after. Whatever the order, the
/// waiter takes the key at once: either its second try after registering
/// sees the release, or the ring is heard (`notify`'s `watch` returns once
/// the event loop has added the inotify watch). 60 rounds, a fresh database
/// each, release delays spread over 0–3 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_racing_the_first_waiter_is_heard() {
    let mut slow = Vec::new();
    let mut took_all = Vec::new();
    for round in 0..60u64 {
        let b = TwoBackends::on(db_path(&format!("race-{round}")), "?poll=10s").await;
        let key = unique_key(&format!("doorbell-doorbell-race-{round}"));
        let guard = hold(&b.holder, &key).await;
        let waits = spawn_waiter(&b.waiter, &key);
        let delay = Duration::from_micros((round * 50) % 3000);
        std::thread::sleep(delay);
        let took = handoff(guard, waits, Duration::from_secs(3)).await;
        match took {
            Some(t) if t < Duration::from_secs(1) => took_all.push(t),
            other => slow.push((round, delay, other)),
        }
        let _ = std::fs::remove_dir_all(b.db.parent().expect("dir"));
    }
    took_all.sort();
    println!(
        "first-waiter race: {} fast, median {:?}, max {:?}",
        took_all.len(),
        took_all.get(took_all.len() / 2),
        took_all.last()
    );
    assert!(
        slow.is_empty(),
        "missed releases (round, delay, took): {slow:?}"
    );
}

/// Two keys whose stored names share a bucket (one bell file): a release of
/// either wakes both waiters (one wasted attempt), and each waiter takes its
/// key at once when its own key is released; the bucket's registration goes
/// with the last of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_keys_in_one_bucket_are_each_rung_awake() {
    let b = TwoBackends::on(db_path("doorbell-bucket"), "?poll=10s").await;
    let first = unique_key("doorbell-doorbell-bucket-0");
    let second = (1..)
        .map(|i| unique_key(&format!("doorbell-doorbell-bucket-{i}")))
        .find(|k| bucket(&format!("dlock:{k}")) == bucket(&format!("dlock:{first}")))
        .expect("a colliding key");

    let a = hold(&b.holder, &first).await;
    let second_guard = hold(&b.holder, &second).await;
    let wa = spawn_waiter(&b.waiter, &first);
    let wb = spawn_waiter(&b.waiter, &second);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(b.waiting.doorbell_waits(), 1, "one bucket for both keys");

    let took_a = handoff(a, wa, Duration::from_secs(3)).await;
    assert!(rung_awake(took_a), "{took_a:?}");
    assert!(!wb.is_finished(), "the second key is still held");
    assert_eq!(
        b.waiting.doorbell_waits(),
        1,
        "the second waiter still listens"
    );
    let took_b = handoff(second_guard, wb, Duration::from_secs(3)).await;
    assert!(rung_awake(took_b), "{took_b:?}");
    assert_eq!(b.waiting.doorbell_waits(), 0);
}
