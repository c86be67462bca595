#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(wait = "1s")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
