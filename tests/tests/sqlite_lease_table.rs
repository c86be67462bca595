//! SQLite's lease table: the lease-table suite every SQL database runs
//! (`tests/src/sql_lease_table.rs`; tokens after a deleted row, a row taken
//! over, row collection, bad URLs), and under stalls and abandonment: a
//! database whose write lock is held does not starve another backend's
//! leases, an abandoned acquisition stops. The suite runs on one database
//! file per process; the other tests use database files and registries of
//! their own.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dlock_runtime::{Registry, SqliteBackend};
use dlock_tests::scenarios::StalledAndHealthy;
use dlock_tests::sql_db::{SqlDb, SqlTarget, SqliteFaults};
use dlock_tests::sql_support::SqlMode;
use dlock_tests::{hold, unique_key};
use sqlx::sqlite::SqliteConnection;

/// The lease-table suite's database: one file per test binary run, under
/// target/ (the tests' own).
async fn target() -> SqlTarget {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(|| {
        Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("sqlite-lease-table-{}.db", std::process::id()))
    });
    SqlTarget::get(SqlDb::Sqlite(path), SqlMode::Lease).await
}

dlock_tests::sql_lease_table_suite!(target);

fn url(path: &Path) -> String {
    format!("sqlite://{}", path.display())
}

async fn registry(url: &str) -> Registry {
    Registry::builder()
        .default_backend(SqliteBackend::connect(url).await.expect("open sqlite"))
        .build()
}

/// A connection of its own to the database file, as an operator or another
/// program would have.
async fn admin(path: &Path) -> SqliteConnection {
    SqliteFaults::connect_to(path).await
}

/// The owner of `key`'s row (`None`: free or no row), read directly.
async fn owner(path: &Path, key: &str) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>("SELECT owner FROM dlock_leases WHERE key = ?1")
        .bind(format!("dlock:{key}"))
        .fetch_optional(&mut admin(path).await)
        .await
        .expect("read the row")
        .flatten()
}

fn db(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

/// Another connection holds database A's write lock for seconds, so every
/// renewal on A hangs. A lease on database B (same registry) stays held and
/// cannot be taken; the 900 ms lease on A is declared lost before it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_database_does_not_starve_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (db(&dir, "a.db"), db(&dir, "b.db"));
    let reg = Registry::builder()
        .default_backend(SqliteBackend::connect(&url(&a)).await.expect("open a"))
        .backend("b", SqliteBackend::connect(&url(&b)).await.expect("open b"))
        .build();
    let leases = StalledAndHealthy::acquire(&reg, "b").await;
    let mut blocker = admin(&a).await;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut blocker)
        .await
        .expect("take a's write lock");
    leases.stalled_lease_is_lost_before_it_ends().await;
    leases
        .healthy_lease_is_held_after_3s(&registry(&url(&b)).await)
        .await;
    assert!(owner(&b, leases.healthy_key()).await.is_some());
    leases
        .finish(async {
            sqlx::query("ROLLBACK")
                .execute(&mut blocker)
                .await
                .expect("free a's write lock");
        })
        .await;
}

/// A waiter whose caller gave up (its future dropped after 1 s of a
/// 60 s wait) stops waiting: when the holder releases, the key stays free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_acquisition_stops() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "abandoned.db");
    let (holder, waiter) = (registry(&url(&path)).await, registry(&url(&path)).await);
    let key = unique_key("abandoned");
    let guard = hold(&holder, &key).await;
    let held_token = guard.fencing_token().expect("sqlite fences").get();
    let started = Instant::now();
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        waiter.lock(&key).wait(Duration::from_secs(60)).acquire(),
    )
    .await;
    assert!(gave_up.is_err(), "the key was busy for the whole second");
    tokio::time::sleep_until((started + Duration::from_millis(1500)).into()).await;
    guard.release().await.expect("release");
    tokio::time::sleep_until((started + Duration::from_secs(2)).into()).await;
    let row_owner = owner(&path, &key).await;
    assert_eq!(
        row_owner, None,
        "the abandoned waiter holds the key its caller gave up on"
    );
    // Nobody took the key since the holder: its row still has the holder's token.
    let row_token: i64 = sqlx::query_scalar("SELECT token FROM dlock_leases WHERE key = ?1")
        .bind(format!("dlock:{key}"))
        .fetch_one(&mut admin(&path).await)
        .await
        .expect("read the row");
    assert_eq!(
        row_token as u64, held_token,
        "the abandoned waiter took the key (and let it go) after its caller had gone"
    );
    holder
        .lock(&key)
        .acquire()
        .await
        .expect("free at once")
        .release()
        .await
        .expect("release");
}

