//! The handoff convoy spread over processes: children of the benchmark
//! program itself (`--convoy-child`), given the backend's URL, that start
//! together at one wall-clock instant.

use std::time::Duration;

use dlock_runtime::Registry;

use super::{CONVOY, dlock_turn, join, now_micros, per_handoff};

/// The argument that makes a benchmark program a convoy process (its `main`
/// hands the arguments after it to [`convoy_child`]).
pub(crate) const CONVOY_CHILD: &str = "--convoy-child";

/// A convoy of [`CONVOY`] tasks spread over `processes` processes of this
/// program, on `key` of the backend at `url`, started at one wall-clock
/// instant; answers the milliseconds per handoff (see [`per_handoff`]).
pub(crate) fn convoy_processes(url: &str, key: &str, processes: usize) -> anyhow::Result<f64> {
    anyhow::ensure!(
        CONVOY.is_multiple_of(processes),
        "{CONVOY} tasks do not split over {processes} processes"
    );
    // Time for every process to start, connect and warm up.
    let start_at = now_micros() + 2_000_000;
    let children: Vec<_> = (0..processes)
        .map(|_| {
            std::process::Command::new(std::env::current_exe()?)
                .args([
                    CONVOY_CHILD,
                    url,
                    key,
                    &(CONVOY / processes).to_string(),
                    &start_at.to_string(),
                ])
                .stdout(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let (mut last_end, mut held, mut tasks) = (start_at, 0u64, 0usize);
    for child in children {
        let output = child.wait_with_output()?;
        anyhow::ensure!(output.status.success(), "a convoy process failed");
        for line in String::from_utf8(output.stdout)?.lines() {
            let (hold, end) = line
                .split_once(' ')
                .ok_or_else(|| anyhow::anyhow!("bad child line {line:?}"))?;
            held += hold.parse::<u64>()?;
            last_end = last_end.max(end.parse()?);
            tasks += 1;
        }
    }
    anyhow::ensure!(
        tasks == CONVOY,
        "the convoy processes reported {tasks} holds"
    );
    anyhow::ensure!(
        last_end > start_at,
        "the convoy processes started late (after the instant they were given)"
    );
    Ok(per_handoff(
        Duration::from_micros(last_end - start_at),
        Duration::from_micros(held),
    ))
}

/// A convoy process: `URL KEY TASKS START_AT_MICROS`. Connects, opens as many
/// connections as it has tasks (one lock on a key of its own each, so that
/// the convoy measures handoffs, not connection set-ups), then at
/// `START_AT_MICROS` runs its tasks: each acquires `KEY` once, holds it for
/// [`HOLD`](super::HOLD) and releases ([`dlock_turn`]). Prints one line per task: its hold
/// and the instant it released, in µs.
pub(crate) async fn convoy_child(args: &[String]) -> anyhow::Result<()> {
    let [url, key, tasks, start_at] = args else {
        anyhow::bail!("usage: {CONVOY_CHILD} URL KEY TASKS START_AT_MICROS");
    };
    let registry = Registry::from_url(url)
        .await
        .map_err(|e| anyhow::anyhow!("convoy process: cannot connect: {e}"))?;
    let tasks: usize = tasks.parse()?;
    let warm_up: Vec<_> = (0..tasks)
        .map(|t| {
            let (registry, key) = (
                registry.clone(),
                format!("{key}:warm-up:{}:{t}", std::process::id()),
            );
            tokio::spawn(async move {
                let guard = registry.lock(key).acquire().await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
                guard.release().await
            })
        })
        .collect();
    for task in warm_up {
        join(task)
            .await
            .map_err(|e| anyhow::anyhow!("convoy process: warm-up failed: {e}"))?;
    }
    let start_at: u64 = start_at.parse()?;
    tokio::time::sleep(Duration::from_micros(start_at.saturating_sub(now_micros()))).await;
    let tasks: Vec<_> = (0..tasks)
        .map(|_| {
            let (registry, key) = (registry.clone(), key.clone());
            tokio::spawn(async move {
                let held = dlock_turn(&registry, key, "convoy process").await;
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
