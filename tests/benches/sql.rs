//! dlock on PostgreSQL and MySQL/MariaDB against what people write by hand
//! with sqlx, in one run, as ratios.
//!
//! ```sh
//! scripts/servers.sh up
//! cargo bench -p dlock-tests --features postgres,mysql --bench sql
//! ```
//!
//! 1. **Lease-mode throughput**, uncontended acquire+release over distinct
//!    keys at concurrency 1 and 32: dlock's guard (watchdog registration,
//!    tracing span, the I/O runtime hop included) against the same two
//!    statements (dlock's acquire upsert and release) written by hand with
//!    sqlx on one pool of the same size and settings.
//! 2. **PostgreSQL session mode** against sqlx's own `PgAdvisoryLock` (what a
//!    Rust user reaches for): acquire+release over distinct keys at
//!    concurrency 1 and 32, sqlx's pool sized to the concurrency.
//! 3. **Cross-process handoff**: 16 waiters in 4 processes (4 tasks each,
//!    `dlock-lock-child handoff`, connections warmed up) take one key 4 times
//!    each, releasing at once;
//!    per handoff = the gap from one holder's release to the next holder's
//!    grant (wall clock, one machine), the median over a convoy, the median
//!    over convoys. PostgreSQL lease mode (NOTIFY), MySQL lease mode (polling,
//!    cap 50 ms), and both session modes (the server hands the key over).
//!
//! It prints a Markdown table.

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dlock_runtime::{MemoryBackend, MysqlBackend, PostgresBackend, Registry};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::{PgAdvisoryLock, PgConnectOptions, PgPoolOptions};

mod common;
use common::{ROUNDS, median, throughput};

const CONVOY_PROCESSES: usize = 4;
const CONVOY_TASKS: usize = 4;
const CONVOYS: usize = 5;
/// Holds per task and convoy.
const CONVOY_ROUNDS: usize = 4;

/// dlock's PostgreSQL lease statements (`dlock-runtime/src/backend/sql/postgres/mod.rs`).
const PG_ACQUIRE: &str = "INSERT INTO dlock_leases AS l (key, owner, token, expires_at) \
    VALUES ($1, $2, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint, \
            clock_timestamp() + $3 * interval '1 millisecond') \
    ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, \
        token = GREATEST(l.token + 1, excluded.token), \
        expires_at = excluded.expires_at, wanted = false \
    WHERE l.owner IS NULL OR l.owner = excluded.owner OR l.expires_at <= clock_timestamp() \
    RETURNING token";
const PG_RELEASE: &str = "WITH r AS (UPDATE dlock_leases SET owner = NULL, \
        expires_at = clock_timestamp() WHERE key = $1 AND owner = $2 RETURNING key, wanted) \
    SELECT pg_notify($3, key) FROM r WHERE wanted";

/// dlock's MySQL lease statements (`dlock-runtime/src/backend/sql/mysql/mod.rs`).
const MY_N: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

fn my_acquire() -> String {
    let n = MY_N;
    let free = format!("(expires_us <= {n} OR owner = ?)");
    format!(
        "INSERT INTO dlock_leases (k, owner, token, expires_us) \
         VALUES (?, ?, LAST_INSERT_ID({n}), {n} + ?) \
         ON DUPLICATE KEY UPDATE \
         token = IF({free}, LAST_INSERT_ID(GREATEST(token + 1, {n})), \
                    token + 0 * LAST_INSERT_ID(LEAST(GREATEST(expires_us - {n}, 0), 1099511627775) + 1)), \
         owner = IF({free}, ?, owner), \
         expires_us = IF({free}, {n} + ?, expires_us)"
    )
}

fn my_release() -> String {
    format!("UPDATE dlock_leases SET owner = NULL, expires_us = {MY_N} WHERE k = ? AND owner = ?")
}

fn pg_url() -> String {
    std::env::var("DLOCK_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://dlock:dlock@127.0.0.1:45432/dlock".into())
}

fn my_url() -> String {
    std::env::var("DLOCK_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://dlock:dlock@127.0.0.1:43306/dlock".into())
}

fn owner() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

async fn connect(url: &str) -> anyhow::Result<Registry> {
    let backend = dlock_runtime::connect(url)
        .await
        .map_err(|e| anyhow::anyhow!("{e}: start the servers first (scripts/servers.sh up)"))?;
    Ok(Registry::builder().default_backend(backend).build())
}

