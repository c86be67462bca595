//! # quickstart: several processes, one lock, no lost update
//!
//! ```sh
//! cargo run --example quickstart                  # 4 worker processes × 25 rounds
//! cargo run --example quickstart -- --kill-one    # SIGKILL one worker while it holds the lock
//! cargo run --example quickstart -- --workers 6 --rounds 40
//! ```
//!
//! Run without arguments, this program is the *coordinator*: it starts
//! `--workers` copies of itself (`quickstart worker <id>`), and each worker calls
//! [`bump`] `--rounds` times. `bump` is a read-modify-write of one counter kept
//! in a file: read the value, work a moment, write the value + 1. Two workers
//! doing that at once would both read 41 and both write 42, losing an update;
//! `#[distributed_lock]` makes the workers take turns, whichever process they
//! run in.
//!
//! The counter lives in a [`FencedStore`], a stand-in for a storage service
//! that checks **fencing tokens**: every acquisition of the lock carries a token
//! higher than all before it (`dlock_runtime::current()` hands it to the body),
//! and the store refuses a write whose token is lower than one it has already
//! accepted. A lease can run out under a holder that paused (GC, swap, SIGSTOP)
//! and still believes it holds the lock; its late write is then refused
//! instead of overwriting newer data. The store also keeps an "inside" mark to
//! detect two workers in `bump` at once.
//!
//! The coordinator prints one line per worker and a verdict, and exits with 0
//! only if no increment was lost and no two workers were ever inside at once.
//! With `--kill-one` it kills a worker (SIGKILL, no clean-up) while that worker
//! holds the lock, and shows that the others go on after at most the 2 s lease.
//!
//! The lock backend comes from `DLOCK_URL` (default: a SQLite file in the
//! workspace's `target/` directory). It must be shared between processes, so
//! `memory://` (a lock inside one process) is refused.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use dlock_runtime::{LockError, Registry, distributed_lock};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tracing_subscriber::EnvFilter;

/// The lease of [`bump`] (the `lease = "2s"` of its attribute): how long a
/// holder that died without releasing blocks the others at most.
const LEASE: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------
// The locked function: this is the part to copy.
// ---------------------------------------------------------------------------

/// Adds one to the counter in `store`, in one process at a time.
///
/// The lock's key is built from the argument (`quickstart:counter`); callers
/// wait up to 30 s for their turn. The lease (2 s) is renewed by the runtime's
/// watchdog while the body runs, and released when it returns, fails or panics.
#[distributed_lock(key = "quickstart:{counter}", wait = "30s", lease = "2s")]
async fn bump(counter: &str, store: &FencedStore) -> Result<u64, AppError> {
    let token = dlock_runtime::current()
        .expect("the body of a #[distributed_lock] fn holds a lock")
        .fencing_token()
        .ok_or(AppError::NoFencingToken)?;
    let me = Holder {
        worker: store.client,
        token: token.into(),
    };
    let found = store.enter(me)?;
    report(Event::Holds(me));
    if let Some(other) = found {
        // Someone's mark is still there: a holder that died inside (its lease
        // ran out, so we got the lock), or, if the lock were broken, a live one.
        report(Event::FoundInside { me, other });
    }

    let value = store.read()?.value;
    // The work between the read and the write: without the lock, another
    // worker would read the same value meanwhile and one increment would be lost.
    tokio::time::sleep(Duration::from_millis(rand::random_range(10..30))).await;
    let written = store.write(value + 1, me)?;
    store.leave(me)?;

    let value = value + 1;
    match written {
        Ok(()) => {
            report(Event::Wrote { me, value });
            Ok(value)
        }
        Err(highest) => {
            report(Event::Refused { me, value });
            Err(AppError::Fenced {
                token: me.token,
                highest,
            })
        }
    }
}

/// What can go wrong in a worker.
#[derive(Debug, thiserror::Error)]
enum AppError {
    /// The lock could not be taken (busy for 30 s, backend down, …) or was lost.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The counter file could not be read or written.
    #[error("counter store: {0}")]
    Store(#[from] io::Error),
    /// The store refused a write: a holder with a higher token wrote before.
    #[error("write with fencing token {token} refused: the store has seen token {highest}")]
    Fenced { token: u64, highest: u64 },
    /// The backend hands out no fencing tokens (Redlock).
    #[error("this example needs a lock backend with fencing tokens (every one but Redlock)")]
    NoFencingToken,
}

// ---------------------------------------------------------------------------
// The fenced store: a counter in a file, standing in for a database or service.
// ---------------------------------------------------------------------------

/// A worker inside `bump`, with the fencing token of its lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    worker: u32,
    token: u64,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {} token {}", self.worker, self.token)
    }
}

