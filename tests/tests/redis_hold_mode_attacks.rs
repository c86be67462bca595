//! Attacks on Redis semaphores and read-write locks (one server and
//! Cluster): acquisitions dropped at every moment, a crashed waiting
//! writer, permit counts that disagree at the same instant, readers and
//! plain locks racing from several registries, tokens after the state was
//! collected, per-holder expiry under batched renewals, revocation with a
//! waiting writer, and a user key with braces on Cluster.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, HoldMode, Lease, LockBackend, Renewal};
use dlock_runtime::{LockError, RedisBackend, Registry};
use dlock_tests::{server_url, servers_missing, unique_key};

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

fn cluster_url() -> String {
    server_url(
        "DLOCK_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
    )
}

async fn connect(url: &str) -> RedisBackend {
    RedisBackend::connect(url)
        .await
        .unwrap_or_else(|e| servers_missing(url, e))
}

async fn registry_at(url: &str) -> Registry {
    Registry::builder()
        .default_backend(connect(url).await)
        .build()
}

const LEASE: Duration = Duration::from_secs(30);

fn request(key: &str, owner: &str, mode: HoldMode) -> AcquireRequest {
    let mut request = AcquireRequest::new(key, owner, LEASE);
    request.mode = mode;
    request
}

fn permits(n: u32) -> HoldMode {
    HoldMode::Permit { permits: n }
}

async fn attempt(backend: &RedisBackend, key: &str, owner: &str, mode: HoldMode) -> Attempt {
    backend
        .try_acquire(&request(key, owner, mode))
        .await
        .expect("an answer")
}

async fn held(backend: &RedisBackend, key: &str, owner: &str, mode: HoldMode) -> Lease {
    match attempt(backend, key, owner, mode).await {
        Attempt::Held(lease) => lease,
        other => panic!("{owner} should hold {key} as {mode}: {other:?}"),
    }
}

async fn is_busy(backend: &RedisBackend, key: &str, owner: &str, mode: HoldMode) -> bool {
    matches!(
        attempt(backend, key, owner, mode).await,
        Attempt::Busy { .. }
    )
}

fn token(lease: &Lease) -> u64 {
    lease.token.expect("a fenced grant").get()
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// The waiting-writer mark of the registry key `key` (default prefix).
fn mark_of(key: &str) -> String {
    format!("{{dlock:{key}}}:writer")
}

/// Writers dropped 0–5 ms (every 0.1 ms) and 5–50 ms (every 1 ms) after
/// they start waiting behind a reader, so some drops land while an
/// attempt's script is on the wire: none leaves its waiting-writer mark,
/// so a new reader gets in at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_dropped_at_any_moment_leaves_no_mark_behind() {
    let (holding, waiting) = (registry_at(&url()).await, registry_at(&url()).await);
    let mut conn = raw(&url()).await;
    let key = unique_key("redis-attack-dropped-writer");
    let reader = holding.lock(&key).read().acquire().await.expect("reader");
    let mut left_behind = Vec::new();
    let steps = (0..50u64)
        .map(|tenth| Duration::from_micros(tenth * 100))
        .chain((5..=50u64).map(Duration::from_millis));
    for step in steps {
        let writer = waiting
            .lock(&key)
            .lease(LEASE)
            .wait(Duration::from_secs(10))
            .acquire();
        let out = tokio::time::timeout(step, writer).await;
        assert!(!matches!(out, Ok(Ok(_))), "a writer beside a reader");
        // The owner-checked undo is sent in the background.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let next = holding.lock(&key).read().acquire().await;
        match next {
            Ok(guard) => guard.release().await.expect("release"),
            Err(LockError::Busy { .. }) => {
                let ttl: i64 = redis::cmd("PTTL")
                    .arg(mark_of(&key))
                    .query_async(&mut conn)
                    .await
                    .expect("pttl");
                left_behind.push((step, ttl));
                let _: () = redis::cmd("DEL")
                    .arg(mark_of(&key))
                    .query_async(&mut conn)
                    .await
                    .expect("del");
            }
            Err(other) => panic!("step {step:?}: {other}"),
        }
    }
    reader.release().await.expect("release");
    assert!(
        left_behind.is_empty(),
        "(dropped after, mark's ms left) of the dropped writers whose mark kept a new reader out: {left_behind:?}"
    );
}

