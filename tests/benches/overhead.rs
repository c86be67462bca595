//! What dlock costs over the work it cannot avoid, measured as ratios in one run.
//!
//! ```sh
//! cargo bench -p dlock-tests --bench overhead
//! ```
//!
//! 1. The attribute against the hand-written guard, on the memory backend (the
//!    macro's own cost: key formatting, policies, the task-local scope).
//! 2. dlock's guard on the memory backend against calling the backend directly
//!    (the runtime's cost: registry, watchdog registration, tracing span).
//! 3. dlock on SQLite against the same two statements (take-over upsert,
//!    owner-checked release) hand-written with sqlx on one pool.
//!
//! Each pair runs alternately, several rounds; the medians are compared.
//! Throughput varies run to run on a shared machine: read the ratios.

use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::backend::{AcquireRequest, Attempt, LockBackend};
use dlock_runtime::{MemoryBackend, Registry};

mod common;
use common::{ROUNDS, hand_written, macro_overhead, median, rate};

fn row(name: &str, baseline: &str, ours: f64, base: f64) {
    println!(
        "| {name} | {ours:>10.0}/s | {baseline}: {base:>10.0}/s | {:.2}x |",
        ours / base
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let n: u64 = std::env::var("DLOCK_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let memory = MemoryBackend::new();
    dlock_runtime::init(Registry::builder().default_backend(memory.clone()).build())?;

    println!("| what | dlock | baseline | ratio |");
    println!("|---|---|---|---|");

    // 1. attribute vs guard
    let (ours, base) = macro_overhead(n).await;
    row(
        "attribute, memory, acquire+release",
        "hand-written guard",
        ours,
        base,
    );

    // 2. runtime vs backend called directly
    let raw = memory.clone();
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let raw = &raw;
        base.push(
            rate(n, |i| async move {
                let request = request(format!("dlock:raw:{i}"));
                let Attempt::Held(lease) = raw.try_acquire(&request).await.expect("raw") else {
                    panic!("busy");
                };
                raw.release(&lease).await.expect("release");
            })
            .await,
        );
        ours.push(
            rate(n, |i| async move {
                hand_written(i).await.map(drop).expect("guard")
            })
            .await,
        );
    }
    row(
        "guard, memory, acquire+release",
        "backend called directly",
        median(ours),
        median(base),
    );

    // 3. SQLite: dlock vs the same statements by hand.
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-overhead.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let url = format!("sqlite://{}", path.display());
    let registry = Registry::from_url(&url).await?;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(5)),
        )
        .await?;
    let pool = Arc::new(pool);
    let n_sql = n / 4;
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let pool = pool.clone();
        base.push(
            rate(n_sql, move |i| {
                let pool = pool.clone();
                async move {
                    let key = format!("dlock:sql-raw:{round}:{i}");
                    let owner = format!("{:032x}", rand::random::<u128>());
                    let token: Option<i64> = sqlx::query_scalar(
                        "INSERT INTO dlock_leases (key, owner, token, expires_at)
                         VALUES (?1, ?2, 1, CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3)
                         ON CONFLICT (key) DO UPDATE SET owner = excluded.owner,
                             token = dlock_leases.token + 1, expires_at = excluded.expires_at
                         WHERE dlock_leases.owner IS NULL
                            OR dlock_leases.expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER)
                         RETURNING token",
                    )
                    .bind(&key)
                    .bind(&owner)
                    .bind(30_000_i64)
                    .fetch_optional(&*pool)
                    .await
                    .expect("acquire");
                    assert!(token.is_some());
                    sqlx::query(
                        "UPDATE dlock_leases SET owner = NULL, expires_at = 0 WHERE key = ?1 AND owner = ?2",
                    )
                    .bind(&key)
                    .bind(&owner)
                    .execute(&*pool)
                    .await
                    .expect("release");
                }
            })
            .await,
        );
        let registry = &registry;
        ours.push(
            rate(n_sql, |i| async move {
                let guard = registry
                    .lock(format!("sql:{round}:{i}"))
                    .acquire()
                    .await
                    .expect("acquire");
                guard.release().await.expect("release");
            })
            .await,
        );
    }
    row(
        "guard, SQLite, acquire+release",
        "same SQL by hand (sqlx)",
        median(ours),
        median(base),
    );
    println!("\n{n} memory and {n_sql} SQLite acquisitions per round, {ROUNDS} rounds, medians.");
    Ok(())
}

fn request(key: String) -> AcquireRequest {
    AcquireRequest::new(
        key,
        format!("{:032x}", rand::random::<u128>()),
        Duration::from_secs(30),
    )
}
