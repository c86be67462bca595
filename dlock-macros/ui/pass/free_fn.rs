// A free `pub async fn` returning `Result<T, E>` with `E: From<LockError>`.
use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub enum AppError {
    Lock(LockError),
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}

pub struct Order {
    pub id: u64,
}

#[derive(Debug)]
pub struct Receipt {
    pub order: u64,
}

/// Doc comments and other attributes are kept.
#[must_use = "the receipt tells whether the payment went through"]
#[distributed_lock(key = "order:{order.id}", wait = "3s", lease = "10s")]
pub async fn pay(order: &Order) -> Result<Receipt, AppError> {
    Ok(Receipt { order: order.id })
}

#[distributed_lock(key = "jobs:nightly", wait = "250ms", lease = "1m 30s")]
pub(crate) async fn no_args() -> Result<(), AppError> {
    Ok(())
}

#[tokio::main]
async fn main() {
    let r = pay(&Order { id: 42 }).await;
    assert!(
        matches!(r, Err(AppError::Lock(LockError::NotInitialized))),
        "{r:?}"
    );
    let r = no_args().await;
    assert!(
        matches!(r, Err(AppError::Lock(LockError::NotInitialized))),
        "{r:?}"
    );
}
