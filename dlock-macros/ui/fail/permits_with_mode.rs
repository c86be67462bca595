#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", permits = 3, mode = "read")]
pub async fn permits_first() -> Option<()> {
    Some(())
}

#[distributed_lock(mode = "write", keys = ["a", "b"], permits = 2)]
pub async fn mode_first() -> Option<()> {
    Some(())
}

fn main() {}
