//! Support for the tests of SQLite's doorbells: fresh databases and their
//! bells, waiters and handoffs, a test run again in a child process, and
//! the process's watcher threads and inotify descriptors.

use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dlock_runtime::{LockError, LockGuard, Registry, SqliteBackend};

use crate::hold;

/// A fresh database path under `root` (the test binary's
/// `CARGO_TARGET_TMPDIR`) of this test's own.
pub fn db_path(root: &Path, case: &str) -> PathBuf {
    let dir = root.join(format!("doorbell-{case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    dir.join("locks.db")
}

/// The bells directory of the database `db`.
pub fn bells_dir(db: &Path) -> PathBuf {
    let mut dir = db.as_os_str().to_owned();
    dir.push(".dlock-bells");
    dir.into()
}

/// Removes the bells directory as a `/tmp` cleaner or an operator would. The
/// process's ringer thread writes bells after a release has returned, so a
/// ring may create a bell file while the directory is being emptied
/// ("Directory not empty"): the removal goes on until the directory is gone.
/// A ring never creates the directory itself, so this ends once the ringer
/// is idle.
pub fn remove_bells(db: &Path) {
    let dir = bells_dir(db);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => return,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return,
            Err(err) if err.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
                assert!(
                    Instant::now() < deadline,
                    "the bells directory kept filling for 10 s: {err}"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(err) => panic!("remove the bells: {err}"),
        }
    }
}

/// A backend of its own on `url`, and a registry over it.
pub async fn backend(url: &str) -> (SqliteBackend, Registry) {
    let backend = SqliteBackend::connect(url).await.expect("open sqlite");
    let registry = Registry::builder().default_backend(backend.clone()).build();
    (backend, registry)
}

/// The bucket of a stored key: a copy of the protocol's hash (32-bit FNV-1a
/// xor-folded to 8 bits), checked against the runtime's own unit test values.
pub fn bucket(stored_key: &str) -> u8 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in stored_key.as_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    let folded = hash ^ (hash >> 16);
    (folded ^ (folded >> 8)) as u8
}

/// The bell file of `user_key` (default prefix) of the database `db`.
pub fn bell_path(db: &Path, user_key: &str) -> PathBuf {
    assert_eq!(bucket("dlock:order:1"), 0x18, "the hash copy drifted");
    bells_dir(db).join(format!("{:02x}", bucket(&format!("dlock:{user_key}"))))
}

/// `path` (absolute) as a path relative to the current directory.
pub fn relative_to_cwd(path: &Path) -> PathBuf {
    let cwd = std::env::current_dir().expect("cwd");
    if let Ok(rest) = path.strip_prefix(&cwd) {
        return rest.to_owned();
    }
    let mut rel = PathBuf::new();
    for c in cwd.components() {
        if matches!(c, Component::Normal(_)) {
            rel.push("..");
        }
    }
    rel.push(path.strip_prefix("/").expect("absolute"));
    assert!(!rel.is_absolute());
    rel
}

/// A task that waits up to 20 s for `key` on `registry` (30 s lease).
pub fn spawn_waiter(
    registry: &Registry,
    key: &str,
) -> tokio::task::JoinHandle<Result<LockGuard, LockError>> {
    let registry = registry.clone();
    let key = key.to_owned();
    tokio::spawn(async move {
        registry
            .lock(key)
            .lease(Duration::from_secs(30))
            .wait(Duration::from_secs(20))
            .acquire()
            .await
    })
}

/// Has a waiter of `waiter` (a registry over `waiting`) wait for the held
/// `key` until its wake-up is registered, then gives up: `waiting` has set
/// up its watcher (if it can) however long the waiter's first attempt took.
pub async fn wait_until_registered(waiting: &SqliteBackend, waiter: &Registry, key: &str) {
    let waits = spawn_waiter(waiter, key);
    let deadline = Instant::now() + Duration::from_secs(15);
    while waiting.doorbell_waits() == 0 && !waits.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the waiter never registered its wake-up"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    waits.abort();
    let _ = waits.await;
}

