//! Session-mode acquisitions on the SQL servers whose connection or caller
//! goes away at awkward moments: a lock statement that reaches the server
//! after the cancel meant for it, a cancel connection that stalls, and a
//! waiting connection the server ends.
#![cfg(any(feature = "postgres", feature = "mysql"))]

use std::time::{Duration, Instant};

use dlock_runtime::Registry;
use dlock_tests::sql_db::SqlDb;
#[cfg(feature = "postgres")]
use dlock_tests::sql_support::{PG_SESSION_KEY, proxy_to, session_hash, via};
use dlock_tests::unique_key;

/// The lease of the waiters: a slice of a third of it (10 s) on the server.
const LEASE: Duration = Duration::from_secs(30);
/// How long a waiter waits in all.
const WAIT: Duration = Duration::from_secs(30);
/// How soon an abandoned wait must be gone from the server (half its slice).
const ENDED_WITHIN: Duration = Duration::from_secs(5);

/// Server processes waiting (not granted) for the session lock of
/// `stored_key`.
#[cfg(feature = "postgres")]
async fn pg_waiting(stored_key: &str) -> Vec<i32> {
    use sqlx::Connection as _;
    let url = SqlDb::Postgres.url();
    let mut admin = sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e));
    let sql = format!(
        "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND NOT l.granted \
         AND l.objsubid = 1 \
         AND l.classid::bigint = ({PG_SESSION_KEY} >> 32) & 4294967295 \
         AND l.objid::bigint = {PG_SESSION_KEY} & 4294967295"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(stored_key)
        .fetch_all(&mut admin)
        .await
        .expect("read pg_locks")
}

/// Polls `check` every 20 ms until it answers true or `within` passed;
/// answers whether it did.
async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Has a waiter of `key` on `waiters` wait on the (PostgreSQL) server, then
/// drops it; fails naming `who` if it never waited there.
async fn pg_abandon_a_waiter(waiters: &Registry, key: &str, who: &str) {
    let stored = format!("{}{key}", waiters.key_prefix());
    let waiter = spawn_waiter(waiters, key);
    assert!(
        eventually(Duration::from_secs(10), || async {
            !pg_waiting(&stored).await.is_empty()
        })
        .await,
        "{who} never waited on the server"
    );
    waiter.abort();
}

/// A waiter of `key` on `registry`, in a task of its own.
fn spawn_waiter(registry: &Registry, key: &str) -> tokio::task::JoinHandle<()> {
    let (registry, key) = (registry.clone(), key.to_owned());
    tokio::spawn(async move {
        let _ = registry.lock(&key).wait(WAIT).lease(LEASE).acquire().await;
    })
}

/// Locks and releases a key of its own through `registry`: afterwards the
/// backend keeps that connection for reuse.
async fn keep_a_connection(registry: &Registry) {
    registry
        .lock(unique_key("keep-a-connection"))
        .acquire()
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
}

/// A backend in session mode whose connections go through a proxy of
/// their own, with `options` added to its URL.
#[cfg(feature = "postgres")]
async fn pg_through_proxy(options: &str) -> (dlock_tests::sql_support::Proxy, Registry) {
    let db = SqlDb::Postgres;
    let proxy = proxy_to(&db.host_port()).await;
    let url = format!("{}?mode=session{options}", via(&db.url(), proxy.addr()));
    let registry = db.connect_url(&url).await.expect("connect").registry();
    (proxy, registry)
}

/// The caller goes away while its lock statement is still on its way to the
/// server (held in the network): the cancel sent from the backend's other
/// connection reaches an idle server process and ends nothing, then the
/// statement arrives and waits. An abandoned wait must still end on the
/// server long before its slice does.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_abandoned_wait_whose_statement_arrives_after_the_cancel_ends_on_the_server() {
    let holder = SqlDb::Postgres.registry("mode=session").await;
    let (proxy, waiters) = pg_through_proxy("").await;
    let key = unique_key("pg-statement-after-cancel");
    let stored = format!("{}{key}", waiters.key_prefix());
    let guard = holder.lock(&key).acquire().await.expect("hold");

    // The statement's parameters carry the key's 64-bit name.
    let late = Duration::from_millis(1500);
    proxy.hold_next(&[&session_hash(&stored).to_be_bytes()], late);
    let waiter = spawn_waiter(&waiters, &key);
    assert!(
        eventually(Duration::from_secs(10), || async {
            proxy.held_on().is_some()
        })
        .await,
        "the lock statement was never sent"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    waiter.abort();
    let abandoned = Instant::now();

    // The statement reaches the server `late` after it was sent.
    tokio::time::sleep(late + Duration::from_millis(500)).await;
    let ended = eventually(ENDED_WITHIN.saturating_sub(abandoned.elapsed()), || async {
        pg_waiting(&stored).await.is_empty()
    })
    .await;
    let still = pg_waiting(&stored).await;
    guard.release().await.expect("release");
    assert!(
        ended,
        "{:?} after its caller went away, the abandoned wait still waits on the server \
         (pids {still:?})",
        abandoned.elapsed()
    );
}

