//! PostgreSQL behind PgBouncer (`scripts/servers.sh` starts Debian's, one
//! instance in session pooling and one in transaction pooling): both modes
//! work through session pooling, also after the pooler's server connections
//! were terminated; transaction pooling is refused at connect with a `Config`
//! error saying what to use, in both modes.
#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, PostgresBackend, Registry};
use dlock_tests::sql_db::SqlDb;
use dlock_tests::{server_url, servers_missing, unique_key};

fn session_pooler_url() -> String {
    server_url(
        "DLOCK_TEST_PGBOUNCER_SESSION_URL",
        "postgres://dlock:dlock@127.0.0.1:46432/dlock",
    )
}

fn transaction_pooler_url() -> String {
    server_url(
        "DLOCK_TEST_PGBOUNCER_TRANSACTION_URL",
        "postgres://dlock:dlock@127.0.0.1:46433/dlock",
    )
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    Lease,
    Session,
}

impl Mode {
    fn option(self) -> &'static str {
        match self {
            Mode::Lease => "",
            Mode::Session => "&mode=session",
        }
    }
}

/// A name no other test (or other process on the shared servers) uses.
fn unique_app(what: &str) -> String {
    format!("pgb_{what}_{:08x}", rand::random::<u32>())
}

/// A backend through the session pooler whose server connections carry the
/// `application_name` `app`.
async fn session_pooled(mode: Mode, app: &str) -> Registry {
    let base = session_pooler_url();
    let url = format!("{base}?application_name={app}{}", mode.option());
    let backend = PostgresBackend::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&base, e));
    Registry::builder().default_backend(backend).build()
}

async fn pg_admin() -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let url = SqlDb::Postgres.url();
    sqlx::PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// Terminates, from a direct connection, every server connection whose
