//! Attacks on read-write locks: readers and writers racing from several
//! sessions, writer preference against a stream of readers, writers that
//! give up, token order across readers, and revocation of a key with
//! readers and a waiting writer.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{MemoryBackend, Registry};
use dlock_tests::unique_key;

/// Readers that keep overlapping (one always inside) while a writer waits:
/// the writer gets in well within its wait.
async fn a_stream_of_readers_never_starves_a_waiting_writer(
    readers: [Registry; 2],
    writer: Registry,
) {
    let key = unique_key("rw-reader-stream");
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (locks, key, stop) = (readers[i % 2].clone(), key.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(25 * i as u64)).await;
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(g) = locks
                        .lock(&key)
                        .read()
                        .wait(Duration::from_secs(30))
                        .acquire()
                        .await
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        g.release().await.expect("release");
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let granted = writer
        .lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await;
    let took = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let granted = granted.expect("the writer gets in");
    assert!(took < Duration::from_secs(5), "the writer waited {took:?}");
    granted.release().await.expect("release");
    for task in tasks {
        task.await.expect("task");
    }
}

/// A writer whose wait ran out behind a reader, and one dropped while
/// waiting, no longer keep new readers out.
async fn a_writer_that_gave_up_no_longer_holds_readers_back(locks: Registry, others: Registry) {
    let key = unique_key("rw-writer-gave-up");
    let reader = locks.lock(&key).read().acquire().await.expect("reader");
    let gave_up = others
        .lock(&key)
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    let next = locks.lock(&key).read().acquire().await;
    assert!(next.is_ok(), "a reader after the writer gave up: {next:?}");
    let dropped = tokio::time::timeout(
        Duration::from_millis(300),
        others.lock(&key).wait(Duration::from_secs(30)).acquire(),
    )
    .await;
    assert!(dropped.is_err(), "{dropped:?}");
    // The dropped writer's owner-checked release is sent in the background:
    // the next reader may wait for it, briefly.
    let started = Instant::now();
    let third = locks
        .lock(&key)
        .read()
        .wait(Duration::from_secs(5))
        .acquire()
        .await;
    let took = started.elapsed();
    assert!(
        third.is_ok(),
        "a reader after the writer was dropped: {third:?}"
    );
    assert!(
        took < Duration::from_millis(500),
        "a reader after the writer was dropped waited {took:?}"
    );
    for g in [Ok(reader), next, third] {
        g.expect("reader").release().await.expect("release");
    }
}

