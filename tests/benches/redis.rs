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
//!    included) against (a) the floor, the same job hand-written with the
//!    redis crate on one multiplexed connection (`SET NX PX`, then the
//!    compare-and-delete script), (b) `rslock` with one instance, and (c)
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
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock_runtime::{MemoryBackend, RedisBackend, Registry};
use dlock_tests::redis_support::OwnRedis;
use redis::Script;
use redis::aio::MultiplexedConnection;
use tokio::sync::Barrier;

mod common;
use common::{ROUNDS, macro_overhead, median};

/// The benchmark's own server (the tests' reserved ports are 29401–29408, the
/// shared servers 46379 and up).
const BENCH_PORT: u16 = 29430;
/// The CPU the concurrency-1 section (client and server) is pinned to.
const PINNED_CPU: &str = "1";
/// Recorded rounds of each throughput contender: every contender takes every
/// position in the rotated order twice.
const THROUGHPUT_ROUNDS: usize = 8;
/// Pairs per run at concurrency 1 and 64, and per warm-up run.
const C1_PAIRS: u64 = 10_000;
const C64_PAIRS: u64 = 20_000;
const WARMUP_PAIRS: u64 = 500;
/// Rounds of the split of a pair into its halves.
const SPLIT_ROUNDS: usize = 3;
/// The server's fence counter key on a single server (never one per name).
const FENCE_KEY: &str = "dlock-fence";

const CONVOY: usize = 16;
const CONVOYS: usize = 5;
const PROCESSES: usize = 4;
const HOLD: Duration = Duration::from_millis(1);
const POLL: Duration = Duration::from_millis(100);
const WATCHDOG_LEASES: usize = 10_000;
const WATCHDOG_LEASE: Duration = Duration::from_secs(3);
const WATCHDOG_WINDOW: Duration = Duration::from_secs(6);

/// The targets (ratios in one run).
const TARGET_C64_FLOOR: f64 = 0.75;
const TARGET_C64_RSLOCK: f64 = 1.0;
const TARGET_C1_FLOOR: f64 = 0.85;
const TARGET_SERVER_CPU: f64 = 1.6;

/// The compare-and-delete every careful hand-written Redis lock uses.
fn unlock_script() -> Script {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    )
}

/// The hand-written acquire: `SET key owner NX PX 30000`; whether it took the key.
async fn floor_try(conn: &mut MultiplexedConnection, key: &str, owner: &str) -> bool {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(owner)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("hand-written floor: SET NX PX failed: {e}"));
    set.is_some()
}

/// The hand-written release: the compare-and-delete script; whether it deleted.
async fn floor_unlock(
    c: &Contenders,
    conn: &mut MultiplexedConnection,
    key: &str,
    owner: &str,
) -> bool {
    let deleted: i64 = c
        .unlock
        .key(key)
        .arg(owner)
        .invoke_async(conn)
        .await
        .unwrap_or_else(|e| panic!("hand-written floor: the unlock script failed: {e}"));
    deleted == 1
}

fn owner() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
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

/// dlock's own Redis scripts, for the "same protocol by hand" baseline.
const ACQUIRE_LUA: &str = include_str!("../../dlock-runtime/src/backend/redis/acquire.lua");
const RELEASE_LUA: &str = include_str!("../../dlock-runtime/src/backend/redis/release.lua");

/// The contenders of one benchmark process, all on one server.
struct Contenders {
    dlock: Registry,
    floor: MultiplexedConnection,
    /// For `INFO` and `CONFIG RESETSTAT`, apart from the contenders.
    admin: MultiplexedConnection,
    unlock: Script,
    acquire_lua: Script,
    release_lua: Script,
    rslock: rslock::LockManager,
    run: u64,
    /// The server's process id (for its threads' run-queue waits).
    server_pid: u32,
}

impl Contenders {
    async fn connect(url: &str, run: u64, server_pid: u32) -> anyhow::Result<Arc<Contenders>> {
        let client = redis::Client::open(url)?;
        Ok(Arc::new(Contenders {
            dlock: Registry::builder()
                .default_backend(
                    RedisBackend::connect(url)
                        .await
                        .map_err(|e| anyhow::anyhow!("dlock cannot connect to {url}: {e}"))?,
                )
                .build(),
            floor: client.get_multiplexed_async_connection().await?,
            admin: client.get_multiplexed_async_connection().await?,
            unlock: unlock_script(),
            acquire_lua: Script::new(ACQUIRE_LUA),
            release_lua: Script::new(RELEASE_LUA),
            rslock: rslock::LockManager::new(vec![url.to_owned()]),
            run,
            server_pid,
        }))
    }
}

/// The throughput contenders.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Who {
    Floor,
    Same,
    Rslock,
    Dlock,
}

impl Who {
    const ALL: [Who; 4] = [Who::Floor, Who::Same, Who::Rslock, Who::Dlock];

    fn name(self) -> &'static str {
        match self {
            Who::Floor => "hand-written floor",
            Who::Same => "dlock's scripts by hand",
            Who::Rslock => "rslock",
            Who::Dlock => "dlock",
        }
    }

    /// The name on the pinned child's output lines.
    fn id(self) -> &'static str {
        match self {
            Who::Floor => "floor",
            Who::Same => "same",
            Who::Rslock => "rslock",
            Who::Dlock => "dlock",
        }
    }

    fn from_id(id: &str) -> anyhow::Result<Who> {
        Who::ALL
            .into_iter()
            .find(|w| w.id() == id)
            .ok_or_else(|| anyhow::anyhow!("unknown contender {id:?}"))
    }

    /// The commands it sends itself besides scripts (a script's own commands
    /// are counted in `INFO commandstats` too, inside the script's time).
    fn direct(self) -> &'static [&'static str] {
        match self {
            Who::Floor | Who::Rslock => &["set"],
            Who::Same | Who::Dlock => &[],
        }
    }
}

