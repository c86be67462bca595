//! Section 2, handoff: a convoy spread over processes of this program.

use super::*;

pub(super) use crate::common::convoy::{convoy_child, convoy_processes};
use crate::common::dlock_turn;

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
            async move { dlock_turn(&c.dlock, key, "dlock handoff").await }
        })
    })
    .await;
    let mut dlock_procs = Vec::new();
    for k in 0..CONVOYS {
        dlock_procs.push(convoy_processes(
            url,
            &format!("handoff-procs:{run}:{k}"),
            PROCESSES,
        )?);
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
