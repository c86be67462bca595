//! Section 3, the watchdog with many held leases: renewals seen by the server,
//! pipelines, CPU.

use super::*;

pub(super) struct WatchdogCost {
    pub(super) renewals_per_s: f64,
    pub(super) expected_per_s: f64,
    pub(super) pipelines_per_s: f64,
    pub(super) cpu_percent: f64,
    pub(super) server_cpu_percent: f64,
}

/// Holds [`WATCHDOG_LEASES`] leases and watches the renewals for a while.
pub(super) async fn watchdog_cost(c: &Arc<Contenders>) -> anyhow::Result<WatchdogCost> {
    let mut guards = Vec::with_capacity(WATCHDOG_LEASES);
    let acquiring: Vec<_> = (0..64)
        .map(|t| {
            let c = c.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                for i in (t..WATCHDOG_LEASES).step_by(64) {
                    mine.push(
                        c.dlock
                            .lock(format!("watchdog:{}:{i}", c.run))
                            .lease(WATCHDOG_LEASE)
                            .acquire()
                            .await
                            .unwrap_or_else(|e| panic!("dlock watchdog: acquire failed: {e}")),
                    );
                }
                mine
            })
        })
        .collect();
    for task in acquiring {
        guards.extend(join(task).await);
    }
    // Let the first renewals of every lease start, then measure.
    tokio::time::sleep(WATCHDOG_LEASE / 3).await;
    let mut conn = c.admin.clone();
    let (renewals, pipelines) = script_calls(&mut conn).await?;
    let server_cpu = server_cpu_seconds(&mut conn).await?;
    let cpu = client_cpu_ns()?;
    let started = Instant::now();
    tokio::time::sleep(WATCHDOG_WINDOW).await;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = (client_cpu_ns()? - cpu) as f64 / 1e9;
    let server_cpu = server_cpu_seconds(&mut conn).await? - server_cpu;
    let (renewals_after, pipelines_after) = script_calls(&mut conn).await?;
    anyhow::ensure!(
        guards.iter().all(|g| !g.is_lost()),
        "a lease was lost while idle"
    );
    for guard in guards {
        guard.release().await?;
    }
    Ok(WatchdogCost {
        renewals_per_s: (renewals_after - renewals) as f64 / elapsed,
        expected_per_s: WATCHDOG_LEASES as f64 / (WATCHDOG_LEASE / 3).as_secs_f64(),
        pipelines_per_s: (pipelines_after - pipelines) as f64 / elapsed,
        cpu_percent: cpu / elapsed * 100.0,
        server_cpu_percent: server_cpu / elapsed * 100.0,
    })
}

/// Section 3: the watchdog rows of the comparison table.
pub(super) async fn watchdog_rows(c: &Arc<Contenders>, table: &mut String) -> anyhow::Result<()> {
    let watchdog = watchdog_cost(c).await?;
    writeln!(
        table,
        "| watchdog, {WATCHDOG_LEASES} leases of {}: renewals/s | {:.0} | one per lease per lease/3: {:.0} | {:.2}× |",
        humantime::format_duration(WATCHDOG_LEASE),
        watchdog.renewals_per_s,
        watchdog.expected_per_s,
        watchdog.renewals_per_s / watchdog.expected_per_s
    )?;
    writeln!(
        table,
        "| watchdog: renewal pipelines/s; CPU | {:.1} pipelines/s | client {:.1}%, server {:.1}% of one core | |",
        watchdog.pipelines_per_s, watchdog.cpu_percent, watchdog.server_cpu_percent
    )?;

    Ok(())
}
