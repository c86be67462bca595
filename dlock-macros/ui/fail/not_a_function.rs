#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "k")]
pub struct Job;

fn main() {}