/// One acquire+release of `who` on a key of its own (`tag`, `i`). Panics, with
/// the contender's name, if anything fails: the run aborts.
async fn pair(c: &Contenders, who: Who, tag: &str, i: u64) {
    match who {
        Who::Floor => {
            let key = format!("bench:floor:{}:{tag}:{i}", c.run);
            let mut conn = c.floor.clone();
            let owner = owner();
            assert!(
                floor_try(&mut conn, &key, &owner).await,
                "hand-written floor: SET NX found {key} taken"
            );
            assert!(
                floor_unlock(c, &mut conn, &key, &owner).await,
                "hand-written floor: the unlock script did not delete {key}"
            );
        }
        Who::Same => {
            let key = format!("{{bench:same:{}:{tag}:{i}}}", c.run);
            let mut conn = c.floor.clone();
            let owner = owner();
            let (taken, _token): (i64, i64) = c
                .acquire_lua
                .key(&key)
                .key(FENCE_KEY)
                .arg(&owner)
                .arg(30_000)
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("dlock's scripts by hand: acquire failed: {e}"));
            assert_eq!(taken, 1, "dlock's scripts by hand: {key} was taken");
            let released: i64 = c
                .release_lua
                .key(&key)
                .arg(&owner)
                .arg(format!("{key}:released"))
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("dlock's scripts by hand: release failed: {e}"));
            assert_eq!(released, 1, "dlock's scripts by hand: {key} not deleted");
        }
        Who::Rslock => {
            let key = format!("bench:rslock:{}:{tag}:{i}", c.run);
            let lock = c
                .rslock
                .lock(key.as_bytes(), Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("rslock: lock failed: {e}"));
            c.rslock.unlock(&lock).await;
        }
        Who::Dlock => {
            let key = format!("throughput:{}:{tag}:{i}", c.run);
            let guard = c
                .dlock
                .lock(key)
                .lease(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("dlock: acquire failed: {e}"));
            guard
                .release()
                .await
                .unwrap_or_else(|e| panic!("dlock: release failed: {e}"));
        }
    }
}

/// The halves of a pair, measured apart (all acquisitions, then all
/// releases) to split the server's cost between them.
#[derive(Clone, Copy, Debug)]
enum Step {
    FloorSet,
    FloorUnlock,
    SameAcquire,
    SameRelease,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::FloorSet => "hand-written floor: SET NX PX",
            Step::FloorUnlock => "hand-written floor: compare-and-delete script",
            Step::SameAcquire => "dlock's acquire.lua (by hand)",
            Step::SameRelease => "dlock's release.lua (by hand)",
        }
    }
}

/// One half of a pair on key `i` of `tag` (the owner is derived from `i`).
async fn step(c: &Contenders, s: Step, tag: &str, i: u64) {
    let mut conn = c.floor.clone();
    let owner = format!("{:032x}", u128::from(i) ^ u128::from(c.run));
    match s {
        Step::FloorSet | Step::FloorUnlock => {
            let key = format!("bench:split-floor:{}:{tag}:{i}", c.run);
            if matches!(s, Step::FloorSet) {
                assert!(
                    floor_try(&mut conn, &key, &owner).await,
                    "split: SET NX found {key} taken"
                );
            } else {
                assert!(
                    floor_unlock(c, &mut conn, &key, &owner).await,
                    "split: the unlock script did not delete {key}"
                );
            }
        }
        Step::SameAcquire => {
            let key = format!("{{bench:split-same:{}:{tag}:{i}}}", c.run);
            let (taken, _token): (i64, i64) = c
                .acquire_lua
                .key(&key)
                .key(FENCE_KEY)
                .arg(&owner)
                .arg(30_000)
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("split: acquire.lua failed: {e}"));
            assert_eq!(taken, 1, "split: {key} was taken");
        }
        Step::SameRelease => {
            let key = format!("{{bench:split-same:{}:{tag}:{i}}}", c.run);
            let released: i64 = c
                .release_lua
                .key(&key)
                .arg(&owner)
                .arg(format!("{key}:released"))
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("split: release.lua failed: {e}"));
            assert_eq!(released, 1, "split: {key} not deleted");
        }
    }
}

/// `n` steps over distinct keys by `concurrency` tasks; answers the server's
/// CPU µs per step and the commands per step (calls, usec).
async fn measure_steps(
    c: &Arc<Contenders>,
    s: Step,
    concurrency: u64,
    n: u64,
    tag: &str,
) -> anyhow::Result<(f64, Commands)> {
    let mut admin = c.admin.clone();
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await?;
    let before = server_cpu_seconds(&mut admin).await?;
    let tag: Arc<str> = tag.into();
    spread(concurrency, n, {
        let c = c.clone();
        move |i| {
            let (c, tag) = (c.clone(), tag.clone());
            async move { step(&c, s, &tag, i).await }
        }
    })
    .await;
    let after = server_cpu_seconds(&mut admin).await?;
    let commands = commandstats(&mut admin)
        .await?
        .into_iter()
        .filter(|(name, _)| !matches!(name.as_str(), "info" | "config|resetstat"))
        .map(|(name, (calls, usec))| (name, (calls as f64 / n as f64, usec as f64 / n as f64)))
        .collect();
    Ok(((after - before) * 1e6 / n as f64, commands))
}

/// Awaits a task; a panic in it goes on in the caller (the run aborts).
async fn join<T>(task: tokio::task::JoinHandle<T>) -> T {
    match task.await {
        Ok(value) => value,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => panic!("a benchmark task failed: {e}"),
    }
}

/// `n` pairs of `who` over distinct keys, by `concurrency` tasks at once.
async fn run_pairs(c: &Arc<Contenders>, who: Who, concurrency: u64, n: u64, tag: &str) {
    let tag: Arc<str> = tag.into();
    spread(concurrency, n, {
        let c = c.clone();
        move |i| {
            let (c, tag) = (c.clone(), tag.clone());
            async move { pair(&c, who, &tag, i).await }
        }
    })
    .await;
}

/// `op(i)` for every `i` below `n`, by `concurrency` tasks at once (task `t`
/// takes `t`, `t + concurrency`, …); a panic in one goes on in the caller.
async fn spread<F, Fut>(concurrency: u64, n: u64, op: F)
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

/// `INFO commandstats` per operation: command → (calls, usec).
type Commands = BTreeMap<String, (f64, f64)>;

/// One run of one contender, per pair.
#[derive(Clone, Debug, Default)]
struct Sample {
    pairs_per_s: f64,
    /// This process's CPU time, µs.
    client_us: f64,
    /// The server's CPU time (`INFO cpu`), µs.
    server_us: f64,
    /// Time this process's threads and the server's spent runnable but
    /// waiting for a CPU (schedstat), µs: the machine's other load.
    client_wait_us: f64,
    server_wait_us: f64,
    /// `INFO commandstats`: command → (calls, usec) per pair.
    commands: BTreeMap<String, (f64, f64)>,
}

impl Sample {
    /// The server's command time per pair for what `who` sends itself:
    /// scripts (their inner commands included) and its direct commands.
    fn command_us(&self, who: Who) -> f64 {
        self.commands
            .iter()
            .filter(|(name, _)| {
                matches!(
                    name.as_str(),
                    "eval" | "evalsha" | "eval_ro" | "evalsha_ro" | "fcall"
                ) || who.direct().contains(&name.as_str())
            })
            .map(|(_, (_, usec))| usec)
            .sum()
    }

