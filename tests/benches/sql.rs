//! dlock on PostgreSQL and MariaDB against what people write by hand with
//! sqlx, in one run, as ratios.
//!
//! ```sh
//! cargo bench -p dlock-tests --features postgres,mysql --bench sql
//! cargo bench -p dlock-tests --features postgres,mysql --bench sql -- --quick
//! ```
//!
//! Needs PostgreSQL 15 and MariaDB installed (`scripts/servers.sh up` installs
//! them; their servers need not run) and, for the pinned section, `taskset`
//! (util-linux). The benchmark starts **servers of its own**: a PostgreSQL
//! cluster made by `initdb` on `127.0.0.1:47871` and a MariaDB data directory
//! made by `mariadb-install-db` on `127.0.0.1:47872` (or the first free of the
//! next few ports of the same parity), both under
//! `target/bench-sql/`, with the test servers' settings (no fsync), runs
//! every section against them and stops and removes them at the end, also
//! when a contender fails. So the servers serve nobody else: their CPU time
//! is the contenders', and what is left in them at the end is counted.
//!
//! 1. **Throughput**, uncontended acquire+release pairs over distinct keys:
//!    - **Lease mode**, PostgreSQL and MariaDB: dlock's guard (watchdog
//!      registration, tracing span included) against the same two statements
//!      (dlock's acquire upsert and release) written by hand with sqlx on one
//!      pool of the same size and settings; and those statements without the
//!      holder record (on PostgreSQL its column and the grant's time left out
//!      of the upsert; on MariaDB, where the record is written once per
//!      registry into `dlock_leases_procs`, the grant's time), so what the
//!      record costs is measured in the same rounds.
//!    - **PostgreSQL session mode** against sqlx's own `PgAdvisoryLock` (what
//!      a Rust user reaches for), sqlx's pool sized to the concurrency.
//!    - **Concurrency 1 runs pinned**: the benchmark runs that section in a
//!      child process of itself under `taskset -c 1`, with the servers pinned
//!      to the same CPU for the duration (every thread of MariaDB; the
//!      postmaster and every process it has forked, so that the backends it
//!      forks for the child inherit the CPU), and a current-thread runtime.
//!      While its connections are still open, the child lists every server
//!      thread's CPUs, the backends serving it included, and the run fails
//!      unless all are on CPU 1. Without `taskset` the section runs
//!      unpinned, is marked so, and no target is judged on it.
//!    - **Concurrency 32 runs unpinned** (client and servers on both CPUs).
//!    - **Interleaved rounds**: every round runs each contender once, in an
//!      order rotated each round, so no contender always runs first (or right
//!      after the same neighbour); one unrecorded warm-up run of each first.
//!      Medians over the rounds.
//!    - **CPU per lock** next to pairs/s, measured around each contender's
//!      run only and divided by its pairs: the client's from the sum over
//!      this process's threads of `/proc/self/task/*/schedstat`, the server's
//!      the same sum over the server's threads (PostgreSQL: the postmaster
//!      and all its children, the backends included).
//! 2. **Handoff** on one hot key: a convoy of 16 tasks over 4 processes
//!    (children of this program, given the server's URL, connections warmed
//!    up) that start together, each acquires once, holds 1 ms and releases.
//!    Per handoff = (wall time − the holds) / 15, the median of several
//!    convoys. PostgreSQL lease mode (`NOTIFY`), MariaDB lease mode (polling,
//!    cap 50 ms) and both session modes (the server hands the key over).
//! 3. **Left in the servers** after all of the above: leases still held (rows
//!    with an owner), advisory locks still held, and the rows that collection
//!    has not removed yet.
//!
//! It prints Markdown tables and the targets with ✓/✗. Targets are printed,
//! never asserted: a contender that fails aborts the run instead.
//! `--quick` (or `DLOCK_BENCH_QUICK=1`) runs every section briefly (well
//! under a minute), to check that it works; its figures are not for reading.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use dlock_runtime::{MemoryBackend, Registry};

mod common;
use common::convoy::{CONVOY_CHILD, convoy_child, convoy_processes};
use common::{CONVOY, median, tick};

#[path = "sql/contenders.rs"]
mod contenders;
#[path = "sql/server.rs"]
mod server;
#[path = "sql/throughput.rs"]
mod throughput;
use contenders::{Contenders, Who};
use server::OwnServer;
use throughput::{C1, Medians, ServerPids, concurrency_1, medians, throughput_rounds};

/// The benchmark's own servers' ports, or the first free of the next few of
/// the same parity (the Redis bench's is 29430, the shared test servers'
/// 45432 and 43306).
const PG_PORT: u16 = 47871;
const MARIADB_PORT: u16 = 47872;
/// The CPU the concurrency-1 section (client and servers) is pinned to.
const PINNED_CPU: &str = "1";
/// The concurrency of the unpinned section.
const HIGH_CONCURRENCY: u64 = 32;
/// Processes a handoff convoy is spread over.
const PROCESSES: usize = 4;

