#![allow(dead_code)]

// The minimum lease is 100ms (`dlock_runtime::MIN_LEASE`), with or without the
// watchdog; the function is still emitted, so `main` compiles against it.
use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", lease = "50ms")]
pub async fn short() -> Option<()> {
    Some(())
}

#[distributed_lock(key = "k", lease = "99ms", watchdog = false)]
pub async fn short_hard_cap() -> Option<()> {
    Some(())
}

#[distributed_lock(key = "k", lease = "100ms")]
pub async fn shortest() -> Option<()> {
    Some(())
}

fn main() {
    let _ = (short(), short_hard_cap(), shortest());
}
