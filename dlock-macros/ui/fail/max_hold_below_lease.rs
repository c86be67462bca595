#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", lease = "10s", max_hold = "5s")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
