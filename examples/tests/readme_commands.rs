//! The README's example commands, run as a newcomer runs them: each example
//! binary (built by `cargo test` beside this test) on the embedded SQLite
//! default, judged by its own verdict (exit code 0).

use std::path::PathBuf;
use std::process::Command;

/// An example's binary: `target/<profile>/examples/<name>`, next to this
/// test's own `target/<profile>/deps/` directory.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    profile.join("examples").join(name)
}

fn run(name: &str, args: &[&str]) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("readme-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test dir");
    let url = format!("sqlite://{}", dir.join("locks.db").display());
    let out = Command::new(example(name))
        .args(args)
        .env("DLOCK_URL", &url)
        .env_remove("RUST_LOG")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "run the {name} example: {e} (`cargo test` builds the examples unless a \
                 target is chosen: run `cargo build --examples` first with `--test`)"
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{name} {args:?}: {}\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("PASS"), "{name}: no verdict:\n{stdout}");
}

#[test]
fn quickstart_passes() {
    run("quickstart", &[]);
}

#[test]
fn axum_handler_self_test_passes() {
    run("axum_handler", &["--self-test"]);
}
