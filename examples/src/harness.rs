//! `quickstart`'s harness: worker processes that call the locked function,
//! and the coordinator that starts them and judges the outcome.
//!
//! ```sh
//! cargo run --example quickstart                  # 4 worker processes × 25 rounds
//! cargo run --example quickstart -- --kill-one    # SIGKILL one worker while it holds the lock
//! cargo run --example quickstart -- --workers 6 --rounds 40
//! ```
//!
//! Run without arguments, the program is the *coordinator*: it creates a
//! [`Counter`] store in a temporary directory and starts `--workers` copies of
//! itself (`quickstart worker <n> --rounds M --store PATH`, see
//! [`crate::copies`]). Each worker calls the locked function `--rounds` times,
//! with a short pause between rounds that gives the others their turns. The
//! store prints what happens ([`Event`] lines); the coordinator reads them, and
//! prints one line per worker and a verdict:
//!
//! - the increments the workers made, against the counter's value in the
//!   store (no lost update);
//! - how often a worker found another live worker inside the
//!   read-modify-write (no overlap);
//! - how many writes the store refused for a stale fencing token.
//!
//! With `--kill-one`, once a quarter of the rounds are done, the coordinator
//! kills a worker (SIGKILL, no clean-up) while it holds the lock, and checks
//! that another worker gets the lock within the lease (plus a poll of the
//! waiters), and that the dead worker's mark is then replaced, not counted as
//! an overlap.
//!
//! [`run`] returns `Ok(true)` only if no increment was lost, no two live
//! workers were inside at once, every worker but a killed one finished, and
//! after a kill the lock came back in time.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::Args;
use crate::copies::Copies;
use crate::counter::{Counter, Event, Holder, State};

const USAGE: &str = "quickstart [--workers N (4)] [--rounds M (25)] [--kill-one]";

/// Runs this process's part of the quickstart, as the command line says: a
/// worker that calls `bump` on the store, or the coordinator. `url` is the lock
/// backend, already installed with `dlock_runtime::init`; `lease` is the lease
/// of `bump`'s lock, which bounds how long a killed holder blocks the others.
///
/// An error from `bump` ends the worker, unless it comes from a write that the
/// store refused for a stale fencing token: the store doing its job.
///
/// Returns `Ok(false)` if the verdict failed.
pub async fn run<T, E>(
    url: &str,
    lease: Duration,
    bump: impl AsyncFn(&Counter) -> Result<T, E>,
) -> anyhow::Result<bool>
where
    E: std::error::Error + Send + Sync + 'static,
{
    match parse_args()? {
        Role::Worker { id, rounds, store } => {
            let store = Counter::open(store, id);
            for _ in 0..rounds {
                if let Err(err) = bump(&store).await
                    && !store.last_write_refused()
                {
                    return Err(err).context(format!("worker {id}"));
                }
                tokio::time::sleep(Duration::from_millis(rand::random_range(0..10))).await;
            }
            Ok(true)
        }
        Role::Coordinator(opts) => coordinate(url, lease, opts).await,
    }
}

/// What this process is.
enum Role {
    Coordinator(Options),
    Worker {
        id: u32,
        rounds: u32,
        store: PathBuf,
    },
}

/// The coordinator's options.
struct Options {
    workers: u32,
    rounds: u32,
    kill_one: bool,
}

fn parse_args() -> anyhow::Result<Role> {
    let mut args = Args::from_env(USAGE);
    let (mut worker, mut store) = (None, None);
    let mut opts = Options {
        workers: 4,
        rounds: 25,
        kill_one: false,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "worker" => worker = Some(args.value("worker")?),
            "--store" => store = Some(args.value::<PathBuf>("--store")?),
            "--workers" => opts.workers = args.value("--workers")?,
            "--rounds" => opts.rounds = args.value("--rounds")?,
            "--kill-one" => opts.kill_one = true,
            other => return Err(args.unknown(other)),
        }
    }
    if let Some(id) = worker {
        let store = store.context("a worker needs --store PATH")?;
        let rounds = opts.rounds;
        return Ok(Role::Worker { id, rounds, store });
    }
    if opts.workers == 0 || opts.rounds == 0 {
        bail!("--workers and --rounds must be at least 1");
    }
    if opts.kill_one && opts.workers < 2 {
        bail!("--kill-one needs at least 2 workers: one to kill, one to go on");
    }
    Ok(Role::Coordinator(opts))
}

/// What the coordinator learned about one worker from the store's lines.
#[derive(Debug, Default)]
struct WorkerStats {
    /// Tokens it held, in order.
    tokens: Vec<u64>,
    /// Tokens of its accepted writes (one increment each).
    wrote: BTreeSet<u64>,
    /// Writes the store refused.
    refused: u32,
}