/// Releases `guard` and gives the waiter `within` to take the key; returns
/// how long it took, or `None` if it was still waiting.
pub async fn handoff(
    guard: LockGuard,
    waiter: tokio::task::JoinHandle<Result<LockGuard, LockError>>,
    within: Duration,
) -> Option<Duration> {
    let released = Instant::now();
    guard.release().await.expect("release");
    match tokio::time::timeout(within, waiter).await {
        Ok(taken) => {
            let took = released.elapsed();
            let guard = taken
                .expect("the waiter's task")
                .expect("the waiter acquires");
            guard.release().await.expect("release");
            Some(took)
        }
        Err(_) => None,
    }
}

/// Whether `registry` finds `key` busy for `within` (its acquisition fails).
pub async fn finds_busy(registry: &Registry, key: &str, within: Duration) -> bool {
    registry.lock(key).wait(within).acquire().await.is_err()
}

/// Whether a [`handoff`] took under a second: the waiter was rung awake
/// (its poll is 10 s, its holder's lease 30 s).
pub fn rung_awake(took: Option<Duration>) -> bool {
    took.is_some_and(|t| t < Duration::from_secs(1))
}

/// A database of a test's own and two backends on it, each with its own
/// local waiters and watcher, as two processes would have: a holder's and a
/// waiter's.
pub struct TwoBackends {
    /// The database file.
    pub db: PathBuf,
    /// The URL both backends opened.
    pub url: String,
    /// The holder's backend.
    pub holding: SqliteBackend,
    /// A registry over the holder's backend.
    pub holder: Registry,
    /// The waiter's backend.
    pub waiting: SqliteBackend,
    /// A registry over the waiter's backend.
    pub waiter: Registry,
}

impl TwoBackends {
    /// Both backends on `url`, a URL of the database `db`.
    pub async fn open(db: PathBuf, url: String) -> Self {
        let (holding, holder) = backend(&url).await;
        let (waiting, waiter) = backend(&url).await;
        TwoBackends {
            db,
            url,
            holding,
            holder,
            waiting,
            waiter,
        }
    }

    /// Both backends on `sqlite://<db><query>` (`query`: `?poll=10s`, or
    /// empty).
    pub async fn on(db: PathBuf, query: &str) -> Self {
        let url = format!("sqlite://{}{query}", db.display());
        Self::open(db, url).await
    }

    /// Holds `key` on the holder's backend, with a waiter of the waiter's
    /// backend queued behind it.
    pub async fn queue(&self, key: &str) -> Queued {
        Queued::behind(hold(&self.holder, key).await, &self.waiter, key).await
    }
}

/// A held key and a waiter queued behind it.
pub struct Queued {
    guard: LockGuard,
    waiter: tokio::task::JoinHandle<Result<LockGuard, LockError>>,
}

impl Queued {
    /// Starts a waiter of `registry` for `key`, which `guard` holds, and
    /// checks 50 ms later that it found the key busy and waits.
    pub async fn behind(guard: LockGuard, registry: &Registry, key: &str) -> Self {
        let waiter = spawn_waiter(registry, key);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "the key was not busy");
        Queued { guard, waiter }
    }

    /// Releases the key: how long the waiter took to take it, `None` if it
    /// still waited after 3 s (see [`handoff`]).
    pub async fn release(self) -> Option<Duration> {
        handoff(self.guard, self.waiter, Duration::from_secs(3)).await
    }
}

/// For a test that runs in a child process: in the test process, runs the
/// test `name` again in a child with `env` set (see [`run_in_child`]) and
/// answers `None`; in the child, answers the runtime to run the test on (two
/// workers, as dlock's own).
pub fn in_child_process(name: &str, env: &str, limit: Duration) -> Option<tokio::runtime::Runtime> {
    if std::env::var(env).is_err() {
        run_in_child(name, env, limit);
        return None;
    }
    Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime"),
    )
}

/// Runs the test `name` of this binary again in a child process with `env`
/// set, and fails with its output if it fails (for tests that would disturb
/// the others in this process: they share dlock's I/O runtime and its count
/// of threads and descriptors).
pub fn run_in_child(name: &str, env: &str, limit: Duration) {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("the child's output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("---- child ----\n{text}---- end of child ----");
    assert!(
        started.elapsed() <= limit,
        "the child did not end within {limit:?}"
    );
    assert!(out.status.success(), "the child failed: {}", out.status);
}

/// The inotify descriptors this process has open.
pub fn inotify_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains("inotify"))
        .count()
}

/// The watcher (`notify-rs`) threads of this process.
pub fn watcher_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("notify-rs"))
        .count()
}