/// A reader's grant and a permit's release are refused by the statements
/// `refusal` (grant key, release key) installs, which `triggers` names: the
/// attempt and the release answer errors, the refused grant holds nothing,
/// and nothing of theirs stays open — another connection writes, the
/// registry's every connection takes new transactions, and both go through
/// once the triggers are gone.
async fn refused_shares_leave_the_database_writable(
    name: &str,
    refusal: impl Fn(&str, &str) -> Vec<String>,
    triggers: [&str; 2],
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, &format!("{name}.db"));
    let locks = registry(&url(&path)).await;
    let grant_key = unique_key(&format!("{name}-grant"));
    let release_key = unique_key(&format!("{name}-release"));
    // The tables exist once a key was taken.
    let permit = locks
        .lock(&release_key)
        .permits(2)
        .acquire()
        .await
        .expect("permit");
    let mut conn = admin(&path).await;
    for sql in refusal(
        &format!("dlock:{grant_key}"),
        &format!("dlock:{release_key}"),
    ) {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut conn)
            .await
            .expect("schema");
    }
    let refused = locks.lock(&grant_key).read().acquire().await;
    assert!(
        refused.is_err(),
        "{name}: the grant was refused: {refused:?}"
    );
    SqliteFaults::assert_writable(&path, &format!("{name}: a refused grant")).await;
    let live: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM dlock_leases_holders WHERE key = ?1 AND owner IS NOT NULL",
    )
    .bind(format!("dlock:{grant_key}"))
    .fetch_one(&mut conn)
    .await
    .expect("count");
    assert_eq!(live, 0, "{name}: the refused grant holds nothing");
    let refused = permit.release().await;
    assert!(
        refused.is_err(),
        "{name}: the release was refused: {refused:?}"
    );
    SqliteFaults::assert_writable(&path, &format!("{name}: a refused release")).await;
    // More transactions at once than the pool has connections: each of
    // them begins.
    let readers = (0..6).map(|i| {
        let key = format!("{grant_key}:other:{i}");
        let locks = locks.clone();
        async move { locks.lock(&key).read().acquire().await }
    });
    for reader in futures_util::future::join_all(readers).await {
        reader.expect("reader").release().await.expect("release");
    }
    for trigger in triggers {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TRIGGER {trigger}")))
            .execute(&mut conn)
            .await
            .expect("drop trigger");
    }
    let reader = locks.lock(&grant_key).read().acquire().await;
    reader.expect("reader").release().await.expect("release");
    let again = locks.lock(&release_key).permits(2).acquire().await;
    again.expect("permit").release().await.expect("release");
    SqliteFaults::assert_writable(&path, &format!("{name}: the releases")).await;
}

/// The holder row's write refused inside the transaction (a trigger
/// raises `ABORT`: the statement is undone, the transaction stays open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_failing_inside_their_transactions_leave_the_database_writable() {
    refused_shares_leave_the_database_writable(
        "refused-statement",
        |grant, release| {
            vec![
                format!(
                    "CREATE TRIGGER refuse_grant BEFORE INSERT ON dlock_leases_holders \
                     WHEN NEW.key = '{grant}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
                ),
                format!(
                    "CREATE TRIGGER refuse_release BEFORE UPDATE ON dlock_leases_holders \
                     WHEN OLD.key = '{release}' AND NEW.owner IS NULL \
                     BEGIN SELECT RAISE(ABORT, 'refused'); END"
                ),
            ]
        },
        ["refuse_grant", "refuse_release"],
    )
    .await;
}

/// The transaction refused at its `COMMIT` (a trigger leaves a deferred
/// foreign key dangling, which SQLite checks at the commit and refuses, the
/// transaction left open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_and_releases_refused_at_their_commit_leave_the_database_writable() {
    refused_shares_leave_the_database_writable(
        "refused-commit",
        |grant, release| {
            vec![
                "CREATE TABLE parents (id INTEGER PRIMARY KEY)".to_owned(),
                "CREATE TABLE children (parent INTEGER REFERENCES parents (id) \
                 DEFERRABLE INITIALLY DEFERRED)"
                    .to_owned(),
                format!(
                    "CREATE TRIGGER dangle_grant AFTER INSERT ON dlock_leases_holders \
                     WHEN NEW.key = '{grant}' BEGIN INSERT INTO children VALUES (42); END"
                ),
                format!(
                    "CREATE TRIGGER dangle_release AFTER UPDATE ON dlock_leases_holders \
                     WHEN OLD.key = '{release}' AND NEW.owner IS NULL \
                     BEGIN INSERT INTO children VALUES (42); END"
                ),
            ]
        },
        ["dangle_grant", "dangle_release"],
    )
    .await;
}

