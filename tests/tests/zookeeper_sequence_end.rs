//! ZooKeeper at the end of a key's sequence counter: a server (in one JVM,
//! `tests/java/CounterEndZooKeeper.java`) whose key container's child
//! counter is set just below `2147483647`, where ZooKeeper 3.8 hands the same
//! suffix to every later child and pipelined creates get `-2147483648` and
//! up. Curator and dlock exclude each other up to the end; past it, dlock
//! sessions still never hold the key together.
#![cfg(feature = "zookeeper")]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::ZooKeeperBackend;
use dlock_tests::unique_key;
use dlock_tests::zk_support::{CounterEndZk, JavaPrograms, Shared, contenders, java_programs};
use tokio::task::JoinHandle;
use zookeeper_client::{Acls, Client, CreateMode};

/// A key at the end of its sequence counter: the server, two dlock sessions
/// on it, the key's container, and the counter file the contenders share.
struct CounterEnd {
    programs: JavaPrograms,
    server: CounterEndZk,
    first: ZooKeeperBackend,
    second: ZooKeeperBackend,
    key: String,
    container: String,
    dir: tempfile::TempDir,
    shared: Arc<Shared>,
}

impl CounterEnd {
    /// The server, under the chroot `/dlock-{name}`, and the key
    /// `counter-{name}`; `None` without Java (`java_programs` says why).
    async fn start(name: &str) -> Option<CounterEnd> {
        let programs = java_programs(Path::new(env!("CARGO_TARGET_TMPDIR")))?;
        let server = CounterEndZk::start(&programs).await;
        let url = server.url(&format!("/dlock-{name}?session_timeout=5s"));
        let first = ZooKeeperBackend::connect(&url).await.expect("connect");
        let second = ZooKeeperBackend::connect(&url).await.expect("connect");
        let key = unique_key(&format!("counter-{name}"));
        let container = first.container_path(&format!("dlock:{key}"));
        let dir = tempfile::tempdir().expect("temporary directory");
        let shared = Shared::new(dir.path());
        Some(CounterEnd {
            programs,
            server,
            first,
            second,
            key,
            container,
            dir,
            shared,
        })
    }

    /// The server's `host:port`.
    fn hosts(&self) -> String {
        format!("127.0.0.1:{}", self.server.port)
    }

    /// A session of its own, as an operator's.
    async fn admin(&self) -> Client {
        Client::connector()
            .with_session_timeout(Duration::from_secs(5))
            .connect(&self.hosts())
            .await
            .expect("admin session")
    }

    /// Starts `tasks` contenders taking `turns` turns each on each dlock
    /// session.
    fn contenders(&self, tasks: usize, turns: usize) -> Vec<JoinHandle<()>> {
        let mut all = contenders(&self.first, &self.key, tasks, turns, &self.shared);
        all.extend(contenders(
            &self.second,
            &self.key,
            tasks,
            turns,
            &self.shared,
        ));
        all
    }

    /// Runs [`Self::contenders`] to the end.
    async fn contend(&self, tasks: usize, turns: usize) {
        finish(self.contenders(tasks, turns)).await;
    }

    /// No two dlock holders were ever inside at once, the counter is
    /// `expected` (no lost update), and the tokens increased.
    fn assert_exclusive(&self, expected: u64, what: &str) {
        assert_eq!(
            *self.shared.overlaps.lock().unwrap(),
            0,
            "two dlock holders at once"
        );
        assert_eq!(self.shared.counter(), expected, "lost updates {what}");
        let tokens = self.shared.tokens.lock().unwrap().clone();
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "tokens not increasing: {tokens:?}"
        );
    }
}

/// Waits for every contender to end.
async fn finish(contenders: Vec<JoinHandle<()>>) {
    for task in contenders {
        task.await.expect("contender");
    }
}

/// The sequence number ZooKeeper gives a new child of `container` now.
async fn probe(admin: &Client, container: &str) -> i64 {
    let (_, sequence) = admin
        .create(
            &format!("{container}/probe-"),
            b"",
            &CreateMode::EphemeralSequential.with_acls(Acls::anyone_all()),
        )
        .await
        .expect("probe");
    sequence.into_i64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_two_holders_at_the_sequence_counters_end() {
    let Some(mut end) = CounterEnd::start("end").await else {
        return;
    };

    // Up to the end: Curator and two dlock sessions take turns, about 40
    // creates from 2147483547 on.
    end.server.set_counter(&end.container, i32::MAX - 100).await;
    let dir_arg = end.dir.path().display().to_string();
    let mut curator = end.programs.curator(
        &end.hosts(),
        &end.container,
        Duration::from_secs(5),
        "count",
        &[&dir_arg, "20", "3"],
    );
    assert_eq!(curator.line(Duration::from_secs(60)).await, "connected");
    end.contend(1, 10).await;
    assert_eq!(curator.line(Duration::from_secs(120)).await, "done");
    assert_eq!(curator.wait(Duration::from_secs(30)).await, Some(0));
    assert_eq!(
        *end.shared.overlaps.lock().unwrap(),
        0,
        "Curator and dlock overlapped"
    );
    assert_eq!(
        end.shared.counter(),
        40,
        "lost updates up to the counter's end"
    );
    let switches = end.shared.switches();
    assert!(
        switches >= 2,
        "dlock and Curator did not take turns ({switches} switches)"
    );
    end.shared.tokens.lock().unwrap().clear();

    // Past the end: two sessions, two tasks each (pipelined creates), 120
    // acquisitions, the last 60 or so with repeated or negative suffixes.
    end.contend(2, 30).await;
    end.assert_exclusive(160, "past the counter's end");

    // The counter is at its end: a new child still gets 2147483647.
    let admin = end.admin().await;
    assert_eq!(probe(&admin, &end.container).await, i64::from(i32::MAX));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_two_holders_when_the_sequence_counter_wraps() {
    let Some(mut end) = CounterEnd::start("wrap").await else {
        return;
    };

    // A holder on 2147483646; waiters queue behind it on 2147483647 (all
    // of them: ZooKeeper 3.8 keeps the counter there).
    end.server.set_counter(&end.container, i32::MAX - 1).await;
    let locks = dlock_runtime::Registry::builder()
        .default_backend(end.first.clone())
        .build();
    let holder = locks.lock(&end.key).acquire().await.expect("acquire");
    let contending = end.contenders(2, 15);
    let admin = end.admin().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while admin
        .list_children(&end.container)
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
    end.server.set_counter(&end.container, i32::MIN).await;
    holder.release().await.expect("release");
    finish(contending).await;
    end.assert_exclusive(60, "across the wrap");
    let sequence = probe(&admin, &end.container).await;
    assert!(sequence < 0, "the counter wrapped: {sequence}");
}
