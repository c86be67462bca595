#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "order:{}")]
pub async fn pay(order: u64) -> Option<u64> {
    Some(order)
}

fn main() {}
