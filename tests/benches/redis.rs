//! dlock on Redis against what people write by hand and against `rslock`,
//! in one run, as ratios.
//!
//! ```sh
//! scripts/servers.sh up
//! cargo bench -p dlock-tests --features redis --bench redis
//! ```
//!
//! 1. **Throughput**, uncontended acquire+release over distinct keys at
//!    concurrency 1 and 64: dlock's guard (fence counter, watchdog
//!    registration, tracing span included) against (a) the floor, the same
//!    commands hand-written with the redis crate on one multiplexed connection
//!    (`SET NX PX`, then the compare-and-delete script), (b) `rslock` with one
//!    instance, and (c) dlock's own two scripts (with the fence counter and
//!    the release message) hand-written on that connection: the gap between
//!    (a) and (c) is what the protocol costs the server, the gap between (c)
//!    and dlock is what the library costs the client.
//! 2. **Handoff** on one hot key: a convoy of 16 tasks that start together,
//!    each acquires once, holds 1 ms and releases. Per handoff =
//!    (wall time − the holds) / 15, the holds as measured (tokio's timer makes
//!    a 1 ms sleep last a little longer); median of several convoys. dlock in
//!    one process and spread over 4 processes, against `rslock` and a 100 ms
//!    polling loop (what the common recipes do).
//! 3. **Watchdog** with 10,000 held leases: renewal commands per second seen
//!    by the server (`INFO commandstats`), renewal pipelines per second, and
//!    this process's CPU time (`/proc/self/stat`) over the window.
//! 4. **Macro overhead**: the attribute against the hand-written guard on the
//!    memory backend.
//!
//! It prints a Markdown table and writes `docs/bench/redis.svg`. The Redis
//! server must be otherwise idle (section 3 reads its command counters).

use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock_runtime::{MemoryBackend, RedisBackend, Registry};
use redis::Script;
use tokio::sync::Barrier;

mod common;
use common::{ROUNDS, macro_overhead, median};

const CONVOY: usize = 16;
const CONVOYS: usize = 5;
const PROCESSES: usize = 4;
const HOLD: Duration = Duration::from_millis(1);
const POLL: Duration = Duration::from_millis(100);
const WATCHDOG_LEASES: usize = 10_000;
const WATCHDOG_LEASE: Duration = Duration::from_secs(3);
const WATCHDOG_WINDOW: Duration = Duration::from_secs(6);

fn redis_url() -> String {
    std::env::var("DLOCK_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:46379/".into())
}

/// The compare-and-delete every careful hand-written Redis lock uses.
fn unlock_script() -> Script {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    )
}

/// The hand-written acquire: `SET key owner NX PX 30000`; whether it took the key.
async fn floor_try(conn: &mut redis::aio::MultiplexedConnection, key: &str, owner: &str) -> bool {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(owner)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(conn)
        .await
        .expect("SET");
    set.is_some()
}

/// The hand-written release: the compare-and-delete script.
async fn floor_unlock(
    c: &Contenders,
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    owner: &str,
) {
    let _: i64 = c
        .unlock
        .key(key)
        .arg(owner)
        .invoke_async(conn)
        .await
        .expect("unlock");
}

fn owner() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if let Some(at) = args.iter().position(|a| a == "--convoy-child") {
        return runtime.block_on(convoy_child(&args[at + 1..]));
    }
    runtime.block_on(bench())
}

/// dlock's own Redis scripts, for the "same protocol by hand" baseline.
const ACQUIRE_LUA: &str = include_str!("../../dlock-runtime/src/backend/redis/acquire.lua");
const RELEASE_LUA: &str = include_str!("../../dlock-runtime/src/backend/redis/release.lua");

/// The contenders of one benchmark run.
struct Contenders {
    dlock: Registry,
    floor: redis::aio::MultiplexedConnection,
    unlock: Script,
    acquire_lua: Script,
    release_lua: Script,
    rslock: rslock::LockManager,
    run: u64,
}