/// The targets (ratios in one run).
const TARGET_LEASE_VS_HAND: f64 = 0.9;
/// What the holder record may cost the lease statements: a few percent.
const TARGET_RECORD: f64 = 0.95;
const TARGET_SESSION_VS_ADVISORY: f64 = 1.0;

/// How much a run measures.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// Recorded rounds of each throughput contender.
    pub(crate) rounds: usize,
    /// Pairs per run at concurrency 1 and [`HIGH_CONCURRENCY`], and per
    /// warm-up run.
    pub(crate) c1_pairs: u64,
    pub(crate) high_pairs: u64,
    pub(crate) warmup_pairs: u64,
    /// Convoys per handoff figure.
    pub(crate) convoys: usize,
}

impl Plan {
    /// Every contender takes every position in the rotated order twice.
    fn full() -> Plan {
        Plan {
            rounds: 2 * Who::ALL.len(),
            c1_pairs: 2_000,
            high_pairs: 5_000,
            warmup_pairs: 200,
            convoys: 5,
        }
    }

    /// Each section briefly: checks that the benchmark works.
    fn quick() -> Plan {
        Plan {
            rounds: Who::ALL.len(),
            c1_pairs: 100,
            high_pairs: 300,
            warmup_pairs: 20,
            convoys: 1,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "dlock on PostgreSQL and MariaDB against the same statements by hand and sqlx's \
             PgAdvisoryLock, as ratios.\n\
             usage: cargo bench -p dlock-tests --features postgres,mysql --bench sql [-- --quick]\n\
             Starts PostgreSQL 15 on 127.0.0.1:{PG_PORT} and MariaDB on 127.0.0.1:{MARIADB_PORT} \
             (fresh, under target/bench-sql/; taskset for the pinned section), runs the \
             throughput sections (c=1 pinned, c={HIGH_CONCURRENCY}) and the handoff convoys, \
             counts what is left in the servers and prints Markdown tables and the targets. \
             --quick (or DLOCK_BENCH_QUICK=1): every section briefly, to check that it works."
        );
        return Ok(());
    }
    if let Some(at) = args.iter().position(|a| a == "--pinned-c1") {
        // All of the client on one thread: the process is pinned to one CPU.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_keep_alive(Duration::from_secs(24 * 3600))
            .build()?;
        return runtime.block_on(throughput::pinned_child(&args[at + 1..]));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        // No thread may exit while the client's CPU time is summed over them.
        .thread_keep_alive(Duration::from_secs(24 * 3600))
        .build()?;
    if let Some(at) = args.iter().position(|a| a == CONVOY_CHILD) {
        return runtime.block_on(convoy_child(&args[at + 1..]));
    }
    let quick = args.iter().any(|a| a == "--quick")
        || std::env::var("DLOCK_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let plan = if quick { Plan::quick() } else { Plan::full() };
    runtime.block_on(bench(plan, quick))
}

/// Where the servers' directories go: `target/bench-sql/`, as an absolute
/// path without `..` (the servers report their data directory so, and the
/// benchmark compares it with its own).
fn servers_root() -> anyhow::Result<PathBuf> {
    let root = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("bench-sql");
    std::fs::create_dir_all(&root)?;
    Ok(root.canonicalize()?)
}

async fn bench(plan: Plan, quick: bool) -> anyhow::Result<()> {
    let load_at_start = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let root = servers_root()?;
    let pg = OwnServer::postgres(PG_PORT, &root).await?;
    let my = OwnServer::mariadb(MARIADB_PORT, &root).await?;
    let (pg_url, my_url) = (pg.url(), my.url());
    let pids = ServerPids {
        postgres: pg.pid()?,
        mariadb: my.pid()?,
    };
    // The global registry is not used; install one so that nothing falls
    // back to it by accident.
    dlock_runtime::init(
        Registry::builder()
            .default_backend(MemoryBackend::new())
            .build(),
    )?;
    let run: u64 = rand::random();
    let mut out = String::new();
    writeln!(
        out,
        "Servers of the benchmark's own: PostgreSQL on 127.0.0.1:{}, MariaDB on 127.0.0.1:{}.\n",
        pg.port(),
        my.port()
    )?;
    if quick {
        writeln!(
            out,
            "**Quick mode**: every section briefly, to check that the benchmark works; \
             these figures are not for reading.\n"
        )?;
    }

    // 1. Throughput: concurrency 1 pinned (in a child, before this process
    // opens any connection), then the high concurrency unpinned (here).
    let c1 = concurrency_1(&pg_url, &my_url, pids, run, &plan)?;
    let c1_label = if c1.pinned {
        format!("c=1, pinned to CPU {PINNED_CPU} (client and servers)")
    } else {
        "c=1 (unpinned, not gated)".to_owned()
    };
    let c = Contenders::connect(&pg_url, &my_url, run, HIGH_CONCURRENCY).await?;
    let high = throughput_rounds(&c, pids, &plan, HIGH_CONCURRENCY, plan.high_pairs).await?;
    let high_label = format!("c={HIGH_CONCURRENCY}, unpinned (both CPUs)");
    let sections = [
        (c1_label.clone(), medians(&c1.samples)),
        (high_label.clone(), medians(&high)),
    ];
    throughput_table(&mut out, &plan, &c1, &sections)?;

    // 2. Handoff.
    writeln!(
        out,
        "\n## Handoff: a {CONVOY}-task convoy over {PROCESSES} processes on one key\n"
    )?;
    writeln!(out, "| mode | ms per handoff |")?;
    writeln!(out, "|---|---:|")?;
    for (name, url) in [
        ("PostgreSQL lease (NOTIFY)", pg_url.clone()),
        ("MariaDB lease (polling, cap 50 ms)", my_url.clone()),
        ("PostgreSQL session", format!("{pg_url}?mode=session")),
        ("MariaDB session", format!("{my_url}?mode=session")),
    ] {
        let mut convoys = Vec::new();
        for k in 0..plan.convoys {
            let key = format!("handoff:{run}:{name}:{k}");
            convoys.push(convoy_processes(&url, &key, PROCESSES)?);
        }
        writeln!(out, "| {name} | {:.3} |", median(convoys))?;
    }
    writeln!(
        out,
        "\nPer handoff: (wall time − the 1 ms holds) / {}; median of {} convoys.",
        CONVOY - 1,
        plan.convoys
    )?;

    // 3. What is left in the servers.
    drop(c);
    let held = left_in_servers(&mut out, &pg_url, &my_url).await?;
    targets(&mut out, &c1, &sections, held)?;
    let load = |line: &str| {
        line.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    };
    writeln!(
        out,
        "\nLoad average (1, 5, 15 min) at start {}, at end {}.",
        load(&load_at_start),
        load(&std::fs::read_to_string("/proc/loadavg").unwrap_or_default())
    )?;
    print!("{out}");
    drop((pg, my));
    Ok(())
}

/// The contender a contender is compared with.
fn baseline(who: Who) -> Who {
    match who {
        Who::PgDlock | Who::PgHandRecord | Who::PgHand => Who::PgHand,
        Who::MyDlock | Who::MyHandRecord | Who::MyHand => Who::MyHand,
        Who::PgSession | Who::PgAdvisory => Who::PgAdvisory,
    }
}

fn throughput_table(
    out: &mut String,
    plan: &Plan,
    c1: &C1,
    sections: &[(String, BTreeMap<Who, Medians>)],
) -> anyhow::Result<()> {
    writeln!(
        out,
        "## Throughput: uncontended acquire+release pairs over distinct keys\n"
    )?;
    writeln!(
        out,
        "| concurrency | contender | pairs/s | × baseline | client CPU µs/pair | server CPU µs/pair | × baseline's server CPU | waiting for a CPU µs/pair, client / server |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|")?;
    for (label, m) in sections {
        for who in [
            Who::PgDlock,
            Who::PgHandRecord,
            Who::PgHand,
            Who::MyDlock,
            Who::MyHandRecord,
            Who::MyHand,
            Who::PgSession,
            Who::PgAdvisory,
        ] {
            let (x, base) = (&m[&who], &m[&baseline(who)]);
            writeln!(
                out,
                "| {label} | {} | {:.0} | {:.2}× | {:.1} | {:.1} | {:.2}× | {:.1} / {:.1} |",
                who.name(),
                x.pairs_per_s,
                x.pairs_per_s / base.pairs_per_s,
                x.client_us,
                x.server_us,
                x.server_us / base.server_us,
                x.client_wait_us,
                x.server_wait_us
            )?;
        }
    }
    writeln!(
        out,
        "\n{} interleaved rounds (order rotated each round) after a warm-up; \
         {} pairs per run at c=1, {} at c={HIGH_CONCURRENCY}; medians. \
         CPU per pair measured around each run only (schedstat). \
         Waiting for a CPU: time runnable but not running, the machine's other load.",
        plan.rounds, plan.c1_pairs, plan.high_pairs
    )?;
    if c1.pinned {
        writeln!(
            out,
            "Pinned section: {} server threads (MariaDB's, PostgreSQL's processes with the \
             backends serving the child) checked on CPU {PINNED_CPU} while the child ran.",
            c1.server_threads
        )?;
    }
    Ok(())
}

/// What is still held in the servers, and the rows collection has not
/// removed yet; answers the count of what is held (leases with an owner,
/// advisory locks).
async fn left_in_servers(out: &mut String, pg_url: &str, my_url: &str) -> anyhow::Result<i64> {
    use sqlx::Connection as _;
    let mut pg = sqlx::PgConnection::connect(pg_url).await?;
    let mut pg_counts = Vec::new();
    for sql in [
        "SELECT count(*) FROM dlock_leases",
        "SELECT count(*) FROM dlock_leases WHERE owner IS NOT NULL",
        "SELECT count(*) FROM dlock_leases_fence",
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
    ] {
        pg_counts.push(sqlx::query_scalar::<_, i64>(sql).fetch_one(&mut pg).await?);
    }
    pg.close().await?;
    let [pg_rows, pg_held, pg_fence, advisory] = pg_counts[..] else {
        unreachable!("four counts");
    };
    let mut my = sqlx::MySqlConnection::connect(my_url).await?;
    let mut my_counts = Vec::new();
    for sql in [
        "SELECT count(*) FROM dlock_leases",
        "SELECT count(*) FROM dlock_leases WHERE owner IS NOT NULL",
    ] {
        my_counts.push(sqlx::query_scalar::<_, i64>(sql).fetch_one(&mut my).await?);
    }
    my.close().await?;
    let [my_rows, my_held] = my_counts[..] else {
        unreachable!("two counts");
    };
    writeln!(out, "\n## Left in the benchmark's servers\n")?;
    writeln!(
        out,
        "PostgreSQL: {pg_held} leases held, {advisory} advisory locks held; rows not collected \
         yet: {pg_rows} in dlock_leases, {pg_fence} session counters in dlock_leases_fence. \
         MariaDB: {my_held} leases held; {my_rows} rows not collected yet in dlock_leases."
    )?;
    Ok(pg_held + advisory + my_held)
}

/// The targets, with ✓/✗.
fn targets(
    out: &mut String,
    c1: &C1,
    sections: &[(String, BTreeMap<Who, Medians>)],
    held: i64,
) -> anyhow::Result<()> {
    let ratio = |m: &BTreeMap<Who, Medians>, a: Who, b: Who| m[&a].pairs_per_s / m[&b].pairs_per_s;
    writeln!(out, "\n## Targets (ratios in this run)\n")?;
    writeln!(out, "| target | measured | met |")?;
    writeln!(out, "|---|---:|:---:|")?;
    for (i, (label, m)) in sections.iter().enumerate() {
        let gated = i > 0 || c1.pinned;
        for (db, ours, hand, bare) in [
            ("PostgreSQL", Who::PgDlock, Who::PgHandRecord, Who::PgHand),
            ("MariaDB", Who::MyDlock, Who::MyHandRecord, Who::MyHand),
        ] {
            let r = ratio(m, ours, hand);
            let gate = |met: bool| if gated { tick(met) } else { "not gated" };
            writeln!(
                out,
                "| {label}: {db} lease mode ≥ {TARGET_LEASE_VS_HAND}× the same statements by hand | {r:.2}× | {} |",
                gate(r >= TARGET_LEASE_VS_HAND)
            )?;
            let r = ratio(m, hand, bare);
            let (with, without) = (&m[&hand], &m[&bare]);
            writeln!(
                out,
                "| {label}: {db} statements with the holder record ≥ {TARGET_RECORD}× without it | {r:.2}× (server CPU {:.1} vs {:.1} µs/pair, {:+.1} µs; client CPU {:.1} vs {:.1} µs/pair) | {} |",
                with.server_us,
                without.server_us,
                with.server_us - without.server_us,
                with.client_us,
                without.client_us,
                gate(r >= TARGET_RECORD)
            )?;
        }
    }
    let (label, m) = &sections[1];
    let r = ratio(m, Who::PgSession, Who::PgAdvisory);
    let (ours, theirs) = (&m[&Who::PgSession], &m[&Who::PgAdvisory]);
    writeln!(
        out,
        "| {label}: PostgreSQL session mode ≥ {TARGET_SESSION_VS_ADVISORY:.1}× sqlx `PgAdvisoryLock` | {r:.2}× ({:.0} vs {:.0} pairs/s; server CPU {:.1} vs {:.1} µs/pair, {:+.1} µs; client CPU {:.1} vs {:.1} µs/pair) | {} |",
        ours.pairs_per_s,
        theirs.pairs_per_s,
        ours.server_us,
        theirs.server_us,
        ours.server_us - theirs.server_us,
        ours.client_us,
        theirs.client_us,
        tick(r >= TARGET_SESSION_VS_ADVISORY)
    )?;
    writeln!(
        out,
        "| nothing held in the servers at the end | {held} | {} |",
        tick(held == 0)
    )?;
    Ok(())
}