    /// One line of the pinned child's output (tab-separated).
    fn encode(&self) -> String {
        let commands: Vec<String> = self
            .commands
            .iter()
            .map(|(name, (calls, usec))| format!("{name}={calls}/{usec}"))
            .collect();
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}",
            self.pairs_per_s,
            self.client_us,
            self.server_us,
            self.client_wait_us,
            self.server_wait_us,
            commands.join(",")
        )
    }

    fn decode(fields: &[&str]) -> anyhow::Result<Sample> {
        let [
            pairs_per_s,
            client_us,
            server_us,
            client_wait_us,
            server_wait_us,
            commands,
        ] = fields
        else {
            anyhow::bail!("bad sample {fields:?}");
        };
        let mut sample = Sample {
            pairs_per_s: pairs_per_s.parse()?,
            client_us: client_us.parse()?,
            server_us: server_us.parse()?,
            client_wait_us: client_wait_us.parse()?,
            server_wait_us: server_wait_us.parse()?,
            commands: BTreeMap::new(),
        };
        for entry in commands.split(',').filter(|e| !e.is_empty()) {
            let (name, values) = entry
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("bad command entry {entry:?}"))?;
            let (calls, usec) = values
                .split_once('/')
                .ok_or_else(|| anyhow::anyhow!("bad command entry {entry:?}"))?;
            sample
                .commands
                .insert(name.to_owned(), (calls.parse()?, usec.parse()?));
        }
        Ok(sample)
    }
}

/// Runs `n` pairs of `who` and measures them: wall time, this process's CPU
/// time and the server's, around that run only; the server's command
/// counters are reset just before.
async fn measure(
    c: &Arc<Contenders>,
    who: Who,
    concurrency: u64,
    n: u64,
    tag: &str,
) -> anyhow::Result<Sample> {
    let mut admin = c.admin.clone();
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await?;
    let server_pid = c.server_pid.to_string();
    let server_before = server_cpu_seconds(&mut admin).await?;
    let server_sched_before = schedstat(&server_pid)?;
    let client_before = schedstat("self")?;
    let started = Instant::now();
    run_pairs(c, who, concurrency, n, tag).await;
    let elapsed = started.elapsed();
    let client_after = schedstat("self")?;
    let server_sched_after = schedstat(&server_pid)?;
    let server_after = server_cpu_seconds(&mut admin).await?;
    let per_pair =
        |before: u64, after: u64| after.saturating_sub(before) as f64 / 1000.0 / n as f64;
    let commands = commandstats(&mut admin)
        .await?
        .into_iter()
        // The measurement's own commands.
        .filter(|(name, _)| !matches!(name.as_str(), "info" | "config|resetstat"))
        .map(|(name, (calls, usec))| (name, (calls as f64 / n as f64, usec as f64 / n as f64)))
        .collect();
    Ok(Sample {
        pairs_per_s: n as f64 / elapsed.as_secs_f64(),
        client_us: per_pair(client_before.0, client_after.0),
        server_us: (server_after - server_before) * 1e6 / n as f64,
        client_wait_us: per_pair(client_before.1, client_after.1),
        server_wait_us: per_pair(server_sched_before.1, server_sched_after.1),
        commands,
    })
}

/// The throughput section at one concurrency: a warm-up run of each
/// contender, then [`THROUGHPUT_ROUNDS`] rounds, each running every contender
/// once in an order rotated by one each round. Answers (round, contender,
/// sample) in the order run.
async fn throughput_rounds(
    c: &Arc<Contenders>,
    concurrency: u64,
    n: u64,
) -> anyhow::Result<Vec<(usize, Who, Sample)>> {
    for who in Who::ALL {
        run_pairs(
            c,
            who,
            concurrency,
            WARMUP_PAIRS,
            &format!("warm:{concurrency}"),
        )
        .await;
    }
    let mut samples = Vec::new();
    for round in 0..THROUGHPUT_ROUNDS {
        let mut order = Who::ALL;
        order.rotate_left(round % Who::ALL.len());
        for who in order {
            let tag = format!("{round}:{concurrency}");
            samples.push((round, who, measure(c, who, concurrency, n, &tag).await?));
        }
    }
    Ok(samples)
}

/// A contender's medians over the rounds.
#[derive(Clone, Debug, Default)]
struct Medians {
    pairs_per_s: f64,
    client_us: f64,
    server_us: f64,
    client_wait_us: f64,
    server_wait_us: f64,
    command_us: f64,
    /// Command → (calls, usec) per pair, medians.
    commands: BTreeMap<String, (f64, f64)>,
}

fn medians(samples: &[(usize, Who, Sample)]) -> BTreeMap<Who, Medians> {
    let mut out = BTreeMap::new();
    for who in Who::ALL {
        let mine: Vec<&Sample> = samples
            .iter()
            .filter(|(_, w, _)| *w == who)
            .map(|(_, _, s)| s)
            .collect();
        let of = |f: &dyn Fn(&Sample) -> f64| median(mine.iter().map(|s| f(s)).collect());
        let names: std::collections::BTreeSet<&String> =
            mine.iter().flat_map(|s| s.commands.keys()).collect();
        let commands = names
            .into_iter()
            .map(|name| {
                let get = |s: &Sample| s.commands.get(name).copied().unwrap_or((0.0, 0.0));
                (name.clone(), (of(&|s| get(s).0), of(&|s| get(s).1)))
            })
            .collect();
        out.insert(
            who,
            Medians {
                pairs_per_s: of(&|s| s.pairs_per_s),
                client_us: of(&|s| s.client_us),
                server_us: of(&|s| s.server_us),
                client_wait_us: of(&|s| s.client_wait_us),
                server_wait_us: of(&|s| s.server_wait_us),
                command_us: of(&|s| s.command_us(who)),
                commands,
            },
        );
    }
    out
}

/// Client CPU over a section, two ways: the per-thread ns counters summed
/// (what the per-run figures use) and the process's tick counters.
struct CpuCheck {
    threads_ns: u64,
    ticks_s: f64,
}

impl CpuCheck {
    fn start() -> anyhow::Result<CpuCheck> {
        Ok(CpuCheck {
            threads_ns: client_cpu_ns()?,
            ticks_s: cpu_seconds()?,
        })
    }