/// `application_name` is `app` (the pooler's, for that backend), waits until
/// they are gone, and answers how many there were.
async fn terminate_server_connections(app: &str) -> usize {
    let mut admin = pg_admin().await;
    let pids: Vec<i32> =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(app)
            .fetch_all(&mut admin)
            .await
            .expect("pg_stat_activity");
    for pid in &pids {
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(&mut admin)
            .await
            .expect("pg_terminate_backend");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)")
                .bind(&pids)
                .fetch_one(&mut admin)
                .await
                .expect("pg_stat_activity");
        if left == 0 {
            return pids.len();
        }
        assert!(
            Instant::now() < deadline,
            "{left} server connections still up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Tasks on two backends (two pools through the pooler) take turns on one
/// key: never two inside at once, and every turn is taken.
async fn check_mutual_exclusion(a: &Registry, b: &Registry, key: &str) {
    const TASKS: usize = 4;
    const TURNS: usize = 8;
    let inside = Arc::new(AtomicUsize::new(0));
    let turns = Arc::new(AtomicUsize::new(0));
    let tasks = (0..2 * TASKS).map(|i| {
        let registry = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (inside, turns, key) = (inside.clone(), turns.clone(), key.to_owned());
        tokio::spawn(async move {
            for _ in 0..TURNS {
                let guard = registry
                    .lock(key.as_str())
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .expect("acquire");
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                turns.fetch_add(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        })
    });
    for task in futures_util::future::join_all(tasks).await {
        task.expect("task");
    }
    assert_eq!(turns.load(Ordering::SeqCst), 2 * TASKS * TURNS);
}

/// A waiter on `key` (held by `holder`) gets it within a second of its
/// release, and a key released by its holder is free for another at once.
async fn check_handoff(holder: &Registry, waiter: &Registry, key: &str) {
    let guard = holder.lock(key).acquire().await.expect("holder acquires");
    let waiting = {
        let (waiter, key) = (waiter.clone(), key.to_owned());
        tokio::spawn(async move {
            let guard = waiter
                .lock(key.as_str())
                .wait(Duration::from_secs(20))
                .acquire()
                .await
                .expect("waiter acquires");
            (Instant::now(), guard)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the waiter got a held key");
    let released = Instant::now();
    guard.release().await.expect("holder releases");
    let (got, guard) = waiting.await.expect("waiter task");
    let handoff = got.saturating_duration_since(released);
    assert!(
        handoff < Duration::from_secs(5),
        "the waiter got the released key after {handoff:?}"
    );
    guard.release().await.expect("waiter releases");
    // Free at once: taken without waiting (a few tries while the release's
    // reply is on its way are allowed for, up to 500 ms).
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        match holder.lock(key).wait(Duration::ZERO).acquire().await {
            Ok(g) => {
                g.release().await.expect("release");
                break;
            }
            Err(LockError::Busy { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("a released key is not free 500 ms later: {e}"),
        }
    }
}

async fn session_pooling_excludes(mode: Mode) {
    let a = session_pooled(mode, &unique_app("excl_a")).await;
    let b = session_pooled(mode, &unique_app("excl_b")).await;
    check_mutual_exclusion(&a, &b, &unique_key(&format!("pgb-exclusion-{mode:?}"))).await;
}

async fn session_pooling_hands_off(mode: Mode) {
    let a = session_pooled(mode, &unique_app("handoff_a")).await;
    let b = session_pooled(mode, &unique_app("handoff_b")).await;
    check_handoff(&a, &b, &unique_key(&format!("pgb-handoff-{mode:?}"))).await;
}

/// The pooler's server connections of both backends are terminated while
/// the backends are idle; everything works as before afterwards.
async fn session_pooling_survives_terminated_server_connections(mode: Mode) {
    let (app_a, app_b) = (unique_app("term_a"), unique_app("term_b"));
    let a = session_pooled(mode, &app_a).await;
    let b = session_pooled(mode, &app_b).await;
    let key = unique_key(&format!("pgb-terminated-{mode:?}"));
    // Connections in use, then idle.
    let guards =
        futures_util::future::join_all((0..4).map(|i| a.lock(format!("{key}:{i}")).acquire()))
            .await;
    for g in guards {
        g.expect("acquire").release().await.expect("release");
    }
    check_handoff(&a, &b, &key).await;
    let ended =
        terminate_server_connections(&app_a).await + terminate_server_connections(&app_b).await;
    assert!(
        ended >= 2,
        "the pooler's server connections were found ({ended})"
    );
    for i in 0..4 {
        let guard = a
            .lock(format!("{key}:{i}"))
            .wait(Duration::from_secs(10))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("acquisition {i} after the termination: {e}"));
        guard.release().await.expect("release");
    }
    check_handoff(&a, &b, &key).await;
    check_handoff(&b, &a, &key).await;
    check_mutual_exclusion(&a, &b, &key).await;
}

/// Connecting through the transaction pooler fails with a `Config` error
/// that names the cause and what to use instead.
async fn transaction_pooling_is_refused(mode: Mode) {
    // One check at a time on this pooler: see `refusals` below.
    let _turn = refusals().lock().await;
    let base = transaction_pooler_url();
    let url = format!(
        "{base}?application_name={}{}",
        unique_app("tx"),
        mode.option()
    );
    let started = Instant::now();
    match PostgresBackend::connect(&url).await {
        Err(LockError::Config { .. }) => {}
        Err(e) => panic!(
            "not a Config error: {e} (is the pooler at {base} up? scripts/servers.sh up starts it)"
        ),
        Ok(_) => panic!("a transaction pooler was taken for a direct or session-pooled connection"),
    }
    let Err(err) = PostgresBackend::connect(&url).await else {
        panic!("the second connect was accepted")
    };
    let message = err.to_string();
    for expected in [
        "transaction pooling",
        "direct URL",
        "session pooling",
        "pool_mode = session",
    ] {
        assert!(
            message.contains(expected),
            "`{expected}` missing from: {message}"
        );
    }
    assert!(
        !message.contains("dlock:dlock@"),
        "the password is shown: {message}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "refused after {:?}",
        started.elapsed()
    );
}

/// The refusal tests share the transaction pooler: a check watches which
/// server connection the pooler hands out, which another test's statements
/// in the same moment could change.
fn refusals() -> &'static tokio::sync::Mutex<()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    &TURN
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_excludes_in_lease_mode() {
    session_pooling_excludes(Mode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_excludes_in_session_mode() {
    session_pooling_excludes(Mode::Session).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_hands_off_in_lease_mode() {
    session_pooling_hands_off(Mode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_hands_off_in_session_mode() {
    session_pooling_hands_off(Mode::Session).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_survives_terminated_server_connections_in_lease_mode() {
    session_pooling_survives_terminated_server_connections(Mode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_survives_terminated_server_connections_in_session_mode() {
    session_pooling_survives_terminated_server_connections(Mode::Session).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_transaction_pooling_is_refused_in_lease_mode() {
    transaction_pooling_is_refused(Mode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_transaction_pooling_is_refused_in_session_mode() {
    transaction_pooling_is_refused(Mode::Session).await;
}

/// Through the session pooler the lease mode's listener works (`LISTEN`
/// stays on its server connection), and a direct connection is not taken
/// for a pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_and_direct_connects_are_accepted() {
    let base = session_pooler_url();
    let pooled = PostgresBackend::connect(&format!("{base}?application_name={}", unique_app("ok")))
        .await
        .unwrap_or_else(|e| servers_missing(&base, e));
    assert!(pooled.is_listening(), "LISTEN through the session pooler");
    let direct = SqlDb::Postgres.url();
    let direct = PostgresBackend::connect(&direct)
        .await
        .unwrap_or_else(|e| servers_missing(&direct, e));
    assert!(direct.is_listening(), "LISTEN on a direct connection");
}

/// Readers and permits held through the session pooler (lease mode) hand
/// off to a writer and a permit seeker of another backend that wait: not
/// before the last share's release, within moments of it — also when the
/// pooler's server connections of the holders were terminated while they
/// held (their releases then go out on new ones).
async fn session_pooling_hands_shares_off(terminate: bool) {
    const PROMPT: Duration = Duration::from_secs(5);
    let (app_a, app_b) = (unique_app("shares_a"), unique_app("shares_b"));
    let a = session_pooled(Mode::Lease, &app_a).await;
    let b = session_pooled(Mode::Lease, &app_b).await;
    let rw = unique_key(&format!("pgb-shares-rw-{terminate}"));
    let sem = unique_key(&format!("pgb-shares-sem-{terminate}"));
    let mut readers = Vec::new();
    for _ in 0..2 {
        readers.push(a.lock(&rw).read().acquire().await.expect("reader"));
    }
    let mut permits = Vec::new();
    for _ in 0..2 {
        permits.push(a.lock(&sem).permits(2).acquire().await.expect("permit"));
    }
    let writer = {
        let (b, rw) = (b.clone(), rw.clone());
        tokio::spawn(async move { b.lock(&rw).wait(Duration::from_secs(60)).acquire().await })
    };
    let seeker = {
        let (b, sem) = (b.clone(), sem.clone());
        tokio::spawn(async move {
            b.lock(&sem)
                .permits(2)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !writer.is_finished() && !seeker.is_finished(),
        "the shares hold the writer and the seeker back"
    );
    if terminate {
        let ended = terminate_server_connections(&app_a).await;
        assert!(ended >= 1, "the holders' server connections were found");
    }
    readers
        .pop()
        .expect("two")
        .release()
        .await
        .expect("release a reader");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!writer.is_finished(), "a writer beside a live reader");
    let released = Instant::now();
    readers
        .pop()
        .expect("two")
        .release()
        .await
        .expect("release the last reader");
    permits
        .pop()
        .expect("two")
        .release()
        .await
        .expect("release a permit");
    let written = tokio::time::timeout(PROMPT, writer)
        .await
        .unwrap_or_else(|_| panic!("the writer waits {PROMPT:?} after the last reader left"))
        .expect("writer task")
        .expect("writer");
    let permitted = tokio::time::timeout(PROMPT.saturating_sub(released.elapsed()), seeker)
        .await
        .unwrap_or_else(|_| panic!("the seeker waits {PROMPT:?} after a permit was freed"))
        .expect("seeker task")
        .expect("seeker");
    written.release().await.expect("release the writer");
    permitted
        .release()
        .await
        .expect("release the seeker's permit");
    permits
        .pop()
        .expect("two")
        .release()
        .await
        .expect("release the other permit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_hands_readers_and_permits_off_in_lease_mode() {
    session_pooling_hands_shares_off(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_session_pooling_hands_shares_off_after_terminated_server_connections() {
    session_pooling_hands_shares_off(true).await;
}