impl Holder {
    /// Parses the words of `worker 2 token 17`.
    fn from_words(words: &[&str]) -> Option<Holder> {
        match words {
            ["worker", worker, "token", token] => Some(Holder {
                worker: worker.parse().ok()?,
                token: token.parse().ok()?,
            }),
            _ => None,
        }
    }
}

/// The store's content, kept as `name value` lines in its file.
#[derive(Debug, Default)]
struct State {
    /// The counter.
    value: u64,
    /// The highest fencing token a write was accepted with.
    highest_token: u64,
    /// How many writes were refused for carrying a lower token.
    stale_refused: u64,
    /// Who is inside `bump` now (the overlap detector).
    inside: Option<Holder>,
    /// Who made the last accepted write.
    last_write: Option<Holder>,
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let holder = |h: Option<Holder>| h.map_or_else(|| "none".to_owned(), |h| h.to_string());
        writeln!(f, "value {}", self.value)?;
        writeln!(f, "highest_token {}", self.highest_token)?;
        writeln!(f, "stale_refused {}", self.stale_refused)?;
        writeln!(f, "inside {}", holder(self.inside))?;
        writeln!(f, "last_write {}", holder(self.last_write))
    }
}

impl FromStr for State {
    type Err = io::Error;

    fn from_str(text: &str) -> io::Result<State> {
        let fields: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once(' ')).collect();
        let bad = |name: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad `{name}`"));
        let number = |name: &str| {
            fields
                .get(name)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(name))
        };
        let holder = |name: &str| match fields.get(name) {
            Some(&"none") => Ok(None),
            Some(v) => Holder::from_words(&v.split(' ').collect::<Vec<_>>())
                .map(Some)
                .ok_or_else(|| bad(name)),
            None => Err(bad(name)),
        };
        Ok(State {
            value: number("value")?,
            highest_token: number("highest_token")?,
            stale_refused: number("stale_refused")?,
            inside: holder("inside")?,
            last_write: holder("last_write")?,
        })
    }
}

/// A counter in a file that refuses writes carrying a stale fencing token.
///
/// Each operation is atomic: it holds an OS file lock (`File::lock`) for the
/// few microseconds it reads and rewrites the file. That lock protects the
/// file's bytes, not the round: between `read` and `write` another worker could
/// run a whole round, and only `#[distributed_lock]` prevents it. (The calls
/// block, briefly; a real store would be an async client.)
struct FencedStore {
    path: PathBuf,
    /// The worker using this handle, recorded in the "inside" mark.
    client: u32,
}

impl FencedStore {
    /// Creates the file with a zero counter.
    fn create(path: &Path) -> io::Result<()> {
        std::fs::write(path, State::default().to_string())
    }

    /// The current state.
    fn read(&self) -> io::Result<State> {
        let mut file = File::open(&self.path)?;
        file.lock_shared()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        text.parse()
    }

    /// Reads, changes and rewrites the state under an exclusive file lock.
    fn update<R>(&self, change: impl FnOnce(&mut State) -> R) -> io::Result<R> {
        let mut file = OpenOptions::new().read(true).write(true).open(&self.path)?;
        file.lock()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let mut state: State = text.parse()?;
        let out = change(&mut state);
        file.rewind()?;
        file.set_len(0)?;
        file.write_all(state.to_string().as_bytes())?;
        Ok(out) // closing `file` releases the file lock
    }

    /// Stores `value` if `by.token` is at least the highest token seen;
    /// otherwise counts a stale write and returns that highest token.
    fn write(&self, value: u64, by: Holder) -> io::Result<Result<(), u64>> {
        self.update(|state| {
            if by.token < state.highest_token {
                state.stale_refused += 1;
                return Err(state.highest_token);
            }
            state.value = value;
            state.highest_token = by.token;
            state.last_write = Some(by);
            Ok(())
        })
    }

    /// Marks `me` as inside; returns whoever was marked inside before.
    fn enter(&self, me: Holder) -> io::Result<Option<Holder>> {
        self.update(|state| state.inside.replace(me))
    }

