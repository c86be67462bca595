#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k")]
pub async fn f() -> impl std::fmt::Display {
    1
}

fn main() {}
