//! Interleaved rounds and the pinned child: how the benchmarks that pit
//! several contenders against each other run them.

use std::process::{Command, Stdio};

/// A warm-up run of each of `all`, then `rounds` rounds, each running every
/// contender once in an order rotated by one each round (so no contender
/// always runs first, or right after the same neighbour). `measure(round,
/// who)` runs and measures one. Answers (round, contender, sample) in the
/// order run.
pub(crate) async fn rotated_rounds<W: Copy, S>(
    all: &[W],
    rounds: usize,
    mut warm_up: impl AsyncFnMut(W),
    mut measure: impl AsyncFnMut(usize, W) -> anyhow::Result<S>,
) -> anyhow::Result<Vec<(usize, W, S)>> {
    for &who in all {
        warm_up(who).await;
    }
    let mut samples = Vec::new();
    for round in 0..rounds {
        let mut order = all.to_vec();
        order.rotate_left(round % all.len());
        for who in order {
            samples.push((round, who, measure(round, who).await?));
        }
    }
    Ok(samples)
}

/// The median over the rounds of `f` of `who`'s samples.
pub(crate) fn median_of<W: PartialEq, S>(
    samples: &[(usize, W, S)],
    who: &W,
    f: impl Fn(&S) -> f64,
) -> f64 {
    super::median(
        samples
            .iter()
            .filter(|(_, w, _)| w == who)
            .map(|(_, _, s)| f(s))
            .collect(),
    )
}

/// Runs this program again with `args`, under `taskset -c CPU` when `cpu` is
/// given, its errors on this process's stderr; answers its output, and fails
/// if it failed.
pub(crate) fn run_child(cpu: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
    let exe = std::env::current_exe()?;
    let mut command = match cpu {
        Some(cpu) => {
            let mut command = Command::new("taskset");
            command.args(["-c", cpu]).arg(&exe);
            command
        }
        None => Command::new(&exe),
    };
    let output = command.args(args).stderr(Stdio::inherit()).output()?;
    anyhow::ensure!(
        output.status.success(),
        "the child {args:?} failed ({}); its messages are above",
        output.status
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// What a pinned child prints first: the CPUs it runs on.
const AFFINITY: &str = "affinity";

/// In a child run by [`run_pinned_child`]: prints the CPUs this process runs
/// on, for the parent to check.
pub(crate) fn report_affinity() -> anyhow::Result<()> {
    println!("{AFFINITY}\t{}", super::cpu::cpus_allowed("self")?);
    Ok(())
}

/// What [`run_pinned_child`] answers.
pub(crate) struct ChildRun {
    /// The child's output but for its affinity line.
    pub(crate) output: String,
    /// Whether it ran pinned.
    pub(crate) pinned: bool,
}

/// Runs this program again with `args` under `taskset -c CPU`, while the
/// servers `pin` pins share that CPU (their former affinity restored after),
/// and checks the CPUs the child reported ([`report_affinity`]). Without
/// `taskset` it runs unpinned, and says so.
pub(crate) fn run_pinned_child(
    cpu: &str,
    pin: impl FnOnce() -> anyhow::Result<super::cpu::PinnedServer>,
    args: &[&str],
) -> anyhow::Result<ChildRun> {
    let pinned = super::cpu::has_taskset();
    let output = if pinned {
        let _pinned_servers = pin()?;
        run_child(Some(cpu), args)?
    } else {
        println!(
            "taskset not found (util-linux): the pinned section runs unpinned, and is not gated"
        );
        run_child(None, args)?
    };
    let mut rest = String::new();
    for line in output.lines() {
        match line
            .strip_prefix(AFFINITY)
            .and_then(|l| l.strip_prefix('\t'))
        {
            Some(cpus) => anyhow::ensure!(
                !pinned || cpus == cpu,
                "the pinned child runs on CPUs {cpus}, not {cpu}"
            ),
            None => {
                rest.push_str(line);
                rest.push('\n');
            }
        }
    }
    Ok(ChildRun {
        output: rest,
        pinned,
    })
}

/// One run of one contender, per pair: its rate and the CPU time on both
/// sides.
#[derive(Clone, Debug, Default)]
pub(crate) struct PairSample {
    pub(crate) pairs_per_s: f64,
    /// This process's CPU time, µs.
    pub(crate) client_us: f64,
    /// The server's CPU time, µs.
    pub(crate) server_us: f64,
    /// Time this process's threads and the server's spent runnable but
    /// waiting for a CPU (schedstat), µs: the machine's other load.
    pub(crate) client_wait_us: f64,
    pub(crate) server_wait_us: f64,
}

impl PairSample {
    /// How many numbers it holds.
    pub(crate) const FIELDS: usize = 5;

    /// Its numbers, in the order of the fields.
    pub(crate) fn values(&self) -> [f64; PairSample::FIELDS] {
        [
            self.pairs_per_s,
            self.client_us,
            self.server_us,
            self.client_wait_us,
            self.server_wait_us,
        ]
    }

    /// Tab-separated, for a pinned child's output.
    pub(crate) fn encode(&self) -> String {
        self.values().map(|v| v.to_string()).join("\t")
    }

    /// What [`PairSample::encode`] wrote, split at the tabs.
    pub(crate) fn decode(fields: &[&str]) -> anyhow::Result<PairSample> {
        let values: Vec<f64> = fields
            .iter()
            .map(|f| f.parse::<f64>())
            .collect::<Result<_, _>>()?;
        let [
            pairs_per_s,
            client_us,
            server_us,
            client_wait_us,
            server_wait_us,
        ] = values[..]
        else {
            anyhow::bail!("bad sample {fields:?}");
        };
        Ok(PairSample {
            pairs_per_s,
            client_us,
            server_us,
            client_wait_us,
            server_wait_us,
        })
    }
}