/// A writer that left its mark behind readers and then crashed (no retry,
/// no undo) holds new readers back only for a short while, not for its
/// whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_waiting_writer_holds_new_readers_back_only_briefly() {
    let key = unique_key("redis-attack-crashed-writer");
    let stored = format!("dlock:{key}");
    let readers = connect(&url()).await;
    let first = held(&readers, &stored, "r1", HoldMode::Shared).await;
    {
        let writer = connect(&url()).await;
        assert!(is_busy(&writer, &stored, "w", HoldMode::Exclusive).await);
        // The writer's process ends here: no further attempt, no undo.
    }
    let registry = registry_at(&url()).await;
    let started = Instant::now();
    let second = registry
        .lock(&key)
        .read()
        .wait(Duration::from_secs(12))
        .acquire()
        .await;
    let took = started.elapsed();
    let mark_left: i64 = redis::cmd("PTTL")
        .arg(mark_of(&key))
        .query_async(&mut raw(&url()).await)
        .await
        .expect("pttl");
    assert!(
        second.is_ok(),
        "a reader after the writer crashed: {second:?}; the mark has {mark_left} ms left"
    );
    assert!(
        took < Duration::from_secs(5),
        "a crashed writer's mark kept a new reader out for {took:?} (its lease is {LEASE:?})"
    );
    second.expect("reader").release().await.expect("release");
    readers.release(&first).await.expect("release");
}

/// Two registries asking for the same fresh key as a 2-permit and a
/// 3-permit semaphore at the same instant: one of them holds, the other is
/// told of the mismatch, never both; once the holder is gone (released,
/// or crashed and expired) the other count is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_counts_that_disagree_at_the_same_instant_never_both_hold() {
    let (two, three) = (connect(&url()).await, connect(&url()).await);
    for round in 0..40 {
        let key = unique_key(&format!("redis-attack-n-vs-m-{round}"));
        let mut short_two = request(&key, "a", permits(2));
        short_two.lease = Duration::from_millis(300);
        let as_three = request(&key, "b", permits(3));
        let (a, b) = tokio::join!(two.try_acquire(&short_two), three.try_acquire(&as_three));
        let (winner, winner_backend, loser, loser_backend, loser_mode) = match (a, b) {
            (Ok(Attempt::Held(a)), Err(e)) => {
                assert!(e.is_config(), "round {round}: {e}");
                (a, &two, "b", &three, permits(3))
            }
            (Err(e), Ok(Attempt::Held(b))) => {
                assert!(e.is_config(), "round {round}: {e}");
                (b, &three, "a", &two, permits(2))
            }
            other => panic!("round {round}: {other:?}"),
        };
        if round % 2 == 1 && winner.owner == "a" {
            // Crashed: the other count is accepted once its lease ran out.
            tokio::time::sleep(Duration::from_millis(400)).await;
        } else {
            winner_backend.release(&winner).await.expect("release");
        }
        let after = held(loser_backend, &key, loser, loser_mode).await;
        assert_eq!(after.slot, Some(0), "round {round}");
        loser_backend.release(&after).await.expect("release");
    }
}

/// A reader and a plain lock (fenced, and unfenced through `SET … NX GET`)
/// racing on a fresh key from two registries are never both granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_and_a_plain_lock_racing_from_two_registries_never_both_hold() {
    let readers = registry_at(&url()).await;
    let fenced = registry_at(&url()).await;
    let unfenced = registry_at(&format!("{}?fencing=off", url())).await;
    for round in 0..40 {
        let writers = if round % 2 == 0 { &fenced } else { &unfenced };
        let key = unique_key(&format!("redis-attack-rw-race-{round}"));
        let (read, write) = tokio::join!(
            readers.lock(&key).read().acquire(),
            writers.lock(&key).acquire()
        );
        assert!(
            !(read.is_ok() && write.is_ok()),
            "round {round}: a reader beside a writer"
        );
        for g in [read, write].into_iter().flatten() {
            g.release().await.expect("release");
        }
    }
}

