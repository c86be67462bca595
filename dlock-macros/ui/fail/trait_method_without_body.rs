#![allow(dead_code)]

use dlock_runtime::distributed_lock;

pub trait Job {
    #[distributed_lock(key = "k")]
    async fn run(&self) -> Option<()>;
}

fn main() {}
