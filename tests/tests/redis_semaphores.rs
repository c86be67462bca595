//! Semaphores and read-write locks on Redis (one server and Cluster), through
//! the backend's own API: slots, per-holder expiry, tokens per (key, slot) and
//! per key, writers preferred, mismatches, renewal, revocation, the keys a
//! name leaves on the server, and the hash slot of every key of a name.
#![cfg(feature = "redis")]

use std::time::Duration;

use dlock_runtime::backend::{
    AcquireRequest, Attempt, AttemptAll, HoldMode, Lease, LockBackend, Renewal,
};
use dlock_runtime::{FencingToken, RedisBackend};
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

async fn busy(backend: &RedisBackend, key: &str, owner: &str, mode: HoldMode) -> Duration {
    match attempt(backend, key, owner, mode).await {
        Attempt::Busy { retry_in } => retry_in.expect("a time to look again"),
        other => panic!("{owner} should find {key} busy as {mode}: {other:?}"),
    }
}

fn token(lease: &Lease) -> FencingToken {
    lease.token.expect("a fenced grant")
}

/// The undo the runtime sends for an attempt it gave up: no slot, no token.
fn undo(key: &str, owner: &str, mode: HoldMode) -> Lease {
    Lease::new(&request(key, owner, mode), None)
}

async fn semaphore_cases(backend: &RedisBackend, key: &str) {
    let a = held(backend, key, "a", permits(3)).await;
    let b = held(backend, key, "b", permits(3)).await;
    let c = held(backend, key, "c", permits(3)).await;
    assert_eq!((a.slot, b.slot, c.slot), (Some(0), Some(1), Some(2)));
    let retry_in = busy(backend, key, "d", permits(3)).await;
    assert!(
        retry_in <= LEASE,
        "the earliest holder's expiry: {retry_in:?}"
    );

    backend.release(&b).await.expect("release");
    let d = held(backend, key, "d", permits(3)).await;
    assert_eq!(d.slot, Some(1), "the lowest free slot");
    assert!(token(&d) > token(&b), "tokens grow per slot");
    // A retry of an answered grant keeps its slot, with a larger token.
    let again = held(backend, key, "d", permits(3)).await;
    assert_eq!(again.slot, Some(1));
    assert!(token(&again) > token(&d));

    for mode in [HoldMode::Exclusive, HoldMode::Shared, permits(4)] {
        let error = backend
            .try_acquire(&request(key, "e", mode))
            .await
            .expect_err("a mismatch");
        assert!(error.is_config(), "{error}");
        assert!(error.to_string().contains("3 permits"), "{error}");
    }

    let entry = backend.inspect(key).await.expect("inspect").expect("held");
    let slots: Vec<_> = entry
        .holders
        .iter()
        .map(|h| (h.owner.as_str(), h.slot))
        .collect();
    assert_eq!(slots, [("a", Some(0)), ("d", Some(1)), ("c", Some(2))]);
    assert!(entry.holders.iter().all(|h| h.mode == permits(3)));

    let renewals = backend
        .renew_all(&[(&a, LEASE), (&again, LEASE), (&b, LEASE)])
        .await;
    let renewals: Vec<_> = renewals.into_iter().map(|r| r.expect("renewal")).collect();
    assert_eq!(
        renewals,
        [Renewal::Renewed, Renewal::Renewed, Renewal::Lost],
        "owner- and slot-checked"
    );

    // The undo of an abandoned attempt frees whatever permit the owner has.
    backend
        .release(&undo(key, "c", permits(3)))
        .await
        .expect("undo");
    assert_eq!(held(backend, key, "f", permits(3)).await.slot, Some(2));

    let revoked = backend.revoke(key).await.expect("revoke");
    assert_eq!(revoked.len(), 3);
    assert_eq!(
        backend.renew(&a, LEASE).await.expect("renewal"),
        Renewal::Revoked
    );
    assert!(backend.inspect(key).await.expect("inspect").is_none());
    // Free again: any mode is accepted.
    let plain = held(backend, key, "g", HoldMode::Exclusive).await;
    assert!(token(&plain) > token(&again));
    let error = backend
        .try_acquire(&request(key, "h", permits(2)))
        .await
        .expect_err("a permit on a plain lock");
    assert!(error.is_config(), "{error}");
    backend.release(&plain).await.expect("release");
}