/// Makes `slow`, a table whose join with itself takes at least 400 ms to
/// count on this machine: a trigger that counts it holds its statement
/// that long. Answers how long the count took.
async fn slow_table(conn: &mut SqliteConnection) -> Duration {
    sqlx::query("CREATE TABLE slow (x INTEGER)")
        .execute(&mut *conn)
        .await
        .expect("slow table");
    let mut rows = 0;
    let mut step = 256;
    loop {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
             INSERT INTO slow SELECT i FROM n",
        )
        .bind(step)
        .execute(&mut *conn)
        .await
        .expect("fill");
        rows += step;
        let started = Instant::now();
        sqlx::query("SELECT count(*) FROM slow a, slow b")
            .execute(&mut *conn)
            .await
            .expect("count");
        let took = started.elapsed();
        if took >= Duration::from_millis(400) {
            return took;
        }
        assert!(rows < 1_000_000, "{rows} rows count in {took:?}");
        step = rows;
    }
}

/// `key`'s live holder rows, read on a connection of its own.
async fn live_shares(path: &Path, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM dlock_leases_holders WHERE key = ?1 AND owner IS NOT NULL \
         AND expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER)",
    )
    .bind(format!("dlock:{key}"))
    .fetch_one(&mut admin(path).await)
    .await
    .expect("count")
}

/// Callers leave while a statement of their share's grant or release runs
/// (a trigger holds it): while the key's row is made, while the holder
/// row is written before the commit, while the release writes. Another
/// registry's caller waiting for the write lock meanwhile gets its share
/// once the statement is done; the grants are undone and the release is
/// made within moments (far before the 60 s lease), and no transaction
/// stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_whose_callers_leave_mid_statement_are_undone_or_released_at_once() {
    const LEASE: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "mid-statement.db");
    let (locks, others) = (registry(&url(&path)).await, registry(&url(&path)).await);
    let open_key = unique_key("slow-open");
    let grant_key = unique_key("slow-grant");
    let release_key = unique_key("slow-release");
    let permit = locks
        .lock(&release_key)
        .permits(2)
        .lease(LEASE)
        .acquire()
        .await
        .expect("permit");
    let mut conn = admin(&path).await;
    let slow = slow_table(&mut conn).await;
    for trigger in [
        format!(
            "CREATE TRIGGER slow_open BEFORE INSERT ON dlock_leases \
             WHEN NEW.key = 'dlock:{open_key}' \
             BEGIN SELECT count(*) FROM slow a, slow b; END"
        ),
        format!(
            "CREATE TRIGGER slow_grant AFTER INSERT ON dlock_leases_holders \
             WHEN NEW.key = 'dlock:{grant_key}' \
             BEGIN SELECT count(*) FROM slow a, slow b; END"
        ),
        format!(
            "CREATE TRIGGER slow_release AFTER UPDATE ON dlock_leases_holders \
             WHEN NEW.key = 'dlock:{release_key}' AND NEW.owner IS NULL \
             BEGIN SELECT count(*) FROM slow a, slow b; END"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(trigger))
            .execute(&mut conn)
            .await
            .expect("trigger");
    }
    drop(conn);
    let bound = slow * 4 + Duration::from_secs(3);
    for (key, permits) in [(&open_key, None), (&grant_key, Some(2))] {
        let what = if permits.is_some() {
            "permit"
        } else {
            "reader"
        };
        let lock = match permits {
            Some(n) => locks.lock(key).permits(n),
            None => locks.lock(key).read(),
        };
        let left = tokio::time::timeout(slow / 2, lock.lease(LEASE).acquire()).await;
        assert!(left.is_err(), "{what}: the statement holds the attempt");
        let left_at = Instant::now();
        let other = others
            .lock(unique_key("meanwhile"))
            .read()
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{what}: another registry's reader: {e}"));
        assert!(
            left_at.elapsed() < bound,
            "{what}: another registry's reader waited {:?}",
            left_at.elapsed()
        );
        other.release().await.expect("release");
        let writer = others
            .lock(key)
            .wait(bound)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{what}: a writer after the left grant: {e}"));
        assert!(
            left_at.elapsed() < bound * 2,
            "{what}: the writer waited {:?} after the caller left",
            left_at.elapsed()
        );
        writer.release().await.expect("release");
        SqliteFaults::assert_writable(&path, &format!("a {what}'s grant left mid-statement")).await;
    }
    let left = tokio::time::timeout(slow / 2, permit.release()).await;
    assert!(left.is_err(), "the statement holds the release");
    let left_at = Instant::now();
    while live_shares(&path, &release_key).await > 0 {
        assert!(
            left_at.elapsed() < bound * 2,
            "the permit still stands {:?} after its release was left",
            left_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    SqliteFaults::assert_writable(&path, "a release left mid-statement").await;
}

/// Slows every grant of a share of `keys` (a trigger on the holder row's
/// insert): the calibrated time the trigger takes.
async fn slow_grants(path: &Path, keys: &[&String]) -> Duration {
    let mut conn = admin(path).await;
    let slow = slow_table(&mut conn).await;
    let names: Vec<String> = keys.iter().map(|k| format!("'dlock:{k}'")).collect();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TRIGGER slow_grants AFTER INSERT ON dlock_leases_holders \
         WHEN NEW.key IN ({}) BEGIN SELECT count(*) FROM slow a, slow b; END",
        names.join(", ")
    )))
    .execute(&mut conn)
    .await
    .expect("trigger");
    slow
}

