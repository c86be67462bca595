//! Attacks on semaphores (`permits(n)`): many tasks on several ZooKeeper
//! sessions, acquisitions dropped at every moment, mode races on fresh
//! keys, the operator's view, and the memory backend's expiry.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, Registry};
use dlock_tests::memory_support::memory_registry;
use dlock_tests::unique_key;

/// A permit holder that is not renewed frees its own slot after its lease,
/// and only that slot: the other holder keeps its permit and its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrenewed_permit_holder_frees_only_its_slot_after_its_lease() {
    let (_memory, locks) = memory_registry();
    let key = unique_key("mem-unrenewed-permit");
    let short = locks
        .lock(&key)
        .permits(2)
        .watchdog(false)
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("the short holder");
    let long = locks
        .lock(&key)
        .permits(2)
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("the long holder");
    let busy = locks.lock(&key).permits(2).acquire().await;
    assert!(matches!(busy, Err(LockError::Busy { .. })), "{busy:?}");
    let short_slot = short.permit().expect("slot");
    let started = Instant::now();
    let next = locks
        .lock(&key)
        .permits(2)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .expect("the expired slot is granted again");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(next.permit(), Some(short_slot));
    assert!(next.fencing_token() > short.fencing_token());
    let third = locks.lock(&key).permits(2).acquire().await;
    assert!(matches!(third, Err(LockError::Busy { .. })), "{third:?}");
    assert!(!long.is_lost(), "the renewed holder keeps its permit");
    next.release().await.expect("release");
    long.release().await.expect("release");
}

/// Inside a permit hold, the same permit count on the same key enters at
/// once as the same hold (same slot and token) without taking a second
/// slot; another count, a reader or a plain lock there is a `Config` error
/// at once, never a wait for itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_acquisitions_inside_a_permit_hold_share_it_or_are_refused_at_once() {
    let (_memory, locks) = memory_registry();
    let key = unique_key("mem-nested-permit");
    let outer = locks.lock(&key).permits(2).acquire().await.expect("outer");
    outer
        .scope(async {
            let inner = locks
                .lock(&key)
                .permits(2)
                .acquire()
                .await
                .expect("the same semaphore inside its hold");
            assert_eq!(inner.permit(), outer.permit());
            assert_eq!(inner.fencing_token(), outer.fencing_token());
            let other = {
                let (locks, key) = (locks.clone(), key.clone());
                tokio::spawn(async move { locks.lock(&key).permits(2).acquire().await })
                    .await
                    .expect("task")
            };
            let other = other.expect("the second slot is still free");
            other.release().await.expect("release");
            inner.release().await.expect("release");
            for asked in ["permits(3)", "read", "write"] {
                let builder = locks.lock(&key).wait(Duration::from_secs(10));
                let builder = match asked {
                    "permits(3)" => builder.permits(3),
                    "read" => builder.read(),
                    _ => builder.write(),
                };
                let started = Instant::now();
                let answer = builder.acquire().await;
                assert!(
                    matches!(answer, Err(LockError::Config { .. })),
                    "{asked} inside a permit: {answer:?}"
                );
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "{asked} inside a permit was not refused at once"
                );
            }
        })
        .await;
    outer.release().await.expect("release");
}

/// Sibling futures inside one permit hold take turns at it: never two of
/// them inside at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_inside_a_permit_hold_take_turns() {
    let (_memory, locks) = memory_registry();
    let key = unique_key("mem-sibling-permits");
    let outer = locks.lock(&key).permits(3).acquire().await.expect("outer");
    let inside = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    let sibling = || async {
        let g = locks
            .lock(&key)
            .permits(3)
            .wait(Duration::from_secs(10))
            .acquire()
            .await
            .expect("a sibling");
        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
        most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
        inside.fetch_sub(1, Ordering::SeqCst);
        g.release().await.expect("release");
    };
    outer
        .scope(async {
            tokio::join!(sibling(), sibling(), sibling());
        })
        .await;
    assert_eq!(most.load(Ordering::SeqCst), 1);
    outer.release().await.expect("release");
}

/// A permit request that waits, on a key held in another mode, is refused
/// at once (a `Config` error), not after its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_mismatched_request_is_refused_at_once() {
    let (_memory, locks) = memory_registry();
    mismatched_requests_are_refused_at_once(&locks, &locks).await;
}

/// Holds `key` in each mode in turn from `holding` and asks it in every
/// other mode from `asking`, with a long wait: a `Config` error at once.
async fn mismatched_requests_are_refused_at_once(holding: &Registry, asking: &Registry) {
    let modes = ["permits(2)", "permits(3)", "read", "write"];
    let builder = |locks: &Registry, key: &str, mode: &str| {
        let b = locks.lock(key);
        match mode {
            "permits(2)" => b.permits(2),
            "permits(3)" => b.permits(3),
            "read" => b.read(),
            _ => b.write(),
        }
    };
    for held in modes {
        let key = unique_key("mismatch-at-once");
        let guard = builder(holding, &key, held)
            .acquire()
            .await
            .expect("the holder");
        for asked in modes {
            // Readers and writers are one kind: busy, not refused.
            let read_write = !held.starts_with('p') && !asked.starts_with('p');
            if held == asked || read_write {
                continue;
            }
            let started = Instant::now();
            let answer = builder(asking, &key, asked)
                .wait(Duration::from_secs(10))
                .acquire()
                .await;
            assert!(
                matches!(answer, Err(LockError::Config { .. })),
                "{asked} on a key held as {held}: {answer:?}"
            );
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{asked} on a key held as {held}: not refused at once"
            );
        }
        guard.release().await.expect("release");
        let again = builder(
            asking,
            &key,
            if held == "permits(2)" {
                "permits(3)"
            } else {
                "permits(2)"
            },
        )
        .acquire()
        .await
        .expect("another mode once the key is free");
        again.release().await.expect("release");
    }
}

