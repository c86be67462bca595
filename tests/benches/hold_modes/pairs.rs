//! Section 1: uncontended permit and reader pairs, dlock against the same
//! scripts and transactions by hand, in interleaved rounds, with CPU per
//! pair; the pinned concurrency-1 child.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::Registry;
use redis::Script;
use redis::aio::MultiplexedConnection;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::common::cpu::{schedstat, tree_schedstat};
use crate::common::rounds::{PairSample, report_affinity, rotated_rounds};
use crate::common::spread;
use crate::hand_sql::{self, HandSql};
use crate::{LEASE, PERMITS};

/// dlock's Redis scripts for every hold mode (`scripts.rs`'s `ACQUIRE_HELD`
/// and `RELEASE_HELD` on a single server).
const ACQUIRE_HELD_LUA: &str =
    include_str!("../../../dlock-runtime/src/backend/redis/acquire_held.lua");
const RELEASE_HELD_LUA: &str =
    include_str!("../../../dlock-runtime/src/backend/redis/release_held.lua");
/// The fence counter of a single Redis server.
const FENCE_KEY: &str = "dlock-fence";
/// dlock's lease-mode pool sizes (PostgreSQL and MariaDB: `POOL_SIZE`;
/// SQLite: its pool): the statements by hand get pools of the same size.
const SERVER_POOL: u32 = 10;
const SQLITE_POOL: u32 = 4;
/// dlock's call timeout on the server databases (`?timeout=`).
const CALL_TIMEOUT: &str = "60s";

/// Where the contenders run: the benchmark's servers and SQLite file.
#[derive(Clone, Debug)]
pub(crate) struct Servers {
    pub(crate) redis: String,
    pub(crate) postgres: String,
    pub(crate) mariadb: String,
    /// `sqlite://PATH`.
    pub(crate) sqlite: String,
    pub(crate) redis_pid: u32,
    pub(crate) postgres_pid: u32,
    pub(crate) mariadb_pid: u32,
}

impl Servers {
    /// As arguments of the pinned child.
    pub(crate) fn args(&self) -> Vec<String> {
        vec![
            self.redis.clone(),
            self.postgres.clone(),
            self.mariadb.clone(),
            self.sqlite.clone(),
            self.redis_pid.to_string(),
            self.postgres_pid.to_string(),
            self.mariadb_pid.to_string(),
        ]
    }

    pub(crate) fn from_args(args: &[String]) -> anyhow::Result<Servers> {
        let [
            redis,
            postgres,
            mariadb,
            sqlite,
            redis_pid,
            postgres_pid,
            mariadb_pid,
        ] = args
        else {
            anyhow::bail!("expected 7 server arguments, got {args:?}");
        };
        Ok(Servers {
            redis: redis.clone(),
            postgres: postgres.clone(),
            mariadb: mariadb.clone(),
            sqlite: sqlite.clone(),
            redis_pid: redis_pid.parse()?,
            postgres_pid: postgres_pid.parse()?,
            mariadb_pid: mariadb_pid.parse()?,
        })
    }
}

/// The backends of section 1.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Store {
    Redis,
    Postgres,
    MariaDb,
    Sqlite,
}

impl Store {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Store::Redis => "Redis",
            Store::Postgres => "PostgreSQL lease",
            Store::MariaDb => "MariaDB lease",
            Store::Sqlite => "SQLite",
        }
    }
}

/// The throughput contenders: each (backend, mode) by dlock and by hand.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) struct Who {
    pub(crate) store: Store,
    /// A reader's pair, else a permit's.
    pub(crate) read: bool,
    /// dlock's guard, else the same scripts or transactions by hand.
    pub(crate) dlock: bool,
}

impl Who {
    /// The compared pairs: (backend, reader?).
    pub(crate) const PAIRS: [(Store, bool); 6] = [
        (Store::Redis, false),
        (Store::Postgres, false),
        (Store::MariaDb, false),
        (Store::Sqlite, false),
        (Store::Redis, true),
        (Store::Postgres, true),
    ];

