//! Section 1, throughput: interleaved rounds of uncontended pairs, CPU per
//! pair on both sides, the server's command time, each half apart, and the
//! pinned concurrency-1 child.

use super::*;
use crate::common::rounds::{PairSample, report_affinity, rotated_rounds, run_pinned_child};

/// The halves of a pair, measured apart (all acquisitions, then all
/// releases) to split the server's cost between them.
#[derive(Clone, Copy, Debug)]
pub(super) enum Step {
    FloorSet,
    FloorUnlock,
    SameAcquire,
    SameRelease,
}

impl Step {
    pub(super) fn name(self) -> &'static str {
        match self {
            Step::FloorSet => "hand-written floor: SET NX PX",
            Step::FloorUnlock => "hand-written floor: compare-and-delete script",
            Step::SameAcquire => "dlock's acquire.lua (by hand)",
            Step::SameRelease => "dlock's release.lua (by hand)",
        }
    }
}

/// One half of a pair on key `i` of `tag` (the owner is derived from `i`).
pub(super) async fn step(c: &Contenders, s: Step, tag: &str, i: u64) {
    let mut conn = c.floor.clone();
    let owner = format!("{:032x}", u128::from(i) ^ u128::from(c.run));
    match s {
        Step::FloorSet | Step::FloorUnlock => {
            let key = format!("bench:split-floor:{}:{tag}:{i}", c.run);
            if matches!(s, Step::FloorSet) {
                assert!(
                    floor_try(&mut conn, &key, &owner).await,
                    "split: SET NX found {key} taken"
                );
            } else {
                assert!(
                    floor_unlock(c, &mut conn, &key, &owner).await,
                    "split: the unlock script did not delete {key}"
                );
            }
        }
        Step::SameAcquire => {
            let key = format!("{{bench:split-same:{}:{tag}:{i}}}", c.run);
            let (taken, _token): (i64, i64) = c
                .acquire_lua
                .key(&key)
                .key(FENCE_KEY)
                .arg(&owner)
                .arg(30_000)
                .arg(&c.record)
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("split: acquire.lua failed: {e}"));
            assert_eq!(taken, 1, "split: {key} was taken");
        }
        Step::SameRelease => {
            let key = format!("{{bench:split-same:{}:{tag}:{i}}}", c.run);
            let released: i64 = c
                .release_lua
                .key(&key)
                .arg(&owner)
                .arg(format!("{key}:released"))
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("split: release.lua failed: {e}"));
            assert_eq!(released, 1, "split: {key} not deleted");
        }
    }
}

/// `n` steps over distinct keys by `concurrency` tasks; answers the server's
/// CPU µs per step and the commands per step (calls, usec).
pub(super) async fn measure_steps(
    c: &Arc<Contenders>,
    s: Step,
    concurrency: u64,
    n: u64,
    tag: &str,
) -> anyhow::Result<(f64, Commands)> {
    let mut admin = c.admin.clone();
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await?;
    let before = server_cpu_seconds(&mut admin).await?;
    let tag: Arc<str> = tag.into();
    spread(concurrency, n, {
        let c = c.clone();
        move |i| {
            let (c, tag) = (c.clone(), tag.clone());
            async move { step(&c, s, &tag, i).await }
        }
    })
    .await;
    let after = server_cpu_seconds(&mut admin).await?;
    let commands = commandstats(&mut admin)
        .await?
        .into_iter()
        .filter(|(name, _)| !matches!(name.as_str(), "info" | "config|resetstat"))
        .map(|(name, (calls, usec))| (name, (calls as f64 / n as f64, usec as f64 / n as f64)))
        .collect();
    Ok(((after - before) * 1e6 / n as f64, commands))
}

/// `n` pairs of `who` over distinct keys, by `concurrency` tasks at once.
pub(super) async fn run_pairs(c: &Arc<Contenders>, who: Who, concurrency: u64, n: u64, tag: &str) {
    let tag: Arc<str> = tag.into();
    spread(concurrency, n, {
        let c = c.clone();
        move |i| {
            let (c, tag) = (c.clone(), tag.clone());
            async move { pair(&c, who, &tag, i).await }
        }
    })
    .await;
}

/// `INFO commandstats` per operation: command → (calls, usec).
pub(super) type Commands = BTreeMap<String, (f64, f64)>;

