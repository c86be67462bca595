#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", fencing = false, fencing = true)]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
