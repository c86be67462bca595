//! dlock on Redis against what people write by hand and against `rslock`,
//! in one run, as ratios.
//!
//! ```sh
//! cargo bench -p dlock-tests --features redis --bench redis
//! ```
//!
//! Needs `redis-server` on `PATH` (`scripts/servers.sh up` installs it) and,
//! for the pinned section, `taskset` (util-linux). Nothing else: the
//! benchmark starts **a Redis server of its own** on `127.0.0.1:29430`
//! (no persistence: `--save '' --appendonly no`), runs every section against
//! it and kills it at the end, also when a contender fails. So the server
//! serves nobody else: its CPU time and command counters are the
//! contenders', and the keys left on it at the end are counted.
//!
//! 1. **Throughput**, uncontended acquire+release pairs over distinct keys:
//!    dlock's guard (fence counter, watchdog registration, tracing span
//!    included), fenced and unfenced (`fencing(false)`: a pipeline of
//!    `SET NX PX GET` and `PTTL` instead of the acquire script), against
//!    (a) the floor, the same job hand-written with the redis crate on one
//!    multiplexed connection (`SET NX PX`, then the compare-and-delete
//!    script), (b) `rslock` with one instance, and (c)
//!    dlock's own two scripts (with the fence counter and the release
//!    message) hand-written on that connection: the gap between (a) and (c)
//!    is what the protocol costs the server, the gap between (c) and dlock is
//!    what the library costs the client.
//!    - **Concurrency 1 runs pinned**: the benchmark runs that section in a
//!      child process of itself under `taskset -c 1`, with the server's
//!      threads pinned to the same CPU (`taskset -a -p`) for the duration, and
//!      a current-thread runtime. Unpinned on a 2-vCPU machine, concurrency 1
//!      mostly measures whether the client and the server happen to share a
//!      vCPU (every contender lands near the same figure and the ordering
//!      flips between runs). Without `taskset` the section runs unpinned, is
//!      marked so, and no target is judged on it.
//!    - **Concurrency 64 runs unpinned** (client and server on both CPUs).
//!    - **Interleaved rounds**: every round runs each contender once, in an
//!      order rotated each round, so no contender always runs first (or right
//!      after the same neighbour); one unrecorded warm-up run of each first.
//!      Medians over the rounds.
//!    - **CPU per lock** next to pairs/s, measured around each contender's
//!      run only and divided by its pairs: the client's from the sum over
//!      this process's threads of `/proc/self/task/*/schedstat` (ns on CPU;
//!      cross-checked against `/proc/self/stat` over the whole section), the
//!      server's from `INFO cpu` (`used_cpu_sys + used_cpu_user`). After a
//!      `CONFIG RESETSTAT` before each run, `INFO commandstats` tells where
//!      the server's command time goes (commands run by a script are counted
//!      on their own rows too, and inside the script's).
//!    - **Each half apart** at concurrency 64: all acquisitions, then all
//!      releases, for the floor and dlock's scripts, to show which half the
//!      server's extra CPU goes to.
//! 2. **Handoff** on one hot key: a convoy of 16 tasks that start together,
//!    each acquires once, holds 1 ms and releases. Per handoff =
//!    (wall time − the holds) / 15, the holds as measured (tokio's timer makes
//!    a 1 ms sleep last a little longer); median of several convoys. dlock in
//!    one process and spread over 4 processes (children of this program, given
//!    the server's URL), against `rslock` and a 100 ms polling loop (what the
//!    common recipes do).
//! 3. **Watchdog** with 10,000 held leases: renewal commands per second seen
//!    by the server (`INFO commandstats`, exact: nothing else talks to it),
//!    renewal pipelines per second, this process's CPU time and the server's.
//! 4. **Macro overhead**: the attribute against the hand-written guard on the
//!    memory backend.
//! 5. **Keys left** on the server after all of the above (`DBSIZE`, nothing
//!    flushed), beyond the bounded fence counter `dlock-fence`.
//!
//! It prints Markdown tables, the targets with ✓/✗, and writes
//! `docs/bench/redis.svg`. Targets are printed, never asserted: a contender
//! that fails aborts the run instead.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{MemoryBackend, RedisBackend, Registry};
use dlock_tests::redis_support::OwnRedis;
use redis::Script;
use redis::aio::MultiplexedConnection;

mod common;
use common::{
    CONVOY, CONVOYS, ROUNDS, convoy, handoffs, hold, join, macro_overhead, median, spread, tick,
};

#[path = "redis/chart.rs"]
mod chart;
#[path = "redis/contenders.rs"]
mod contenders;
#[path = "redis/handoff.rs"]
mod handoff;
#[path = "redis/report.rs"]
mod report;
#[path = "redis/server.rs"]
mod server;
#[path = "redis/throughput.rs"]
mod throughput;
#[path = "redis/watchdog.rs"]
mod watchdog;
use chart::*;
use contenders::*;
use handoff::*;
use report::*;
use server::*;
use throughput::*;
use watchdog::*;

