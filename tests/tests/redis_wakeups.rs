//! Wake-ups on Redis: one release wakes one waiter per process (not every
//! waiter racing for the key), and a woken waiter that leaves without the key
//! passes the wake-up on, so a free key never waits for an old holder's
//! expiry.
//!
//! The waiters run on a backend wrapped in [`Steered`], which counts the
//! attempts and can pause the attempts of one marked waiter, so the tests see
//! how many attempts a release causes and can make a waiter leave at a chosen
//! point. Holders are registries of their own: other processes.
//!
//! The last two tests: wake-one assumes that the one waiter a release wakes
//! either takes the key or finds it held by someone who will publish a
//! release later. A holder that never publishes (a process that crashed, a
//! lease that ran out) does not: the waiters a release did not wake keep the
//! timer of the holder they saw last, which may be a long lease that ended
//! early. So a wake-up stays owed until the woken waiter holds the key (a
//! busy answer does not settle it), and no waiter is stranded.
#![cfg(feature = "redis")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_runtime::backend::{AcquireRequest, Attempt, Lease, LockBackend, Renewal, WakeSource};
use dlock_runtime::{BackendError, RedisBackend, Registry};
use dlock_tests::redis_support::hash_tagged;
use dlock_tests::{server_url, servers_missing, unique_key};
use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};

fn url() -> String {
    server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/")
}

async fn redis() -> RedisBackend {
    let url = url();
    RedisBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// The first holder's lease: far longer than the test.
const LONG: Duration = Duration::from_secs(30);

/// What happened to the marked waiter's attempts.
#[derive(Debug)]
enum Event {
    /// An attempt is paused before it reaches the server.
    Paused,
    /// An attempt answered (busy: true / held: false / other: None).
    Answered(Option<bool>),
}

/// The Redis backend; the marked waiter's attempts can be paused once and
/// report their answers.
struct Steered {
    inner: RedisBackend,
    /// Every attempt, marked or not.
    attempts: AtomicUsize,
    /// The `wait` that marks the waiter whose attempts the test steers.
    marked_wait: Duration,
    /// Set: the marked waiter's next attempt waits for this to be answered.
    pause: Mutex<Option<oneshot::Receiver<()>>>,
    events: mpsc::UnboundedSender<Event>,
}

impl std::fmt::Debug for Steered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Steered")
    }
}

impl LockBackend for Steered {
    fn kind(&self) -> &'static str {
        "steered-redis"
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        Box::pin(async move {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            if request.wait != self.marked_wait {
                return self.inner.try_acquire(request).await;
            }
            let pause = self.pause.lock().unwrap().take();
            if let Some(resume) = pause {
                let _ = self.events.send(Event::Paused);
                let _ = resume.await;
            }
            let answer = self.inner.try_acquire(request).await;
            let _ = self.events.send(Event::Answered(match &answer {
                Ok(Attempt::Busy { .. }) => Some(true),
                Ok(Attempt::Held(_)) => Some(false),
                _ => None,
            }));
            answer
        })
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.inner.wake_source(request)
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        self.inner.abandon(request)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        self.inner.renew_all(batch)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        self.inner.release(lease)
    }

    fn needs_io_runtime(&self) -> bool {
        self.inner.needs_io_runtime()
    }
}

async fn steered(marked_wait: Duration, events: mpsc::UnboundedSender<Event>) -> Arc<Steered> {
    Arc::new(Steered {
        inner: redis().await,
        attempts: AtomicUsize::new(0),
        marked_wait,
        pause: Mutex::new(None),
        events,
    })
}

fn registry(backend: &Arc<Steered>) -> Registry {
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

async fn next_event(events: &mut mpsc::UnboundedReceiver<Event>) -> Event {
    tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .expect("the marked waiter did something within 5 s")
        .expect("the backend lives")
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

    let (events, _) = mpsc::unbounded_channel();
    let backend = steered(Duration::ZERO, events).await;
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

/// The marked waiter's `wait`.
const HANG_WAIT: Duration = Duration::from_secs(20);

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

    let (events_tx, mut events) = mpsc::unbounded_channel();
    let backend = steered(HANG_WAIT, events_tx).await;
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

    // Its next attempt hangs: the resume is never sent.
    let (_never, hang) = oneshot::channel();
    *backend.pause.lock().unwrap() = Some(hang);
    first.release().await.expect("release the first holder");
    // The release woke the first waiter, whose attempt now hangs (its
    // earlier attempts' answers come first).
    while !matches!(next_event(&mut events).await, Event::Paused) {}
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

/// Holder H (another process) holds the key with a 30 s lease; waiters A and
/// B (this process) sleep on it, A registered first. H releases: the one
/// wake-up goes to A. Before A's attempt reaches the server, a third process
/// C takes the key with a 2 s lease and dies (no release will ever be
/// published; its key simply expires). A's attempt answers busy (C), and A's
/// caller gives up (an HTTP client went away; or A's `wait` ended).
///
/// The key is free 2 s later. B, which the release never woke, still sleeps
/// until H's *old* expiry (~30 s) — past the 2 s crash-TTL the design allows
/// ("a crashed holder must not stall them to the wait limit": here B's
/// 25 s `wait` runs out first). Before wake-one, H's release woke B too, and B
/// either took the key at once or timed its next look to C's 2 s expiry.
///
/// Fails on the current code: B has not taken the key 8 s after C's key
/// expired. Fix: settle `OwedWake` only on `Held`; on `Busy` keep it owed, so
/// a woken waiter that then leaves without ever holding passes the wake-up
/// on (the next waiter looks, sees the new holder, and times its retry to
/// that holder's expiry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_not_woken_sleeps_past_a_crashed_holders_expiry() {
    scenario("break11-wake-one-crash", Leaves::Cancelled, 2000).await;
}

/// The same without any cancellation, with waiters of different `wait`s: A
/// (`wait` 3 s) is woken by H's release, finds C's key (4 s, C crashed), and
/// its `wait` runs out while C's key still lives: A answers busy and leaves.
/// B (`wait` 25 s), never woken, sleeps until H's old expiry (~30 s) and so
/// fails with `Busy` although the key has been free for ~20 s of its wait.
///
/// Fails on the current code: B has not taken the key 8 s after C's key
/// expired. Same fix (the deadline after a busy answer passes the wake-up
/// on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_wait_ends_after_a_busy_wake_strands_the_next() {
    scenario("break11-wake-one-deadline", Leaves::WaitRunsOut, 4000).await;
}

