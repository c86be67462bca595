//! The `dlock` binary run as an operator runs it, against real servers: a
//! lock held here through dlock-runtime, the command run as a child process
//! on the same backend, its output and exit code checked; `watch` driven in
//! a terminal (tmux).

use std::io::Write as _;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use dlock_runtime::{LockGuard, Registry};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

/// Runs `dlock` with `args` (no `DLOCK_URL` from the environment), feeding
/// `stdin` when given; off the async runtime so the test's lock keeps renewing.
async fn dlock(args: &[&str], stdin: Option<&str>) -> Output {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let stdin = stdin.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        let mut child = Command::new(DLOCK)
            .args(&args)
            .env_remove("DLOCK_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the dlock binary starts");
        let mut input = child.stdin.take().expect("stdin is piped");
        if let Some(text) = stdin {
            input
                .write_all(text.as_bytes())
                .expect("stdin takes the answer");
        }
        drop(input);
        child.wait_with_output().expect("dlock ends")
    })
    .await
    .expect("the child's thread")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts an exit code, showing both streams when it differs.
fn assert_exit(out: &Output, code: i32, what: &str) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        stdout(out),
        stderr(out)
    );
}

/// A key no other test run uses.
fn unique_key(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    format!("cli-test:{name}:{}:{nanos}", std::process::id())
}

