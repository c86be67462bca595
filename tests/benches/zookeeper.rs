//! dlock on ZooKeeper against the same calls written by hand and against
//! kazoo's `Lock`, in one run, as ratios.
//!
//! ```sh
//! scripts/servers.sh up
//! cargo bench -p dlock-tests --features zookeeper --bench zookeeper
//! ```
//!
//! 1. **Uncontended acquire+release** per second, at concurrency 1 (one key,
//!    again and again) and 16 (a key per task): dlock's guard (tracing span,
//!    watchdog registration, the I/O runtime hop included) against the floor,
//!    the same ZooKeeper calls written by hand on one `zookeeper-client`
//!    session — create an ephemeral-sequential child, list the children,
//!    delete the child — and against kazoo's `Lock` (Python, installed with
//!    `pip install kazoo` into a virtual environment under `target/`; if that
//!    fails the output says so and only that contender is skipped).
//! 2. **Handoff** on one hot key: a convoy of 16 tasks (kazoo: threads) that
//!    start together, each acquires once, holds 1 ms and releases. Per
//!    handoff = (wall time − the holds) / 15, the holds as measured; median of
//!    several convoys.
//!
//! It prints a Markdown table.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::{MemoryBackend, Registry, ZooKeeperBackend};
use zookeeper_client::{Acls, Client, CreateMode};

mod common;
use common::{CONVOY, CONVOYS, ROUNDS, convoy, handoffs, hold, median, throughput};

const PAIRS_C1: u64 = 1_000;
const PAIRS_C16: u64 = 4_000;

fn zk_url() -> String {
    std::env::var("DLOCK_TEST_ZK_URL").unwrap_or_else(|_| "zk://127.0.0.1:42181/dlock-test".into())
}

fn hosts(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    rest[..end].to_owned()
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench())
}

struct Contenders {
    dlock: Registry,
    /// The hand-written floor's session, at the root.
    hand: Client,
    /// Where the hand-written locks live.
    hand_root: String,
    run: u64,
}

/// The hand-written lock: create an ephemeral-sequential child of `parent`
/// (and the parent, a container, when the server has reaped it), list the
/// children, check that ours is the lowest, delete it.
async fn hand_pair(client: &Client, parent: &str) {
    let prefix = format!("{parent}/lock-");
    let create = || {
        client.create(
            &prefix,
            b"owner",
            &CreateMode::EphemeralSequential.with_acls(Acls::anyone_all()),
        )
    };
    let (_, seq) = match create().await {
        Err(zookeeper_client::Error::NoNode) => {
            match client
                .create(
                    parent,
                    &[],
                    &CreateMode::Container.with_acls(Acls::anyone_all()),
                )
                .await
            {
                Ok(_) | Err(zookeeper_client::Error::NodeExists) => {}
                Err(e) => panic!("container: {e}"),
            }
            create().await
        }
        created => created,
    }
    .expect("create");
    let ours = format!("lock-{seq}");
    let children = client.list_children(parent).await.expect("children");
    let lowest = children
        .iter()
        .filter_map(|c| c.strip_prefix("lock-")?.parse::<i32>().ok())
        .min();
    assert_eq!(lowest, Some(seq.into_i64() as i32), "uncontended");
    client
        .delete(&format!("{parent}/{ours}"), None)
        .await
        .expect("delete");
}

