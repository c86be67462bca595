//! What the benchmark programs share: timing helpers, the convoy that
//! measures handoffs (in one process here, over processes in [`convoy`]),
//! spreading operations over tasks, the macro-overhead pair (the attribute
//! against the hand-written guard, same global registry), pinning and CPU
//! time ([`cpu`]), and interleaved rounds of contenders ([`rounds`]).

#![allow(dead_code)] // each bench uses its own subset

pub(crate) mod convoy;
pub(crate) mod cpu;
pub(crate) mod rounds;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock_runtime::{LockError, Registry, distributed_lock, lock};
use tokio::sync::Barrier;

pub(crate) use dlock_tests::handoff::median_f64 as median;

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

/// A target's mark: met or not.
pub(crate) fn tick(ok: bool) -> &'static str {
    if ok { "✓" } else { "✗" }
}

/// Tasks per convoy.
pub(crate) const CONVOY: usize = 16;
/// Convoys per handoff figure (their median).
pub(crate) const CONVOYS: usize = 5;
/// How long each convoy task holds the lock.
pub(crate) const HOLD: Duration = Duration::from_millis(1);

/// Holds the lock for [`HOLD`]; answers how long that really took.
pub(crate) async fn hold() -> Duration {
    let started = Instant::now();
    tokio::time::sleep(HOLD).await;
    started.elapsed()
}

/// One convoy turn with dlock on `registry`: acquires `key` (waiting up to
/// 30 s, a lease of 30 s), [`hold`]s it and releases it; answers the hold.
/// Panics, naming `who`, if a call fails.
pub(crate) async fn dlock_turn(registry: &Registry, key: String, who: &str) -> Duration {
    let guard = registry
        .lock(key)
        .wait(Duration::from_secs(30))
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{who}: acquire failed: {e}"));
    let held = hold().await;
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{who}: release failed: {e}"));
    held
}

/// A task's answer; a panic in it is the benchmark's panic.
pub(crate) async fn join<T>(task: tokio::task::JoinHandle<T>) -> T {
    match task.await {
        Ok(value) => value,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => panic!("a benchmark task failed: {e}"),
    }
}

/// One convoy: [`CONVOY`] tasks start together, each runs `op` once (acquire,
/// hold, release; it answers its hold). Answers the milliseconds per handoff.
pub(crate) async fn convoy<F, Fut>(op: F) -> f64
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Duration> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(CONVOY + 1));
    let tasks: Vec<_> = (0..CONVOY)
        .map(|t| {
            let (op, barrier) = (op.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                op(t).await
            })
        })
        .collect();
    barrier.wait().await;
    let started = Instant::now();
    let mut held = Duration::ZERO;
    for task in tasks {
        held += join(task).await;
    }
    per_handoff(started.elapsed(), held)
}

/// Milliseconds per handoff of a convoy that took `wall` with `held` of holds.
pub(crate) fn per_handoff(wall: Duration, held: Duration) -> f64 {
    wall.saturating_sub(held).as_secs_f64() * 1000.0 / (CONVOY - 1) as f64
}

/// The median over [`CONVOYS`] convoys, each on a key of its own.
pub(crate) async fn handoffs<F, Fut>(mut one: F) -> f64
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = f64>,
{
    let mut all = Vec::new();
    for k in 0..CONVOYS {
        all.push(one(k).await);
    }
    median(all)
}

/// Runs `op(i)` for `i` in `0..n`, spread over `concurrency` tasks.
pub(crate) async fn spread<F, Fut>(concurrency: u64, n: u64, op: F)
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let op = op.clone();
            tokio::spawn(async move {
                for i in (t..n).step_by(concurrency as usize) {
                    op(i).await;
                }
            })
        })
        .collect();
    for task in tasks {
        join(task).await;
    }
}

/// Operations per second of `op(i)` for `i` in `0..n`, spread over
/// `concurrency` tasks (task `i % concurrency` runs `op(i)`).
pub(crate) async fn throughput<F, Fut>(concurrency: u64, n: u64, op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let started = Instant::now();
    spread(concurrency, n, op).await;
    n as f64 / started.elapsed().as_secs_f64()
}

/// The wall clock in µs since 1970 (an instant several processes agree on).
pub(crate) fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as u64
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