/// Until no share of `keys` stands, for `bound` at most.
async fn shares_end_within(path: &Path, keys: &[&String], bound: Duration, after: &str) {
    let started = Instant::now();
    for key in keys {
        while live_shares(path, key).await > 0 {
            assert!(
                started.elapsed() < bound,
                "{key}: a share stands {bound:?} after {after}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A reader's and a permit's callers, each on a `current_thread` runtime
/// of its own, are mid-grant (the holder row's statement held by a
/// trigger) when their runtimes are shut down: neither share stands once
/// the statements are done, far within the 60 s lease, and no transaction
/// stays open; another registry takes both keys.
#[test]
fn shares_mid_grant_when_their_runtimes_shut_down_are_undone() {
    const LEASE: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "runtime-mid-grant.db");
    let (reader_key, permit_key) = (unique_key("rt-mid-reader"), unique_key("rt-mid-permit"));
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (others, slow) = main.block_on(async {
        let others = registry(&url(&path)).await;
        dlock_tests::acquire_and_release(&others, &unique_key("warm")).await;
        let slow = slow_grants(&path, &[&reader_key, &permit_key]).await;
        (others, slow)
    });
    let callers: Vec<_> = [(reader_key.clone(), false), (permit_key.clone(), true)]
        .into_iter()
        .map(|(key, permit)| {
            let path = path.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let registry = runtime.block_on(async {
                    let registry = registry(&url(&path)).await;
                    let lock = if permit {
                        registry.lock(&key).permits(2)
                    } else {
                        registry.lock(&key).read()
                    };
                    let attempt = tokio::spawn(lock.lease(LEASE).acquire());
                    tokio::time::sleep(slow / 2).await;
                    assert!(!attempt.is_finished(), "{key}: the trigger holds the grant");
                    registry
                });
                drop(runtime);
                registry
            })
        })
        .collect();
    let registries: Vec<Registry> = callers
        .into_iter()
        .map(|c| c.join().expect("caller"))
        .collect();
    main.block_on(async {
        let keys = [&reader_key, &permit_key];
        shares_end_within(&path, &keys, slow * 4 + Duration::from_secs(3), "shutdown").await;
        SqliteFaults::assert_writable(&path, "runtimes shut down mid-grant").await;
        let writer = others
            .lock(&reader_key)
            .wait(Duration::from_secs(10))
            .acquire()
            .await
            .expect("a writer after the reader's grant was undone");
        writer.release().await.expect("release");
        let both = [
            others.lock(&permit_key).permits(2),
            others.lock(&permit_key).permits(2),
        ]
        .map(|lock| lock.wait(Duration::from_secs(10)).acquire());
        for permit in futures_util::future::join_all(both).await {
            permit
                .expect("both permits")
                .release()
                .await
                .expect("release");
        }
    });
    drop(registries);
}

/// The registry is shut down while its callers' grants of a reader and a
/// permit are mid-statement (a trigger holds the holder row's insert):
/// shutdown returns with nothing unfinished, no share stands, no
/// transaction stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_with_shares_mid_grant_leaves_nothing_held_or_open() {
    const LEASE: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "shutdown-mid-grant.db");
    let (reader_key, permit_key) = (unique_key("sd-mid-reader"), unique_key("sd-mid-permit"));
    let shared = registry(&url(&path)).await;
    dlock_tests::acquire_and_release(&shared, &unique_key("warm")).await;
    let slow = slow_grants(&path, &[&reader_key, &permit_key]).await;
    let attempts = [
        tokio::spawn(shared.lock(&reader_key).read().lease(LEASE).acquire()),
        tokio::spawn(shared.lock(&permit_key).permits(2).lease(LEASE).acquire()),
    ];
    tokio::time::sleep(slow / 2).await;
    assert!(
        attempts.iter().all(|a| !a.is_finished()),
        "the trigger holds the grants"
    );
    let report = shared.shutdown(Duration::from_secs(30)).await;
    assert_eq!(report.unfinished, 0, "shutdown finished everything");
    for attempt in attempts {
        let stopped = attempt.await.expect("attempt task");
        assert!(stopped.is_err(), "shutdown stopped it: {stopped:?}");
    }
    let keys = [&reader_key, &permit_key];
    shares_end_within(&path, &keys, Duration::from_secs(1), "shutdown returned").await;
    SqliteFaults::assert_writable(&path, "a shutdown mid-grant").await;
}
