//! The orchestrator: starts the fenced store, the servers it owns (the main
//! backend's and the side backend's), one proxy per worker, the worker processes
//! and the nemesis; stops everything; inspects both backends for keys left
//! behind; hands the histories to the checker.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::Mutex;

use crate::checker::{self, RunMeta, Summary};
use crate::history::{
    FaultEvent, Phase, Record, RevocationEvent, SessionKillEvent, Step, WorkerEvent, WorkerLine,
};
use crate::proxy::Proxy;
use crate::servers::Server;
use crate::store::Mode;
use crate::worker::{INITIAL_BALANCE, MAX_LEASE, PERMITS, Workload};
use dlock_runtime::HoldMode;

/// Which lock service a run exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Backend {
    /// A SQLite file shared by the workers (faults: pauses and kills of workers).
    Sqlite,
    /// One Redis the harness runs, behind a fault proxy per worker (adds server
    /// kills with and without persistence, delays, black holes and resets).
    Redis,
    /// Five Redis masters the harness runs (adds minority outages and the loss of
    /// a node of the holder's majority). Redlock has no fencing token: the store
    /// compares versions instead.
    Redlock,
    /// One ZooKeeper the harness runs, behind a fault proxy per worker (adds
    /// server kills and restarts, delays, black holes, resets and forced session
    /// expiries); the side backend is a SQLite file.
    Zk,
    /// A three-member etcd cluster the harness runs, each worker behind a
    /// fault proxy to one member (adds member kills and restarts, delays,
    /// black holes and resets); the side backend is a SQLite file.
    Etcd,
    /// One PostgreSQL the harness runs, behind a fault proxy per worker (adds
    /// server kills and restarts, delays, black holes, resets; in lease mode a
    /// holder's row deleted or taken over behind its back, in session mode its
    /// connection terminated); the side backend is a SQLite file.
    Postgres,
    /// One MariaDB the harness runs, with the same faults as `postgres`
    /// (`KILL` of a holder's connection in session mode).
    Mysql,
    /// `--url`: any backend the workers can reach (faults: pauses and kills of workers).
    Url,
}

/// How the SQL backends (`postgres`, `mysql`) lock: their URL's `?mode=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SqlMode {
    /// A row per key in the lease table, on the database's clock.
    Lease,
    /// PostgreSQL advisory locks, MySQL `GET_LOCK`: on a connection per held lock.
    Session,
}

/// `dlock-chaos run`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RunArgs {
    /// Lock service to run against.
    #[arg(long, value_enum)]
    pub(crate) backend: Backend,
    /// Backend URL, with `--backend url`.
    #[arg(long, required_if_eq("backend", "url"))]
    pub(crate) url: Option<String>,
    /// With `--backend postgres` or `mysql`: the lease table or session locks.
    #[arg(long, value_enum, default_value_t = SqlMode::Lease)]
    pub(crate) mode: SqlMode,
    /// Worker processes.
    #[arg(long, default_value_t = 8)]
    pub(crate) workers: usize,
    /// Keys the workers share (counter and read-write workloads: 3 by
    /// default; semaphore workload: 2, so that eight workers contend for six
    /// permits).
    #[arg(long)]
    pub(crate) keys: Option<usize>,
    /// What the workers do inside the lock: increment one key's counter,
    /// move an amount between two accounts held in one hold (`lock_all`),
    /// increment the counter of a permit's slot (a semaphore of 3 permits),
    /// or read (readers) and increment (writers, plain locks) a key's counter.
    #[arg(long, value_enum, default_value_t = Workload::Counter)]
    pub(crate) workload: Workload,
    /// Accounts the transfers pick pairs from (transfer workload).
    #[arg(long, default_value_t = 16)]
    pub(crate) accounts: usize,
    /// Run until this many entries into the lock …
    #[arg(long, default_value_t = 2_000)]
    pub(crate) acquisitions: u64,
    /// … and this many faults.
    #[arg(long, default_value_t = 10)]
    pub(crate) faults: u32,
    /// Seed of the nemesis and the workers.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Longest time inside the lock between read and write.
    #[arg(long, default_value_t = 20)]
    pub(crate) hold_max_ms: u64,
    /// Share of the workers' iterations whose caller gives up (a short timeout
    /// around the acquisition, the body or the release).
    #[arg(long, default_value_t = 0.06)]
    pub(crate) give_up_rate: f64,
    /// Share of the workers' iterations that also hold a lock on the side backend.
    #[arg(long, default_value_t = 0.15)]
    pub(crate) side_rate: f64,
    /// First loopback port of the servers the harness runs (Redis from here,
    /// the side Redis at +6, ZooKeeper at +7, PostgreSQL at +8, MariaDB at +9,
    /// etcd's members at +10 to +12, their peer ports at +13 to +15).
    /// Below Linux's ephemeral range (32768–60999): a port in it can be taken
    /// at any moment by the local end of some outgoing connection, and a
    /// restarted server then cannot bind it again.
    #[arg(long, default_value_t = 28379)]
    pub(crate) port_base: u16,
    /// Give up (and fail) after this long.
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    pub(crate) max_duration: Duration,
    /// Where histories go (default: target/chaos/BACKEND-SEED, or
    /// BACKEND-transfer-SEED).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
}

