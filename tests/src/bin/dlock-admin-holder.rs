//! A process that holds one key until told to let go, for tests that read
//! another process's grant (`Registry::inspect`, `list`, `revoke`).
//!
//! ```text
//! dlock-admin-holder <url> <key>
//! ```
//!
//! Connects (the holder name comes from `DLOCK_HOLDER`, if set), takes `key`
//! with a 10 s lease under the watchdog, prints `held <token>`, then waits for
//! a line (or the end) on stdin, or for the lease to be lost; prints
//! `released` or `lost` and exits. Errors go to stderr with exit status 1.

use std::io::BufRead as _;
use std::time::Duration;

use dlock_runtime::Registry;

fn fail(message: &str) -> ! {
    eprintln!("dlock-admin-holder: {message}");
    std::process::exit(1)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(url), Some(key)) = (args.get(1), args.get(2)) else {
        fail("usage: dlock-admin-holder <url> <key>")
    };
    let registry = Registry::from_url(url)
        .await
        .unwrap_or_else(|e| fail(&format!("connect: {e}")));
    let guard = registry
        .lock(key.as_str())
        .lease(Duration::from_secs(10))
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap_or_else(|e| fail(&format!("acquire: {e}")));
    println!("held {}", guard.fencing_token().map_or(0, u64::from));
    let stdin = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
    });
    tokio::select! {
        _ = stdin => {
            guard.release().await.unwrap_or_else(|e| fail(&format!("release: {e}")));
            println!("released");
        }
        _ = guard.lost() => println!("lost"),
    }
}
