#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", fencing = "off")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