async fn bench() -> anyhow::Result<()> {
    let url = zk_url();
    // The global registry stays empty-handed (memory); ZooKeeper is a
    // registry of its own, the same code path as the global one.
    dlock_runtime::init(
        Registry::builder()
            .default_backend(MemoryBackend::new())
            .build(),
    )?;
    let backend = ZooKeeperBackend::connect(&url)
        .await
        .map_err(|e| anyhow::anyhow!("{e}: start the servers first (scripts/servers.sh up)"))?;
    let hand = Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(&hosts(&url))
        .await?;
    let run: u64 = rand::random();
    let hand_root = format!("/dlock-bench-hand-{run:x}");
    hand.create(
        &hand_root,
        &[],
        &CreateMode::Persistent.with_acls(Acls::anyone_all()),
    )
    .await?;
    let c = Arc::new(Contenders {
        dlock: Registry::builder().default_backend(backend).build(),
        hand,
        hand_root,
        run,
    });

    let kazoo = Kazoo::prepare(&hosts(&url));

    let mut table = String::new();
    writeln!(table, "| measure | dlock | baseline | ratio |")?;
    writeln!(table, "|---|---:|---:|---:|")?;

    // 1. Uncontended throughput: each task keeps to its own key.
    for (concurrency, n) in [(1u64, PAIRS_C1), (16, PAIRS_C16)] {
        let (mut ours, mut floor) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            floor.push(
                throughput(concurrency, n, {
                    let c = c.clone();
                    move |i| {
                        let (c, task) = (c.clone(), i % concurrency);
                        async move {
                            hand_pair(&c.hand, &format!("{}/k{task}", c.hand_root)).await;
                        }
                    }
                })
                .await,
            );
            ours.push(
                throughput(concurrency, n, {
                    let c = c.clone();
                    move |i| {
                        let task = i % concurrency;
                        let (c, key) = (c.clone(), format!("bench:{}:{round}:{task}", c.run));
                        async move {
                            let guard = c
                                .dlock
                                .lock(key)
                                .lease(Duration::from_secs(30))
                                .acquire()
                                .await
                                .expect("acquire");
                            guard.release().await.expect("release");
                        }
                    }
                })
                .await,
            );
        }
        let (ours, floor) = (median(ours), median(floor));
        writeln!(
            table,
            "| acquire+release/s, c={concurrency} | {ours:.0} | hand-written zookeeper-client {floor:.0} | {:.2}× |",
            ours / floor
        )?;
        if concurrency == 1 {
            match &kazoo {
                Ok(kazoo) => match kazoo.results() {
                    Ok(k) => {
                        writeln!(
                            table,
                            "| acquire+release/s, c=1 | {ours:.0} | kazoo Lock {:.0} | {:.2}× |",
                            k.rate,
                            ours / k.rate
                        )?;
                    }
                    Err(e) => println!("kazoo contender skipped: {e}"),
                },
                Err(e) => println!("kazoo contender skipped: {e}"),
            }
        }
    }

    // 2. Handoff.
    let dlock_convoy = handoffs(|k| {
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
                    .expect("acquire");
                let held = hold().await;
                guard.release().await.expect("release");
                held
            }
        })
    })
    .await;
    match kazoo.as_ref().map(Kazoo::results) {
        Ok(Ok(k)) => writeln!(
            table,
            "| handoff, {CONVOY}-task convoy, ms | {dlock_convoy:.3} | kazoo Lock, {CONVOY} threads {:.3} | {:.2}× faster |",
            k.handoff_ms,
            k.handoff_ms / dlock_convoy
        )?,
        _ => writeln!(
            table,
            "| handoff, {CONVOY}-task convoy, ms | {dlock_convoy:.3} | (kazoo skipped) | |"
        )?,
    }

    print!("{table}");
    println!(
        "\n{ROUNDS} rounds of each throughput pair (alternating), {CONVOYS} convoys per handoff \
         contender, medians. Server: {url}"
    );
    for child in c.hand.list_children(&c.hand_root).await.unwrap_or_default() {
        let _ = c
            .hand
            .delete(&format!("{}/{child}", c.hand_root), None)
            .await;
    }
    let _ = c.hand.delete(&c.hand_root, None).await;
    Ok(())
}

/// kazoo's `Lock`, measured by a Python program in a virtual environment.
struct Kazoo {
    python: PathBuf,
    script: PathBuf,
    hosts: String,
    results: std::sync::OnceLock<Result<KazooResults, String>>,
}

#[derive(Clone, Copy)]
struct KazooResults {
    rate: f64,
    handoff_ms: f64,
}

const KAZOO_SCRIPT: &str = r#"
import json, sys, threading, time
from kazoo.client import KazooClient