/// How A leaves after its woken attempt answered busy.
#[derive(PartialEq)]
enum Leaves {
    /// Its caller drops the acquisition.
    Cancelled,
    /// Its `wait` (3 s) runs out.
    WaitRunsOut,
}

async fn scenario(case: &str, leaves: Leaves, c_ttl_ms: u64) {
    let a_wait = match leaves {
        Leaves::Cancelled => Duration::from_secs(21),
        Leaves::WaitRunsOut => Duration::from_secs(3),
    };
    let key = unique_key(case);
    let stored = format!("dlock:{key}");
    let holder = Registry::builder().default_backend(redis().await).build();
    let first = holder
        .lock(&key)
        .lease(LONG)
        .acquire()
        .await
        .expect("the first holder");

    let (events_tx, mut events) = mpsc::unbounded_channel();
    let backend = steered(a_wait, events_tx).await;
    let waiters = registry(&backend);

    // A: registers first (its two attempts: try, subscribe, try again).
    let (cancel_a, a_cancelled) = oneshot::channel::<()>();
    let a = tokio::spawn({
        let (waiters, key) = (waiters.clone(), key.clone());
        async move {
            tokio::select! {
                guard = waiters.lock(&key).lease(LONG).wait(a_wait).acquire() => {
                    assert!(
                        matches!(guard, Err(dlock_runtime::LockError::Busy { .. })),
                        "A cannot take the key here: {:?}",
                        guard.map(|_| ())
                    );
                }
                _ = a_cancelled => {}
            }
        }
    });
    assert!(matches!(
        next_event(&mut events).await,
        Event::Answered(Some(true))
    ));
    assert!(matches!(
        next_event(&mut events).await,
        Event::Answered(Some(true))
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;

    // B: registers second.
    let b = tokio::spawn({
        let (waiters, key) = (waiters.clone(), key.clone());
        async move {
            let guard = waiters
                .lock(&key)
                .lease(LONG)
                .wait(Duration::from_secs(25))
                .acquire()
                .await;
            let at = Instant::now();
            match guard {
                Ok(guard) => {
                    guard.release().await.expect("release");
                    Ok(at)
                }
                Err(err) => Err(err),
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    // H releases: the wake-up goes to A, whose attempt is held back.
    let (resume_a, paused) = oneshot::channel();
    *backend.pause.lock().unwrap() = Some(paused);
    first.release().await.expect("release the first holder");
    assert!(
        matches!(next_event(&mut events).await, Event::Paused),
        "the release woke A"
    );

    // C, another process, takes the key for 2 s and crashes.
    let mut admin = redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let set: Option<String> = redis::cmd("SET")
        .arg(hash_tagged(&stored))
        .arg("crashed-process-c")
        .arg("NX")
        .arg("PX")
        .arg(c_ttl_ms)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        set.is_some(),
        "the key was free after H's release (B must not have taken it)"
    );
    let c_expires = Instant::now() + Duration::from_millis(c_ttl_ms);

    // A looks: busy (C). Then A's caller gives up.
    resume_a.send(()).unwrap();
    assert!(
        matches!(next_event(&mut events).await, Event::Answered(Some(true))),
        "A's woken attempt finds C's key"
    );
    if leaves == Leaves::Cancelled {
        tokio::time::sleep(Duration::from_millis(100)).await;
        cancel_a.send(()).unwrap();
    } else {
        // A's last look at its deadline: still C's key.
        assert!(matches!(
            next_event(&mut events).await,
            Event::Answered(Some(true))
        ));
        assert!(
            Instant::now() < c_expires,
            "A's wait ended while C's key lived"
        );
    }
    a.await.unwrap();

    // C's key expires at `c_expires`; B should take the key shortly after.
    let budget = c_expires + Duration::from_secs(8) - Instant::now();
    let took = tokio::time::timeout(budget, b).await;
    let took = match took {
        Ok(joined) => joined.expect("B's task"),
        Err(_) => panic!(
            "B has not taken the key 8 s after C's key expired (the key is free): B still \
             sleeps until the first holder's old 30 s expiry, because the one wake-up of that \
             release went to A, which found C and left"
        ),
    };
    let at = took.expect("B takes the key");
    assert!(
        at < c_expires + Duration::from_secs(3),
        "B took the key {:?} after C's key expired",
        at.duration_since(c_expires)
    );
}
