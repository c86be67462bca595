#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "acct:{from}", keys = ["acct:{from}", "acct:{to}"])]
pub async fn transfer(from: u32, to: u32) -> Option<()> {
    Some(())
}

fn main() {}
