//! dlock and Apache Curator's `InterProcessMutex` (Debian's
//! `libcurator-recipes-java`, run by `tests/java/CuratorLocker.java`) on one
//! key of the test server: they exclude each other, and each takes over from
//! the other's crashed holder once its session has expired.
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
