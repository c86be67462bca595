#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k")]
pub async fn f() -> String {
    String::new()
}

fn main() {}
