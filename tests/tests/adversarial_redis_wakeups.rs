//! Adversarial review of the Redis wake-one change (`notify_one` per release
//! message, `OwedWake` in the wait loop).
//!
//! Wake-one assumes that the one waiter a release wakes either takes the key
//! or finds it held by someone who will publish a release later ("a busy
//! key's holder will wake the next waiter when it releases"). A holder that
//! never publishes — a process that crashed, a lease that ran out — breaks
//! that assumption: the waiters a release did *not* wake keep the timer of
//! the holder they saw last, which may be a long lease that ended early.
//! Before wake-one every release woke every waiter, so every waiter looked
//! at the new holder and timed its next look to *that* holder's expiry.
//!
//! Found by the adversarial review of issue 11; both tests failed until the
//! wait loop kept a wake-up owed until the woken waiter *holds* the key (a
//! busy answer no longer settles it), so a woken waiter that leaves without
//! the key passes the wake-up on.
#![cfg(feature = "redis")]

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

async fn next_event(events: &mut mpsc::UnboundedReceiver<Event>) -> Event {
    tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .expect("the marked waiter did something within 5 s")
        .expect("the backend lives")
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
    let backend = Arc::new(Steered {
        inner: redis().await,
        marked_wait: a_wait,
        pause: Mutex::new(None),
        events: events_tx,
    });
    let waiters = Registry::builder()
        .default_backend(backend.clone() as Arc<dyn LockBackend>)
        .build();

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
