#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", wait = "1s", wait = "2s")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
