#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", wait = "3 seconds x")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