impl RunArgs {
    /// The keys the workers share: `--keys`, or the workload's default.
    pub(crate) fn keys(&self) -> usize {
        self.keys.unwrap_or(match self.workload {
            Workload::Semaphore => 2,
            Workload::Counter | Workload::Transfer | Workload::Rw => 3,
        })
    }
}

/// Where each worker stands, as far as its records say.
#[derive(Default)]
pub(crate) struct Tracker {
    /// Entries into the lock so far.
    pub(crate) acquisitions: u64,
    /// Worker slot → how long it stays after its read (`None` before the read),
    /// while inside the lock.
    pub(crate) inside: HashMap<usize, Option<u64>>,
    /// Worker slot → the key (as the worker names it) it is inside.
    pub(crate) keys: HashMap<usize, String>,
    /// Worker slot → its entries into the lock so far (every incarnation).
    pub(crate) entries: HashMap<usize, u64>,
}

/// A running worker process.
pub(crate) struct WorkerProc {
    pub(crate) child: Child,
    /// Closing it tells the worker to stop.
    pub(crate) stdin: Option<ChildStdin>,
    pub(crate) inc: u32,
}

/// Everything the nemesis acts on.
pub(crate) struct Cluster {
    pub(crate) args: RunArgs,
    pub(crate) run_id: String,
    pub(crate) out: PathBuf,
    pub(crate) store_port: u16,
    pub(crate) workers: Mutex<Vec<WorkerProc>>,
    pub(crate) tracker: Arc<SyncMutex<Tracker>>,
    pub(crate) history: Arc<SyncMutex<std::io::BufWriter<std::fs::File>>>,
    pub(crate) servers: Mutex<Vec<Server>>,
    /// The side backend's Redis (Redis and Redlock runs).
    pub(crate) side_server: Mutex<Option<Server>>,
    pub(crate) proxies: Vec<Proxy>,
}

/// Port of the side backend's Redis, after the main one (`port_base`) and the
/// five Redlock nodes.
fn side_port(args: &RunArgs) -> u16 {
    args.port_base + 6
}

/// Port of the fenced store's own Redis (Redis runs), after MariaDB.
fn store_redis_port(args: &RunArgs) -> u16 {
    args.port_base + 10
}

/// Port of the ZooKeeper server, after the side Redis.
fn zk_port(args: &RunArgs) -> u16 {
    args.port_base + 7
}

/// Port of the PostgreSQL server, after ZooKeeper.
fn pg_port(args: &RunArgs) -> u16 {
    args.port_base + 8
}

/// Port of the MariaDB server, after PostgreSQL.
fn mysql_port(args: &RunArgs) -> u16 {
    args.port_base + 9
}

/// Client ports of the etcd members (peer ports: 3 above each).
fn etcd_ports(args: &RunArgs) -> [u16; 3] {
    [
        args.port_base + 10,
        args.port_base + 11,
        args.port_base + 12,
    ]
}

/// The TTL of the workers' etcd session leases: as ZooKeeper's session
/// timeout, longer than the longest lease, short enough that a killed
/// holder's key frees within the other workers' patience.
pub(crate) const ETCD_SESSION_TTL: Duration = Duration::from_secs(3);

/// The SQL backends' `?timeout=` (bounds every statement): far above a
/// loopback round trip and the proxy's longest delay, below the workers' wait.
const SQL_TIMEOUT: &str = "1s";

/// The session timeout of the workers' ZooKeeper sessions: longer than the
/// longest lease, so that a lease is renewed several times per session timeout,
/// and short enough that a killed holder's key frees within the other workers'
/// patience for a few rounds. A lease outlives neither its session nor its own
/// end (the backend deletes a node it did not renew in time).
pub(crate) const ZK_SESSION_TIMEOUT: Duration = Duration::from_secs(3);

impl Cluster {
    fn worker_url(&self, id: usize) -> String {
        match self.args.backend {
            Backend::Sqlite => format!("sqlite://{}", self.out.join("locks.db").display()),
            Backend::Redis => {
                format!(
                    "redis://127.0.0.1:{}/?timeout=250ms",
                    self.proxies[id].port()
                )
            }
            Backend::Redlock => {
                let nodes: Vec<String> = (1..=5)
                    .map(|i| format!("127.0.0.1:{}", self.args.port_base + i))
                    .collect();
                format!("redlock://{}", nodes.join(","))
            }
            Backend::Zk => format!(
                "zk://127.0.0.1:{}/chaos-{}?session_timeout={}ms",
                self.proxies[id].port(),
                self.run_id,
                ZK_SESSION_TIMEOUT.as_millis()
            ),
            Backend::Etcd => format!(
                "etcd://127.0.0.1:{}/chaos-{}?session_ttl={}s",
                self.proxies[id].port(),
                self.run_id,
                ETCD_SESSION_TTL.as_secs()
            ),
            Backend::Postgres | Backend::Mysql => sql_url(&self.args, self.proxies[id].port()),
            Backend::Url => self.args.url.clone().unwrap_or_default(),
        }
    }

