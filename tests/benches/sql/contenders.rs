//! The contenders: dlock's lease mode against its own two statements by hand
//! (PostgreSQL and MariaDB), dlock's PostgreSQL session mode against sqlx's
//! `PgAdvisoryLock`; one acquire+release pair of each.

use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::Registry;
use dlock_runtime::backend::HolderRecord;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgAdvisoryLock, PgConnectOptions, PgPool, PgPoolOptions};

use super::server::Flavor;

/// The instant on PostgreSQL, in µs (`dlock-runtime/src/backend/sql/postgres/mod.rs`).
const PG_NOW: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

/// dlock's PostgreSQL lease acquisition (`dlock-runtime/src/backend/sql/postgres/mod.rs`),
/// with the holder record (`$4`) and the grant's time, as dlock sends it, or
/// without them.
fn pg_acquire(record: bool) -> String {
    let (columns, values, sets) = if record {
        (
            ", holder, granted_at",
            ", $4, clock_timestamp()",
            ", holder = excluded.holder, \
             granted_at = CASE WHEN l.owner = excluded.owner THEN l.granted_at \
                               ELSE excluded.granted_at END",
        )
    } else {
        ("", "", "")
    };
    format!(
        "INSERT INTO dlock_leases AS l (key, owner, token, expires_at{columns}) \
         VALUES ($1, $2, {PG_NOW}, clock_timestamp() + $3 * interval '1 millisecond'{values}) \
         ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, \
             token = GREATEST(l.token + 1, excluded.token), \
             expires_at = excluded.expires_at, wanted = false{sets} \
         WHERE (l.owner IS NULL OR l.owner = excluded.owner \
                OR l.expires_at <= clock_timestamp()) \
           AND (l.shared_until IS NULL OR l.shared_until <= clock_timestamp()) \
         RETURNING token"
    )
}
const PG_RELEASE: &str = "WITH r AS (UPDATE dlock_leases SET owner = NULL, \
        expires_at = clock_timestamp() WHERE key = $1 AND owner = $2 RETURNING key, wanted) \
    SELECT pg_notify($3, key) FROM r WHERE wanted";

/// The instant on MariaDB, in µs (`dlock-runtime/src/backend/sql/mysql/mod.rs`).
const MY_NOW: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// dlock's MariaDB lease acquisition (`dlock-runtime/src/backend/sql/mysql/mod.rs`),
/// with the holder record as dlock keeps it, or without it. dlock writes the
/// record itself once per registry into `dlock_leases_procs` (see
/// [`MY_RECORD`]), under the holder id its owners start with; what each
/// grant writes of it is the grant's time.
fn my_acquire(record: bool) -> String {
    let n = MY_NOW;
    let free = format!("((expires_us <= {n} OR owner = VALUES(owner)) AND shared_us <= {n})");
    let (columns, values, sets) = if record {
        (
            ", granted_us",
            format!(", {n}"),
            format!(
                "granted_us = IF({free}, IF(owner <=> VALUES(owner), granted_us, {n}), granted_us), "
            ),
        )
    } else {
        ("", String::new(), String::new())
    };
    format!(
        "INSERT INTO dlock_leases (k, owner, token, expires_us{columns}) \
         VALUES (?, ?, LAST_INSERT_ID({n}), {n} + ?{values}) \
         ON DUPLICATE KEY UPDATE \
         token = IF({free}, LAST_INSERT_ID(GREATEST(token + 1, {n})), \
                    token + 0 * LAST_INSERT_ID(LEAST(GREATEST(expires_us - {n}, shared_us - {n}, 0), 1099511627775) + 1)), \
         {sets}\
         owner = IF({free}, VALUES(owner), owner), \
         expires_us = IF({free}, VALUES(expires_us), expires_us)"
    )
}

/// dlock's write of a registry's holder record (id, record, cover in µs).
const MY_RECORD: &str = "INSERT INTO dlock_leases_procs (id, holder, until_us) \
    VALUES (?, ?, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) + ?) \
    ON DUPLICATE KEY UPDATE holder = VALUES(holder), \
    until_us = GREATEST(until_us, VALUES(until_us))";

/// The holder id of the hand-written statements with the record: what
/// their owners start with, as dlock's do.
const MY_HOLDER_ID: &str = "0123456789abcdef";

/// dlock's MariaDB lease release.
fn my_release() -> String {
    format!("UPDATE dlock_leases SET owner = NULL, expires_us = {MY_NOW} WHERE k = ? AND owner = ?")
}