async fn bench() -> anyhow::Result<()> {
    // The global registry is not used; install one so that nothing falls
    // back to it by accident.
    dlock_runtime::init(
        Registry::builder()
            .default_backend(MemoryBackend::new())
            .build(),
    )?;
    // Make sure the tables exist.
    PostgresBackend::connect(&pg_url()).await?;
    MysqlBackend::connect(&my_url()).await?;
    let run: u64 = rand::random();
    let mut table = String::new();
    writeln!(table, "| measure | dlock | baseline | ratio |")?;
    writeln!(table, "|---|---:|---:|---:|")?;

    // 1. Lease-mode throughput against the same statements by hand.
    let pg = connect(&pg_url()).await?;
    let my = connect(&my_url()).await?;
    let pg_options: PgConnectOptions = pg_url().parse()?;
    let pg_pool = PgPoolOptions::new()
        .max_connections(10)
        .test_before_acquire(false)
        .connect_with(pg_options.options([("default_transaction_isolation", "read committed")]))
        .await?;
    let my_pool = MySqlPoolOptions::new()
        .max_connections(10)
        .test_before_acquire(false)
        .connect(&my_url())
        .await?;
    let my_acquire: Arc<str> = my_acquire().into();
    let my_release: Arc<str> = my_release().into();
    for (concurrency, n) in [(1u64, 1_000u64), (32, 5_000)] {
        let (mut pg_ours, mut pg_hand, mut my_ours, mut my_hand) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let tag = format!("{run}:{round}:{concurrency}");
            pg_hand.push(
                throughput(concurrency, n, {
                    let (pool, tag) = (pg_pool.clone(), tag.clone());
                    move |i| {
                        let (pool, key) = (pool.clone(), format!("bench:pg-hand:{tag}:{i}"));
                        async move {
                            let owner = owner();
                            let token: Option<i64> = sqlx::query_scalar(PG_ACQUIRE)
                                .bind(&key)
                                .bind(&owner)
                                .bind(30_000i64)
                                .fetch_optional(&pool)
                                .await
                                .expect("acquire");
                            assert!(token.is_some());
                            sqlx::query(PG_RELEASE)
                                .bind(&key)
                                .bind(&owner)
                                .bind("dlock")
                                .execute(&pool)
                                .await
                                .expect("release");
                        }
                    }
                })
                .await,
            );
            pg_ours.push(dlock_throughput(&pg, concurrency, n, &format!("pg:{tag}")).await);
            my_hand.push(
                throughput(concurrency, n, {
                    let (pool, tag) = (my_pool.clone(), tag.clone());
                    let (acquire, release) = (my_acquire.clone(), my_release.clone());
                    move |i| {
                        let (pool, key) = (pool.clone(), format!("bench:my-hand:{tag}:{i}"));
                        let (acquire, release) = (acquire.clone(), release.clone());
                        async move {
                            let owner = owner();
                            let lease_us = 30_000_000i64;
                            let done = sqlx::query(sqlx::AssertSqlSafe(acquire))
                                .bind(&key)
                                .bind(&owner)
                                .bind(lease_us)
                                .bind(&owner)
                                .bind(&owner)
                                .bind(&owner)
                                .bind(&owner)
                                .bind(lease_us)
                                .execute(&pool)
                                .await
                                .expect("acquire");
                            assert!(done.last_insert_id() > 1 << 40);
                            sqlx::query(sqlx::AssertSqlSafe(release))
                                .bind(&key)
                                .bind(&owner)
                                .execute(&pool)
                                .await
                                .expect("release");
                        }
                    }
                })
                .await,
            );
            my_ours.push(dlock_throughput(&my, concurrency, n, &format!("my:{tag}")).await);
        }
        for (db, ours, hand) in [
            ("PostgreSQL", median(pg_ours), median(pg_hand)),
            ("MariaDB", median(my_ours), median(my_hand)),
        ] {
            writeln!(
                table,
                "| {db} lease, acquire+release/s, c={concurrency} | {ours:.0} | same statements by hand (sqlx, one pool) {hand:.0} | {:.2}× |",
                ours / hand
            )?;
        }
    }

    // 2. PostgreSQL session mode against sqlx's PgAdvisoryLock.
    let pg_session = connect(&format!("{}?mode=session", pg_url())).await?;
    for (concurrency, n) in [(1u64, 1_000u64), (32, 5_000)] {
        let sqlx_pool = PgPoolOptions::new()
            .max_connections(concurrency as u32)
            .connect(&pg_url())
            .await?;
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let tag = format!("{run}:{round}:{concurrency}");
            theirs.push(
                throughput(concurrency, n, {
                    let (pool, tag) = (sqlx_pool.clone(), tag.clone());
                    move |i| {
                        let (pool, key) = (pool.clone(), format!("bench:sqlx-advisory:{tag}:{i}"));
                        async move {
                            let lock = PgAdvisoryLock::new(key);
                            let conn = pool.acquire().await.expect("connection");
                            let guard = lock.acquire(conn).await.expect("lock");
                            guard.release_now().await.expect("unlock");
                        }
                    }
                })
                .await,
            );
            ours.push(dlock_throughput(&pg_session, concurrency, n, &format!("pgs:{tag}")).await);
        }
        let (ours, theirs) = (median(ours), median(theirs));
        writeln!(
            table,
            "| PostgreSQL session, acquire+release/s, c={concurrency} | {ours:.0} | sqlx `PgAdvisoryLock` {theirs:.0} | {:.2}× |",
            ours / theirs
        )?;
        sqlx_pool.close().await;
    }

    // 3. Cross-process handoff.
    for (name, url, target) in [
        ("PostgreSQL lease (NOTIFY)", pg_url(), "≤ 1 ms"),
        (
            "MariaDB lease (polling, cap 50 ms)",
            my_url(),
            "poll cap 50 ms",
        ),
        (
            "PostgreSQL session",
            format!("{}?mode=session", pg_url()),
            "≤ 1 ms",
        ),
        (
            "MariaDB session",
            format!("{}?mode=session", my_url()),
            "≤ 1 ms",
        ),
    ] {
        let mut convoys = Vec::new();
        for k in 0..CONVOYS {
            convoys.push(convoy_processes(
                &url,
                &format!("handoff:{run}:{name}:{k}"),
            )?);
        }
        let ms = median(convoys);
        writeln!(
            table,
            "| handoff, {} waiters in {CONVOY_PROCESSES} processes, ms: {name} | {ms:.3} | target {target} | |",
            CONVOY_PROCESSES * CONVOY_TASKS
        )?;
    }

    print!("{table}");
    println!("\n{ROUNDS} rounds of each throughput pair, {CONVOYS} convoys per handoff, medians.");
    Ok(())
}