/// One run of one contender, per pair.
#[derive(Clone, Debug, Default)]
pub(super) struct Sample {
    /// Its rate and CPU time (the server's from `INFO cpu`).
    pub(super) pair: PairSample,
    /// `INFO commandstats`: command → (calls, usec) per pair.
    pub(super) commands: BTreeMap<String, (f64, f64)>,
}

impl Sample {
    /// The server's command time per pair for what `who` sends itself:
    /// scripts (their inner commands included) and its direct commands.
    pub(super) fn command_us(&self, who: Who) -> f64 {
        self.commands
            .iter()
            .filter(|(name, _)| {
                matches!(
                    name.as_str(),
                    "eval" | "evalsha" | "eval_ro" | "evalsha_ro" | "fcall"
                ) || who.direct().contains(&name.as_str())
            })
            .map(|(_, (_, usec))| usec)
            .sum()
    }

    /// One line of the pinned child's output (tab-separated).
    pub(super) fn encode(&self) -> String {
        let commands: Vec<String> = self
            .commands
            .iter()
            .map(|(name, (calls, usec))| format!("{name}={calls}/{usec}"))
            .collect();
        format!("{}\t{}", self.pair.encode(), commands.join(","))
    }

    pub(super) fn decode(fields: &[&str]) -> anyhow::Result<Sample> {
        let [pair @ .., commands] = fields else {
            anyhow::bail!("bad sample {fields:?}");
        };
        let mut sample = Sample {
            pair: PairSample::decode(pair)?,
            commands: BTreeMap::new(),
        };
        for entry in commands.split(',').filter(|e| !e.is_empty()) {
            let (name, values) = entry
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("bad command entry {entry:?}"))?;
            let (calls, usec) = values
                .split_once('/')
                .ok_or_else(|| anyhow::anyhow!("bad command entry {entry:?}"))?;
            sample
                .commands
                .insert(name.to_owned(), (calls.parse()?, usec.parse()?));
        }
        Ok(sample)
    }
}

/// Runs `n` pairs of `who` and measures them: wall time, this process's CPU
/// time and the server's, around that run only; the server's command
/// counters are reset just before.
pub(super) async fn measure(
    c: &Arc<Contenders>,
    who: Who,
    concurrency: u64,
    n: u64,
    tag: &str,
) -> anyhow::Result<Sample> {
    let mut admin = c.admin.clone();
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await?;
    let server_pid = c.server_pid.to_string();
    let server_before = server_cpu_seconds(&mut admin).await?;
    let server_sched_before = schedstat(&server_pid)?;
    let client_before = schedstat("self")?;
    let started = Instant::now();
    run_pairs(c, who, concurrency, n, tag).await;
    let elapsed = started.elapsed();
    let client_after = schedstat("self")?;
    let server_sched_after = schedstat(&server_pid)?;
    let server_after = server_cpu_seconds(&mut admin).await?;
    let per_pair =
        |before: u64, after: u64| after.saturating_sub(before) as f64 / 1000.0 / n as f64;
    let commands = commandstats(&mut admin)
        .await?
        .into_iter()
        // The measurement's own commands.
        .filter(|(name, _)| !matches!(name.as_str(), "info" | "config|resetstat"))
        .map(|(name, (calls, usec))| (name, (calls as f64 / n as f64, usec as f64 / n as f64)))
        .collect();
    Ok(Sample {
        pair: PairSample {
            pairs_per_s: n as f64 / elapsed.as_secs_f64(),
            client_us: per_pair(client_before.0, client_after.0),
            server_us: (server_after - server_before) * 1e6 / n as f64,
            client_wait_us: per_pair(client_before.1, client_after.1),
            server_wait_us: per_pair(server_sched_before.1, server_sched_after.1),
        },
        commands,
    })
}

/// The throughput section at one concurrency: a warm-up run of each
/// contender, then [`THROUGHPUT_ROUNDS`] interleaved rounds
/// ([`rotated_rounds`]). Answers (round, contender, sample) in the order run.
pub(super) async fn throughput_rounds(
    c: &Arc<Contenders>,
    concurrency: u64,
    n: u64,
) -> anyhow::Result<Vec<(usize, Who, Sample)>> {
    let warm_up = format!("warm:{concurrency}");
    rotated_rounds(
        &Who::ALL,
        THROUGHPUT_ROUNDS,
        async |who| run_pairs(c, who, concurrency, WARMUP_PAIRS, &warm_up).await,
        async |round, who| {
            let tag = format!("{round}:{concurrency}");
            measure(c, who, concurrency, n, &tag).await
        },
    )
    .await
}

