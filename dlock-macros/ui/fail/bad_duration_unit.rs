#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", lease = "2 weeks")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