/// The lease dlock and the hand-written statements take.
const LEASE: Duration = Duration::from_secs(30);
/// dlock's lease-mode pool size (`POOL_SIZE` of both dialects): the
/// hand-written statements get a pool of the same size and settings.
const LEASE_POOL: u32 = 10;

/// The throughput contenders.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) enum Who {
    PgHand,
    PgHandRecord,
    PgDlock,
    MyHand,
    MyHandRecord,
    MyDlock,
    PgAdvisory,
    PgSession,
}

impl Who {
    pub(super) const ALL: [Who; 8] = [
        Who::PgHand,
        Who::PgHandRecord,
        Who::PgDlock,
        Who::MyHand,
        Who::MyHandRecord,
        Who::MyDlock,
        Who::PgAdvisory,
        Who::PgSession,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Who::PgHand => "PostgreSQL: dlock's lease statements by hand, no holder record",
            Who::PgHandRecord => "PostgreSQL: dlock's lease statements by hand",
            Who::PgDlock => "PostgreSQL: dlock, lease mode",
            Who::MyHand => "MariaDB: dlock's lease statements by hand, no holder record",
            Who::MyHandRecord => "MariaDB: dlock's lease statements by hand",
            Who::MyDlock => "MariaDB: dlock, lease mode",
            Who::PgAdvisory => "PostgreSQL: sqlx `PgAdvisoryLock`",
            Who::PgSession => "PostgreSQL: dlock, session mode",
        }
    }

    /// The name on the pinned child's output lines.
    pub(super) fn id(self) -> &'static str {
        match self {
            Who::PgHand => "pg-hand",
            Who::PgHandRecord => "pg-hand-record",
            Who::PgDlock => "pg-dlock",
            Who::MyHand => "my-hand",
            Who::MyHandRecord => "my-hand-record",
            Who::MyDlock => "my-dlock",
            Who::PgAdvisory => "pg-advisory",
            Who::PgSession => "pg-session",
        }
    }

    pub(super) fn from_id(id: &str) -> anyhow::Result<Who> {
        Who::ALL
            .into_iter()
            .find(|w| w.id() == id)
            .ok_or_else(|| anyhow::anyhow!("unknown contender {id:?}"))
    }

    /// The server it runs on.
    pub(super) fn server(self) -> Flavor {
        match self {
            Who::MyHand | Who::MyHandRecord | Who::MyDlock => Flavor::MariaDb,
            _ => Flavor::Postgres,
        }
    }
}

/// The contenders of one benchmark process, on the benchmark's two servers.
pub(super) struct Contenders {
    pg_dlock: Registry,
    pg_hand: PgPool,
    my_dlock: Registry,
    my_hand: MySqlPool,
    pg_acquire: String,
    pg_acquire_record: String,
    my_acquire: String,
    my_acquire_record: String,
    my_release: String,
    pg_session: Registry,
    /// sqlx's pool for `PgAdvisoryLock`, sized to the concurrency.
    pg_advisory: PgPool,
    /// Tells this process's keys from the other runs'.
    run: u64,
}

async fn registry(url: &str) -> anyhow::Result<Registry> {
    let backend = dlock_runtime::connect(url)
        .await
        .map_err(|e| anyhow::anyhow!("dlock cannot connect to {url}: {e}"))?;
    Ok(Registry::builder().default_backend(backend).build())
}

impl Contenders {
    /// Connects every contender (dlock first: it creates its tables).
    pub(super) async fn connect(
        pg_url: &str,
        my_url: &str,
        run: u64,
        concurrency: u64,
    ) -> anyhow::Result<Arc<Contenders>> {
        let pg_dlock = registry(pg_url).await?;
        let my_dlock = registry(my_url).await?;
        let pg_session = registry(&format!("{pg_url}?mode=session")).await?;
        let pg_options: PgConnectOptions = pg_url.parse()?;
        let my_hand = MySqlPoolOptions::new()
            .max_connections(LEASE_POOL)
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
            .connect(my_url)
            .await?;
        // The record once, as dlock writes it before its registry's first
        // grant (covering far longer than the run: dlock extends it once
        // a lease or so).
        sqlx::query(MY_RECORD)
            .bind(MY_HOLDER_ID)
            .bind(HolderRecord::this_process().encode())
            .bind(24 * 3600 * 1_000_000_i64)
            .execute(&my_hand)
            .await?;
        Ok(Arc::new(Contenders {
            pg_dlock,
            my_dlock,
            pg_session,
            pg_hand: PgPoolOptions::new()
                .max_connections(LEASE_POOL)
                .min_connections(0)
                .test_before_acquire(false)
                .connect_with(
                    pg_options.options([("default_transaction_isolation", "read committed")]),
                )
                .await?,
            my_hand,
            pg_acquire: pg_acquire(false),
            pg_acquire_record: pg_acquire(true),
            my_acquire: my_acquire(false),
            my_acquire_record: my_acquire(true),
            my_release: my_release(),
            pg_advisory: PgPoolOptions::new()
                .max_connections(u32::try_from(concurrency)?)
                .connect(pg_url)
                .await?,
            run,
        }))
    }
}