    /// A plain URL of the run's PostgreSQL or MariaDB itself (not through a
    /// proxy), as the user `dlock`, for the harness's own statements; `None`
    /// on other backends.
    pub(crate) async fn sql_admin_url(&self) -> Option<String> {
        let scheme = match self.args.backend {
            Backend::Postgres => "postgres",
            Backend::Mysql => "mysql",
            _ => return None,
        };
        let port = self.servers.lock().await.first()?.port();
        Some(format!("{scheme}://dlock:dlock@127.0.0.1:{port}/dlock"))
    }

    /// The URL an operator would use on the run's main backend: the servers
    /// themselves (never through a worker's proxy), with the workers' chroot
    /// or prefix, for the nemesis' own registry (`revoke`).
    pub(crate) async fn admin_url(&self) -> String {
        match self.args.backend {
            Backend::Sqlite | Backend::Redlock | Backend::Url => self.worker_url(0),
            Backend::Redis => {
                let port = self.servers.lock().await[0].port();
                format!("redis://127.0.0.1:{port}/?timeout=1s")
            }
            Backend::Zk => format!(
                "zk://127.0.0.1:{}/chaos-{}?session_timeout={}ms",
                zk_port(&self.args),
                self.run_id,
                ZK_SESSION_TIMEOUT.as_millis()
            ),
            Backend::Etcd => {
                let members: Vec<String> = etcd_ports(&self.args)
                    .iter()
                    .map(|p| format!("127.0.0.1:{p}"))
                    .collect();
                format!(
                    "etcd://{}/chaos-{}?session_ttl={}s",
                    members.join(","),
                    self.run_id,
                    ETCD_SESSION_TTL.as_secs()
                )
            }
            Backend::Postgres | Backend::Mysql => {
                let port = self.servers.lock().await[0].port();
                sql_url(&self.args, port)
            }
        }
    }

    /// The side backend's URL: a second SQLite file, or a Redis of its own; none
    /// with `--backend url` (the harness cannot stall what it does not own).
    pub(crate) fn side_url(&self) -> Option<String> {
        match self.args.backend {
            Backend::Sqlite | Backend::Zk | Backend::Etcd | Backend::Postgres | Backend::Mysql => {
                Some(format!("sqlite://{}", self.out.join("side.db").display()))
            }
            Backend::Redis | Backend::Redlock => Some(format!(
                "redis://127.0.0.1:{}/?timeout=250ms",
                side_port(&self.args)
            )),
            Backend::Url => None,
        }
    }

    /// Starts worker `id` (incarnation `inc`) and a task copying its records.
    pub(crate) fn spawn_worker(&self, id: usize, inc: u32) -> anyhow::Result<WorkerProc> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.out.join(format!("worker-{id}.log")))?;
        let mut child = Command::new(std::env::current_exe()?)
            .arg("worker")
            .args(["--id", &id.to_string(), "--inc", &inc.to_string()])
            .args([
                "--url",
                &self.worker_url(id),
                "--store-port",
                &self.store_port.to_string(),
            ])
            .args([
                "--run",
                &self.run_id,
                "--keys",
                &self.args.keys().to_string(),
            ])
            .args([
                "--workload",
                workload_name(self.args.workload),
                "--accounts",
                &self.args.accounts.to_string(),
            ])
            .args(["--hold-max-ms", &self.args.hold_max_ms.to_string()])
            .args(["--give-up-rate", &self.args.give_up_rate.to_string()])
            .args(["--side-rate", &self.args.side_rate.to_string()])
            .args(["--seed", &self.args.seed.to_string()])
            .args(
                self.side_url()
                    .map(|url| ["--side-url".to_owned(), url])
                    .into_iter()
                    .flatten(),
            )
            .args(
                (self.args.backend == Backend::Zk)
                    .then(|| {
                        [
                            "--zk-server".to_owned(),
                            format!("127.0.0.1:{}", zk_port(&self.args)),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            .env("RUST_BACKTRACE", "1")
            // A group of its own: when the orchestrator's group is orphaned (run
            // under nohup, say), the kernel sends SIGCONT to every stopped member
            // whenever a process of that group exits — ending a pause early.
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().context("worker stdout")?;
        let (tracker, history) = (self.tracker.clone(), self.history.clone());
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<WorkerLine>(&line) {
                    Ok(WorkerLine::Step(event)) => {
                        track(&mut tracker.lock().expect("tracker"), &event);
                        append(&history, &Record::Worker(event));
                    }
                    Ok(WorkerLine::Trace(event)) => append(&history, &Record::Trace(event)),
                    Err(_) => eprintln!("worker {id}: not a record: {line}"),
                }
            }
        });
        Ok(WorkerProc {
            stdin: child.stdin.take(),
            child,
            inc,
        })
    }

    /// Records a fault's start or heal.
    pub(crate) fn fault(
        &self,
        id: u32,
        fault: &str,
        phase: Phase,
        workers: Vec<usize>,
        detail: String,
    ) {
        let event = FaultEvent {
            t: crate::clock::now_ns(),
            id,
            fault: fault.to_owned(),
            phase,
            workers,
            detail,
        };
        println!(
            "  [{:>3}] {:<6} {fault} {:?} {}",
            id,
            format!("{phase:?}").to_lowercase(),
            event.workers,
            event.detail
        );
        append(&self.history, &Record::Fault(event));
    }

    /// Records what a revocation took.
    pub(crate) fn revocation(&self, event: RevocationEvent) {
        append(&self.history, &Record::Revocation(event));
    }

    /// Records whose connection a `session_kill` ended.
    pub(crate) fn session_kill(&self, event: SessionKillEvent) {
        append(&self.history, &Record::SessionKill(event));
    }
}