    pub(crate) fn all() -> Vec<Who> {
        Who::PAIRS
            .iter()
            .flat_map(|&(store, read)| [true, false].map(|dlock| Who { store, read, dlock }))
            .collect()
    }

    /// The mode's words in tables.
    pub(crate) fn mode(self) -> String {
        if self.read {
            "read lock".to_owned()
        } else {
            format!("semaphore, {PERMITS} permits")
        }
    }

    pub(crate) fn name(self) -> String {
        format!(
            "{} {}: {}",
            self.store.name(),
            self.mode(),
            if self.dlock { "dlock" } else { "by hand" }
        )
    }

    /// The name on the pinned child's output lines.
    pub(crate) fn id(self) -> String {
        format!(
            "{:?}-{}-{}",
            self.store,
            u8::from(self.read),
            u8::from(self.dlock)
        )
    }

    pub(crate) fn from_id(id: &str) -> anyhow::Result<Who> {
        Who::all()
            .into_iter()
            .find(|w| w.id() == id)
            .ok_or_else(|| anyhow::anyhow!("unknown contender {id:?}"))
    }
}

/// The contenders of one process.
pub(crate) struct Contenders {
    dlock: [Registry; 4],
    redis: MultiplexedConnection,
    acquire_held: Script,
    release_held: Script,
    postgres: PgPool,
    mariadb: MySqlPool,
    sqlite: SqlitePool,
    sql: [HandSql; 3],
    /// The holder record dlock stores with each grant (this process's).
    record: String,
    run: u64,
    servers: Servers,
}

async fn registry(url: &str) -> anyhow::Result<Registry> {
    let backend = dlock_runtime::connect(url)
        .await
        .map_err(|e| anyhow::anyhow!("dlock cannot connect to {url}: {e}"))?;
    Ok(Registry::builder().default_backend(backend).build())
}

impl Contenders {
    /// Connects every contender (dlock first: it creates its tables).
    pub(crate) async fn connect(servers: &Servers, run: u64) -> anyhow::Result<Arc<Contenders>> {
        // The statements by hand wait as long as the pool makes them: so may
        // dlock's calls (3 s by default), which c=64 on a 10-connection pool
        // of a loaded machine can exceed.
        let dlock = [
            registry(&servers.redis).await?,
            registry(&format!("{}?timeout={CALL_TIMEOUT}", servers.postgres)).await?,
            registry(&format!("{}?timeout={CALL_TIMEOUT}", servers.mariadb)).await?,
            registry(&servers.sqlite).await?,
        ];
        let pg_options: PgConnectOptions = servers.postgres.parse()?;
        let sqlite_path = servers
            .sqlite
            .strip_prefix("sqlite://")
            .ok_or_else(|| anyhow::anyhow!("not a sqlite:// URL: {}", servers.sqlite))?;
        Ok(Arc::new(Contenders {
            dlock,
            redis: redis::Client::open(servers.redis.as_str())?
                .get_multiplexed_async_connection()
                .await?,
            acquire_held: Script::new(ACQUIRE_HELD_LUA),
            release_held: Script::new(RELEASE_HELD_LUA),
            postgres: PgPoolOptions::new()
                .max_connections(SERVER_POOL)
                .min_connections(0)
                .test_before_acquire(false)
                .connect_with(
                    pg_options.options([("default_transaction_isolation", "read committed")]),
                )
                .await?,
            mariadb: MySqlPoolOptions::new()
                .max_connections(SERVER_POOL)
                .min_connections(0)
                .test_before_acquire(false)
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                            .execute(conn)
                            .await
                            .map(drop)
                    })
                })
                .connect(&servers.mariadb)
                .await?,
            sqlite: SqlitePoolOptions::new()
                .max_connections(SQLITE_POOL)
                .acquire_timeout(Duration::from_secs(5))
                // As dlock's: no ping before each use.
                .test_before_acquire(false)
                .connect_with(
                    SqliteConnectOptions::new()
                        .filename(sqlite_path)
                        .journal_mode(SqliteJournalMode::Wal)
                        .synchronous(SqliteSynchronous::Normal)
                        .busy_timeout(Duration::from_secs(5)),
                )
                .await?,
            sql: [
                hand_sql::postgres(),
                hand_sql::mariadb(),
                hand_sql::sqlite(),
            ],
            record: dlock_runtime::backend::HolderRecord::this_process().encode(),
            run,
            servers: servers.clone(),
        }))
    }

    /// The server's CPU time and run-queue wait, ns (SQLite: none, it runs
    /// in this process).
    fn server_sched(&self, store: Store) -> anyhow::Result<(u64, u64)> {
        match store {
            Store::Redis => schedstat(&self.servers.redis_pid.to_string()),
            Store::Postgres => tree_schedstat(self.servers.postgres_pid),
            Store::MariaDb => schedstat(&self.servers.mariadb_pid.to_string()),
            Store::Sqlite => Ok((0, 0)),
        }
    }
}