    /// (threads' sum, process ticks) since `start`, seconds.
    fn since(&self) -> anyhow::Result<(f64, f64)> {
        Ok((
            (client_cpu_ns()? - self.threads_ns) as f64 / 1e9,
            cpu_seconds()? - self.ticks_s,
        ))
    }
}

/// The pinned concurrency-1 section's child: `URL RUN SERVER_PID`. Prints its affinity,
/// one `sample` line per run and a CPU cross-check line.
async fn pinned_child(args: &[String]) -> anyhow::Result<()> {
    let [url, run, server_pid] = args else {
        anyhow::bail!("usage: --pinned-c1 URL RUN SERVER_PID");
    };
    let c = Contenders::connect(url, run.parse()?, server_pid.parse()?).await?;
    println!("affinity\t{}", cpus_allowed("self")?);
    let check = CpuCheck::start()?;
    let samples = throughput_rounds(&c, 1, C1_PAIRS).await?;
    let (threads, ticks) = check.since()?;
    for (round, who, sample) in samples {
        println!("sample\t{round}\t{}\t{}", who.id(), sample.encode());
    }
    println!("check\t{threads}\t{ticks}");
    Ok(())
}

/// What the parent gets back from the concurrency-1 section.
struct C1 {
    samples: Vec<(usize, Who, Sample)>,
    pinned: bool,
    check: (f64, f64),
}

/// Runs the concurrency-1 section in a child of this program, pinned with the
/// server to [`PINNED_CPU`] when `taskset` is there.
fn concurrency_1(url: &str, server_pid: u32, run: u64) -> anyhow::Result<C1> {
    let exe = std::env::current_exe()?;
    let (run, pid) = (run.to_string(), server_pid.to_string());
    let child_args = ["--pinned-c1", url, &run, &pid];
    let pinned = has_taskset();
    let (output, _pin) = if pinned {
        let pin = PinnedServer::pin(server_pid, PINNED_CPU)?;
        let output = std::process::Command::new("taskset")
            .args(["-c", PINNED_CPU])
            .arg(&exe)
            .args(child_args)
            .stderr(std::process::Stdio::inherit())
            .output()?;
        (output, Some(pin))
    } else {
        println!("taskset not found (util-linux): concurrency 1 runs unpinned, and is not gated");
        let output = std::process::Command::new(&exe)
            .args(child_args)
            .stderr(std::process::Stdio::inherit())
            .output()?;
        (output, None)
    };
    anyhow::ensure!(
        output.status.success(),
        "the concurrency-1 child failed ({}); its messages are above",
        output.status
    );
    let mut c1 = C1 {
        samples: Vec::new(),
        pinned,
        check: (0.0, 0.0),
    };
    for line in String::from_utf8(output.stdout)?.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields.as_slice() {
            ["affinity", cpus] => {
                if pinned {
                    anyhow::ensure!(
                        *cpus == PINNED_CPU,
                        "the pinned child runs on CPUs {cpus}, not {PINNED_CPU}"
                    );
                }
            }
            ["sample", round, who, rest @ ..] => {
                c1.samples
                    .push((round.parse()?, Who::from_id(who)?, Sample::decode(rest)?));
            }
            ["check", threads, ticks] => c1.check = (threads.parse()?, ticks.parse()?),
            _ => anyhow::bail!("unexpected line from the concurrency-1 child: {line:?}"),
        }
    }
    anyhow::ensure!(
        c1.samples.len() == THROUGHPUT_ROUNDS * Who::ALL.len(),
        "the concurrency-1 child reported {} runs",
        c1.samples.len()
    );
    Ok(c1)
}

fn has_taskset() -> bool {
    std::process::Command::new("taskset")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn taskset(args: &[&str]) -> anyhow::Result<()> {
    let status = std::process::Command::new("taskset")
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "taskset {args:?} failed");
    Ok(())
}