/// A contender's medians over the rounds.
#[derive(Clone, Debug, Default)]
pub(super) struct Medians {
    pub(super) pairs_per_s: f64,
    pub(super) client_us: f64,
    pub(super) server_us: f64,
    pub(super) client_wait_us: f64,
    pub(super) server_wait_us: f64,
    pub(super) command_us: f64,
    /// Command → (calls, usec) per pair, medians.
    pub(super) commands: BTreeMap<String, (f64, f64)>,
}

pub(super) fn medians(samples: &[(usize, Who, Sample)]) -> BTreeMap<Who, Medians> {
    let mut out = BTreeMap::new();
    for who in Who::ALL {
        let mine: Vec<&Sample> = samples
            .iter()
            .filter(|(_, w, _)| *w == who)
            .map(|(_, _, s)| s)
            .collect();
        let of = |f: &dyn Fn(&Sample) -> f64| median(mine.iter().map(|s| f(s)).collect());
        let names: std::collections::BTreeSet<&String> =
            mine.iter().flat_map(|s| s.commands.keys()).collect();
        let commands = names
            .into_iter()
            .map(|name| {
                let get = |s: &Sample| s.commands.get(name).copied().unwrap_or((0.0, 0.0));
                (name.clone(), (of(&|s| get(s).0), of(&|s| get(s).1)))
            })
            .collect();
        out.insert(
            who,
            Medians {
                pairs_per_s: of(&|s| s.pair.pairs_per_s),
                client_us: of(&|s| s.pair.client_us),
                server_us: of(&|s| s.pair.server_us),
                client_wait_us: of(&|s| s.pair.client_wait_us),
                server_wait_us: of(&|s| s.pair.server_wait_us),
                command_us: of(&|s| s.command_us(who)),
                commands,
            },
        );
    }
    out
}

/// Client CPU over a section, two ways: the per-thread ns counters summed
/// (what the per-run figures use) and the process's tick counters.
pub(super) struct CpuCheck {
    pub(super) threads_ns: u64,
    pub(super) ticks_s: f64,
}

impl CpuCheck {
    pub(super) fn start() -> anyhow::Result<CpuCheck> {
        Ok(CpuCheck {
            threads_ns: client_cpu_ns()?,
            ticks_s: cpu_seconds()?,
        })
    }

    /// (threads' sum, process ticks) since `start`, seconds.
    pub(super) fn since(&self) -> anyhow::Result<(f64, f64)> {
        Ok((
            (client_cpu_ns()? - self.threads_ns) as f64 / 1e9,
            cpu_seconds()? - self.ticks_s,
        ))
    }
}

/// The pinned concurrency-1 section's child: `URL RUN SERVER_PID`. Prints its affinity,
/// one `sample` line per run and a CPU cross-check line.
pub(super) async fn pinned_child(args: &[String]) -> anyhow::Result<()> {
    let [url, run, server_pid] = args else {
        anyhow::bail!("usage: --pinned-c1 URL RUN SERVER_PID");
    };
    let c = Contenders::connect(url, run.parse()?, server_pid.parse()?).await?;
    report_affinity()?;
    let check = CpuCheck::start()?;
    let samples = throughput_rounds(&c, 1, C1_PAIRS).await?;
    let (threads, ticks) = check.since()?;
    for (round, who, sample) in samples {
        println!("sample\t{round}\t{}\t{}", who.id(), sample.encode());
    }
    println!("check\t{threads}\t{ticks}");
    Ok(())
}

/// What the parent gets back from the concurrency-1 section.
pub(super) struct C1 {
    pub(super) samples: Vec<(usize, Who, Sample)>,
    pub(super) pinned: bool,
    pub(super) check: (f64, f64),
}