/// The name of a workload on the command line.
fn workload_name(workload: Workload) -> &'static str {
    match workload {
        Workload::Counter => "counter",
        Workload::Transfer => "transfer",
        Workload::Semaphore => "semaphore",
        Workload::Rw => "rw",
    }
}

/// The modes the workload's holds take besides plain locks, which the
/// backend must offer.
fn hold_modes(workload: Workload) -> &'static [HoldMode] {
    match workload {
        Workload::Counter | Workload::Transfer => &[],
        Workload::Semaphore => &[HoldMode::Permit { permits: PERMITS }],
        Workload::Rw => &[HoldMode::Shared],
    }
}

/// What the run's accounts hold before the first transfer (0 for the
/// counter workload), and how many there are.
fn opening(args: &RunArgs) -> (u64, usize) {
    match args.workload {
        Workload::Counter | Workload::Semaphore | Workload::Rw => (0, 0),
        Workload::Transfer => (INITIAL_BALANCE, args.accounts),
    }
}

/// The URL of the SQL backend of the run (`postgres` or `mysql`, in its
/// `--mode`) on `port`: a worker's proxy, or the server itself.
fn sql_url(args: &RunArgs, port: u16) -> String {
    let scheme = match args.backend {
        Backend::Mysql => "mysql",
        _ => "postgres",
    };
    let mode = match args.mode {
        SqlMode::Lease => "",
        SqlMode::Session => "&mode=session",
    };
    format!("{scheme}://dlock:dlock@127.0.0.1:{port}/dlock?timeout={SQL_TIMEOUT}{mode}")
}

fn track(tracker: &mut Tracker, event: &WorkerEvent) {
    match &event.ev {
        Step::Acquired { .. } => {
            tracker.acquisitions += 1;
            *tracker.entries.entry(event.w).or_default() += 1;
            tracker.inside.insert(event.w, None);
            tracker.keys.insert(event.w, event.key.clone());
        }
        Step::Read { hold_ms, .. } | Step::ReadBoth { hold_ms, .. } => {
            if let Some(inside) = tracker.inside.get_mut(&event.w) {
                *inside = Some(*hold_ms);
            }
        }
        Step::Leaving
        | Step::Lost { .. }
        | Step::Error { .. }
        | Step::Fenced
        | Step::GaveUp { .. } => {
            tracker.inside.remove(&event.w);
            tracker.keys.remove(&event.w);
        }
        _ => {}
    }
}

fn append(history: &SyncMutex<std::io::BufWriter<std::fs::File>>, record: &Record) {
    let mut out = history.lock().expect("history");
    let _ = serde_json::to_writer(&mut *out, record);
    let _ = out.write_all(b"\n");
}

