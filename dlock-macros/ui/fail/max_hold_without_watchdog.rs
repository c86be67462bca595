#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", watchdog = false, max_hold = "1m")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
