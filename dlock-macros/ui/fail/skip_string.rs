#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", on_busy = "skip")]
pub async fn f() -> String {
    String::new()
}

fn main() {}