/// The backend's cancel connection stalls (a black hole on that one
/// connection): the cancel of the first abandoned wait is given up after
/// the backend's timeout. A later abandoned wait must still be cancelled,
/// on a connection that answers.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_abandoned_waits_are_cancelled_after_the_cancel_connection_stalled() {
    let holder = SqlDb::Postgres.registry("mode=session").await;
    let (proxy, waiters) = pg_through_proxy("&timeout=1s").await;
    let (first, second) = (
        unique_key("pg-stalled-cancel-first"),
        unique_key("pg-stalled-cancel-second"),
    );
    let stored = |k: &str| format!("{}{k}", waiters.key_prefix());
    let held = (
        holder.lock(&first).acquire().await.expect("hold"),
        holder.lock(&second).acquire().await.expect("hold"),
    );

    proxy.hold_next(&[b"pg_cancel_backend"], Duration::from_secs(120));
    pg_abandon_a_waiter(&waiters, &first, "the first waiter").await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            proxy.held_on().is_some()
        })
        .await,
        "the first cancel was never sent"
    );
    // The first abandon gives up after the backend's timeout (1 s).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    pg_abandon_a_waiter(&waiters, &second, "the second waiter").await;
    let abandoned = Instant::now();
    let ended = eventually(ENDED_WITHIN, || async {
        pg_waiting(&stored(&second)).await.is_empty()
    })
    .await;
    held.0.release().await.expect("release");
    held.1.release().await.expect("release");
    assert!(
        ended,
        "{:?} after its caller went away, the second abandoned wait still waits on the \
         server: the stalled cancel connection was kept",
        abandoned.elapsed()
    );
}

/// The server ends the connection of a caller waiting for a held key
/// (`pg_terminate_backend`, as an operator or a failover does) before
/// granting it anything: the acquisition goes on, on another connection, and
/// gets the key once its holder lets it go.
#[cfg(feature = "postgres")]
async fn postgres_waiter_whose_connection_is_terminated_goes_on_waiting(kept: bool) {
    use dlock_tests::sql_support::PgFaults;

    let holder = SqlDb::Postgres.registry("mode=session").await;
    let waiters = SqlDb::Postgres.registry("mode=session").await;
    if kept {
        keep_a_connection(&waiters).await;
    }
    let key = unique_key(&format!("pg-waiter-terminated-{kept}"));
    let stored = format!("{}{key}", waiters.key_prefix());
    let guard = holder.lock(&key).acquire().await.expect("hold");
    let waiter = {
        let (waiters, key) = (waiters.clone(), key.clone());
        tokio::spawn(async move { waiters.lock(&key).wait(WAIT).lease(LEASE).acquire().await })
    };
    let mut pids = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the waiter never waited on the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        pids = pg_waiting(&stored).await;
    }
    let faults = PgFaults {
        url: SqlDb::Postgres.url(),
        mode: dlock_tests::sql_support::SqlMode::Session,
    };
    faults.terminate(&pids).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    guard.release().await.expect("release");
    let got = tokio::time::timeout(WAIT, waiter)
        .await
        .expect("the waiter answers within its wait")
        .expect("the waiter's task");
    match got {
        Ok(g) => g.release().await.expect("release"),
        Err(e) => panic!("a waiter whose connection the server ended failed: {e:?}"),
    }
}

/// See [`postgres_waiter_whose_connection_is_terminated_goes_on_waiting`]:
/// the waiter's connection is the first it opened.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_waiter_on_a_new_connection_terminated_goes_on_waiting() {
    postgres_waiter_whose_connection_is_terminated_goes_on_waiting(false).await;
}