/// Runs the concurrency-1 section in a child of this program, pinned with the
/// server to [`PINNED_CPU`] when `taskset` is there.
pub(super) fn concurrency_1(url: &str, server_pid: u32, run: u64) -> anyhow::Result<C1> {
    let (run, pid) = (run.to_string(), server_pid.to_string());
    let child_args = ["--pinned-c1", url, &run, &pid];
    let child = run_pinned_child(
        PINNED_CPU,
        || PinnedServer::pin(server_pid, PINNED_CPU),
        &child_args,
    )?;
    let mut c1 = C1 {
        samples: Vec::new(),
        pinned: child.pinned,
        check: (0.0, 0.0),
    };
    for line in child.output.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields.as_slice() {
            ["sample", round, who, rest @ ..] => {
                c1.samples
                    .push((round.parse()?, Who::from_id(who)?, Sample::decode(rest)?));
            }
            ["check", threads, ticks] => c1.check = (threads.parse()?, ticks.parse()?),
            _ => anyhow::bail!("unexpected line from the concurrency-1 child: {line:?}"),
        }
    }
    anyhow::ensure!(
        c1.samples.len() == THROUGHPUT_ROUNDS * Who::ALL.len(),
        "the concurrency-1 child reported {} runs",
        c1.samples.len()
    );
    Ok(c1)
}

/// Section 1's figures: concurrency 1 (pinned, in a child) and 64.
pub(super) struct Throughput {
    /// The concurrency-1 run.
    pub(super) c1: C1,
    /// Its label (pinned or not).
    pub(super) c1_label: String,
    /// (label, pairs per run, medians by contender) at concurrency 1, then 64.
    pub(super) sections: [(String, u64, BTreeMap<Who, Medians>); 2],
}

/// Section 1: the throughput table, the server's command time per pair and
/// the chart's throughput bars.
pub(super) async fn throughput_section(
    c: &Arc<Contenders>,
    url: &str,
    server_pid: u32,
    run: u64,
    out: &mut String,
    chart: &mut Chart,
) -> anyhow::Result<Throughput> {
    let c1 = concurrency_1(url, server_pid, run)?;
    let c1_label = if c1.pinned {
        format!("c=1, pinned to CPU {PINNED_CPU} (client and server)")
    } else {
        "c=1 (unpinned, not gated)".to_owned()
    };
    let check64 = CpuCheck::start()?;
    let c64_samples = throughput_rounds(c, 64, C64_PAIRS).await?;
    let check64 = check64.since()?;
    let c64_label = "c=64, unpinned (both CPUs)".to_owned();
    let sections = [
        (c1_label.clone(), C1_PAIRS, medians(&c1.samples)),
        (c64_label.clone(), C64_PAIRS, medians(&c64_samples)),
    ];

    writeln!(
        out,
        "## Throughput: uncontended acquire+release pairs over distinct keys\n"
    )?;
    writeln!(
        out,
        "| concurrency | contender | pairs/s | × floor | client CPU µs/pair | server CPU µs/pair | × floor's server CPU | server command µs/pair | waiting for a CPU µs/pair, client / server |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|")?;
    for (label, _, m) in &sections {
        let floor = &m[&Who::Floor];
        let mut bars = Vec::new();
        for who in [
            Who::Dlock,
            Who::Unfenced,
            Who::Floor,
            Who::Same,
            Who::Rslock,
        ] {
            let x = &m[&who];
            writeln!(
                out,
                "| {label} | {} | {:.0} | {:.2}× | {:.1} | {:.1} | {:.2}× | {:.1} | {:.1} / {:.1} |",
                who.name(),
                x.pairs_per_s,
                x.pairs_per_s / floor.pairs_per_s,
                x.client_us,
                x.server_us,
                x.server_us / floor.server_us,
                x.command_us,
                x.client_wait_us,
                x.server_wait_us
            )?;
            bars.push(Bar {
                name: who.name().into(),
                per_s: x.pairs_per_s,
                client_us: x.client_us,
                server_us: x.server_us,
            });
        }
        chart.throughput.push((label.clone(), bars));
    }
    writeln!(
        out,
        "\n{THROUGHPUT_ROUNDS} interleaved rounds (order rotated each round) after a warm-up; \
         {C1_PAIRS} pairs per run at c=1, {C64_PAIRS} at c=64; medians. \
         CPU per pair measured around each run only. \
         Waiting for a CPU: time runnable but not running (schedstat), the machine's other load."
    )?;
    writeln!(
        out,
        "Client CPU cross-check (threads' schedstat sum vs /proc/self/stat ticks): \
         c=1 section {:.2} s vs {:.2} s, c=64 section {:.2} s vs {:.2} s.",
        c1.check.0, c1.check.1, check64.0, check64.1
    )?;

    writeln!(
        out,
        "\n## Server command time per pair (INFO commandstats, medians)\n"
    )?;
    writeln!(
        out,
        "Commands a script runs are counted on their own rows and inside the script's row.\n"
    )?;
    writeln!(
        out,
        "| concurrency | contender | its scripts and direct commands, µs/pair | commands: calls/pair × µs/call |"
    )?;
    writeln!(out, "|---|---|---:|---|")?;
    for (label, _, m) in &sections {
        for who in [
            Who::Dlock,
            Who::Unfenced,
            Who::Same,
            Who::Floor,
            Who::Rslock,
        ] {
            let commands: Vec<String> = m[&who]
                .commands
                .iter()
                .filter(|(_, (calls, _))| *calls >= 0.01)
                .map(|(name, (calls, usec))| format!("{name} {calls:.2} × {:.2}", usec / calls))
                .collect();
            writeln!(
                out,
                "| {label} | {} | {:.1} | {} |",
                who.name(),
                m[&who].command_us,
                commands.join(", ")
            )?;
        }
    }

    Ok(Throughput {
        c1,
        c1_label,
        sections,
    })
}

