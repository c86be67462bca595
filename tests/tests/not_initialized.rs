//! Before `init`, locks are a typed error through every path — never a panic.

use dlock_runtime::{LockError, distributed_lock, lock};

#[derive(Debug)]
struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

#[distributed_lock(key = "job")]
async fn job() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "job", on_busy = "skip")]
async fn optional_job() -> Option<u32> {
    Some(1)
}

#[tokio::test]
async fn everything_reports_not_initialized() {
    assert!(matches!(
        job().await,
        Err(AppError(LockError::NotInitialized))
    ));
    assert_eq!(optional_job().await, None);
    assert!(matches!(
        lock("job").acquire().await,
        Err(LockError::NotInitialized)
    ));
    assert!(dlock_runtime::current().is_none());
    assert!(dlock_runtime::global().is_none());
    let io: std::io::Error = LockError::NotInitialized.into();
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
}