/// `Cpus_allowed_list` of a process (`self` or a pid) or of `pid/task/tid`.
fn cpus_allowed(which: &str) -> anyhow::Result<String> {
    let status = std::fs::read_to_string(format!("/proc/{which}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_owned())
        .ok_or_else(|| anyhow::anyhow!("no Cpus_allowed_list in /proc/{which}/status"))
}

/// The server's threads pinned to one CPU; their former affinity is restored
/// when dropped.
struct PinnedServer {
    pid: String,
    former: String,
}

impl PinnedServer {
    fn pin(pid: u32, cpu: &str) -> anyhow::Result<PinnedServer> {
        let pid = pid.to_string();
        let pinned = PinnedServer {
            former: cpus_allowed(&pid)?,
            pid,
        };
        taskset(&["-a", "-p", "-c", cpu, &pinned.pid])?;
        for task in std::fs::read_dir(format!("/proc/{}/task", pinned.pid))? {
            let tid = task?.file_name().to_string_lossy().into_owned();
            let cpus = cpus_allowed(&format!("{}/task/{tid}", pinned.pid))?;
            anyhow::ensure!(cpus == cpu, "server thread {tid} still on CPUs {cpus}");
        }
        Ok(pinned)
    }
}

impl Drop for PinnedServer {
    fn drop(&mut self) {
        if let Err(e) = taskset(&["-a", "-p", "-c", &self.former, &self.pid]) {
            eprintln!("could not restore the server's CPU affinity: {e}");
        }
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Starts the benchmark's own server and checks that what answers is it.
async fn own_server() -> anyhow::Result<OwnRedis> {
    anyhow::ensure!(
        on_path("redis-server"),
        "redis-server is not on PATH: scripts/servers.sh up installs it"
    );
    // A server left on the port would answer in place of ours.
    std::net::TcpListener::bind(("127.0.0.1", BENCH_PORT)).map_err(|e| {
        anyhow::anyhow!("port {BENCH_PORT} is taken ({e}): is another benchmark running?")
    })?;
    let server = OwnRedis::start(BENCH_PORT, &[]).await;
    let mut admin = server.admin().await;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut admin)
        .await?;
    let answering = info_field(&info, "process_id");
    anyhow::ensure!(
        answering.is_some() && answering == server.pid().map(f64::from),
        "the server on port {BENCH_PORT} is not the one this benchmark started"
    );
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut admin).await?;
    anyhow::ensure!(keys == 0, "the benchmark's new server holds {keys} keys");
    Ok(server)
}

fn tick(ok: bool) -> &'static str {
    if ok { "✓" } else { "✗" }
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
    let c1 = concurrency_1(&url, server_pid, run)?;
    let c1_label = if c1.pinned {
        format!("c=1, pinned to CPU {PINNED_CPU} (client and server)")
    } else {
        "c=1 (unpinned, not gated)".to_owned()
    };
    let check64 = CpuCheck::start()?;
    let c64_samples = throughput_rounds(&c, 64, C64_PAIRS).await?;
    let check64 = check64.since()?;
    let c64_label = "c=64, unpinned (both CPUs)".to_owned();
    let sections = [
        (c1_label.clone(), C1_PAIRS, medians(&c1.samples)),
        (c64_label.clone(), C64_PAIRS, medians(&c64_samples)),
    ];

    writeln!(
        out,
        "## Throughput: uncontended acquire+release pairs over distinct keys\n"
    )?;
    writeln!(
        out,
        "| concurrency | contender | pairs/s | × floor | client CPU µs/pair | server CPU µs/pair | × floor's server CPU | server command µs/pair | waiting for a CPU µs/pair, client / server |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|")?;
    for (label, _, m) in &sections {
        let floor = &m[&Who::Floor];
        let mut bars = Vec::new();
        for who in [Who::Dlock, Who::Floor, Who::Same, Who::Rslock] {
            let x = &m[&who];
            writeln!(
                out,
                "| {label} | {} | {:.0} | {:.2}× | {:.1} | {:.1} | {:.2}× | {:.1} | {:.1} / {:.1} |",
                who.name(),
                x.pairs_per_s,
                x.pairs_per_s / floor.pairs_per_s,
                x.client_us,
                x.server_us,
                x.server_us / floor.server_us,
                x.command_us,
                x.client_wait_us,
                x.server_wait_us
            )?;
            bars.push(Bar {
                name: who.name().into(),
                per_s: x.pairs_per_s,
                client_us: x.client_us,
                server_us: x.server_us,
            });
        }
        chart.throughput.push((label.clone(), bars));
    }
    writeln!(
        out,
        "\n{THROUGHPUT_ROUNDS} interleaved rounds (order rotated each round) after a warm-up; \
         {C1_PAIRS} pairs per run at c=1, {C64_PAIRS} at c=64; medians. \
         CPU per pair measured around each run only. \
         Waiting for a CPU: time runnable but not running (schedstat), the machine's other load."
    )?;
    writeln!(
        out,
        "Client CPU cross-check (threads' schedstat sum vs /proc/self/stat ticks): \
         c=1 section {:.2} s vs {:.2} s, c=64 section {:.2} s vs {:.2} s.",
        c1.check.0, c1.check.1, check64.0, check64.1
    )?;

    writeln!(
        out,
        "\n## Server command time per pair (INFO commandstats, medians)\n"
    )?;
    writeln!(
        out,
        "Commands a script runs are counted on their own rows and inside the script's row.\n"
    )?;
    writeln!(
        out,
        "| concurrency | contender | its scripts and direct commands, µs/pair | commands: calls/pair × µs/call |"
    )?;
    writeln!(out, "|---|---|---:|---|")?;
    for (label, _, m) in &sections {
        for who in [Who::Dlock, Who::Same, Who::Floor, Who::Rslock] {
            let commands: Vec<String> = m[&who]
                .commands
                .iter()
                .filter(|(_, (calls, _))| *calls >= 0.01)
                .map(|(name, (calls, usec))| format!("{name} {calls:.2} × {:.2}", usec / calls))
                .collect();
            writeln!(
                out,
                "| {label} | {} | {:.1} | {} |",
                who.name(),
                m[&who].command_us,
                commands.join(", ")
            )?;
        }
    }

    // Where the server's time goes: each half of a pair on its own, c=64.
    writeln!(
        out,
        "\n## The server's cost of each half, c=64 ({C64_PAIRS} steps, acquisitions then releases; medians of {SPLIT_ROUNDS})\n"
    )?;
    writeln!(
        out,
        "| step | server CPU µs/step | commands: calls/step × µs/call |"
    )?;
    writeln!(out, "|---|---:|---|")?;
    let mut split: BTreeMap<&str, (Vec<f64>, Vec<Commands>)> = BTreeMap::new();
    for round in 0..SPLIT_ROUNDS {
        for (acquire, release) in [
            (Step::FloorSet, Step::FloorUnlock),
            (Step::SameAcquire, Step::SameRelease),
        ] {
            let tag = format!("split:{round}");
            for s in [acquire, release] {
                let (cpu, commands) = measure_steps(&c, s, 64, C64_PAIRS, &tag).await?;
                let entry = split.entry(s.name()).or_default();
                entry.0.push(cpu);
                entry.1.push(commands);
            }
        }
    }
    for s in [
        Step::FloorSet,
        Step::FloorUnlock,
        Step::SameAcquire,
        Step::SameRelease,
    ] {
        let (cpu, runs) = &split[s.name()];
        let names: std::collections::BTreeSet<&String> =
            runs.iter().flat_map(|r| r.keys()).collect();
        let commands: Vec<String> = names
            .into_iter()
            .filter_map(|name| {
                let get = |i: usize| {
                    runs.iter()
                        .map(|r| r.get(name).map_or(0.0, |v| [v.0, v.1][i]))
                        .collect()
                };
                let (calls, usec) = (median(get(0)), median(get(1)));
                (calls >= 0.01).then(|| format!("{name} {calls:.2} × {:.2}", usec / calls))
            })
            .collect();
        writeln!(
            out,
            "| {} | {:.1} | {} |",
            s.name(),
            median(cpu.clone()),
            commands.join(", ")
        )?;
    }

    // The comparison table of before, with the handoff, watchdog and macro rows.
    let mut table = String::new();
    writeln!(table, "\n## dlock against the baselines\n")?;
    writeln!(table, "| measure | dlock | baseline | ratio |")?;
    writeln!(table, "|---|---:|---:|---:|")?;
    for (label, _, m) in &sections {
        let ours = m[&Who::Dlock].pairs_per_s;
        for who in [Who::Floor, Who::Rslock, Who::Same] {
            let base = m[&who].pairs_per_s;
            writeln!(
                table,
                "| acquire+release/s, {label} | {ours:.0} | {} {base:.0} | {:.2}× |",
                who.name(),
                ours / base
            )?;
        }
    }

    // 2. Handoff.
    let dlock_one = handoffs(|k| {
        let c = c.clone();
        convoy(move |_| {
            let (c, key) = (c.clone(), format!("handoff:{}:{k}", c.run));
            async move {
                let guard = c
                    .dlock
                    .lock(key)
                    .wait(Duration::from_secs(30))
                    .lease(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap_or_else(|e| panic!("dlock handoff: acquire failed: {e}"));
                let held = hold().await;
                guard
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("dlock handoff: release failed: {e}"));
                held
            }
        })
    })
    .await;
    let mut dlock_procs = Vec::new();
    for k in 0..CONVOYS {
        dlock_procs.push(convoy_processes(&url, &format!("handoff-procs:{run}:{k}"))?);
    }
    let dlock_procs = median(dlock_procs);
    let rslock = handoffs(|k| {
        let c = c.clone();
        convoy(move |_| {
            let (c, key) = (c.clone(), format!("bench:rslock-handoff:{}:{k}", c.run));
            async move {
                let lock = c
                    .rslock
                    .acquire_no_guard(key.as_bytes(), Duration::from_secs(30))
                    .await
                    .unwrap_or_else(|e| panic!("rslock handoff: acquire failed: {e}"));
                let held = hold().await;
                c.rslock.unlock(&lock).await;
                held
            }
        })
    })
    .await;
    let polling = handoffs(|k| {
        let c = c.clone();
        convoy(move |_| {
            let (c, key) = (c.clone(), format!("bench:poll:{}:{k}", c.run));
            async move {
                let mut conn = c.floor.clone();
                let owner = owner();
                while !floor_try(&mut conn, &key, &owner).await {
                    tokio::time::sleep(POLL).await;
                }
                let held = hold().await;
                assert!(
                    floor_unlock(&c, &mut conn, &key, &owner).await,
                    "polling loop: the unlock script did not delete {key}"
                );
                held
            }
        })
    })
    .await;
    for (name, ms) in [
        ("rslock", rslock),
        ("100 ms polling loop", polling),
        ("dlock, 4 processes", dlock_procs),
    ] {
        writeln!(
            table,
            "| handoff, {CONVOY}-task convoy, ms | {dlock_one:.3} | {name} {ms:.3} | {:.3}× |",
            dlock_one / ms
        )?;
    }
    chart.handoff = vec![
        ("dlock, 1 process".into(), dlock_one),
        ("dlock, 4 processes".into(), dlock_procs),
        ("rslock".into(), rslock),
        ("100 ms polling".into(), polling),
    ];

    // 3. Watchdog.
    let watchdog = watchdog_cost(&c).await?;
    writeln!(
        table,
        "| watchdog, {WATCHDOG_LEASES} leases of {}: renewals/s | {:.0} | one per lease per lease/3: {:.0} | {:.2}× |",
        humantime::format_duration(WATCHDOG_LEASE),
        watchdog.renewals_per_s,
        watchdog.expected_per_s,
        watchdog.renewals_per_s / watchdog.expected_per_s
    )?;
    writeln!(
        table,
        "| watchdog: renewal pipelines/s; CPU | {:.1} pipelines/s | client {:.1}%, server {:.1}% of one core | |",
        watchdog.pipelines_per_s, watchdog.cpu_percent, watchdog.server_cpu_percent
    )?;

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

    // 5. Keys left: nothing flushed, nothing deleted before counting.
    let total: u64 = redis::cmd("DBSIZE").query_async(&mut admin).await?;
    let mut keys: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut admin)
            .await?;
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    let (fences, left): (Vec<String>, Vec<String>) = keys
        .into_iter()
        .partition(|k| k == FENCE_KEY || k.starts_with(&format!("{FENCE_KEY}:")));
    writeln!(out, "\n## Keys left on the benchmark's server\n")?;
    writeln!(
        out,
        "DBSIZE {total}: fence counters {} ({}); keys left: {} (beyond the fence counter){}",
        fences.len(),
        fences.join(", "),
        left.len(),
        if left.is_empty() {
            String::new()
        } else {
            format!(
                ", e.g. {}",
                left.iter().take(10).cloned().collect::<Vec<_>>().join(", ")
            )
        }
    )?;

    // Targets.
    let c1m = &sections[0].2;
    let c64m = &sections[1].2;
    let ratio = |m: &BTreeMap<Who, Medians>, a: Who, b: Who| m[&a].pairs_per_s / m[&b].pairs_per_s;
    let cpu_ratio =
        |m: &BTreeMap<Who, Medians>| m[&Who::Dlock].server_us / m[&Who::Floor].server_us;
    writeln!(out, "\n## Targets (ratios in this run)\n")?;
    writeln!(out, "| target | measured | met |")?;
    writeln!(out, "|---|---:|:---:|")?;
    let r = ratio(c64m, Who::Dlock, Who::Floor);
    writeln!(
        out,
        "| c=64: dlock ≥ {TARGET_C64_FLOOR}× the floor | {r:.2}× | {} |",
        tick(r >= TARGET_C64_FLOOR)
    )?;
    let r = ratio(c64m, Who::Dlock, Who::Rslock);
    writeln!(
        out,
        "| c=64: dlock ≥ {TARGET_C64_RSLOCK:.1}× rslock | {r:.2}× | {} |",
        tick(r >= TARGET_C64_RSLOCK)
    )?;
    let r = ratio(c1m, Who::Dlock, Who::Floor);
    if c1.pinned {
        writeln!(
            out,
            "| {c1_label}: dlock ≥ {TARGET_C1_FLOOR}× the floor | {r:.2}× | {} |",
            tick(r >= TARGET_C1_FLOOR)
        )?;
    } else {
        writeln!(
            out,
            "| {c1_label}: dlock ≥ {TARGET_C1_FLOOR}× the floor | {r:.2}× | not gated |"
        )?;
    }
    let r = cpu_ratio(c64m);
    writeln!(
        out,
        "| c=64: server CPU per lock ≤ {TARGET_SERVER_CPU}× the floor's | {r:.2}× ({:.1} vs {:.1} µs) | {} |",
        c64m[&Who::Dlock].server_us,
        c64m[&Who::Floor].server_us,
        tick(r <= TARGET_SERVER_CPU)
    )?;
    let r = cpu_ratio(c1m);
    writeln!(
        out,
        "| {c1_label}: server CPU per lock ≤ {TARGET_SERVER_CPU}× the floor's | {r:.2}× ({:.1} vs {:.1} µs) | {} |",
        c1m[&Who::Dlock].server_us,
        c1m[&Who::Floor].server_us,
        if c1.pinned {
            tick(r <= TARGET_SERVER_CPU)
        } else {
            "not gated"
        }
    )?;
    writeln!(
        out,
        "| keys left: 0 beyond the fence counter | {} | {} |",
        left.len(),
        tick(left.is_empty())
    )?;
    for (name, ms) in [("1 process", dlock_one), ("4 processes", dlock_procs)] {
        writeln!(
            out,
            "| handoff: dlock ({name}) faster than rslock and 100 ms polling | {ms:.3} ms vs {rslock:.3} / {polling:.3} ms | {} |",
            tick(ms < rslock && ms < polling)
        )?;
    }
    writeln!(
        out,
        "\nMachine: {} CPUs online ({}), this process on CPUs {}; load average at start {}, at end {}",
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .unwrap_or_default()
            .trim(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpus_allowed("self")?,
        load_at_start.trim(),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    )?;

    print!("{out}");
    let svg = chart.svg();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/bench/redis.svg");
    std::fs::create_dir_all(path.parent().expect("folder"))?;
    std::fs::write(&path, svg)?;
    println!("chart: {}", path.display());
    drop(server);
    Ok(())
}

/// Holds the lock for [`HOLD`]; answers how long that really took.
async fn hold() -> Duration {
    let started = Instant::now();
    tokio::time::sleep(HOLD).await;
    started.elapsed()
}

/// One convoy: [`CONVOY`] tasks start together, each runs `op` once (acquire,
/// hold, release; it answers its hold). Answers the milliseconds per handoff.
async fn convoy<F, Fut>(op: F) -> f64
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

fn per_handoff(wall: Duration, held: Duration) -> f64 {
    wall.saturating_sub(held).as_secs_f64() * 1000.0 / (CONVOY - 1) as f64
}

/// The median over [`CONVOYS`] convoys, each on a key of its own.
async fn handoffs<F, Fut>(mut one: F) -> f64
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

/// A convoy spread over [`PROCESSES`] processes of this program, started at
/// one wall-clock instant; answers the milliseconds per handoff.
fn convoy_processes(url: &str, key: &str) -> anyhow::Result<f64> {
    let start_at = now_micros() + 1_500_000;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            std::process::Command::new(std::env::current_exe()?)
                .args([
                    "--convoy-child",
                    url,
                    key,
                    &(CONVOY / PROCESSES).to_string(),
                    &start_at.to_string(),
                ])
                .stdout(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let (mut last_end, mut held) = (start_at, 0u64);
    for child in children {
        let output = child.wait_with_output()?;
        anyhow::ensure!(output.status.success(), "a convoy process failed");
        for line in String::from_utf8(output.stdout)?.lines() {
            let (hold, end) = line
                .split_once(' ')
                .ok_or_else(|| anyhow::anyhow!("bad child line {line:?}"))?;
            held += hold.parse::<u64>()?;
            last_end = last_end.max(end.parse()?);
        }
    }
    Ok(per_handoff(
        Duration::from_micros(last_end - start_at),
        Duration::from_micros(held),
    ))
}

/// A convoy process: `url key tasks start_at_micros`. Prints one line per
/// task: its hold and the instant it released, in µs.
async fn convoy_child(args: &[String]) -> anyhow::Result<()> {
    let [url, key, tasks, start_at] = args else {
        anyhow::bail!("usage: --convoy-child URL KEY TASKS START_AT_MICROS");
    };
    let registry = Registry::builder()
        .default_backend(RedisBackend::connect(url).await?)
        .build();
    let start_at: u64 = start_at.parse()?;
    tokio::time::sleep(Duration::from_micros(start_at.saturating_sub(now_micros()))).await;
    let tasks: Vec<_> = (0..tasks.parse::<usize>()?)
        .map(|_| {
            let (registry, key) = (registry.clone(), key.clone());
            tokio::spawn(async move {
                let guard = registry
                    .lock(key)
                    .wait(Duration::from_secs(30))
                    .lease(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap_or_else(|e| panic!("dlock convoy process: acquire failed: {e}"));
                let held = hold().await;
                guard
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("dlock convoy process: release failed: {e}"));
                (held, now_micros())
            })
        })
        .collect();
    for task in tasks {
        let (held, end) = join(task).await;
        println!("{} {end}", held.as_micros());
    }
    Ok(())
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as u64
}

struct WatchdogCost {
    renewals_per_s: f64,
    expected_per_s: f64,
    pipelines_per_s: f64,
    cpu_percent: f64,
    server_cpu_percent: f64,
}

/// Holds [`WATCHDOG_LEASES`] leases and watches the renewals for a while.
async fn watchdog_cost(c: &Arc<Contenders>) -> anyhow::Result<WatchdogCost> {
    let mut guards = Vec::with_capacity(WATCHDOG_LEASES);
    let acquiring: Vec<_> = (0..64)
        .map(|t| {
            let c = c.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                for i in (t..WATCHDOG_LEASES).step_by(64) {
                    mine.push(
                        c.dlock
                            .lock(format!("watchdog:{}:{i}", c.run))
                            .lease(WATCHDOG_LEASE)
                            .acquire()
                            .await
                            .unwrap_or_else(|e| panic!("dlock watchdog: acquire failed: {e}")),
                    );
                }
                mine
            })
        })
        .collect();
    for task in acquiring {
        guards.extend(join(task).await);
    }
    // Let the first renewals of every lease start, then measure.
    tokio::time::sleep(WATCHDOG_LEASE / 3).await;
    let mut conn = c.admin.clone();
    let (renewals, pipelines) = script_calls(&mut conn).await?;
    let server_cpu = server_cpu_seconds(&mut conn).await?;
    let cpu = client_cpu_ns()?;
    let started = Instant::now();
    tokio::time::sleep(WATCHDOG_WINDOW).await;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = (client_cpu_ns()? - cpu) as f64 / 1e9;
    let server_cpu = server_cpu_seconds(&mut conn).await? - server_cpu;
    let (renewals_after, pipelines_after) = script_calls(&mut conn).await?;
    anyhow::ensure!(
        guards.iter().all(|g| !g.is_lost()),
        "a lease was lost while idle"
    );
    for guard in guards {
        guard.release().await?;
    }
    Ok(WatchdogCost {
        renewals_per_s: (renewals_after - renewals) as f64 / elapsed,
        expected_per_s: WATCHDOG_LEASES as f64 / (WATCHDOG_LEASE / 3).as_secs_f64(),
        pipelines_per_s: (pipelines_after - pipelines) as f64 / elapsed,
        cpu_percent: cpu / elapsed * 100.0,
        server_cpu_percent: server_cpu / elapsed * 100.0,
    })
}