impl WorkerStats {
    fn rounds(&self) -> usize {
        self.wrote.len() + self.refused as usize
    }
}

/// The worker killed by `--kill-one`.
struct Killed {
    /// The worker and the token it was seen holding.
    victim: Holder,
    at: Instant,
    /// The next holder, and how long after the kill it got the lock.
    next: Option<(Holder, Duration)>,
}

/// Everything the coordinator observed during a run.
#[derive(Default)]
struct Observed {
    stats: BTreeMap<u32, WorkerStats>,
    /// Accepted writes so far.
    increments: u32,
    killed: Option<Killed>,
    /// Two live workers inside at once: (the one entering, the one it found).
    overlaps: Vec<(Holder, Holder)>,
    /// The killed worker's mark, found by the next holder.
    stale_marks: Vec<(Holder, Holder)>,
    /// Workers that exited with an error (a killed one aside).
    failed: Vec<String>,
}

impl Observed {
    /// Takes one event into account.
    fn record(&mut self, event: Event, lease: Duration) {
        match event {
            Event::Holds(me) => {
                self.stats
                    .entry(me.worker)
                    .or_default()
                    .tokens
                    .push(me.token);
                if let Some(k) = &mut self.killed
                    && k.next.is_none()
                    && me.worker != k.victim.worker
                {
                    k.next = Some((me, k.at.elapsed()));
                    println!(
                        "  worker {} got the lock {:.2} s later, with token {} (the lease is {} s)",
                        me.worker,
                        k.at.elapsed().as_secs_f64(),
                        me.token,
                        lease.as_secs_f64()
                    );
                }
            }
            Event::FoundInside { me, other } => match &self.killed {
                // The dead worker's mark, found by the next holder: a stale
                // holder cleaned up, not two workers inside at once.
                Some(k) if other.worker == k.victim.worker && other.token >= k.victim.token => {
                    self.stale_marks.push((me, other));
                }
                _ => self.overlaps.push((me, other)),
            },
            Event::Wrote { me, .. } => {
                self.stats
                    .entry(me.worker)
                    .or_default()
                    .wrote
                    .insert(me.token);
                self.increments += 1;
            }
            Event::Refused { me } => self.stats.entry(me.worker).or_default().refused += 1,
        }
    }

    fn was_killed(&self, worker: u32) -> bool {
        self.killed
            .as_ref()
            .is_some_and(|k| k.victim.worker == worker)
    }
}

