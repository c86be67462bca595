//! dlock's semaphores and read-write locks: their uncontended pairs against
//! the same scripts and transactions by hand, and their handoffs against the
//! plain lock's, in one run, as ratios.
//!
//! ```sh
//! set -a; . target/servers/urls.env; set +a   # ZooKeeper's URL, for the handoffs
//! cargo bench -p dlock-tests --all-features --bench hold_modes
//! cargo bench -p dlock-tests --all-features --bench hold_modes -- --quick
//! cargo bench -p dlock-tests --all-features --bench hold_modes -- handoff zookeeper
//! ```
//!
//! Needs `redis-server`, PostgreSQL 15 and MariaDB installed
//! (`scripts/servers.sh up` installs them; their servers need not run) and,
//! for the pinned section, `taskset` (util-linux). The benchmark starts
//! **servers of its own**, as the Redis and SQL benchmarks do: Redis on
//! `127.0.0.1:29431`, a PostgreSQL cluster on `127.0.0.1:47891` and a MariaDB
//! data directory on `127.0.0.1:47892` (or the first free of the next few
//! ports of the same parity), under `target/bench-hold-modes/`, with a fresh
//! SQLite file there too; it stops and removes them at the end, also when a
//! contender fails. ZooKeeper, for the handoffs only, is the test server of
//! `DLOCK_TEST_ZK_URL` (skipped, and said so, without it).
//!
//! 1. **Acquire+release pairs**, uncontended, over distinct keys, lease 30 s:
//!    a semaphore of 3 permits on Redis, PostgreSQL lease mode, MariaDB lease
//!    mode and SQLite, and a read lock on Redis and PostgreSQL. dlock's guard
//!    (watchdog registration, tracing span included) against the same work
//!    by hand: on Redis, dlock's hold-mode scripts (`acquire_held.lua`,
//!    `release_held.lua`, the texts `scripts.rs` sends) invoked with the
//!    redis crate on one multiplexed connection; on the SQL backends, the
//!    statements of `sql/shared.rs` in each dialect's text, in the same
//!    transactions (lock the key's row, insert it if missing, read the live
//!    holders, raise `shared_until`, take the slot row, with the token
//!    returned by the statement that writes it, or read after it on
//!    MariaDB; free, recompute, notify), with sqlx on a pool of the size
//!    dlock's has (SQLite's, as dlock's, without a ping before each use;
//!    dlock's call timeout there raised to 60 s: the pool by hand has none).
//!    Target: dlock ≥ 0.8× the hand-written pairs/s.
//!    - **Concurrency 1 runs pinned**: in a child process of this program
//!      under `taskset -c 1`, with every server thread pinned to the same
//!      CPU for the duration (Redis, MariaDB, the postmaster and the backends
//!      it forks), and a current-thread runtime. Without `taskset` it runs
//!      unpinned, is marked so, and no target is judged on it.
//!    - **Concurrency 64 runs unpinned** (client and servers on both CPUs).
//!    - **Interleaved rounds**: every round runs each contender once, in an
//!      order rotated each round; one unrecorded warm-up run of each first.
//!      Medians over the rounds.
//!    - **CPU per pair** next to pairs/s, measured around each run only: the
//!      client's from this process's threads' `schedstat`, the server's the
//!      same over the server's threads (PostgreSQL: the postmaster and its
//!      children); SQLite runs in the client. The CPU per pair is the
//!      figure other load on the machine disturbs least.
//! 2. **Handoff**: the time from a holder's release call to a waiting
//!    contender's grant (`dlock_tests::handoff::measure_handover`), holder
//!    and waiter on registries of their own (a backend instance each, so the
//!    wake-up crosses the server as between processes; the memory backend
//!    is one instance), the waiter waiting 50 ms before the release: (a)
//!    plain → waiting plain (the baseline), (b) writer → waiting reader,
//!    (c) reader → waiting writer, (d) one of 2 permit holders (both slots
//!    held) → waiting permit seeker. Rounds interleave the four; medians
//!    over every handoff. Target: (b), (c), (d) ≤ 1.5× (a) on each backend.
//!    The backends are the list [`HANDOFF_BACKENDS`]; a mode a backend does
//!    not offer (`LockBackend::offers`) is shown as such.
//!
//! It prints Markdown tables, the targets with ✓/✗, and the load average at
//! the start and the end. Targets are printed, never asserted: a contender
//! that fails aborts the run instead. `--quick` (or `DLOCK_BENCH_QUICK=1`)
//! runs every section briefly, to check that it works.
//!
//! **Selecting.** Words after `--` select what runs: `pairs` and `handoff`
//! name the sections (both when neither is given); any other word selects
//! the handoff backends whose name contains it, case-insensitively
//! (`zookeeper`, `redis`, `postgresql`, …; every backend when none is
//! given), and a word that names none is an error. The benchmark's own
//! servers start only when a selected part uses them: `-- handoff
//! zookeeper` needs none of them (nor `redis-server`), only
//! `DLOCK_TEST_ZK_URL`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::{HoldMode, LockBackend, MemoryBackend, Registry};
use dlock_tests::handoff::{Handover, measure_handover};
use dlock_tests::redis_support::OwnRedis;