fn owner() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// One acquire+release of `who` on a key of its own (`tag`, `i`). Panics, with
/// the contender's name, if anything fails: the run aborts.
pub(crate) async fn pair(c: &Contenders, who: Who, tag: &str, i: u64) {
    let key = format!("hm:{}:{}:{tag}:{i}", who.id(), c.run);
    let fail = |what: &str, e: &dyn std::fmt::Display| -> ! {
        panic!("{}: {what} failed: {e}", who.name())
    };
    if who.dlock {
        let lock = c.dlock[who.store as usize].lock(key).lease(LEASE);
        let lock = if who.read {
            lock.read()
        } else {
            lock.permits(PERMITS)
        };
        let guard = lock.acquire().await.unwrap_or_else(|e| fail("acquire", &e));
        guard
            .release()
            .await
            .unwrap_or_else(|e| fail("release", &e));
        return;
    }
    let owner = owner();
    let lease_ms = LEASE.as_millis() as i64;
    let permits = if who.read { 0 } else { i64::from(PERMITS) };
    // The registry's stored key: its prefix and the name.
    let stored = format!("{}{key}", dlock_runtime::DEFAULT_PREFIX);
    match who.store {
        Store::Redis => {
            let lock = format!("{{{stored}}}");
            let (channel, mark) = (format!("{lock}:released"), format!("{lock}:writer"));
            let mut conn = c.redis.clone();
            let mode = if who.read {
                "r".to_owned()
            } else {
                PERMITS.to_string()
            };
            let answer: Vec<i64> = c
                .acquire_held
                .key(&lock)
                .key(FENCE_KEY)
                .key(&mark)
                .arg(&owner)
                .arg(lease_ms)
                .arg(&c.record)
                .arg(mode)
                .arg(&channel)
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| fail("acquire_held.lua", &e));
            let [1, _token, slot] = answer[..] else {
                panic!("{}: {lock} was not granted: {answer:?}", who.name());
            };
            let field = if who.read {
                format!("r:{owner}")
            } else {
                slot.to_string()
            };
            let released: i64 = c
                .release_held
                .key(&lock)
                .key(&mark)
                .arg(&owner)
                .arg(&channel)
                .arg(field)
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| fail("release_held.lua", &e));
            assert_eq!(released, 1, "{}: {lock} not released", who.name());
        }
        Store::Postgres => {
            let sql = &c.sql[0];
            let (slot, _) = hand_sql::pg::acquire(
                &c.postgres,
                sql,
                &stored,
                &owner,
                &c.record,
                lease_ms,
                permits,
            )
            .await
            .unwrap_or_else(|e| fail("acquire", &e));
            hand_sql::pg::release(&c.postgres, sql, &stored, &owner, slot)
                .await
                .unwrap_or_else(|e| fail("release", &e));
        }
        Store::MariaDb => {
            let sql = &c.sql[1];
            let (slot, _) = hand_sql::my::acquire(
                &c.mariadb, sql, &stored, &owner, &c.record, lease_ms, permits,
            )
            .await
            .unwrap_or_else(|e| fail("acquire", &e));
            hand_sql::my::release(&c.mariadb, sql, &stored, &owner, slot)
                .await
                .unwrap_or_else(|e| fail("release", &e));
        }
        Store::Sqlite => {
            let sql = &c.sql[2];
            let (slot, _) = hand_sql::sq::acquire(
                &c.sqlite, sql, &stored, &owner, &c.record, lease_ms, permits,
            )
            .await
            .unwrap_or_else(|e| fail("acquire", &e));
            hand_sql::sq::release(&c.sqlite, sql, &stored, &owner, slot)
                .await
                .unwrap_or_else(|e| fail("release", &e));
        }
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
/// time and the server's, around that run only.
async fn measure(
    c: &Arc<Contenders>,
    who: Who,
    concurrency: u64,
    n: u64,
    tag: &str,
) -> anyhow::Result<PairSample> {
    let server_before = c.server_sched(who.store)?;
    let client_before = schedstat("self")?;
    let started = Instant::now();
    run_pairs(c, who, concurrency, n, tag).await;
    let elapsed = started.elapsed();
    let client_after = schedstat("self")?;
    let server_after = c.server_sched(who.store)?;
    let per_pair =
        |before: u64, after: u64| after.saturating_sub(before) as f64 / 1000.0 / n as f64;
    Ok(PairSample {
        pairs_per_s: n as f64 / elapsed.as_secs_f64(),
        client_us: per_pair(client_before.0, client_after.0),
        server_us: per_pair(server_before.0, server_after.0),
        client_wait_us: per_pair(client_before.1, client_after.1),
        server_wait_us: per_pair(server_before.1, server_after.1),
    })
}