/// Runs one chaos run and checks it.
pub(crate) async fn run(args: RunArgs) -> anyhow::Result<Summary> {
    let sql = matches!(args.backend, Backend::Postgres | Backend::Mysql);
    if args.workload == Workload::Transfer && args.accounts < 2 {
        bail!("--workload transfer needs --accounts 2 or more");
    }
    if args.mode == SqlMode::Session && !sql {
        bail!(
            "--mode session is for --backend postgres and mysql (with --backend url, put ?mode=session in the URL)"
        );
    }
    let backend_name = match args.backend {
        Backend::Url => {
            let url = args.url.as_deref().unwrap_or_default();
            let scheme = url.split_once("://").map_or("url", |(scheme, _)| scheme);
            // The session modes tell their losses apart (see the checker's
            // `TELLS_REVOKED`).
            if url.contains("mode=session") {
                format!("{scheme}-session")
            } else {
                scheme.to_owned()
            }
        }
        other if args.mode == SqlMode::Session => {
            format!("{}-session", format!("{other:?}").to_lowercase())
        }
        other => format!("{other:?}").to_lowercase(),
    };
    let out = match &args.out {
        Some(dir) => dir.clone(),
        None => target_dir().join("chaos").join(match args.workload {
            Workload::Counter => format!("{backend_name}-{}", args.seed),
            other => format!("{backend_name}-{}-{}", workload_name(other), args.seed),
        }),
    };
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    std::fs::create_dir_all(&out)?;
    let out = out.canonicalize()?;
    let mode = if args.backend == Backend::Redlock {
        Mode::Version
    } else {
        Mode::Fence
    };
    println!(
        "chaos run: {backend_name}, {} workload, {} workers, {} acquisitions, {} faults, seed {} → {}",
        workload_name(args.workload),
        args.workers,
        args.acquisitions,
        args.faults,
        args.seed,
        out.display()
    );

    // The fenced store, a process of its own, deciding through the fencing
    // kit on a database no fault touches: a Redis of its own for Redis runs, a
    // SQLite file for the others (Redlock compares versions).
    let store_redis = match (mode, args.backend) {
        (Mode::Fence, Backend::Redis) => {
            Some(Server::redis(store_redis_port(&args), &out.join("store-redis")).await?)
        }
        _ => None,
    };
    let mut store = Command::new(std::env::current_exe()?);
    store.args([
        "store",
        "--mode",
        if mode == Mode::Fence {
            "fence"
        } else {
            "version"
        },
    ]);
    match (&store_redis, mode) {
        (Some(redis), _) => {
            store
                .arg("--redis")
                .arg(format!("redis://127.0.0.1:{}/", redis.port()));
        }
        (None, Mode::Fence) => {
            store.arg("--sqlite").arg(out.join("store.db"));
        }
        (None, Mode::Version) => {}
    }
    let (initial, accounts) = opening(&args);
    let mut store = store
        .args(["--initial", &initial.to_string()])
        .args(["--accounts", &accounts.to_string()])
        .arg("--log")
        .arg(out.join("store.jsonl"))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut first = String::new();
    BufReader::new(store.stdout.take().context("store stdout")?)
        .read_line(&mut first)
        .await?;
    let store_port: u16 = first
        .trim()
        .strip_prefix("LISTENING ")
        .context("store did not start")?
        .parse()?;

    // The servers and proxies the nemesis controls.
    let mut servers = Vec::new();
    match args.backend {
        Backend::Redis => servers.push(Server::redis(args.port_base, &out.join("redis")).await?),
        Backend::Redlock => {
            for i in 1..=5 {
                servers.push(
                    Server::redis(args.port_base + i, &out.join(format!("redlock-{i}"))).await?,
                );
            }
        }
        Backend::Zk => {
            servers.push(Server::zookeeper(zk_port(&args), &out.join("zookeeper")).await?)
        }
        Backend::Etcd => {
            // Started together: each waits for the others to form the cluster.
            let ports = etcd_ports(&args);
            let dirs = [0, 1, 2].map(|i| out.join(format!("etcd-{i}")));
            let started = tokio::join!(
                Server::etcd(0, ports, &dirs[0]),
                Server::etcd(1, ports, &dirs[1]),
                Server::etcd(2, ports, &dirs[2]),
            );
            servers.push(started.0?);
            servers.push(started.1?);
            servers.push(started.2?);
            await_etcd_leader(ports).await?;
        }
        Backend::Postgres => {
            servers.push(Server::postgres(pg_port(&args), &out.join("postgres")).await?)
        }
        Backend::Mysql => {
            servers.push(Server::mariadb(mysql_port(&args), &out.join("mariadb")).await?)
        }
        Backend::Sqlite | Backend::Url => {}
    }
    let side_server = match args.backend {
        Backend::Redis | Backend::Redlock => {
            Some(Server::redis(side_port(&args), &out.join("side-redis")).await?)
        }
        Backend::Sqlite
        | Backend::Zk
        | Backend::Etcd
        | Backend::Postgres
        | Backend::Mysql
        | Backend::Url => None,
    };
    let mut proxies = Vec::new();
    if matches!(
        args.backend,
        Backend::Redis | Backend::Zk | Backend::Postgres | Backend::Mysql
    ) {
        for _ in 0..args.workers {
            proxies.push(Proxy::to_port(servers[0].port()).await?);
        }
    }
    if args.backend == Backend::Etcd {
        // Worker w talks to member w % 3, through its own proxy.
        for w in 0..args.workers {
            proxies.push(Proxy::to_port(servers[w % servers.len()].port()).await?);
        }
    }
    let history = std::fs::File::create(out.join("history.jsonl"))?;
    let cluster = Arc::new(Cluster {
        run_id: format!("{}-{}", args.seed, std::process::id()),
        out: out.clone(),
        store_port,
        workers: Mutex::new(Vec::new()),
        tracker: Arc::default(),
        history: Arc::new(SyncMutex::new(std::io::BufWriter::new(history))),
        servers: Mutex::new(servers),
        side_server: Mutex::new(side_server),
        proxies,
        args: args.clone(),
    });
    if matches!(
        args.backend,
        Backend::Sqlite | Backend::Zk | Backend::Etcd | Backend::Postgres | Backend::Mysql
    ) {
        // Create the tables once, so that eight processes do not race to.
        match args.backend {
            Backend::Sqlite => drop(dlock_runtime::connect(&cluster.worker_url(0)).await?),
            Backend::Postgres | Backend::Mysql => {
                let port = cluster.servers.lock().await[0].port();
                drop(dlock_runtime::connect(&sql_url(&args, port)).await?);
            }
            _ => {}
        }
        if let Some(side) = cluster.side_url() {
            drop(dlock_runtime::connect(&side).await?);
        }
    }
    // A backend that does not offer the workload's modes ends the run here:
    // never a run that passes without having taken them.
    for &mode in hold_modes(args.workload) {
        let backend = dlock_runtime::connect(&cluster.worker_url(0)).await?;
        if let Err(why) = backend.offers(mode) {
            bail!(
                "--workload {} takes {mode}, which the {backend_name} backend does not offer: {why}",
                workload_name(args.workload)
            );
        }
    }
    {
        let mut workers = cluster.workers.lock().await;
        for id in 0..args.workers {
            workers.push(cluster.spawn_worker(id, 0)?);
        }
    }

    // Faults while the workers work, until both targets are met.
    let started = Instant::now();
    let nemesis = tokio::spawn(crate::nemesis::run(cluster.clone()));
    let mut finished = false;
    while started.elapsed() < args.max_duration {
        let done = cluster.tracker.lock().expect("tracker").acquisitions >= args.acquisitions;
        if done && nemesis.is_finished() {
            finished = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    nemesis.abort();
    let nemesis = match nemesis.await {
        Ok(result) => result,
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => Err(anyhow::anyhow!("the nemesis panicked: {e}")),
    };
    crate::nemesis::heal_all(&cluster).await?;
    // A fault that could not be injected or healed (a server that did not come
    // back) makes the run meaningless.
    nemesis.context("nemesis")?;

    // Stop the workers: closing stdin ends their loop after the current step.
    let mut hung_workers = 0;
    let mut workers = std::mem::take(&mut *cluster.workers.lock().await);
    for w in &mut workers {
        w.stdin.take();
    }
    for w in &mut workers {
        if tokio::time::timeout(Duration::from_secs(20), w.child.wait())
            .await
            .is_err()
        {
            hung_workers += 1;
            let _ = w.child.kill().await;
        }
    }
    // A worker killed while holding leaves its key until its lease ends (on
    // ZooKeeper: until its session expires): look until both backends are
    // clear, for at most that long and a margin. (Every worker has exited:
    // nothing takes a key any more.)
    let idle_by = Instant::now()
        + match args.backend {
            Backend::Zk => ZK_SESSION_TIMEOUT.max(MAX_LEASE) + Duration::from_secs(2),
            // A leader change restarts a session lease's whole TTL.
            Backend::Etcd => ETCD_SESSION_TTL.max(MAX_LEASE) * 2 + Duration::from_secs(2),
            _ => MAX_LEASE + Duration::from_millis(500),
        };
    let (keys_left, side_keys_left) = loop {
        let left = (keys_left(&cluster).await?, side_keys_left(&cluster).await?);
        let clear = left.0.unwrap_or(0) == 0 && left.1.unwrap_or(0) == 0;
        if clear || Instant::now() >= idle_by {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let dump = crate::store::StoreClient::connect(store_port)
        .await?
        .dump()
        .await?;
    let _ = store.kill().await;
    cluster.history.lock().expect("history").flush()?;
    for server in cluster.servers.lock().await.iter_mut() {
        server.kill().await?;
        server.discard_data()?;
    }
    if let Some(server) = cluster.side_server.lock().await.as_mut() {
        server.kill().await?;
    }

    let meta = RunMeta {
        backend: backend_name,
        seed: args.seed,
        workers: args.workers,
        mode,
        lease_ms: MAX_LEASE.as_millis() as u64,
        session_timeout_ms: match args.backend {
            Backend::Zk => Some(ZK_SESSION_TIMEOUT.as_millis() as u64),
            // etcd: a renewal makes the session's lease outlast the renewed
            // lease, not a whole TTL past the renewal: measured against the
            // lease, as on Redis.
            _ => None,
        },
        keys_left,
        side_keys_left,
        traced: true,
        hung_workers,
        finished,
        workload: args.workload,
        permits: (args.workload == Workload::Semaphore).then_some(PERMITS),
        initial_balance: initial,
        accounts,
        dump,
    };
    std::fs::write(out.join("meta.json"), serde_json::to_vec_pretty(&meta)?)?;
    let summary = checker::check_dir(&out)?;
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    Ok(summary)
}

/// Waits until the run's etcd cluster answers a linearizable read, that is
/// has elected a leader: its members listen before they have one, and a
/// lease asked for meanwhile (the first connection's session) times out.
async fn await_etcd_leader(ports: [u16; 3]) -> anyhow::Result<()> {
    let members: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let read = async {
            let mut client = etcd_client::Client::connect(members.clone(), None).await?;
            client.get("/", None).await
        };
        let why = match tokio::time::timeout(Duration::from_secs(3), read).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer within 3 s".to_owned(),
        };
        if Instant::now() >= deadline {
            bail!("the etcd cluster elected no leader within 60 s: {why}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Lock keys of this run still held on the main backend's server(s) once
/// everything is idle.
async fn keys_left(cluster: &Cluster) -> anyhow::Result<Option<usize>> {
    match cluster.args.backend {
        Backend::Redis | Backend::Redlock => {
            let mut left = 0;
            for server in cluster.servers.lock().await.iter() {
                left += redis_keys_left(cluster, server.port()).await?;
            }
            Ok(Some(left))
        }
        Backend::Sqlite => Ok(Some(
            sqlite_keys_left(cluster, &cluster.worker_url(0)).await?,
        )),
        Backend::Zk => Ok(Some(zk_nodes_left(cluster).await?)),
        Backend::Etcd => Ok(Some(etcd_entries_left(cluster).await?)),
        Backend::Postgres => Ok(Some(pg_keys_left(cluster).await?)),
        Backend::Mysql => Ok(Some(mysql_keys_left(cluster).await?)),
        Backend::Url => Ok(None),
    }
}

/// Lock keys of this run still held on the side backend once everything is idle.
async fn side_keys_left(cluster: &Cluster) -> anyhow::Result<Option<usize>> {
    if let Some(server) = cluster.side_server.lock().await.as_ref() {
        return Ok(Some(redis_keys_left(cluster, server.port()).await?));
    }
    match cluster.side_url() {
        Some(url) => Ok(Some(sqlite_keys_left(cluster, &url).await?)),
        None => Ok(None),
    }
}

async fn redis_keys_left(cluster: &Cluster, port: u16) -> anyhow::Result<usize> {
    let pattern = format!("*chaos:{}:*", cluster.run_id);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut conn)
        .await?;
    // The shared fence counters (`dlock-fence…`) are outside the pattern.
    Ok(keys.len())
}

/// Lock nodes left under the run's chroot (`/chaos-<run>`): the children of
/// every key's container, straight from the server (not through a proxy);
/// for a semaphore, the lease nodes under its `leases` child (and any
/// under `locks`, Curator's mutex of the semaphore) instead of that child.
async fn zk_nodes_left(cluster: &Cluster) -> anyhow::Result<usize> {
    use zookeeper_client::{Client, Error as ZkError};
    let chroot = format!("/chaos-{}", cluster.run_id);
    let client = Client::connector()
        .with_session_timeout(ZK_SESSION_TIMEOUT)
        .with_fail_eagerly()
        .connect(&format!("127.0.0.1:{}", zk_port(&cluster.args)))
        .await
        .context("connect to ZooKeeper to count the nodes left")?;
    let containers = match client.list_children(&chroot).await {
        Ok(children) => children,
        Err(ZkError::NoNode) => Vec::new(),
        Err(e) => bail!("listing {chroot}: {e}"),
    };
    let mut left = 0;
    for container in containers {
        let path = format!("{chroot}/{container}");
        let children = match client.list_children(&path).await {
            Ok(children) => children,
            Err(ZkError::NoNode) => continue,
            Err(e) => bail!("listing {path}: {e}"),
        };
        for child in children {
            if child != "leases" && child != "locks" {
                left += 1;
                continue;
            }
            match client.list_children(&format!("{path}/{child}")).await {
                Ok(nodes) => left += nodes.len(),
                Err(ZkError::NoNode) => {}
                Err(e) => bail!("listing {path}/{child}: {e}"),
            }
        }
    }
    Ok(left)
}

/// Lock entries left under the run's prefix (`/chaos-<run>/`), read from
/// the members themselves (not through a proxy).
async fn etcd_entries_left(cluster: &Cluster) -> anyhow::Result<usize> {
    let members: Vec<String> = etcd_ports(&cluster.args)
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let mut client = etcd_client::Client::connect(members, None)
        .await
        .context("connect to etcd to count the entries left")?;
    let prefix = format!("/chaos-{}/", cluster.run_id);
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    let answer = tokio::time::timeout(Duration::from_secs(10), client.get(prefix, Some(options)))
        .await
        .context("etcd did not answer the count of the entries left")??;
    Ok(usize::try_from(answer.count())?)
}

/// Leases of this run still live in PostgreSQL's lease table (an owner and
/// an expiry in the future; lease mode: session mode has no such table),
/// its holder rows still live (readers and permits) and its waiting-writer
/// marks still standing, plus
/// every advisory lock still held on the server (`pg_locks`; the harness's
/// server serves this run only): the session mode's locks, and any a
/// lease-mode backend would have left.
async fn pg_keys_left(cluster: &Cluster) -> anyhow::Result<usize> {
    use sqlx::Connection as _;
    let url = cluster.sql_admin_url().await.context("no PostgreSQL")?;
    let mut conn = sqlx::PgConnection::connect(&url).await?;
    let (rows,): (i64,) = match cluster.args.mode {
        SqlMode::Lease => {
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM dlock_leases WHERE key LIKE $1
                         AND owner IS NOT NULL AND expires_at > clock_timestamp())
                      + (SELECT count(*) FROM dlock_leases WHERE key LIKE $1
                         AND wwait_owner IS NOT NULL AND wwait_until > clock_timestamp()
                         AND wwait_token = token)
                      + (SELECT count(*) FROM dlock_leases_holders WHERE key LIKE $1
                         AND owner IS NOT NULL AND expires_at > clock_timestamp())",
            )
            .bind(format!("dlock:chaos:{}:%", cluster.run_id))
            .fetch_one(&mut conn)
            .await?
        }
        SqlMode::Session => (0,),
    };
    let (locks,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted")
            .fetch_one(&mut conn)
            .await?;
    conn.close().await?;
    Ok(usize::try_from(rows + locks)?)
}

/// Leases of this run still live in MariaDB's lease table (lease mode), with
/// its live holder rows and standing waiting-writer marks, plus every
/// `GET_LOCK` lock still held on the server: the performance schema's
/// metadata locks of type `USER LEVEL LOCK` (the server runs with the
/// metadata-lock instrument on; it serves this run only).
async fn mysql_keys_left(cluster: &Cluster) -> anyhow::Result<usize> {
    use sqlx::Connection as _;
    let url = cluster.sql_admin_url().await.context("no MariaDB")?;
    let mut conn = sqlx::MySqlConnection::connect(&url).await?;
    let (rows,): (i64,) = match cluster.args.mode {
        SqlMode::Lease => {
            let like = format!("dlock:chaos:{}:%", cluster.run_id).into_bytes();
            let (now,): (i64,) = sqlx::query_as(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))
                 AS SIGNED)",
            )
            .fetch_one(&mut conn)
            .await?;
            sqlx::query_as(
                "SELECT CAST((SELECT count(*) FROM dlock_leases WHERE k LIKE ?
                              AND owner IS NOT NULL AND expires_us > ?)
                           + (SELECT count(*) FROM dlock_leases WHERE k LIKE ?
                              AND wwait_owner IS NOT NULL AND wwait_us > ?
                              AND wwait_token = token)
                           + (SELECT count(*) FROM dlock_leases_holders WHERE k LIKE ?
                              AND owner IS NOT NULL AND expires_us > ?) AS SIGNED)",
            )
            .bind(like.clone())
            .bind(now)
            .bind(like.clone())
            .bind(now)
            .bind(like)
            .bind(now)
            .fetch_one(&mut conn)
            .await?
        }
        SqlMode::Session => (0,),
    };
    let (locks,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM performance_schema.metadata_locks
         WHERE OBJECT_TYPE = 'USER LEVEL LOCK' AND LOCK_STATUS = 'GRANTED'",
    )
    .fetch_one(&mut conn)
    .await?;
    conn.close().await?;
    Ok(usize::try_from(rows + locks)?)
}