/// dlock's guard: acquire+release per second over distinct keys.
async fn dlock_throughput(registry: &Registry, concurrency: u64, n: u64, tag: &str) -> f64 {
    throughput(concurrency, n, {
        let (registry, tag) = (registry.clone(), tag.to_owned());
        move |i| {
            let (registry, key) = (registry.clone(), format!("bench:dlock:{tag}:{i}"));
            async move {
                let guard = registry
                    .lock(key)
                    .lease(Duration::from_secs(30))
                    .acquire()
                    .await
                    .expect("acquire");
                guard.release().await.expect("release");
            }
        }
    })
    .await
}

/// One convoy over [`CONVOY_PROCESSES`] child processes: answers the median
/// milliseconds from a release to the next grant.
fn convoy_processes(url: &str, key: &str) -> anyhow::Result<f64> {
    let start_at = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() + 2_000;
    let children: Vec<_> = (0..CONVOY_PROCESSES)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_dlock-lock-child"))
                .args([
                    "handoff",
                    url,
                    key,
                    &CONVOY_TASKS.to_string(),
                    &CONVOY_ROUNDS.to_string(),
                    &start_at.to_string(),
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut holds: Vec<(u128, u128)> = Vec::new();
    for child in children {
        let out = child.wait_with_output()?;
        anyhow::ensure!(out.status.success(), "a convoy child failed");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = line.split_whitespace().skip(1);
            let (Some(a), Some(r)) = (parts.next(), parts.next()) else {
                continue;
            };
            holds.push((a.parse()?, r.parse()?));
        }
    }
    anyhow::ensure!(
        holds.len() == CONVOY_PROCESSES * CONVOY_TASKS * CONVOY_ROUNDS,
        "holds: {holds:?}"
    );
    holds.sort_unstable();
    let gaps: Vec<f64> = holds
        .windows(2)
        .map(|w| w[1].0.saturating_sub(w[0].1) as f64 / 1e6)
        .collect();
    Ok(median(gaps))
}
