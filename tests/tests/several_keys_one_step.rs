//! Several keys in one step ([`LockBackend::try_acquire_all`]) on the
//! backends that offer it: Redis (one server, and Redis Cluster when the
//! keys share a hash slot) and the SQL lease tables (SQLite, PostgreSQL,
//! MySQL/MariaDB). On each: the step is offered where it should be and not
//! elsewhere (Redis Cluster across slots, session modes); a hold taken
//! through the runtime is one step (every key stored with the one owner of
//! the hold, read from the server); a busy key leaves the others untaken (a
//! plain lock of each succeeds at once); each key's token is larger than
//! every earlier token of that key, a retry of the step included; the busy
//! key's release wakes a waiting step at once. On Redis,
//! a hold of three keys is one script call (`INFO commandstats` of a server
//! of this test's own).
#![cfg(any(
    feature = "redis",
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql"
))]

use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::backend::{AcquireRequest, AttemptAll, Lease, LockBackend};
use dlock_runtime::{FencingToken, Registry};
use dlock_tests::unique_key;

/// How a test reads who holds a stored key on the server: the owner token
/// of its holder, `None` when free.
type OwnerOf = Box<dyn Fn(String) -> futures_util::future::BoxFuture<'static, Option<String>>>;

fn requests(stored: &[String], owner: &str) -> Vec<AcquireRequest> {
    stored
        .iter()
        .map(|k| AcquireRequest::new(k.clone(), owner, Duration::from_secs(30)))
        .collect()
}

fn owner() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// One step over `stored`, for `owner`.
async fn step(backend: &dyn LockBackend, stored: &[String], owner: &str) -> AttemptAll {
    let requests = requests(stored, owner);
    backend
        .try_acquire_all(&requests)
        .expect("the backend takes these keys in one step")
        .await
        .expect("an answer")
}

fn held(attempt: AttemptAll) -> Vec<Lease> {
    match attempt {
        AttemptAll::Held(leases) => leases,
        other => panic!("expected every key, got {other:?}"),
    }
}

async fn release_all(backend: &dyn LockBackend, leases: &[Lease]) {
    for lease in leases {
        backend.release(lease).await.expect("release");
    }
}

fn token(lease: &Lease) -> FencingToken {
    lease.token.expect("a fenced grant has a token")
}