fn memory_registry(memory: &MemoryBackend) -> Registry {
    Registry::builder().default_backend(memory.clone()).build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_stream_of_readers_never_starves_a_waiting_writer() {
    let memory = MemoryBackend::new();
    let locks = memory_registry(&memory);
    a_stream_of_readers_never_starves_a_waiting_writer([locks.clone(), locks.clone()], locks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_writer_that_gave_up_no_longer_holds_readers_back() {
    let memory = MemoryBackend::new();
    let locks = memory_registry(&memory);
    a_writer_that_gave_up_no_longer_holds_readers_back(locks.clone(), locks).await;
}

/// Several keys in read mode and as permits: readers of the same keys share
/// them, a third permit is busy, and a several-key read that finds one key
/// written leaves no reader on the others.
async fn several_keys_in_shared_modes(one: Registry, two: Registry) {
    let (a, b) = (unique_key("rw-several-a"), unique_key("rw-several-b"));
    let r1 = one
        .lock_all([a.clone(), b.clone()])
        .read()
        .acquire()
        .await
        .expect("readers of both keys");
    let r2 = two
        .lock_all([b.clone(), a.clone()])
        .read()
        .acquire()
        .await
        .expect("other readers of both keys");
    let w = two.lock(&a).acquire().await;
    assert!(w.is_err(), "a writer beside readers: {w:?}");
    r1.release().await.expect("release");
    r2.release().await.expect("release");

    let writer = one.lock(&b).acquire().await.expect("a writer of b");
    let refused = two.lock_all([a.clone(), b.clone()]).read().acquire().await;
    assert!(refused.is_err(), "read beside a writer: {refused:?}");
    let started = Instant::now();
    let on_a = one
        .lock(&a)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("nothing of the refused reader is left on the other key");
    assert!(started.elapsed() < Duration::from_secs(2));
    on_a.release().await.expect("release");
    writer.release().await.expect("release");

    let (c, d) = (unique_key("sem-several-c"), unique_key("sem-several-d"));
    let p1 = one
        .lock_all([c.clone(), d.clone()])
        .permits(2)
        .acquire()
        .await
        .expect("p1");
    let p2 = two
        .lock_all([d.clone(), c.clone()])
        .permits(2)
        .acquire()
        .await
        .expect("p2");
    let p3 = one.lock(&c).permits(2).acquire().await;
    assert!(p3.is_err(), "a third permit: {p3:?}");
    let p3 = two
        .lock_all([c.clone(), d.clone()])
        .permits(2)
        .acquire()
        .await;
    assert!(p3.is_err(), "a third permit: {p3:?}");
    p1.release().await.expect("release");
    let p4 = one
        .lock(&d)
        .permits(2)
        .acquire()
        .await
        .expect("the freed permit of d");
    p4.release().await.expect("release");
    p2.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_several_keys_in_shared_modes() {
    let memory = MemoryBackend::new();
    let locks = memory_registry(&memory);
    several_keys_in_shared_modes(locks.clone(), locks).await;
}

/// A reader that is not renewed frees the key after its lease: a writer
/// waiting behind it gets in then, not after its whole wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_an_unrenewed_reader_lets_a_waiting_writer_in_after_its_lease() {
    let memory = MemoryBackend::new();
    let locks = memory_registry(&memory);
    let key = unique_key("mem-unrenewed-reader");
    let reader = locks
        .lock(&key)
        .read()
        .watchdog(false)
        .lease(Duration::from_millis(400))
        .acquire()
        .await
        .expect("reader");
    let started = Instant::now();
    let writer = locks
        .lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the writer after the reader's lease");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(writer.fencing_token() > reader.fencing_token());
    writer.release().await.expect("release");
}

/// A writer waiting longer than its mark's own life behind a reader keeps
/// holding new readers back the whole time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_long_waiting_writer_keeps_new_readers_out() {
    let memory = MemoryBackend::new();
    let locks = memory_registry(&memory);
    let key = unique_key("mem-long-waiting-writer");
    let reader = locks.lock(&key).read().acquire().await.expect("reader");
    let writer = {
        let (locks, key) = (locks.clone(), key.clone());
        tokio::spawn(async move {
            locks
                .lock(&key)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        })
    };
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let late = locks.lock(&key).read().acquire().await;
        assert!(late.is_err(), "a new reader while a writer waits: {late:?}");
    }
    reader.release().await.expect("release");
    let writer = tokio::time::timeout(Duration::from_secs(5), writer)
        .await
        .expect("the writer")
        .expect("task")
        .expect("granted");
    writer.release().await.expect("release");
}

/// Ten thousand keys left by crashed readers, crashed permit holders and
/// writers that vanished while waiting (their marks never removed): once
/// their leases and marks ran out, nothing of them stays in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_state_left_by_crashed_readers_permits_and_waiting_writers_is_collected() {
    use dlock_runtime::backend::{AcquireRequest, Attempt};
    use dlock_runtime::{HoldMode, LockBackend};
    let memory = MemoryBackend::new();
    let prefix = unique_key("mem-crashed-rw");
    let lease = Duration::from_secs(60);
    for i in 0..10_000 {
        let key = format!("{prefix}:{i}");
        let (first, second) = if i % 2 == 0 {
            (HoldMode::Shared, HoldMode::Exclusive)
        } else {
            let permits = HoldMode::Permit { permits: 3 };
            (permits, permits)
        };
        let held = memory
            .try_acquire(&AcquireRequest::new(key.clone(), "crashed", lease).with_mode(first))
            .await
            .expect("attempt");
        assert!(matches!(held, Attempt::Held(_)), "{held:?}");
        let other = memory
            .try_acquire(
                &AcquireRequest::new(key, "vanished", lease)
                    .with_mode(second)
                    .with_wait(Duration::from_secs(30)),
            )
            .await
            .expect("attempt");
        if i % 2 == 0 {
            assert!(matches!(other, Attempt::Busy { .. }), "{other:?}");
        }
    }
    assert!(memory.entries_under(&prefix) >= 10_000);
    memory.advance(Duration::from_secs(120));
    let locks = memory_registry(&memory);
    // A collection pass runs once the new keys number half the keys kept.
    for i in 0..6000 {
        locks
            .lock(format!("{prefix}:after:{i}"))
            .acquire()
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
    }
    let left = memory.entries_under(&prefix);
    assert!(
        left <= 2,
        "{left} entries left of the crashed holders and marks"
    );
}

