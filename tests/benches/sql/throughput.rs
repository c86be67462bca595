//! Throughput: interleaved rounds of uncontended acquire+release pairs, CPU
//! per pair on both sides, and the pinned concurrency-1 child.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::contenders::{Contenders, Who, pair};
use super::server::Flavor;
use super::{PINNED_CPU, Plan};
use crate::common::cpu::{PinnedServer, process_tree, schedstat, thread_cpus, tree_schedstat};
pub(super) use crate::common::rounds::PairSample as Sample;
use crate::common::rounds::{median_of, report_affinity, rotated_rounds, run_pinned_child};
use crate::common::spread;

/// The servers' processes: PostgreSQL's postmaster (its backends are its
/// children) and MariaDB's one process.
#[derive(Clone, Copy, Debug)]
pub(super) struct ServerPids {
    pub(super) postgres: u32,
    pub(super) mariadb: u32,
}

impl ServerPids {
    /// The CPU time of `flavor`'s server (all its processes and threads), ns,
    /// and its time runnable but waiting for a CPU.
    fn schedstat(self, flavor: Flavor) -> anyhow::Result<(u64, u64)> {
        match flavor {
            Flavor::Postgres => tree_schedstat(self.postgres),
            Flavor::MariaDb => schedstat(&self.mariadb.to_string()),
        }
    }

    /// Every server process (PostgreSQL: the postmaster and its children).
    fn all(self) -> anyhow::Result<Vec<u32>> {
        let mut pids = process_tree(self.postgres)?;
        pids.push(self.mariadb);
        Ok(pids)
    }
}

