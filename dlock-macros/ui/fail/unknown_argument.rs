#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", timeout = "3s")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