/// See [`postgres_waiter_whose_connection_is_terminated_goes_on_waiting`]:
/// the waiter's connection was kept from an earlier lock.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_waiter_on_a_kept_connection_terminated_goes_on_waiting() {
    postgres_waiter_whose_connection_is_terminated_goes_on_waiting(true).await;
}

/// MariaDB/MySQL: the server `KILL`s the connection of a caller waiting in
/// `GET_LOCK` for a held key, before granting it anything: the acquisition
/// goes on, on another connection, and gets the key once its holder lets it
/// go.
#[cfg(feature = "mysql")]
async fn mysql_waiter_killed_by_the_server_goes_on_waiting(kept: bool) {
    use dlock_tests::sql_support::{MyFaults, SqlMode};

    let db = SqlDb::Mysql;
    let holder = db.registry("mode=session").await;
    let waiters = db.registry("mode=session").await;
    if kept {
        keep_a_connection(&waiters).await;
    }
    let key = unique_key(&format!("mysql-waiter-killed-{kept}"));
    let stored = format!("{}{key}", waiters.key_prefix());
    let faults = MyFaults {
        url: db.url(),
        mode: SqlMode::Session,
    };
    let guard = holder.lock(&key).acquire().await.expect("hold");
    let waiter = {
        let (waiters, key) = (waiters.clone(), key.clone());
        tokio::spawn(async move { waiters.lock(&key).wait(WAIT).lease(LEASE).acquire().await })
    };
    let mut ids = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while ids.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the waiter never waited on the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        ids = my_waiting(&faults, &stored).await;
    }
    faults.kill(ids[0]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    guard.release().await.expect("release");
    let got = tokio::time::timeout(WAIT, waiter)
        .await
        .expect("the waiter answers within its wait")
        .expect("the waiter's task");
    match got {
        Ok(g) => g.release().await.expect("release"),
        Err(e) => panic!("a waiter whose connection the server killed failed: {e:?}"),
    }
}

/// See [`mysql_waiter_killed_by_the_server_goes_on_waiting`]: the waiter's
/// connection is the first it opened.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_session_waiter_on_a_new_connection_killed_goes_on_waiting() {
    mysql_waiter_killed_by_the_server_goes_on_waiting(false).await;
}

/// See [`mysql_waiter_killed_by_the_server_goes_on_waiting`]: the waiter's
/// connection was kept from an earlier lock.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_session_waiter_on_a_kept_connection_killed_goes_on_waiting() {
    mysql_waiter_killed_by_the_server_goes_on_waiting(true).await;
}

/// The connection ids of MySQL sessions waiting in `GET_LOCK` for the
/// session lock of `stored_key`.
#[cfg(feature = "mysql")]
async fn my_waiting(faults: &dlock_tests::sql_support::MyFaults, stored_key: &str) -> Vec<i64> {
    let pattern = format!(
        "%GET_LOCK('{}'%",
        dlock_tests::sql_support::mysql_lock_name(stored_key)
    );
    sqlx::query_scalar::<_, i64>(
        "SELECT CAST(id AS SIGNED) FROM information_schema.processlist \
         WHERE info LIKE ? AND id <> CONNECTION_ID()",
    )
    .bind(&pattern)
    .fetch_all(&mut faults.connect().await)
    .await
    .expect("processlist")
}

/// MariaDB/MySQL: a caller that goes away while `GET_LOCK` makes it wait
/// for a held key. The abandoned wait must end on the server long before its
/// slice does (not be left to be granted the key for nobody).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_abandoned_wait_ends_on_the_server() {
    use dlock_tests::sql_support::{MyFaults, SqlMode};

    let db = SqlDb::Mysql;
    let holder = db.registry("mode=session").await;
    let waiters = db.registry("mode=session").await;
    let key = unique_key("mysql-abandoned-wait");
    let stored = format!("{}{key}", waiters.key_prefix());
    let faults = MyFaults {
        url: db.url(),
        mode: SqlMode::Session,
    };
    let guard = holder.lock(&key).acquire().await.expect("hold");
    let waiter = spawn_waiter(&waiters, &key);
    assert!(
        eventually(Duration::from_secs(10), || async {
            !my_waiting(&faults, &stored).await.is_empty()
        })
        .await,
        "the waiter never waited on the server"
    );
    waiter.abort();
    let abandoned = Instant::now();
    let ended = eventually(ENDED_WITHIN, || async {
        my_waiting(&faults, &stored).await.is_empty()
    })
    .await;
    guard.release().await.expect("release");
    assert!(
        ended,
        "{:?} after its caller went away, the abandoned wait still waits on the server",
        abandoned.elapsed()
    );
}