hosts, root, n, rounds, convoy, convoys = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
zk = KazooClient(hosts=hosts, timeout=10.0)
zk.start()
lock = zk.Lock(root + "/uncontended", "bench")
for _ in range(50):
    lock.acquire(); lock.release()
rates = []
for _ in range(rounds):
    started = time.perf_counter()
    for _ in range(n):
        lock.acquire(); lock.release()
    rates.append(n / (time.perf_counter() - started))

def one_convoy(k):
    barrier = threading.Barrier(convoy + 1)
    holds = [0.0] * convoy
    def run(i):
        l = zk.Lock("%s/convoy-%d" % (root, k), str(i))
        barrier.wait()
        l.acquire(timeout=30)
        s = time.perf_counter()
        time.sleep(0.001)
        holds[i] = time.perf_counter() - s
        l.release()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(convoy)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return (time.perf_counter() - started - sum(holds)) * 1000.0 / (convoy - 1)

handoffs = sorted(one_convoy(k) for k in range(convoys))
rates.sort()
print(json.dumps({"rate": rates[len(rates) // 2], "handoff_ms": handoffs[len(handoffs) // 2]}))
zk.delete(root, recursive=True)
zk.stop()
"#;

impl Kazoo {
    /// A virtual environment with kazoo under the target directory (made
    /// once, reused), and the script next to it.
    fn prepare(hosts: &str) -> Result<Kazoo, String> {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
        let venv = target.join("zk-bench-venv");
        let python = venv.join("bin/python");
        let has_kazoo = |python: &PathBuf| {
            std::process::Command::new(python)
                .args(["-c", "import kazoo"])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if !has_kazoo(&python) {
            let made = std::process::Command::new("python3")
                .args(["-m", "venv"])
                .arg(&venv)
                .output()
                .map_err(|e| format!("python3 -m venv: {e}"))?;
            if !made.status.success() {
                return Err(format!(
                    "python3 -m venv failed: {}",
                    String::from_utf8_lossy(&made.stderr).trim()
                ));
            }
            let pip = std::process::Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet", "kazoo"])
                .output()
                .map_err(|e| format!("pip install kazoo: {e}"))?;
            if !pip.status.success() || !has_kazoo(&python) {
                return Err(format!(
                    "pip install kazoo failed: {}",
                    String::from_utf8_lossy(&pip.stderr).trim()
                ));
            }
        }
        let script = target.join("zk-bench-kazoo.py");
        std::fs::write(&script, KAZOO_SCRIPT).map_err(|e| format!("writing the script: {e}"))?;
        Ok(Kazoo {
            python,
            script,
            hosts: hosts.to_owned(),
            results: std::sync::OnceLock::new(),
        })
    }

    /// Runs the script once (the first call) and answers its figures.
    fn results(&self) -> Result<KazooResults, String> {
        self.results
            .get_or_init(|| {
                let root = format!("/dlock-bench-kazoo-{:x}", rand::random::<u64>());
                let out = std::process::Command::new(&self.python)
                    .arg(&self.script)
                    .args([
                        self.hosts.as_str(),
                        root.as_str(),
                        &PAIRS_C1.to_string(),
                        &ROUNDS.to_string(),
                        &CONVOY.to_string(),
                        &CONVOYS.to_string(),
                    ])
                    .output()
                    .map_err(|e| format!("running kazoo: {e}"))?;
                if !out.status.success() {
                    return Err(format!(
                        "the kazoo script failed: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
                let text = String::from_utf8_lossy(&out.stdout);
                let line = text.lines().last().unwrap_or("");
                let field = |name: &str| -> Result<f64, String> {
                    let at = line
                        .find(&format!("\"{name}\": "))
                        .ok_or_else(|| format!("no {name} in {line:?}"))?;
                    let rest = &line[at + name.len() + 4..];
                    let end = rest.find([',', '}']).unwrap_or(rest.len());
                    rest[..end]
                        .trim()
                        .parse()
                        .map_err(|e| format!("bad {name} in {line:?}: {e}"))
                };
                Ok(KazooResults {
                    rate: field("rate")?,
                    handoff_ms: field("handoff_ms")?,
                })
            })
            .clone()
    }
}