#[cfg(feature = "zookeeper")]
mod zookeeper {
    use super::*;
    use dlock_runtime::ZooKeeperBackend;
    use dlock_testkit::proxy::Fault;
    use dlock_tests::servers_missing;
    use dlock_tests::zk_support::{ProxiedZk, ZkProxy, admin, children, port, url};

    async fn backend() -> ZooKeeperBackend {
        let url = url();
        ZooKeeperBackend::connect(&url)
            .await
            .unwrap_or_else(|e| servers_missing(&url, e))
    }

    fn registry(backend: &ZooKeeperBackend) -> Registry {
        Registry::builder().default_backend(backend.clone()).build()
    }

    /// The lease nodes under the key's `leases` child.
    async fn leases(zk: &ZooKeeperBackend, key: &str) -> Vec<String> {
        let admin = admin(&url()).await;
        let container = zk.container_path(&format!("dlock:{key}"));
        children(&admin, &format!("{container}/leases")).await
    }

    /// Waits up to `within` for `key` to have `n` lease nodes: `what` once
    /// it is past.
    async fn leases_come_to(
        zk: &ZooKeeperBackend,
        key: &str,
        n: usize,
        within: Duration,
        what: &str,
    ) {
        let until = Instant::now() + within;
        loop {
            let now = leases(zk, key).await;
            if now.len() == n {
                return;
            }
            assert!(Instant::now() < until, "{what}: {now:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One of two permits on `key` from `locks`, at once: `what` if not.
    async fn one_of_two(locks: &Registry, key: &str, what: &str) -> dlock_runtime::LockGuard {
        locks.lock(key).permits(2).acquire().await.expect(what)
    }

    /// A backend on the test server through `proxy`, `?query` (or nothing)
    /// on its URL.
    async fn through(proxy: &ZkProxy, query: &str) -> ZooKeeperBackend {
        let url = format!("zk://127.0.0.1:{}/dlock-test{query}", proxy.port());
        ZooKeeperBackend::connect(&url)
            .await
            .unwrap_or_else(|e| servers_missing(&url, e))
    }

    /// `tasks` tasks, task `i` on a registry of `sessions[i % len]`, each
    /// taking one of two permits on `key` three times (a 60 s wait) and
    /// holding it for `hold`: never more than two inside at once, never two
    /// on one slot. Each task's time for its three holds.
    async fn permits_in_turns(
        sessions: &[ZooKeeperBackend],
        key: &str,
        tasks: usize,
        hold: Duration,
    ) -> Vec<Duration> {
        let inside = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
        let tasks: Vec<_> = (0..tasks)
            .map(|i| {
                let locks = registry(&sessions[i % sessions.len()]);
                let (key, inside) = (key.to_owned(), inside.clone());
                tokio::spawn(async move {
                    let started = Instant::now();
                    for _ in 0..3 {
                        let g = locks
                            .lock(&key)
                            .permits(2)
                            .wait(Duration::from_secs(60))
                            .acquire()
                            .await
                            .expect("a permit within the wait");
                        let slot = g.permit().expect("slot");
                        {
                            let mut now = inside.lock().unwrap();
                            assert!(
                                !now.contains(&slot) && now.len() < 2,
                                "{slot} beside {now:?}"
                            );
                            now.push(slot);
                        }
                        tokio::time::sleep(hold).await;
                        inside.lock().unwrap().retain(|s| *s != slot);
                        g.release().await.expect("release");
                    }
                    started.elapsed()
                })
            })
            .collect();
        let mut took = Vec::new();
        for task in tasks {
            took.push(task.await.expect("task"));
        }
        took
    }

    /// Sixteen tasks on two sessions competing for two permits, several
    /// rounds each: never more than two inside, never two on one slot, and
    /// everyone gets their turns well within their waits (the contenders for
    /// the last free permit must not keep refusing one another).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn permit_contenders_on_two_sessions_all_get_their_turns_promptly() {
        let sessions = [backend().await, backend().await];
        let key = unique_key("zk-sem-herd");
        let started = Instant::now();
        permits_in_turns(&sessions, &key, 16, Duration::from_millis(10)).await;
        let took = started.elapsed();
        // 48 holds of 10 ms, two at a time: a quarter of a second of holding.
        assert!(took < Duration::from_secs(15), "48 holds took {took:?}");
        assert!(leases(&sessions[0], &key).await.is_empty());
    }

    /// Acquisitions of a full semaphore dropped 0–50 ms after they start
    /// (while waiting, and as a permit comes free) leave no lease node, and
    /// the permits are granted at once once the holders leave.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_permit_acquisition_dropped_at_any_moment_leaves_no_lease() {
        let (holding_zk, waiting_zk) = (backend().await, backend().await);
        let (holding, waiting) = (registry(&holding_zk), registry(&waiting_zk));
        let key = unique_key("zk-sem-dropped");
        let mut holders = Vec::new();
        for _ in 0..2 {
            holders.push(one_of_two(&holding, &key, "holder").await);
        }
        for step in 0..26u64 {
            let delay = Duration::from_millis(step * 2);
            let attempt = waiting
                .lock(&key)
                .permits(2)
                .wait(Duration::from_secs(10))
                .acquire();
            // Every fourth step, a permit comes free right as the drop comes.
            if step % 4 == 3 {
                let freed = holders.pop().expect("a holder");
                let release = async move {
                    tokio::time::sleep(delay).await;
                    freed.release().await.expect("release");
                };
                let (_, granted) = tokio::join!(release, tokio::time::timeout(delay, attempt));
                drop(granted);
                holders.push(
                    holding
                        .lock(&key)
                        .permits(2)
                        .wait(Duration::from_secs(10))
                        .acquire()
                        .await
                        .expect("the freed permit back"),
                );
            } else {
                let out = tokio::time::timeout(delay, attempt).await;
                assert!(!matches!(out, Ok(Ok(_))), "granted beside two holders");
            }
        }
        let within = Duration::from_secs(5);
        leases_come_to(&holding_zk, &key, 2, within, "leases left behind").await;
        for holder in holders {
            holder.release().await.expect("release");
        }
        let started = Instant::now();
        let a = waiting.lock(&key).permits(2).acquire().await.expect("a");
        let b = waiting.lock(&key).permits(2).acquire().await.expect("b");
        assert!(started.elapsed() < Duration::from_secs(2));
        a.release().await.expect("release");
        b.release().await.expect("release");
    }

    /// A reader (or a writer) and a permit racing on a fresh key from two
    /// sessions are never both granted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_or_a_writer_and_a_permit_racing_on_a_fresh_key_never_both_hold() {
        let (one, two) = (backend().await, backend().await);
        let (one, two) = (registry(&one), registry(&two));
        for round in 0..40 {
            let key = unique_key(&format!("zk-sem-read-race-{round}"));
            let other = if round % 2 == 0 {
                one.lock(&key).read()
            } else {
                one.lock(&key).write()
            };
            let (read, permit) = tokio::join!(other.acquire(), two.lock(&key).permits(3).acquire());
            assert!(
                !(read.is_ok() && permit.is_ok()),
                "round {round}: a reader or writer and a permit held together"
            );
            for err in [read.as_ref().err(), permit.as_ref().err()]
                .into_iter()
                .flatten()
            {
                assert!(
                    matches!(err, LockError::Config { .. } | LockError::Busy { .. }),
                    "{err:?}"
                );
            }
            if let Ok(g) = read {
                g.release().await.expect("release");
            }
            if let Ok(g) = permit {
                g.release().await.expect("release");
            }
        }
    }