/// How much one throughput section runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Runs {
    pub(crate) rounds: usize,
    pub(crate) pairs: u64,
    pub(crate) warmup: u64,
}

/// One section at one concurrency: a warm-up run of each contender, then
/// `runs.rounds` interleaved rounds. Answers (round, contender, sample).
pub(crate) async fn rounds(
    c: &Arc<Contenders>,
    concurrency: u64,
    runs: Runs,
) -> anyhow::Result<Vec<(usize, Who, PairSample)>> {
    let warm_up = format!("warm:{concurrency}");
    rotated_rounds(
        &Who::all(),
        runs.rounds,
        async |who| run_pairs(c, who, concurrency, runs.warmup, &warm_up).await,
        async |round, who| {
            let tag = format!("{round}:{concurrency}");
            measure(c, who, concurrency, runs.pairs, &tag).await
        },
    )
    .await
}

/// The pinned concurrency-1 child: `RUN ROUNDS PAIRS WARMUP SERVERS…`.
/// Prints its affinity and one `sample` line per run.
pub(crate) async fn pinned_child(args: &[String]) -> anyhow::Result<()> {
    let [run, rounds_n, pairs, warmup, servers @ ..] = args else {
        anyhow::bail!("usage: --pinned-c1 RUN ROUNDS PAIRS WARMUP SERVERS…");
    };
    let servers = Servers::from_args(servers)?;
    let c = Contenders::connect(&servers, run.parse()?).await?;
    report_affinity()?;
    let runs = Runs {
        rounds: rounds_n.parse()?,
        pairs: pairs.parse()?,
        warmup: warmup.parse()?,
    };
    for (round, who, sample) in rounds(&c, 1, runs).await? {
        println!("sample\t{round}\t{}\t{}", who.id(), sample.encode());
    }
    Ok(())
}
