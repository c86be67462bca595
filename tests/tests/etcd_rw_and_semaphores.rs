//! Read-write locks and semaphores on etcd: entry names, tokens taken at
//! the grant (readers granted in either order, a writer queued behind a
//! reader), a crashed permit holder freeing only its own slot, releases out
//! of order waking the first waiter, mode mismatches between racing
//! clients, no herd, and cancellation that leaves no entry or slot claim.
#![cfg(feature = "etcd")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease};
use dlock_runtime::{EtcdBackend, HoldMode, LockBackend};
use dlock_tests::etcd_support::{admin, backend, entries, kept_under, registry, url};
use dlock_tests::unique_key;

const LEASE: Duration = Duration::from_secs(30);

/// A request that waits (so a busy attempt keeps its entry queued).
fn request(key: &str, owner: &str, mode: HoldMode) -> AcquireRequest {
    AcquireRequest::new(key, owner, LEASE)
        .with_mode(mode)
        .with_wait(Duration::from_secs(30))
}

/// Attempts until granted (within 10 s), the wake-up being the backend's.
async fn held(etcd: &EtcdBackend, request: &AcquireRequest) -> Lease {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match etcd.try_acquire(request).await.expect("attempt") {
            Attempt::Held(lease) => return lease,
            Attempt::Busy { .. } | Attempt::Unavailable { .. } => {
                assert!(Instant::now() < deadline, "{} never granted", request.owner);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("{other:?}"),
        }
    }
}

/// One attempt that must find the key busy (and leave its entry queued).
async fn queued(etcd: &EtcdBackend, request: &AcquireRequest) {
    let answer = etcd.try_acquire(request).await.expect("attempt");
    assert!(matches!(answer, Attempt::Busy { .. }), "{answer:?}");
}

fn token(lease: &Lease) -> u64 {
    u64::from(lease.token.expect("a token"))
}

/// The names (below the queue) of the key's entries, in create order.
async fn names(etcd: &EtcdBackend, stored_key: &str) -> Vec<String> {
    let queue = etcd.queue_prefix(stored_key);
    entries(&admin(&url()).await, &queue)
        .await
        .into_iter()
        .map(|(key, _)| key[queue.len()..].to_owned())
        .collect()
}

/// What is kept on the server for stored keys starting with `stored_prefix`.
async fn kept(etcd: &EtcdBackend, stored_prefix: &str) -> Vec<String> {
    let client = admin(&url()).await;
    let mut kept = Vec::new();
    for under in kept_under(etcd, stored_prefix) {
        kept.extend(entries(&client, &under).await.into_iter().map(|(k, _)| k));
    }
    kept
}

/// Readers' entries are `%R{owner}`, permits' `%P{n}:{owner}`, a plain
/// lock's the bare owner; a permit's slot claim is outside the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_names_say_the_mode_and_slot_claims_are_outside_the_queue() {
    let etcd = backend(&url()).await;
    let key = format!("dlock:{}", unique_key("etcd-names"));
    let reader = held(&etcd, &request(&key, "r1", HoldMode::Shared)).await;
    assert_eq!(names(&etcd, &key).await, ["%Rr1"]);
    etcd.release(&reader).await.expect("release");
    let permit = HoldMode::Permit { permits: 3 };
    let p = held(&etcd, &request(&key, "p1", permit)).await;
    assert_eq!(p.slot, Some(0));
    assert_eq!(names(&etcd, &key).await, ["%P3:p1"]);
    let stored = kept(&etcd, &key).await;
    assert!(
        stored
            .iter()
            .any(|k| k.ends_with(&format!("%slots/{key}/0"))),
        "{stored:?}"
    );
    etcd.release(&p).await.expect("release");
    let writer = held(&etcd, &request(&key, "w1", HoldMode::Exclusive)).await;
    assert_eq!(names(&etcd, &key).await, ["w1"]);
    etcd.release(&writer).await.expect("release");
    assert!(kept(&etcd, &key).await.is_empty());
}