/// `INFO commandstats`: command → (calls, usec).
async fn commandstats(
    conn: &mut MultiplexedConnection,
) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut out = BTreeMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
        };
        let (Some(calls), Some(usec)) = (field("calls"), field("usec")) else {
            anyhow::bail!("unexpected INFO commandstats line {line:?}");
        };
        out.insert(name.to_owned(), (calls, usec));
    }
    Ok(out)
}

/// The server's counts of `EVALSHA` (renewals; nothing else runs scripts
/// meanwhile) and `SCRIPT LOAD` (one per renewal pipeline).
async fn script_calls(conn: &mut MultiplexedConnection) -> anyhow::Result<(u64, u64)> {
    let stats = commandstats(conn).await?;
    let calls = |name: &str| stats.get(name).map_or(0, |(calls, _)| *calls);
    Ok((calls("evalsha"), calls("script|load")))
}

/// A numeric field of an `INFO` answer.
fn info_field(info: &str, name: &str) -> Option<f64> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

/// The server's user + system CPU time (`INFO cpu`), in seconds.
async fn server_cpu_seconds(conn: &mut MultiplexedConnection) -> anyhow::Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    match (
        info_field(&info, "used_cpu_sys"),
        info_field(&info, "used_cpu_user"),
    ) {
        (Some(sys), Some(user)) => Ok(sys + user),
        _ => anyhow::bail!("no used_cpu_sys/used_cpu_user in INFO cpu"),
    }
}

