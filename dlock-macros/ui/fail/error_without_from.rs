#![allow(dead_code)]

use dlock_runtime::distributed_lock;

#[derive(Debug)]
pub struct AppError;

#[distributed_lock(key = "k")]
pub async fn f() -> Result<(), AppError> {
    Ok(())
}

fn main() {}