/// A shared test server's URL from `urls.env`'s variable, else its default.
fn server_url(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// The registry a test holds its locks through.
async fn registry(url: &str) -> Registry {
    let backend = dlock_runtime::connect(url).await.unwrap_or_else(|e| {
        panic!(
            "cannot reach the test server ({e}); start them with scripts/servers.sh and \
             export target/servers/urls.env"
        )
    });
    Registry::builder()
        .default_backend(backend)
        .holder_name("cli-test")
        .build()
}

async fn hold(registry: &Registry, key: &str) -> LockGuard {
    registry
        .lock(key)
        .lease(Duration::from_secs(3))
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the test takes the key")
}

/// list, show, `--json` on both sides of the command, a refused revoke and
/// a confirmed one, on the backend `url` names.
async fn operates_a_held_key(url: &str) {
    let registry = registry(url).await;
    let key = unique_key("held");
    let guard = hold(&registry, &key).await;
    let token = guard
        .fencing_token()
        .expect("the backend fences")
        .get()
        .to_string();
    let pid = std::process::id().to_string();

    // The prefix of this run's key: other runs' keys stay out of the way.
    let prefix = key.rsplit_once(':').expect("key has a suffix").0.to_owned();
    let list = dlock(&["--url", url, "list", &prefix], None).await;
    assert_exit(&list, 0, "list");
    let text = stdout(&list);
    assert!(text.starts_with("KEY "), "list shows a table:\n{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_else(|| panic!("list shows {key}:\n{text}"));
    assert!(
        row.contains("cli-test (") && row.contains(&format!("pid {pid})")),
        "the row names this process: {row}"
    );
    assert!(
        row.split_whitespace().any(|cell| cell == token),
        "the row shows token {token}: {row}"
    );

    let show = dlock(&["show", &key, "--url", url], None).await;
    assert_exit(&show, 0, "show");
    let text = stdout(&show);
    assert!(text.contains(&format!("key:         {key}")), "{text}");
    assert!(text.contains(&format!("pid {pid}")), "{text}");
    assert!(text.contains(&format!("token:       {token}\n")), "{text}");

    for args in [
        &["--json", "--url", url, "show", &key][..],
        &["--url", url, "show", &key, "--json"][..],
    ] {
        let out = dlock(args, None).await;
        assert_exit(&out, 0, "show --json");
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(doc["key"], key.as_str(), "{doc}");
        assert_eq!(doc["holders"][0]["pid"], std::process::id(), "{doc}");
        assert_eq!(doc["holders"][0]["name"], "cli-test", "{doc}");
        assert_eq!(doc["holders"][0]["token"].to_string(), token, "{doc}");
    }
    let out = dlock(&["list", &prefix, "--url", url, "--json"], None).await;
    assert_exit(&out, 0, "list --json");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let keys: Vec<&str> = doc
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|l| l["key"].as_str())
        .collect();
    assert_eq!(keys, [key.as_str()], "{doc}");

    let refused = dlock(&["--url", url, "revoke", &key], Some("no\n")).await;
    assert_exit(&refused, 1, "revoke answered no");
    assert!(
        stderr(&refused).contains("not revoked"),
        "{}",
        stderr(&refused)
    );
    assert!(
        stderr(&refused).contains(&format!("pid {pid}")),
        "the question names the holder: {}",
        stderr(&refused)
    );
    assert!(!guard.is_lost(), "a refused revoke leaves the holder");
    let still = dlock(&["--url", url, "--json", "show", &key], None).await;
    assert_exit(&still, 0, "show after a refused revoke");
    assert_ne!(stdout(&still).trim(), "null", "still held");

    let revoked = dlock(&["--url", url, "revoke", "--yes", &key, "--json"], None).await;
    assert_exit(&revoked, 0, "revoke --yes");
    let doc: serde_json::Value = serde_json::from_slice(&revoked.stdout).expect("JSON");
    assert_eq!(doc[0]["pid"], std::process::id(), "{doc}");
    assert_eq!(doc[0]["token"].to_string(), token, "{doc}");
    tokio::time::timeout(Duration::from_secs(15), guard.lost())
        .await
        .expect("the revoked holder learns it lost the key");

    let free = dlock(&["--url", url, "show", &key], None).await;
    assert_exit(&free, 0, "show of a free key");
    assert_eq!(stdout(&free), format!("{key}: free\n"));
    let free = dlock(&["--url", url, "show", &key, "--json"], None).await;
    assert_exit(&free, 0, "show --json of a free key");
    assert_eq!(stdout(&free).trim(), "null");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_held_key_on_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    operates_a_held_key(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_answered_from_a_pipe_with_yes_revokes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let registry = registry(&url).await;
    let key = unique_key("piped");
    let guard = hold(&registry, &key).await;
    let out = dlock(&["--url", &url, "revoke", &key], Some("yes\n")).await;
    assert_exit(&out, 0, "revoke with `yes` piped");
    assert!(
        !stderr(&out).contains("changed hands"),
        "the holder asked about is the one revoked: {}",
        stderr(&out)
    );
    assert!(
        stdout(&out).contains(&format!("revoked {key} from cli-test (")),
        "{}",
        stdout(&out)
    );
    tokio::time::timeout(Duration::from_secs(15), guard.lost())
        .await
        .expect("the revoked holder learns it lost the key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_without_an_answer_revokes_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let registry = registry(&url).await;
    let key = unique_key("unanswered");
    let guard = hold(&registry, &key).await;
    let out = dlock(&["--url", &url, "revoke", &key], Some("")).await;
    assert_exit(&out, 1, "revoke with stdin closed");
    assert!(stderr(&out).contains("not revoked"), "{}", stderr(&out));
    assert!(
        registry.inspect(&key).await.expect("inspect").is_some(),
        "still held"
    );
    assert!(!guard.is_lost());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_comes_from_dlock_url_or_the_command_fails_as_a_usage_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    // The applications' database, which the command never makes.
    let _applications = registry(&url).await;
    let out = tokio::task::spawn_blocking(move || {
        Command::new(DLOCK)
            .args(["list"])
            .env("DLOCK_URL", &url)
            .output()
            .expect("dlock runs")
    })
    .await
    .expect("thread");
    assert_exit(&out, 0, "list with DLOCK_URL");
    assert_eq!(stdout(&out), "no held keys\n");

    let out = dlock(&["list"], None).await;
    assert_exit(&out, 2, "list without a URL");
    assert!(stderr(&out).contains("DLOCK_URL"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_fail_without_showing_their_password() {
    for url in [
        "nosuch://admin:s3cretpw@db.example/locks",
        "admin:s3cretpw@db.example:5432/locks",
        "postgres://admin:s3cretpw@127.0.0.1:1/locks",
        "redis://admin:s3cretpw@127.0.0.1:1/",
        "mysql://admin:s3cretpw@127.0.0.1:1/locks",
    ] {
        let out = dlock(&["--url", url, "--timeout", "10s", "list"], None).await;
        assert_exit(&out, 1, url);
        let all = format!("{}{}", stdout(&out), stderr(&out));
        assert!(all.starts_with("dlock: error: "), "{url}: {all}");
        assert!(
            !all.contains("s3cretpw"),
            "{url}: the password is shown: {all}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_fails_within_the_timeout() {
    // Accepts connections (the kernel's backlog) and never says a word.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    for url in [
        format!("redis://127.0.0.1:{port}/"),
        format!("postgres://u:s3cretpw@127.0.0.1:{port}/db"),
    ] {
        let started = Instant::now();
        let out = dlock(&["--url", &url, "--timeout", "2s", "list"], None).await;
        let took = started.elapsed();
        assert_exit(&out, 1, &url);
        assert!(took < Duration::from_secs(8), "{url}: took {took:?}");
        assert!(!stderr(&out).contains("s3cretpw"), "{}", stderr(&out));
    }
    drop(silent);
}

/// tmux on a socket of this test's own, killed on drop.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux runs")
    }

    fn capture(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "watch"]).stdout)
            .into_owned()
    }

    /// Polls the pane until `pred` holds, for up to `within`.
    fn wait_for(&self, within: Duration, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        loop {
            let screen = self.capture();
            if pred(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "{what}; the pane shows:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

fn tmux_available() -> bool {
    let found = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "tmux is missing (scripts/servers.sh installs it)"
        );
        eprintln!("tmux is missing: run scripts/servers.sh to install it; not tested here");
    }
    found
}

fn write_script(path: &Path, text: &str) {
    std::fs::write(path, text).expect("script written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_redraws_in_a_terminal_and_quits_on_ctrl_c() {
    if !tmux_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let registry = registry(&url).await;
    let status = dir.path().join("status");
    let script = dir.path().join("watch.sh");
    write_script(
        &script,
        &format!(
            "'{DLOCK}' --url '{url}' watch cli-test: --interval 200ms\necho $? > '{}'\nsleep 60\n",
            status.display()
        ),
    );
    let tmux = Tmux {
        socket: format!("dlock-cli-test-{}", std::process::id()),
    };
    let script_arg = format!("bash '{}'", script.display());
    let started = tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "watch",
        "-x",
        "120",
        "-y",
        "30",
        &script_arg,
    ]);
    assert!(started.status.success(), "tmux new-session: {started:?}");

    let tmux_ref = &tmux;
    tokio::task::block_in_place(|| {
        tmux_ref.wait_for(Duration::from_secs(20), "watch draws its frame", |s| {
            s.contains("dlock watch") && s.contains("no held keys")
        })
    });
    let key = unique_key("watched");
    let guard = hold(&registry, &key).await;
    let token = guard.fencing_token().expect("fenced").get().to_string();
    let pid = format!("pid {}", std::process::id());
    let screen = tokio::task::block_in_place(|| {
        tmux_ref.wait_for(Duration::from_secs(20), "the held key shows", |s| {
            s.contains(&key)
        })
    });
    let row = screen
        .lines()
        .find(|l| l.starts_with(&key))
        .expect("the key's row");
    assert!(row.contains(&pid), "{row}");
    assert!(row.split_whitespace().any(|c| c == token), "{row}");
    assert!(
        screen.lines().any(|l| l.starts_with("KEY ")),
        "the table's header:\n{screen}"
    );
    guard.release().await.expect("released");
    tokio::task::block_in_place(|| {
        tmux_ref.wait_for(Duration::from_secs(20), "the released key goes", |s| {
            !s.contains(&key) && s.contains("no held keys")
        })
    });

    let sent = tmux.run(&["send-keys", "-t", "watch", "C-c"]);
    assert!(sent.status.success(), "send-keys: {sent:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !status.exists() {
        assert!(Instant::now() < deadline, "watch did not quit on Ctrl-C");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let code = std::fs::read_to_string(&status).expect("status");
    assert_eq!(code.trim(), "0", "watch's exit code after Ctrl-C");
    let modes = tmux.run(&[
        "display-message",
        "-p",
        "-t",
        "watch",
        "#{alternate_on} #{cursor_flag}",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&modes.stdout).trim(),
        "0 1",
        "the terminal is restored: main screen, cursor shown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_held_key_on_redis() {
    operates_a_held_key(&server_url(
        "DLOCK_TEST_REDIS_URL",
        "redis://127.0.0.1:46379/",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_held_key_on_postgres() {
    operates_a_held_key(&server_url(
        "DLOCK_TEST_POSTGRES_URL",
        "postgres://dlock:dlock@127.0.0.1:45432/dlock",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_held_key_on_mysql() {
    operates_a_held_key(&server_url(
        "DLOCK_TEST_MYSQL_URL",
        "mysql://dlock:dlock@127.0.0.1:43306/dlock",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_held_key_on_zookeeper() {
    operates_a_held_key(&server_url(
        "DLOCK_TEST_ZK_URL",
        "zk://127.0.0.1:42181/dlock-test",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_held_key_on_etcd() {
    operates_a_held_key(&server_url(
        "DLOCK_TEST_ETCD_URL",
        "etcd://127.0.0.1:42379,127.0.0.1:42389,127.0.0.1:42399/dlock-test",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_ends_on_sigterm_with_the_terminal_restored() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let _applications = registry(&url).await;
    let out = tokio::task::spawn_blocking(move || {
        let child = Command::new(DLOCK)
            .args(["--url", &url, "watch", "--interval", "100ms"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dlock watch starts");
        std::thread::sleep(Duration::from_secs(2));
        let killed = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(killed.success());
        child.wait_with_output().expect("watch ends")
    })
    .await
    .expect("thread");
    assert_exit(&out, 0, "watch after SIGTERM");
    let text = stdout(&out);
    assert!(text.starts_with("\x1b[?1049h\x1b[?25l"), "{text:?}");
    assert!(text.contains("no held keys"), "{text:?}");
    assert!(
        text.ends_with("\x1b[?25h\x1b[?1049l"),
        "the terminal is restored: {text:?}"
    );
}

/// A misspelt lock table or SQLite path is an error (exit 1) naming it,
/// never created and shown as "no held keys": the command reads the tables
/// the applications made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelt_table_or_database_is_an_error_and_never_created() {
    let mysql = server_url(
        "DLOCK_TEST_MYSQL_URL",
        "mysql://dlock:dlock@127.0.0.1:43306/dlock",
    );
    // With the test servers' password (`dlock`, also the user and database
    // name the message shows) in it: the name is shown whole.
    let table = format!("dlock_misspelt_{}", std::process::id());
    let url = format!("{mysql}?table={table}");
    for command in [&["list"][..], &["show", "k"], &["revoke", "--yes", "k"]] {
        let out = dlock(&[&["--url", url.as_str()][..], command].concat(), None).await;
        assert_exit(&out, 1, &format!("{command:?} on a missing table"));
        let err = stderr(&out);
        assert!(err.contains(&format!("`{table}`")), "{err}");
        assert!(err.contains("create=true"), "{err}");
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("misspelt").join("locks.db");
    let url = format!("sqlite://{}", file.display());
    for command in [&["list"][..], &["show", "k"]] {
        let out = dlock(&[&["--url", url.as_str()][..], command].concat(), None).await;
        assert_exit(&out, 1, &format!("{command:?} on a missing SQLite file"));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("no SQLite lock database at `{}`", file.display())),
            "{err}"
        );
    }
    assert!(!dir.path().join("misspelt").exists(), "nothing created");
}

/// Permits and readers of one key, on MySQL and SQLite: `show` and `list`
/// name every holder, `--json` gives each its slot or reader flag, and a
/// revocation answers them all.
async fn shows_every_holder_of_a_shared_key(url: &str) {
    let registry = registry(url).await;
    let sem = unique_key("permits");
    let rw = format!("{sem}:rw");
    let hold_as =
        |key: String, lock: fn(dlock_runtime::LockBuilder) -> dlock_runtime::LockBuilder| {
            let registry = registry.clone();
            async move {
                lock(registry.lock(key).lease(Duration::from_secs(3)))
                    .acquire()
                    .await
                    .expect("acquire")
            }
        };
    let p1 = hold_as(sem.clone(), |l| l.permits(3)).await;
    let p2 = hold_as(sem.clone(), |l| l.permits(3)).await;
    let r1 = hold_as(rw.clone(), |l| l.read()).await;
    let r2 = hold_as(rw.clone(), |l| l.read()).await;
    let out = dlock(&["--url", url, "show", &sem, "--json"], None).await;
    assert_exit(&out, 0, "show --json");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let slots: Vec<_> = doc["holders"]
        .as_array()
        .expect("holders")
        .iter()
        .map(|h| {
            (
                h["slot"].as_u64(),
                h["reader"].as_bool(),
                h["name"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        slots,
        [
            (Some(0), Some(false), Some("cli-test")),
            (Some(1), Some(false), Some("cli-test"))
        ],
        "{doc}"
    );
    let prefix = sem.rsplit_once(':').expect("key has a suffix").0.to_owned();
    let out = dlock(&["--url", url, "list", &prefix, "--json"], None).await;
    assert_exit(&out, 0, "list --json");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let listed: Vec<_> = doc
        .as_array()
        .expect("an array")
        .iter()
        .map(|k| {
            let readers = k["holders"]
                .as_array()
                .expect("holders")
                .iter()
                .filter(|h| h["reader"] == true)
                .count();
            (k["key"].as_str().map(str::to_owned), readers)
        })
        .collect();
    assert_eq!(
        listed,
        [(Some(sem.clone()), 0), (Some(rw.clone()), 2)],
        "{doc}"
    );
    let out = dlock(&["--url", url, "show", &rw], None).await;
    assert_exit(&out, 0, "show");
    let pid = format!("pid {}", std::process::id());
    assert_eq!(stdout(&out).matches(&pid).count(), 2, "{}", stdout(&out));
    let out = dlock(&["--url", url, "revoke", &sem, "--json"], Some("y\n")).await;
    assert_exit(&out, 0, "revoke");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(doc.as_array().map(Vec::len), Some(2), "{doc}");
    assert!(
        !stderr(&out).contains("changed hands"),
        "the holders asked about are the ones revoked: {}",
        stderr(&out)
    );
    for guard in [&p1, &p2] {
        tokio::time::timeout(Duration::from_secs(15), guard.lost())
            .await
            .expect("a revoked permit learns it lost the key");
    }
    r1.release().await.expect("release");
    r2.release().await.expect("release");
    let out = dlock(&["--url", url, "list", &prefix], None).await;
    assert_exit(&out, 0, "list");
    assert_eq!(stdout(&out), format!("no held keys under `{prefix}`\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shows_every_holder_of_a_shared_key_on_mysql() {
    shows_every_holder_of_a_shared_key(&server_url(
        "DLOCK_TEST_MYSQL_URL",
        "mysql://dlock:dlock@127.0.0.1:43306/dlock",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shows_every_holder_of_a_shared_key_on_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    shows_every_holder_of_a_shared_key(&url).await;
}
