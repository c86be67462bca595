//! Section 2, handoff: a convoy spread over processes of this program.

use super::*;

/// A convoy spread over [`PROCESSES`] processes of this program, started at
/// one wall-clock instant; answers the milliseconds per handoff.
pub(super) fn convoy_processes(url: &str, key: &str) -> anyhow::Result<f64> {
    let start_at = now_micros() + 1_500_000;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            std::process::Command::new(std::env::current_exe()?)
                .args([
                    "--convoy-child",
                    url,
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
pub(super) async fn convoy_child(args: &[String]) -> anyhow::Result<()> {
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
                    .unwrap_or_else(|e| panic!("dlock convoy process: acquire failed: {e}"));
                let held = hold().await;
                guard
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("dlock convoy process: release failed: {e}"));
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

/// Section 2's figures, milliseconds per handoff.
pub(super) struct HandoffFigures {
    /// dlock, the convoy in one process.
    pub(super) dlock_one: f64,
    /// dlock, the convoy spread over [`PROCESSES`] processes.
    pub(super) dlock_procs: f64,
    /// `rslock`.
    pub(super) rslock: f64,
    /// A 100 ms polling loop.
    pub(super) polling: f64,
}

/// Section 2: the handoff rows of the comparison table and the chart's
/// handoff bars.
pub(super) async fn handoff_section(
    c: &Arc<Contenders>,
    url: &str,
    run: u64,
    table: &mut String,
    chart: &mut Chart,
) -> anyhow::Result<HandoffFigures> {
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
                    .unwrap_or_else(|e| panic!("dlock handoff: acquire failed: {e}"));
                let held = hold().await;
                guard
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("dlock handoff: release failed: {e}"));
                held
            }
        })
    })
    .await;
    let mut dlock_procs = Vec::new();
    for k in 0..CONVOYS {
        dlock_procs.push(convoy_processes(url, &format!("handoff-procs:{run}:{k}"))?);
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
                    .unwrap_or_else(|e| panic!("rslock handoff: acquire failed: {e}"));
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
                assert!(
                    floor_unlock(&c, &mut conn, &key, &owner).await,
                    "polling loop: the unlock script did not delete {key}"
                );
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

    Ok(HandoffFigures {
        dlock_one,
        dlock_procs,
        rslock,
        polling,
    })
}
