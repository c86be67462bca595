//! What the fence costs a write: `fence::check` + the write against the bare
//! write on PostgreSQL, and `fence::redis::set` against a plain `SET`, as
//! ratios.
//!
//! ```sh
//! set -a; . target/servers/urls.env; set +a   # scripts/servers.sh up
//! cargo bench -p dlock-tests --features postgres,redis --bench fence
//! ```
//!
//! Runs against the test servers (`DLOCK_TEST_POSTGRES_URL`,
//! `DLOCK_TEST_REDIS_URL`), so other load on them shows up in both columns
//! alike. One connection, one write at a time (the latency a request pays):
//!
//! - **PostgreSQL**: the bare write is a transaction `BEGIN; UPDATE
//!   bench_fence_data SET val = val + 1 WHERE id = $1; COMMIT`; the fenced
//!   write adds `fence::check` (one upsert statement) before the `UPDATE`,
//!   with a token that grows with each write, over 64 rows and resources.
//! - **Redis**: `SET key value` against `fence::redis::set` (one `EVALSHA`
//!   reading the fence, writing the value and the fence).
//!
//! Interleaved rounds: every round runs each contender once, in an order
//! rotated each round, after one unrecorded warm-up run of each; medians over
//! the rounds.

use std::time::Instant;

use dlock_runtime::FencingToken;
use dlock_runtime::fence;
use sqlx::Connection as _;

mod common;
use common::ROUNDS;
use common::rounds::{median_of, rotated_rounds};

/// Writes per contender per round.
const WRITES: u64 = 400;
/// Rows (and fenced resources) the writes go round.
const ROWS: u64 = 64;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Pg {
    Bare,
    Fenced,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Rd {
    Set,
    Fenced,
}

fn url(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: start the test servers and source target/servers/urls.env")
    })
}

/// Microseconds per write of `n` writes run by `op`.
async fn per_write<F: AsyncFnMut(u64) -> anyhow::Result<()>>(
    n: u64,
    mut op: F,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    for i in 0..n {
        op(i).await?;
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / n as f64)
}

async fn postgres() -> anyhow::Result<(f64, f64)> {
    let mut conn = sqlx::PgConnection::connect(&url("DLOCK_TEST_POSTGRES_URL")).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_fence_data (id bigint PRIMARY KEY, val bigint NOT NULL)",
    )
    .execute(&mut conn)
    .await?;
    sqlx::query(
        "INSERT INTO bench_fence_data SELECT g, 0 FROM generate_series(0, $1) g ON CONFLICT DO NOTHING",
    )
    .bind(ROWS as i64)
    .execute(&mut conn)
    .await?;
    let run = format!("bench-fence:{}", rand::random::<u32>());
    // Tokens grow across rounds: every fenced write passes.
    let mut token = 1u64;
    let samples = rotated_rounds(
        &[Pg::Bare, Pg::Fenced],
        ROUNDS,
        async |_| {},
        async |_, who| {
            per_write(WRITES, async |i| {
                let row = (i % ROWS) as i64;
                let mut tx = conn.begin().await?;
                if who == Pg::Fenced {
                    token += 1;
                    let resource = format!("{run}:{row}");
                    fence::check(&mut tx, &resource, FencingToken::new(token)).await?;
                }
                sqlx::query("UPDATE bench_fence_data SET val = val + 1 WHERE id = $1")
                    .bind(row)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            })
            .await
        },
    )
    .await?;
    sqlx::query("DELETE FROM dlock_fences WHERE resource LIKE $1")
        .bind(format!("{run}:%"))
        .execute(&mut conn)
        .await?;
    Ok((
        median_of(&samples, &Pg::Bare, |s| *s),
        median_of(&samples, &Pg::Fenced, |s| *s),
    ))
}

async fn redis() -> anyhow::Result<(f64, f64)> {
    let mut conn = redis::Client::open(url("DLOCK_TEST_REDIS_URL"))?
        .get_multiplexed_async_connection()
        .await?;
    let run = format!("bench-fence:{}", rand::random::<u32>());
    let mut token = 1u64;
    let samples = rotated_rounds(
        &[Rd::Set, Rd::Fenced],
        ROUNDS,
        async |_| {},
        async |_, who| {
            per_write(WRITES * 5, async |i| {
                let key = format!("{run}:{}", i % ROWS);
                match who {
                    Rd::Set => {
                        let () = redis::cmd("SET")
                            .arg(&key)
                            .arg(i)
                            .query_async(&mut conn)
                            .await?;
                    }
                    Rd::Fenced => {
                        token += 1;
                        fence::redis::set(&mut conn, &key, i.to_string(), FencingToken::new(token))
                            .await?;
                    }
                }
                Ok(())
            })
            .await
        },
    )
    .await?;
    for row in 0..ROWS {
        let key = format!("{run}:{row}");
        let () = redis::cmd("DEL")
            .arg(&key)
            .arg(fence::redis::fence_key(&key))
            .query_async(&mut conn)
            .await?;
    }
    Ok((
        median_of(&samples, &Rd::Set, |s| *s),
        median_of(&samples, &Rd::Fenced, |s| *s),
    ))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let (bare, fenced) = postgres().await?;
    let (set, fenced_set) = redis().await?;
    println!("| store | write | µs per write (median of {ROUNDS}) | ratio |");
    println!("|---|---|---:|---:|");
    println!("| PostgreSQL | BEGIN; UPDATE; COMMIT | {bare:.0} | 1.00 |");
    println!(
        "| PostgreSQL | BEGIN; fence::check; UPDATE; COMMIT | {fenced:.0} | {:.2} |",
        fenced / bare
    );
    println!("| Redis | SET | {set:.0} | 1.00 |");
    println!(
        "| Redis | fence::redis::set | {fenced_set:.0} | {:.2} |",
        fenced_set / set
    );
    Ok(())
}
