//! ZooKeeper at the end of a key's sequence counter: a server (in one JVM,
//! `tests/java/CounterEndZooKeeper.java`) whose key container's child
//! counter is set just below `2147483647`, where ZooKeeper 3.8 hands the same
//! suffix to every later child and pipelined creates get `-2147483648` and
//! up. Curator and dlock exclude each other up to the end; past it, dlock
//! sessions still never hold the key together.
#![cfg(feature = "zookeeper")]

use std::path::Path;
use std::time::Duration;

use dlock_runtime::ZooKeeperBackend;
use dlock_tests::unique_key;
use dlock_tests::zk_support::{CounterEndZk, Shared, contenders, java_programs};
use zookeeper_client::{Acls, Client, CreateMode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_two_holders_at_the_sequence_counters_end() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let mut server = CounterEndZk::start(&programs).await;
    let url = server.url("/dlock-end?session_timeout=5s");
    let first = ZooKeeperBackend::connect(&url).await.expect("connect");
    let second = ZooKeeperBackend::connect(&url).await.expect("connect");
    let key = unique_key("counter-end");
    let container = first.container_path(&format!("dlock:{key}"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let shared = Shared::new(dir.path());

    // Up to the end: Curator and two dlock sessions take turns, about 40
    // creates from 2147483547 on.
    server.set_counter(&container, i32::MAX - 100).await;
    let hosts = format!("127.0.0.1:{}", server.port);
    let dir_arg = dir.path().display().to_string();
    let mut curator = programs.curator(
        &hosts,
        &container,
        Duration::from_secs(5),
        "count",
        &[&dir_arg, "20", "3"],
    );
    assert_eq!(curator.line(Duration::from_secs(60)).await, "connected");
    let mut tasks = contenders(&first, &key, 1, 10, &shared);
    tasks.extend(contenders(&second, &key, 1, 10, &shared));
    for task in tasks {
        task.await.expect("contender");
    }
    assert_eq!(curator.line(Duration::from_secs(120)).await, "done");
    assert_eq!(curator.wait(Duration::from_secs(30)).await, Some(0));
    assert_eq!(
        *shared.overlaps.lock().unwrap(),
        0,
        "Curator and dlock overlapped"
    );
    assert_eq!(shared.counter(), 40, "lost updates up to the counter's end");
    let switches = shared.switches();
    assert!(
        switches >= 2,
        "dlock and Curator did not take turns ({switches} switches)"
    );
    shared.tokens.lock().unwrap().clear();

    // Past the end: two sessions, two tasks each (pipelined creates), 120
    // acquisitions, the last 60 or so with repeated or negative suffixes.
    let mut tasks = contenders(&first, &key, 2, 30, &shared);
    tasks.extend(contenders(&second, &key, 2, 30, &shared));
    for task in tasks {
        task.await.expect("contender");
    }
    assert_eq!(
        *shared.overlaps.lock().unwrap(),
        0,
        "two dlock holders at once"
    );
    assert_eq!(shared.counter(), 160, "lost updates past the counter's end");
    let tokens = shared.tokens.lock().unwrap().clone();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing: {tokens:?}"
    );

    // The counter is at its end: a new child still gets 2147483647.
    let admin = Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(&hosts)
        .await
        .expect("admin session");
    let (_, sequence) = admin
        .create(
            &format!("{container}/probe-"),
            b"",
            &CreateMode::EphemeralSequential.with_acls(Acls::anyone_all()),
        )
        .await
        .expect("probe");
    assert_eq!(sequence.into_i64(), i64::from(i32::MAX));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_two_holders_when_the_sequence_counter_wraps() {
    let Some(programs) = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR"))) else {
        return;
    };
    let mut server = CounterEndZk::start(&programs).await;
    let url = server.url("/dlock-wrap?session_timeout=5s");
    let first = ZooKeeperBackend::connect(&url).await.expect("connect");
    let second = ZooKeeperBackend::connect(&url).await.expect("connect");
    let key = unique_key("counter-wrap");
    let container = first.container_path(&format!("dlock:{key}"));
    let dir = tempfile::tempdir().expect("temporary directory");
    let shared = Shared::new(dir.path());

    // A holder on 2147483646; waiters queue behind it on 2147483647 (all
    // of them: ZooKeeper 3.8 keeps the counter there).
    server.set_counter(&container, i32::MAX - 1).await;
    let locks = dlock_runtime::Registry::builder()
        .default_backend(first.clone())
        .build();
    let holder = locks.lock(&key).acquire().await.expect("acquire");
    let mut tasks = contenders(&first, &key, 2, 15, &shared);
    tasks.extend(contenders(&second, &key, 2, 15, &shared));
    let hosts = format!("127.0.0.1:{}", server.port);
    let admin = Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(&hosts)
        .await
        .expect("admin session");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while admin
        .list_children(&container)
        .await
        .expect("children")
        .len()
        < 5
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the waiters did not queue"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The counter wraps, as on servers that let it: the next children get
    // -2147483648 and up, behind the queued 2147483647s.
    server.set_counter(&container, i32::MIN).await;
    holder.release().await.expect("release");
    for task in tasks {
        task.await.expect("contender");
    }
    assert_eq!(
        *shared.overlaps.lock().unwrap(),
        0,
        "two dlock holders at once"
    );
    assert_eq!(shared.counter(), 60, "lost updates across the wrap");
    let tokens = shared.tokens.lock().unwrap().clone();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing: {tokens:?}"
    );
    let (_, sequence) = admin
        .create(
            &format!("{container}/probe-"),
            b"",
            &CreateMode::EphemeralSequential.with_acls(Acls::anyone_all()),
        )
        .await
        .expect("probe");
    assert!(sequence.into_i64() < 0, "the counter wrapped: {sequence}");
}