/// The benchmark's own server (the tests' reserved ports are 29401–29408, the
/// shared servers 46379 and up).
const BENCH_PORT: u16 = 29430;
/// The CPU the concurrency-1 section (client and server) is pinned to.
const PINNED_CPU: &str = "1";
/// Recorded rounds of each throughput contender: every contender takes every
/// position in the rotated order twice.
const THROUGHPUT_ROUNDS: usize = 10;
/// Pairs per run at concurrency 1 and 64, and per warm-up run.
const C1_PAIRS: u64 = 10_000;
const C64_PAIRS: u64 = 20_000;
const WARMUP_PAIRS: u64 = 500;
/// Rounds of the split of a pair into its halves.
const SPLIT_ROUNDS: usize = 3;
/// The server's fence counter key on a single server (never one per name).
const FENCE_KEY: &str = "dlock-fence";

const PROCESSES: usize = 4;
const POLL: Duration = Duration::from_millis(100);
const WATCHDOG_LEASES: usize = 10_000;
const WATCHDOG_LEASE: Duration = Duration::from_secs(3);
const WATCHDOG_WINDOW: Duration = Duration::from_secs(6);

/// The targets (ratios in one run).
const TARGET_C64_FLOOR: f64 = 0.75;
const TARGET_C64_RSLOCK: f64 = 1.0;
const TARGET_C1_FLOOR: f64 = 0.85;
/// dlock without a fencing token (`fencing(false)`: a plain `SET NX PX`).
const TARGET_UNFENCED_C64_FLOOR: f64 = 0.9;
const TARGET_SERVER_CPU: f64 = 1.6;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "dlock on Redis against the floor, its own scripts by hand and rslock, as ratios.\n\
             usage: cargo bench -p dlock-tests --features redis --bench redis\n\
             Starts redis-server on 127.0.0.1:{BENCH_PORT} (needs it on PATH; taskset for the \
             pinned section), runs the throughput ({THROUGHPUT_ROUNDS} rounds), handoff \
             ({CONVOYS} convoys of {CONVOY}), watchdog ({WATCHDOG_LEASES} leases) and \
             macro-overhead sections, counts the keys left, prints Markdown tables and the \
             targets, and writes docs/bench/redis.svg."
        );
        return Ok(());
    }
    if let Some(at) = args.iter().position(|a| a == "--pinned-c1") {
        // All of the client on one thread: the process is pinned to one CPU.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_keep_alive(Duration::from_secs(24 * 3600))
            .build()?;
        return runtime.block_on(pinned_child(&args[at + 1..]));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        // No thread may exit while the client's CPU time is summed over them.
        .thread_keep_alive(Duration::from_secs(24 * 3600))
        .build()?;
    if let Some(at) = args.iter().position(|a| a == "--convoy-child") {
        return runtime.block_on(convoy_child(&args[at + 1..]));
    }
    runtime.block_on(bench())
}

async fn bench() -> anyhow::Result<()> {
    let server = own_server().await?;
    let url = server.url();
    let server_pid = server
        .pid()
        .ok_or_else(|| anyhow::anyhow!("the server is not running"))?;
    // The global registry is memory, for the macro-overhead pair; Redis is a
    // registry of its own (the same code path as the global one).
    dlock_runtime::init(
        Registry::builder()
            .default_backend(MemoryBackend::new())
            .build(),
    )?;
    let run: u64 = rand::random();
    let c = Contenders::connect(&url, run, server_pid).await?;
    let mut admin = c.admin.clone();

    let mut out = String::new();
    let mut chart = Chart::default();
    let load_at_start = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

    // 1. Throughput: concurrency 1 pinned (in a child), 64 unpinned (here).
    let throughput = throughput_section(&c, &url, server_pid, run, &mut out, &mut chart).await?;
    halves_section(&c, &mut out).await?;
    // The comparison table, with the handoff, watchdog and macro rows.
    let mut table = comparison_rows(&throughput)?;
    // 2. Handoff.
    let handoff = handoff_section(&c, &url, run, &mut table, &mut chart).await?;
    // 3. Watchdog.
    watchdog_rows(&c, &mut table).await?;
    // 4. Macro overhead.
    let (ours, base) = macro_overhead(20_000).await;
    writeln!(
        table,
        "| attribute vs hand-written guard (memory), calls/s | {ours:.0} | {base:.0} | {:.2}× |",
        ours / base
    )?;
    out.push_str(&table);
    writeln!(
        out,
        "\n{CONVOYS} convoys per handoff contender, {ROUNDS} rounds of the macro pair, medians."
    )?;

    // 5. Keys left.
    let left = keys_left(&mut admin, &mut out).await?;
    targets(&mut out, &throughput, &left, &handoff, &load_at_start)?;
    print!("{out}");
    let svg = chart.svg();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/bench/redis.svg");
    std::fs::create_dir_all(path.parent().expect("folder"))?;
    std::fs::write(&path, svg)?;
    println!("chart: {}", path.display());
    drop(server);
    Ok(())
}
