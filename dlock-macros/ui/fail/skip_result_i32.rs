#![allow(dead_code)]

use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

#[distributed_lock(key = "k", on_busy = "skip")]
pub async fn f() -> Result<i32, AppError> {
    Ok(1)
}

fn main() {}