mod common;
use common::cpu::{PinnedServer, on_path, process_tree};
use common::rounds::{PairSample, median_of, run_pinned_child};
use common::{median, tick};

#[path = "hold_modes/hand_sql.rs"]
mod hand_sql;
#[path = "hold_modes/pairs.rs"]
mod pairs;
#[path = "sql/server.rs"]
mod server;
use pairs::{Contenders, Runs, Servers, Who};
use server::OwnServer;

/// The benchmark's own servers (the Redis bench's is 29430, the SQL
/// bench's 47871 and 47872 and the next few of each parity).
const REDIS_PORT: u16 = 29431;
const PG_PORT: u16 = 47891;
const MARIADB_PORT: u16 = 47892;
/// The CPU the concurrency-1 section (client and servers) is pinned to.
const PINNED_CPU: &str = "1";
/// The concurrency of the unpinned section.
const HIGH_CONCURRENCY: u64 = 64;
/// The semaphore's permits in section 1.
pub(crate) const PERMITS: u32 = 3;
/// The lease of every pair.
pub(crate) const LEASE: Duration = Duration::from_secs(30);
/// The permits of the handoff's semaphore (both held when the seeker comes).
const HANDOFF_PERMITS: u32 = 2;
/// How long a waiter waits before the holder releases.
const SETTLE: Duration = Duration::from_millis(50);

/// The targets.
const TARGET_PAIRS_VS_HAND: f64 = 0.8;
const TARGET_HANDOFF_VS_PLAIN: f64 = 1.5;

/// A backend of the handoff section.
struct HandoffBackend {
    name: &'static str,
    /// Its URL (from the benchmark's own servers, when running), or why
    /// it is skipped.
    url: fn(Option<&Servers>) -> Result<String, String>,
    /// Whether it uses the benchmark's own servers.
    own_server: bool,
}

/// The test servers' URL in `var`, or why there is none.
fn test_url(var: &str) -> Result<String, String> {
    std::env::var(var).map_err(|_| format!("{var} is not set (source target/servers/urls.env)"))
}

/// Why a backend on the benchmark's own servers is skipped without them.
fn own(servers: Option<&Servers>) -> Result<&Servers, String> {
    servers.ok_or_else(|| "the benchmark's own servers are not running".to_owned())
}

