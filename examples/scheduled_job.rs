//! # scheduled_job: a job every replica schedules, run once per tick
//!
//! ```sh
//! cargo run --example scheduled_job                 # 3 replicas, 5 ticks
//! cargo run --example scheduled_job -- --ticks 10
//! ```
//!
//! Like a service deployed as three replicas, each with the same timer, this
//! program starts three processes of itself (`scheduled_job replica <n>`) that
//! all call [`nightly_report`] once a second. The tick is the wall-clock second
//! since the UNIX epoch, so the replicas agree on it without talking to each
//! other, and the lock's key contains it: `report:{tick}`. The first replica to
//! fire takes the lock and runs the job; the others find it busy and, with
//! `on_busy = "skip"`, return at once without running it.
//!
//! To show that this, and not luck, makes each tick run once, the replicas'
//! timers fire 50 ms apart within each second (in an order that rotates every
//! tick, so each replica gets to win), while the job itself takes ~30 ms: the
//! first replica has **finished** before the later ones fire. That is what
//! `hold_at_least = "900ms"` is for. Without it, the winner would release
//! `report:{tick}` as it returns, the replica firing 50 ms later would find the
//! key free and run the same tick a second time. With it, releasing leaves the
//! key held until 900 ms after the job ended (as a lease that expires on the
//! backend, not a sleep in the caller), longer than the spread of the
//! replicas' timers. The next tick is a different key, so holding this one
//! delays nothing. (Pick `hold_at_least` above the clock skew and timer jitter
//! between replicas, and below the interval, as ShedLock's `lockAtLeastFor`.)
//!
//! Each replica prints `replica 1 tick 1732350000: ran` or `…: skipped`; the
//! coordinator prints one line per tick and exits with 0 only if every tick
//! ran exactly once.
//!
//! The lock backend comes from `DLOCK_URL` (default: a SQLite file in the
//! workspace's `target/` directory). It must be shared between processes, so
//! `memory://` (a lock inside one process) is refused.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use dlock_examples::Args;
use dlock_examples::copies::Copies;
use dlock_runtime::{LockError, Registry, distributed_lock};

/// How many replicas the coordinator starts.
const REPLICAS: u32 = 3;

/// How far apart, within a second, the replicas' timers fire.
const SPREAD: Duration = Duration::from_millis(50);

// ---------------------------------------------------------------------------
// The job: this is the part to copy.
// ---------------------------------------------------------------------------

/// What a run of the job produced.
#[derive(Debug)]
struct Report {
    /// When the report was done.
    done_at: SystemTime,
}

/// The job every replica schedules. Returns `Ok(None)` when skipped.
///
/// With `on_busy = "skip"`, a busy lock returns the return type's "skipped"
/// value instead of an error: `Ok(None)` for `Result<Option<T>, E>`, as here,
/// so that the caller can tell a skip from a run. `Result<(), E>` works too,
/// when the caller does not need to know (the skip is then `Ok(())`).
#[distributed_lock(
    key = "report:{tick}",
    on_busy = "skip",
    hold_at_least = "900ms",
    lease = "10s"
)]
async fn nightly_report(tick: u64) -> Result<Option<Report>, AppError> {
    tracing::debug!(tick, "building the report");
    tokio::time::sleep(Duration::from_millis(30)).await; // the work: short
    Ok(Some(Report {
        done_at: SystemTime::now(),
    }))
}

