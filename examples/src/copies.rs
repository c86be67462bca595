//! Copies of the running program, started as separate processes.
//!
//! The multi-process examples are one program in two roles: run without
//! arguments, it is the *coordinator*, which starts copies of itself with the
//! arguments of the other role (a worker, a replica), reads what they print,
//! one line per event, and judges. [`Copies`] is that starting and reading.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::process::{ExitStatus, Stdio};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// Running copies of this program, each known by a number, whose stdout lines
/// arrive on one channel in the order they were printed.
///
/// Dropping `Copies` kills the copies still running.
pub struct Copies {
    children: BTreeMap<u32, Child>,
    lines: mpsc::UnboundedReceiver<(u32, String)>,
}

impl Copies {
    /// Starts one copy of this program per `(number, arguments)`, with
    /// `DLOCK_URL` set to `url` so that all of them share the lock backend.
    pub fn start<I, A>(url: &str, copies: I) -> anyhow::Result<Copies>
    where
        I: IntoIterator<Item = (u32, A)>,
        A: IntoIterator,
        A::Item: Into<OsString>,
    {
        let exe = std::env::current_exe().context("locating this program")?;
        let (tx, lines) = mpsc::unbounded_channel();
        let mut children = BTreeMap::new();
        for (number, args) in copies {
            let mut child = Command::new(&exe)
                .args(args.into_iter().map(Into::into))
                .env("DLOCK_URL", url)
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .context("starting a copy of this program")?;
            let mut out = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Ok(Some(line)) = out.next_line().await {
                    let _ = tx.send((number, line));
                }
            });
            children.insert(number, child);
        }
        Ok(Copies { children, lines })
    }

    /// The next line a copy printed, with the copy's number; `None` once every
    /// copy has closed its stdout (exited, or was killed).
    pub async fn next_line(&mut self) -> Option<(u32, String)> {
        self.lines.recv().await
    }

    /// Kills copy `number` with SIGKILL: it gets no chance to clean up.
    pub async fn kill(&mut self, number: u32) -> anyhow::Result<()> {
        let child = self
            .children
            .get_mut(&number)
            .with_context(|| format!("no copy numbered {number}"))?;
        child.kill().await.context("killing a copy")
    }

    /// Waits for every copy to exit, and returns how each one did.
    pub async fn wait(mut self) -> anyhow::Result<BTreeMap<u32, ExitStatus>> {
        let mut statuses = BTreeMap::new();
        for (number, child) in &mut self.children {
            statuses.insert(*number, child.wait().await?);
        }
        Ok(statuses)
    }
}
