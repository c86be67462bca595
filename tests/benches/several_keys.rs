//! Several keys: a hold of two keys taken in one step (`lock_all`: one
//! Redis script, one PostgreSQL statement, one SQLite transaction) against
//! the same two keys taken as two single acquisitions in sequence (lock A,
//! then lock B), in one run, as ratios.
//!
//! ```sh
//! cargo bench -p dlock-tests --features redis,postgres,mysql,sqlite --bench several_keys
//! cargo bench -p dlock-tests --features redis,postgres,mysql,sqlite --bench several_keys -- --quick
//! ```
//!
//! (`mysql` only because the PostgreSQL server of its own is started by the
//! SQL benchmark's code, which starts MariaDB too.) Needs `redis-server` on
//! `PATH` and PostgreSQL 15 installed
//! (`scripts/servers.sh up` installs both; their servers need not run). The
//! benchmark starts **servers of its own**: Redis on `127.0.0.1:47314`
//! (no persistence) and a PostgreSQL cluster made by `initdb` on
//! `127.0.0.1:47875` (or the first free of the next few ports of the same
//! parity) under `target/bench-several-keys/`, with the test servers'
//! settings (no fsync); SQLite is a file in a temporary directory. They are
//! stopped and removed at the end, also when a contender fails.
//!
//! - **What one hold is**: acquire both keys (uncontended, distinct keys
//!   each time, all in one Redis hash slot), then release both. Both
//!   contenders release the two keys concurrently (the hold's release does;
//!   the sequence joins its two releases), so the difference is the
//!   acquisition: one round trip against two.
//! - **Concurrency 1** (one hold after another) and **concurrency 16**
//!   (16 tasks), each a run of a fixed number of holds; holds per second.
//! - **Interleaved rounds**: every round runs each contender once, in an
//!   order rotated each round; one unrecorded warm-up run of each first.
//!   Medians over the rounds; the ratio is one step's holds/s over the
//!   sequence's.
//!
//! It prints a Markdown table. Nothing is asserted: a contender that fails
//! aborts the run. `--quick` (or `DLOCK_BENCH_QUICK=1`) runs briefly, to
//! check that it works; its figures are not for reading.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{LockBackend, PostgresBackend, RedisBackend, Registry, SqliteBackend};
use dlock_tests::redis_support::OwnRedis;

mod common;
use common::rounds::{median_of, rotated_rounds};

// The SQL benchmark's servers of its own (MariaDB unused here).
#[allow(dead_code)]
#[path = "sql/server.rs"]
mod server;
use server::OwnServer;

const REDIS_PORT: u16 = 47314;
const PG_PORT: u16 = 47875;

/// The two ways to take two keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    OneStep,
    InSequence,
}

impl Who {
    fn name(self) -> &'static str {
        match self {
            Who::OneStep => "one step (`lock_all`)",
            Who::InSequence => "in sequence (lock A, lock B)",
        }
    }
}

const ALL: [Who; 2] = [Who::OneStep, Who::InSequence];

/// How much each run does.
struct Plan {
    rounds: usize,
    /// Holds per run, by backend: Redis, PostgreSQL, SQLite.
    holds: [usize; 3],
}

impl Plan {
    fn full() -> Self {
        Plan {
            rounds: 7,
            holds: [3000, 1500, 1500],
        }
    }

    fn quick() -> Self {
        Plan {
            rounds: 2,
            holds: [200, 100, 100],
        }
    }
}

/// One hold of the pair `i` of run `run`, taken as `who` says.
async fn hold(registry: &Registry, who: Who, run: u64, i: usize) -> anyhow::Result<()> {
    // One hash tag: the pair is in one Redis slot.
    let (a, b) = (
        format!("{{pair:{run}:{i}}}:a"),
        format!("{{pair:{run}:{i}}}:b"),
    );
    let lease = Duration::from_secs(30);
    match who {
        Who::OneStep => {
            let guard = registry.lock_all([a, b]).lease(lease).acquire().await?;
            guard.release().await?;
        }
        Who::InSequence => {
            let first = registry.lock(a).lease(lease).acquire().await?;
            let second = registry.lock(b).lease(lease).acquire().await?;
            let (x, y) = tokio::join!(first.release(), second.release());
            x?;
            y?;
        }
    }
    Ok(())
}

