//! A process that takes one ZooKeeper lock and keeps it until it is killed,
//! for the tests where another library takes over from a crashed holder.
//!
//! ```text
//! dlock-zk-holder <url> <key>
//! ```
//!
//! Prints `held <token>` once it holds `key`, then sleeps (its watchdog
//! renewing the lease) until killed. Errors go to stderr with exit status 1.

use std::time::Duration;

use dlock_runtime::Registry;

fn fail(message: &str) -> ! {
    eprintln!("dlock-zk-holder: {message}");
    std::process::exit(1)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(url), Some(key)) = (args.get(1), args.get(2)) else {
        fail("usage: dlock-zk-holder <url> <key>");
    };
    let registry = Registry::from_url(url)
        .await
        .unwrap_or_else(|e| fail(&format!("connect: {e}")));
    let guard = registry
        .lock(key)
        .wait(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap_or_else(|e| fail(&format!("acquire: {e}")));
    println!("held {}", guard.fencing_token().map_or(0, u64::from));
    loop {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
}
