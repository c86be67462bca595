#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "account:{self.id}")]
pub async fn balance(id: u64) -> Option<u64> {
    Some(id)
}

fn main() {}
