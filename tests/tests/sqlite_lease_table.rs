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

/// Another connection's `BEGIN IMMEDIATE` (5 s busy timeout): the database's
/// write lock is free, no transaction of dlock's stays open.
async fn writable(path: &Path, after: &str) {
    let mut conn = admin(path).await;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("after {after}, the write lock is still taken: {e}"));
    sqlx::query("ROLLBACK")
        .execute(&mut conn)
        .await
        .expect("rollback");
}

/// A reader's grant and a permit's release fail inside their transactions
/// (a trigger refuses the holder row's write): the attempt and the release
/// answer errors, and nothing of theirs stays open — another connection
/// writes, the registry's every connection takes new transactions, and the
/// release goes through once the trigger is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_failing_inside_their_transactions_leave_the_database_writable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "failing.db");
    let locks = registry(&url(&path)).await;
    let (grant_key, release_key) = (unique_key("refused-grant"), unique_key("refused-release"));
    // The tables exist once a key was taken.
    let permit = locks
        .lock(&release_key)
        .permits(2)
        .acquire()
        .await
        .expect("permit");
    let mut conn = admin(&path).await;
    for trigger in [
        format!(
            "CREATE TRIGGER refuse_grant BEFORE INSERT ON dlock_leases_holders \
             WHEN NEW.key = 'dlock:{grant_key}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        ),
        format!(
            "CREATE TRIGGER refuse_release BEFORE UPDATE ON dlock_leases_holders \
             WHEN OLD.key = 'dlock:{release_key}' AND NEW.owner IS NULL \
             BEGIN SELECT RAISE(ABORT, 'refused'); END"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(trigger))
            .execute(&mut conn)
            .await
            .expect("trigger");
    }
    drop(conn);
    let refused = locks.lock(&grant_key).read().acquire().await;
    assert!(refused.is_err(), "the grant was refused: {refused:?}");
    writable(&path, "a refused grant").await;
    let refused = permit.release().await;
    assert!(refused.is_err(), "the release was refused: {refused:?}");
    writable(&path, "a refused release").await;
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
    sqlx::query("DROP TRIGGER refuse_release")
        .execute(&mut admin(&path).await)
        .await
        .expect("drop trigger");
    let again = locks.lock(&release_key).permits(2).acquire().await;
    again.expect("permit").release().await.expect("release");
    writable(&path, "the releases").await;
}

/// A reader's grant and a permit's release fail at their `COMMIT` (a
/// trigger leaves a deferred foreign key dangling, which SQLite checks at
/// the commit and refuses, the transaction left open): the attempt and the
/// release answer errors, the refused grant holds nothing, and nothing of
/// theirs stays open — another connection writes, the registry's every
/// connection takes new transactions, the release goes through once the
/// trigger is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_and_releases_refused_at_their_commit_leave_the_database_writable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "refused-commit.db");
    let locks = registry(&url(&path)).await;
    let (grant_key, release_key) = (unique_key("commit-grant"), unique_key("commit-release"));
    // The tables exist once a key was taken.
    let permit = locks
        .lock(&release_key)
        .permits(2)
        .acquire()
        .await
        .expect("permit");
    let mut conn = admin(&path).await;
    for sql in [
        "CREATE TABLE parents (id INTEGER PRIMARY KEY)".to_owned(),
        "CREATE TABLE children (parent INTEGER REFERENCES parents (id) \
         DEFERRABLE INITIALLY DEFERRED)"
            .to_owned(),
        format!(
            "CREATE TRIGGER dangle_grant AFTER INSERT ON dlock_leases_holders \
             WHEN NEW.key = 'dlock:{grant_key}' BEGIN INSERT INTO children VALUES (42); END"
        ),
        format!(
            "CREATE TRIGGER dangle_release AFTER UPDATE ON dlock_leases_holders \
             WHEN OLD.key = 'dlock:{release_key}' AND NEW.owner IS NULL \
             BEGIN INSERT INTO children VALUES (42); END"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut conn)
            .await
            .expect("schema");
    }
    drop(conn);
    let refused = locks.lock(&grant_key).read().acquire().await;
    assert!(refused.is_err(), "the grant was refused: {refused:?}");
    writable(&path, "a grant refused at its commit").await;
    let live: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM dlock_leases_holders WHERE key = ?1 AND owner IS NOT NULL",
    )
    .bind(format!("dlock:{grant_key}"))
    .fetch_one(&mut admin(&path).await)
    .await
    .expect("count");
    assert_eq!(live, 0, "the refused grant holds nothing");
    let refused = permit.release().await;
    assert!(refused.is_err(), "the release was refused: {refused:?}");
    writable(&path, "a release refused at its commit").await;
    let readers = (0..6).map(|i| {
        let key = format!("{grant_key}:other:{i}");
        let locks = locks.clone();
        async move { locks.lock(&key).read().acquire().await }
    });
    for reader in futures_util::future::join_all(readers).await {
        reader.expect("reader").release().await.expect("release");
    }
    for trigger in ["dangle_grant", "dangle_release"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TRIGGER {trigger}")))
            .execute(&mut admin(&path).await)
            .await
            .expect("drop trigger");
    }
    let reader = locks.lock(&grant_key).read().acquire().await;
    reader.expect("reader").release().await.expect("release");
    let again = locks.lock(&release_key).permits(2).acquire().await;
    again.expect("permit").release().await.expect("release");
    writable(&path, "the releases").await;
}
