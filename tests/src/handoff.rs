//! The handoff measurement: how long a waiter takes to get a key after its
//! holder releases it.

use std::time::{Duration, Instant};

use dlock_runtime::{LockBuilder, LockError, LockGuard, Registry};

/// Handoff times, sorted.
#[derive(Debug, Clone)]
pub struct Handoffs(pub Vec<Duration>);

impl Handoffs {
    /// `handoffs`, sorted.
    pub fn sorted(mut handoffs: Vec<Duration>) -> Handoffs {
        handoffs.sort();
        Handoffs(handoffs)
    }

    /// The median (the upper one of an even count).
    pub fn median(&self) -> Duration {
        self.0[self.0.len() / 2]
    }
}

/// Hands `key` from `holder` to a waiter of `waiter` `rounds` times and
/// answers the handoffs: each round the holder takes the key with a 30 s
/// lease, a waiter starts waiting (up to 20 s), and `settle` later the holder
/// releases; the handoff is the time from the release call to the waiter's
/// grant. A handoff well below 30 s can only come from a wake-up.
pub async fn measure(
    holder: &Registry,
    waiter: &Registry,
    key: &str,
    rounds: usize,
    settle: Duration,
) -> Handoffs {
    measure_when_ready(
        holder,
        waiter,
        rounds,
        |_| key.to_owned(),
        |_| tokio::time::sleep(settle),
    )
    .await
}

/// [`measure`] with the key of each round given by `key(round)`, and the
/// release made once `ready(key)` (awaited while the waiter waits) is done.
pub async fn measure_when_ready<K, R, Fut>(
    holder: &Registry,
    waiter: &Registry,
    rounds: usize,
    key: K,
    mut ready: R,
) -> Handoffs
where
    K: Fn(usize) -> String,
    R: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut handoffs = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let key = key(round);
        let guard = holder
            .lock(&key)
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .expect("acquire");
        let waiting = start_waiting(waiter, &key, Duration::from_secs(20));
        ready(key).await;
        let released = Instant::now();
        guard.release().await.expect("release");
        let (next, acquired) = waiting.await.expect("task");
        next.expect("handed over").release().await.expect("release");
        handoffs.push(acquired - released);
    }
    Handoffs::sorted(handoffs)
}

/// A task that waits up to `wait` for `key` on `waiter`, and answers the
/// outcome with the instant it came.
pub fn start_waiting(
    waiter: &Registry,
    key: &str,
    wait: Duration,
) -> tokio::task::JoinHandle<(Result<LockGuard, LockError>, Instant)> {
    let (waiter, key) = (waiter.clone(), key.to_owned());
    tokio::spawn(async move {
        let g = waiter.lock(&key).wait(wait).acquire().await;
        (g, Instant::now())
    })
}

/// What a handoff hands over: the hold its holder releases and the request
/// that waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handover {
    /// A plain lock to a waiting plain lock.
    Plain,
    /// A writer (the plain lock) to a waiting reader.
    WriterToReader,
    /// A reader to a waiting writer.
    ReaderToWriter,
    /// One of `permits` permit holders, every slot held, to a waiting
    /// permit seeker.
    Permit {
        /// The semaphore's permits.
        permits: u32,
    },
}

impl Handover {
    /// The holders' request.
    pub fn hold(self, lock: LockBuilder) -> LockBuilder {
        match self {
            Handover::Plain | Handover::WriterToReader => lock,
            Handover::ReaderToWriter => lock.read(),
            Handover::Permit { permits } => lock.permits(permits),
        }
    }

    /// The waiter's request.
    pub fn wait(self, lock: LockBuilder) -> LockBuilder {
        match self {
            Handover::Plain | Handover::ReaderToWriter => lock,
            Handover::WriterToReader => lock.read(),
            Handover::Permit { permits } => lock.permits(permits),
        }
    }

    /// How many holders hold the key before the waiter comes: every slot of
    /// a semaphore, else one.
    pub fn holders(self) -> u32 {
        match self {
            Handover::Permit { permits } => permits,
            _ => 1,
        }
    }
}

/// [`measure`] for any [`Handover`]: each round the holders take the key
/// `key(round)` on `holder` (each in a task of its own, a 30 s lease), a
/// waiter on `waiter` starts waiting (up to 20 s), and `settle` later one
/// holder releases; the handoff is the time from that release call to the
/// waiter's grant. The other holders release after the waiter.
pub async fn measure_handover<K>(
    holder: &Registry,
    waiter: &Registry,
    handover: Handover,
    rounds: usize,
    key: K,
    settle: Duration,
) -> Handoffs
where
    K: Fn(usize) -> String,
{
    let mut handoffs = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let key = key(round);
        let mut guards = Vec::new();
        for _ in 0..handover.holders() {
            let (registry, key) = (holder.clone(), key.clone());
            let task = tokio::spawn(async move {
                handover
                    .hold(registry.lock(key))
                    .lease(Duration::from_secs(30))
                    .acquire()
                    .await
            });
            guards.push(task.await.expect("task").expect("acquire"));
        }
        let waiting = {
            let (waiter, key) = (waiter.clone(), key.clone());
            tokio::spawn(async move {
                let g = handover
                    .wait(waiter.lock(key))
                    .wait(Duration::from_secs(20))
                    .acquire()
                    .await;
                (g, Instant::now())
            })
        };
        tokio::time::sleep(settle).await;
        let released = Instant::now();
        guards.remove(0).release().await.expect("release");
        let (next, acquired) = waiting.await.expect("task");
        next.expect("handed over").release().await.expect("release");
        for guard in guards {
            guard.release().await.expect("release");
        }
        handoffs.push(acquired - released);
    }
    Handoffs::sorted(handoffs)
}

/// The median of `values` (the upper one of an even count).
pub fn median_f64(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