    /// The operator's list shows a semaphore's holders under its own name,
    /// each with its slot, never its `leases` child as a key of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn list_shows_a_semaphore_under_its_name_with_every_slot() {
        let zk = backend().await;
        let locks = registry(&zk);
        let prefix = unique_key("zk-sem-list");
        let key = format!("{prefix}/sem");
        let a = locks.lock(&key).permits(3).acquire().await.expect("a");
        let b = locks.lock(&key).permits(3).acquire().await.expect("b");
        let admin = locks.admin(None).expect("admin");
        let listed = admin.list(&prefix, 100).await.expect("list");
        let names: Vec<&str> = listed.iter().map(|i| i.key()).collect();
        assert!(names.iter().all(|n| *n == key), "{names:?}");
        let mut slots: Vec<Option<u32>> = listed
            .iter()
            .flat_map(|i| i.holders().iter().map(|h| h.slot()))
            .collect();
        slots.sort();
        assert_eq!(slots, vec![Some(0), Some(1)], "{listed:?}");
        a.release().await.expect("release");
        b.release().await.expect("release");
        let after = admin.list(&prefix, 100).await.expect("list");
        assert!(after.is_empty(), "{after:?}");
    }

    /// A permit holder whose session ended (its process gone, not released)
    /// no longer keeps another permit count out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_permit_count_is_accepted_once_a_holders_session_ended() {
        let key = unique_key("zk-sem-crashed-mismatch");
        let crashed = ProxiedZk::connect().await;
        let guard = registry(&crashed.backend)
            .lock(&key)
            .permits(3)
            .acquire()
            .await
            .expect("holder");
        let other = backend().await;
        let others = registry(&other);
        let refused = others.lock(&key).permits(5).acquire().await;
        assert!(
            matches!(refused, Err(LockError::Config { .. })),
            "{refused:?}"
        );
        crashed.end_session().await;
        tokio::time::timeout(Duration::from_secs(15), guard.lost())
            .await
            .expect("the holder hears of the loss");
        let until = Instant::now() + Duration::from_secs(20);
        let accepted = loop {
            match others.lock(&key).permits(5).acquire().await {
                Ok(g) => break g,
                Err(LockError::Config { .. }) if Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(err) => panic!("{err:?}"),
            }
        };
        accepted.release().await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zookeeper_a_waiting_mismatched_request_is_refused_at_once() {
        let (a, b) = (backend().await, backend().await);
        mismatched_requests_are_refused_at_once(&registry(&a), &registry(&b)).await;
    }

    /// A permit holder cut off from the server (its connection black-holed)
    /// hears of its loss before its slot is granted to anyone else, and the
    /// next holder of that slot has the larger token.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_partitioned_permit_holder_hears_of_its_loss_before_its_slot_is_granted_again() {
        let proxy = ZkProxy::start(port(&url())).await;
        let cut_zk = through(&proxy, "?session_timeout=4s").await;
        let (stays_zk, next_zk) = (backend().await, backend().await);
        let key = unique_key("zk-sem-partitioned");
        let cut = one_of_two(&registry(&cut_zk), &key, "the holder cut off").await;
        let stays = one_of_two(&registry(&stays_zk), &key, "the holder that stays").await;
        proxy.set(Fault::Hold);
        let next = registry(&next_zk)
            .lock(&key)
            .permits(2)
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .expect("the freed slot");
        assert!(
            cut.is_lost(),
            "granted while the cut-off holder still believes it holds"
        );
        assert!(!stays.is_lost());
        assert_eq!(next.permit(), cut.permit());
        assert!(next.fencing_token() > cut.fencing_token());
        proxy.set(Fault::Pass);
        next.release().await.expect("release");
        stays.release().await.expect("release");
        drop(cut);
    }

    /// A plain lock right after a semaphore's last holder released (its
    /// `leases` child may still be there) is granted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plain_lock_is_granted_right_after_a_semaphore_emptied() {
        let (a, b) = (backend().await, backend().await);
        let key = unique_key("zk-sem-then-plain");
        let p = one_of_two(&registry(&a), &key, "permit").await;
        p.release().await.expect("release");
        let plain = registry(&b).lock(&key).acquire().await.expect("plain lock");
        let reader_busy = registry(&a).lock(&key).read().acquire().await;
        assert!(
            matches!(reader_busy, Err(LockError::Busy { .. })),
            "{reader_busy:?}"
        );
        plain.release().await.expect("release");
        let p = registry(&a)
            .lock(&key)
            .permits(3)
            .acquire()
            .await
            .expect("a permit of another count afterwards");
        p.release().await.expect("release");
    }

    /// Thirty contenders on three sessions for two permits, each releasing
    /// as soon as it is granted: everyone gets its turns within seconds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn permit_contenders_releasing_at_once_all_get_their_turns_promptly() {
        let sessions = [backend().await, backend().await, backend().await];
        let key = unique_key("zk-sem-herd-fast");
        let started = Instant::now();
        permits_in_turns(&sessions, &key, 30, Duration::ZERO).await;
        let took = started.elapsed();
        let created: u64 = sessions.iter().map(|s| s.stats().nodes_created).sum();
        eprintln!("90 holds took {took:?}, {created} lease nodes created");
        assert!(took < Duration::from_secs(20), "90 holds took {took:?}");
    }

    /// Revoking a semaphore takes every permit: each holder hears of it,
    /// and the next grants have larger tokens on every slot.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn revoking_a_semaphore_takes_every_permit() {
        let (a, b) = (backend().await, backend().await);
        let key = unique_key("zk-sem-revoke");
        // Short leases: a revoked holder hears of it at its next renewal.
        let g1 = registry(&a)
            .lock(&key)
            .permits(2)
            .lease(Duration::from_secs(3))
            .acquire()
            .await
            .expect("g1");
        let g2 = registry(&b)
            .lock(&key)
            .permits(2)
            .lease(Duration::from_secs(3))
            .acquire()
            .await
            .expect("g2");
        let admin = registry(&a).admin(None).expect("admin");
        let revoked = admin.revoke(&key).await.expect("revoke");
        assert_eq!(revoked.len(), 2, "{revoked:?}");
        for g in [&g1, &g2] {
            tokio::time::timeout(Duration::from_secs(10), g.lost())
                .await
                .expect("a revoked holder hears of it");
        }
        assert!(leases(&a, &key).await.is_empty());
        let top = g1.fencing_token().max(g2.fencing_token());
        let n1 = one_of_two(&registry(&b), &key, "n1").await;
        let n2 = one_of_two(&registry(&b), &key, "n2").await;
        assert!(n1.fencing_token() > top && n2.fencing_token() > top);
        n1.release().await.expect("release");
        n2.release().await.expect("release");
        drop((g1, g2));
    }

    /// Ten waiters on a full semaphore: one release lets one of them in and
    /// wakes about one, not all ten into creating leases that refuse one
    /// another.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_released_permit_wakes_one_waiter_not_every_one() {
        let holding_zk = backend().await;
        let waiting_zk = [backend().await, backend().await];
        let key = unique_key("zk-sem-wake-one");
        let holding = registry(&holding_zk);
        let first = one_of_two(&holding, &key, "first").await;
        let second = one_of_two(&holding, &key, "second").await;
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let granted = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..10)
            .map(|i| {
                let locks = registry(&waiting_zk[i % 2]);
                let (key, granted, done) = (key.clone(), granted.clone(), done.clone());
                tokio::spawn(async move {
                    let g = locks
                        .lock(&key)
                        .permits(2)
                        .wait(Duration::from_secs(30))
                        .acquire()
                        .await
                        .expect("a permit");
                    granted.fetch_add(1, Ordering::SeqCst);
                    while !done.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    g.release().await.expect("release");
                })
            })
            .collect();
        // Every waiter is waiting on its watch.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let created = || -> u64 { waiting_zk.iter().map(|z| z.stats().nodes_created).sum() };
        let before = created();
        first.release().await.expect("release");
        let until = Instant::now() + Duration::from_secs(10);
        while granted.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < until, "no waiter was let in");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let creates = created() - before;
        assert_eq!(granted.load(Ordering::SeqCst), 1);
        assert!(
            creates <= 3,
            "one freed permit made the waiters create {creates} lease nodes"
        );
        done.store(true, Ordering::SeqCst);
        second.release().await.expect("release");
        for task in tasks {
            task.await.expect("task");
        }
    }

    /// A permit whose lease create's reply is lost (the connection cut right
    /// after it) is still granted, and leaves exactly its own lease: no
    /// ghost lease keeps a permit taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_lease_create_reply_leaves_no_ghost_lease() {
        let proxy = ZkProxy::start(port(&url())).await;
        let cut_zk = through(&proxy, "?session_timeout=5s").await;
        let locks = registry(&cut_zk);
        let other_zk = backend().await;
        let others = registry(&other_zk);
        let key = unique_key("zk-sem-lost-create");
        // The key's containers first, so that the cut create is the lease's.
        let warm = locks.lock(&key).permits(2).acquire().await.expect("warm");
        warm.release().await.expect("release");
        proxy.cut_after_next_create();
        let guard = locks
            .lock(&key)
            .permits(2)
            .wait(Duration::from_secs(15))
            .acquire()
            .await
            .expect("granted despite the lost reply");
        assert_eq!(proxy.creates_cut(), 1);
        let held = leases(&other_zk, &key).await;
        assert_eq!(held.len(), 1, "{held:?}");
        let second = one_of_two(&others, &key, "the other permit is free").await;
        guard.release().await.expect("release");
        second.release().await.expect("release");
        assert!(leases(&other_zk, &key).await.is_empty());

        // The same, with the acquisition dropped right after the cut.
        let filler = one_of_two(&others, &key, "filler").await;
        proxy.cut_after_next_create();
        let dropped = tokio::time::timeout(
            Duration::from_millis(200),
            locks
                .lock(&key)
                .permits(2)
                .wait(Duration::from_secs(15))
                .acquire(),
        )
        .await;
        if let Ok(Ok(g)) = dropped {
            g.release().await.expect("release");
        }
        leases_come_to(&other_zk, &key, 1, Duration::from_secs(10), "a ghost lease").await;
        filler.release().await.expect("release");
    }

    /// Permit holders on three sessions, one behind a slow connection:
    /// never more than the permits inside, never two on one slot, and every
    /// one gets its turns within seconds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn permit_holders_on_three_sessions_one_slow_stay_within_the_permits() {
        let proxy = ZkProxy::start(port(&url())).await;
        let slow_zk = through(&proxy, "").await;
        proxy.set(Fault::Delay(Duration::from_millis(30)));
        let sessions = [slow_zk, backend().await, backend().await];
        let key = unique_key("zk-sem-slow");
        let took = permits_in_turns(&sessions, &key, 9, Duration::from_millis(15)).await;
        proxy.set(Fault::Pass);
        eprintln!(
            "time for three holds, task i on session i % 3 (0: slow): {took:?}; slow session: {:?}",
            sessions[0].stats()
        );
        // 27 holds of 15 ms, two at a time: well under a second of holding.
        let longest = took.iter().max().copied().expect("tasks");
        assert!(
            longest < Duration::from_secs(15),
            "three holds took up to {longest:?}: {took:?}"
        );
    }

    /// ZooKeeper's opcodes counted below.
    const DELETE: i32 = 2;
    const GET_DATA: i32 = 4;
    const GET_CHILDREN: i32 = 8;
    const PING: i32 = 11;
    const GET_CHILDREN2: i32 = 12;
    const CREATE2: i32 = 15;
    const REMOVE_WATCHES: i32 = 18;
    const MULTI_READ: i32 = 22;

    /// The requests `proxy` forwarded so far, by opcode, pings left out.
    fn sent(proxy: &ZkProxy) -> Vec<u64> {
        (0..128)
            .map(|op| if op == PING { 0 } else { proxy.requests(op) })
            .collect()
    }

    /// Waits up to 10 s for `proxy` to have forwarded `n` requests of
    /// `opcode` more than `before`: `what` once it is past.
    async fn forwarded(proxy: &ZkProxy, before: &[u64], opcode: i32, n: u64, what: &str) {
        let until = Instant::now() + Duration::from_secs(10);
        while proxy.requests(opcode) - before[opcode as usize] < n {
            assert!(Instant::now() < until, "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Two held permits and a waiter for a third through a proxy of its
    /// own, waiting on its watches (one per lease): the holders' registry,
    /// the holders, the waiter's backend and task, and the proxy.
    async fn a_waiter_behind_two_permits(
        key: &str,
    ) -> (
        Registry,
        [dlock_runtime::LockGuard; 2],
        ZooKeeperBackend,
        tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>>,
        ZkProxy,
    ) {
        let proxy = ZkProxy::start(port(&url())).await;
        let waiting_zk = through(&proxy, "").await;
        let holding = registry(&backend().await);
        let first = one_of_two(&holding, key, "first").await;
        let second = one_of_two(&holding, key, "second").await;
        let waiting = registry(&waiting_zk);
        let key = key.to_owned();
        let waiter = tokio::spawn(async move {
            waiting
                .lock(&key)
                .permits(2)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
        });
        let until = Instant::now() + Duration::from_secs(10);
        while waiting_zk.stats().watches_set < 2 {
            assert!(
                Instant::now() < until,
                "the waiter set no watch on each lease: {:?}",
                waiting_zk.stats()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (holding, [first, second], waiting_zk, waiter, proxy)
    }

    /// The first waiter for a full semaphore, woken by a holder's release,
    /// takes the freed lease's slot in one round trip: it sends its
    /// lease's create and the two listings that check it (and the delete of
    /// its queue node), and reads neither the queue nor any lease's data;
    /// its watch on the lease still held is removed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_woken_first_permit_waiter_takes_the_freed_slot_with_one_create_and_two_listings() {
        let key = unique_key("zk-sem-seeker");
        let (_holding, [first, second], waiting_zk, waiter, proxy) =
            a_waiter_behind_two_permits(&key).await;
        let before = sent(&proxy);
        let freed = second.permit();
        second.release().await.expect("release");
        let guard = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter was not let in")
            .expect("task")
            .expect("the freed permit");
        assert_eq!(guard.permit(), freed, "the freed lease's slot");
        forwarded(&proxy, &before, REMOVE_WATCHES, 1, "the watch kept").await;
        // Sent with the grant, not waited for.
        forwarded(&proxy, &before, DELETE, 1, "the queue node kept").await;
        let after = sent(&proxy);
        let more = |op: i32| after[op as usize] - before[op as usize];
        let every: u64 = after.iter().sum::<u64>() - before.iter().sum::<u64>();
        let by_op: Vec<(usize, u64)> = (0..128)
            .filter(|op| after[*op] > before[*op])
            .map(|op| (op, after[op] - before[op]))
            .collect();
        assert_eq!(more(CREATE2), 1, "creates: {by_op:?}");
        assert_eq!(
            more(GET_CHILDREN) + more(GET_CHILDREN2),
            2,
            "listings: {by_op:?}"
        );
        assert_eq!(more(GET_DATA) + more(MULTI_READ), 0, "reads: {by_op:?}");
        assert_eq!(every, 5, "requests by opcode: {by_op:?}");
        assert_eq!(waiting_zk.stats().watch_events, 1);
        guard.release().await.expect("release");
        first.release().await.expect("release");
        assert!(leases(&waiting_zk, &key).await.is_empty());
    }

    /// The bytes of a getData request that sets a watch on `held`'s lease
    /// (of two permits on `key`): the lease's path, then `true`.
    async fn watch_request_on(
        zk: &ZooKeeperBackend,
        key: &str,
        held: &dlock_runtime::LockGuard,
    ) -> Vec<u8> {
        let admin = admin(&url()).await;
        let container = zk.container_path(&format!("dlock:{key}"));
        let slot_line = format!("dlock-permit 2 {}", held.permit().expect("a slot"));
        for lease in leases(zk, key).await {
            let (data, _) = admin
                .get_data(&format!("{container}/leases/{lease}"))
                .await
                .expect("a lease's data");
            if data.ends_with(slot_line.as_bytes()) {
                let mut needle = lease.into_bytes();
                needle.push(1);
                return needle;
            }
        }
        panic!("no lease carries {slot_line:?}");
    }

    /// A lease released while the first waiter's watch on it is on its way
    /// (held back by the waiter's proxy): the watch answers that the lease
    /// is gone and is not set, and the waiter looks again and takes the
    /// freed permit at once, not at the re-check its long session timeout
    /// would bring.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_released_before_the_first_waiters_watch_on_it_is_set_leaves_no_waiter_behind()
    {
        let key = unique_key("zk-sem-seeker-late-watch");
        let proxy = ZkProxy::start(port(&url())).await;
        let waiting_zk = through(&proxy, "?session_timeout=60s").await;
        let holding = registry(&backend().await);
        let first = one_of_two(&holding, &key, "first").await;
        let second = one_of_two(&holding, &key, "second").await;
        let admin = admin(&url()).await;
        let container = waiting_zk.container_path(&format!("dlock:{key}"));
        let needle = watch_request_on(&waiting_zk, &key, &second).await;
        proxy.hold_next(&[&needle], Duration::from_secs(5));
        let waiting = registry(&waiting_zk);
        let waiter = tokio::spawn({
            let key = key.clone();
            async move {
                waiting
                    .lock(&key)
                    .permits(2)
                    .wait(Duration::from_secs(50))
                    .acquire()
                    .await
            }
        });
        let until = Instant::now() + Duration::from_secs(10);
        while proxy.held_on().is_none() {
            assert!(Instant::now() < until, "the waiter never watched the lease");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        second.release().await.expect("release");
        let guard = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("the waiter was left on the watches it could set")
            .expect("task")
            .expect("the freed permit");
        assert_eq!(
            waiting_zk.stats().watch_events,
            0,
            "the released lease's watch was set"
        );
        guard.release().await.expect("release");
        first.release().await.expect("release");
        assert!(leases(&waiting_zk, &key).await.is_empty());
        assert!(
            children(&admin, &format!("{container}/locks"))
                .await
                .is_empty()
        );
    }

    /// A slot-1 holder's release raced for: the holders of `permits`
    /// permits, slot 0 first; an attempt that found slot 1 free before
    /// anyone queued (its lease's create held back 10 s by its proxy, while
    /// another holder takes slot 1 meanwhile); and the first waiter, woken by
    /// that holder's release (its create on the freed slot held back 15 s).
    /// The racer's earlier create holds slot 1. Returns the holders left
    /// (slot 0 first), the racer's permit, the waiter's backend and task,
    /// and the racer's and the waiter's proxies.
    async fn a_freed_slot_raced_for(
        key: &str,
        permits: u32,
    ) -> (
        Vec<dlock_runtime::LockGuard>,
        dlock_runtime::LockGuard,
        ZooKeeperBackend,
        tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>>,
        [ZkProxy; 2],
    ) {
        let holding = registry(&backend().await);
        let (racing_proxy, waiting_proxy) = (
            ZkProxy::start(port(&url())).await,
            ZkProxy::start(port(&url())).await,
        );
        let racing_zk = through(&racing_proxy, "?session_timeout=60s").await;
        let waiting_zk = through(&waiting_proxy, "?session_timeout=60s").await;
        let take = |locks: Registry| {
            let key = key.to_owned();
            async move {
                locks
                    .lock(&key)
                    .permits(permits)
                    .wait(Duration::from_secs(50))
                    .acquire()
                    .await
            }
        };
        let mut holders = vec![take(holding.clone()).await.expect("slot 0")];
        // A lease create on slot 1, in its data.
        let on_slot_1 = format!("dlock-permit {permits} 1");
        racing_proxy.hold_next(&[on_slot_1.as_bytes()], Duration::from_secs(10));
        let racer = tokio::spawn(take(registry(&racing_zk)));
        let until = Instant::now() + Duration::from_secs(10);
        while racing_proxy.held_on().is_none() {
            assert!(Instant::now() < until, "the racer never created its lease");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for _ in 1..permits {
            holders.push(take(holding.clone()).await.expect("a free slot"));
        }
        assert_eq!(holders[1].permit(), Some(1));
        let waiter = tokio::spawn(take(registry(&waiting_zk)));
        let until = Instant::now() + Duration::from_secs(10);
        while waiting_zk.stats().watches_set < u64::from(permits) {
            assert!(Instant::now() < until, "the waiter watched no lease");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        waiting_proxy.hold_next(&[on_slot_1.as_bytes()], Duration::from_secs(15));
        holders.remove(1).release().await.expect("release");
        let raced = tokio::time::timeout(Duration::from_secs(30), racer)
            .await
            .expect("the racer was not let in")
            .expect("task")
            .expect("the freed permit");
        assert_eq!(raced.permit(), Some(1));
        assert!(
            waiting_proxy.held_on().is_some(),
            "the woken waiter sent no create on the freed slot"
        );
        (
            holders,
            raced,
            waiting_zk,
            waiter,
            [racing_proxy, waiting_proxy],
        )
    }

    /// A woken first waiter whose create on the freed slot lands after a
    /// racer's, every permit then taken: it gives its lease up, waits again
    /// on the leases, and takes the slot at the next release, with a larger
    /// token.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_woken_first_waiter_losing_the_freed_slot_to_an_earlier_create_waits_for_the_next_release()
     {
        let key = unique_key("zk-sem-seeker-race-full");
        let (holders, raced, waiting_zk, waiter, _proxies) = a_freed_slot_raced_for(&key, 2).await;
        // The waiter's create lands, finds three leases, and the waiter
        // watches the two others.
        let until = Instant::now() + Duration::from_secs(30);
        while waiting_zk.stats().watches_set < 4 {
            assert!(
                Instant::now() < until,
                "the waiter did not wait again: {:?}",
                waiting_zk.stats()
            );
            assert!(!waiter.is_finished(), "the waiter ended beside two holders");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!waiter.is_finished(), "the waiter ended beside two holders");
        leases_come_to(
            &waiting_zk,
            &key,
            2,
            Duration::from_secs(10),
            "a third lease",
        )
        .await;
        let raced_token = raced.fencing_token();
        raced.release().await.expect("release");
        let guard = tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("the waiter was not let in at the racer's release")
            .expect("task")
            .expect("the freed permit");
        assert_eq!(guard.permit(), Some(1));
        assert!(guard.fencing_token() > raced_token);
        guard.release().await.expect("release");
        for holder in holders {
            holder.release().await.expect("release");
        }
        assert!(leases(&waiting_zk, &key).await.is_empty());
    }

    /// A woken first waiter whose create on the freed slot lands after a
    /// racer's on that slot, another slot freed meanwhile (the leases then
    /// within the permits): it gives its lease up and takes the other slot,
    /// never the racer's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_woken_first_waiter_losing_the_freed_slot_to_an_earlier_create_takes_another_free_slot()
     {
        let key = unique_key("zk-sem-seeker-race-other");
        let (mut holders, raced, waiting_zk, waiter, _proxies) =
            a_freed_slot_raced_for(&key, 3).await;
        let third = holders.pop().expect("the slot 2 holder");
        assert_eq!(third.permit(), Some(2));
        // Before the waiter's create lands.
        third.release().await.expect("release");
        let guard = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("the waiter was not let in")
            .expect("task")
            .expect("the free permit");
        assert_eq!(guard.permit(), Some(2), "the racer's slot taken twice");
        assert!(!raced.is_lost());
        leases_come_to(&waiting_zk, &key, 3, Duration::from_secs(10), "leases").await;
        for g in [guard, raced].into_iter().chain(holders) {
            g.release().await.expect("release");
        }
        assert!(leases(&waiting_zk, &key).await.is_empty());
    }

    /// A first permit waiter dropped while its watches on the leases are on
    /// their way (held back by its proxy): every watch the server sets once
    /// they arrive is removed, and no node is left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_first_permit_waiter_dropped_while_setting_its_watches_removes_them() {
        let key = unique_key("zk-sem-seeker-dropped-early");
        let proxy = ZkProxy::start(port(&url())).await;
        let waiting_zk = through(&proxy, "?session_timeout=60s").await;
        let holding = registry(&backend().await);
        let first = one_of_two(&holding, &key, "first").await;
        let second = one_of_two(&holding, &key, "second").await;
        let needle = watch_request_on(&waiting_zk, &key, &second).await;
        proxy.hold_next(&[&needle], Duration::from_secs(3));
        let waiting = registry(&waiting_zk);
        let waiter = tokio::spawn({
            let key = key.clone();
            async move {
                waiting
                    .lock(&key)
                    .permits(2)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
            }
        });
        let until = Instant::now() + Duration::from_secs(10);
        while proxy.held_on().is_none() {
            assert!(Instant::now() < until, "the waiter never watched the lease");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = sent(&proxy);
        waiter.abort();
        assert!(waiter.await.is_err_and(|e| e.is_cancelled()));
        forwarded(
            &proxy,
            &before,
            REMOVE_WATCHES,
            2,
            "watches left on the leases",
        )
        .await;
        let admin = admin(&url()).await;
        let container = waiting_zk.container_path(&format!("dlock:{key}"));
        let until = Instant::now() + Duration::from_secs(10);
        while !children(&admin, &format!("{container}/locks"))
            .await
            .is_empty()
        {
            assert!(Instant::now() < until, "the waiter's queue node is left");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(leases(&waiting_zk, &key).await.len(), 2);
        assert_eq!(waiting_zk.stats().watch_events, 0);
        first.release().await.expect("release");
        second.release().await.expect("release");
    }

    /// A first permit waiter that gives up removes its watch on each lease,
    /// and leaves no node.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_first_permit_waiter_dropped_removes_its_watches_on_the_leases() {
        let key = unique_key("zk-sem-seeker-dropped");
        let (_holding, [first, second], waiting_zk, waiter, proxy) =
            a_waiter_behind_two_permits(&key).await;
        let before = sent(&proxy);
        waiter.abort();
        assert!(waiter.await.is_err_and(|e| e.is_cancelled()));
        forwarded(
            &proxy,
            &before,
            REMOVE_WATCHES,
            2,
            "watches left on the leases",
        )
        .await;
        let admin = admin(&url()).await;
        let container = waiting_zk.container_path(&format!("dlock:{key}"));
        let until = Instant::now() + Duration::from_secs(10);
        while !children(&admin, &format!("{container}/locks"))
            .await
            .is_empty()
        {
            assert!(Instant::now() < until, "the waiter's queue node is left");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(leases(&waiting_zk, &key).await.len(), 2);
        first.release().await.expect("release");
        second.release().await.expect("release");
    }

    /// Three tasks of one session sharing two permits, each holding a few
    /// times: every one gets its turns within seconds (each release wakes
    /// the session's waiters).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn permit_waiters_of_one_session_are_woken_by_each_release() {
        let zk = backend().await;
        let key = unique_key("zk-sem-one-session");
        let took = permits_in_turns(&[zk], &key, 3, Duration::from_millis(15)).await;
        let longest = took.iter().max().copied().expect("tasks");
        assert!(
            longest < Duration::from_secs(5),
            "three holds took up to {longest:?}: {took:?}"
        );
    }
}
