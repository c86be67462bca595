//! The handoff measurement: how long a waiter takes to get a key after its
//! holder releases it.

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, Registry};

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

/// The median of `values` (the upper one of an even count).
pub fn median_f64(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