/// `n` pairs of `who` over distinct keys, by `concurrency` tasks at once.
async fn run_pairs(c: &Arc<Contenders>, who: Who, concurrency: u64, n: u64, tag: &str) {
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

/// Runs `n` pairs of `who` and measures them: wall time, this process's CPU
/// time and its server's, around that run only.
async fn measure(
    c: &Arc<Contenders>,
    pids: ServerPids,
    who: Who,
    concurrency: u64,
    n: u64,
    tag: &str,
) -> anyhow::Result<Sample> {
    let server_before = pids.schedstat(who.server())?;
    let client_before = schedstat("self")?;
    let started = Instant::now();
    run_pairs(c, who, concurrency, n, tag).await;
    let elapsed = started.elapsed();
    let client_after = schedstat("self")?;
    let server_after = pids.schedstat(who.server())?;
    let per_pair =
        |before: u64, after: u64| after.saturating_sub(before) as f64 / 1000.0 / n as f64;
    Ok(Sample {
        pairs_per_s: n as f64 / elapsed.as_secs_f64(),
        client_us: per_pair(client_before.0, client_after.0),
        server_us: per_pair(server_before.0, server_after.0),
        client_wait_us: per_pair(client_before.1, client_after.1),
        server_wait_us: per_pair(server_before.1, server_after.1),
    })
}

/// The throughput section at one concurrency: a warm-up run of each
/// contender, then `plan.rounds` interleaved rounds ([`rotated_rounds`]).
pub(super) async fn throughput_rounds(
    c: &Arc<Contenders>,
    pids: ServerPids,
    plan: &Plan,
    concurrency: u64,
    n: u64,
) -> anyhow::Result<Vec<(usize, Who, Sample)>> {
    let warm_up = format!("warm:{concurrency}");
    rotated_rounds(
        &Who::ALL,
        plan.rounds,
        async |who| run_pairs(c, who, concurrency, plan.warmup_pairs, &warm_up).await,
        async |round, who| {
            let tag = format!("{round}:{concurrency}");
            measure(c, pids, who, concurrency, n, &tag).await
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
}

pub(super) fn medians(samples: &[(usize, Who, Sample)]) -> BTreeMap<Who, Medians> {
    Who::ALL
        .into_iter()
        .map(|who| {
            let of = |f: fn(&Sample) -> f64| median_of(samples, &who, f);
            let m = Medians {
                pairs_per_s: of(|s| s.pairs_per_s),
                client_us: of(|s| s.client_us),
                server_us: of(|s| s.server_us),
                client_wait_us: of(|s| s.client_wait_us),
                server_wait_us: of(|s| s.server_wait_us),
            };
            (who, m)
        })
        .collect()
}

/// The pinned concurrency-1 section's child: `PG_URL MY_URL RUN PG_PID
/// MARIADB_PID ROUNDS PAIRS WARMUP_PAIRS`. Prints its affinity, one `sample`
/// line per run, and, while its connections are still open, one `server`
/// line per server thread with its CPUs (the PostgreSQL backends serving
/// this process included).
pub(super) async fn pinned_child(args: &[String]) -> anyhow::Result<()> {
    let [
        pg_url,
        my_url,
        run,
        pg_pid,
        my_pid,
        rounds,
        pairs,
        warmup_pairs,
    ] = args
    else {
        anyhow::bail!(
            "usage: --pinned-c1 PG_URL MY_URL RUN PG_PID MARIADB_PID ROUNDS PAIRS WARMUP_PAIRS"
        );
    };
    let pids = ServerPids {
        postgres: pg_pid.parse()?,
        mariadb: my_pid.parse()?,
    };
    let plan = Plan {
        rounds: rounds.parse()?,
        c1_pairs: pairs.parse()?,
        warmup_pairs: warmup_pairs.parse()?,
        ..Plan::full()
    };
    let c = Contenders::connect(pg_url, my_url, run.parse()?, 1).await?;
    report_affinity()?;
    let samples = throughput_rounds(&c, pids, &plan, 1, plan.c1_pairs).await?;
    for (round, who, sample) in samples {
        println!("sample\t{round}\t{}\t{}", who.id(), sample.encode());
    }
    for pid in pids.all()? {
        for (tid, cpus) in thread_cpus(pid)? {
            println!("server\t{pid}/{tid}\t{cpus}");
        }
    }
    Ok(())
}

/// What the parent gets back from the concurrency-1 section.
pub(super) struct C1 {
    pub(super) samples: Vec<(usize, Who, Sample)>,
    pub(super) pinned: bool,
    /// Server threads seen on the pinned CPU while the child ran.
    pub(super) server_threads: usize,
}

/// Runs the concurrency-1 section in a child of this program, pinned with the
/// servers to [`PINNED_CPU`] when `taskset` is there: every thread of MariaDB
/// and of PostgreSQL's processes (so the backends the postmaster forks for
/// the child inherit the CPU), checked while the child runs.
pub(super) fn concurrency_1(
    pg_url: &str,
    my_url: &str,
    pids: ServerPids,
    run: u64,
    plan: &Plan,
) -> anyhow::Result<C1> {
    let numbers = [
        run.to_string(),
        pids.postgres.to_string(),
        pids.mariadb.to_string(),
        plan.rounds.to_string(),
        plan.c1_pairs.to_string(),
        plan.warmup_pairs.to_string(),
    ];
    let mut child_args = vec!["--pinned-c1", pg_url, my_url];
    child_args.extend(numbers.iter().map(String::as_str));
    let child = run_pinned_child(
        PINNED_CPU,
        || PinnedServer::pin_all(&pids.all()?, PINNED_CPU),
        &child_args,
    )?;
    let pinned = child.pinned;
    let mut c1 = C1 {
        samples: Vec::new(),
        pinned,
        server_threads: 0,
    };
    for line in child.output.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields.as_slice() {
            ["server", thread, cpus] => {
                anyhow::ensure!(
                    !pinned || *cpus == PINNED_CPU,
                    "server thread {thread} ran on CPUs {cpus} during the pinned section, not {PINNED_CPU}"
                );
                c1.server_threads += 1;
            }
            ["sample", round, who, rest @ ..] => {
                c1.samples
                    .push((round.parse()?, Who::from_id(who)?, Sample::decode(rest)?));
            }
            _ => anyhow::bail!("unexpected line from the concurrency-1 child: {line:?}"),
        }
    }
    anyhow::ensure!(
        c1.samples.len() == plan.rounds * Who::ALL.len(),
        "the concurrency-1 child reported {} runs",
        c1.samples.len()
    );
    Ok(c1)
}
