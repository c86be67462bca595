#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(
    key = "order:{nope}:{",
    wait = "soon",
    lease = "0ms",
    on_busy = "maybe",
    on_lost = "ignore",
    timeout = "1s",
    wait = "2s",
    backend = ""
)]
pub fn f(order: u64) -> Option<u64> {
    Some(order)
}

fn main() {}