async fn bench() -> anyhow::Result<()> {
    let url = redis_url();
    // The global registry is memory, for the macro-overhead pair; Redis is a
    // registry of its own (the same code path as the global one).
    dlock_runtime::init(
        Registry::builder()
            .default_backend(MemoryBackend::new())
            .build(),
    )?;
    let c = Arc::new(Contenders {
        dlock: Registry::builder()
            .default_backend(RedisBackend::connect(&url).await.map_err(|e| {
                anyhow::anyhow!("{e}: start the servers first (scripts/servers.sh up)")
            })?)
            .build(),
        floor: redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection()
            .await?,
        unlock: unlock_script(),
        acquire_lua: Script::new(ACQUIRE_LUA),
        release_lua: Script::new(RELEASE_LUA),
        rslock: rslock::LockManager::new(vec![url.clone()]),
        run: rand::random(),
    });

    let mut table = String::new();
    let mut chart = Chart::default();
    writeln!(table, "| measure | dlock | baseline | ratio |")?;
    writeln!(table, "|---|---:|---:|---:|")?;

    // 1. Throughput.
    for (concurrency, n) in [(1, 2_000), (64, 20_000)] {
        let (mut ours, mut floor, mut rs, mut same) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let tag = format!("{round}:{concurrency}");
            floor.push(
                throughput(concurrency, n, {
                    let (c, tag) = (c.clone(), tag.clone());
                    move |i| {
                        let (c, key) = (c.clone(), format!("bench:floor:{}:{tag}:{i}", c.run));
                        async move {
                            let mut conn = c.floor.clone();
                            let owner = owner();
                            assert!(floor_try(&mut conn, &key, &owner).await);
                            floor_unlock(&c, &mut conn, &key, &owner).await;
                        }
                    }
                })
                .await,
            );
            same.push(
                throughput(concurrency, n, {
                    let (c, tag) = (c.clone(), tag.clone());
                    move |i| {
                        let (c, key) = (c.clone(), format!("{{bench:same:{}:{tag}:{i}}}", c.run));
                        async move {
                            let mut conn = c.floor.clone();
                            let owner = owner();
                            let (taken, _token): (i64, i64) = c
                                .acquire_lua
                                .key(&key)
                                .key("dlock-fence")
                                .arg(&owner)
                                .arg(30_000)
                                .invoke_async(&mut conn)
                                .await
                                .expect("acquire script");
                            assert_eq!(taken, 1);
                            let _: i64 = c
                                .release_lua
                                .key(&key)
                                .arg(&owner)
                                .arg(format!("{key}:released"))
                                .invoke_async(&mut conn)
                                .await
                                .expect("release script");
                        }
                    }
                })
                .await,
            );
            rs.push(
                throughput(concurrency, n, {
                    let (c, tag) = (c.clone(), tag.clone());
                    move |i| {
                        let (c, key) = (c.clone(), format!("bench:rslock:{}:{tag}:{i}", c.run));
                        async move {
                            let lock = c
                                .rslock
                                .lock(key.as_bytes(), Duration::from_secs(30))
                                .await
                                .expect("rslock");
                            c.rslock.unlock(&lock).await;
                        }
                    }
                })
                .await,
            );
            ours.push(
                throughput(concurrency, n, {
                    let (c, tag) = (c.clone(), tag.clone());
                    move |i| {
                        let (c, key) = (c.clone(), format!("throughput:{}:{tag}:{i}", c.run));
                        async move {
                            let guard = c
                                .dlock
                                .lock(key)
                                .lease(Duration::from_secs(30))
                                .acquire()
                                .await
                                .expect("acquire");
                            guard.release().await.expect("release");
                        }
                    }
                })
                .await,
            );
        }
        let (ours, floor, rs, same) = (median(ours), median(floor), median(rs), median(same));
        writeln!(
            table,
            "| acquire+release/s, c={concurrency} | {ours:.0} | hand-written floor {floor:.0} | {:.2}× |",
            ours / floor
        )?;
        writeln!(
            table,
            "| acquire+release/s, c={concurrency} | {ours:.0} | rslock {rs:.0} ({:.2}× floor) | {:.2}× |",
            rs / floor,
            ours / rs
        )?;
        writeln!(
            table,
            "| acquire+release/s, c={concurrency} | {ours:.0} | dlock's own scripts by hand {same:.0} ({:.2}× floor) | {:.2}× |",
            same / floor,
            ours / same
        )?;
        chart.throughput.push((
            format!("c={concurrency}"),
            vec![
                ("dlock".into(), ours),
                ("hand-written".into(), floor),
                ("dlock's scripts by hand".into(), same),
                ("rslock".into(), rs),
            ],
        ));
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
                    .expect("acquire");
                let held = hold().await;
                guard.release().await.expect("release");
                held
            }
        })
    })
    .await;
    let mut dlock_procs = Vec::new();
    for k in 0..CONVOYS {
        dlock_procs.push(convoy_processes(&format!("handoff-procs:{}:{k}", c.run))?);
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
                    .expect("rslock");
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
                floor_unlock(&c, &mut conn, &key, &owner).await;
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
        "| watchdog: renewal pipelines/s; client CPU | {:.1} pipelines/s | CPU {:.1}% of one core | |",
        watchdog.pipelines_per_s, watchdog.cpu_percent
    )?;

    // 4. Macro overhead.
    let (ours, base) = macro_overhead(20_000).await;
    writeln!(
        table,
        "| attribute vs hand-written guard (memory), calls/s | {ours:.0} | {base:.0} | {:.2}× |",
        ours / base
    )?;

    print!("{table}");
    println!(
        "\n{ROUNDS} rounds of each throughput pair, {CONVOYS} convoys per handoff contender, medians."
    );
    let svg = chart.svg();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/bench/redis.svg");
    std::fs::create_dir_all(path.parent().expect("folder"))?;
    std::fs::write(&path, svg)?;
    println!("chart: {}", path.display());
    Ok(())
}

