//! SQLite's lease table under stalls and abandonment: a database whose write
//! lock is held does not starve another backend's leases, an abandoned
//! acquisition stops, tokens survive a deleted row, and free rows are
//! collected. Each test uses its own database files and its own registries.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, Registry, SqliteBackend};
use dlock_tests::unique_key;
use sqlx::ConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};

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
    SqliteConnectOptions::new()
        .filename(path)
        .busy_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("admin connection")
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

/// Another connection holds database A's write lock for seconds, so
/// every renewal on A hangs. A lease on database B (same registry) stays held
/// and cannot be taken; the 900 ms lease on A is declared lost before it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_database_does_not_starve_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (db(&dir, "a.db"), db(&dir, "b.db"));
    let reg = Registry::builder()
        .default_backend(SqliteBackend::connect(&url(&a)).await.expect("open a"))
        .backend("b", SqliteBackend::connect(&url(&b)).await.expect("open b"))
        .build();
    let (key_a, key_long, key_b) = (
        unique_key("stalled-a"),
        unique_key("stalled-a-long"),
        unique_key("healthy-b"),
    );
    let lease = Duration::from_millis(900);
    let guard_b = reg
        .lock(&key_b)
        .backend("b")
        .lease(lease)
        .acquire()
        .await
        .expect("acquire on b");
    let b_since = Instant::now();
    // Its renewal (due at 1.33 s) hangs until its give-up instant (3.6 s):
    // A has a renewal on the wire for most of the test.
    let guard_long = reg
        .lock(&key_long)
        .lease(Duration::from_secs(4))
        .acquire()
        .await
        .expect("acquire the long lease on a");
    let asked = Instant::now();
    let guard_a = reg
        .lock(&key_a)
        .lease(lease)
        .acquire()
        .await
        .expect("acquire on a");
    let mut blocker = admin(&a).await;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut blocker)
        .await
        .expect("take a's write lock");

    tokio::time::timeout(lease, guard_a.lost())
        .await
        .expect("the lease on the stalled database is declared lost before it ends");
    let lost_after = asked.elapsed();
    assert!(
        lost_after < lease,
        "lost after {lost_after:?}, not before the lease ({lease:?}) ran out"
    );

    tokio::time::sleep_until((b_since + Duration::from_secs(3)).into()).await;
    assert!(
        !guard_b.is_lost(),
        "b's lease was lost while a's database was stalled"
    );
    let other = registry(&url(&b)).await;
    let taken = other.lock(&key_b).acquire().await;
    assert!(
        matches!(taken, Err(LockError::Busy { .. })),
        "another registry took b's key while its holder still held it: {taken:?}"
    );
    assert!(owner(&b, &key_b).await.is_some());
    guard_b
        .release()
        .await
        .expect("b's lease was held throughout");

    sqlx::query("ROLLBACK")
        .execute(&mut blocker)
        .await
        .expect("free a's write lock");
    assert!(matches!(
        guard_a.release().await,
        Err(LockError::Lost { .. })
    ));
    drop(guard_long);
}

/// A waiter whose caller gave up (its future dropped after 1 s of a
/// 60 s wait) stops waiting: when the holder releases, the key stays free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_acquisition_stops() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "abandoned.db");
    let (holder, waiter) = (registry(&url(&path)).await, registry(&url(&path)).await);
    let key = unique_key("abandoned");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("acquire");
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

/// Tokens are hybrid: after the key's row is deleted (an operator, or
/// the collection of free rows), the next token is still above the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_after_the_row_is_deleted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "tokens.db");
    let reg = registry(&url(&path)).await;
    let key = unique_key("hybrid");
    let mut last = 0;
    for round in 0..3 {
        let guard = reg.lock(&key).acquire().await.expect("acquire");
        let token = guard.fencing_token().expect("sqlite fences").get();
        assert!(token > last, "round {round}: token {token} after {last}");
        last = token;
        guard.release().await.expect("release");
        let deleted = sqlx::query("DELETE FROM dlock_leases WHERE key = ?1")
            .bind(format!("dlock:{key}"))
            .execute(&mut admin(&path).await)
            .await
            .expect("delete the row");
        assert_eq!(deleted.rows_affected(), 1, "the row existed");
    }
}

/// Free rows are collected after the retention: after 2,000 distinct
/// keys are locked and released, the table shrinks back to O(1) rows once the
/// retention (1 s) and the collection interval (min(retention, 60 s)) have
/// passed and one more release runs the collection.
/// Not covered: the SQLite backend's in-process waiter map (it has no public
/// size to observe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_rows_are_collected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = db(&dir, "bounded.db");
    let backend = SqliteBackend::connect(&format!("{}?retention=1s", url(&path)))
        .await
        .expect("open sqlite");
    let reg = Registry::builder().default_backend(backend.clone()).build();
    let prefix = unique_key("bounded");
    for i in 0..2000 {
        reg.lock(format!("{prefix}:{i}"))
            .acquire()
            .await
            .expect("acquire")
            .release()
            .await
            .expect("release");
    }
    let before = backend.row_count().await.expect("count");
    assert!(
        before > 5,
        "{before} rows right after the releases: the rows of the last second are kept"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    reg.lock(format!("{prefix}:last"))
        .acquire()
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
    let after = backend.row_count().await.expect("count");
    assert!(
        after <= 2,
        "{after} rows left of 2,001 free keys once the retention passed"
    );
}