/// Tokens of a key's slot and of its read-write sequence keep growing after
/// every holder left and the hash is gone from the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_after_the_state_of_a_key_is_gone() {
    let backend = connect(&url()).await;
    let key = unique_key("redis-attack-tokens-collected");
    let mut last_slot0 = 0;
    let mut last_rw = 0;
    for round in 0..20 {
        let p = held(&backend, &key, "p", permits(2)).await;
        assert_eq!(p.slot, Some(0));
        assert!(token(&p) > last_slot0, "round {round}: slot 0 token");
        last_slot0 = token(&p);
        backend.release(&p).await.expect("release");
        assert!(backend.inspect(&key).await.expect("inspect").is_none());
        let r = held(&backend, &key, "r", HoldMode::Shared).await;
        assert!(token(&r) > last_rw, "round {round}: reader token");
        backend.release(&r).await.expect("release");
        let w = held(&backend, &key, "w", HoldMode::Exclusive).await;
        assert!(token(&w) > token(&r), "round {round}: writer token");
        last_rw = token(&w);
        backend.release(&w).await.expect("release");
    }
}

/// A reader that stopped renewing (crashed) frees only its own share after
/// its lease; a batch renewing a reader, a permit and a plain lease on
/// three keys keeps all three, and a writer waiting on the readers' key
/// gets in as soon as the renewed reader leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_reader_frees_only_its_share_while_mixed_batches_renew() {
    let backend = connect(&url()).await;
    let (rk, pk, xk) = (
        unique_key("redis-attack-batch-r"),
        unique_key("redis-attack-batch-p"),
        unique_key("redis-attack-batch-x"),
    );
    let mut short = request(&rk, "crashed", HoldMode::Shared);
    short.lease = Duration::from_millis(300);
    let Attempt::Held(_crashed) = backend.try_acquire(&short).await.expect("answer") else {
        panic!("a free key");
    };
    let reader = held(&backend, &rk, "reader", HoldMode::Shared).await;
    let permit = held(&backend, &pk, "permit", permits(2)).await;
    let plain = held(&backend, &xk, "plain", HoldMode::Exclusive).await;
    assert!(is_busy(&backend, &rk, "w", HoldMode::Exclusive).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let renewals = backend
        .renew_all(&[(&reader, LEASE), (&permit, LEASE), (&plain, LEASE)])
        .await;
    let renewals: Vec<_> = renewals.into_iter().map(|r| r.expect("renewal")).collect();
    assert_eq!(renewals, [Renewal::Renewed; 3]);
    let entry = backend.inspect(&rk).await.expect("inspect").expect("held");
    let owners: Vec<_> = entry.holders.iter().map(|h| h.owner.as_str()).collect();
    assert_eq!(
        owners,
        ["reader"],
        "the crashed reader's share only is gone"
    );
    assert!(is_busy(&backend, &rk, "w", HoldMode::Exclusive).await);
    backend.release(&reader).await.expect("release");
    let w = held(&backend, &rk, "w", HoldMode::Exclusive).await;
    for lease in [&w, &permit, &plain] {
        backend.release(lease).await.expect("release");
    }
}