async fn sqlite_keys_left(cluster: &Cluster, url: &str) -> anyhow::Result<usize> {
    let pool = sqlx::SqlitePool::connect(&format!("{url}?mode=ro")).await?;
    let like = format!("dlock:chaos:{}:%", cluster.run_id);
    // Live leases, standing waiting-writer marks, live holder rows (readers
    // and permits).
    let (left,): (i64,) = sqlx::query_as(
        "WITH now(ms) AS (SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER))
         SELECT (SELECT COUNT(*) FROM dlock_leases, now WHERE key LIKE ?1
                 AND owner IS NOT NULL AND expires_at > now.ms)
              + (SELECT COUNT(*) FROM dlock_leases, now WHERE key LIKE ?1
                 AND wwait_owner IS NOT NULL AND wwait_until > now.ms AND wwait_token = token)
              + (SELECT COUNT(*) FROM dlock_leases_holders, now WHERE key LIKE ?1
                 AND owner IS NOT NULL AND expires_at > now.ms)",
    )
    .bind(like)
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    Ok(usize::try_from(left)?)
}

/// `target/` of the workspace (or `CARGO_TARGET_DIR`).
fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return dir.into();
    }
    // The binary lives in target/<profile>/.
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("target"))
}

/// Fails unless `summary` has no violations.
pub(crate) fn verdict(summary: &Summary) -> anyhow::Result<()> {
    if summary.violations.is_empty() {
        Ok(())
    } else {
        bail!("chaos run failed: {}", summary.violations.join("; "))
    }
}