/// Starts the workers, reads the store's lines, prints the verdict.
async fn coordinate(url: &str, lease: Duration, opts: Options) -> anyhow::Result<bool> {
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("dlock-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("counter.txt");
    Counter::create(&path)?;
    let store = Counter::open(path.clone(), 0);

    println!("dlock quickstart");
    println!("  backend  {url}");
    println!(
        "  lock     `bump` in examples/quickstart.rs (lease {} s)",
        lease.as_secs_f64()
    );
    println!(
        "  {} worker processes × {} rounds of: read the counter, work 10–30 ms, write it + 1",
        opts.workers, opts.rounds
    );
    println!();

    let rounds = opts.rounds.to_string();
    let mut workers = Copies::start(
        url,
        (1..=opts.workers).map(|id| {
            let id_arg = id.to_string();
            let args = ["worker", &id_arg, "--rounds", &rounds, "--store"].map(String::from);
            (id, args.into_iter().chain([path.display().to_string()]))
        }),
    )?;

    let mut seen = Observed::default();
    while let Some((id, line)) = workers.next_line().await {
        let Some(event) = Event::parse(&line) else {
            println!("  worker {id}: {line}");
            continue;
        };
        seen.record(event, lease);
        // Kill a holder once a quarter of the rounds are done.
        if let Event::Holds(me) = event
            && opts.kill_one
            && seen.killed.is_none()
            && seen.increments >= opts.workers * opts.rounds / 4
        {
            workers.kill(me.worker).await?;
            let at = Instant::now();
            println!(
                "  killed worker {} (SIGKILL) while it held the lock with token {}",
                me.worker, me.token
            );
            // Its last write may have reached the store just before it could
            // print it: nobody else can write until its lease runs out, so the
            // store tells.
            if let Some(last) = store.state()?.last_write
                && last.worker == me.worker
            {
                let stats = seen.stats.entry(me.worker).or_default();
                stats.wrote.insert(last.token);
            }
            seen.killed = Some(Killed {
                victim: me,
                at,
                next: None,
            });
        }
    }

    // Every worker but the killed one must have finished cleanly.
    for (id, status) in workers.wait().await? {
        if !status.success() && !seen.was_killed(id) {
            seen.failed
                .push(format!("worker {id} exited with {status}"));
        }
    }
    let state = store.state()?;
    let _ = std::fs::remove_dir_all(&dir);

    print_workers(&mut seen, &opts);
    let passed = print_verdict(&seen, &opts, &state, lease);
    println!();
    println!(
        "{} in {:.1} s",
        if passed { "PASS" } else { "FAIL" },
        started.elapsed().as_secs_f64()
    );
    Ok(passed)
}

/// Prints one line per worker: its rounds, increments and fencing tokens.
fn print_workers(seen: &mut Observed, opts: &Options) {
    if seen.killed.is_some() {
        println!();
    }
    println!("worker  rounds        increments  fencing tokens");
    for id in 1..=opts.workers {
        let killed = seen.was_killed(id);
        let s = seen.stats.entry(id).or_default();
        let mut rounds = s.rounds().to_string();
        if killed {
            rounds.push_str(" (killed)");
        }
        let tokens = match (s.tokens.first(), s.tokens.last()) {
            (Some(first), Some(last)) => format!("{first}..{last}"),
            _ => "-".to_owned(),
        };
        println!("{id:>6}  {rounds:<12}  {:>10}  {tokens}", s.wrote.len());
    }
    println!();
}

/// Prints the verdict, one line per check (`ok`/`FAIL` where it decides the
/// outcome); true if every check passed.
fn print_verdict(seen: &Observed, opts: &Options, state: &State, lease: Duration) -> bool {
    let line = |ok: Option<bool>, what: &str, value: String, note: &str| {
        let mark = match ok {
            Some(true) => "ok",
            Some(false) => "FAIL",
            None => "",
        };
        println!("{mark:<4}  {what:<28}  {value:>6}  {note}");
    };
    let expected: usize = seen.stats.values().map(|s| s.wrote.len()).sum();
    let done: usize = seen.stats.values().map(WorkerStats::rounds).sum();
    let unfinished = opts.workers as usize * opts.rounds as usize - done;
    let no_lost_update = expected as u64 == state.row.value;
    let no_overlap = seen.overlaps.is_empty();

    let why = match &seen.killed {
        Some(k) => format!(
            "{} × {} rounds, minus the {unfinished} that killed worker {} never ran",
            opts.workers, opts.rounds, k.victim.worker
        ),
        None => format!("{} × {} rounds", opts.workers, opts.rounds),
    };
    line(
        None,
        "increments made by workers",
        expected.to_string(),
        &why,
    );
    let note = if no_lost_update {
        "no update was lost"
    } else {
        "the counter disagrees: updates were lost"
    };
    line(
        Some(no_lost_update),
        "counter value in the store",
        state.row.value.to_string(),
        note,
    );
    line(
        Some(no_overlap),
        "overlapping holders",
        seen.overlaps.len().to_string(),
        "times two live workers were inside `bump` at once",
    );
    for (me, other) in seen.overlaps.iter().take(5) {
        println!("        {me} found {other} inside");
    }
    if seen.overlaps.len() > 5 {
        println!("        … and {} more", seen.overlaps.len() - 5);
    }
    line(
        None,
        "stale writes refused",
        state.stale_refused.to_string(),
        "writes with an out-of-date fencing token (from a holder whose lease ran out)",
    );

    let mut resumed = true;
    if let Some(k) = &seen.killed {
        let note = match seen.stale_marks.first() {
            Some((me, other)) => format!("{me} replaced the mark of dead {other}"),
            None => format!("worker {} died after clearing its mark", k.victim.worker),
        };
        line(
            None,
            "dead holder's mark replaced",
            seen.stale_marks.len().to_string(),
            &note,
        );
        // The next holder gets the lock when the dead one's lease runs out: at
        // most the lease after its last renewal, plus a poll of the waiters.
        match k.next {
            Some((next, stall)) => {
                resumed = stall <= lease + Duration::from_millis(750);
                line(
                    Some(resumed),
                    "lock back after the kill",
                    format!("{:.2} s", stall.as_secs_f64()),
                    &format!(
                        "worker {} went on; the lease is {} s",
                        next.worker,
                        lease.as_secs_f64()
                    ),
                );
            }
            None => {
                resumed = false;
                line(Some(false), "lock back after the kill", "never".into(), "");
            }
        }
    }
    for failure in &seen.failed {
        line(Some(false), "worker failed", String::new(), failure);
    }
    no_lost_update && no_overlap && resumed && seen.failed.is_empty()
}