/// Revoking a key held by two readers while a writer waits: each reader's
/// renewal answers revoked (not lost), the waiting writer's next attempt
/// is granted with a larger token, and the revoked readers cannot renew
/// beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_readers_with_a_waiting_writer_answers_revoked_and_grows_the_token() {
    let backend = connect(&url()).await;
    let key = unique_key("redis-attack-revoke");
    let r1 = held(&backend, &key, "r1", HoldMode::Shared).await;
    let r2 = held(&backend, &key, "r2", HoldMode::Shared).await;
    assert!(is_busy(&backend, &key, "w", HoldMode::Exclusive).await);
    let revoked = backend.revoke(&key).await.expect("revoke");
    assert_eq!(revoked.len(), 2, "{revoked:?}");
    let w = held(&backend, &key, "w", HoldMode::Exclusive).await;
    assert!(token(&w) > token(&r1).max(token(&r2)));
    let renewals = backend.renew_all(&[(&r1, LEASE), (&r2, LEASE)]).await;
    for r in renewals {
        assert_eq!(r.expect("renewal"), Renewal::Revoked);
    }
    assert!(is_busy(&backend, &key, "r3", HoldMode::Shared).await);
    backend.release(&w).await.expect("release");
    let r3 = held(&backend, &key, "r3", HoldMode::Shared).await;
    assert!(token(&r3) > token(&w));
    backend.release(&r3).await.expect("release");
}

/// Permit and reader waiters dropped 0–50 ms into their wait (every 2 ms),
/// while the holders they wait for leave part-way through, so some drops
/// land as a grant arrives: afterwards the key has exactly the holders the
/// test keeps, and a new holder gets in at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_and_reader_waiters_dropped_as_a_grant_arrives_leave_nothing() {
    let (holding, waiting) = (registry_at(&url()).await, registry_at(&url()).await);
    let backend = connect(&url()).await;
    for semaphore in [true, false] {
        let key = unique_key(&format!("redis-attack-dropped-waiters-{semaphore}"));
        let hold = |registry: &Registry| {
            let b = registry.lock(&key).lease(Duration::from_secs(10));
            if semaphore { b.permits(2) } else { b }
        };
        let mut kept = vec![hold(&holding).acquire().await.expect("holder")];
        if semaphore {
            kept.push(hold(&holding).acquire().await.expect("holder"));
        }
        for step in 0..=25u64 {
            if step == 12 {
                // From here on the waiters can be granted: the writer
                // leaves, or one of the two permits is free.
                for g in kept.drain(..) {
                    g.release().await.expect("release");
                }
                if semaphore {
                    kept.push(hold(&holding).acquire().await.expect("holder"));
                }
            }
            let b = waiting.lock(&key).wait(Duration::from_secs(10));
            let b = if semaphore { b.permits(2) } else { b.read() };
            let delay = Duration::from_millis(step * 2);
            // A grant that arrives is released at once; a drop at any
            // moment must leave nothing.
            if let Ok(Ok(g)) = tokio::time::timeout(delay, b.acquire()).await {
                g.release().await.expect("release");
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let entry = backend
            .inspect(&format!("dlock:{key}"))
            .await
            .expect("inspect");
        let holders = entry.map_or(0, |e| e.holders.len());
        assert_eq!(
            holders,
            kept.len(),
            "semaphore {semaphore}: holders left behind"
        );
        let b = waiting.lock(&key);
        let b = if semaphore { b.permits(2) } else { b.read() };
        let next = b.acquire().await.expect("a new holder at once");
        next.release().await.expect("release");
        for g in kept {
            g.release().await.expect("release");
        }
    }
}

/// On Cluster, user keys with braces (`{}`, `}{`, a tag of their own)
/// keep every key of the name in one hash slot: semaphores, readers, a
/// waiting writer's mark and revocation all work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_with_braces_in_the_user_text_work_in_every_mode() {
    let backend = connect(&cluster_url()).await;
    for shape in ["a{}b", "{}", "x}{y", "{tag}rest", "o{p{q}r}s"] {
        let key = format!("dlock:{}:{shape}", unique_key("cluster-braces"));
        let p0 = held(&backend, &key, "p0", permits(2)).await;
        let p1 = held(&backend, &key, "p1", permits(2)).await;
        assert!(is_busy(&backend, &key, "p2", permits(2)).await, "{shape}");
        assert_eq!(
            backend.renew(&p1, LEASE).await.expect("renew"),
            Renewal::Renewed,
            "{shape}"
        );
        backend.release(&p0).await.expect("release");
        backend.release(&p1).await.expect("release");
        let r = held(&backend, &key, "r", HoldMode::Shared).await;
        assert!(
            is_busy(&backend, &key, "w", HoldMode::Exclusive).await,
            "{shape}"
        );
        assert!(
            is_busy(&backend, &key, "r2", HoldMode::Shared).await,
            "{shape}"
        );
        assert_eq!(
            backend.revoke(&key).await.expect("revoke").len(),
            1,
            "{shape}"
        );
        assert_eq!(
            backend.renew(&r, LEASE).await.expect("renew"),
            Renewal::Revoked,
            "{shape}"
        );
        let w = held(&backend, &key, "w", HoldMode::Exclusive).await;
        backend.release(&w).await.expect("release");
        assert!(
            backend.inspect(&key).await.expect("inspect").is_none(),
            "{shape}"
        );
    }
}

