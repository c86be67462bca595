#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", mode = "read", mode = "write")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