    /// Clears the mark if it is still `me`'s.
    fn leave(&self, me: Holder) -> io::Result<()> {
        self.update(|state| {
            if state.inside == Some(me) {
                state.inside = None;
            }
        })
    }
}

// ---------------------------------------------------------------------------
// What workers tell the coordinator: one line on stdout per event.
// ---------------------------------------------------------------------------

/// One line of a worker's stdout.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// `worker 2 token 17 holds the lock`
    Holds(Holder),
    /// `worker 2 token 17 found worker 3 token 16 inside`
    FoundInside { me: Holder, other: Holder },
    /// `worker 2 token 17 wrote 18`
    Wrote { me: Holder, value: u64 },
    /// `worker 2 token 17 was refused 18`
    Refused { me: Holder, value: u64 },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Holds(me) => write!(f, "{me} holds the lock"),
            Event::FoundInside { me, other } => write!(f, "{me} found {other} inside"),
            Event::Wrote { me, value } => write!(f, "{me} wrote {value}"),
            Event::Refused { me, value } => write!(f, "{me} was refused {value}"),
        }
    }
}

impl Event {
    fn parse(line: &str) -> Option<Event> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (me, rest) = words.split_at_checked(4)?;
        let me = Holder::from_words(me)?;
        Some(match rest {
            ["holds", "the", "lock"] => Event::Holds(me),
            [found @ .., "inside"] if found.first() == Some(&"found") => Event::FoundInside {
                me,
                other: Holder::from_words(&found[1..])?,
            },
            ["wrote", value] => Event::Wrote {
                me,
                value: value.parse().ok()?,
            },
            ["was", "refused", value] => Event::Refused {
                me,
                value: value.parse().ok()?,
            },
            _ => return None,
        })
    }
}

/// Prints `event` for the coordinator (stdout is flushed at each newline).
fn report(event: Event) {
    println!("{event}");
}

// ---------------------------------------------------------------------------
// The worker: `quickstart worker <id> --rounds M --store PATH`.
// ---------------------------------------------------------------------------

async fn worker(id: u32, rounds: u32, store: PathBuf) -> anyhow::Result<()> {
    let store = FencedStore {
        path: store,
        client: id,
    };
    for _ in 0..rounds {
        match bump("counter", &store).await {
            // A refused stale write is the store doing its job: go on.
            Ok(_) | Err(AppError::Fenced { .. }) => {}
            Err(err) => return Err(err).context(format!("worker {id}")),
        }
        // Work outside the lock gives the other workers their turns.
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..10))).await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The coordinator: starts the workers, reads their lines, judges.
// ---------------------------------------------------------------------------

/// What the coordinator learned about one worker from its lines.
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

struct Options {
    workers: u32,
    rounds: u32,
    kill_one: bool,
}

