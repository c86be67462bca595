#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k", hold_at_least = "18446744073709551615s 1s")]
pub async fn f() -> Option<()> {
    Some(())
}

fn main() {}
