//! What the examples share, so that each example file shows only its lock.
//!
//! The examples are `cargo run --example …` programs beside this crate:
//! `quickstart`, `axum_handler` and `scheduled_job`. This library holds their
//! common start-up and the machinery that demonstrates them:
//!
//! - [`main`]: logging, the Tokio runtime and the exit code of every example;
//! - [`dlock_url`] and [`dlock_url_between_processes`]: the lock backend, from
//!   `DLOCK_URL` or a SQLite file in the workspace's `target/` directory;
//! - [`Args`]: the few command-line options the examples take;
//! - [`copies`]: starting copies of the running program (the workers and
//!   replicas of the multi-process examples) and reading their report lines;
//! - [`counter`]: the fenced counter store of `quickstart`, instrumented to
//!   detect overlapping holders;
//! - [`harness`]: `quickstart`'s workers, its coordinator and its verdict.

#![forbid(unsafe_code)]

pub mod copies;
pub mod counter;
pub mod harness;

use std::future::Future;
use std::path::Path;
use std::process::ExitCode;
use std::str::FromStr;

use anyhow::{Context, bail};
use tracing_subscriber::EnvFilter;

/// Runs an example: `run` on a multi-threaded Tokio runtime, with logs on
/// stderr (stdout is for the example's report; `RUST_LOG` filters, default
/// `info`).
///
/// The exit code is 0 if `run` returns `Ok(true)` (the example passed), 1 if
/// `Ok(false)` (its verdict failed), 2 if it returns an error (it could not
/// run), printed on stderr.
pub fn main(run: impl Future<Output = anyhow::Result<bool>>) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let outcome = tokio::runtime::Runtime::new()
        .context("starting the Tokio runtime")
        .and_then(|runtime| runtime.block_on(run));
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// The lock backend's URL: `DLOCK_URL`, or by default a SQLite file in the
/// workspace's `target/` directory (`target/dlock-examples.db`).
pub fn dlock_url() -> String {
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

/// [`dlock_url`], for an example whose lock is shared by several processes:
/// refuses `memory://`, a lock inside one process.
pub fn dlock_url_between_processes() -> anyhow::Result<String> {
    let url = dlock_url();
    if url.starts_with("memory:") {
        bail!(
            "DLOCK_URL={url} is a lock inside one process, but this example runs in several \
             processes: use a sqlite:// file (the default) or a server URL"
        );
    }
    Ok(url)
}

/// The command-line arguments of an example, read one at a time.
///
/// `-h` and `--help` print the usage line and exit with 0.
pub struct Args {
    args: std::iter::Skip<std::env::Args>,
    usage: &'static str,
}

impl Args {
    /// This program's arguments; `usage` is printed for `--help`.
    pub fn from_env(usage: &'static str) -> Args {
        Args {
            args: std::env::args().skip(1),
            usage,
        }
    }

    /// The value of option `name`: the next argument, parsed.
    pub fn value<T>(&mut self, name: &str) -> anyhow::Result<T>
    where
        T: FromStr,
        T::Err: std::error::Error + Send + Sync + 'static,
    {
        let value = self
            .args
            .next()
            .with_context(|| format!("{name} needs a value"))?;
        value.parse().with_context(|| format!("{name} {value}"))
    }

    /// The error for an argument the example does not know.
    pub fn unknown(&self, arg: &str) -> anyhow::Error {
        anyhow::anyhow!("unknown argument `{arg}` (usage: {})", self.usage)
    }
}

impl Iterator for Args {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        let arg = self.args.next()?;
        if arg == "-h" || arg == "--help" {
            println!("usage: {}", self.usage);
            std::process::exit(0);
        }
        Some(arg)
    }
}