fn owner() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// dlock's guard on `registry`: acquire, release.
async fn dlock_pair(registry: &Registry, key: String, who: Who) {
    let guard = registry
        .lock(key)
        .lease(LEASE)
        .acquire()
        .await
        .unwrap_or_else(|e| panic!("{}: acquire failed: {e}", who.name()));
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{}: release failed: {e}", who.name()));
}

/// One acquire+release of `who` on a key of its own (`tag`, `i`). Panics, with
/// the contender's name, if anything fails: the run aborts.
pub(super) async fn pair(c: &Contenders, who: Who, tag: &str, i: u64) {
    let key = format!("bench:{}:{}:{tag}:{i}", who.id(), c.run);
    match who {
        Who::PgDlock => dlock_pair(&c.pg_dlock, key, who).await,
        Who::MyDlock => dlock_pair(&c.my_dlock, key, who).await,
        Who::PgSession => dlock_pair(&c.pg_session, key, who).await,
        Who::PgHand | Who::PgHandRecord => {
            let owner = owner();
            let acquire = if who == Who::PgHandRecord {
                &c.pg_acquire_record
            } else {
                &c.pg_acquire
            };
            let mut query = sqlx::query_scalar(sqlx::AssertSqlSafe(acquire.as_str()))
                .bind(&key)
                .bind(&owner)
                .bind(LEASE.as_millis() as i64);
            if who == Who::PgHandRecord {
                query = query.bind(HolderRecord::this_process().encode());
            }
            let token: Option<i64> = query
                .fetch_optional(&c.pg_hand)
                .await
                .unwrap_or_else(|e| panic!("{}: acquire failed: {e}", who.name()));
            assert!(token.is_some(), "{}: {key} was taken", who.name());
            sqlx::query(PG_RELEASE)
                .bind(&key)
                .bind(&owner)
                .bind("dlock")
                .execute(&c.pg_hand)
                .await
                .unwrap_or_else(|e| panic!("{}: release failed: {e}", who.name()));
        }
        Who::MyHand | Who::MyHandRecord => {
            // dlock's owners: the registry's holder id, 64 random bits.
            let owner = format!("{MY_HOLDER_ID}{:016x}", rand::random::<u64>());
            let lease_us = LEASE.as_micros() as i64;
            let acquire = if who == Who::MyHandRecord {
                &c.my_acquire_record
            } else {
                &c.my_acquire
            };
            let done = sqlx::query(sqlx::AssertSqlSafe(acquire.as_str()))
                .bind(&key)
                .bind(&owner)
                .bind(lease_us)
                .execute(&c.my_hand)
                .await
                .unwrap_or_else(|e| panic!("{}: acquire failed: {e}", who.name()));
            assert!(
                done.last_insert_id() > 1 << 40,
                "{}: {key} was taken",
                who.name()
            );
            sqlx::query(sqlx::AssertSqlSafe(c.my_release.as_str()))
                .bind(&key)
                .bind(&owner)
                .execute(&c.my_hand)
                .await
                .unwrap_or_else(|e| panic!("{}: release failed: {e}", who.name()));
        }
        Who::PgAdvisory => {
            let lock = PgAdvisoryLock::new(key);
            let conn = c
                .pg_advisory
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("{}: connection failed: {e}", who.name()));
            let guard = lock
                .acquire(conn)
                .await
                .unwrap_or_else(|e| panic!("{}: lock failed: {e}", who.name()));
            guard
                .release_now()
                .await
                .unwrap_or_else(|e| panic!("{}: unlock failed: {e}", who.name()));
        }
    }
}