/// The backends whose handoffs are measured.
const HANDOFF_BACKENDS: &[HandoffBackend] = &[
    HandoffBackend {
        name: "memory",
        own_server: false,
        url: |_| Ok("memory://".to_owned()),
    },
    HandoffBackend {
        name: "Redis",
        own_server: true,
        url: |s| Ok(own(s)?.redis.clone()),
    },
    HandoffBackend {
        name: "SQLite",
        own_server: true,
        url: |s| Ok(own(s)?.sqlite.clone()),
    },
    HandoffBackend {
        name: "PostgreSQL lease",
        own_server: true,
        url: |s| Ok(own(s)?.postgres.clone()),
    },
    HandoffBackend {
        name: "MariaDB lease",
        own_server: true,
        url: |s| Ok(own(s)?.mariadb.clone()),
    },
    HandoffBackend {
        name: "ZooKeeper",
        own_server: false,
        url: |_| test_url("DLOCK_TEST_ZK_URL"),
    },
];

/// The handoffs measured, the baseline first.
const HANDOVERS: [Handover; 4] = [
    Handover::Plain,
    Handover::WriterToReader,
    Handover::ReaderToWriter,
    Handover::Permit {
        permits: HANDOFF_PERMITS,
    },
];

fn handover_name(h: Handover) -> &'static str {
    match h {
        Handover::Plain => "plain → plain",
        Handover::WriterToReader => "writer → reader",
        Handover::ReaderToWriter => "reader → writer",
        Handover::Permit { .. } => "permit → permit seeker",
    }
}

/// How much a run measures.
#[derive(Clone, Copy, Debug)]
struct Plan {
    c1: Runs,
    high: Runs,
    /// Batches of handoffs per (backend, handoff), interleaved, and
    /// handoffs per batch.
    handoff_batches: usize,
    handoffs_per_batch: usize,
}

impl Plan {
    fn full() -> Plan {
        Plan {
            c1: Runs {
                rounds: 6,
                pairs: 500,
                warmup: 50,
            },
            high: Runs {
                rounds: 4,
                pairs: 1_500,
                warmup: 150,
            },
            handoff_batches: 5,
            handoffs_per_batch: 5,
        }
    }