async fn coordinate(url: &str, opts: Options) -> anyhow::Result<bool> {
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("dlock-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let store = FencedStore {
        path: dir.join("counter.txt"),
        client: 0,
    };
    FencedStore::create(&store.path)?;

    println!("dlock quickstart");
    println!("  backend  {url}");
    println!(
        r#"  lock     #[distributed_lock(key = "quickstart:{{counter}}", wait = "30s", lease = "2s")]"#
    );
    println!(
        "  {} worker processes × {} rounds of: read the counter, work 10–30 ms, write it + 1",
        opts.workers, opts.rounds
    );
    println!();

    // Start the workers, and funnel their stdout lines into one channel.
    let exe = std::env::current_exe().context("locating this program")?;
    let (lines_tx, mut lines) = mpsc::unbounded_channel::<(u32, String)>();
    let mut children: BTreeMap<u32, Child> = BTreeMap::new();
    for id in 1..=opts.workers {
        let mut child = Command::new(&exe)
            .args([
                "worker",
                &id.to_string(),
                "--rounds",
                &opts.rounds.to_string(),
            ])
            .arg("--store")
            .arg(&store.path)
            .env("DLOCK_URL", url)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting a worker")?;
        let mut out = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
        let tx = lines_tx.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                let _ = tx.send((id, line));
            }
        });
        children.insert(id, child);
    }
    drop(lines_tx);

    let total_rounds = opts.workers * opts.rounds;
    let mut stats: BTreeMap<u32, WorkerStats> = BTreeMap::new();
    let mut killed: Option<Killed> = None;
    let mut overlaps = Vec::new();
    let mut stale_marks = Vec::new();
    let mut increments = 0;

    while let Some((id, line)) = lines.recv().await {
        let Some(event) = Event::parse(&line) else {
            println!("  worker {id}: {line}");
            continue;
        };
        match event {
            Event::Holds(me) => {
                stats.entry(me.worker).or_default().tokens.push(me.token);
                if let Some(k) = &mut killed
                    && k.next.is_none()
                    && me.worker != k.victim.worker
                {
                    k.next = Some((me, k.at.elapsed()));
                    println!(
                        "  worker {} got the lock {:.2} s later, with token {} (the lease is {} s)",
                        me.worker,
                        k.at.elapsed().as_secs_f64(),
                        me.token,
                        LEASE.as_secs()
                    );
                }
                // Kill a holder once a quarter of the rounds are done.
                if opts.kill_one && killed.is_none() && increments >= total_rounds / 4 {
                    let child = children.get_mut(&me.worker).expect("a worker we started");
                    child.kill().await.context("killing a worker")?;
                    let at = Instant::now();
                    println!(
                        "  killed worker {} (SIGKILL) while it held the lock with token {}",
                        me.worker, me.token
                    );
                    // Its last write may have reached the store just before it
                    // could print it: nobody else can write until its lease
                    // runs out, so the store tells.
                    if let Some(last) = store.read()?.last_write
                        && last.worker == me.worker
                    {
                        stats.entry(me.worker).or_default().wrote.insert(last.token);
                    }
                    killed = Some(Killed {
                        victim: me,
                        at,
                        next: None,
                    });
                }
            }
            Event::FoundInside { me, other } => match &killed {
                // The dead worker's mark, found by the next holder: a stale
                // holder cleaned up, not two workers inside at once.
                Some(k) if other.worker == k.victim.worker && other.token >= k.victim.token => {
                    stale_marks.push((me, other));
                }
                _ => overlaps.push((me, other)),
            },
            Event::Wrote { me, .. } => {
                stats.entry(me.worker).or_default().wrote.insert(me.token);
                increments += 1;
            }
            Event::Refused { me, .. } => stats.entry(me.worker).or_default().refused += 1,
        }
    }

    // Every worker but the killed one must have finished cleanly.
    let mut failed_workers = Vec::new();
    for (id, child) in &mut children {
        let status = child.wait().await?;
        let was_killed = killed.as_ref().is_some_and(|k| k.victim.worker == *id);
        if !status.success() && !was_killed {
            failed_workers.push(format!("worker {id} exited with {status}"));
        }
    }
    let state = store.read()?;
    let _ = std::fs::remove_dir_all(&dir);

    // One line per worker.
    if killed.is_some() {
        println!();
    }
    println!("worker  rounds        increments  fencing tokens");
    for id in 1..=opts.workers {
        let s = stats.entry(id).or_default();
        let mut rounds = s.rounds().to_string();
        if killed.as_ref().is_some_and(|k| k.victim.worker == id) {
            rounds.push_str(" (killed)");
        }
        let tokens = match (s.tokens.first(), s.tokens.last()) {
            (Some(first), Some(last)) => format!("{first}..{last}"),
            _ => "-".to_owned(),
        };
        println!("{id:>6}  {rounds:<12}  {:>10}  {tokens}", s.wrote.len());
    }
    println!();

    // The verdict: one line per check, `ok`/`FAIL` where it decides the exit code.
    let line = |ok: Option<bool>, what: &str, value: String, note: &str| {
        let mark = match ok {
            Some(true) => "ok",
            Some(false) => "FAIL",
            None => "",
        };
        println!("{mark:<4}  {what:<28}  {value:>6}  {note}");
    };
    let expected: usize = stats.values().map(|s| s.wrote.len()).sum();
    let done: usize = stats.values().map(WorkerStats::rounds).sum();
    let unfinished = opts.workers as usize * opts.rounds as usize - done;
    let seen = usize::try_from(state.value)?;
    let no_lost_update = expected == seen;
    let no_overlap = overlaps.is_empty();

    let why = match &killed {
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
        seen.to_string(),
        note,
    );
    line(
        Some(no_overlap),
        "overlapping holders",
        overlaps.len().to_string(),
        "times two live workers were inside `bump` at once",
    );
    for (me, other) in overlaps.iter().take(5) {
        println!("        {me} found {other} inside");
    }
    if overlaps.len() > 5 {
        println!("        … and {} more", overlaps.len() - 5);
    }
    line(
        None,
        "stale writes refused",
        state.stale_refused.to_string(),
        "writes with an out-of-date fencing token (from a holder whose lease ran out)",
    );

    let mut resumed = true;
    if let Some(k) = &killed {
        let note = match stale_marks.first() {
            Some((me, other)) => format!("{me} replaced the mark of dead {other}"),
            None => format!("worker {} died after clearing its mark", k.victim.worker),
        };
        line(
            None,
            "dead holder's mark replaced",
            stale_marks.len().to_string(),
            &note,
        );
        // The next holder gets the lock when the dead one's lease runs out: at
        // most LEASE after its last renewal, plus a poll of the waiters.
        match k.next {
            Some((next, stall)) => {
                resumed = stall <= LEASE + Duration::from_millis(750);
                line(
                    Some(resumed),
                    "lock back after the kill",
                    format!("{:.2} s", stall.as_secs_f64()),
                    &format!(
                        "worker {} went on; the lease is {} s",
                        next.worker,
                        LEASE.as_secs()
                    ),
                );
            }
            None => {
                resumed = false;
                line(Some(false), "lock back after the kill", "never".into(), "");
            }
        }
    }
    for failure in &failed_workers {
        line(Some(false), "worker failed", String::new(), failure);
    }

    let passed = no_lost_update && no_overlap && resumed && failed_workers.is_empty();
    println!();
    println!(
        "{} in {:.1} s",
        if passed { "PASS" } else { "FAIL" },
        started.elapsed().as_secs_f64()
    );
    Ok(passed)
}

