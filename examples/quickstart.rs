//! # quickstart: several processes, one lock, no lost update
//!
//! ```sh
//! cargo run --example quickstart                  # 4 worker processes × 25 rounds
//! cargo run --example quickstart -- --kill-one    # SIGKILL one worker while it holds the lock
//! ```
//!
//! This program starts worker processes of itself, and each calls [`bump`] 25
//! times: read a counter, work a moment, write the value + 1. Two workers
//! doing that at once would both read 41 and both write 42, losing an update;
//! `#[distributed_lock]` makes them take turns, whichever process they run in.
//! The write is *fenced* ([`write_fenced`]), so that even a holder whose lease
//! ran out cannot overwrite newer data.
//!
//! Then it prints a verdict: the increments the workers made against the
//! counter's final value, how often two workers overlapped, how many stale
//! writes the store refused. The workers, the counter store and the verdict
//! are in the examples' library (`examples/src/harness.rs`).
//!
//! The lock backend comes from `DLOCK_URL` (default: a SQLite file under
//! `target/`), and must be shared between processes: `memory://` is refused.

use std::process::ExitCode;
use std::time::Duration;

use dlock_examples::counter::{Counter, Row};
use dlock_runtime::{LockError, Registry, distributed_lock};

/// The lease of `bump`'s lock: how long a holder that died blocks the others at most.
const LEASE: Duration = Duration::from_secs(2);

/// Adds one to the counter, in one process at a time; returns the new value.
///
/// The lock's key is built from the argument (`quickstart:counter`); callers
/// wait up to 30 s for their turn. The lease is renewed while the body runs,
/// and the lock released when it returns, fails or panics.
#[distributed_lock(key = "quickstart:{name}", wait = "30s", lease = "2s")]
async fn bump(name: &str, counter: &Counter) -> Result<u64, AppError> {
    // Each acquisition of a key carries a token higher than all before it.
    let token = dlock_runtime::current()
        .and_then(|lock| lock.fencing_token())
        .ok_or(AppError::NoFencingToken)?;
    let value = counter.read()?;
    // The work between the read and the write: without the lock, another
    // worker would read the same value meanwhile, and one increment would be lost.
    tokio::time::sleep(Duration::from_millis(rand::random_range(10..30))).await;
    write_fenced(counter, value + 1, token.into())?;
    Ok(value + 1)
}

/// Stores `value` unless a write with a higher fencing token came first.
///
/// A holder can pause (GC, swap, SIGSTOP) past its lease and wake up believing
/// it still holds the lock while another worker holds it; this check refuses
/// its late write. In SQL: `UPDATE counter SET value = ?, token = ? WHERE token <= ?`.
fn write_fenced(counter: &Counter, value: u64, token: u64) -> Result<(), AppError> {
    counter.update(|row: &mut Row| {
        if token < row.token {
            return Err(AppError::Stale {
                token,
                seen: row.token,
            });
        }
        *row = Row { value, token };
        Ok(())
    })?
}

/// What can go wrong in `bump`.
#[derive(Debug, thiserror::Error)]
enum AppError {
    /// The lock could not be taken in 30 s (or the backend failed), or was lost.
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The counter store could not be read or written.
    #[error("counter store: {0}")]
    Store(#[from] std::io::Error),
    /// The store refused a write: a holder with a higher token wrote before.
    #[error("write with fencing token {token} refused: the store has seen token {seen}")]
    Stale { token: u64, seen: u64 },
    /// The backend hands out no fencing tokens (Redlock).
    #[error("this example needs a lock backend with fencing tokens (every one but Redlock)")]
    NoFencingToken,
}

fn main() -> ExitCode {
    dlock_examples::main(async {
        let url = dlock_examples::dlock_url_between_processes()?;
        // Once per process: the backend every #[distributed_lock] function uses.
        dlock_runtime::init(Registry::from_url(&url).await?)?;
        // A worker calls `bump`; the coordinator starts the workers and judges.
        dlock_examples::harness::run(&url, LEASE, async |counter| bump("counter", counter).await)
            .await
    })
}