/// Server processes of `app` holding an advisory lock.
#[cfg(feature = "postgres")]
async fn pg_granted_to(app: &str) -> i64 {
    use sqlx::Connection as _;
    let url = SqlDb::Postgres.url();
    let mut admin = sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e));
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.granted",
    )
    .bind(app)
    .fetch_one(&mut admin)
    .await
    .expect("pg_locks")
}

/// Callers that go away just as the key they wait for is released (the
/// cancel racing the grant), over and over on one key with the same few
/// connections: each grant made for a gone caller is undone within a round
/// trip, and the connections reused next are clean (nothing held).
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_callers_gone_as_the_key_is_granted_leave_nothing_held() {
    let holder = SqlDb::Postgres.registry("mode=session").await;
    let app = format!("grant_race_{:08x}", rand::random::<u32>());
    let waiters = SqlDb::Postgres
        .registry(&format!("mode=session&application_name={app}"))
        .await;
    let key = unique_key("pg-gone-at-grant");
    let stored = format!("{}{key}", waiters.key_prefix());
    for round in 0..20u64 {
        let guard = holder.lock(&key).acquire().await.expect("hold");
        let waiter = spawn_waiter(&waiters, &key);
        assert!(
            eventually(Duration::from_secs(10), || async {
                !pg_waiting(&stored).await.is_empty()
            })
            .await,
            "round {round}: the waiter never waited on the server"
        );
        let release = tokio::spawn(guard.release());
        tokio::time::sleep(Duration::from_micros(500 * (round % 6))).await;
        waiter.abort();
        release.await.expect("task").expect("release");
        assert!(
            eventually(Duration::from_secs(1), || async {
                pg_granted_to(&app).await == 0
            })
            .await,
            "round {round}: a lock is still granted to a gone caller's connection 1 s later"
        );
    }
}

/// The backend's cancel connection was ended by the server
/// (`pg_terminate_backend`, a restart of a pooler): a later abandoned wait
/// must still end on the server at once.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_abandoned_waits_end_after_the_cancel_connection_was_terminated() {
    use sqlx::Connection as _;

    let holder = SqlDb::Postgres.registry("mode=session").await;
    let app = format!("dead_cancel_{:08x}", rand::random::<u32>());
    let waiters = SqlDb::Postgres
        .registry(&format!("mode=session&application_name={app}"))
        .await;
    let (first, second) = (
        unique_key("pg-dead-cancel-first"),
        unique_key("pg-dead-cancel-second"),
    );
    let stored = |k: &str| format!("{}{k}", waiters.key_prefix());
    let held = (
        holder.lock(&first).acquire().await.expect("hold"),
        holder.lock(&second).acquire().await.expect("hold"),
    );
    let url = SqlDb::Postgres.url();
    let mut admin = sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| dlock_tests::servers_missing(&url, e));

    // A first abandoned wait opens the cancel connection.
    pg_abandon_a_waiter(&waiters, &first, "the first waiter").await;
    assert!(
        eventually(ENDED_WITHIN, || async {
            pg_waiting(&stored(&first)).await.is_empty()
        })
        .await,
        "the first abandoned wait was not cancelled"
    );
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = $1 AND query LIKE '%pg_cancel_backend%'",
    )
    .bind(&app)
    .fetch_one(&mut admin)
    .await
    .expect("terminate the cancel connection");
    assert_eq!(ended, 1, "one cancel connection");
    tokio::time::sleep(Duration::from_millis(300)).await;

    pg_abandon_a_waiter(&waiters, &second, "the second waiter").await;
    let abandoned = Instant::now();
    let ended = eventually(ENDED_WITHIN, || async {
        pg_waiting(&stored(&second)).await.is_empty()
    })
    .await;
    held.0.release().await.expect("release");
    held.1.release().await.expect("release");
    assert!(
        ended,
        "{:?} after its caller went away, the second abandoned wait still waits on the \
         server: the cancel connection had been ended",
        abandoned.elapsed()
    );
}
