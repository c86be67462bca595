#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "order:{x}")]
pub async fn pay(order_id: u64, amount: u64) -> Option<u64> {
    Some(order_id + amount)
}

fn main() {}