// ---------------------------------------------------------------------------
// Start-up.
// ---------------------------------------------------------------------------

enum Mode {
    Coordinator(Options),
    Worker {
        id: u32,
        rounds: u32,
        store: PathBuf,
    },
}

fn parse_args() -> anyhow::Result<Mode> {
    let mut args = std::env::args().skip(1);
    let mut worker_id = None;
    let mut store = None;
    let mut opts = Options {
        workers: 4,
        rounds: 25,
        kill_one: false,
    };
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "worker" => worker_id = Some(value("worker")?.parse().context("worker <id>")?),
            "--store" => store = Some(PathBuf::from(value("--store")?)),
            "--workers" => opts.workers = value("--workers")?.parse().context("--workers N")?,
            "--rounds" => opts.rounds = value("--rounds")?.parse().context("--rounds M")?,
            "--kill-one" => opts.kill_one = true,
            "-h" | "--help" => {
                println!("usage: quickstart [--workers N (4)] [--rounds M (25)] [--kill-one]");
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}` (try --help)"),
        }
    }
    if let Some(id) = worker_id {
        let store = store.context("a worker needs --store PATH")?;
        return Ok(Mode::Worker {
            id,
            rounds: opts.rounds,
            store,
        });
    }
    if opts.workers == 0 || opts.rounds == 0 {
        bail!("--workers and --rounds must be at least 1");
    }
    if opts.kill_one && opts.workers < 2 {
        bail!("--kill-one needs at least 2 workers: one to kill, one to go on");
    }
    Ok(Mode::Coordinator(opts))
}

/// The lock backend: `DLOCK_URL`, or a SQLite file in the workspace's `target/`.
fn dlock_url() -> String {
    std::env::var("DLOCK_URL").unwrap_or_else(|_| {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the examples crate lives in the workspace");
        format!(
            "sqlite://{}",
            workspace.join("target/dlock-examples.db").display()
        )
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs go to stderr: a worker's stdout is for its report lines.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(io::stderr)
        .init();

    // Exit codes: 0 passed, 1 the verdict failed, 2 could not run.
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// Runs this process's part; `Ok(false)` if the verdict failed.
async fn run() -> anyhow::Result<bool> {
    let mode = parse_args()?;
    let url = dlock_url();
    if url.starts_with("memory:") {
        bail!(
            "DLOCK_URL={url} is a lock inside one process, but quickstart's workers are \
             separate processes: use a sqlite:// file (the default) or a server URL"
        );
    }
    dlock_runtime::init(Registry::from_url(&url).await?)?;

    match mode {
        Mode::Worker { id, rounds, store } => worker(id, rounds, store).await.map(|()| true),
        Mode::Coordinator(opts) => coordinate(&url, opts).await,
    }
}
