//! Wake-ups on Redis: one release wakes one waiter per process (not every
//! waiter racing for the key), and a woken waiter that leaves before it has
//! looked passes the wake-up on, so a free key never waits for its old
//! holder's expiry.
//!
//! The waiters run on a backend wrapped in [`Counted`], which counts the
//! attempts (and can hang one), so the tests see how many attempts a release
//! causes. The holder is a registry of its own: another process.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal, WakeSource};
use dlock_runtime::{BackendError, RedisBackend, Registry};
use dlock_tests::{server_url, servers_missing, unique_key};
use futures_util::future::BoxFuture;
use tokio::sync::{Notify, oneshot};

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

async fn redis() -> RedisBackend {
    let url = url();
    RedisBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// Holders hold this long, so that no waiter looks again on the holder's
/// expiry within a test: every attempt after the first two of a waiter is a
/// wake-up's.
const LONG: Duration = Duration::from_secs(30);

/// The Redis backend, counting attempts; the next attempt of a request whose
/// `wait` is [`HANG_WAIT`] hangs once `hang` is set.
#[derive(Debug)]
struct Counted {
    inner: RedisBackend,
    attempts: AtomicUsize,
    hang: AtomicBool,
    hung: Notify,
}

const HANG_WAIT: Duration = Duration::from_secs(20);

impl LockBackend for Counted {
    fn kind(&self) -> &'static str {
        "counted-redis"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            if request.wait == HANG_WAIT && self.hang.swap(false, Ordering::SeqCst) {
                self.hung.notify_one();
                std::future::pending::<()>().await;
            }
            self.inner.try_acquire(request).await
        })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.inner.wake_source(request)
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        self.inner.abandon(request)
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Renewal, BackendError>> {
        self.inner.renew(lease, ttl)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        self.inner.release(lease)
    }

    fn needs_io_runtime(&self) -> bool {
        self.inner.needs_io_runtime()
    }
}

async fn counted() -> Arc<Counted> {
    Arc::new(Counted {
        inner: redis().await,
        attempts: AtomicUsize::new(0),
        hang: AtomicBool::new(false),
        hung: Notify::new(),
    })
}

fn registry(backend: &Arc<Counted>) -> Registry {
    Registry::builder()
        .default_backend(backend.clone() as Arc<dyn LockBackend>)
        .build()
}

/// Waits until `count` stops moving for 300 ms (every waiter asleep).
async fn settled(count: &AtomicUsize) -> usize {
    let mut last = count.load(Ordering::SeqCst);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = count.load(Ordering::SeqCst);
        if now == last {
            return now;
        }
        last = now;
    }
}

/// Eight waiters in one process; each release wakes one of them, which takes
/// the key. Before: every release woke all eight (8 attempts, 7 of them lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_one_waiter_per_process() {
    const WAITERS: usize = 8;
    let key = unique_key("wake-one");
    let holder = Registry::builder().default_backend(redis().await).build();
    let first = holder
        .lock(&key)
        .lease(LONG)
        .acquire()
        .await
        .expect("the first holder");

    let backend = counted().await;
    let waiters = registry(&backend);
    let (held_tx, mut held_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut go = Vec::new();
    let mut tasks = Vec::new();
    for n in 0..WAITERS {
        let (waiters, key, held_tx) = (waiters.clone(), key.clone(), held_tx.clone());
        let (go_tx, go_rx) = oneshot::channel::<()>();
        go.push(Some(go_tx));
        tasks.push(tokio::spawn(async move {
            let guard = waiters
                .lock(&key)
                .lease(LONG)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
                .expect("a waiter");
            held_tx.send(n).expect("the test listens");
            go_rx.await.expect("the test lets it go");
            guard.release().await.expect("release");
        }));
    }
    let asleep = settled(&backend.attempts).await;
    assert_eq!(
        asleep,
        2 * WAITERS,
        "each waiter tries, subscribes and tries again, then sleeps"
    );

    first.release().await.expect("release the first holder");
    let mut order = Vec::new();
    for turn in 0..WAITERS {
        let n = tokio::time::timeout(Duration::from_secs(5), held_rx.recv())
            .await
            .unwrap_or_else(|_| panic!("turn {turn}: no waiter took the key within 5 s"))
            .expect("a waiter");
        order.push(n);
        // While it holds: the release that woke it caused one attempt, its own.
        let now = settled(&backend.attempts).await;
        assert_eq!(
            now,
            asleep + turn + 1,
            "release {turn} woke more than one waiter (attempts {now}, holders so far {order:?})"
        );
        go[n]
            .take()
            .expect("one turn each")
            .send(())
            .expect("the holder listens");
    }
    for task in tasks {
        task.await.expect("a waiter task");
    }
    order.sort_unstable();
    assert_eq!(order, (0..WAITERS).collect::<Vec<_>>());
}

/// Two waiters; the one a release wakes hangs in its attempt and its caller
/// gives up. The other must be woken in its place: without the hand-over
/// it would sleep until the old holder's lease (30 s) ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_woken_waiter_that_leaves_passes_the_wake_up_on() {
    let key = unique_key("wake-pass-on");
    let holder = Registry::builder().default_backend(redis().await).build();
    let first = holder
        .lock(&key)
        .lease(LONG)
        .acquire()
        .await
        .expect("the first holder");

    let backend = counted().await;
    let waiters = registry(&backend);
    // The first waiter registers first, so it is the one a release wakes.
    let (cancel, cancelled) = oneshot::channel::<()>();
    let leaving = tokio::spawn({
        let (waiters, key) = (waiters.clone(), key.clone());
        async move {
            tokio::select! {
                guard = waiters.lock(&key).lease(LONG).wait(HANG_WAIT).acquire() => {
                    panic!("the hung waiter cannot take the key: {:?}", guard.map(|_| ()))
                }
                _ = cancelled => {}
            }
        }
    });
    assert_eq!(settled(&backend.attempts).await, 2);
    let staying = tokio::spawn({
        let (waiters, key) = (waiters.clone(), key.clone());
        async move {
            let guard = waiters
                .lock(&key)
                .lease(LONG)
                .wait(Duration::from_secs(25))
                .acquire()
                .await
                .expect("the second waiter");
            let at = Instant::now();
            guard.release().await.expect("release");
            at
        }
    });
    assert_eq!(settled(&backend.attempts).await, 4);

    backend.hang.store(true, Ordering::SeqCst);
    first.release().await.expect("release the first holder");
    tokio::time::timeout(Duration::from_secs(5), backend.hung.notified())
        .await
        .expect("the release woke the first waiter, whose attempt now hangs");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!staying.is_finished(), "one release woke both waiters");

    let left = Instant::now();
    cancel.send(()).expect("the leaving waiter listens");
    leaving.await.expect("the leaving waiter");
    let took = tokio::time::timeout(Duration::from_secs(5), staying)
        .await
        .expect("the second waiter was not woken when the first left")
        .expect("the second waiter");
    assert!(
        took.duration_since(left) < Duration::from_secs(2),
        "the second waiter took {:?}",
        took.duration_since(left)
    );
}
