// `on_busy = "skip"` with every return type that can express "skipped".
use dlock_runtime::{LockError, distributed_lock};

#[derive(Debug)]
pub struct AppError(LockError);

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError(e)
    }
}

#[distributed_lock(key = "report:nightly", on_busy = "skip", hold_at_least = "5m")]
pub async fn report() -> Result<(), AppError> {
    Ok(())
}

#[distributed_lock(key = "report:{day}", on_busy = "skip")]
pub async fn report_for(day: u32) -> Result<Option<u32>, AppError> {
    Ok(Some(day))
}

#[distributed_lock(key = "report:{day}:anyhow", on_busy = "skip")]
pub async fn report_anyhow(day: u32) -> anyhow::Result<()> {
    let _ = day;
    Ok(())
}

#[distributed_lock(key = "sweep", on_busy = "skip", wait = "0s")]
pub async fn sweep() -> Option<usize> {
    Some(3)
}

#[distributed_lock(key = "tick", on_busy = "skip")]
pub async fn tick() {}

#[tokio::main]
async fn main() {
    // Before `init` the error is not "busy", so it is reported, not skipped.
    assert!(matches!(
        report().await,
        Err(AppError(LockError::NotInitialized))
    ));
    assert!(matches!(
        report_for(1).await,
        Err(AppError(LockError::NotInitialized))
    ));
    assert!(report_anyhow(1).await.is_err());
    assert_eq!(sweep().await, None);
    tick().await;
}
