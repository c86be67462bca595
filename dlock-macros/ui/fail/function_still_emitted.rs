#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", wait = "nope")]
pub async fn f() -> Option<u32> {
    Some(1)
}

// Only the attribute's error is reported: `f` still exists with its signature.
pub async fn g() -> Option<u32> {
    let x: Option<u32> = f().await;
    x
}

fn main() {}