async fn per_holder_expiry_cases(backend: &RedisBackend, key: &str) {
    let mut short = request(key, "short", permits(2));
    short.lease = Duration::from_millis(200);
    let Attempt::Held(short) = backend.try_acquire(&short).await.expect("answer") else {
        panic!("a free semaphore");
    };
    let long = held(backend, key, "long", permits(2)).await;
    busy(backend, key, "third", permits(2)).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let third = held(backend, key, "third", permits(2)).await;
    assert_eq!(third.slot, short.slot, "the expired holder's slot only");
    assert_eq!(
        backend.renew(&long, LEASE).await.expect("renewal"),
        Renewal::Renewed
    );
    assert_eq!(
        backend.renew(&short, LEASE).await.expect("renewal"),
        Renewal::Lost
    );
    backend.release(&third).await.expect("release");
    backend.release(&long).await.expect("release");
    assert!(backend.inspect(key).await.expect("inspect").is_none());
}

async fn read_write_cases(backend: &RedisBackend, key: &str) {
    let r1 = held(backend, key, "r1", HoldMode::Shared).await;
    let r2 = held(backend, key, "r2", HoldMode::Shared).await;
    assert!(
        token(&r2) > token(&r1),
        "readers take tokens from the key's sequence"
    );
    // A writer finds readers: busy, and its mark holds new readers back.
    let retry_in = busy(backend, key, "w", HoldMode::Exclusive).await;
    assert!(
        retry_in <= LEASE / 2,
        "a retry renews the mark: {retry_in:?}"
    );
    busy(backend, key, "r3", HoldMode::Shared).await;
    let error = backend
        .try_acquire(&request(key, "p", permits(2)))
        .await
        .expect_err("a permit on readers");
    assert!(error.is_config(), "{error}");

    let entry = backend.inspect(key).await.expect("inspect").expect("held");
    assert_eq!(entry.holders.len(), 2);
    assert!(entry.holders.iter().all(|h| h.mode == HoldMode::Shared));

    backend.release(&r1).await.expect("release");
    busy(backend, key, "w", HoldMode::Exclusive).await;
    backend.release(&r2).await.expect("release");
    let w = held(backend, key, "w", HoldMode::Exclusive).await;
    assert!(token(&w) > token(&r2));
    busy(backend, key, "r3", HoldMode::Shared).await;
    backend.release(&w).await.expect("release");
    let r3 = held(backend, key, "r3", HoldMode::Shared).await;
    assert!(
        token(&r3) > token(&w),
        "a holder after another has the larger token"
    );

    // A writer that gives up takes its mark with it.
    busy(backend, key, "w2", HoldMode::Exclusive).await;
    busy(backend, key, "r4", HoldMode::Shared).await;
    backend
        .release(&undo(key, "w2", HoldMode::Exclusive))
        .await
        .expect("undo");
    let r4 = held(backend, key, "r4", HoldMode::Shared).await;

    let renewals = backend.renew_all(&[(&r3, LEASE), (&r4, LEASE)]).await;
    assert!(renewals.iter().all(|r| matches!(r, Ok(Renewal::Renewed))));
    assert_eq!(backend.revoke(key).await.expect("revoke").len(), 2);
    assert_eq!(
        backend.renew(&r4, LEASE).await.expect("renewal"),
        Renewal::Revoked
    );
    assert!(backend.inspect(key).await.expect("inspect").is_none());
}

/// Every server-side key whose name contains `part`.
async fn keys_containing(url: &str, part: &str) -> Vec<String> {
    let client = redis::Client::open(url).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let mut found = Vec::new();
    let mut cursor = 0_u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("*{part}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .expect("scan");
        found.extend(keys);
        cursor = next;
        if cursor == 0 {
            return found;
        }
    }
}

#[tokio::test]
async fn semaphores_grant_slots_per_holder_and_refuse_other_modes() {
    let backend = connect(&url()).await;
    semaphore_cases(&backend, &unique_key("redis-semaphore")).await;
}

#[tokio::test]
async fn a_crashed_permit_holder_frees_only_its_own_slot() {
    let backend = connect(&url()).await;
    per_holder_expiry_cases(&backend, &unique_key("redis-semaphore-expiry")).await;
}

#[tokio::test]
async fn readers_share_and_a_waiting_writer_holds_new_readers_back() {
    let backend = connect(&url()).await;
    read_write_cases(&backend, &unique_key("redis-rw")).await;
}

