// `impl Trait` in the return type: the concrete type must still be a
// `Result`/`Option`/`()` the runtime can report through.
use std::fmt::Display;

use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

#[distributed_lock(key = "render:{id}")]
pub async fn render(id: u32) -> Option<impl Display> {
    Some(format!("#{id}"))
}

#[distributed_lock(key = "render2:{id}")]
pub async fn render_result(id: u32) -> Result<impl Display + use<>, AppError> {
    Ok(id * 2)
}

#[distributed_lock(key = "iter")]
pub async fn iter() -> Option<impl Iterator<Item = u8>> {
    Some(vec![1u8, 2].into_iter())
}

#[tokio::main]
async fn main() {
    assert!(render(1).await.is_none());
    assert!(matches!(
        render_result(1).await,
        Err(AppError(LockError::NotInitialized))
    ));
    assert!(iter().await.is_none());
}
