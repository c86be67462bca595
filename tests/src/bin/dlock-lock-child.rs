//! A process that locks, for tests and benchmarks that need several
//! processes (the table-creation race, cross-process handoff).
//!
//! ```text
//! dlock-lock-child race    <url> <key> <start_at_unix_ms>
//! dlock-lock-child handoff <url> <key> <tasks> <rounds> <start_at_unix_ms>
//! ```
//!
//! `race` connects at `start_at` (so that all children open the backend at
//! once), takes `key` once and prints `token <n>`. `handoff` opens `tasks`
//! connections (a warm-up), then at `start_at` runs `tasks` tasks that each
//! take `key` `rounds` times, releasing it at once, and prints
//! `hold <acquired_unix_ns> <released_unix_ns>` per hold. Errors go to
//! stderr with exit status 1.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dlock_runtime::Registry;

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos()
}

async fn sleep_until_unix_ms(at: u128) {
    let now = unix_ns() / 1_000_000;
    if at > now {
        tokio::time::sleep(Duration::from_millis((at - now) as u64)).await;
    }
}

fn arg(args: &[String], i: usize, what: &str) -> String {
    args.get(i)
        .cloned()
        .unwrap_or_else(|| fail(&format!("missing argument {i}: {what}")))
}

fn fail(message: &str) -> ! {
    eprintln!("dlock-lock-child: {message}");
    std::process::exit(1)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let number = |i: usize, what: &str| -> u128 {
        arg(&args, i, what)
            .parse()
            .unwrap_or_else(|e| fail(&format!("bad {what}: {e}")))
    };
    match arg(&args, 1, "mode").as_str() {
        "race" => {
            let (url, key) = (arg(&args, 2, "url"), arg(&args, 3, "key"));
            sleep_until_unix_ms(number(4, "start_at")).await;
            let registry = Registry::from_url(&url)
                .await
                .unwrap_or_else(|e| fail(&format!("connect: {e}")));
            let guard = registry
                .lock(&key)
                .wait(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap_or_else(|e| fail(&format!("acquire: {e}")));
            let token = guard.fencing_token().map_or(0, u64::from);
            guard
                .release()
                .await
                .unwrap_or_else(|e| fail(&format!("release: {e}")));
            println!("token {token}");
        }
        "handoff" => {
            let (url, key) = (arg(&args, 2, "url"), arg(&args, 3, "key"));
            let (tasks, rounds) = (number(4, "tasks"), number(5, "rounds"));
            let registry = Registry::from_url(&url)
                .await
                .unwrap_or_else(|e| fail(&format!("connect: {e}")));
            // Warm up: as many connections open as there will be tasks, so
            // that the convoy measures handoffs, not connection set-ups.
            let warm: Vec<_> = (0..tasks)
                .map(|t| {
                    let (registry, key) = (
                        registry.clone(),
                        format!("{key}:warm-up:{}:{t}", std::process::id()),
                    );
                    tokio::spawn(async move {
                        let guard = registry
                            .lock(&key)
                            .acquire()
                            .await
                            .unwrap_or_else(|e| fail(&format!("warm-up: {e}")));
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        guard
                            .release()
                            .await
                            .unwrap_or_else(|e| fail(&format!("warm-up: {e}")));
                    })
                })
                .collect();
            for w in warm {
                w.await.unwrap_or_else(|e| fail(&e.to_string()));
            }
            sleep_until_unix_ms(number(6, "start_at")).await;
            let workers: Vec<_> = (0..tasks)
                .map(|_| {
                    let (registry, key) = (registry.clone(), key.clone());
                    tokio::spawn(async move {
                        let mut holds = Vec::new();
                        for _ in 0..rounds {
                            let guard = registry
                                .lock(&key)
                                .wait(Duration::from_secs(120))
                                .lease(Duration::from_secs(10))
                                .acquire()
                                .await
                                .unwrap_or_else(|e| fail(&format!("acquire: {e}")));
                            let acquired = unix_ns();
                            let released = unix_ns();
                            guard
                                .release()
                                .await
                                .unwrap_or_else(|e| fail(&format!("release: {e}")));
                            holds.push((acquired, released));
                        }
                        holds
                    })
                })
                .collect();
            for worker in workers {
                for (acquired, released) in worker.await.unwrap_or_else(|e| fail(&e.to_string())) {
                    println!("hold {acquired} {released}");
                }
            }
        }
        other => fail(&format!("unknown mode `{other}`")),
    }
}