/// Two readers queued behind a writer become eligible at once; the one
/// queued second is granted first and releases, then the first is granted:
/// its token is the larger (the token is taken at the grant, not at the
/// queueing). Both are above the writer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_granted_in_either_order_have_tokens_in_grant_order() {
    let etcd = backend(&url()).await;
    let key = format!("dlock:{}", unique_key("etcd-reader-tokens"));
    let writer = held(&etcd, &request(&key, "w", HoldMode::Exclusive)).await;
    let (first, second) = (
        request(&key, "r-first", HoldMode::Shared),
        request(&key, "r-second", HoldMode::Shared),
    );
    queued(&etcd, &first).await;
    queued(&etcd, &second).await;
    let writer_token = token(&writer);
    etcd.release(&writer).await.expect("release");
    let second_lease = held(&etcd, &second).await;
    etcd.release(&second_lease).await.expect("release");
    let first_lease = held(&etcd, &first).await;
    assert!(token(&second_lease) > writer_token);
    assert!(
        token(&first_lease) > token(&second_lease),
        "granted after the other reader's release: {} then {}",
        token(&second_lease),
        token(&first_lease)
    );
    etcd.release(&first_lease).await.expect("release");
    assert!(kept(&etcd, &key).await.is_empty());
}

/// A reader queued before a writer, both behind a holder: the reader is
/// granted when the holder leaves (after the writer's entry was created),
/// and the writer, granted after the reader's release, has the larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_granted_after_an_earlier_queued_reader_has_the_larger_token() {
    let etcd = backend(&url()).await;
    let key = format!("dlock:{}", unique_key("etcd-writer-after-reader"));
    let holder = held(&etcd, &request(&key, "w0", HoldMode::Exclusive)).await;
    let reader = request(&key, "r", HoldMode::Shared);
    let writer = request(&key, "w1", HoldMode::Exclusive);
    queued(&etcd, &reader).await;
    queued(&etcd, &writer).await;
    assert_eq!(names(&etcd, &key).await, ["w0", "%Rr", "w1"]);
    etcd.release(&holder).await.expect("release");
    let reader_lease = held(&etcd, &reader).await;
    // The writer waits behind the reader.
    queued(&etcd, &writer).await;
    etcd.release(&reader_lease).await.expect("release");
    let writer_lease = held(&etcd, &writer).await;
    assert!(token(&reader_lease) > token(&holder));
    assert!(
        token(&writer_lease) > token(&reader_lease),
        "{} then {}",
        token(&reader_lease),
        token(&writer_lease)
    );
    // What `inspect` shows is the holder's token.
    let info = etcd.inspect(&key).await.expect("inspect").expect("held");
    assert_eq!(info.holders[0].token, writer_lease.token);
    etcd.release(&writer_lease).await.expect("release");
}

/// A readers' batch and a waiting writer: new readers queue behind the
/// writer; `inspect` shows every reader holding, each with its own token,
/// and the writer and the late reader waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_readers_batch_and_counts_the_waiting_writer() {
    let etcd = backend(&url()).await;
    let key = format!("dlock:{}", unique_key("etcd-readers-batch"));
    let r1 = held(&etcd, &request(&key, "r1", HoldMode::Shared)).await;
    let r2 = held(&etcd, &request(&key, "r2", HoldMode::Shared)).await;
    let writer = request(&key, "w", HoldMode::Exclusive);
    queued(&etcd, &writer).await;
    let late = request(&key, "r3", HoldMode::Shared);
    queued(&etcd, &late).await;
    let info = etcd.inspect(&key).await.expect("inspect").expect("held");
    let mut shown: Vec<_> = info
        .holders
        .iter()
        .map(|h| (h.owner.clone(), h.mode, h.token))
        .collect();
    shown.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        shown,
        [
            ("r1".to_owned(), HoldMode::Shared, r1.token),
            ("r2".to_owned(), HoldMode::Shared, r2.token)
        ]
    );
    assert_eq!(info.waiters, Some(2));
    etcd.release(&r1).await.expect("release");
    etcd.release(&r2).await.expect("release");
    let w = held(&etcd, &writer).await;
    queued(&etcd, &late).await;
    etcd.release(&w).await.expect("release");
    let r3 = held(&etcd, &late).await;
    assert!(token(&r3) > token(&w));
    etcd.release(&r3).await.expect("release");
    assert!(kept(&etcd, &key).await.is_empty());
}

