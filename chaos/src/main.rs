//! `dlock-chaos`: dlock under faults.
//!
//! ```sh
//! cargo run -p dlock-chaos -- run --backend redis                 # short run
//! cargo run -p dlock-chaos -- run --backend postgres --mode session # advisory locks
//! cargo run --release -p dlock-chaos -- run --backend redis \
//!     --acquisitions 100000 --faults 200                          # long run
//! cargo run -p dlock-chaos -- run --backend postgres \
//!     --workload transfer --accounts 16                           # transfers
//! cargo run -p dlock-chaos -- run --backend zk --workload semaphore # 3 permits
//! cargo run -p dlock-chaos -- run --backend redis --workload rw  # readers, writers
//! cargo run -p dlock-chaos -- check target/chaos/redis-1         # re-check a run
//! ```
//!
//! `run` starts N worker processes (this binary, `worker`) against one lock
//! backend (and a second, `side`, backend that the nemesis stalls); each loops
//! through `#[distributed_lock]` functions that read and write a counter in a
//! fenced store (this binary, `store`) with its fencing token, with mixed lease
//! lengths, sometimes giving up (a timeout) during the acquisition, the body or
//! the release. With `--workload transfer` each iteration instead takes two
//! accounts in one hold (`keys = [..]`, `lock_all`) and moves an amount from
//! one to the other, both writes fenced with each key's own token and decided
//! together; the checker adds conservation of the total. With `--workload
//! semaphore` each hold is one of 3 permits of its key (`permits = 3`) and
//! increments its slot's counter, fenced per (key, slot); with `--workload
//! rw` readers (`mode = "read"`) read a key's counter while writers (`mode =
//! "write"`) and plain locks increment it; the checker adds never more
//! holders than permits, never two holders of one slot, never a reader
//! beside a writer, all decided on the store's order of the operations it
//! took. A backend that does not offer the workload's mode fails the run at
//! its start. A nemesis pauses,
//! kills and cuts off workers and servers on a seeded schedule, and revokes
//! held keys through the admin API as an operator would. The checker then reads every history, including the runtime's
//! own trace of each lease, and prints one summary; the exit status is 1 when an
//! invariant was broken.

mod checker;
mod clock;
mod history;
mod nemesis;
mod proxy;
mod run;
mod servers;
mod store;
mod trace;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "dlock-chaos",
    about = "dlock under faults: workers, a fenced store, a nemesis, a checker"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One chaos run against a backend, then the checker's summary.
    Run(run::RunArgs),
    /// Checks the histories of an earlier run again.
    Check {
        /// The run's directory (history.jsonl, store.jsonl, meta.json).
        dir: PathBuf,
    },
    /// (internal) A worker process.
    #[command(hide = true)]
    Worker(worker::WorkerArgs),
    /// (internal) The fenced store.
    #[command(hide = true)]
    Store {
        /// Fencing tokens or versions.
        #[arg(long, value_enum)]
        mode: store::Mode,
        /// Where to log every decision.
        #[arg(long)]
        log: PathBuf,
        /// Fence mode: the SQLite file the fencing kit keeps the counters in.
        #[arg(long)]
        sqlite: Option<PathBuf>,
        /// Fence mode: the Redis server the fencing kit keeps the counters in.
        #[arg(long)]
        redis: Option<String>,
        /// What a key never written holds (the transfer workload's opening balance).
        #[arg(long, default_value_t = 0)]
        initial: u64,
        /// Accounts `acct:0` … known from the start (transfer workload).
        #[arg(long, default_value_t = 0)]
        accounts: usize,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Run(args) => run::run(args).await.and_then(|summary| {
            println!("{summary}");
            run::verdict(&summary)
        }),
        Command::Check { dir } => checker::check_dir(&dir).and_then(|summary| {
            println!("{summary}");
            run::verdict(&summary)
        }),
        Command::Worker(args) => worker::run(args).await,
        Command::Store {
            mode,
            log,
            sqlite,
            redis,
            initial,
            accounts,
        } => match store::Kit::open(sqlite.as_deref(), redis.as_deref()).await {
            Ok(kit) => store::serve(mode, kit, &log, initial, accounts).await,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dlock-chaos: {e:#}");
            ExitCode::FAILURE
        }
    }
}
