#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", wait)]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
