#![allow(dead_code)]

use dlock_runtime::distributed_lock;

pub struct Order {
    pub id: u64,
}

#[distributed_lock(key = "order:{order.number}")]
pub async fn pay(order: &Order) -> Option<u64> {
    Some(order.id)
}

fn main() {}
