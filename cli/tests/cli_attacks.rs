//! The `dlock` binary given hostile input: passwords the URL parser cannot
//! place (an unencoded `/`, `#` or `?`) never appear in its output, and a
//! server of any kind that accepts connections but never answers ends the
//! command within the default timeout.

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

/// Runs `dlock` with `args` (no `DLOCK_URL` from the environment, standard
/// input closed), off the async runtime.
fn dlock(args: &[&str]) -> Output {
    Command::new(DLOCK)
        .args(args)
        .env_remove("DLOCK_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("the dlock binary runs")
}

fn all_output(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A password with a character that ends the URL's authority (`/`, `#`,
/// `?`) written unencoded: the command fails, and no part of the password
/// after the user name is printed.
#[test]
fn passwords_with_reserved_characters_are_never_shown() {
    for (url, password) in [
        ("postgres://admin:se/cretpw@127.0.0.1:1/locks", "se/cretpw"),
        ("postgres://admin:se#cretpw@127.0.0.1:1/locks", "se#cretpw"),
        ("postgres://admin:se?cretpw@127.0.0.1:1/locks", "se?cretpw"),
        ("mysql://admin:se/cretpw@127.0.0.1:1/locks", "se/cretpw"),
        ("mysql://admin:se?cretpw@127.0.0.1:1/locks", "se?cretpw"),
        ("redis://admin:se#cretpw@127.0.0.1:1/", "se#cretpw"),
        ("redis://admin:se/cretpw@127.0.0.1:1/", "se/cretpw"),
        ("etcd://admin:se/cretpw@127.0.0.1:1/p", "se/cretpw"),
        ("zk://admin:se/cretpw@127.0.0.1:1/p", "se/cretpw"),
    ] {
        for command in [&["list"][..], &["show", "k"], &["revoke", "k", "--yes"]] {
            let mut args = vec!["--url", url, "--timeout", "3s"];
            args.extend_from_slice(command);
            let out = dlock(&args);
            let all = all_output(&out);
            assert_eq!(out.status.code(), Some(1), "{url} {command:?}: {all}");
            assert!(
                !all.contains(password) && !all.contains("cretpw"),
                "{url} {command:?}: the password is shown: {all}"
            );
        }
    }
}

/// A server of each kind that accepts connections and never answers: the
/// command fails within a few seconds under the default timeout.
#[test]
fn a_silent_server_of_any_kind_fails_within_the_default_timeout() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    for url in [
        format!("redis://127.0.0.1:{port}/"),
        format!("rediss://127.0.0.1:{port}/"),
        format!("redis+cluster://127.0.0.1:{port}"),
        format!("redis+sentinel://127.0.0.1:{port}/primary"),
        format!("redlock://127.0.0.1:{port},127.0.0.1:{port},127.0.0.1:{port}"),
        format!("postgres://u:s3cretpw@127.0.0.1:{port}/db"),
        format!("mysql://u:s3cretpw@127.0.0.1:{port}/db"),
        format!("zk://127.0.0.1:{port}/p"),
        format!("etcd://u:s3cretpw@127.0.0.1:{port}/p"),
    ] {
        let started = Instant::now();
        let out = dlock(&["--url", &url, "show", "k"]);
        let took = started.elapsed();
        let all = all_output(&out);
        assert_eq!(out.status.code(), Some(1), "{url}: {all}");
        assert!(took < Duration::from_secs(10), "{url}: took {took:?}");
        assert!(!all.contains("s3cretpw"), "{url}: {all}");
    }
    drop(silent);
}
