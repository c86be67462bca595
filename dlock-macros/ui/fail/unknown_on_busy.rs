#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", on_busy = "retry")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