#[tokio::test]
async fn semaphores_and_read_write_locks_on_cluster_keep_a_name_in_one_slot() {
    let backend = connect(&cluster_url()).await;
    // A script touching keys of two slots fails with CROSSSLOT: these pass
    // only with the lock, its mark, its revocation set and its counter in one.
    semaphore_cases(&backend, &unique_key("cluster-semaphore")).await;
    per_holder_expiry_cases(&backend, &unique_key("cluster-semaphore-expiry")).await;
    read_write_cases(&backend, &unique_key("cluster-rw")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_a_free_semaphore_or_read_lock_stays_on_the_server() {
    let backend = connect(&url()).await;
    let prefix = unique_key("redis-semaphore-names");
    for i in 0..5_000 {
        let key = format!("{prefix}:s{i}");
        let lease = held(&backend, &key, "a", permits(2)).await;
        backend.release(&lease).await.expect("release");
        let key = format!("{prefix}:r{i}");
        let lease = held(&backend, &key, "a", HoldMode::Shared).await;
        backend.release(&lease).await.expect("release");
    }
    // A writer's mark goes with its grant.
    let key = format!("{prefix}:w");
    let reader = held(&backend, &key, "r", HoldMode::Shared).await;
    busy(&backend, &key, "w", HoldMode::Exclusive).await;
    backend.release(&reader).await.expect("release");
    let writer = held(&backend, &key, "w", HoldMode::Exclusive).await;
    backend.release(&writer).await.expect("release");
    assert_eq!(keys_containing(&url(), &prefix).await, Vec::<String>::new());
}

async fn registry() -> dlock_runtime::Registry {
    dlock_runtime::Registry::builder()
        .default_backend(connect(&url()).await)
        .build()
}

/// Starts waiting for `key` in `mode` (`None`: a reader) on `registry`,
/// answering the guard and when it came.
fn wait_for(
    registry: &dlock_runtime::Registry,
    key: &str,
    permits: Option<u32>,
) -> tokio::task::JoinHandle<(dlock_runtime::LockGuard, std::time::Instant)> {
    let builder = registry
        .lock(key)
        .lease(LEASE)
        .wait(Duration::from_secs(20));
    let builder = match permits {
        Some(n) => builder.permits(n),
        None => builder.read(),
    };
    tokio::spawn(async move {
        let guard = builder.acquire().await.expect("granted while waiting");
        (guard, std::time::Instant::now())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_permit_wakes_one_waiter_at_once() {
    let (holder, waiter) = (registry().await, registry().await);
    let key = unique_key("redis-semaphore-wake");
    let first = holder
        .lock(&key)
        .permits(2)
        .lease(LEASE)
        .acquire()
        .await
        .expect("free");
    let second = holder
        .lock(&key)
        .permits(2)
        .lease(LEASE)
        .acquire()
        .await
        .expect("free");
    assert_eq!((first.permit(), second.permit()), (Some(0), Some(1)));
    let waiters = [
        wait_for(&waiter, &key, Some(2)),
        wait_for(&waiter, &key, Some(2)),
    ];
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(waiters.iter().all(|w| !w.is_finished()));

    let released = std::time::Instant::now();
    second.release().await.expect("release");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let [a, b] = waiters;
    let (done, pending) = match (a.is_finished(), b.is_finished()) {
        (true, false) => (a, b),
        (false, true) => (b, a),
        both => panic!("one waiter, and only one, takes the freed permit: {both:?}"),
    };
    let (guard, at) = done.await.expect("task");
    // The holders' leases were 30 s: only the release message explains this.
    assert!(at - released < Duration::from_secs(2));
    assert_eq!(guard.permit(), Some(1));
    first.release().await.expect("release");
    let (other, _) = tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .expect("woken by the second release")
        .expect("task");
    assert_eq!(other.permit(), Some(0));
    guard.release().await.expect("release");
    other.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_waiting_behind_a_writer_all_enter_when_it_releases() {
    let (holder, waiter) = (registry().await, registry().await);
    let key = unique_key("redis-rw-wake");
    let writer = holder
        .lock(&key)
        .write()
        .lease(LEASE)
        .acquire()
        .await
        .expect("free");
    let readers = [wait_for(&waiter, &key, None), wait_for(&waiter, &key, None)];
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(readers.iter().all(|r| !r.is_finished()));
    let writer_token = writer.fencing_token().expect("fenced");
    writer.release().await.expect("release");
    for reader in readers {
        let (guard, _) = tokio::time::timeout(Duration::from_secs(5), reader)
            .await
            .expect("woken well before the writer's lease would have ended")
            .expect("task");
        assert!(guard.fencing_token().expect("fenced") > writer_token);
        assert_eq!(guard.permit(), None);
        guard.release().await.expect("release");
    }
}

async fn list_and_several_keys_cases(backend: &RedisBackend, prefix: &str) {
    // One hash slot for the several-key script on a cluster.
    let (readers, semaphore, plain) = (
        format!("{prefix}:{{t}}:a"),
        format!("{prefix}:{{t}}:b"),
        format!("{prefix}:{{t}}:c"),
    );
    let r1 = held(backend, &readers, "r1", HoldMode::Shared).await;
    let r2 = held(backend, &readers, "r2", HoldMode::Shared).await;
    let p = held(backend, &semaphore, "p", permits(2)).await;
    // An unfenced writer meets the readers too, and leaves its mark.
    let mut unfenced = request(&readers, "w", HoldMode::Exclusive);
    unfenced.fencing = false;
    assert!(matches!(
        backend.try_acquire(&unfenced).await.expect("answer"),
        Attempt::Busy { .. }
    ));
    let listed = backend.list(prefix, 10).await.expect("list");
    let names: Vec<_> = listed
        .iter()
        .map(|e| (e.key.as_str(), e.holders.len()))
        .collect();
    assert_eq!(names, [(readers.as_str(), 2), (semaphore.as_str(), 1)]);
    backend
        .release(&undo(&readers, "w", HoldMode::Exclusive))
        .await
        .expect("undo");

    let several = |keys: &[&String]| -> Vec<AcquireRequest> {
        keys.iter()
            .map(|k| request(k, "all", HoldMode::Exclusive))
            .collect()
    };
    let step = backend
        .try_acquire_all(&several(&[&plain, &readers]))
        .expect("one step")
        .await
        .expect("an answer");
    assert!(
        matches!(step, AttemptAll::Busy { key: 1, .. }),
        "the readers' key is the busy one: {step:?}"
    );
    // That busy step marked the readers' key: new readers wait.
    busy(backend, &readers, "r3", HoldMode::Shared).await;
    let error = backend
        .try_acquire_all(&several(&[&semaphore, &plain]))
        .expect("one step")
        .await
        .expect_err("a plain lock on a semaphore");
    assert!(error.is_config(), "{error}");
    assert!(backend.inspect(&plain).await.expect("inspect").is_none());

    backend.release(&r1).await.expect("release");
    backend.release(&r2).await.expect("release");
    let AttemptAll::Held(leases) = backend
        .try_acquire_all(&several(&[&plain, &readers]))
        .expect("one step")
        .await
        .expect("an answer")
    else {
        panic!("both keys are free");
    };
    for lease in &leases {
        backend.release(lease).await.expect("release");
    }
    // The mark went with the writer's release: readers enter.
    let r3 = held(backend, &readers, "r3", HoldMode::Shared).await;
    backend.release(&r3).await.expect("release");
    backend.release(&p).await.expect("release");
    assert!(backend.list(prefix, 10).await.expect("list").is_empty());
}

#[tokio::test]
async fn list_shows_each_name_once_and_several_keys_meet_readers_and_permits() {
    let backend = connect(&url()).await;
    list_and_several_keys_cases(&backend, &unique_key("redis-held-list")).await;
    let backend = connect(&cluster_url()).await;
    list_and_several_keys_cases(&backend, &unique_key("cluster-held-list")).await;
}

fn primary_url(options: &str) -> String {
    let url = server_url("DLOCK_TEST_REDIS_PRIMARY_URL", "redis://127.0.0.1:46384/");
    format!("{url}?{options}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_acknowledgements_cover_permits_and_readers() {
    let acknowledged = connect(&primary_url("replicas=1&timeout=2s")).await;
    let key = unique_key("redis-semaphore-replicas");
    let permit = held(&acknowledged, &key, "a", permits(2)).await;
    assert_eq!(permit.slot, Some(0));
    acknowledged.release(&permit).await.expect("release");
    let reader = held(&acknowledged, &key, "r", HoldMode::Shared).await;
    acknowledged.release(&reader).await.expect("release");

    // More replicas than exist: each grant is undone.
    let unacknowledged = connect(&primary_url("replicas=2&timeout=400ms")).await;
    for mode in [permits(2), HoldMode::Shared] {
        match attempt(&unacknowledged, &key, "b", mode).await {
            Attempt::Unavailable { error, .. } => {
                assert!(error.to_string().contains("of the 2 replicas"), "{error}");
            }
            other => panic!("one replica cannot acknowledge for two: {other:?}"),
        }
        assert!(
            unacknowledged
                .inspect(&key)
                .await
                .expect("inspect")
                .is_none(),
            "the {mode} grant is undone"
        );
    }
}
