//! dlock and Apache Curator's `InterProcessMutex`, `InterProcessSemaphoreV2`
//! and `InterProcessReadWriteLock` (Debian's `libcurator-recipes-java`, run
//! by `tests/java/CuratorLocker.java`) on one key of the test server: they
//! exclude each other, each takes over from the other's crashed holder once
//! its session has expired, permit holders of both never exceed the permits,
//! and readers and writers of both keep the read-write invariant.
#![cfg(feature = "zookeeper")]

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, Registry, ZooKeeperBackend};
use dlock_tests::zk_support::{Shared, contenders, hosts, java_programs, url};
use dlock_tests::{servers_missing, unique_key};
use tokio::io::AsyncBufReadExt as _;

/// The session timeout of both sides' crashable holders.
const SESSION: Duration = Duration::from_secs(2);

async fn backend(query: &str) -> ZooKeeperBackend {
    let url = format!("{}{query}", url());
    ZooKeeperBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlock_and_curator_increment_one_counter_without_lost_updates() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let zk = backend("").await;
    let key = unique_key("curator-counter");
    let container = zk.container_path(&format!("dlock:{key}"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let shared = Shared::new(dir.path());
    let dir_arg = dir.path().display().to_string();
    let mut curator = programs.curator(
        &hosts(&url()),
        &container,
        Duration::from_secs(10),
        "count",
        &[&dir_arg, "30", "3"],
    );
    assert_eq!(curator.line(Duration::from_secs(60)).await, "connected");
    for task in contenders(&zk, &key, 2, 15, &shared) {
        task.await.expect("contender");
    }
    assert_eq!(curator.line(Duration::from_secs(120)).await, "done");
    assert_eq!(curator.wait(Duration::from_secs(30)).await, Some(0));
    assert_eq!(
        *shared.overlaps.lock().unwrap(),
        0,
        "Curator and dlock overlapped"
    );
    assert_eq!(shared.counter(), 60, "lost updates");
    let switches = shared.switches();
    assert!(
        switches >= 2,
        "dlock and Curator did not take turns ({switches} switches)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_curator_holder_is_taken_over_after_its_session_timeout() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let zk = backend("").await;
    let locks = Registry::builder().default_backend(zk.clone()).build();
    let key = unique_key("curator-crash");
    let container = zk.container_path(&format!("dlock:{key}"));
    let mut holder = programs.curator(&hosts(&url()), &container, SESSION, "hold", &[]);
    assert_eq!(holder.line(Duration::from_secs(60)).await, "connected");
    assert_eq!(holder.line(Duration::from_secs(30)).await, "held");
    let busy = locks.lock(&key).wait(Duration::ZERO).acquire().await;
    assert!(
        matches!(busy, Err(LockError::Busy { .. })),
        "Curator holds the key: {busy:?}"
    );
    holder.kill().await;
    let killed = Instant::now();
    let guard = locks
        .lock(&key)
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .expect("taken over after the Curator session expired");
    let waited = killed.elapsed();
    assert!(
        waited >= SESSION / 2,
        "taken over {waited:?} after the crash, before the session could expire"
    );
    guard.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_dlock_holder_is_taken_over_by_curator_after_its_session_timeout() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let zk = backend("").await;
    let key = unique_key("dlock-crash");
    let container = zk.container_path(&format!("dlock:{key}"));
    let mut holder = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlock-zk-holder"))
        .arg(format!("{}?session_timeout={}s", url(), SESSION.as_secs()))
        .arg(&key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start dlock-zk-holder");
    let mut lines = tokio::io::BufReader::new(holder.stdout.take().expect("stdout")).lines();
    let held = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("dlock-zk-holder holds in time")
        .expect("its output")
        .expect("a line");
    assert!(held.starts_with("held "), "{held}");

    let mut early = programs.curator(&hosts(&url()), &container, SESSION, "acquire", &["500"]);
    assert_eq!(early.line(Duration::from_secs(60)).await, "connected");
    assert_eq!(early.line(Duration::from_secs(30)).await, "timeout");
    assert_eq!(early.wait(Duration::from_secs(30)).await, Some(3));

    let mut taker = programs.curator(&hosts(&url()), &container, SESSION, "acquire", &["30000"]);
    assert_eq!(taker.line(Duration::from_secs(60)).await, "connected");
    holder.kill().await.expect("SIGKILL the dlock holder");
    let killed = Instant::now();
    assert_eq!(taker.line(Duration::from_secs(40)).await, "held");
    let waited = killed.elapsed();
    assert!(
        waited >= SESSION / 2,
        "taken over {waited:?} after the crash, before the session could expire"
    );
    assert_eq!(taker.wait(Duration::from_secs(30)).await, Some(0));
}

/// One dlock holder's turn in `dir`, as `CuratorLocker.java`'s `inside`:
/// `kind` is `p` (a permit of `permits`), `r` (a reader) or `w` (a writer).
/// Returns whether it overlapped a holder it must exclude.
async fn inside(dir: &Path, kind: &str, permits: usize, hold: Duration) -> bool {
    let mine = dir.join(format!("in-{kind}-{:032x}", rand::random::<u128>()));
    std::fs::File::create_new(&mine).expect("marker");
    let others: Vec<String> = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("in-") && *n != mine.file_name().unwrap().to_string_lossy())
        .collect();
    let overlap = match kind {
        "p" => others.iter().filter(|n| n.starts_with("in-p-")).count() + 1 > permits,
        "r" => others.iter().any(|n| n.starts_with("in-w-")),
        _ => !others.is_empty(),
    };
    let mut turns = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("turns"))
        .expect("turns");
    std::io::Write::write_all(&mut turns, b"d").expect("turn");
    tokio::time::sleep(hold).await;
    std::fs::remove_file(&mine).expect("marker gone");
    overlap
}

fn turns(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("turns")).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_dlock_permit_holders_never_exceed_the_permits() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let zk = backend("").await;
    let locks = Registry::builder().default_backend(zk.clone()).build();
    let key = unique_key("curator-permits");
    let container = zk.container_path(&format!("dlock:{key}"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let dir_arg = dir.path().display().to_string();
    let mut curators = Vec::new();
    for _ in 0..2 {
        let mut curator = programs.curator(
            &hosts(&url()),
            &container,
            Duration::from_secs(10),
            "permits",
            &[&dir_arg, "12", "20", "2"],
        );
        assert_eq!(curator.line(Duration::from_secs(60)).await, "connected");
        curators.push(curator);
    }
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (locks, key, dir) = (locks.clone(), key.clone(), dir.path().to_owned());
        tasks.push(tokio::spawn(async move {
            let mut overlaps = 0;
            for _ in 0..8 {
                let guard = locks
                    .lock(&key)
                    .permits(2)
                    .wait(Duration::from_secs(60))
                    .acquire()
                    .await
                    .expect("a permit");
                overlaps += usize::from(inside(&dir, "p", 2, Duration::from_millis(20)).await);
                guard.release().await.expect("release");
            }
            overlaps
        }));
    }
    let mut overlaps = 0;
    for task in tasks {
        overlaps += task.await.expect("dlock holder");
    }
    for mut curator in curators {
        assert_eq!(curator.line(Duration::from_secs(120)).await, "done");
        assert_eq!(curator.wait(Duration::from_secs(30)).await, Some(0));
    }
    assert_eq!(overlaps, 0, "more than 2 permit holders at once");
    let turns = turns(dir.path());
    assert_eq!(turns.matches('c').count(), 24, "{turns}");
    assert_eq!(turns.matches('d').count(), 24, "{turns}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_dlock_readers_and_writers_keep_the_read_write_invariant() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    // Writers named as Curator's write lock names its own.
    let zk = backend("?writers=rw").await;
    let locks = Registry::builder().default_backend(zk.clone()).build();
    let key = unique_key("curator-rw");
    let container = zk.container_path(&format!("dlock:{key}"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let dir_arg = dir.path().display().to_string();
    let mut curators = Vec::new();
    for role in ["read", "read", "write"] {
        let mut curator = programs.curator(
            &hosts(&url()),
            &container,
            Duration::from_secs(10),
            "rw",
            &[&dir_arg, "10", "20", role],
        );
        assert_eq!(curator.line(Duration::from_secs(60)).await, "connected");
        curators.push(curator);
    }
    let mut tasks = Vec::new();
    for kind in ["r", "r", "w"] {
        let (locks, key, dir) = (locks.clone(), key.clone(), dir.path().to_owned());
        tasks.push(tokio::spawn(async move {
            let mut overlaps = 0;
            for _ in 0..8 {
                let builder = locks.lock(&key).wait(Duration::from_secs(60));
                let builder = if kind == "r" {
                    builder.read()
                } else {
                    builder.write()
                };
                let guard = builder.acquire().await.expect("the lock");
                overlaps += usize::from(inside(&dir, kind, 0, Duration::from_millis(20)).await);
                guard.release().await.expect("release");
            }
            overlaps
        }));
    }
    let mut overlaps = 0;
    for task in tasks {
        overlaps += task.await.expect("dlock holder");
    }
    for mut curator in curators {
        assert_eq!(curator.line(Duration::from_secs(120)).await, "done");
        assert_eq!(curator.wait(Duration::from_secs(30)).await, Some(0));
    }
    assert_eq!(overlaps, 0, "a writer beside another holder");
    let turns = turns(dir.path());
    assert_eq!(turns.matches('c').count(), 30, "{turns}");
    assert_eq!(turns.matches('d').count(), 24, "{turns}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlock_writers_wait_for_curator_readers_under_either_writer_name() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    for query in ["", "?writers=rw"] {
        let zk = backend(query).await;
        let locks = Registry::builder().default_backend(zk.clone()).build();
        let key = unique_key("curator-reader-holds");
        let container = zk.container_path(&format!("dlock:{key}"));
        let dir = tempfile::tempdir().expect("temporary directory");
        let dir_arg = dir.path().display().to_string();
        let mut reader = programs.curator(
            &hosts(&url()),
            &container,
            Duration::from_secs(10),
            "rw",
            &[&dir_arg, "1", "1500", "read"],
        );
        assert_eq!(reader.line(Duration::from_secs(60)).await, "connected");
        while !turns(dir.path()).contains('c') {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let busy = locks.lock(&key).acquire().await;
        assert!(
            matches!(busy, Err(LockError::Busy { .. })),
            "{query}: {busy:?}"
        );
        let shared = locks
            .lock(&key)
            .read()
            .acquire()
            .await
            .expect("readers share");
        shared.release().await.expect("release");
        let writer = locks
            .lock(&key)
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .expect("the writer after the Curator reader");
        assert_eq!(
            reader.line(Duration::from_secs(30)).await,
            "done",
            "{query}"
        );
        writer.release().await.expect("release");
    }
}
