#![allow(dead_code)]

use dlock_runtime::distributed_lock;

const PAYMENT_SLOTS: u32 = 3;

#[distributed_lock(key = "k", permits = PAYMENT_SLOTS)]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