/// This process's CPU time in ns (see [`schedstat`]).
fn client_cpu_ns() -> anyhow::Result<u64> {
    Ok(schedstat("self")?.0)
}

/// A process's (`self` or a pid) time on a CPU and time runnable but waiting
/// for one, in ns: the sums over its threads of the first two fields of
/// `/proc/PID/task/*/schedstat`. Our threads never exit meanwhile (the
/// runtimes keep theirs alive), nor do the server's; a thread that appears
/// counts from zero.
fn schedstat(pid: &str) -> anyhow::Result<(u64, u64)> {
    let (mut on_cpu, mut waiting) = (0u64, 0u64);
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        match std::fs::read_to_string(&path) {
            Ok(stat) => {
                let mut fields = stat.split_whitespace().map(str::parse::<u64>);
                match (fields.next(), fields.next()) {
                    (Some(Ok(run)), Some(Ok(wait))) => {
                        on_cpu += run;
                        waiting += wait;
                    }
                    _ => anyhow::bail!("unexpected {}: {stat:?}", path.display()),
                }
            }
            // A thread that exited between the listing and the read.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((on_cpu, waiting))
}

/// Clock ticks per second of `/proc/*/stat` (`getconf CLK_TCK`, normally 100).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// This process's user + system CPU time from `/proc/self/stat`, in seconds
/// (tick resolution: the cross-check of [`client_cpu_ns`]).
fn cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow::anyhow!("unexpected /proc/self/stat"))?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file, 12 and 13 here.
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / clock_ticks())
}

