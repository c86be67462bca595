#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k")]
pub const fn f() -> Option<()> {
    Some(())
}

fn main() {}