/// Where the server's time goes: each half of a pair on its own, c=64.
pub(super) async fn halves_section(c: &Arc<Contenders>, out: &mut String) -> anyhow::Result<()> {
    writeln!(
        out,
        "\n## The server's cost of each half, c=64 ({C64_PAIRS} steps, acquisitions then releases; medians of {SPLIT_ROUNDS})\n"
    )?;
    writeln!(
        out,
        "| step | server CPU µs/step | commands: calls/step × µs/call |"
    )?;
    writeln!(out, "|---|---:|---|")?;
    let mut split: BTreeMap<&str, (Vec<f64>, Vec<Commands>)> = BTreeMap::new();
    for round in 0..SPLIT_ROUNDS {
        for (acquire, release) in [
            (Step::FloorSet, Step::FloorUnlock),
            (Step::SameAcquire, Step::SameRelease),
        ] {
            let tag = format!("split:{round}");
            for s in [acquire, release] {
                let (cpu, commands) = measure_steps(c, s, 64, C64_PAIRS, &tag).await?;
                let entry = split.entry(s.name()).or_default();
                entry.0.push(cpu);
                entry.1.push(commands);
            }
        }
    }
    for s in [
        Step::FloorSet,
        Step::FloorUnlock,
        Step::SameAcquire,
        Step::SameRelease,
    ] {
        let (cpu, runs) = &split[s.name()];
        let names: std::collections::BTreeSet<&String> =
            runs.iter().flat_map(|r| r.keys()).collect();
        let commands: Vec<String> = names
            .into_iter()
            .filter_map(|name| {
                let get = |i: usize| {
                    runs.iter()
                        .map(|r| r.get(name).map_or(0.0, |v| [v.0, v.1][i]))
                        .collect()
                };
                let (calls, usec) = (median(get(0)), median(get(1)));
                (calls >= 0.01).then(|| format!("{name} {calls:.2} × {:.2}", usec / calls))
            })
            .collect();
        writeln!(
            out,
            "| {} | {:.1} | {} |",
            s.name(),
            median(cpu.clone()),
            commands.join(", ")
        )?;
    }

    Ok(())
}

/// The first rows of the comparison table: dlock's pairs/s against each
/// baseline's.
pub(super) fn comparison_rows(t: &Throughput) -> anyhow::Result<String> {
    let mut table = String::new();
    writeln!(table, "\n## dlock against the baselines\n")?;
    writeln!(table, "| measure | dlock | baseline | ratio |")?;
    writeln!(table, "|---|---:|---:|---:|")?;
    for (label, _, m) in t.sections.iter() {
        let ours = m[&Who::Dlock].pairs_per_s;
        for who in [Who::Floor, Who::Rslock, Who::Same] {
            let base = m[&who].pairs_per_s;
            writeln!(
                table,
                "| acquire+release/s, {label} | {ours:.0} | {} {base:.0} | {:.2}× |",
                who.name(),
                ours / base
            )?;
        }
        let unfenced = m[&Who::Unfenced].pairs_per_s;
        for who in [Who::Floor, Who::Rslock, Who::Dlock] {
            let base = m[&who].pairs_per_s;
            writeln!(
                table,
                "| unfenced acquire+release/s, {label} | {unfenced:.0} | {} {base:.0} | {:.2}× |",
                who.name(),
                unfenced / base
            )?;
        }
    }

    Ok(table)
}