/// One throughput bar.
struct Bar {
    name: String,
    per_s: f64,
    client_us: f64,
    server_us: f64,
}

/// The two panels of `docs/bench/redis.svg`.
#[derive(Default)]
struct Chart {
    /// Per concurrency: the contenders' bars.
    throughput: Vec<(String, Vec<Bar>)>,
    /// (contender, ms per handoff).
    handoff: Vec<(String, f64)>,
}

impl Chart {
    fn svg(&self) -> String {
        const W: f64 = 900.0;
        const LABEL: f64 = 190.0;
        const BAR: f64 = 18.0;
        let plot = W - LABEL - 290.0;
        let colour = |name: &str| {
            if name.starts_with("dlock") && !name.contains("by hand") {
                "#2b6cb0"
            } else if name.starts_with("rslock") {
                "#c05621"
            } else {
                "#718096"
            }
        };
        let mut body = String::new();
        let mut y = 30.0;
        let title = |body: &mut String, y: &mut f64, text: &str| {
            let _ = writeln!(
                body,
                r#"<text x="10" y="{y}" font-size="15" font-weight="bold">{text}</text>"#
            );
            *y += 14.0;
        };
        title(
            &mut body,
            &mut y,
            "Uncontended acquire+release per second (higher is better); CPU µs per pair, client + server",
        );
        let max = self
            .throughput
            .iter()
            .flat_map(|(_, bars)| bars.iter().map(|b| b.per_s))
            .fold(1.0, f64::max);
        for (group, bars) in &self.throughput {
            let _ = writeln!(
                body,
                r#"<text x="10" y="{}" font-size="12" font-style="italic">{group}</text>"#,
                y + 12.0
            );
            y += 18.0;
            for bar in bars {
                let width = plot * bar.per_s / max;
                let _ = writeln!(
                    body,
                    r#"<text x="{}" y="{}" font-size="12" text-anchor="end">{}</text><rect x="{LABEL}" y="{y}" width="{width:.1}" height="{BAR}" fill="{}"/><text x="{:.1}" y="{}" font-size="12">{:.0}/s · CPU {:.1} + {:.1} µs</text>"#,
                    LABEL - 6.0,
                    y + 13.0,
                    bar.name,
                    colour(&bar.name),
                    LABEL + width + 4.0,
                    y + 13.0,
                    bar.per_s,
                    bar.client_us,
                    bar.server_us
                );
                y += BAR + 4.0;
            }
            y += 8.0;
        }
        y += 20.0;
        title(
            &mut body,
            &mut y,
            "Handoff on one hot key, ms per handoff (log scale, lower is better)",
        );
        // Log scale from 0.01 ms to 1000 ms.
        let scale = |ms: f64| plot * ((ms.max(0.01)).log10() + 2.0) / 5.0;
        for (name, ms) in &self.handoff {
            let width = scale(*ms);
            let _ = writeln!(
                body,
                r#"<text x="{}" y="{}" font-size="12" text-anchor="end">{name}</text><rect x="{LABEL}" y="{y}" width="{width:.1}" height="{BAR}" fill="{}"/><text x="{:.1}" y="{}" font-size="12">{ms:.2} ms</text>"#,
                LABEL - 6.0,
                y + 13.0,
                colour(name),
                LABEL + width + 4.0,
                y + 13.0
            );
            y += BAR + 4.0;
        }
        for (i, tick) in ["0.01", "0.1", "1", "10", "100", "1000"].iter().enumerate() {
            let x = LABEL + plot * i as f64 / 5.0;
            let _ = writeln!(
                body,
                r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#a0aec0" stroke-dasharray="2,2"/><text x="{x:.1}" y="{}" font-size="11" text-anchor="middle">{tick}</text>"##,
                y - (BAR + 4.0) * self.handoff.len() as f64,
                y,
                y + 14.0
            );
        }
        y += 30.0;
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{y}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>
{body}</svg>
"#
        )
    }
}