#[cfg(feature = "zookeeper")]
mod zookeeper {
    use super::*;
    use dlock_runtime::ZooKeeperBackend;
    use dlock_testkit::proxy::Fault;
    use dlock_tests::servers_missing;
    use dlock_tests::zk_support::{ZkProxy, admin, children, port, url};

    async fn connect(url: &str) -> ZooKeeperBackend {
        ZooKeeperBackend::connect(url)
            .await
            .unwrap_or_else(|e| servers_missing(url, e))
    }

    async fn backend() -> ZooKeeperBackend {
        connect(&url()).await
    }

    fn registry(backend: &ZooKeeperBackend) -> Registry {
        Registry::builder().default_backend(backend.clone()).build()
    }

    async fn nodes(zk: &ZooKeeperBackend, key: &str) -> Vec<String> {
        let admin = admin(&url()).await;
        children(&admin, &zk.container_path(&format!("dlock:{key}"))).await
    }

    async fn until_nodes(zk: &ZooKeeperBackend, key: &str, n: usize) {
        let until = Instant::now() + Duration::from_secs(5);
        while nodes(zk, key).await.len() != n {
            assert!(Instant::now() < until, "{:?}", nodes(zk, key).await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_a_stream_of_readers_never_starves_a_waiting_writer() {
        let (a, b, c) = (backend().await, backend().await, backend().await);
        a_stream_of_readers_never_starves_a_waiting_writer(
            [registry(&a), registry(&b)],
            registry(&c),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_a_writer_that_gave_up_no_longer_holds_readers_back() {
        let (a, b) = (backend().await, backend().await);
        a_writer_that_gave_up_no_longer_holds_readers_back(registry(&a), registry(&b)).await;
        // Nothing of the writer is left on the key.
    }

    /// A reader and a plain lock racing on a fresh key from two sessions
    /// are never both granted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_and_a_writer_racing_on_two_sessions_never_both_hold() {
        let (one, two) = (backend().await, backend().await);
        let (one, two) = (registry(&one), registry(&two));
        for round in 0..30 {
            let key = unique_key(&format!("zk-rw-race-{round}"));
            let (read, write) =
                tokio::join!(one.lock(&key).read().acquire(), two.lock(&key).acquire());
            assert!(
                !(read.is_ok() && write.is_ok()),
                "round {round}: a reader beside a writer"
            );
            for g in [read, write].into_iter().flatten() {
                g.release().await.expect("release");
            }
        }
    }

    /// Two readers queued behind a writer: the one whose connection is slow
    /// is granted after the other one came and went, and its token must
    /// still be the larger (every grant takes a token from the key's one
    /// sequence).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_granted_after_another_reader_finished_has_the_larger_token() {
        let proxy = ZkProxy::start(port(&url())).await;
        let slow_zk = connect(&format!("zk://127.0.0.1:{}/dlock-test", proxy.port())).await;
        let fast_zk = backend().await;
        let (slow, fast) = (registry(&slow_zk), registry(&fast_zk));
        let key = unique_key("zk-rw-reader-order");
        let writer = fast.lock(&key).acquire().await.expect("writer");
        let slow_reader = {
            let (slow, key) = (slow.clone(), key.clone());
            tokio::spawn(async move {
                let g = slow
                    .lock(&key)
                    .read()
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
                    .expect("the slow reader");
                (Instant::now(), g)
            })
        };
        until_nodes(&fast_zk, &key, 2).await;
        let fast_reader = {
            let (fast, key) = (fast.clone(), key.clone());
            tokio::spawn(async move {
                fast.lock(&key)
                    .read()
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
                    .expect("the fast reader")
            })
        };
        until_nodes(&fast_zk, &key, 3).await;
        proxy.set(Fault::Delay(Duration::from_millis(500)));
        writer.release().await.expect("release the writer");
        let fast_guard = fast_reader.await.expect("task");
        let fast_token = fast_guard.fencing_token().expect("token");
        fast_guard.release().await.expect("release");
        let finished = Instant::now();
        let (granted_at, slow_guard) = slow_reader.await.expect("task");
        proxy.set(Fault::Pass);
        assert!(granted_at > finished, "the slow reader was granted first");
        let slow_token = slow_guard.fencing_token().expect("token");
        assert!(
            slow_token > fast_token,
            "granted after the other reader finished, with token {slow_token:?} <= {fast_token:?}"
        );
        slow_guard.release().await.expect("release");
    }

    /// Revoking a key held by two readers while a writer waits: both
    /// readers hear of it, and the writer is then granted with a token
    /// larger than theirs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn revoking_readers_with_a_waiting_writer_lets_the_writer_in_with_a_larger_token() {
        let (a, b) = (backend().await, backend().await);
        let (readers, writers) = (registry(&a), registry(&b));
        let key = unique_key("zk-rw-revoke");
        // Short leases: a revoked holder hears of it at its next renewal.
        let reader = || readers.lock(&key).read().lease(Duration::from_secs(3));
        let r1 = reader().acquire().await.expect("r1");
        let r2 = reader().acquire().await.expect("r2");
        let writer = {
            let (writers, key) = (writers.clone(), key.clone());
            tokio::spawn(async move {
                writers
                    .lock(&key)
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await
            })
        };
        until_nodes(&a, &key, 3).await;
        let admin = readers.admin(None).expect("admin");
        let info = admin.inspect(&key).await.expect("inspect").expect("held");
        assert_eq!(info.holders().len(), 2, "{info:?}");
        assert!(info.holders().iter().all(|h| h.is_reader()), "{info:?}");
        let revoked = admin.revoke(&key).await.expect("revoke");
        assert!(revoked.len() >= 2, "{revoked:?}");
        for r in [&r1, &r2] {
            tokio::time::timeout(Duration::from_secs(10), r.lost())
                .await
                .expect("a revoked reader hears of it");
        }
        let w = tokio::time::timeout(Duration::from_secs(10), writer)
            .await
            .expect("the writer within 10 s")
            .expect("task")
            .expect("the writer is granted");
        let top = [&r1, &r2]
            .iter()
            .filter_map(|r| r.fencing_token())
            .max()
            .expect("tokens");
        assert!(w.fencing_token().expect("token") > top);
        w.release().await.expect("release");
        drop((r1, r2));
    }

    /// Writers and readers dropped 0–50 ms after they start waiting (a
    /// writer behind readers, a reader behind a writer) leave no node on
    /// the key: once the holders leave, the other side enters at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiters_dropped_at_any_moment_leave_no_node() {
        let (holding_zk, waiting_zk) = (backend().await, backend().await);
        let (holding, waiting) = (registry(&holding_zk), registry(&waiting_zk));
        for readers_hold in [true, false] {
            let key = unique_key("zk-rw-dropped");
            let holder = if readers_hold {
                holding.lock(&key).read().acquire().await
            } else {
                holding.lock(&key).acquire().await
            }
            .expect("holder");
            for step in 0..26u64 {
                let builder = waiting.lock(&key).wait(Duration::from_secs(10));
                let builder = if readers_hold {
                    builder
                } else {
                    builder.read()
                };
                let out =
                    tokio::time::timeout(Duration::from_millis(step * 2), builder.acquire()).await;
                assert!(!matches!(out, Ok(Ok(_))), "granted beside the holder");
            }
            let until = Instant::now() + Duration::from_secs(5);
            loop {
                let now = nodes(&holding_zk, &key).await;
                if now.len() == 1 {
                    break;
                }
                assert!(Instant::now() < until, "nodes left behind: {now:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if readers_hold {
                let more = waiting.lock(&key).read().acquire().await;
                assert!(more.is_ok(), "a reader beside the reader: {more:?}");
                more.expect("reader").release().await.expect("release");
            }
            holder.release().await.expect("release");
            let started = Instant::now();
            let next = if readers_hold {
                waiting.lock(&key).acquire().await
            } else {
                waiting.lock(&key).read().acquire().await
            }
            .expect("the other side at once");
            assert!(started.elapsed() < Duration::from_secs(2));
            next.release().await.expect("release");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_several_keys_in_shared_modes() {
        let (a, b) = (backend().await, backend().await);
        several_keys_in_shared_modes(registry(&a), registry(&b)).await;
    }

    /// A reader whose node's create reply is lost is still granted and
    /// leaves exactly its own node; dropped right after the cut, it leaves
    /// none, and a writer then gets in at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_reader_create_reply_leaves_no_ghost_reader() {
        let proxy = ZkProxy::start(port(&url())).await;
        let cut_zk = connect(&format!(
            "zk://127.0.0.1:{}/dlock-test?session_timeout=5s",
            proxy.port()
        ))
        .await;
        let locks = registry(&cut_zk);
        let other_zk = backend().await;
        let others = registry(&other_zk);
        let key = unique_key("zk-rw-lost-create");
        let warm = locks.lock(&key).read().acquire().await.expect("warm");
        warm.release().await.expect("release");
        proxy.cut_after_next_create();
        let guard = locks
            .lock(&key)
            .read()
            .wait(Duration::from_secs(15))
            .acquire()
            .await
            .expect("granted despite the lost reply");
        assert_eq!(proxy.creates_cut(), 1);
        let held = nodes(&other_zk, &key).await;
        assert_eq!(held.len(), 1, "{held:?}");
        guard.release().await.expect("release");
        let w = others.lock(&key).acquire().await.expect("writer after");
        w.release().await.expect("release");

        let writer = others.lock(&key).acquire().await.expect("writer");
        proxy.cut_after_next_create();
        let dropped = tokio::time::timeout(
            Duration::from_millis(200),
            locks
                .lock(&key)
                .read()
                .wait(Duration::from_secs(15))
                .acquire(),
        )
        .await;
        assert!(!matches!(dropped, Ok(Ok(_))), "{dropped:?}");
        until_nodes(&other_zk, &key, 1).await;
        writer.release().await.expect("release");
        let w = others
            .lock(&key)
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .expect("nothing of the dropped reader is left");
        w.release().await.expect("release");
    }

    /// Writers of a client in `writers=rw` mode (Curator's write-lock
    /// names) and plain locks of a client in the default mode exclude each
    /// other and both sides' readers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writers_of_both_naming_modes_exclude_each_other_and_readers() {
        let rw_zk = connect(&format!("{}?writers=rw", url())).await;
        let plain_zk = backend().await;
        let (rw, plain) = (registry(&rw_zk), registry(&plain_zk));
        for (holding, asking) in [(&rw, &plain), (&plain, &rw)] {
            let key = unique_key("zk-rw-naming-modes");
            let w = holding.lock(&key).acquire().await.expect("writer");
            for read in [false, true] {
                let b = asking.lock(&key);
                let b = if read { b.read() } else { b };
                let other = b.acquire().await;
                assert!(
                    matches!(other, Err(dlock_runtime::LockError::Busy { .. })),
                    "read {read}: {other:?}"
                );
            }
            w.release().await.expect("release");
            let r = asking.lock(&key).read().acquire().await.expect("reader");
            let w = holding.lock(&key).acquire().await;
            assert!(w.is_err(), "a writer beside a reader: {w:?}");
            r.release().await.expect("release");
        }
    }

    /// Readers and writers on three sessions, one of them behind a slow
    /// connection: a writer is never inside beside anyone, and every one of
    /// them gets in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readers_and_writers_on_three_sessions_one_slow_never_overlap() {
        let proxy = ZkProxy::start(port(&url())).await;
        let slow_zk = connect(&format!("zk://127.0.0.1:{}/dlock-test", proxy.port())).await;
        proxy.set(Fault::Delay(Duration::from_millis(30)));
        let sessions = [slow_zk, backend().await, backend().await];
        let key = unique_key("zk-rw-mixed");
        // (readers inside, writers inside)
        let inside = Arc::new(std::sync::Mutex::new((0usize, 0usize)));
        let tasks: Vec<_> = (0..12)
            .map(|i| {
                let locks = registry(&sessions[i % 3]);
                let (key, inside) = (key.clone(), inside.clone());
                tokio::spawn(async move {
                    let write = i % 4 == 0;
                    for _ in 0..3 {
                        let b = locks.lock(&key).wait(Duration::from_secs(60));
                        let b = if write { b } else { b.read() };
                        let g = b.acquire().await.expect("granted within the wait");
                        {
                            let mut now = inside.lock().unwrap();
                            if write {
                                assert_eq!(*now, (0, 0), "a writer entered beside {now:?}");
                                now.1 += 1;
                            } else {
                                assert_eq!(now.1, 0, "a reader entered beside a writer");
                                now.0 += 1;
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(15)).await;
                        {
                            let mut now = inside.lock().unwrap();
                            if write {
                                now.1 -= 1;
                            } else {
                                now.0 -= 1;
                            }
                        }
                        g.release().await.expect("release");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        proxy.set(Fault::Pass);
    }
}