/// What can go wrong in the job.
#[derive(Debug, thiserror::Error)]
enum AppError {
    /// The lock backend failed (a busy lock is a skip, not an error).
    #[error(transparent)]
    Lock(#[from] LockError),
}

// ---------------------------------------------------------------------------
// A replica: `scheduled_job replica <n> --from <tick> --ticks <N>`.
// ---------------------------------------------------------------------------

/// Runs the schedule of replica `replica`: ticks `from..from + ticks`.
async fn replica(replica: u32, from: u64, ticks: u64) -> anyhow::Result<()> {
    for tick in from..from + ticks {
        // Each replica fires at its own offset into the second; the order
        // rotates with the tick.
        let second = UNIX_EPOCH + Duration::from_secs(tick);
        let offset = SPREAD * u32::try_from((u64::from(replica) + tick) % u64::from(REPLICAS))?;
        sleep_until(second + offset).await;
        // Milliseconds into the tick's second, to show when things happened.
        let ms = |t: SystemTime| t.duration_since(second).unwrap_or_default().as_millis();
        let fired = ms(SystemTime::now());
        match nightly_report(tick).await? {
            Some(report) => println!(
                "replica {replica} tick {tick}: ran (+{fired} to +{} ms)",
                ms(report.done_at)
            ),
            None => println!("replica {replica} tick {tick}: skipped (+{fired} ms)"),
        }
    }
    Ok(())
}

/// Sleeps until the wall clock reads `at` (returns at once if it is past).
async fn sleep_until(at: SystemTime) {
    let left = at.duration_since(SystemTime::now()).unwrap_or_default();
    tokio::time::sleep(left).await;
}

// ---------------------------------------------------------------------------
// The coordinator: starts the replicas, collects their lines, judges.
// ---------------------------------------------------------------------------

/// What the replicas reported for one tick.
#[derive(Debug, Default)]
struct TickOutcome {
    /// The replicas that ran the job, with what they printed.
    ran: Vec<(u64, String)>,
    /// The replicas that skipped it, with what they printed.
    skipped: Vec<(u64, String)>,
}

/// Parses `replica 2 tick 1732350000: ran (+0 to +31 ms)`.
fn parse_line(line: &str) -> Option<(u64, u64, &str)> {
    let rest = line.strip_prefix("replica ")?;
    let (replica, rest) = rest.split_once(" tick ")?;
    let (tick, outcome) = rest.split_once(": ")?;
    Some((replica.parse().ok()?, tick.parse().ok()?, outcome))
}

async fn coordinate(url: &str, ticks: u64) -> anyhow::Result<bool> {
    let started = Instant::now();
    // The first tick: the next second that leaves the replicas ≥ 0.7 s to start.
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
    let from = (now + Duration::from_millis(700)).as_secs() + 1;

    println!("dlock scheduled_job");
    println!("  backend  {url}");
    println!(
        r#"  lock     #[distributed_lock(key = "report:{{tick}}", on_busy = "skip", hold_at_least = "900ms", lease = "10s")]"#
    );
    println!(
        "  {REPLICAS} replica processes call `nightly_report(tick)` every second for {ticks} ticks, \
         {} ms apart within the second; the job takes ~30 ms",
        SPREAD.as_millis()
    );
    println!();

    let (from_arg, ticks_arg) = (from.to_string(), ticks.to_string());
    let mut replicas = Copies::start(
        url,
        (1..=REPLICAS).map(|n| {
            let n_arg = n.to_string();
            let args = [
                "replica", &n_arg, "--from", &from_arg, "--ticks", &ticks_arg,
            ];
            (n, args.map(String::from))
        }),
    )?;

    let mut outcomes: BTreeMap<u64, TickOutcome> = (from..from + ticks)
        .map(|t| (t, TickOutcome::default()))
        .collect();
    let mut problems = Vec::new();
    while let Some((_, line)) = replicas.next_line().await {
        match parse_line(&line) {
            Some((replica, tick, outcome)) if outcomes.contains_key(&tick) => {
                let entry = outcomes.entry(tick).or_default();
                let (what, when) = outcome.split_once(' ').unwrap_or((outcome, ""));
                let when = when.trim_matches(['(', ')']).to_owned();
                match what {
                    "ran" => entry.ran.push((replica, when)),
                    _ => entry.skipped.push((replica, when)),
                }
            }
            _ => println!("  {line}"),
        }
    }
    for (n, status) in replicas.wait().await? {
        if !status.success() {
            problems.push(format!("replica {n} exited with {status}"));
        }
    }

    println!("tick        ran (ms into the second)   skipped (ms into the second)");
    let list = |runs: &[(u64, String)]| {
        let runs: Vec<String> = runs
            .iter()
            .map(|(replica, when)| format!("replica {replica} {when}"))
            .collect();
        if runs.is_empty() {
            "-".to_owned()
        } else {
            runs.join(", ")
        }
    };
    for (tick, outcome) in &outcomes {
        let mark = if outcome.ran.len() == 1 {
            ""
        } else {
            "  <- FAIL"
        };
        println!(
            "{tick}  {:<25}  {}{mark}",
            list(&outcome.ran),
            list(&outcome.skipped)
        );

        let reported = outcome.ran.len() + outcome.skipped.len();
        if outcome.ran.len() != 1 {
            problems.push(format!("tick {tick} ran {} times", outcome.ran.len()));
        }
        if reported != REPLICAS as usize {
            problems.push(format!(
                "tick {tick}: {reported} of {REPLICAS} replicas reported"
            ));
        }
    }
    println!();
    for problem in &problems {
        println!("FAIL  {problem}");
    }
    let passed = problems.is_empty();
    if passed {
        println!(
            "PASS: each of the {ticks} ticks ran exactly once; the other replicas skipped it ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
    } else {
        println!("FAIL ({:.1} s)", started.elapsed().as_secs_f64());
    }
    Ok(passed)
}

// ---------------------------------------------------------------------------
// Start-up.
// ---------------------------------------------------------------------------

/// What this process is.
enum Role {
    Coordinator { ticks: u64 },
    Replica { n: u32, from: u64, ticks: u64 },
}

fn parse_args() -> anyhow::Result<Role> {
    let mut args = Args::from_env("scheduled_job [--ticks N (5)]");
    let (mut replica, mut from, mut ticks) = (None, None, 5);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "replica" => replica = Some(args.value("replica")?),
            "--from" => from = Some(args.value("--from")?),
            "--ticks" => ticks = args.value("--ticks")?,
            other => return Err(args.unknown(other)),
        }
    }
    if ticks == 0 {
        bail!("--ticks must be at least 1");
    }
    Ok(match replica {
        Some(n) => Role::Replica {
            n,
            from: from.context("a replica needs --from <tick>")?,
            ticks,
        },
        None => Role::Coordinator { ticks },
    })
}

fn main() -> ExitCode {
    dlock_examples::main(async {
        let role = parse_args()?;
        let url = dlock_examples::dlock_url_between_processes()?;
        dlock_runtime::init(Registry::from_url(&url).await?)?;
        match role {
            Role::Replica { n, from, ticks } => replica(n, from, ticks).await.map(|()| true),
            Role::Coordinator { ticks } => coordinate(&url, ticks).await,
        }
    })
}
