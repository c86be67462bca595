//! What the benchmark programs share: timing helpers and the macro-overhead
//! pair (the attribute against the hand-written guard, same global registry).

#![allow(dead_code)] // each bench uses its own subset

use std::time::{Duration, Instant};

use dlock_runtime::{LockError, distributed_lock, lock};

/// Rounds per comparison; each pair runs alternately and the medians are compared.
pub(crate) const ROUNDS: usize = 5;

#[distributed_lock(key = "bench:{i}", lease = "30s")]
pub(crate) async fn annotated(i: u64) -> Result<u64, LockError> {
    Ok(i)
}

/// What the attribute expands to, written by hand with the guard.
pub(crate) async fn hand_written(i: u64) -> Result<u64, LockError> {
    let guard = lock(format!("bench:{i}"))
        .lease(Duration::from_secs(30))
        .acquire()
        .await?;
    guard.release().await?;
    Ok(i)
}

/// Operations per second of `op` over `n` distinct keys, one after another.
pub(crate) async fn rate<F, Fut>(n: u64, mut op: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let started = Instant::now();
    for i in 0..n {
        op(i).await;
    }
    n as f64 / started.elapsed().as_secs_f64()
}

/// The median (the upper one of an even count).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Medians of (attribute, hand-written guard) acquisitions per second on the
/// global registry's default backend, `n` per round.
pub(crate) async fn macro_overhead(n: u64) -> (f64, f64) {
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        base.push(
            rate(n, |i| async move {
                hand_written(i).await.map(drop).expect("guard")
            })
            .await,
        );
        ours.push(
            rate(n, |i| async move {
                annotated(i).await.map(drop).expect("attribute")
            })
            .await,
        );
    }
    (median(ours), median(base))
}
