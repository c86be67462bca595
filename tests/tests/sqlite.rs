//! The conformance suite on the SQLite lease table, and the guarantees that
//! need several processes: mutual exclusion between processes sharing the
//! file, and a SIGKILLed holder that costs the others at most its lease.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dlock_runtime::{Registry, lock};
use dlock_tests::sql_db::{SqlDb, SqlTarget};
use dlock_tests::sql_support::SqlMode;
use dlock_tests::{Harness, unique_key};

/// One database per test binary run, under target/ (the tests' own), or
/// `DLOCK_TEST_SQLITE_PATH`.
fn db_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::var_os("DLOCK_TEST_SQLITE_PATH")
            .map(Into::into)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_TARGET_TMPDIR"))
                    .join(format!("sqlite-{}.db", std::process::id()))
            })
    })
}

async fn harness() -> &'static Harness {
    SqlTarget::get(SqlDb::Sqlite(db_path()), SqlMode::Lease)
        .await
        .h
}

dlock_tests::conformance_suite!(harness);
dlock_tests::semaphore_suite!(harness);
dlock_tests::rw_suite!(harness);

/// What a child process of this test binary does, chosen by `DLOCK_CHILD`.
/// Runs only as a child (the variable is unset in a normal test run).
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var("DLOCK_CHILD") else {
        return;
    };
    let url = std::env::var("DLOCK_CHILD_URL").expect("url");
    let key = std::env::var("DLOCK_CHILD_KEY").expect("key");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        dlock_runtime::init(Registry::from_url(&url).await.expect("open")).expect("init");
        match role.as_str() {
            // Take the lock, say so, and hold it until killed.
            "hold" => {
                let guard = lock(&key)
                    .lease(Duration::from_millis(1500))
                    .acquire()
                    .await
                    .expect("child acquires");
                println!("HOLDING {}", guard.fencing_token().expect("token"));
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            // Fenced read-modify-write of a counter file, many times.
            "count" => {
                let file = std::env::var("DLOCK_CHILD_FILE").expect("file");
                for _ in 0..25 {
                    let guard = lock(&key)
                        .wait(Duration::from_secs(60))
                        .lease(Duration::from_secs(10))
                        .acquire()
                        .await
                        .expect("acquire");
                    let n: u64 = std::fs::read_to_string(&file)
                        .ok()
                        .and_then(|s| s.trim().parse().ok())
                        .unwrap_or(0);
                    tokio::task::yield_now().await;
                    std::fs::write(&file, format!("{}\n", n + 1)).expect("write");
                    guard.release().await.expect("release");
                }
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

fn child(role: &str, key: &str, extra: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args([
        "--exact",
        "child_process_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("DLOCK_CHILD", role)
    .env(
        "DLOCK_CHILD_URL",
        format!("sqlite://{}", db_path().display()),
    )
    .env("DLOCK_CHILD_KEY", key);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_exclude_each_other() {
    harness().await;
    let key = unique_key("processes");
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("counter-{}", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let children: Vec<_> = (0..4)
        .map(|_| {
            child(
                "count",
                &key,
                &[("DLOCK_CHILD_FILE", file.display().to_string())],
            )
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn")
        })
        .collect();
    for mut c in children {
        assert!(c.wait().expect("wait").success(), "a child failed");
    }
    let total: u64 = std::fs::read_to_string(&file)
        .expect("counter")
        .trim()
        .parse()
        .expect("number");
    assert_eq!(total, 100, "lost updates: the processes overlapped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_costs_at_most_its_lease() {
    use std::io::BufRead;
    harness().await;
    let key = unique_key("killed");
    let mut holder = child("hold", &key, &[])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    let mut out = std::io::BufReader::new(holder.stdout.take().expect("stdout"));
    // The test harness of the child prints its own lines first.
    while !line.contains("HOLDING ") {
        line.clear();
        if out.read_line(&mut line).expect("read") == 0 {
            break;
        }
    }
    let (_, token) = line
        .split_once("HOLDING ")
        .expect("the child took the lock");
    let child_token: u64 = token.trim().parse().expect("token");
    holder.kill().expect("SIGKILL"); // Child::kill sends SIGKILL on Unix.
    holder.wait().expect("reaped");
    let killed_at = Instant::now();
    let guard = lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the lock comes back after the dead holder's lease");
    let took = killed_at.elapsed();
    assert!(
        took < Duration::from_millis(1500) + Duration::from_millis(700),
        "took {took:?}"
    );
    assert!(u64::from(guard.fencing_token().expect("token")) > child_token);
    guard.release().await.expect("release");
}

#[tokio::test]
async fn unwritable_path_is_an_error_not_a_panic() {
    let result = Registry::from_url("sqlite:///proc/definitely/not/here.db").await;
    assert!(result.is_err(), "{result:?}");
}
