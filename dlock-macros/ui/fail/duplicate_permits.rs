#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", permits = 3, permits = 4)]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
