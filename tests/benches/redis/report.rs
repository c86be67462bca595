//! Sections 5 and the targets: the keys left on the benchmark's server, and
//! the targets judged on this run's ratios.

use super::*;

/// Section 5: the keys left on the server (nothing flushed, nothing deleted
/// before counting), beyond the fence counter; answers them.
pub(super) async fn keys_left(
    admin: &mut MultiplexedConnection,
    out: &mut String,
) -> anyhow::Result<Vec<String>> {
    let total: u64 = redis::cmd("DBSIZE").query_async(admin).await?;
    let mut keys: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(admin)
            .await?;
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    let (fences, left): (Vec<String>, Vec<String>) = keys
        .into_iter()
        .partition(|k| k == FENCE_KEY || k.starts_with(&format!("{FENCE_KEY}:")));
    writeln!(out, "\n## Keys left on the benchmark's server\n")?;
    writeln!(
        out,
        "DBSIZE {total}: fence counters {} ({}); keys left: {} (beyond the fence counter){}",
        fences.len(),
        fences.join(", "),
        left.len(),
        if left.is_empty() {
            String::new()
        } else {
            format!(
                ", e.g. {}",
                left.iter().take(10).cloned().collect::<Vec<_>>().join(", ")
            )
        }
    )?;

    Ok(left)
}

/// The targets, with ✓/✗, and the machine's load.
pub(super) fn targets(
    out: &mut String,
    t: &Throughput,
    left: &[String],
    h: &HandoffFigures,
    load_at_start: &str,
) -> anyhow::Result<()> {
    let (sections, c1, c1_label) = (&t.sections, &t.c1, &t.c1_label);
    let (dlock_one, dlock_procs, rslock, polling) =
        (h.dlock_one, h.dlock_procs, h.rslock, h.polling);
    let c1m = &sections[0].2;
    let c64m = &sections[1].2;
    let ratio = |m: &BTreeMap<Who, Medians>, a: Who, b: Who| m[&a].pairs_per_s / m[&b].pairs_per_s;
    let cpu_ratio =
        |m: &BTreeMap<Who, Medians>| m[&Who::Dlock].server_us / m[&Who::Floor].server_us;
    writeln!(out, "\n## Targets (ratios in this run)\n")?;
    writeln!(out, "| target | measured | met |")?;
    writeln!(out, "|---|---:|:---:|")?;
    let r = ratio(c64m, Who::Dlock, Who::Floor);
    writeln!(
        out,
        "| c=64: dlock ≥ {TARGET_C64_FLOOR}× the floor | {r:.2}× | {} |",
        tick(r >= TARGET_C64_FLOOR)
    )?;
    let r = ratio(c64m, Who::Dlock, Who::Rslock);
    writeln!(
        out,
        "| c=64: dlock ≥ {TARGET_C64_RSLOCK:.1}× rslock | {r:.2}× | {} |",
        tick(r >= TARGET_C64_RSLOCK)
    )?;
    let r = ratio(c1m, Who::Dlock, Who::Floor);
    if c1.pinned {
        writeln!(
            out,
            "| {c1_label}: dlock ≥ {TARGET_C1_FLOOR}× the floor | {r:.2}× | {} |",
            tick(r >= TARGET_C1_FLOOR)
        )?;
    } else {
        writeln!(
            out,
            "| {c1_label}: dlock ≥ {TARGET_C1_FLOOR}× the floor | {r:.2}× | not gated |"
        )?;
    }
    let r = ratio(c64m, Who::Unfenced, Who::Floor);
    writeln!(
        out,
        "| c=64: dlock unfenced ≥ {TARGET_UNFENCED_C64_FLOOR}× the floor | {r:.2}× | {} |",
        tick(r >= TARGET_UNFENCED_C64_FLOOR)
    )?;
    let r = ratio(c64m, Who::Unfenced, Who::Rslock);
    writeln!(
        out,
        "| c=64: dlock unfenced ≥ {TARGET_C64_RSLOCK:.1}× rslock | {r:.2}× | {} |",
        tick(r >= TARGET_C64_RSLOCK)
    )?;
    let r = ratio(c1m, Who::Unfenced, Who::Floor);
    writeln!(
        out,
        "| {c1_label}: dlock unfenced ≥ {TARGET_C1_FLOOR}× the floor | {r:.2}× | {} |",
        if c1.pinned {
            tick(r >= TARGET_C1_FLOOR)
        } else {
            "not gated"
        }
    )?;
    let r = cpu_ratio(c64m);
    writeln!(
        out,
        "| c=64: server CPU per lock ≤ {TARGET_SERVER_CPU}× the floor's | {r:.2}× ({:.1} vs {:.1} µs) | {} |",
        c64m[&Who::Dlock].server_us,
        c64m[&Who::Floor].server_us,
        tick(r <= TARGET_SERVER_CPU)
    )?;
    let r = cpu_ratio(c1m);
    writeln!(
        out,
        "| {c1_label}: server CPU per lock ≤ {TARGET_SERVER_CPU}× the floor's | {r:.2}× ({:.1} vs {:.1} µs) | {} |",
        c1m[&Who::Dlock].server_us,
        c1m[&Who::Floor].server_us,
        if c1.pinned {
            tick(r <= TARGET_SERVER_CPU)
        } else {
            "not gated"
        }
    )?;
    writeln!(
        out,
        "| keys left: 0 beyond the fence counter | {} | {} |",
        left.len(),
        tick(left.is_empty())
    )?;
    for (name, ms) in [("1 process", dlock_one), ("4 processes", dlock_procs)] {
        writeln!(
            out,
            "| handoff: dlock ({name}) faster than rslock and 100 ms polling | {ms:.3} ms vs {rslock:.3} / {polling:.3} ms | {} |",
            tick(ms < rslock && ms < polling)
        )?;
    }
    writeln!(
        out,
        "\nMachine: {} CPUs online ({}), this process on CPUs {}; load average at start {}, at end {}",
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .unwrap_or_default()
            .trim(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpus_allowed("self")?,
        load_at_start.trim(),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    )?;

    Ok(())
}