    fn quick() -> Plan {
        Plan {
            c1: Runs {
                rounds: 2,
                pairs: 50,
                warmup: 10,
            },
            high: Runs {
                rounds: 2,
                pairs: 200,
                warmup: 20,
            },
            handoff_batches: 1,
            handoffs_per_batch: 2,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "dlock's semaphores and read-write locks against the same scripts and transactions \
             by hand, and their handoffs against the plain lock's, as ratios.\n\
             usage: cargo bench -p dlock-tests --all-features --bench hold_modes [-- [--quick] [WORD...]]\n\
             Starts Redis on 127.0.0.1:{REDIS_PORT}, PostgreSQL 15 on 127.0.0.1:{PG_PORT} and \
             MariaDB on 127.0.0.1:{MARIADB_PORT} (fresh, under target/bench-hold-modes/; \
             taskset for the pinned section); ZooKeeper from DLOCK_TEST_ZK_URL. \
             --quick (or DLOCK_BENCH_QUICK=1): every section briefly, to check that it works. \
             Words select: `pairs`, `handoff` (the sections; both by default), and any other \
             word the handoff backends whose name contains it (e.g. `-- handoff zookeeper`)."
        );
        return Ok(());
    }
    if let Some(at) = args.iter().position(|a| a == "--pinned-c1") {
        // All of the client on one thread: the process is pinned to one CPU.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_keep_alive(Duration::from_secs(24 * 3600))
            .build()?;
        return runtime.block_on(pairs::pinned_child(&args[at + 1..]));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        // No thread may exit while the client's CPU time is summed over them.
        .thread_keep_alive(Duration::from_secs(24 * 3600))
        .build()?;
    let quick = args.iter().any(|a| a == "--quick")
        || std::env::var("DLOCK_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let plan = if quick { Plan::quick() } else { Plan::full() };
    let selection = Selection::parse(&args[1..])?;
    runtime.block_on(bench(plan, quick, &selection))
}

/// What a run measures, from the words of its command line.
struct Selection {
    /// Section 1.
    pairs: bool,
    /// Section 2, on these backends of [`HANDOFF_BACKENDS`].
    handoff: Vec<&'static HandoffBackend>,
}

impl Selection {
    /// `args` without the program's name; flags (`--quick`, and `--bench`,
    /// which `cargo bench` passes) are not words.
    fn parse(args: &[String]) -> anyhow::Result<Selection> {
        if let Some(flag) = args
            .iter()
            .find(|a| a.starts_with('-') && *a != "--quick" && *a != "--bench")
        {
            anyhow::bail!("unknown flag {flag:?} (--quick, --help)");
        }
        let words: Vec<String> = args
            .iter()
            .filter(|a| !a.starts_with('-'))
            .map(|a| a.to_lowercase())
            .collect();
        let (sections, backends): (Vec<&String>, Vec<&String>) =
            words.iter().partition(|w| *w == "pairs" || *w == "handoff");
        for word in &backends {
            anyhow::ensure!(
                HANDOFF_BACKENDS
                    .iter()
                    .any(|b| b.name.to_lowercase().contains(word.as_str())),
                "{word:?} names no section (pairs, handoff) and no handoff backend ({})",
                HANDOFF_BACKENDS
                    .iter()
                    .map(|b| b.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let section = |name: &str| sections.is_empty() || sections.iter().any(|s| *s == name);
        anyhow::ensure!(
            backends.is_empty() || section("handoff"),
            "{backends:?} select handoff backends, but the handoff section is not selected"
        );
        let handoff = if section("handoff") {
            HANDOFF_BACKENDS
                .iter()
                .filter(|b| {
                    let name = b.name.to_lowercase();
                    backends.is_empty() || backends.iter().any(|w| name.contains(w.as_str()))
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(Selection {
            pairs: section("pairs"),
            handoff,
        })
    }

    /// Whether a selected part uses the benchmark's own servers.
    fn needs_own_servers(&self) -> bool {
        self.pairs || self.handoff.iter().any(|b| b.own_server)
    }
}

/// The benchmark's own servers, running; stopped when dropped.
struct OwnServers {
    servers: Servers,
    redis: OwnRedis,
    pg: OwnServer,
    my: OwnServer,
    sqlite: PathBuf,
}

impl OwnServers {
    async fn start() -> anyhow::Result<OwnServers> {
        anyhow::ensure!(
            on_path("redis-server"),
            "redis-server is not on PATH: scripts/servers.sh up installs it"
        );
        // A server left on the port would answer in place of ours.
        std::net::TcpListener::bind(("127.0.0.1", REDIS_PORT)).map_err(|e| {
            anyhow::anyhow!("port {REDIS_PORT} is taken ({e}): is another benchmark running?")
        })?;
        let root = servers_root()?;
        let redis = OwnRedis::start(REDIS_PORT, &[]).await;
        let pg = OwnServer::postgres(PG_PORT, &root).await?;
        let my = OwnServer::mariadb(MARIADB_PORT, &root).await?;
        let sqlite = root.join("hold-modes.db");
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", sqlite.display()));
        }
        let servers = Servers {
            redis: redis.url(),
            postgres: pg.url(),
            mariadb: my.url(),
            sqlite: format!("sqlite://{}", sqlite.display()),
            redis_pid: redis
                .pid()
                .ok_or_else(|| anyhow::anyhow!("the Redis server is not running"))?,
            postgres_pid: pg.pid()?,
            mariadb_pid: my.pid()?,
        };
        Ok(OwnServers {
            servers,
            redis,
            pg,
            my,
            sqlite,
        })
    }
}

/// `target/bench-hold-modes/`, absolute, without `..`.
fn servers_root() -> anyhow::Result<PathBuf> {
    let root = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("bench-hold-modes");
    std::fs::create_dir_all(&root)?;
    Ok(root.canonicalize()?)
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

async fn bench(plan: Plan, quick: bool, selection: &Selection) -> anyhow::Result<()> {
    let load_at_start = load();
    let own = if selection.needs_own_servers() {
        Some(OwnServers::start().await?)
    } else {
        None
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
    if let Some(own) = &own {
        writeln!(
            out,
            "Servers of the benchmark's own: Redis on 127.0.0.1:{}, PostgreSQL on \
             127.0.0.1:{}, MariaDB on 127.0.0.1:{}; SQLite at {}.\n",
            own.redis.port(),
            own.pg.port(),
            own.my.port(),
            own.sqlite.display()
        )?;
    }
    if quick {
        writeln!(
            out,
            "**Quick mode**: every section briefly, to check that the benchmark works; \
             these figures are not for reading.\n"
        )?;
    }

    let mut targets = Vec::new();
    // 1. Pairs: concurrency 1 pinned (in a child, before this process opens
    // any connection), then the high concurrency unpinned (here).
    if selection.pairs {
        let servers = &own
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("section 1 runs without its servers"))?
            .servers;
        let (c1, pinned) = concurrency_1(servers, run, plan.c1)?;
        let c = Contenders::connect(servers, run).await?;
        let high = pairs::rounds(&c, HIGH_CONCURRENCY, plan.high).await?;
        let c1_label = if pinned {
            format!("c=1, pinned to CPU {PINNED_CPU} (client and servers)")
        } else {
            "c=1 (unpinned, not gated)".to_owned()
        };
        let high_label = format!("c={HIGH_CONCURRENCY}, unpinned (both CPUs)");
        let load_after_pairs = load();
        pairs_table(
            &mut out,
            &[(c1_label, pinned, c1), (high_label, true, high)],
            plan,
            &mut targets,
        )?;
        writeln!(out, "\nLoad average after section 1: {load_after_pairs}.")?;
    }

    // 2. Handoffs.
    if !selection.handoff.is_empty() {
        handoff_section(
            &mut out,
            &selection.handoff,
            own.as_ref().map(|o| &o.servers),
            run,
            plan,
            &mut targets,
        )
        .await?;
    }

    writeln!(out, "\n## Targets\n")?;
    for (ok, line) in &targets {
        writeln!(out, "- {} {line}", tick(*ok))?;
    }
    writeln!(
        out,
        "\nLoad average (1, 5, 15 min) at the start: {load_at_start}; at the end: {}. \
         The machine's other load slows wall-clock figures; CPU per pair is the figure \
         it disturbs least.",
        load()
    )?;
    print!("{out}");
    drop(own);
    Ok(())
}

/// Section 1 at concurrency 1, in a child of this program pinned with the
/// servers to [`PINNED_CPU`] when `taskset` is there. Answers its samples
/// and whether it ran pinned.
fn concurrency_1(servers: &Servers, run: u64, runs: Runs) -> anyhow::Result<(Samples, bool)> {
    let mut args = vec![
        "--pinned-c1".to_owned(),
        run.to_string(),
        runs.rounds.to_string(),
        runs.pairs.to_string(),
        runs.warmup.to_string(),
    ];
    args.extend(servers.args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let child = run_pinned_child(
        PINNED_CPU,
        || {
            let mut pids = vec![servers.redis_pid, servers.mariadb_pid];
            pids.extend(process_tree(servers.postgres_pid)?);
            PinnedServer::pin_all(&pids, PINNED_CPU)
        },
        &args,
    )?;
    let mut samples = Vec::new();
    for line in child.output.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields.as_slice() {
            ["sample", round, who, rest @ ..] => {
                samples.push((
                    round.parse()?,
                    Who::from_id(who)?,
                    PairSample::decode(rest)?,
                ));
            }
            _ => anyhow::bail!("unexpected line from the concurrency-1 child: {line:?}"),
        }
    }
    anyhow::ensure!(
        samples.len() == runs.rounds * Who::all().len(),
        "the concurrency-1 child reported {} runs",
        samples.len()
    );
    Ok((samples, child.pinned))
}

/// (round, contender, sample) of every run of a section.
type Samples = Vec<(usize, Who, PairSample)>;

/// A section's label, whether its targets are judged, and its samples.
type Section = (String, bool, Samples);

/// Section 1's table: each (backend, mode), dlock against by hand.
fn pairs_table(
    out: &mut String,
    sections: &[Section],
    plan: Plan,
    targets: &mut Vec<(bool, String)>,
) -> anyhow::Result<()> {
    writeln!(
        out,
        "## Acquire+release pairs: dlock against the same scripts / transactions by hand\n"
    )?;
    writeln!(
        out,
        "| concurrency | backend, mode | dlock pairs/s | by hand pairs/s | ratio (≥ {TARGET_PAIRS_VS_HAND}) | client CPU µs/pair, dlock / by hand | server CPU µs/pair, dlock / by hand | waiting for a CPU µs/pair, client / server (dlock) |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|")?;
    for (label, gated, samples) in sections {
        for (store, read) in Who::PAIRS {
            let ours = Who {
                store,
                read,
                dlock: true,
            };
            let hand = Who {
                dlock: false,
                ..ours
            };
            let m = |who: Who, f: fn(&PairSample) -> f64| median_of(samples, &who, f);
            let ratio = m(ours, |s| s.pairs_per_s) / m(hand, |s| s.pairs_per_s);
            let ok = ratio >= TARGET_PAIRS_VS_HAND;
            writeln!(
                out,
                "| {label} | {}, {} | {:.0} | {:.0} | {ratio:.2}× {} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} |",
                store.name(),
                ours.mode(),
                m(ours, |s| s.pairs_per_s),
                m(hand, |s| s.pairs_per_s),
                if *gated { tick(ok) } else { "(not gated)" },
                m(ours, |s| s.client_us),
                m(hand, |s| s.client_us),
                m(ours, |s| s.server_us),
                m(hand, |s| s.server_us),
                m(ours, |s| s.client_wait_us),
                m(ours, |s| s.server_wait_us),
            )?;
            if *gated {
                targets.push((
                    ok,
                    format!(
                        "{}, {}, {label}: dlock {ratio:.2}× by hand (target ≥ {TARGET_PAIRS_VS_HAND}×)",
                        store.name(),
                        ours.mode()
                    ),
                ));
            }
        }
    }
    writeln!(
        out,
        "\n{} interleaved rounds (order rotated each round) after a warm-up; {} pairs per run \
         at c=1, {} at c={HIGH_CONCURRENCY}; medians. CPU per pair measured around each run \
         only; SQLite's server CPU is in the client's (it runs in the process). Waiting for a \
         CPU: time runnable but not running (schedstat), the machine's other load.",
        plan.c1.rounds, plan.c1.pairs, plan.high.pairs
    )?;
    Ok(())
}

/// A backend of the handoff section, connected: the holder's and the
/// waiter's registries.
struct Connected {
    name: &'static str,
    holder: Registry,
    waiter: Registry,
    /// What it does not offer, by handoff.
    refused: Vec<(Handover, String)>,
}

async fn connect_handoff(
    b: &HandoffBackend,
    servers: Option<&Servers>,
) -> Result<Connected, String> {
    let url = (b.url)(servers)?;
    let connect = async || {
        dlock_runtime::connect(&url)
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))
    };
    let holder_backend: Arc<dyn LockBackend> = connect().await?;
    // The memory backend is one instance in a process: share it.
    let waiter_backend = if url.starts_with("memory:") {
        holder_backend.clone()
    } else {
        connect().await?
    };
    let refused = HANDOVERS
        .into_iter()
        .filter_map(|h| {
            let modes = match h {
                Handover::Plain => vec![],
                Handover::WriterToReader | Handover::ReaderToWriter => vec![HoldMode::Shared],
                Handover::Permit { permits } => vec![HoldMode::Permit { permits }],
            };
            modes
                .into_iter()
                .find_map(|m| holder_backend.offers(m).err())
                .map(|why| (h, why))
        })
        .collect();
    Ok(Connected {
        name: b.name,
        holder: Registry::builder().default_backend(holder_backend).build(),
        waiter: Registry::builder().default_backend(waiter_backend).build(),
        refused,
    })
}

/// Section 2: the handoffs of `backends` (of [`HANDOFF_BACKENDS`]).
async fn handoff_section(
    out: &mut String,
    backends: &[&'static HandoffBackend],
    servers: Option<&Servers>,
    run: u64,
    plan: Plan,
    targets: &mut Vec<(bool, String)>,
) -> anyhow::Result<()> {
    let mut connected = Vec::new();
    let mut skipped = Vec::new();
    for b in backends {
        match connect_handoff(b, servers).await {
            Ok(c) => connected.push(c),
            Err(why) => skipped.push((b.name, why)),
        }
    }
    // (backend, handoff) → every handoff, ms.
    let mut all: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); HANDOVERS.len()]; connected.len()];
    for batch in 0..plan.handoff_batches {
        for (b, backend) in connected.iter().enumerate() {
            let mut order: Vec<usize> = (0..HANDOVERS.len()).collect();
            order.rotate_left(batch % HANDOVERS.len());
            for h in order {
                let handover = HANDOVERS[h];
                if backend.refused.iter().any(|(r, _)| *r == handover) {
                    continue;
                }
                let handoffs = measure_handover(
                    &backend.holder,
                    &backend.waiter,
                    handover,
                    plan.handoffs_per_batch,
                    |round| format!("hm-handoff:{run}:{b}:{h}:{batch}:{round}"),
                    SETTLE,
                )
                .await;
                all[b][h].extend(handoffs.0.iter().map(|d| d.as_secs_f64() * 1000.0));
            }
        }
    }

    writeln!(
        out,
        "\n## Handoff: a holder's release to a waiting contender's grant\n"
    )?;
    writeln!(
        out,
        "| backend | {} ms (baseline) | {} ms (× baseline) | {} ms (× baseline) | {} ({HANDOFF_PERMITS} permits, both held) ms (× baseline) |",
        handover_name(HANDOVERS[0]),
        handover_name(HANDOVERS[1]),
        handover_name(HANDOVERS[2]),
        handover_name(HANDOVERS[3]),
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|")?;
    for (b, backend) in connected.iter().enumerate() {
        let base = median(all[b][0].clone());
        let mut row = format!("| {} | {base:.2} |", backend.name);
        for (h, handover) in HANDOVERS.iter().enumerate().skip(1) {
            if let Some((_, why)) = backend.refused.iter().find(|(r, _)| r == handover) {
                write!(row, " not offered: {why} |")?;
                continue;
            }
            let ms = median(all[b][h].clone());
            let ratio = ms / base;
            let ok = ratio <= TARGET_HANDOFF_VS_PLAIN;
            write!(row, " {ms:.2} ({ratio:.2}× {}) |", tick(ok))?;
            targets.push((
                ok,
                format!(
                    "{} handoff {}: {ratio:.2}× plain → plain (target ≤ {TARGET_HANDOFF_VS_PLAIN}×)",
                    backend.name,
                    handover_name(*handover)
                ),
            ));
        }
        writeln!(out, "{row}")?;
    }
    for (name, why) in &skipped {
        writeln!(out, "| {name} | skipped: {why} | | | |")?;
    }
    writeln!(
        out,
        "\n{} handoffs per (backend, handoff) in {} interleaved batches (order rotated each \
         batch), the waiter waiting {} ms before each release; medians.",
        plan.handoff_batches * plan.handoffs_per_batch,
        plan.handoff_batches,
        SETTLE.as_millis()
    )?;
    Ok(())
}