/// A server restarted without persistence forgets every holder and the
/// fence counter: the holders' renewals answer lost, and the next grants'
/// tokens — per slot and on the read-write sequence — are still larger
/// than every token granted before the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_across_a_restart_without_persistence() {
    let mut server = dlock_tests::redis_support::OwnRedis::start(47311, &[]).await;
    let backend = connect(&server.url()).await;
    let (sem, rw) = (
        unique_key("redis-attack-restart-sem"),
        unique_key("redis-attack-restart-rw"),
    );
    let p0 = held(&backend, &sem, "p0", permits(2)).await;
    let p1 = held(&backend, &sem, "p1", permits(2)).await;
    let w = held(&backend, &rw, "w", HoldMode::Exclusive).await;
    backend.release(&w).await.expect("release");
    let r = held(&backend, &rw, "r", HoldMode::Shared).await;
    assert!(token(&r) > token(&w));
    server.restart().await;
    let mut renewals = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while renewals.is_empty() {
        let answers = backend
            .renew_all(&[(&p0, LEASE), (&p1, LEASE), (&r, LEASE)])
            .await;
        if answers.iter().all(Result::is_ok) {
            renewals = answers.into_iter().map(|a| a.expect("renewal")).collect();
        } else {
            assert!(Instant::now() < until, "the server back: {answers:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(renewals, [Renewal::Lost; 3]);
    let q0 = held(&backend, &sem, "q0", permits(2)).await;
    let q1 = held(&backend, &sem, "q1", permits(2)).await;
    assert_eq!((q0.slot, q1.slot), (Some(0), Some(1)));
    assert!(token(&q0) > token(&p0) && token(&q1) > token(&p1));
    let w2 = held(&backend, &rw, "w2", HoldMode::Exclusive).await;
    assert!(token(&w2) > token(&r));
}

/// Readers of two registries that keep overlapping (one always inside)
/// while a writer of a third waits: the writer's short mark, renewed by
/// its retries, keeps new readers out until it is in, well within its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_readers_never_starves_a_waiting_writer() {
    let readers = [registry_at(&url()).await, registry_at(&url()).await];
    let writer = registry_at(&url()).await;
    let key = unique_key("redis-attack-reader-stream");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let (locks, key, stop) = (readers[i % 2].clone(), key.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(25 * i as u64)).await;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let g = locks
                        .lock(&key)
                        .read()
                        .wait(Duration::from_secs(30))
                        .acquire()
                        .await
                        .expect("a reader within its wait");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    g.release().await.expect("release");
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let granted = writer
        .lock(&key)
        .wait(Duration::from_secs(15))
        .acquire()
        .await;
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let granted = granted.expect("the writer gets in");
    assert!(took < Duration::from_secs(3), "the writer waited {took:?}");
    granted.release().await.expect("release");
    for task in tasks {
        task.await.expect("task");
    }
}