/// Of two permit holders, the one whose process died (its session's etcd
/// lease revoked) frees its own slot only: a waiter takes that slot, the
/// other holder keeps its own and renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_permit_holder_frees_only_its_slot() {
    let crashed = backend(&url()).await;
    let alive = backend(&url()).await;
    let key = unique_key("etcd-crashed-permit");
    let first = registry(&crashed)
        .lock(&key)
        .permits(2)
        .lease(LEASE)
        .acquire()
        .await
        .expect("first permit");
    let second = registry(&alive)
        .lock(&key)
        .permits(2)
        .lease(LEASE)
        .acquire()
        .await
        .expect("second permit");
    assert_eq!((first.permit(), second.permit()), (Some(0), Some(1)));
    let waiter = {
        let locks = registry(&alive);
        let key = key.clone();
        tokio::spawn(async move {
            locks
                .lock(&key)
                .permits(2)
                .lease(LEASE)
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    let stored = format!("dlock:{key}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while names(&alive, &stored).await.len() < 3 {
        assert!(Instant::now() < deadline, "the waiter did not queue");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lease = crashed.session_lease_for_tests().expect("a session");
    let mut client = admin(&url()).await;
    client.lease_revoke(lease).await.expect("revoke the lease");
    let taken = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is woken by the crash")
        .expect("task")
        .expect("the crashed holder's permit");
    assert_eq!(taken.permit(), Some(0), "the crashed holder's slot");
    assert!(!second.is_lost(), "the other holder keeps its permit");
    let info = registry(&alive)
        .inspect(&key)
        .await
        .expect("inspect")
        .expect("held");
    let mut slots: Vec<_> = info.holders().iter().map(|h| h.slot()).collect();
    slots.sort();
    assert_eq!(slots, [Some(0), Some(1)]);
    second.release().await.expect("the other holder releases");
    taken.release().await.expect("release");
    drop(first);
    assert!(kept(&alive, &stored).await.is_empty());
}

/// Holders of a semaphore release in any order: the waiter is woken by the
/// release of the later holder too (not only of the first one), at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_out_of_order_wakes_the_first_permit_waiter() {
    let etcd = backend(&url()).await;
    let key = format!("dlock:{}", unique_key("etcd-permit-out-of-order"));
    let permits = HoldMode::Permit { permits: 2 };
    let early = held(&etcd, &request(&key, "early", permits)).await;
    let late = held(&etcd, &request(&key, "late", permits)).await;
    let first_waiter = request(&key, "w1", permits);
    let second_waiter = request(&key, "w2", permits);
    queued(&etcd, &first_waiter).await;
    queued(&etcd, &second_waiter).await;
    let woken = etcd.stats().watch_events;
    let released = Instant::now();
    etcd.release(&late).await.expect("release the later holder");
    let w1 = held(&etcd, &first_waiter).await;
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "woken by the release, not by a fallback: {:?}",
        released.elapsed()
    );
    assert_eq!(w1.slot, late.slot, "the freed slot");
    assert!(etcd.stats().watch_events > woken);
    queued(&etcd, &second_waiter).await;
    etcd.release(&early).await.expect("release");
    let w2 = held(&etcd, &second_waiter).await;
    assert_eq!(w2.slot, early.slot);
    etcd.release(&w1).await.expect("release");
    etcd.release(&w2).await.expect("release");
    assert!(kept(&etcd, &key).await.is_empty());
}

/// Two clients race for a fresh key in different modes: exactly one is
/// granted, the other is a configuration error naming both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_clients_with_different_modes_get_one_grant_and_one_mismatch() {
    let one = backend(&url()).await;
    let other = backend(&url()).await;
    let modes = [
        (
            HoldMode::Permit { permits: 2 },
            HoldMode::Permit { permits: 3 },
        ),
        (HoldMode::Permit { permits: 2 }, HoldMode::Exclusive),
        (HoldMode::Shared, HoldMode::Permit { permits: 4 }),
    ];
    for round in 0..12 {
        let (a, b) = modes[round % modes.len()];
        let key = format!("dlock:{}", unique_key(&format!("etcd-mode-race-{round}")));
        let (ra, rb) = (request(&key, "a", a), request(&key, "b", b));
        let (x, y) = tokio::join!(one.try_acquire(&ra), other.try_acquire(&rb));
        let mut granted = Vec::new();
        for (answer, etcd) in [(x, &one), (y, &other)] {
            match answer {
                Ok(Attempt::Held(lease)) => granted.push((lease, etcd)),
                Err(err) => assert!(
                    err.is_config() && err.to_string().contains("this call asks for it as"),
                    "round {round}: {err:?}"
                ),
                Ok(other) => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(granted.len(), 1, "round {round} ({a:?} vs {b:?})");
        for (lease, etcd) in granted {
            etcd.release(&lease).await.expect("release");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while !kept(&one, &key).await.is_empty() {
            assert!(Instant::now() < deadline, "round {round}: entries left");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Ten waiters for two permits, served one after another: each release
/// wakes at most two waiters (the first waiter, then — by its grant — the
/// next one taking its place), never the whole queue; each waiter puts its
/// entry once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_herd_on_a_semaphore_with_ten_waiters() {
    const WAITERS: usize = 10;
    let holders = backend(&url()).await;
    let waiters = backend(&url()).await;
    let key = unique_key("etcd-semaphore-herd");
    let stored = format!("dlock:{key}");
    let locks = registry(&holders);
    let a = locks.lock(&key).permits(2).acquire().await.expect("a");
    let b = locks.lock(&key).permits(2).acquire().await.expect("b");
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let (locks, key, inside) = (registry(&waiters), key.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            let guard = locks
                .lock(&key)
                .permits(2)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
                .expect("served");
            assert!(
                inside.fetch_add(1, Ordering::SeqCst) < 2,
                "more than 2 inside"
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
            inside.fetch_sub(1, Ordering::SeqCst);
            guard.release().await.expect("release");
        }));
        let deadline = Instant::now() + Duration::from_secs(10);
        while names(&waiters, &stored).await.len() < i + 3 {
            assert!(Instant::now() < deadline, "waiter {i} did not queue");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let before = waiters.stats();
    a.release().await.expect("release");
    b.release().await.expect("release");
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("all served")
            .expect("task");
    }
    let after = waiters.stats();
    let releases = (WAITERS + 2) as u64;
    let woken = after.watch_events - before.watch_events;
    assert!(
        woken <= 2 * releases,
        "{woken} wake-ups for {releases} releases: {after:?}"
    );
    assert_eq!(after.entries_put, WAITERS as u64, "{after:?}");
    assert!(kept(&waiters, &stored).await.is_empty());
}

/// Permit and reader acquisitions dropped at points of their flight —
/// uncontended or queued — leave no entry and no slot claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_permit_and_reader_acquisitions_leave_nothing() {
    let etcd = backend(&url()).await;
    let locks = registry(&etcd);
    let prefix = unique_key("etcd-cancel-modes");
    let busy = format!("{prefix}:busy");
    let holders = [
        locks.lock(&busy).permits(2).acquire().await.expect("a"),
        locks.lock(&busy).permits(2).acquire().await.expect("b"),
    ];
    for i in 0..60u64 {
        let key = match i % 3 {
            0 => busy.clone(),
            _ => format!("{prefix}:free-{i}"),
        };
        let builder = if i % 3 == 2 {
            locks.lock(&key).read()
        } else {
            locks.lock(&key).permits(2)
        };
        let cut = Duration::from_micros(i * 150);
        if let Ok(Ok(guard)) =
            tokio::time::timeout(cut, builder.wait(Duration::from_secs(5)).acquire()).await
        {
            guard.release().await.expect("release");
        }
    }
    for holder in holders {
        holder.release().await.expect("release");
    }
    let stored = format!("dlock:{prefix}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = kept(&etcd, &stored).await;
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left behind: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
