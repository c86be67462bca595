#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(keys = ["acct:{from}", "acct:{too}"])]
pub async fn transfer(from: u32, to: u32) -> Option<()> {
    Some(())
}

fn main() {}