/// Holds per second of `holds` holds over `concurrency` tasks.
async fn run(
    registry: &Registry,
    who: Who,
    holds: usize,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let run: u64 = rand::random();
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for task in 0..concurrency {
        let registry = registry.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = task;
            while i < holds {
                hold(&registry, who, run, i).await?;
                i += concurrency;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(holds as f64 / started.elapsed().as_secs_f64())
}

/// The medians of both contenders on `registry` at `concurrency`: (one
/// step, in sequence) holds/s.
async fn compare(
    registry: &Registry,
    holds: usize,
    concurrency: usize,
    rounds: usize,
) -> anyhow::Result<(f64, f64)> {
    let samples = rotated_rounds(
        &ALL,
        rounds,
        async |who| {
            let _ = run(registry, who, holds / 4, concurrency).await;
        },
        async |_, who| run(registry, who, holds, concurrency).await,
    )
    .await?;
    Ok((
        median_of(&samples, &Who::OneStep, |s| *s),
        median_of(&samples, &Who::InSequence, |s| *s),
    ))
}

fn servers_root() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("bench-several-keys")
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "Two keys in one step against two single acquisitions in sequence, on Redis, \
             PostgreSQL and SQLite, as ratios.\n\
             usage: cargo bench -p dlock-tests --features redis,postgres,mysql,sqlite --bench \
             several_keys [-- --quick]\n\
             Starts Redis on 127.0.0.1:{REDIS_PORT} and PostgreSQL 15 on 127.0.0.1:{PG_PORT} \
             (fresh, under target/bench-several-keys/). --quick (or DLOCK_BENCH_QUICK=1): \
             briefly, to check that it works."
        );
        return Ok(());
    }
    let quick = args.iter().any(|a| a == "--quick")
        || std::env::var("DLOCK_BENCH_QUICK").is_ok_and(|v| v == "1");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let plan = if quick { Plan::quick() } else { Plan::full() };
    runtime.block_on(bench(plan, quick))
}

async fn bench(plan: Plan, quick: bool) -> anyhow::Result<()> {
    let load_at_start = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let redis = OwnRedis::start(REDIS_PORT, &["--save", "", "--appendonly", "no"]).await;
    let pg = OwnServer::postgres(PG_PORT, &servers_root()).await?;
    let sqlite_dir = tempfile::tempdir()?;
    let backends: [(&str, Arc<dyn LockBackend>); 3] = [
        (
            "Redis",
            Arc::new(RedisBackend::connect(&redis.url()).await?),
        ),
        (
            "PostgreSQL",
            Arc::new(PostgresBackend::connect(&pg.url()).await?),
        ),
        (
            "SQLite",
            Arc::new(
                SqliteBackend::open(
                    sqlite_dir.path().join("locks.db"),
                    Duration::from_millis(25),
                )
                .await?,
            ),
        ),
    ];
    let mut out = String::new();
    writeln!(
        out,
        "| backend | concurrency | one step (holds/s) | in sequence (holds/s) | one step ÷ in sequence |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|")?;
    for ((name, backend), holds) in backends.into_iter().zip(plan.holds) {
        let registry = Registry::builder().default_backend(backend).build();
        for concurrency in [1, 16] {
            let (one_step, in_sequence) =
                compare(&registry, holds, concurrency, plan.rounds).await?;
            writeln!(
                out,
                "| {name} | {concurrency} | {one_step:.0} | {in_sequence:.0} | {:.2}× |",
                one_step / in_sequence
            )?;
            eprintln!("{name} c={concurrency}: done");
        }
        registry.shutdown(Duration::from_secs(5)).await;
    }
    let load_at_end = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "## Several keys: two keys in one step against two acquisitions in sequence{}\n",
        if quick {
            " (--quick: not for reading)"
        } else {
            ""
        }
    );
    println!(
        "{} and {}: acquire both keys of a fresh pair, release both; medians of {} \
         interleaved rounds.\n",
        Who::OneStep.name(),
        Who::InSequence.name(),
        plan.rounds
    );
    print!("{out}");
    println!(
        "\nload average at start: {}, at end: {}",
        load_at_start.trim_end(),
        load_at_end.trim_end()
    );
    drop(pg);
    drop(redis);
    Ok(())
}