/// Operations per second of `op` over `n` keys, by `concurrency` tasks at once.
async fn throughput<F, Fut>(concurrency: u64, n: u64, op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let started = Instant::now();
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
        task.await.expect("task");
    }
    n as f64 / started.elapsed().as_secs_f64()
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
    Fut: Future<Output = Duration> + Send,
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
        held += task.await.expect("task");
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
fn convoy_processes(key: &str) -> anyhow::Result<f64> {
    let start_at = now_micros() + 1_500_000;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            std::process::Command::new(std::env::current_exe()?)
                .args([
                    "--convoy-child",
                    &redis_url(),
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
                    .expect("acquire");
                let held = hold().await;
                guard.release().await.expect("release");
                (held, now_micros())
            })
        })
        .collect();
    for task in tasks {
        let (held, end) = task.await?;
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
                            .expect("acquire"),
                    );
                }
                mine
            })
        })
        .collect();
    for task in acquiring {
        guards.extend(task.await?);
    }
    // Let the first renewals of every lease start, then measure.
    tokio::time::sleep(WATCHDOG_LEASE / 3).await;
    let mut conn = c.floor.clone();
    let (renewals, pipelines) = script_calls(&mut conn).await?;
    let cpu = cpu_seconds()?;
    let started = Instant::now();
    tokio::time::sleep(WATCHDOG_WINDOW).await;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds()? - cpu;
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
    })
}

/// The server's counts of `EVALSHA` (renewals; nothing else runs scripts
/// meanwhile) and `SCRIPT LOAD` (one per renewal pipeline).
async fn script_calls(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<(u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let calls = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok((calls("evalsha"), calls("script|load")))
}

/// This process's user + system CPU time, in seconds.
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
    // USER_HZ is 100 on Linux.
    Ok(ticks as f64 / 100.0)
}

/// The two panels of `docs/bench/redis.svg`.
#[derive(Default)]
struct Chart {
    /// Per concurrency: (contender, acquire+release per second).
    throughput: Vec<(String, Vec<(String, f64)>)>,
    /// (contender, ms per handoff).
    handoff: Vec<(String, f64)>,
}

impl Chart {
    fn svg(&self) -> String {
        const W: f64 = 760.0;
        const LABEL: f64 = 190.0;
        const BAR: f64 = 18.0;
        let plot = W - LABEL - 110.0;
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
            "Uncontended acquire+release per second (higher is better)",
        );
        let max = self
            .throughput
            .iter()
            .flat_map(|(_, bars)| bars.iter().map(|(_, v)| *v))
            .fold(1.0, f64::max);
        for (group, bars) in &self.throughput {
            for (name, value) in bars {
                let width = plot * value / max;
                let _ = writeln!(
                    body,
                    r#"<text x="{}" y="{}" font-size="12" text-anchor="end">{name}, {group}</text><rect x="{LABEL}" y="{y}" width="{width:.1}" height="{BAR}" fill="{}"/><text x="{:.1}" y="{}" font-size="12">{value:.0}/s</text>"#,
                    LABEL - 6.0,
                    y + 13.0,
                    colour(name),
                    LABEL + width + 4.0,
                    y + 13.0
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