/// Every case that holds on any backend offering one step. `keys` are the
/// user's keys (three, in canonical order, one hash slot where it matters).
async fn one_step_cases(backend: Arc<dyn LockBackend>, keys: [String; 3], owner_of: OwnerOf) {
    let registry = Registry::builder().default_backend(backend.clone()).build();
    let prefix = registry.key_prefix().to_owned();
    let stored: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();

    // Through the runtime: one step, so one owner for every key.
    let guard = registry
        .lock_all(keys.iter().rev())
        .acquire()
        .await
        .expect("every key free");
    let mut owners = Vec::new();
    for k in &stored {
        owners.push(owner_of(k.clone()).await.expect("held on the server"));
    }
    assert!(
        owners.iter().all(|o| *o == owners[0]),
        "the keys were not taken in one step: owners {owners:?}"
    );
    let through_runtime: Vec<FencingToken> = keys
        .iter()
        .map(|k| guard.fencing_token_of(k).expect("a token per key"))
        .collect();
    guard.release().await.expect("release");
    for k in &stored {
        assert_eq!(owner_of(k.clone()).await, None, "`{k}` held after release");
    }

    // A busy key: the step names it and takes nothing.
    let elsewhere = registry.lock(&keys[1]).acquire().await.expect("acquire");
    match step(&*backend, &stored, &owner()).await {
        AttemptAll::Busy { key, .. } => assert_eq!(key, 1, "the busy key's index"),
        other => panic!("expected busy, got {other:?}"),
    }
    for k in [&keys[0], &keys[2]] {
        let plain = registry
            .lock(k)
            .wait(Duration::ZERO)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("`{k}` was left taken by a busy step: {e}"));
        plain.release().await.expect("release");
    }
    elsewhere.release().await.expect("release");

    // Waiting on a busy key: its release wakes the step (well before the
    // holder's 30 s lease ends, and before PostgreSQL's 1 s poll).
    let elsewhere = registry.lock(&keys[1]).acquire().await.expect("acquire");
    let waiting = tokio::spawn({
        let (registry, keys) = (registry.clone(), keys.clone());
        async move {
            let guard = registry
                .lock_all(&keys)
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (guard, std::time::Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = std::time::Instant::now();
    elsewhere.release().await.expect("release");
    let (guard, acquired) = waiting.await.expect("waiting task");
    let after = acquired - released;
    assert!(
        after < Duration::from_millis(900),
        "the busy key's release woke the step only after {after:?}"
    );
    guard
        .expect("every key once released")
        .release()
        .await
        .expect("release");

    // Tokens: each key's larger than its earlier ones, a retry included.
    let alone = registry.lock(&keys[2]).acquire().await.expect("acquire");
    let alone_token = alone.fencing_token().expect("token");
    alone.release().await.expect("release");
    let stepper = owner();
    let first = held(step(&*backend, &stored, &stepper).await);
    assert_eq!(first.len(), 3);
    for (i, lease) in first.iter().enumerate() {
        assert_eq!(lease.key, stored[i], "leases in the requests' order");
        assert!(
            token(lease) > through_runtime[i],
            "`{}`: {:?} after {:?}",
            stored[i],
            token(lease),
            through_runtime[i]
        );
    }
    assert!(token(&first[2]) > alone_token);
    let retry = held(step(&*backend, &stored, &stepper).await);
    for (before, after) in first.iter().zip(&retry) {
        assert!(
            token(after) > token(before),
            "a retry issues a larger token"
        );
    }
    release_all(&*backend, &retry).await;
    for k in &stored {
        assert_eq!(owner_of(k.clone()).await, None, "`{k}` held after release");
    }
}

/// Three keys of one test, in canonical order, sharing what precedes the
/// first `}` (one hash slot on Redis Cluster).
fn three_keys(case: &str) -> [String; 3] {
    let tag = unique_key(case);
    [
        format!("{{{tag}}}:1"),
        format!("{{{tag}}}:2"),
        format!("{{{tag}}}:3"),
    ]
}

#[cfg(feature = "redis")]
mod redis_backend {
    use super::*;
    use dlock_runtime::RedisBackend;
    use dlock_tests::redis_support::OwnRedis;
    use dlock_tests::{server_url, servers_missing};
    use redis::AsyncCommands;

    async fn connect(url: &str) -> RedisBackend {
        RedisBackend::connect(url)
            .await
            .unwrap_or_else(|e| servers_missing(url, e))
    }

    /// Who holds a stored key: the first line of its lock key `{K}`'s value
    /// (the owner; the holder's record follows).
    fn owner_from_redis<C>(conn: C) -> OwnerOf
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    {
        Box::new(move |stored| {
            let mut conn = conn.clone();
            Box::pin(async move {
                conn.get::<_, Option<String>>(format!("{{{stored}}}"))
                    .await
                    .expect("GET")
                    .map(owner_line)
            })
        })
    }

    fn owner_line(value: String) -> String {
        value.lines().next().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn one_step_on_one_redis_server() {
        let url = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
        let backend: Arc<dyn LockBackend> = Arc::new(connect(&url).await);
        let client = redis::Client::open(url).expect("url");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let owner_of = owner_from_redis(conn);
        one_step_cases(backend, three_keys("redis-one-step"), owner_of).await;
    }

    #[tokio::test]
    async fn one_step_on_redis_cluster_within_one_hash_slot_only() {
        let url = server_url(
            "DLOCK_TEST_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:47001,127.0.0.1:47002,127.0.0.1:47003",
        );
        let backend: Arc<dyn LockBackend> = Arc::new(connect(&url).await);
        // Lock keys `{dlock:x-one-step-a}` and `…-b}`: different slots.
        let across = requests(
            &["dlock:x-one-step-a".into(), "dlock:x-one-step-b".into()],
            "o",
        );
        assert!(
            backend.try_acquire_all(&across).is_none(),
            "keys in different hash slots are not one script"
        );
        let nodes: Vec<String> = url
            .trim_start_matches("redis+cluster://")
            .split(',')
            .map(|n| format!("redis://{n}/"))
            .collect();
        let client = redis::cluster::ClusterClient::new(nodes).expect("cluster client");
        let conn = client.get_async_connection().await.expect("connect");
        let owner_of = owner_from_redis(conn);
        one_step_cases(backend.clone(), three_keys("cluster-one-step"), owner_of).await;

        // Through the runtime across slots: one by one, one owner per key.
        let registry = Registry::builder().default_backend(backend).build();
        let guard = registry
            .lock_all(["x-one-step-a", "x-one-step-b"])
            .acquire()
            .await
            .expect("free keys");
        let mut conn = client.get_async_connection().await.expect("connect");
        let a: Option<String> = conn.get("{dlock:x-one-step-a}").await.expect("GET");
        let b: Option<String> = conn.get("{dlock:x-one-step-b}").await.expect("GET");
        let (a, b) = (a.map(owner_line), b.map(owner_line));
        assert!(a.is_some() && b.is_some(), "both held");
        assert_ne!(a, b, "keys in different slots are taken one by one");
        guard.release().await.expect("release");
    }

    /// The calls of `INFO commandstats` whose command is `name` (0 if none).
    fn calls(stats: &str, name: &str) -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn a_hold_of_three_keys_is_one_script_call() {
        let server = OwnRedis::start(47311, &[]).await;
        let mut admin = server.admin().await;
        for (fencing, url) in [
            (true, server.url()),
            (false, format!("{}?fencing=off", server.url())),
        ] {
            let registry = Registry::builder()
                .default_backend(connect(&url).await)
                .build();
            let keys = three_keys("commandstats");
            // Once first, so that the script is loaded (EVALSHA, NOSCRIPT, …).
            let warm = registry.lock_all(&keys).acquire().await.expect("acquire");
            warm.release().await.expect("release");
            let _: () = redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async(&mut admin)
                .await
                .expect("RESETSTAT");
            let guard = registry.lock_all(&keys).acquire().await.expect("acquire");
            let stats: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut admin)
                .await
                .expect("INFO");
            guard.release().await.expect("release");
            let scripts = calls(&stats, "evalsha") + calls(&stats, "eval");
            assert_eq!(
                scripts, 1,
                "fencing {fencing}: one script for three keys:\n{stats}"
            );
            // The script's own three SETs of the locks (and the counter's),
            // and no `SET … NX` sent on its own.
            assert!(
                calls(&stats, "set") <= 6,
                "fencing {fencing}: too many SETs:\n{stats}"
            );
            assert_eq!(calls(&stats, "pttl"), 0, "fencing {fencing}:\n{stats}");
        }
    }
}

/// Who holds a stored key, read from the lease table of `pool` with `sql`
/// (the stored key bound as its one parameter).
macro_rules! owner_from_table {
    ($pool:expr, $sql:expr) => {{
        let pool = $pool;
        let owner_of: OwnerOf = Box::new(move |stored| {
            let pool = pool.clone();
            Box::pin(async move {
                sqlx::query_scalar::<_, Option<String>>($sql)
                    .bind(stored)
                    .fetch_optional(&pool)
                    .await
                    .expect("select")
                    .flatten()
            })
        });
        owner_of
    }};
}

#[cfg(feature = "sqlite")]
mod sqlite_backend {
    use super::*;
    use dlock_runtime::SqliteBackend;

    #[tokio::test]
    async fn one_step_on_sqlite() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("locks.db");
        let backend = SqliteBackend::open(&path, Duration::from_millis(25))
            .await
            .expect("open");
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
            .await
            .expect("connect");
        let owner_of = owner_from_table!(pool, "SELECT owner FROM dlock_leases WHERE key = ?1");
        one_step_cases(Arc::new(backend), three_keys("sqlite-one-step"), owner_of).await;
    }
}

/// The cases of a server database: its lease table, and its session mode
/// (no one step).
macro_rules! server_database {
    ($module:ident, $feature:literal, $backend:ident, $pool:ty, $var:literal, $default:literal, $owner_sql:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;
            use dlock_runtime::$backend;
            use dlock_tests::{server_url, servers_missing};

            fn url() -> String {
                server_url($var, $default)
            }

            #[tokio::test]
            async fn one_step_on_the_lease_table() {
                let url = url();
                let backend = $backend::connect(&url)
                    .await
                    .unwrap_or_else(|e| servers_missing(&url, e));
                let pool = <$pool>::connect(&url).await.expect("connect");
                let owner_of = owner_from_table!(pool, $owner_sql);
                let keys = three_keys(concat!(stringify!($module), "-one-step"));
                one_step_cases(Arc::new(backend), keys, owner_of).await;
            }

            #[tokio::test]
            async fn session_mode_takes_several_keys_one_by_one() {
                let url = format!("{}?mode=session", url());
                let backend = $backend::connect(&url)
                    .await
                    .unwrap_or_else(|e| servers_missing(&url, e));
                let stored = ["dlock:a".to_owned(), "dlock:b".to_owned()];
                assert!(backend.try_acquire_all(&requests(&stored, "o")).is_none());
            }
        }
    };
}

server_database!(
    postgres_backend,
    "postgres",
    PostgresBackend,
    sqlx::PgPool,
    "DLOCK_TEST_POSTGRES_URL",
    "postgres://dlock:dlock@127.0.0.1:45432/dlock",
    "SELECT owner FROM dlock_leases WHERE key = $1"
);

server_database!(
    mysql_backend,
    "mysql",
    MysqlBackend,
    sqlx::MySqlPool,
    "DLOCK_TEST_MYSQL_URL",
    "mysql://dlock:dlock@127.0.0.1:43306/dlock",
    "SELECT CAST(owner AS CHAR) FROM dlock_leases WHERE k = ?"
);
